"""Offline attribution: a recording and request records in, attribution records out."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgspec

from kvmiss.collectors.recording import RecordedMessage, RecordingWriter
from kvmiss.schemas.attribution import RequestFacts
from kvmiss.schemas.events import BlockRemoved, BlockStored, EventBatch

H = 2**64 - 77  # >= 2^63: exercises the uint64 path end to end


def live(worker: str, seq: int, ts: float, *events) -> RecordedMessage:
    payload = msgspec.msgpack.encode(EventBatch(ts=ts, events=list(events), dp_rank=0))
    return RecordedMessage(ts + 0.001, worker, "sub", [b"kv", seq.to_bytes(8, "big"), payload])


def write_recording(path) -> None:
    with RecordingWriter(path) as w:
        for seq in range(0, 30):
            events = []
            if seq == 5:
                events = [BlockStored(block_hashes=[H], block_size=16)]
            if seq == 12:
                events = [BlockRemoved(block_hashes=[H])]
            w.write(live("A", seq, 100.0 + seq, *events))
            w.write(live("B", seq, 100.2 + seq,
                         *([BlockStored(block_hashes=[H + 1], block_size=16)] if seq == 3 else [])))


def facts(request_id: str, worker: str, t: float, first_miss: int, **kw) -> bytes:
    return msgspec.json.encode(RequestFacts(
        request_id=request_id, prompt_tokens=40, cached_tokens=16, block_size=16, worker=worker,
        lookup_time=t, block_hashes=[1, first_miss], **kw))


def run_attribute(tmp_path, request_lines: list[bytes], env_extra=None):
    rec, req = tmp_path / "events.kvrec", tmp_path / "requests.jsonl"
    write_recording(rec)
    req.write_bytes(b"\n".join(request_lines) + b"\n")
    env = {"KVMISS_TEST_DIGEST": "offline-test-secret-1234", **(env_extra or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "kvmiss.enricher.cli", "attribute", "--events", str(rec),
         "--requests", str(req), "--digest-key-env", "KVMISS_TEST_DIGEST"],
        capture_output=True, timeout=60, env={**os.environ, **env})
    return proc, [json.loads(x) for x in proc.stdout.splitlines()]


def test_recorded_history_gives_each_request_its_proven_label(tmp_path):
    proc, records = run_attribute(tmp_path, [
        facts("evicted", "A", 120.5, H),
        facts("routing", "A", 120.5, H + 1),
        facts("never", "A", 120.5, H + 2),
        facts("lagging", "A", 500.0, H),
        facts("untracked", "Z", 120.5, H),
        b'{"prompt_tokens": "many"}',
    ])
    assert proc.returncode == 0, proc.stderr
    labels = {r["request_id"]: r["verdict"]["label"] for r in records}
    assert labels == {"evicted": "evicted", "routing": "routing_miss", "never": "no_match",
                      "lagging": "unknown_history", "untracked": "unknown_history"}
    evicted = records[0]["verdict"]
    assert (evicted["stored_seq"], evicted["removed_seq"]) == (5, 12)
    assert evicted["first_miss_digest"].count(":") == 1
    stderr = proc.stderr.decode()
    assert "request line 6" in stderr and "prompt_tokens" in stderr
    assert "evicted" in stderr and "unknown share" in stderr


def test_no_hash_or_secret_leaves_in_records_or_the_summary(tmp_path):
    proc, records = run_attribute(tmp_path, [facts("r", "A", 120.5, H)])
    text = proc.stdout.decode() + proc.stderr.decode()
    for forbidden in (str(H), f"{H:x}", str(H - 2**64), "offline-test-secret-1234"):
        assert forbidden not in text


# --- `kvmiss requests --otlp`: request records from span files --------------------------------


def _sdk_traces():
    """Finished SDK spans of five requests as a router, vLLM and the kvmiss plugin emit them,
    plus an LLM client's span with only its token usage; all ends explicit (ns)."""
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    providers = {}
    for name, resource in (("router", {"service.name": "router"}),
                           ("vllm", {"service.name": "vllm", "kvmiss.worker": "A", "service.instance.id": "i-1"})):
        provider = TracerProvider(resource=Resource.create(resource))
        provider.add_span_processor(SimpleSpanProcessor(memory))
        providers[name] = provider.get_tracer(name)
    router, vllm = providers["router"], providers["vllm"]
    s = 1_000_000_000
    chain = [1, H - 2**64, 7]  # OTel ints are int64: the uint64 chain as two's complement

    def llm(rid, ctx, end, out, start=100 * s):
        vllm.start_span("llm_request", context=ctx, kind=trace.SpanKind.SERVER, start_time=start, attributes={
            "gen_ai.request.id": rid, "gen_ai.usage.prompt_tokens": 40, "gen_ai.usage.completion_tokens": out,
            "gen_ai.latency.time_in_queue": 0.5}).end(end_time=end)

    # 1. router span (lookup time, chain) + llm_request: the engine's end and count win
    route = router.start_span("route", start_time=100 * s, attributes={
        "gen_ai.request.id": "r1", "kvmiss.route.worker": "A", "gen_ai.usage.cache_read.input_tokens": 16,
        "kvmiss.block_hashes": chain, "kvmiss.lookup_time_unix_nano": 101 * s, "gen_ai.usage.output_tokens": 99,
        "kvmiss.token_ids": [5, 6, 7]})
    ctx = trace.set_span_in_context(route)
    router.start_span("kv_transfer", context=ctx, start_time=100 * s, attributes={
        "gen_ai.request.id": "r1", "kvmiss.transfer.result": "failed", "kvmiss.transfer.source": "B"}).end(end_time=101 * s)
    llm("r1", ctx, 110 * s, 12)
    route.end(end_time=112 * s)
    # 2. a router span without a lookup time: it takes llm_request's (start + time in queue)
    route = router.start_span("route", start_time=120 * s, attributes={
        "gen_ai.request.id": "r2", "kvmiss.route.worker": "A", "gen_ai.usage.cache_read.input_tokens": 0,
        "kvmiss.block_hashes": chain})
    llm("r2", trace.set_span_in_context(route), 125 * s, 3, start=120 * s)
    route.end(end_time=126 * s)
    # 3. the plugin's lookup span (engine id, cached count) + llm_request, no router
    root = router.start_span("client", start_time=130 * s)
    ctx = trace.set_span_in_context(root)
    vllm.start_span("kvmiss.prefix_lookup", context=ctx, start_time=131 * s, attributes={
        "gen_ai.request.id": "r3-abcdefgh", "kvmiss.cached_tokens": 16, "gen_ai.usage.input_tokens": 40,
        "kvmiss.block_hashes": chain, "kvmiss.lookup_time_unix_nano": 131 * s, "kvmiss.block_size": 16,
    }).end(end_time=131 * s + 1000)
    llm("r3", ctx, 139 * s, 30, start=130 * s)
    root.end(end_time=140 * s)
    # 4. facts that never complete (no cached tokens anywhere): no record
    router.start_span("route", start_time=150 * s, attributes={"gen_ai.request.id": "r4", "kvmiss.route.worker": "A",
                                                            "gen_ai.usage.input_tokens": 40}).end(end_time=151 * s)
    # 5. an LLM client's span with token usage only: no request of its own
    router.start_span("openai.chat", start_time=160 * s, attributes={"gen_ai.usage.output_tokens": 4}).end(end_time=161 * s)
    return memory.get_finished_spans()


def test_kvmiss_requests_writes_from_span_files_the_records_kvmiss_serve_writes(tmp_path):
    """The same spans through the live pipeline (its verdict callback writing records) and, as
    OTLP/JSON files, through `kvmiss requests`: the same records, spans of one trace joined
    across files, and no prompt material."""
    import asyncio

    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from kvmiss.enricher.core.attribution import Attributor
    from kvmiss.enricher.core.index import ResidencyIndex
    from kvmiss.enricher.otlp.exporter import to_otlp_json
    from kvmiss.enricher.service.offline import read_requests
    from kvmiss.enricher.service.pipeline import Pipeline
    from kvmiss.enricher.service.request_records import encode_record, record_of

    spans = _sdk_traces()
    live_records = []

    class Discard:
        def has_capacity(self, spans):
            return True

        def put(self, request, tag=None):
            return True

    pipe = Pipeline(Attributor(ResidencyIndex(["A"])), Discard(), clock=lambda: 0.0, judge_on_arrival=True,
                    on_verdict=lambda facts, verdict, trace_id: live_records.append(record_of(facts, trace_id)))
    halves = [spans[: len(spans) // 2], spans[len(spans) // 2:]]  # a trace may span two batches, or two files
    for half in halves:
        asyncio.run(pipe.consume(encode_spans(half)))
    pipe.poll(final=True)
    files = []
    for i, half in enumerate(halves):
        files.append(tmp_path / f"spans-{i}.jsonl")
        files[-1].write_text(to_otlp_json(encode_spans(half)) + "\n\nnot json\n")
    out = tmp_path / "requests.jsonl"
    done = subprocess.run([sys.executable, "-m", "kvmiss.enricher.cli", "requests", "--otlp", str(files[0]),
                           "--otlp", str(files[1]), "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "3 request records written" in done.stderr
    assert "1 requests left out (facts incomplete: no cached_tokens)" in done.stderr
    assert done.stderr.count("not an OTLP/JSON export request") == 2  # reported by position
    written = out.read_bytes()
    assert sorted(written.splitlines()) == sorted(encode_record(r) for r in live_records)
    by_id = {r.request_id: r for r in read_requests(written.splitlines())}
    assert set(by_id) == {"r1", "r2", "r3"}
    assert (by_id["r1"].finish_time, by_id["r1"].output_tokens, by_id["r1"].lookup_time) == (110.0, 12, 101.0)
    assert by_id["r1"].block_hashes == [1, H, 7] and by_id["r1"].transfers[0].source == "B"
    assert (by_id["r2"].finish_time, by_id["r2"].lookup_time) == (125.0, 120.5)  # start + time in queue
    assert (by_id["r3"].finish_time, by_id["r3"].output_tokens, by_id["r3"].worker) == (139.0, 30, "A")
    assert b"token_ids" not in written and b"[5,6,7]" not in written
