"""A longer run on the real vLLM CPU engine, deployed as users deploy it, checked against the
engine's own event stream.

    python examples/vllm-cpu/run_field.py [--mode router|plugin|router+plugin] [--requests 500]
        [--pacing mixed|sequential|back-to-back|bursts|idle] [--vllm-venv DIR] [--scratch DIR]
        [--json FILE]

What it runs (the set-up of run_e2e.py: venv, tiny model, free ports):

* ``kvmiss serve`` with ``sha256_cbor``, ``PYTHONHASHSEED=0`` on the engine, 32-token blocks;
  OTLP/gRPC in, enriched spans to a JSON-lines file.
* vLLM's OpenAI server with prefix caching, a 16-block pool, KV events over ZeroMQ + replay,
  and its own tracing at its defaults (``--otlp-traces-endpoint``: ``llm_request`` exported by
  a BatchSpanProcessor every ~5 s).
* ``router``: this process plays the router. Each request gets a span from the real OTel SDK
  (BatchSpanProcessor at its defaults), whose context goes to vLLM as ``traceparent``, with
  ``gen_ai.request.id`` = vLLM's own request id (``cmpl-<X-Request-Id>-0``), the prompt and
  cached tokens from the API's answer, ``kvmiss.route.worker``, ``kvmiss.block_size`` and the
  block chain -- and no lookup time: kvmiss takes it from ``llm_request``. The kvmiss plugin is
  off. ``plugin``: no router span; the kvmiss plugin writes the lookup span. ``router+plugin``:
  both.
* A workload of cold prompts, repeats, block-multiple prompts, shared prefixes and fillers that
  evict, paced back-to-back, ~70 ms apart, in bursts of 4 and with idle gaps of 0.1-30 s.

The oracle is the engine itself: an independent subscriber (run_e2e.Witness) records every batch the engine
publishes (sequence numbers checked: a gap voids the run), and each request's true label
follows from its chain, the API's cached tokens and the residency those batches show just
before the batch that stores the request's first missed block (removals of that block in
the same batch happened before the lookup: vLLM frees before it allocates). kvmiss's labels
are then compared with the oracle: wrong (a proven label that disagrees), unknown share of
misses, requests with two different labels, spans in = out, kvmiss's RSS.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import run_e2e as base  # noqa: E402  (the walkthrough's set-up, processes and span reading)

BLOCK = base.BLOCK
WORKER = base.WORKER
SEED = "0"  # PYTHONHASHSEED on the engine = [engine] hash_seed
ALGO = "sha256_cbor"
POOL_BLOCKS = 16


# --- the workload ------------------------------------------------------------------------------


@dataclass
class Request:
    kind: str
    prompt: list[int]
    gap_s: float  # pause before sending it
    burst: int = 0  # requests of one burst are sent together
    request_id: str = ""
    trace_id: str = ""
    sent_at: float = 0.0
    cached_api: int | None = None
    chain: list[int] = field(default_factory=list)
    truth: str | None = None
    labels: list[str] = field(default_factory=list)
    label_spans: list[str] = field(default_factory=list)
    reason: str | None = None


def workload(n: int, pacing: str, seed: int = 7) -> list[Request]:
    """``n`` requests mixing every case. The pool holds 16 blocks (512 tokens), so a few
    fillers evict what came before them; repeats of recent prompts hit, of older ones are
    evicted; 128- and 96-token prompts are block multiples (lookup_limit on a repeat)."""
    rng = random.Random(seed)
    seen: list[list[int]] = []
    out: list[Request] = []
    burst = 0
    while len(out) < n:
        roll = rng.random()
        if roll < 0.25 or not seen:
            kind, prompt = "cold", base.prompt(rng.randrange(1 << 30), rng.choice((40, 70, 100, 140)))
        elif roll < 0.40:
            kind, prompt = "repeat_recent", list(seen[-1])
        elif roll < 0.52:
            kind, prompt = "repeat_older", list(rng.choice(seen[-12:]))
        elif roll < 0.64:
            kind, prompt = "block_multiple", base.prompt(rng.randrange(1 << 30), rng.choice((64, 96, 128)))
            seen.append(prompt)
            out.append(Request(kind, prompt, 0.0))
            kind, prompt = "block_multiple_repeat", list(prompt)
        elif roll < 0.80:
            parent = rng.choice(seen[-6:])
            keep = min(len(parent) // BLOCK, rng.choice((1, 2, 3))) * BLOCK
            kind, prompt = "shared_prefix", parent[:keep] + base.prompt(rng.randrange(1 << 30), rng.choice((20, 45, 70)))
        else:
            kind, prompt = "filler", base.prompt(rng.randrange(1 << 30), 200)
        seen.append(prompt)
        out.append(Request(kind, prompt, 0.0))
    out = out[:n]
    for i, request in enumerate(out):
        request.gap_s = _gap(pacing, i, rng)
    if pacing in ("mixed", "bursts"):  # bursts of 4 cold prompts (distinct: no shared block in flight)
        every = 25 if pacing == "mixed" else 5
        for i in range(0, len(out) - 4, every):
            burst += 1
            for r in out[i:i + 4]:
                r.kind, r.prompt, r.burst = "burst_cold", base.prompt(rng.randrange(1 << 30), 70), burst
    return out


IDLE_GAPS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _gap(pacing: str, i: int, rng: random.Random) -> float:
    if pacing == "back-to-back":
        return 0.0
    if pacing == "sequential":
        return 0.07
    if pacing == "idle":
        return IDLE_GAPS[i % len(IDLE_GAPS)]
    if pacing == "bursts":
        return 0.07
    # mixed: mostly ~70 ms, runs back-to-back, and every idle gap once per 100 requests
    if i % 100 in (10, 24, 37, 51, 66, 80, 95):
        return IDLE_GAPS[(i % 100) % len(IDLE_GAPS)] if i % 100 != 95 else 30.0
    return 0.0 if i % 7 == 3 else 0.07


# --- the oracle ----------------------------------------------------------------------------------


CAPTURE_MESSAGES = 60


def capture_replay(endpoint: str, start: int = 0, timeout_s: float = 5.0) -> list[list[bytes]]:
    """One replay request from ``start``, answered as the engine's replay socket answers it
    (DEALER; every reply message up to and including the end marker)."""
    import zmq

    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    socket.connect(endpoint)
    socket.send_multipart([b"", start.to_bytes(8, "big")])
    replies = []
    try:
        while len(replies) < CAPTURE_MESSAGES + 1:
            reply = socket.recv_multipart()
            replies.append(reply)
            if reply[-2] == b"\xff" * 8 and reply[-1] == b"":  # the end marker
                break
    except zmq.Again:
        pass
    finally:
        socket.close(0)
    return replies


def write_capture(path: Path, version: str, live: list[list[bytes]], replay: list[list[bytes]]) -> None:
    """The captured messages as `kvmiss decode` input lines (one JSON object per message)."""
    import base64

    with open(path, "w") as out:
        for kind, messages in (("live", live), ("replay", replay)):
            for frames in messages:
                out.write(json.dumps({"vllm": version, "source": kind,
                                      "frames": [base64.b64encode(f).decode() for f in frames]}) + "\n")


def _event_type(event) -> str:
    return event["type"] if isinstance(event, dict) else event[0]


def _event_hashes(event) -> list[int]:
    return list(event["block_hashes"] if isinstance(event, dict) else event[1])


def judge_truth(requests: list[Request], batches: list[tuple[int, float, list]]) -> None:
    """Each request's true label from the engine's own stream (see the module docstring)."""
    for request in requests:
        n, c = len(request.prompt), request.cached_api
        if c is None:
            continue
        limit = (n - 1) // BLOCK * BLOCK
        if c >= limit:
            request.truth = "lookup_limit" if n % BLOCK == 0 and n >= BLOCK and c == limit else "hit"
            continue
        h = request.chain[c // BLOCK]
        store_at = next((i for i, (_, recv, events) in enumerate(batches) if recv >= request.sent_at
                         and any(_event_type(e) == "BlockStored" and h in _event_hashes(e) for e in events)), None)
        if store_at is None:
            continue  # no store of it seen: no truth (not counted)
        copies: collections.Counter[int] = collections.Counter()
        ever = False
        for i, (_, _, events) in enumerate(batches[:store_at + 1]):
            for event in events:
                kind = _event_type(event)
                if kind == "AllBlocksCleared":
                    copies.clear()
                    continue
                for x in _event_hashes(event):
                    if kind == "BlockStored" and i < store_at:
                        copies[x] += 1
                        ever |= x == h
                    elif kind == "BlockRemoved":
                        copies[x] = max(0, copies[x] - 1)
        request.truth = "resident_miss" if copies[h] > 0 else "evicted" if ever else "no_match"


# --- the router --------------------------------------------------------------------------------


class Router:
    """Spans as a router with the real OTel SDK emits them (BatchSpanProcessor defaults)."""

    def __init__(self, otlp_grpc: str):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from kvmiss.enricher.core.hashing import BlockHasher, external_hash

        self.provider = TracerProvider(resource=Resource.create({"service.name": "router"}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_grpc, insecure=True)))
        self.tracer = self.provider.get_tracer("kvmiss-field-run")
        self.hasher = BlockHasher(ALGO, seed=SEED, block_size=BLOCK)
        self.external_hash = external_hash

    def chain(self, tokens: list[int]) -> list[int]:
        return [self.external_hash(d) for d in self.hasher.hash_request(tokens)]

    def close(self) -> None:
        self.provider.shutdown()


def send(port: int, request: Request, router: Router | None) -> None:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    x_request_id = uuid.uuid4().hex
    request.request_id = f"cmpl-{x_request_id}-0"  # the id vLLM gives the engine request and llm_request
    body = json.dumps({"model": "tiny", "prompt": request.prompt, "max_tokens": 1, "temperature": 0.0}).encode()
    headers = {"Content-Type": "application/json", "X-Request-Id": x_request_id}
    span = None
    if router is not None:
        span = router.tracer.start_span("router.route", kind=trace.SpanKind.CLIENT)
        TraceContextTextMapPropagator().inject(headers, context=trace.set_span_in_context(span))
        request.trace_id = format(span.get_span_context().trace_id, "032x")
    else:
        request.trace_id = os.urandom(16).hex()
        headers["traceparent"] = f"00-{request.trace_id}-{os.urandom(8).hex()}-01"
    request.sent_at = time.time()
    http = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, method="POST", headers=headers)
    with urllib.request.urlopen(http, timeout=120) as response:
        usage = json.loads(response.read())["usage"]
    request.cached_api = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    if span is not None:
        chain = request.chain
        span.set_attributes({
            "gen_ai.request.id": request.request_id,
            "gen_ai.usage.input_tokens": usage["prompt_tokens"],
            "gen_ai.usage.cache_read.input_tokens": request.cached_api,
            "kvmiss.route.worker": WORKER,
            "kvmiss.block_size": BLOCK,
            "kvmiss.block_hashes": [h - (1 << 64) if h >= 1 << 63 else h for h in chain],
        })
        span.end()


# --- the run -----------------------------------------------------------------------------------


def render_config(ports: dict[str, int], enriched: Path) -> str:
    text = base.render_config(ports, enriched)
    text = text.replace('hash_algo = "sha256"', f'hash_algo = "{ALGO}"\nhash_seed = "{SEED}"')
    assert f'"{ALGO}"' in text
    return text


def rss_mb(pid: int) -> float | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def collect_labels(requests: list[Request], spans: list[dict]) -> None:
    by_trace: dict[str, list[dict]] = collections.defaultdict(list)
    for span in spans:
        by_trace[span["trace_id"]].append(span)
    for request in requests:
        request.labels, request.label_spans = [], []
        for span in by_trace.get(request.trace_id, []):
            label = span["attributes"].get("kvmiss.label")
            if label is not None:
                request.labels.append(label)
                request.label_spans.append(span["name"])
                request.reason = span["attributes"].get("kvmiss.reason")


def summarise(requests: list[Request], mode: str, pacing: str, extra: dict) -> dict:
    judged = [r for r in requests if r.truth is not None]
    misses = [r for r in judged if r.truth not in ("hit", "lookup_limit")]
    wrong = [r for r in judged if r.labels and not r.labels[0].startswith("unknown") and r.labels[0] != r.truth]
    conflicting = [r for r in requests if len(set(r.labels)) > 1]
    doubled = [r for r in requests if len(r.labels) > 1]
    unlabelled = [r for r in requests if not r.labels]
    unknown = [r for r in misses if r.labels and r.labels[0].startswith("unknown")]
    by_truth: dict[str, dict[str, int]] = collections.defaultdict(lambda: collections.Counter())
    for r in judged:
        by_truth[r.truth][r.labels[0] if r.labels else "(none)"] += 1
    return {
        "mode": mode, "pacing": pacing, "requests": len(requests), "with_truth": len(judged),
        "misses": len(misses), "wrong": len(wrong), "unknown": len(unknown),
        "unknown_share_of_misses": round(len(unknown) / len(misses), 4) if misses else 0.0,
        "two_labels": len(conflicting), "labelled_twice": len(doubled), "unlabelled": len(unlabelled),
        "truth_vs_label": {k: dict(v) for k, v in sorted(by_truth.items())},
        "wrong_detail": [{"kind": r.kind, "truth": r.truth, "labels": r.labels, "reason": r.reason} for r in wrong[:10]],
        "unknown_reasons": dict(collections.Counter((r.reason or "")[:90] for r in unknown)),
        **extra,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("router", "plugin", "router+plugin"), default="router")
    parser.add_argument("--pacing", choices=("mixed", "sequential", "back-to-back", "bursts", "idle"), default="mixed")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get("KVMISS_VLLM_VENV", "/work/vllm-venv")))
    parser.add_argument("--scratch", type=Path, default=Path(os.environ.get("KVMISS_VLLM_SCRATCH", "/work/vllm-scratch")))
    parser.add_argument("--setup", action="store_true", help="create the venv / install kvmiss / make the model")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--kvmiss-python", type=Path, default=Path(sys.executable),
                        help="the interpreter whose kvmiss serves (another checkout's venv, for an A/B)")
    parser.add_argument("--capture", type=Path, help="write the engine's first live and replayed messages here")
    args = parser.parse_args(argv)

    scratch = args.scratch.resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    model = scratch / "tiny-model"
    if args.setup:
        base.setup(args.vllm_venv, model, scratch)
    python = args.vllm_venv / "bin" / "python"
    if not python.exists() or not (model / "config.json").exists():
        raise SystemExit(f"no vLLM venv at {args.vllm_venv} or no model at {model}: run with --setup")
    run_dir = scratch / f"field-{args.mode.replace('+', '-')}-{args.pacing}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir()
    ports = {name: base.free_port() for name in ("otlp_grpc", "otlp_http", "metrics", "events", "replay", "vllm")}
    enriched = run_dir / "enriched.jsonl"
    config = run_dir / "kvmiss.toml"
    config.write_text(render_config(ports, enriched))
    requests = workload(args.requests, args.pacing)

    kvmiss = vllm = router = recorder = None
    extra: dict = {}
    try:
        base.say(f"kvmiss serve --config {config}")
        kvmiss = subprocess.Popen([str(args.kvmiss_python), "-m", "kvmiss.enricher.cli", "serve", "--config", str(config)],
                                  stdout=open(run_dir / "kvmiss.log", "w"), stderr=subprocess.STDOUT)
        base.wait_http(f"http://127.0.0.1:{ports['metrics']}/healthz", 30, kvmiss, "kvmiss serve")
        recorder = base.Witness(f"tcp://127.0.0.1:{ports['events']}", keep_frames=CAPTURE_MESSAGES)
        plugins = "kvmiss" if "plugin" in args.mode else "kvmiss-disabled"
        env = {**os.environ, **base.offline_env(scratch), "VLLM_PLUGINS": plugins, "PYTHONHASHSEED": SEED,
               "OTEL_RESOURCE_ATTRIBUTES": f"kvmiss.worker={WORKER}", "OTEL_SERVICE_NAME": "vllm-cpu"}
        command = base.vllm_command(python, model, ports, 0.1) + ["--prefix-caching-hash-algo", ALGO]
        (run_dir / "vllm-command.txt").write_text(" ".join(command) + "\n")
        base.say(f"starting vLLM ({args.mode}, {args.pacing}, {len(requests)} requests)")
        vllm = subprocess.Popen(command, env=env, cwd=scratch, stdout=open(run_dir / "vllm.log", "w"),
                                stderr=subprocess.STDOUT)
        base.wait_http(f"http://127.0.0.1:{ports['vllm']}/health", args.start_timeout, vllm, "vLLM", run_dir / "vllm.log")
        time.sleep(6.0)  # kvmiss's subscriber reconnects with a backoff of up to 5 s
        if "router" in args.mode:
            router = Router(f"http://127.0.0.1:{ports['otlp_grpc']}")
        started = time.monotonic()
        i = 0
        while i < len(requests):
            request = requests[i]
            time.sleep(request.gap_s)
            group = [r for r in requests[i:i + 4] if request.burst and r.burst == request.burst] or [request]
            if router is not None:
                for r in group:
                    r.chain = router.chain(r.prompt)
            threads = [threading.Thread(target=send, args=(ports["vllm"], r, router)) for r in group]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            i += len(group)
            if i % 50 < len(group):
                base.say(f"{i}/{len(requests)} sent; kvmiss RSS {rss_mb(kvmiss.pid):.0f} MB")
        extra["send_seconds"] = round(time.monotonic() - started, 1)
        if router is not None:
            router.close()  # flushes the router's spans
        # vLLM exports llm_request every ~5 s; kvmiss waits up to assemble_wait_s (15 s) for partners.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            collect_labels(requests, base.read_spans(enriched))
            if all(r.labels for r in requests):
                break
            time.sleep(1.0)
        time.sleep(20.0)  # late partners, if any, would show as second labels
        extra["kvmiss_rss_mb"] = rss_mb(kvmiss.pid)
        if args.capture is not None:
            version = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"],
                                     capture_output=True, text=True, env={**os.environ, **base.offline_env(scratch)}
                                     ).stdout.strip().splitlines()[-1]
            last = recorder.batches[-1][0] if recorder.batches else 0  # a short reply, through its end marker
            write_capture(args.capture, version, recorder.frames,
                          capture_replay(f"tcp://127.0.0.1:{ports['replay']}", start=max(0, last - 8)))
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=5) as response:
            metrics = response.read().decode()
        (run_dir / "kvmiss-metrics.txt").write_text(metrics)
        extra["spans_received"] = metric(metrics, "kvmiss_spans_received_total")
        extra["spans_exported"] = metric(metrics, "kvmiss_spans_exported_total")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/readyz", timeout=5) as response:
                extra["readyz"] = response.status
        except urllib.error.HTTPError as exc:
            extra["readyz"] = exc.code
            extra["readyz_body"] = exc.read().decode()[:300]
    finally:
        if recorder is not None:
            recorder.close()
        base.stop(vllm, "vLLM")
        base.stop(kvmiss, "kvmiss serve")

    spans = base.read_spans(enriched)
    extra["spans_in_file"] = len(spans)
    extra["engine_batches"] = len(recorder.batches)
    extra["engine_stream_gaps"] = recorder.gaps
    if "router" not in args.mode:  # the truth needs each request's chain
        from kvmiss.enricher.core.hashing import BlockHasher, external_hash

        hasher = BlockHasher(ALGO, seed=SEED, block_size=BLOCK)
        for r in requests:
            r.chain = [external_hash(d) for d in hasher.hash_request(r.prompt)]
    judge_truth(requests, recorder.batches)
    collect_labels(requests, spans)
    summary = summarise(requests, args.mode, args.pacing, extra)
    summary["run_dir"] = str(run_dir)
    (run_dir / "requests.json").write_text(json.dumps([r.__dict__ | {"prompt": len(r.prompt), "chain": len(r.chain)}
                                                       for r in requests], indent=0))
    text = json.dumps(summary, indent=1)
    (run_dir / "summary.json").write_text(text)
    if args.json:
        args.json.write_text(text)
    print(text)
    ok = (summary["wrong"] == 0 and summary["two_labels"] == 0 and summary["unlabelled"] == 0
          and not recorder.gaps and summary["spans_received"] == summary["spans_exported"])
    base.say("ok" if ok else "NOT OK (see above and " + str(run_dir) + ")")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
