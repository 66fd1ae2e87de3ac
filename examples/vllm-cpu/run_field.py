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
  block chain -- and no lookup time: kvmiss takes it from ``llm_request``. ``--router-spans``
  says what else: nothing (``spans-md``), the report mode of full-report requests
  (``report-mode``), or that too and that each request read the cache (``all``). The kvmiss
  plugin is off. ``plugin``: no router span; the kvmiss plugin writes the lookup span. ``router+plugin``:
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
import engine_truth  # noqa: E402  (the oracle: the engine's stream and vLLM's hit rule)
import run_e2e as base  # noqa: E402  (the walkthrough's set-up, processes and span reading)

BLOCK = base.BLOCK
WORKER = base.WORKER
SEED = "0"  # PYTHONHASHSEED on the engine = [engine] hash_seed
ALGO = "sha256_cbor"
POOL_BLOCKS = 16
MAX_PROMPT = 250  # vLLM runs with --max-model-len 256 and one output token
# What the router's spans say beyond SPANS.md's inputs (--router-spans).
ROUTER_SPANS = ("spans-md", "report-mode", "all")


# --- the workload ------------------------------------------------------------------------------


@dataclass
class Request:
    kind: str
    prompt: list[int]
    gap_s: float  # pause before sending it
    burst: int = 0  # requests of one burst are sent together
    concurrent: bool = False  # sent through the pool that keeps --in-flight requests in flight
    full_report: bool = False  # kv_cache_report_mode "full" (vllm_xargs)
    request_id: str = ""
    trace_id: str = ""
    sent_at: float = 0.0
    done_at: float = 0.0
    lookup_time: float | None = None  # from llm_request: span start + time in queue (engine clock)
    lookup_time_latest: float | None = None  # span start + time to first token - prefill time
    skip_reading: bool | None = None  # skip_reading_prefix_cache, as kvmiss was told it
    earlier_lookups: list = field(default_factory=list)  # the plugin's lookups before admission
    cached_api: int | None = None
    chain: list[int] = field(default_factory=list)
    truth: str | None = None
    excluded: str | None = None  # why the oracle did not judge it (ambiguous, ...)
    truth_detail: dict = field(default_factory=dict)
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
            prompt = prompt[:MAX_PROMPT]  # with a large block (--hash-block 96) the share alone may be 288
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


def hybrid_workload(n: int, seed: int = 11) -> list[Request]:
    """A Gemma-3-style hybrid (window W = 64 = two 32-token blocks) first meets the designed
    cases of ATTRIBUTION.md, then the mixed workload: P cold and again (hit); Q sharing P's
    first 64 tokens (the full-attention group holds them, the window group never kept them:
    window_limit); R sharing P's first 128; a block-multiple prompt twice; fillers that evict
    P; P again (evicted, read in the full-attention group) and once more (hit)."""
    rng = random.Random(seed)
    p = base.prompt(rng.randrange(1 << 30), 200)
    s = base.prompt(rng.randrange(1 << 30), 128)
    designed = [
        Request("hybrid_P_cold", p, 0.07), Request("hybrid_P_repeat", list(p), 0.07),
        Request("hybrid_Q_shares_64", p[:64] + base.prompt(rng.randrange(1 << 30), 66), 0.07),
        Request("hybrid_R_shares_128", p[:128] + base.prompt(rng.randrange(1 << 30), 40), 0.07),
        Request("hybrid_S_cold_128", s, 0.07), Request("hybrid_S_repeat_128", list(s), 0.07),
    ]
    designed += [Request("filler", base.prompt(rng.randrange(1 << 30), 200), 0.07) for _ in range(6)]
    designed += [Request("hybrid_P_after_fillers", list(p), 0.07), Request("hybrid_P_again", list(p), 0.07),
                 Request("hybrid_Q2_shares_64", p[:64] + base.prompt(rng.randrange(1 << 30), 50), 0.07)]
    return designed + workload(max(0, n - len(designed)), "sequential", seed)


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


def judge_truth(requests: list[Request], batches: list[tuple[int, float, list]]) -> dict:
    """Each request's true label from the engine's own stream (engine_truth.py)."""
    stream = engine_truth.Stream(batches, BLOCK)  # (the module's BLOCK: --hash-block)
    lookups = [engine_truth.Lookup(str(i), r.chain, len(r.prompt), r.cached_api, r.sent_at, r.done_at, r.full_report)
               for i, r in enumerate(requests) if r.cached_api is not None]
    stream.note_lookups(lookups)
    re_announcements = stream.mark_re_announcements(lookups)
    for lk in lookups:
        r = requests[int(lk.key)]
        t = stream.judge(lk)
        r.truth, r.excluded = t.label, t.excluded
        r.truth_detail = {"predicted": t.predicted, "limiting_group": t.limiting_group, "step": t.step,
                          "reading": t.reading, **t.detail}
    return {"groups": {g.idx: {"kind": g.kind, "window": g.window, "block_size": g.block_size}
                       for g in stream.groups.values()},
            "re_announcements_skipped": re_announcements, "unmodelled_kinds": stream.unmodelled}


# --- the router --------------------------------------------------------------------------------


class Router:
    """Spans as a router with the real OTel SDK emits them (BatchSpanProcessor defaults)."""

    def __init__(self, otlp_grpc: str, spans: str = "all"):
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
        self.spans = spans  # ROUTER_SPANS: which attributes beyond SPANS.md's inputs it sets

    def chain(self, tokens: list[int]) -> list[int]:
        return [self.external_hash(d) for d in self.hasher.hash_request(tokens)]

    def close(self) -> None:
        self.provider.shutdown()


def send(port: int, request: Request, router: Router | None) -> None:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    x_request_id = uuid.uuid4().hex
    request.request_id = f"cmpl-{x_request_id}-0"  # the id vLLM gives the engine request and llm_request
    body = {"model": "tiny", "prompt": request.prompt, "max_tokens": 1, "temperature": 0.0}
    if request.full_report:  # vLLM 0.32+: re-announce the reused chain (SamplingParams.extra_args)
        body["vllm_xargs"] = {"kv_cache_report_mode": "full"}
    body = json.dumps(body).encode()
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
    request.done_at = time.time()
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
        if request.full_report and router.spans != "spans-md":
            # The router set vllm_xargs, so it says so: only the request tells its
            # re-announcement apart from a second copy (docs/VLLM.md, "Router spans").
            span.set_attribute("kvmiss.kv_cache_report_mode", "full")
        if router.spans == "all":  # it asks for no prompt logprobs: vLLM reads the cache for every request
            span.set_attribute("kvmiss.skip_reading_prefix_cache", False)
        span.end()


def mark_modes(requests: list[Request], in_flight: int, concurrent_share: float, full_report_share: float) -> None:
    """Full reports on a seeded share of the requests; with ``in_flight`` > 1, the last
    ``concurrent_share`` of the run (the designed cases stay sequential) goes through the pool."""
    rng = random.Random(5)
    for r in requests:
        r.full_report = rng.random() < full_report_share
    if in_flight > 1:
        for r in requests[int(len(requests) * (1 - concurrent_share)):]:
            r.concurrent, r.burst, r.gap_s = True, 0, 0.0


def send_in_flight(port: int, requests: list[Request], router: Router | None, in_flight: int) -> None:
    """Real concurrent traffic: ``in_flight`` clients, each sending its next request as soon as
    its last one is answered, so the engine schedules several requests per step."""
    import concurrent.futures

    if router is not None:
        for r in requests:
            r.chain = router.chain(r.prompt)
    with concurrent.futures.ThreadPoolExecutor(in_flight) as pool:
        for future in [pool.submit(send, port, r, router) for r in requests]:
            future.result()


def read_request_records(requests: list[Request], path: Path) -> None:
    """The lookup time kvmiss used for each request, and the latest it can have been when
    that came from ``llm_request`` (its ``[export] request_records``)."""
    by_trace = {r.trace_id: r for r in requests}
    if not path.exists():
        return
    for line in path.read_text().splitlines():
        record = json.loads(line)
        r = by_trace.get(record.get("trace_id"))
        if r is not None and record.get("lookup_time") is not None:
            r.lookup_time = record["lookup_time"]
            r.lookup_time_latest = record.get("lookup_time_latest")
        if r is not None:
            r.skip_reading = record.get("skip_reading_prefix_cache")
            r.earlier_lookups = record.get("earlier_lookups") or []


def write_run_capture(path: Path, recorder, requests: list[Request], summary: dict) -> None:
    """The whole run as a test fixture: every live message as the engine sent it (frames in
    base64, receive time), then one line per request with what kvmiss was given (chain, counts,
    lookup time), the oracle's truth and kvmiss's live label. No token ids: chains only."""
    import base64
    import gzip

    with (gzip.open(path, "wt") if path.suffix == ".gz" else open(path, "w")) as out:
        out.write(json.dumps({"run": {k: summary[k] for k in (
            "arch", "mode", "in_flight", "pool_blocks", "groups", "requests", "with_truth", "misses", "wrong",
            "unknown", "excluded", "re_announcements_skipped", "unmodelled_kinds")}
                                     | {k: summary[k] for k in ("router_spans",) if k in summary}}) + "\n")
        for frames, (seq, recv, _) in zip(recorder.all_frames, recorder.batches):
            out.write(json.dumps({"source": "live", "seq": seq, "recv_ts": recv,
                                  "frames": [base64.b64encode(f).decode() for f in frames]}) + "\n")
        for r in requests:
            out.write(json.dumps({"request": {
                "kind": r.kind, "prompt_tokens": len(r.prompt), "cached_tokens": r.cached_api, "block_size": BLOCK,
                "worker": WORKER, "lookup_time": r.lookup_time, "lookup_time_latest": r.lookup_time_latest,
                "block_hashes": r.chain,
                "full_report": r.full_report, "skip_reading_prefix_cache": r.skip_reading,
                "earlier_lookups": r.earlier_lookups,
                "concurrent": r.concurrent, "sent_at": r.sent_at, "done_at": r.done_at,
                "truth": r.truth, "excluded": r.excluded, "kvmiss_live": r.labels[0] if r.labels else None}}) + "\n")


# --- the run -----------------------------------------------------------------------------------


def render_config(ports: dict[str, int], enriched: Path) -> str:
    text = base.render_config(ports, enriched)
    text = text.replace('hash_algo = "sha256"', f'hash_algo = "{ALGO}"\nhash_seed = "{SEED}"')
    records = json.dumps(str(enriched.with_name("request-records.jsonl")))
    text = text.replace("[export]\n", f"[export]\nrequest_records = {records}\n", 1)
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


# kvmiss's own counters the summary reports (tests/enricher/service/test_metrics.py checks that
# kvmiss declares each; `metric` refuses a name it does not).
REPORTED_METRICS = (
    "kvmiss_index_re_announced_stores_total", "kvmiss_index_re_announced_blocks_total",
    "kvmiss_index_re_announced_confirmed_total", "kvmiss_index_uncounted_copies_removed_total",
    "kvmiss_index_stale_partial_stores_total", "kvmiss_index_stores_without_hashes_total", "kvmiss_stream_gaps_total",
    "kvmiss_stream_batches_applied_total")


class MissingMetric(LookupError):
    """A metric the run reports is not on kvmiss's /metrics at all: a misspelt or renamed
    name, which must never read as 0."""


def metric(text: str, name: str) -> float:
    """The sum of ``name``'s samples on a Prometheus text page. A family that is declared
    (``# TYPE``) with no sample yet (a labelled counter never incremented) is 0; a name the
    page does not declare raises `MissingMetric`."""
    total, found = 0.0, False
    family = name.removesuffix("_total")
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
            found = True
        elif line.startswith("# TYPE ") and line.split()[2] in (name, family):
            found = True
    if not found:
        raise MissingMetric(f"kvmiss's /metrics has no metric {name!r}")
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
    # A miss a group kvmiss does not model cut (Mamba state): the right answer is an honest
    # unknown_history naming the kind; other unknowns count against the budget.
    unknown = [r for r in misses if r.truth != "unknown_history" and r.labels and r.labels[0].startswith("unknown")]
    by_truth: dict[str, dict[str, int]] = collections.defaultdict(lambda: collections.Counter())
    for r in judged:
        by_truth[r.truth][r.labels[0] if r.labels else "(none)"] += 1
    excluded = collections.Counter((r.excluded or "").split(":")[0] for r in requests if r.excluded)
    kinds = extra.get("unmodelled_kinds") or []
    unmodelled = [r for r in judged if r.truth == "unknown_history"]
    unmodelled_ok = [r for r in unmodelled if r.labels[:1] == ["unknown_history"]
                     and any(k in (r.reason or "") for k in kinds)]
    return {
        "mode": mode, "pacing": pacing, "requests": len(requests), "with_truth": len(judged),
        "excluded": dict(excluded), "misses": len(misses), "wrong": len(wrong), "unknown": len(unknown),
        "unknown_share_of_misses": round(len(unknown) / len(misses), 4) if misses else 0.0,
        "two_labels": len(conflicting), "labelled_twice": len(doubled), "unlabelled": len(unlabelled),
        "truth_vs_label": {k: dict(v) for k, v in sorted(by_truth.items())},
        "wrong_detail": [{"kind": r.kind, "truth": r.truth, "labels": r.labels, "reason": r.reason,
                          "cached": r.cached_api, "tokens": len(r.prompt), "oracle": r.truth_detail}
                         for r in wrong[:10]],
        "unknown_reasons": dict(collections.Counter((r.reason or "")[:90] for r in unknown)),
        "designed": {r.kind: {"truth": r.truth, "label": r.labels[0] if r.labels else None, "cached": r.cached_api}
                     for r in requests if r.kind.startswith("hybrid_")},
        "unmodelled_misses": len(unmodelled), "unmodelled_unknown_naming_kind": len(unmodelled_ok),
        "concurrent_requests": sum(r.concurrent for r in requests),
        "full_report_requests": sum(r.full_report for r in requests),
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
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--arch", choices=("llama", "gemma3", "granite-hybrid", "qwen3-next"), default="llama",
                        help="the tiny model (make_tiny_model.py): gemma3 is a sliding-window hybrid, "
                             "granite-hybrid / qwen3-next a Mamba / linear-attention one")
    parser.add_argument("--dtype", default="float32", help="vLLM's --dtype (vLLM's CPU GDN layers need bfloat16)")
    parser.add_argument("--hash-block", type=int, default=base.BLOCK,
                        help="the engine's block size for hashing, as its events show it: a Mamba hybrid's "
                             "attention block grows to hold a layer's state (96 tokens for the tiny qwen3-next); "
                             "the router's chains, the oracle and the workload use it")
    parser.add_argument("--workload", choices=("field", "hybrid"), default="field",
                        help="hybrid: the designed window cases first, then the field mix")
    parser.add_argument("--pool-blocks", type=int, default=POOL_BLOCKS, help="--num-gpu-blocks-override")
    parser.add_argument("--in-flight", type=int, default=1,
                        help="keep this many requests in flight (concurrent traffic: several requests "
                             "per engine step) for a share of the run: --concurrent-share")
    parser.add_argument("--concurrent-share", type=float, default=0.5)
    parser.add_argument("--full-report-share", type=float, default=0.0,
                        help='share of requests sent with vllm_xargs {"kv_cache_report_mode": "full"}')
    parser.add_argument("--router-spans", choices=ROUTER_SPANS, default="all",
                        help="the router's span attributes: spans-md = exactly SPANS.md's inputs; report-mode = "
                             "those and kvmiss.kv_cache_report_mode on requests sent in full report mode; "
                             "all = also kvmiss.skip_reading_prefix_cache = false on every request")
    parser.add_argument("--capture-run", type=Path,
                        help="write the whole run (every live message, kvmiss's request records, the truth) "
                             "as a test fixture (tests/data/engines/)")
    parser.add_argument("--kvmiss-python", type=Path, default=Path(sys.executable),
                        help="the interpreter whose kvmiss serves (another checkout's venv, for an A/B)")
    parser.add_argument("--capture", type=Path, help="write the engine's first live and replayed messages here")
    args = parser.parse_args(argv)
    global BLOCK
    BLOCK = args.hash_block

    scratch = args.scratch.resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    model = scratch / ("tiny-model" if args.arch == "llama" else f"tiny-{args.arch}")
    if args.setup:
        base.setup(args.vllm_venv, model, scratch, arch=args.arch)
    python = args.vllm_venv / "bin" / "python"
    if not python.exists() or not (model / "config.json").exists():
        raise SystemExit(f"no vLLM venv at {args.vllm_venv} or no model at {model}: run with --setup")
    run_dir = scratch / f"field-{args.arch}-{args.mode.replace('+', '-')}-{args.pacing}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir()
    ports = {name: base.free_port() for name in ("otlp_grpc", "otlp_http", "metrics", "events", "replay", "vllm")}
    enriched = run_dir / "enriched.jsonl"
    config = run_dir / "kvmiss.toml"
    config.write_text(render_config(ports, enriched))
    requests = (hybrid_workload(args.requests) if args.workload == "hybrid" else workload(args.requests, args.pacing))
    mark_modes(requests, args.in_flight, args.concurrent_share, args.full_report_share)

    kvmiss = vllm = router = recorder = None
    extra: dict = {}
    metrics = ""
    try:
        base.say(f"kvmiss serve --config {config}")
        kvmiss = subprocess.Popen([str(args.kvmiss_python), "-m", "kvmiss.enricher.cli", "serve", "--config", str(config)],
                                  stdout=open(run_dir / "kvmiss.log", "w"), stderr=subprocess.STDOUT, env=base.kvmiss_env())
        base.wait_http(f"http://127.0.0.1:{ports['metrics']}/healthz", 30, kvmiss, "kvmiss serve")
        recorder = base.Witness(f"tcp://127.0.0.1:{ports['events']}", keep_frames=CAPTURE_MESSAGES,
                                keep_all=args.capture_run is not None)
        plugins = "kvmiss" if "plugin" in args.mode else "kvmiss-disabled"
        env = {**os.environ, **base.offline_env(scratch), "VLLM_PLUGINS": plugins, "PYTHONHASHSEED": SEED,
               "OTEL_RESOURCE_ATTRIBUTES": f"kvmiss.worker={WORKER}", "OTEL_SERVICE_NAME": "vllm-cpu"}
        command = base.vllm_command(python, model, ports, 0.1, args.pool_blocks) + ["--prefix-caching-hash-algo", ALGO]
        command[command.index("--dtype") + 1] = args.dtype
        (run_dir / "vllm-command.txt").write_text(" ".join(command) + "\n")
        base.say(f"starting vLLM ({args.arch}, {args.mode}, {args.pacing}, {len(requests)} requests, "
                 f"{args.in_flight} in flight for {sum(r.concurrent for r in requests)}, "
                 f"{sum(r.full_report for r in requests)} with full reports)")
        vllm = subprocess.Popen(command, env=env, cwd=scratch, stdout=open(run_dir / "vllm.log", "w"),
                                stderr=subprocess.STDOUT)
        base.wait_http(f"http://127.0.0.1:{ports['vllm']}/health", args.start_timeout, vllm, "vLLM", run_dir / "vllm.log")
        time.sleep(6.0)  # kvmiss's subscriber reconnects with a backoff of up to 5 s
        if "router" in args.mode:
            router = Router(f"http://127.0.0.1:{ports['otlp_grpc']}", args.router_spans)
        started = time.monotonic()
        i = 0
        while i < len(requests):
            request = requests[i]
            if request.concurrent:  # a run of concurrent requests: --in-flight of them at all times
                j = i
                while j < len(requests) and requests[j].concurrent:
                    j += 1
                send_in_flight(ports["vllm"], requests[i:j], router, args.in_flight)
                i = j
                base.say(f"{i}/{len(requests)} sent ({args.in_flight} in flight); kvmiss RSS {rss_mb(kvmiss.pid):.0f} MB")
                continue
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
        extra["spans_exported"] = metric(metrics, "kvmiss_spans_handed_to_export_total")
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
    extra.update(judge_truth(requests, recorder.batches))
    collect_labels(requests, spans)
    read_request_records(requests, run_dir / "request-records.jsonl")
    extra["arch"], extra["in_flight"], extra["pool_blocks"] = args.arch, args.in_flight, args.pool_blocks
    if "router" in args.mode:
        extra["router_spans"] = args.router_spans
    extra["kvmiss_metrics"] = {name: metric(metrics, name) for name in REPORTED_METRICS}
    summary = summarise(requests, args.mode, args.pacing, extra)
    if args.capture_run is not None:
        write_run_capture(args.capture_run, recorder, requests, summary)
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
