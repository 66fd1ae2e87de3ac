import sys

from kvmiss.enricher.cli import main

sys.exit(main())
