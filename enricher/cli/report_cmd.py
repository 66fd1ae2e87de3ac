"""`kvmiss report`: render the HTML report from attribution records or enriched spans.

    kvmiss report --records attributions.jsonl --out DIR     (what `kvmiss attribute` writes)
    kvmiss report --spans enriched.otlp.jsonl --out DIR      (what `[export] file` writes)

``--recording`` adds what neither file carries, the stream-health lanes: a recording of the
KV events over the same period (`kvmiss collect --record`), played through the collector's
state machines. ``--context`` is `kvmiss demo`'s ``report_context.json`` (the same lanes, plus
its injected faults, route-to-BlockStored latency and ground truth).
Writes DIR/report.html (self-contained) and one PNG per chart; prints the report's path.
"""

from __future__ import annotations

import argparse
import sys

# Shown under `kvmiss report --help`: what it reads, in one schema line, and one example.
HELP_INPUT = """\
input:    --records FILE: attribution records (`kvmiss attribute` output), or --spans FILE: enriched
          OTLP/JSON spans ([export] file), one JSON object per line; optionally --recording FILE:
          the KV events of the same period (`kvmiss collect --record`), for the stream-health lanes
example:  kvmiss report --spans enriched.otlp.jsonl --recording events.rec --out ./kvmiss-report
"""

def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--records", metavar="FILE.jsonl",
                        help="attribution records, one JSON object per line (kvmiss attribute)")
    source.add_argument("--spans", metavar="FILE.otlp.jsonl",
                        help="enriched spans as OTLP/JSON lines ([export] file)")
    parser.add_argument("--out", default="./kvmiss-report", help="output directory (default ./kvmiss-report)")
    parser.add_argument("--recording", metavar="FILE",
                        help="KV events of the same period (kvmiss collect --record): stream-health lanes per worker")
    parser.add_argument("--context", metavar="FILE.json",
                        help="report context written by kvmiss demo (report_context.json)")
    parser.add_argument("--title", help="the report's title")


def run(args: argparse.Namespace) -> int:
    from kvmiss.collectors.recording import ReadStats, RecordingError
    from kvmiss.enricher.report import InputError, load_context, load_records, load_spans, write_report
    from kvmiss.enricher.report.streams import context_from_recording

    errors: list[str] = []
    path = args.records or args.spans
    stats = ReadStats()
    try:
        rows = load_records(path, errors) if args.records else load_spans(path, errors)
        context = load_context(args.context)
        if args.recording:
            context.update(context_from_recording(args.recording, stats))
    except (OSError, InputError, RecordingError) as exc:
        print(f"kvmiss report: {exc}", file=sys.stderr)
        return 2
    if stats.torn_tail:
        print(f"kvmiss report: {args.recording}: torn last record skipped ({stats.records} records read)",
              file=sys.stderr)
    for error in errors[:10]:
        print(f"kvmiss report: {path}: {error}", file=sys.stderr)
    if len(errors) > 10:
        print(f"kvmiss report: {path}: {len(errors) - 10} more bad lines", file=sys.stderr)
    if not rows:
        print(f"kvmiss report: {path}: no attributed requests found", file=sys.stderr)
        return 1
    if args.title:
        context["title"] = args.title
    context.setdefault("subtitle", f"{len(rows)} attributed requests from {path}")
    report = write_report(rows, context, args.out)
    print(report)
    return 0
