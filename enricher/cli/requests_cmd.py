"""`kvmiss requests --otlp FILE`: request records from spans kept in OTLP/JSON files.

For spans already stored (an OpenTelemetry Collector's ``file`` exporter, one OTLP/JSON
export request per line, before kvmiss: kvmiss's own ``[export] file`` has no block hashes
unless ``keep_block_hashes``): each request's facts are read and joined by the same rules
``kvmiss serve`` uses, and written as the request records `kvmiss attribute` and
`kvmiss whatif` read, one JSON line per request, on stdout or ``--out`` -- what ``[export]
request_records`` writes from live traffic. No token ids, extra keys, salts or adapter paths
are written. Requests whose facts are incomplete are left out and counted on stderr.

``--config`` gives the ``[attributes]`` names and the ``[engine]`` settings (block size, and
the hash algorithm and seed when routers send token ids instead of block hashes).
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Iterator
from typing import IO

# Shown under `kvmiss requests --help`: what it reads, in one schema line, and one example.
HELP_INPUT = """\
input:    --otlp FILE (repeatable): OTLP/JSON export requests, one per line (a Collector's file
          exporter upstream of kvmiss)
example:  kvmiss requests --otlp spans.otlp.jsonl --config kvmiss.toml --out requests.jsonl
"""

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--otlp", required=True, action="append", metavar="FILE",
                        help="OTLP/JSON lines (a Collector's file exporter; '-' for stdin); may be repeated")
    parser.add_argument("--config", help="kvmiss.toml: [attributes] names and [engine] settings")
    parser.add_argument("--out", help="write the records here instead of stdout")


def _requests(paths: list[str], bad: list[str]) -> Iterator:
    from kvmiss.enricher.otlp.receiver import parse_otlp_json

    for path in paths:
        lines: IO[bytes] = sys.stdin.buffer if path == "-" else open(path, "rb")
        try:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    yield parse_otlp_json(line)
                except ValueError as exc:  # a line is reported by position, never by content
                    bad.append(f"{path}: line {number}: not an OTLP/JSON export request ({str(exc)[:120]})")
        finally:
            if lines is not sys.stdin.buffer:
                lines.close()


def run(args: argparse.Namespace) -> int:
    from kvmiss.enricher.core.hashing import BlockHasher, HashingError
    from kvmiss.enricher.otlp.spans import SpanReader
    from kvmiss.enricher.service.offline import records_from_spans
    from kvmiss.enricher.service.request_records import encode_record
    from kvmiss.schemas.config import Config, ConfigError, load_config

    try:
        config = load_config(args.config) if args.config else Config()
    except ConfigError as exc:
        print(f"kvmiss requests: {exc}", file=sys.stderr)
        return 2
    engine = config.engine
    try:
        hasher = BlockHasher(engine.hash_algo, seed=engine.hash_seed, block_size=engine.block_size,
                             extra_keys_format=engine.extra_keys_format)
    except HashingError:
        hasher = None
    left_out: collections.Counter[str] = collections.Counter()
    bad: list[str] = []
    written = 0
    try:
        out = open(args.out, "wb") if args.out else sys.stdout.buffer
        try:
            for record in records_from_spans(_requests(args.otlp, bad), SpanReader(config.attributes), hasher=hasher,
                                             default_block_size=engine.block_size, left_out=left_out):
                out.write(encode_record(record) + b"\n")
                written += 1
        finally:
            if out is sys.stdout.buffer:
                out.flush()
            else:
                out.close()
    except OSError as exc:
        print(f"kvmiss requests: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    for line in bad:
        print(f"kvmiss requests: {line}", file=sys.stderr)
    for why, n in sorted(left_out.items()):
        print(f"kvmiss requests: {n} requests left out (facts incomplete: {why})", file=sys.stderr)
    print(f"kvmiss requests: {written} request records written", file=sys.stderr)
    return 0
