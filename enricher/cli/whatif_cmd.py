"""`kvmiss whatif --events REC --requests REQ --pool-blocks N`: how much of each worker's
prompts a pool of N x scale blocks would have served, replayed from a recording of its KV
events and the request records `kvmiss attribute` reads (with ``finish_time`` and
``output_tokens``). An estimate under vLLM's pool policy (enricher/estimates/whatif.py), kept apart
from the proven labels: it never changes one.

Without ``--pool-blocks`` the pool comes from ``[[workers]] pool_blocks`` in ``--config``.
``--json`` prints one object per line per worker and scale.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

from kvmiss.collectors.continuity import Apply
from kvmiss.collectors.fleet import Fleet, play_recording
from kvmiss.collectors.recording import ReadStats, RecordingError
from kvmiss.enricher.estimates.whatif import DEFAULT_SCALES, PoolRequest, curve, output_chains
from kvmiss.enricher.service.offline import BadRequestLine, read_requests, workers_in_recording
from kvmiss.schemas.config import ConfigError, load_config
from kvmiss.schemas.events import BlockStored

# Shown under `kvmiss whatif --help`: what it reads, in one schema line, and one example.
HELP_INPUT = """\
input:    --events FILE from `kvmiss collect --record`; --requests FILE: request records with
          finish_time and output_tokens, one JSON object per line ([export] request_records, `kvmiss requests`)
example:  kvmiss whatif --events rec.kvrec --requests requests.jsonl --pool-blocks 4096 --scales 1,2,4
"""

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--events", required=True, help="a recording made by `kvmiss collect --record`")
    parser.add_argument("--requests", required=True, help="request records, JSON lines")
    parser.add_argument("--pool-blocks", type=int, help="the engines' KV pool in blocks (num_gpu_blocks)")
    parser.add_argument("--config", help="kvmiss.toml: workers and their [[workers]] pool_blocks")
    parser.add_argument("--scales", default=",".join(f"{s:g}" for s in DEFAULT_SCALES),
                        help="pool sizes as multiples of the recorded one (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="one JSON object per worker and scale")


# Scale 1 replays the recorded pool: a prediction further than this from what the engine did
# says the replay is not modelling that engine, and the other scales inherit the error.
CALIBRATION_POINTS = 1.0


def calibration_gap(row: dict) -> float | None:
    """Points by which a scale-1 prediction misses what the engine did, when beyond
    `CALIBRATION_POINTS` (positive: the replay kept more)."""
    gap = round(100 * (row["predicted_hit_ratio"] - row["observed_hit_ratio"]), 1)
    return gap if abs(gap) > CALIBRATION_POINTS else None


LIKELY_CAUSE = {
    True: ("the engine kept less than vLLM's pool of that size would have: its pool is smaller than "
           "--pool-blocks says, or it is not vLLM's pool (kvmiss demo's simulated engine evicts "
           "differently), or it held blocks for requests the records do not show"),
    False: ("the engine kept more than vLLM's pool of that size would have: its pool is larger than "
            "--pool-blocks says, or an offload tier or another policy served blocks"),
}


def _scales(text: str) -> list[float]:
    scales = sorted({float(x) for x in text.split(",") if x.strip()})
    if not scales or scales[0] <= 0:
        raise ValueError("--scales: positive numbers, comma separated")
    return scales


def run(args: argparse.Namespace) -> int:
    try:
        scales = _scales(args.scales)
        config = load_config(args.config) if args.config else None
        workers = config.workers if config else workers_in_recording(args.events)
    except (ValueError, ConfigError, RecordingError, OSError) as exc:
        print(f"kvmiss whatif: {exc}", file=sys.stderr)
        return 2
    pools = {w.id: args.pool_blocks or w.pool_blocks for w in workers}
    missing = sorted(w for w, n in pools.items() if not n)
    if missing:
        print("kvmiss whatif: the pool size is not known for " + ", ".join(missing) + ": pass --pool-blocks N "
              "or set [[workers]] pool_blocks (vLLM logs it at start-up: num_gpu_blocks)", file=sys.stderr)
        return 2
    stores: dict[str, list] = collections.defaultdict(list)  # worker -> (ts, parent, hashes)

    def sink(worker: str, action) -> None:
        if isinstance(action, Apply):
            for event in action.batch.events:
                if type(event) is BlockStored and event.medium in (None, "GPU"):
                    stores[worker].append((action.batch.ts, event.parent_block_hash, event.block_hashes))

    stats = ReadStats()
    try:
        play_recording(args.events, Fleet(workers, sink), stats)
    except (RecordingError, OSError) as exc:
        print(f"kvmiss whatif: {exc}", file=sys.stderr)
        return 2
    by_worker: dict[str, list] = collections.defaultdict(list)
    skipped = collections.Counter()
    with open(args.requests, "rb") as lines:
        for item in read_requests(lines):
            if isinstance(item, BadRequestLine):
                print(f"kvmiss whatif: request line {item.line}: {item.error}", file=sys.stderr)
                continue
            if item.worker not in pools:
                skipped["untracked worker"] += 1
            elif item.lookup_time is None or item.finish_time is None or item.output_tokens is None:
                skipped["no lookup_time, finish_time or output_tokens"] += 1
            elif not item.block_hashes and item.prompt_tokens >= item.block_size:
                skipped["no block_hashes"] += 1
            else:
                by_worker[item.worker].append(item)
    for why, n in sorted(skipped.items()):
        print(f"kvmiss whatif: {n} requests left out ({why})", file=sys.stderr)
    rows = []
    for worker in sorted(by_worker):
        facts = sorted(by_worker[worker], key=lambda f: f.lookup_time)
        size = facts[0].block_size
        wanted = [((f.prompt_tokens + f.output_tokens) // size) - len(f.block_hashes or ()) for f in facts]
        outputs = output_chains(stores[worker], [(f.lookup_time, f.finish_time, list(f.block_hashes or ()), n)
                                                 for f, n in zip(facts, wanted)])
        requests = [PoolRequest(lookup_time=f.lookup_time, finish_time=f.finish_time, prompt_tokens=f.prompt_tokens,
                                output_tokens=f.output_tokens, chain=list(f.block_hashes or ()), output_chain=out,
                                observed_cached_tokens=f.cached_tokens) for f, out in zip(facts, outputs)]
        for scale, result in curve(requests, pools[worker], size, scales).items():
            rows.append({"worker": worker, "scale": scale, "pool_blocks": result.pool_blocks,
                         "requests": result.requests, "prompt_tokens": result.prompt_tokens,
                         "observed_cached_tokens": result.observed_cached_tokens,
                         "predicted_cached_tokens": result.predicted_cached_tokens,
                         "predicted_hit_ratio": round(result.predicted_hit_ratio, 5),
                         "observed_hit_ratio": round(result.observed_hit_ratio, 5),
                         "uncertain": result.uncertain, **({"reason": result.reason} if result.reason else {})})
    for row in rows:
        if row["scale"] == 1.0 and (gap := calibration_gap(row)) is not None:
            row["calibration"] = {"gap_points": gap, "likely_cause": LIKELY_CAUSE[gap > 0]}
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(f"{'worker':<12}{'scale':>7}{'pool blocks':>13}{'requests':>10}{'predicted hit':>15}{'observed':>10}")
    for row in rows:
        observed = f"{row['observed_hit_ratio']:.1%}" if row["scale"] == 1.0 else ""
        flag = "  (uncertain)" if row["uncertain"] else ""
        print(f"{row['worker']:<12}{row['scale']:>7g}{row['pool_blocks']:>13}{row['requests']:>10}"
              f"{row['predicted_hit_ratio']:>15.1%}{observed:>10}{flag}")
    for reason in sorted({row["reason"] for row in rows if row.get("reason")}):
        print(f"uncertain: {reason}")
    off = [row for row in rows if "calibration" in row]
    for row in off:
        print(f"{row['worker']}: at scale 1 the replay predicts {row['predicted_hit_ratio']:.1%} against "
              f"{row['observed_hit_ratio']:.1%} observed ({row['calibration']['gap_points']:+.1f} points)")
    for over in sorted({row["calibration"]["gap_points"] > 0 for row in off}, reverse=True):
        print(f"likely: {LIKELY_CAUSE[over]}; read the other scales relative to scale 1, not as absolutes")
    print("estimates under vLLM's pool policy (least recently freed first, blocks in use never evicted); "
          "they never change a kvmiss.label")
    return 0
