"""The `kvmiss` command line. Each subcommand lives in its own module and registers itself
through `SUBCOMMANDS`; the modules keep their imports lazy so `kvmiss --help` stays fast."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module under kvmiss.enricher.cli, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "decode": ("decode_cmd", "decode KV-event messages: base64 frames as JSON lines on stdin, or a recording (--recording)"),
    "hash": ("hash_cmd", "vLLM-compatible block hashes for one request (a JSON object on stdin)"),
    "attribute": ("attribute_cmd", "offline attribution: a KV-event recording + request records"),
    "serve": ("serve_cmd", "run the enricher: KV-event collectors, residency index, OTLP in and out, metrics"),
    "compare": ("compare_cmd", "where two prompt renderings stop sharing cached blocks (for CI)"),
    "collect": ("collect_cmd", "subscribe to the configured workers' KV events; record them and report stream health"),
    "replay-size": ("replay_size_cmd", "minimum replay window (batches) for a peak rate and outage"),
    "demo": ("demo_cmd", "run a simulated vLLM fleet through the real pipeline and show why requests missed"),
    "whatif": ("whatif_cmd", "what-if cache sizing: the hit ratio a larger pool would have given (an estimate)"),
    "requests": ("requests_cmd", "request records (for attribute and whatif) from spans in OTLP/JSON files"),
    "report": ("report_cmd", "render the HTML report from attribution records or enriched OTLP-JSON spans"),
    "status": ("status_cmd", "ask a running kvmiss serve: ready or not, and each worker's stream and why not"),
    "config": ("config_cmd", "example configurations shipped with kvmiss (kvmiss config example [NAME])"),
    "fleet-sync": ("fleet_sync_cmd", "keep a [fleet] file equal to a Kubernetes Service's ready endpoints (a sidecar)"),
}


def version_text() -> str:
    """``kvmiss 0.2.0`` and which compiled parts this install has (each is optional at build)."""
    from kvmiss.collectors.frames import READER_COMPILED
    from kvmiss.enricher import __version__
    from kvmiss.enricher.core.residency_table import ACCELERATED
    from kvmiss.enricher.otlp.spans import WIRE_SCAN

    parts = {"residency table": ACCELERATED, "OTLP wire path": WIRE_SCAN, "KV-event reader": READER_COMPILED}
    compiled = ", ".join(f"{name} {'compiled' if on else 'pure Python'}" for name, on in parts.items())
    return f"kvmiss {__version__} (Python {sys.version.split()[0]}; {compiled})"


class _VersionAction(argparse.Action):
    # argparse's own "version" action takes a fixed string; this one imports the compiled
    # parts only when asked, so `kvmiss --help` stays fast.
    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmiss",
        description="Explain why each LLM request missed the prefix cache.",
    )
    parser.add_argument("--version", action=_VersionAction,
                        help="print the version and which compiled parts are present, and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        mod = importlib.import_module(f"{__name__}.{module}")
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=mod.HELP_INPUT,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except BrokenPipeError:  # `kvmiss decode | head` is normal use
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
