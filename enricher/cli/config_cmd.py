"""`kvmiss config example [NAME]`: print one of the example configurations kvmiss ships.

The examples are the TOML files of the repository's examples/ folder, installed with the
package (pyproject.toml: package ``kvmiss.examples``), so an installed kvmiss prints exactly
what the repository holds. Each kvmiss config passes ``kvmiss serve --check`` once the digest
secret is in ``KVMISS_DIGEST_KEY``::

    kvmiss config example single > kvmiss.toml
    KVMISS_DIGEST_KEY=$(openssl rand -hex 16) kvmiss serve --check --config kvmiss.toml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# name -> (path under examples/, what it is for). The first is the default.
EXAMPLES: dict[str, tuple[str, str]] = {
    "single": ("collector/kvmiss-single.toml",
               "one kvmiss beside one OpenTelemetry Collector (examples/collector/single.yaml)"),
    "replicas": ("collector/kvmiss-replica.toml",
                 "every replica of a scaled-out kvmiss behind the Collector's trace-id load balancer"),
    "fleet": ("kvmiss-fleet.toml", "engines that come and go: the workers from a [fleet] file"),
    "fleet-file": ("fleet.toml", "the [fleet] file the fleet example reads ([[workers]] only, not a kvmiss config)"),
    "full": ("kvmiss.toml", "every key, with its default and what it does"),
    "rotel": ("rotel/kvmiss.toml", "kvmiss behind rotel, exporting straight to Tempo or Jaeger"),
    "vllm": ("vllm-cpu/kvmiss.toml", "one local vLLM engine with the kvmiss plugin, enriched spans to a file"),
}
DEFAULT = next(iter(EXAMPLES))
# Not a kvmiss config: `kvmiss serve --check` does not apply to it.
FLEET_FILES = {"fleet-file"}


# Shown under `kvmiss config --help`: what it reads, in one schema line, and one example.
HELP_INPUT = f"""\
input:    none: the example configurations installed with kvmiss ({', '.join(EXAMPLES)});
          each kvmiss config reads its digest secret from KVMISS_DIGEST_KEY
example:  kvmiss config example single > kvmiss.toml
          kvmiss config example | KVMISS_DIGEST_KEY=$(openssl rand -hex 16) kvmiss serve --check --config -
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="config_action", required=True, metavar="ACTION")
    example = actions.add_parser(
        "example", help="print an example configuration", description="print an example configuration: "
        + "; ".join(f"{name}: {what}" for name, (_, what) in EXAMPLES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=HELP_INPUT)
    example.add_argument("name", nargs="?", default=DEFAULT, choices=list(EXAMPLES), metavar="NAME",
                         help=f"one of {', '.join(EXAMPLES)} (default {DEFAULT})")
    example.add_argument("--list", action="store_true", help="list the examples, one per line, and exit")


def examples_dir() -> Path:
    """Where the example files are. pyproject.toml installs examples/ as ``kvmiss/examples``
    beside ``kvmiss/enricher``; an editable install or a checkout has examples/ beside
    enricher/ -- the same place relative to this package either way."""
    import kvmiss.enricher

    return Path(kvmiss.enricher.__file__).resolve().parent.parent / "examples"


def example_text(name: str) -> str:
    return (examples_dir() / EXAMPLES[name][0]).read_text(encoding="utf-8")


def run(args: argparse.Namespace) -> int:
    if args.list:
        width = max(map(len, EXAMPLES))
        for name, (path, what) in EXAMPLES.items():
            print(f"{name:<{width}}  examples/{path}: {what}")
        return 0
    try:
        text = example_text(args.name)
    except OSError as exc:  # an install that left the package data out
        print(f"kvmiss config: example {args.name!r} is not installed ({examples_dir()}): {exc.strerror}",
              file=sys.stderr)
        return 1
    sys.stdout.write(text)
    return 0
