"""`kvmiss demo`: run a simulated vLLM fleet through the real pipeline and show why requests missed.

No external services: simulated workers publish real vLLM-format KV events on loopback
ZeroMQ sockets; `kvmiss serve` runs in-process (collector, index, OTLP receivers, file
export); every finished request is sent as router and engine spans with the OTel SDK's
OTLP exporters, and the labels kvmiss writes on them are read back from the exported file
and checked against the simulator's ground truth. Writes an HTML report with PNG charts.
Progress goes to stderr; the summary to stdout (``--json``: one JSON object on stdout, the
human summary on stderr). Exit status 1 when any verdict named a wrong cause or a request
never came back enriched.
"""

from __future__ import annotations

import argparse
import json
import sys

# Shown under `kvmiss demo --help`: what it reads, in one schema line, and one example.
HELP_INPUT = """\
input:    none: a simulated fleet and workload built in (shaped by the flags below)
example:  kvmiss demo --requests 600 --seed 7 --out ./kvmiss-demo-out
"""

def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvmiss.enricher.demo.faults import FAULTS

    parser.add_argument("--requests", type=int, default=600, help="requests to run (default 600)")
    parser.add_argument("--workers", type=int, default=4, help="simulated workers (default 4)")
    parser.add_argument("--seed", type=int, default=7, help="workload and routing seed (default 7)")
    parser.add_argument("--faults", default="all",
                        help=f"comma list of {', '.join(FAULTS)}; or all / none (default all)")
    parser.add_argument("--out", default="./kvmiss-demo-out",
                        help="directory for the enriched spans, records, kvmiss.toml and the report "
                             "(default ./kvmiss-demo-out)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def run(args: argparse.Namespace) -> int:
    from kvmiss.enricher.demo.faults import parse_faults
    from kvmiss.enricher.demo.run import DemoOptions, run_demo

    try:
        faults = parse_faults(args.faults)
    except ValueError as exc:
        print(f"kvmiss demo: --faults: {exc}", file=sys.stderr)
        return 2
    if args.requests < 1 or args.workers < 1:
        print("kvmiss demo: --requests and --workers must be at least 1", file=sys.stderr)
        return 2
    options = DemoOptions(requests=args.requests, workers=args.workers, seed=args.seed,
                          faults=faults, out=args.out)
    summary, report = run_demo(options, log=sys.stderr)
    human = report.render(summary)
    if args.json:
        print(human, file=sys.stderr)
        print(json.dumps(summary))
    else:
        print(human)
    return 1 if summary["wrong_verdicts"] or summary["not_read_back"] else 0
