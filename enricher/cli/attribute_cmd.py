"""`kvmiss attribute --events REC --requests REQ.jsonl`: offline attribution.

Writes one attribution record (schemas/attribution.py `AttributionRecord`) per request as a
JSON line on stdout (or ``--out``), and the summary table by label and owner on stderr.
Workers come from ``--config`` or, without it, from the recording itself. The digest key
comes from the config's [privacy] section or ``--digest-key-env``; without one, records
carry no first-miss digest. Without ``--config`` the settings assumed in its place (which can
change labels) are printed on stderr.
"""

from __future__ import annotations

import argparse
import sys

from kvmiss.collectors.recording import ReadStats, RecordingError
from kvmiss.enricher.core.privacy import DigestKeyError, load_digest_key
from kvmiss.enricher.service.offline import (
    attribute_requests,
    index_from_recording,
    read_requests,
    workers_in_recording,
)
from kvmiss.schemas.config import ConfigError, load_config

# Shown under `kvmiss attribute --help`: what it reads, in one schema line, and one example.
HELP_INPUT = """\
input:    --events FILE: a recording from `kvmiss collect --record`; --requests FILE ('-': stdin):
          request records, one JSON object per line: {"prompt_tokens", "cached_tokens", "block_size",
          "worker", "lookup_time", "block_hashes", ...} (docs/COMMANDS.md, "Request records")
example:  kvmiss attribute --events rec.kvrec --requests requests.jsonl --out attributions.jsonl
"""

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--events", required=True, help="a recording made by `kvmiss collect --record`")
    parser.add_argument("--requests", required=True, help="request records, JSON lines ('-' for stdin)")
    parser.add_argument("--config", help="kvmiss.toml: workers and the privacy key")
    parser.add_argument("--digest-key-env", help="environment variable holding the digest secret")
    parser.add_argument("--kv-cache-report-mode", choices=("any", "incremental"),
                        help="[history] kv_cache_report_mode (overrides --config; default any): incremental "
                             "when no request uses vLLM's full report mode")
    parser.add_argument("--out", help="write records here instead of stdout")


def assumed_defaults(workers, mode: str, key_given: bool) -> str:
    """What attribute runs with when no --config says otherwise, on stderr: a label can
    differ from `kvmiss serve`'s with the deployment's real settings."""
    from kvmiss.schemas.config import HistoryConfig

    names = ", ".join(w.id for w in workers[:8]) + (f", ... ({len(workers)})" if len(workers) > 8 else "")
    replay = sum(w.replay_endpoint is not None for w in workers)
    return "\n".join([
        "kvmiss attribute: no --config; assumed in its place (pass the kvmiss.toml kvmiss serve runs with):",
        f"  workers: the {len(workers)} in the recording ({names}); {replay} with replay (replies recorded)",
        f"  [history] kv_cache_report_mode = {mode!r}" + (
            " (a parentless store may re-announce a resident chain; --kv-cache-report-mode incremental "
            "if no request uses vLLM's full report mode)" if mode == "any" else ""),
        f"  [history] aged_out_as_recent_match = {str(HistoryConfig().aged_out_as_recent_match).lower()}",
        "  history: every event of the recording is kept (no retention_s limit, as with --config)",
        "  block size, hash algorithm and seed: not used (each request record carries its block hashes)",
        "  digest key: " + ("from --digest-key-env" if key_given else
                            "none: records carry no first-miss digest (--digest-key-env NAME)"),
    ])


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config) if args.config else None
        workers = config.workers if config else workers_in_recording(args.events)
        key = None
        if args.digest_key_env:
            key = load_digest_key(None, args.digest_key_env)
        elif config and (config.privacy.digest_key or config.privacy.digest_key_env):
            key = load_digest_key(config.privacy.digest_key, config.privacy.digest_key_env)
        mode = args.kv_cache_report_mode or (config.history.kv_cache_report_mode if config else "any")
        if config is None:
            print(assumed_defaults(workers, mode, key is not None), file=sys.stderr)
        stats = ReadStats()
        index = index_from_recording(args.events, workers, stats=stats, re_announcements=mode == "any")
    except (ConfigError, DigestKeyError, RecordingError, OSError) as exc:
        print(f"kvmiss attribute: {exc}", file=sys.stderr)
        return 2
    if stats.torn_tail:
        print(f"kvmiss attribute: {args.events}: torn last record skipped "
              f"({stats.records} records read)", file=sys.stderr)
    requests_in = sys.stdin.buffer if args.requests == "-" else open(args.requests, "rb")
    out = open(args.out, "wb") if args.out else sys.stdout.buffer
    try:
        summary = attribute_requests(index, read_requests(requests_in), out, digest_key=key, errors=sys.stderr,
                                     aged_out_as_recent_match=bool(config and config.history.aged_out_as_recent_match))
    finally:
        if requests_in is not sys.stdin.buffer:
            requests_in.close()
        if out is not sys.stdout.buffer:
            out.close()
        else:
            out.flush()
    print(summary.table(), file=sys.stderr)
    return 0
