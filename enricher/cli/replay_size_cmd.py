"""`kvmiss replay-size`: the minimum replay window for an observed or assumed peak rate.

Either give ``--peak-batches-per-s`` or a recording (``--recording FILE``) whose live
messages' arrival times give each worker's peak rate over 1-second windows (the busiest
worker decides). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

from kvmiss.collectors.recording import ReadStats, read_recording
from kvmiss.collectors.replay_window import (
    VLLM_DEFAULT_BUFFER_STEPS,
    min_replay_window,
    peak_rate,
    window_lasts_s,
)

# Shown under `kvmiss replay-size --help`: what it reads, in one schema line, and one example.
HELP_INPUT = """\
input:    --peak-batches-per-s N, or --recording FILE from `kvmiss collect --record`
example:  kvmiss replay-size --peak-batches-per-s 800 --outage-s 12
"""

def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--peak-batches-per-s", type=float, help="peak published batches per second")
    source.add_argument("--recording", help="a `kvmiss collect --record` file to measure the peak from")
    parser.add_argument("--outage-s", type=float, required=True, help="longest consumer outage to survive")
    parser.add_argument("--catchup-s", type=float, default=3.0, help="reconnect and catch-up time (default 3)")
    parser.add_argument("--safety-factor", type=float, default=2.0, help="burst safety factor (default 2)")
    parser.add_argument("--buffer-steps", type=int, default=VLLM_DEFAULT_BUFFER_STEPS,
                        help="the ring size to assess (default: vLLM's 10000)")


def _peak_from_recording(path: str) -> tuple[float, str | None]:
    arrivals: dict[str, list[float]] = collections.defaultdict(list)
    stats = ReadStats()
    for message in read_recording(path, stats):
        if message.socket == "sub":
            arrivals[message.worker].append(message.recv_ts)
    if stats.torn_tail:
        print(f"kvmiss replay-size: {path}: torn last record skipped", file=sys.stderr)
    rates = {worker: peak_rate(sorted(ts)) for worker, ts in arrivals.items()}
    if not rates:
        return 0.0, None
    worker = max(rates, key=rates.get)  # type: ignore[arg-type]
    return rates[worker], worker


def run(args: argparse.Namespace) -> int:
    worker = None
    if args.recording is not None:
        peak, worker = _peak_from_recording(args.recording)
    else:
        peak = args.peak_batches_per_s
    try:
        needed = min_replay_window(peak, args.outage_s, args.catchup_s, args.safety_factor)
    except ValueError as exc:
        print(f"kvmiss replay-size: {exc}", file=sys.stderr)
        return 2
    lasts = window_lasts_s(args.buffer_steps, peak)
    print(json.dumps({
        "peak_batches_per_s": peak,
        "busiest_worker": worker,
        "outage_s": args.outage_s,
        "catchup_s": args.catchup_s,
        "safety_factor": args.safety_factor,
        "min_replay_window_batches": needed,
        "buffer_steps": args.buffer_steps,
        "buffer_lasts_s": None if lasts == float("inf") else round(lasts, 3),
        "buffer_sufficient": args.buffer_steps >= needed,
    }))
    return 0
