"""kvmiss finds a data-parallel vLLM engine's event streams by asking it: the real vLLM CPU engine
with ``--data-parallel-size 2``, its publishers on ``tcp://*:0`` (ports the OS picks), and a kvmiss
config that names only the engine's HTTP URL ([fleet.engines]); no port of the events anywhere.

    python examples/vllm-cpu/run_discovery.py [--requests 120] [--restart] [--dp 2] [--json FILE]

What it runs (the set-up of run_e2e.py: venv, tiny model, free ports):

* ``kvmiss serve`` with ``[fleet.engines] urls = ["http://127.0.0.1:<api port>"]`` and
  ``id = "{host}:{port}-dp{dp_rank}"``: it asks ``/kv_event_sources`` and follows each rank.
* vLLM's OpenAI server, ``VLLM_HOST_IP=127.0.0.1``, the kvmiss plugin naming each engine core
  ``kvmiss.worker=127.0.0.1:<api port>-dp{dp_rank}`` (the plugin puts in the core's rank).
* A router in this process: each request is pinned to a rank it picks (vLLM's
  ``X-data-parallel-rank`` header), so a repeat sent to the other rank is a routing miss.
* ``--restart``: halfway, vLLM is stopped and started again: new processes on new ports, which
  kvmiss learns by asking again (the same worker ids, new streams).
* ``kvmiss serve --check`` is run against the running engine: what the engine answered.

The oracle is the engine: an independent subscriber per rank (run_e2e.Witness, connected to the
endpoints this script reads from /kv_event_sources itself) records every batch; each request
is judged on its rank's stream (engine_truth.py), and a miss whose first missed block the other
rank held when the request was sent is a ``routing_miss``. Then kvmiss's labels are compared:
wrong (a proven label that disagrees), unknown, spans in = out, batches kvmiss applied per rank
against the batches each rank published.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import engine_truth  # noqa: E402
import run_e2e as base  # noqa: E402
import run_field as field  # noqa: E402

BLOCK = base.BLOCK
ID_TEMPLATE = "{host}:{port}-dp{dp_rank}"


def render_config(ports: dict[str, int], enriched: Path) -> str:
    """kvmiss.toml beside this file without its [[workers]] table: the engine is asked instead."""
    text = field.render_config(ports, enriched)
    start = text.index("[[workers]]")
    end = text.index("[privacy]")
    engines = (f'[fleet]\npoll_interval_s = 0.25\n[fleet.engines]\nurls = ["http://127.0.0.1:{ports["vllm"]}"]\n'
               f'id = "{ID_TEMPLATE}"\ninterval_s = 1.0\n\n')
    return text[:start] + engines + text[end:]


def ask(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/kv_event_sources", timeout=5) as reply:
        return json.loads(reply.read())


def send(port: int, r: field.Request, rank: int) -> None:
    r.trace_id = os.urandom(16).hex()
    r.request_id = f"cmpl-{uuid.uuid4().hex}-0"
    body = json.dumps({"model": "tiny", "prompt": r.prompt, "max_tokens": 1, "temperature": 0.0}).encode()
    headers = {"Content-Type": "application/json", "X-data-parallel-rank": str(rank),
               "traceparent": f"00-{r.trace_id}-{os.urandom(8).hex()}-01"}
    r.sent_at = time.time()
    http = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, method="POST", headers=headers)
    with urllib.request.urlopen(http, timeout=120) as response:
        usage = json.loads(response.read())["usage"]
    r.done_at = time.time()
    r.cached_api = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


class Engine:
    """One vLLM process group (API server + one engine core per rank) and a witness per rank."""

    def __init__(self, args, python: Path, model: Path, ports: dict[str, int], run_dir: Path, n: int):
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
                  "replay_endpoint": "tcp://*:0", "topic": "kv-events"}
        command = base.vllm_command(python, model, ports, 0.1, field.POOL_BLOCKS)
        command[command.index("--kv-events-config") + 1] = json.dumps(events)
        command += ["--prefix-caching-hash-algo", field.ALGO, "--data-parallel-size", str(args.dp)]
        (run_dir / f"vllm-command-{n}.txt").write_text(" ".join(command) + "\n")
        env = {**os.environ, **base.offline_env(args.scratch.resolve()), "VLLM_PLUGINS": "kvmiss",
               "PYTHONHASHSEED": field.SEED, "VLLM_HOST_IP": "127.0.0.1",
               "OTEL_RESOURCE_ATTRIBUTES": f"kvmiss.worker=127.0.0.1:{ports['vllm']}-dp{{dp_rank}}",
               "OTEL_SERVICE_NAME": "vllm-cpu"}
        base.say(f"starting vLLM #{n} with --data-parallel-size {args.dp}, events on tcp://*:0")
        started = time.monotonic()
        self.proc = subprocess.Popen(["nice", "-n", "5", *command], env=env, cwd=args.scratch.resolve(),
                                     stdout=open(run_dir / f"vllm-{n}.log", "w"), stderr=subprocess.STDOUT)
        base.wait_http(f"http://127.0.0.1:{ports['vllm']}/health", args.start_timeout, self.proc, "vLLM",
                       run_dir / f"vllm-{n}.log")
        self.sources = ask(ports["vllm"])
        base.say(f"vLLM #{n} ready after {time.monotonic() - started:.0f} s; /kv_event_sources: "
                 + ", ".join(f"rank {k}: {v['endpoint']} (replay {v['replay_endpoint']})" for k, v in self.sources.items()))
        self.witnesses = {int(k): base.Witness(v["endpoint"]) for k, v in self.sources.items()}

    def stop(self) -> dict[int, list]:
        batches = {}
        for rank, witness in self.witnesses.items():
            witness.close()
            batches[rank] = witness.batches
        base.stop(self.proc, "vLLM")
        return batches


def holds(batches: list, h: int) -> bool:
    """Whether the full-attention group holds ``h`` after ``batches`` (copies counted)."""
    copies: collections.Counter = collections.Counter()
    for _, _, events in batches:
        for e in events:
            kind = engine_truth.kind_of(e)
            if kind == "AllBlocksCleared":
                copies.clear()
            elif kind in ("BlockStored", "BlockRemoved") and engine_truth.group_of(e) == 0:
                for x in engine_truth.hashes_of(e):
                    copies[x] += 1 if kind == "BlockStored" else -1
    return copies[h] > 0


def judge(requests: list, batches: dict[int, list]) -> None:
    """Each request's truth on its own rank's stream, then routing_miss where the other rank held
    the first missed block when the request was sent (requests go one at a time here)."""
    streams = {rank: engine_truth.Stream(b, BLOCK) for rank, b in batches.items()}
    for rank, stream in streams.items():
        mine = [r for r in requests if r.rank == rank and r.cached_api is not None]
        lookups = [engine_truth.Lookup(str(i), r.chain, len(r.prompt), r.cached_api, r.sent_at, r.done_at)
                   for i, r in enumerate(mine)]
        stream.note_lookups(lookups)
        for lk in lookups:
            r = mine[int(lk.key)]
            t = stream.judge(lk)
            r.truth, r.excluded = t.label, t.excluded
            r.truth_detail = {"predicted": t.predicted, "step": t.step, "reading": t.reading, **t.detail}
            if r.truth not in ("no_match", "evicted", "resident_miss"):
                continue
            h = r.chain[r.cached_api // BLOCK]
            for other, o in streams.items():
                if other == rank:
                    continue
                # Held on the other rank both before the request was sent and after its answer
                # (its batches in flight applied, or not): then either reading agrees.
                before = sum(1 for _, recv, _ in o.batches if recv < r.sent_at)
                after = sum(1 for _, recv, _ in o.batches if recv <= r.done_at + engine_truth.SLACK_S)
                held = {holds(o.batches[:n], h) for n in {before, after}}
                if len(held) > 1:
                    r.truth, r.excluded = None, "other_rank_changed_in_flight"
                    break
                if held == {True}:
                    r.truth = "routing_miss"


def applied_by_worker(metrics: str) -> dict[str, float]:
    return {line.split('worker="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines() if line.startswith("kvmiss_stream_batches_applied_total{")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--restart", action="store_true", help="restart vLLM halfway (new ports)")
    parser.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get("KVMISS_VLLM_VENV", "/work/vllm-venv")))
    parser.add_argument("--scratch", type=Path, default=Path(os.environ.get("KVMISS_VLLM_SCRATCH", "/work/vllm-scratch")))
    parser.add_argument("--setup", action="store_true", help="create the venv / install kvmiss / make the model")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    scratch = args.scratch.resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    model = scratch / "tiny-model"
    if args.setup:
        base.setup(args.vllm_venv, model, scratch)
    python = args.vllm_venv / "bin" / "python"
    if not python.exists() or not (model / "config.json").exists():
        raise SystemExit(f"no vLLM venv at {args.vllm_venv} or no model at {model}: run with --setup")
    run_dir = scratch / f"discovery-dp{args.dp}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir()
    ports = {name: base.free_port() for name in ("otlp_grpc", "otlp_http", "metrics", "events", "replay", "vllm")}
    enriched = run_dir / "enriched.jsonl"
    config = run_dir / "kvmiss.toml"
    config.write_text(render_config(ports, enriched))
    # `serve --check` binds each listen port for a moment: its copy listens on free ones.
    check_config = run_dir / "check.toml"
    check_config.write_text(render_config({**ports, "otlp_grpc": 0, "otlp_http": 0, "metrics": 0}, enriched))
    requests = field.workload(args.requests, "sequential")
    rng = random.Random(3)
    from kvmiss.enricher.core.hashing import BlockHasher, external_hash

    hasher = BlockHasher(field.ALGO, seed=field.SEED, block_size=BLOCK)
    for r in requests:
        r.rank = rng.randrange(args.dp)  # the router's choice
        r.chain = [external_hash(d) for d in hasher.hash_request(r.prompt)]
    halves = [requests[:len(requests) // 2], requests[len(requests) // 2:]] if args.restart else [requests]

    kvmiss = engine = None
    extra: dict = {"epochs": []}
    metrics = ""
    try:
        base.say(f"kvmiss serve --config {config} (no event ports in it: {ID_TEMPLATE} per rank)")
        kvmiss = subprocess.Popen([sys.executable, "-m", "kvmiss.enricher.cli", "serve", "--config", str(config)],
                                  stdout=open(run_dir / "kvmiss.log", "w"), stderr=subprocess.STDOUT, env=base.kvmiss_env())
        base.wait_http(f"http://127.0.0.1:{ports['metrics']}/healthz", 30, kvmiss, "kvmiss serve")
        for n, half in enumerate(halves):
            engine = Engine(args, python, model, ports, run_dir, n)
            check = subprocess.run([sys.executable, "-m", "kvmiss.enricher.cli", "serve", "--check", "--config", str(check_config)],
                                   capture_output=True, text=True, env=base.kvmiss_env())
            check_lines = [line for line in check.stdout.splitlines() if "fleet engines" in line or line.startswith("  ")]
            base.say("kvmiss serve --check:\n" + "\n".join(check_lines))
            time.sleep(6.0)  # the engine is asked every second; a join is followed from seq 0 by replay
            for i, r in enumerate(half):
                time.sleep(r.gap_s)
                send(ports["vllm"], r, r.rank)
                if (i + 1) % 40 == 0:
                    base.say(f"epoch {n}: {i + 1}/{len(half)} sent")
            time.sleep(8.0)  # the engine's span processors export every ~5 s: let them, before a stop
            if n + 1 == len(halves):
                # Last epoch: wait for labels with the engine still up (its spans are exported every ~5 s).
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    field.collect_labels(requests, base.read_spans(enriched))
                    if all(r.labels for r in requests):
                        break
                    time.sleep(1.0)
                time.sleep(10.0)
            # Per lifetime: a restart replaces each rank's stream, and its counters with it.
            with urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=5) as response:
                metrics = response.read().decode()
            batches = engine.stop()
            engine = None
            gaps = {rank: [(a, b) for a, b in zip([s for s, _, _ in b], [s for s, _, _ in b][1:]) if b != a + 1]
                    for rank, b in batches.items()}
            extra["epochs"].append({"check": check_lines, "published_batches": {r: len(b) for r, b in batches.items()},
                                    "applied_by_worker": applied_by_worker(metrics),
                                    "first_seq": {r: (b[0][0] if b else None) for r, b in batches.items()},
                                    "witness_gaps": gaps})
            judge(half, batches)
        (run_dir / "kvmiss-metrics.txt").write_text(metrics)
        extra["spans_received"] = field.metric(metrics, "kvmiss_spans_received_total")
        extra["spans_exported"] = field.metric(metrics, "kvmiss_spans_handed_to_export_total")
        extra["fleet_joins"] = field.metric(metrics, "kvmiss_fleet_joins_total")
        extra["fleet_departures"] = field.metric(metrics, "kvmiss_fleet_departures_total")
        extra["engine_answers"] = [line for line in metrics.splitlines()
                                   if line.startswith("kvmiss_fleet_engine_answers_total{")]
    finally:
        if engine is not None:
            engine.stop()
        base.stop(kvmiss, "kvmiss serve")

    spans = base.read_spans(enriched)
    extra["spans_in_file"] = len(spans)
    field.collect_labels(requests, spans)
    worker_of = {}
    for span in spans:
        if span["name"] == "kvmiss.prefix_lookup":
            worker_of[span["trace_id"]] = span["resource"].get("kvmiss.worker")
    extra["plugin_worker_matches_rank"] = sum(worker_of.get(r.trace_id, "").endswith(f"-dp{r.rank}") for r in requests)
    summary = field.summarise(requests, "plugin", "sequential", extra)
    summary["ranks"] = args.dp
    summary["restart"] = args.restart
    summary["run_dir"] = str(run_dir)
    text = json.dumps(summary, indent=1)
    (run_dir / "summary.json").write_text(text)
    if args.json:
        args.json.write_text(text)
    print(text)
    ok = (summary["wrong"] == 0 and summary["unlabelled"] == 0 and summary["two_labels"] == 0
          and extra["spans_received"] == extra["spans_exported"])
    base.say("0 wrong, every request labelled, spans in = out" if ok else f"NOT OK (see {run_dir})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
