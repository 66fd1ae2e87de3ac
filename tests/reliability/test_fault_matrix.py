"""The fault matrix, end to end through spans (issue #7, item 3).

Every case runs a real ``kvmiss serve`` process, real ZeroMQ publishers speaking vLLM's
wire protocol (kvmiss's demo publisher, in this process or in a child process that can be
SIGKILLed), a real OTLP/HTTP sink, and sends real OTLP requests. Each asserts

* no span lost: every span kvmiss acknowledged reaches the sink exactly once (the one
  exception, a SIGKILL of kvmiss itself, asserts that what is lost is exactly what kvmiss
  held at the kill, and nothing else);
* no wrong verdict: each request's label is the one the residency the test published
  proves (`Truth`), or an honest ``unknown_*`` where the case says the evidence is gone.

Every wait has a deadline (reliability_rig.WAIT_S); each case takes 2-10 s on the shared
2-core machine.
"""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
from lossy_proxy import LossyProxy
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from reliability_rig import (
    UNKNOWN,
    WAIT_S,
    Kvmiss,
    PublisherProcess,
    Sender,
    Spans,
    Truth,
    assert_exactly_once,
    attributes,
    bring_up,
    check_verdicts,
    labels_at_sink,
    quiet_port,
    router_attrs,
    span_ids,
    wait_applied,
    wait_until,
)

from kvmiss.enricher.otlp.exporter import retry_info_delay


def sdk_spans(n: int, tag: str) -> list:
    """``n`` finished OTel SDK spans (ReadableSpan), exported by the test itself."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "reliability-sdk"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("reliability")
    for i in range(n):
        with tracer.start_as_current_span(f"sdk-{tag}", attributes={"test.sdk": tag, "test.i": i}):
            pass
    provider.shutdown()
    return list(memory.get_finished_spans())


def sdk_ids(spans) -> list[bytes]:
    return [s.context.span_id.to_bytes(8, "big") for s in spans]


def log_count(kvmiss: Kvmiss, text: str) -> int:
    return sum(text in line for line in list(kvmiss.log))


# --- 1. the downstream exporter goes down, then comes back ------------------------------------------


def test_exporter_down_then_back_buffers_within_the_bound_pushes_back_then_flushes_in_order(rig):
    """While the sink is unreachable kvmiss holds at most ``max_pending_spans`` spans (those
    held for attribution included), answers 503 + Retry-After / UNAVAILABLE + RetryInfo
    beyond that, and once the sink is back delivers everything once, in acceptance order.
    The OTel SDK exporter, refused meanwhile, retries and gets through."""
    bound, batch = 1000, 100
    engines = rig.engines(["w0", "w1"])
    sink = rig.sink(start=False)  # down: connection refused
    kvmiss = rig.start_kvmiss({w: engines.endpoints(w) for w in engines.pubs}, sink,
                              max_pending_spans=bound, wait_s=5.0)
    bring_up(kvmiss, engines)
    H, Q = 5001, 5002
    engines.publish("w0", stored=[H])
    t_past = engines.mark()
    wait_applied(kvmiss, dict(engines.seqs))

    spans, sender = Spans(seed=11), Sender(kvmiss.http_port)
    # A request whose lookup time the engine has not reached yet: held for its history wait.
    t_future = engines.clock() + 1.0
    held = spans.request(plain=batch - 1, routers=[router_attrs("held", "w0", H, t_future)], batch="held")
    assert sender.try_once(held) == 200
    plain, refused = [], None
    for i in range(3 * bound // batch):  # bounded: the bound is reached long before
        request = spans.request(plain=batch - 1, routers=[router_attrs(f"r{i}", "w0", Q, t_past)], batch=f"p{i}")
        if sender.try_once(request) != 200:
            refused = request
            break
        plain.append(request)
    assert refused is not None, "kvmiss never pushed back"
    status, retry_after = sender.statuses[-1]
    assert status == 503 and retry_after is not None and float(retry_after) >= 1
    accepted_while_down = len(sender.acked)
    assert accepted_while_down <= bound, f"{accepted_while_down} spans taken in, bound {bound}"
    assert accepted_while_down >= bound - 2 * batch  # and the bound is actually used

    # OTLP/gRPC senders are told the same: UNAVAILABLE with a RetryInfo delay.
    with grpc.insecure_channel(f"127.0.0.1:{kvmiss.grpc_port}") as channel:
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Export(spans.request(plain=batch), timeout=10)
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    assert retry_info_delay(info.value.trailing_metadata()) >= 1.0

    # The held request's lookup time is reached: it is judged and joins the export queue,
    # which is full of what came after it. Nothing may be dropped for lack of room.
    wait_until(lambda: engines.clock() > t_future + 0.01, "engine time past the held lookup")
    engines.tick()
    wait_until(lambda: kvmiss.scrape().get("kvmiss_spans_handed_to_export") >= accepted_while_down,
               "every accepted span handed to the export queue")
    m = kvmiss.scrape()
    assert m.get("kvmiss_spans_handed_to_export") == accepted_while_down
    assert m.by("kvmiss_requests_unenriched", "reason").get("export_refused", 0) == 0

    # Bring the sink back between two of the queue's retries, after the OTel SDK exporter
    # has been refused at least once, so both retry paths are exercised.
    retries_before = kvmiss.scrape().get("kvmiss_export_retries")
    wait_until(lambda: kvmiss.scrape().get("kvmiss_export_retries") > retries_before, "the queue's next retry")
    refused_before = kvmiss.scrape().get("kvmiss_spans_refused")
    sdk_batch = sdk_spans(batch, "while-full")
    sdk_result: list = []
    exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{kvmiss.http_port}/v1/traces", timeout=30)
    thread = threading.Thread(target=lambda: sdk_result.append(exporter.export(sdk_batch)), daemon=True)
    thread.start()
    wait_until(lambda: kvmiss.scrape().get("kvmiss_spans_refused") >= refused_before + batch,
               "the SDK exporter's request refused")
    sink.start()
    sender.send(refused, timeout=30)  # honours Retry-After until accepted
    thread.join(35)
    assert sdk_result == [SpanExportResult.SUCCESS]
    exporter.shutdown()
    for i in range(2):
        assert sender.try_once(spans.request(plain=batch, batch=f"after{i}")) == 200

    acked = sender.acked + sdk_ids(sdk_batch)
    sink.wait_for(len(acked), timeout=30)
    time.sleep(0.3)  # anything extra (a duplicate) would arrive now
    assert_exactly_once(acked, sink)

    # In order: what was buffered during the outage left first, in the order it joined the
    # export queue (the held request joined it when judged, after the other nine), and
    # before anything accepted once the sink was back.
    arrival = [attributes(s)["test.seq"] for s in sink.spans() if "test.seq" in attributes(s)]
    buffered = [attributes(s)["test.seq"] for r in plain + [held] for s in r.resource_spans[0].scope_spans[0].spans]
    assert arrival[:len(buffered)] == buffered, "the outage's backlog left kvmiss out of order"

    got = labels_at_sink(sink)
    expected = {"held": (engines.truth.label("w0", H, t_future),)}
    expected.update({f"r{i}": (engines.truth.label("w0", Q, t_past),) for i in range(len(plain))})
    labels = check_verdicts(got, expected)
    assert labels["held"] == "resident_miss" and labels["r0"] == "no_match"
    m = kvmiss.scrape()
    assert m.by("kvmiss_requests_unenriched", "reason").get("export_refused", 0) == 0
    assert kvmiss.stop() == 0


# --- 2. a publisher process killed while it is sending ---------------------------------------------


def test_a_publisher_killed_mid_stream_leaves_correct_verdicts_or_honest_unknowns(rig):
    """w0's engine runs in a child process streaming one batch per millisecond when it is
    SIGKILLed; a new process then binds the same ports and counts from seq 0 again. kvmiss
    must see the restart (a new epoch), never credit the dead process's blocks to the new
    one, and say nothing it cannot prove about the interval no process was alive."""
    truth = Truth()
    engines = rig.engines(["w1"], truth=truth)
    pub_port, replay_port = quiet_port(), quiet_port()
    old = PublisherProcess(pub_port, replay_port, truth)
    rig.on_close(old.kill)
    sink = rig.sink()
    kvmiss = rig.start_kvmiss({"w0": (f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"),
                               "w1": engines.endpoints("w1")}, sink)

    def tick(publisher: PublisherProcess) -> dict:
        engines.tick()
        return publisher.publish()

    def mark(publisher: PublisherProcess) -> float:
        time.sleep(0.004)
        t = time.time()
        time.sleep(0.004)
        tick(publisher)
        return t

    wait_until(lambda: tick(old) and kvmiss.ready(), "kvmiss /readyz", interval=0.1)
    K1, M1, N = 7001, 7002, 7999
    old.publish(stored=[K1])
    engines.publish("w1", stored=[M1])
    t1 = mark(old)
    wait_applied(kvmiss, {"w0": old.reports[-1]["seq"], "w1": engines.seqs["w1"]})

    old.stream(count=5000, interval_s=0.001, first_block=100_000)  # bounded; killed long before
    old.wait_reports(len(old.reports) + 300)
    old.kill()  # SIGKILL, mid-stream: batches handed over but not yet on the wire die with it
    streamed = [r for r in old.reports if r["stored"] and r["stored"][0] >= 100_000]
    t_mid = (streamed[100]["ts"] + streamed[101]["ts"]) / 2
    last_old = streamed[-1]
    time.sleep(0.05)
    t_dead = time.time()  # no w0 process alive at this engine time
    time.sleep(0.05)

    truth.restart("w0")
    new = PublisherProcess(pub_port, replay_port, truth)  # same ports, seq from 0
    rig.on_close(new.close)
    K2 = 7003
    new.publish(stored=[K2])
    t2 = mark(new)

    def restarted():
        m = kvmiss.scrape()
        return (m.get("kvmiss_stream_epoch_changes", worker="w0") >= 1
                and m.get("kvmiss_stream_quarantined", worker="w0") == 0
                and m.get("kvmiss_stream_last_contiguous_seq", worker="w0") >= new.reports[-1]["seq"])
    wait_until(lambda: restarted() or (tick(new) and False), "kvmiss to follow w0's new process", interval=0.1)
    t3 = mark(new)
    wait_applied(kvmiss, {"w1": engines.seqs["w1"]})

    requests = {  # request id -> (lookup, block, labels allowed)
        "before-K1": (t1, K1, (truth.label("w0", K1, t1),)),
        "before-N": (t1, N, (truth.label("w0", N, t1),)),
        "mid-streamed": (t_mid, streamed[50]["stored"][0], (truth.label("w0", streamed[50]["stored"][0], t_mid),) + UNKNOWN),
        "dead-K1": (t_dead, K1, UNKNOWN),  # no process served w0 then: nothing to prove
        "dead-last": (t_dead, last_old["stored"][0], UNKNOWN),
        "after-K1": (t2, K1, ("no_match",)),  # the old process's block is not the new one's
        "after-last": (t3, last_old["stored"][0], ("no_match",)),
        "after-K2": (t3, K2, ("resident_miss",)),
        "after-M1": (t3, M1, ("routing_miss",)),
    }
    assert truth.label("w0", K1, t2) == "no_match" and truth.label("w0", K2, t3) == "resident_miss"
    spans, sender = Spans(seed=2), Sender(kvmiss.http_port)
    for rid, (t, block, _) in requests.items():
        assert sender.try_once(spans.request(plain=20, routers=[router_attrs(rid, "w0", block, t)])) == 200
    sink.wait_for(len(sender.acked))
    time.sleep(0.3)
    assert_exactly_once(sender.acked, sink)
    labels = check_verdicts(labels_at_sink(sink), {rid: allowed for rid, (_, _, allowed) in requests.items()})
    assert labels["before-K1"] == "resident_miss" and labels["before-N"] == "no_match"
    assert labels["dead-K1"] == "unknown_epoch"
    m = kvmiss.scrape()
    assert m.get("kvmiss_stream_epoch_changes", worker="w0") >= 1
    assert m.get("kvmiss_stream_epoch_changes", worker="w1") == 0
    assert m.get("kvmiss_stream_gaps", worker="w1") == 0


# --- 3. the consumer is away longer than the replay ring ------------------------------------------


def test_a_consumer_outage_longer_than_the_ring_gives_unknown_history_for_that_window(rig):
    """w0's events reach kvmiss through a proxy that stops forwarding (kvmiss's side of the
    connection is away) for longer than w0's 4-batch replay ring. Requests whose lookup
    falls in or after the hole are unknown_history (quarantined) until w0 clears its cache;
    before the hole and after the clear they are proven; a block another worker held at
    the time still proves routing_miss even inside the hole."""
    engines = rig.engines(["w0", "w1"], buffer_steps=4)
    pub_ep, replay_ep = engines.endpoints("w0")
    proxy = LossyProxy(pub_ep, replay_upstream=replay_ep).start()
    rig.on_close(proxy.stop)
    assert proxy.wait_for(lambda p: p.upstream_connects >= 1), "proxy not connected"
    sink = rig.sink()
    kvmiss = rig.start_kvmiss({"w0": (proxy.endpoint, proxy.replay_endpoint),
                               "w1": engines.endpoints("w1")}, sink)
    bring_up(kvmiss, engines)
    X, Y, Z, N, B = 8001, 8002, 8003, 8999, 8100
    engines.publish("w0", stored=[X])
    engines.publish("w1", stored=[B])
    t_before = engines.mark()
    wait_applied(kvmiss, dict(engines.seqs))

    proxy.pause()  # from here kvmiss hears nothing from w0
    received = len(proxy.received)
    engines.publish("w0", stored=[Y])
    engines.publish("w0", removed=[X])
    t_gap = engines.mark()
    for _ in range(8):  # twice the ring: when kvmiss hears w0 again, the ring has moved on
        engines.tick(["w0"])
    assert proxy.wait_for(lambda p: len(p.received) >= received + 11), "w0's batches never reached the proxy"
    proxy.resume()
    t_after = engines.mark()
    wait_until(lambda: kvmiss.scrape().get("kvmiss_stream_quarantined", worker="w0") == 1
               or (engines.tick() and False), "w0 quarantined", interval=0.1)
    wait_applied(kvmiss, dict(engines.seqs))

    engines.publish("w0", cleared=True)  # a known-empty point: the quarantine is over
    engines.publish("w0", stored=[Z])
    t_clear = engines.mark()
    wait_until(lambda: kvmiss.scrape().get("kvmiss_stream_quarantined", worker="w0") == 0,
               "w0 released by its cache clear")
    wait_applied(kvmiss, dict(engines.seqs))

    truth = engines.truth
    q = ("unknown_history",)
    requests = {
        "before-X": (t_before, X, (truth.label("w0", X, t_before),)),
        "before-N": (t_before, N, (truth.label("w0", N, t_before),)),
        "gap-X": (t_gap, X, q), "gap-Y": (t_gap, Y, q), "gap-N": (t_gap, N, q),
        "gap-B": (t_gap, B, (truth.label("w0", B, t_gap),)),  # held by w1: provable anyway
        "after-Y": (t_after, Y, q), "after-N": (t_after, N, q),
        # X and Y were gone at the clear: "not since the clear" is what w0's history proves
        "clear-X": (t_clear, X, ("evicted", "no_match") + UNKNOWN),
        "clear-Y": (t_clear, Y, ("evicted", "no_match") + UNKNOWN),
        "clear-Z": (t_clear, Z, (truth.label("w0", Z, t_clear),)),
        "clear-N": (t_clear, N, (truth.label("w0", N, t_clear),)),
    }
    assert [requests[k][2] for k in ("before-X", "before-N", "gap-B", "clear-Z", "clear-N")] == [
        ("resident_miss",), ("no_match",), ("routing_miss",), ("resident_miss",), ("no_match",)]
    assert truth.label("w0", X, t_gap) == "evicted" and truth.label("w0", Y, t_gap) == "resident_miss"
    spans, sender = Spans(seed=3), Sender(kvmiss.http_port)
    for rid, (t, block, _) in requests.items():
        assert sender.try_once(spans.request(plain=10, routers=[router_attrs(rid, "w0", block, t)])) == 200
    sink.wait_for(len(sender.acked))
    time.sleep(0.3)
    assert_exactly_once(sender.acked, sink)
    got = labels_at_sink(sink)
    check_verdicts(got, {rid: allowed for rid, (_, _, allowed) in requests.items()})
    for rid in ("gap-X", "gap-Y", "gap-N", "after-Y", "after-N"):
        assert got[rid]["kvmiss.history"] == "quarantined", (rid, got[rid]["kvmiss.reason"])
    m = kvmiss.scrape()
    assert m.get("kvmiss_stream_unrecoverable_gaps", worker="w0", reason="missing") == 1
    assert m.get("kvmiss_stream_gaps", worker="w1") == 0


# --- 4. a flood of garbage frames on one worker's socket ------------------------------------------


def garbage(rng: random.Random, near_seq: int) -> list[bytes]:
    """One frame set that is not a valid KV-event batch, of a kind picked at random."""
    kind = rng.randrange(7)
    junk = rng.randbytes(rng.randrange(1, 64))
    if kind == 0:  # wrong number of frames
        return [rng.randbytes(rng.randrange(0, 16)) for _ in range(rng.choice((1, 2, 4, 5)))]
    if kind == 1:  # a sequence frame that is not 8 bytes
        return [b"kv@w0@m", rng.randbytes(rng.choice((0, 4, 7, 9))), junk]
    if kind == 2:  # any sequence number, junk payload
        return [b"kv@w0@m", rng.randbytes(8), junk]
    if kind == 3:  # a plausible sequence number, junk payload
        return [b"kv@w0@m", max(0, near_seq + rng.randrange(-3, 4)).to_bytes(8, "big"), junk]
    if kind == 4:  # valid msgpack, not a batch
        return [b"kv@w0@m", max(0, near_seq + rng.randrange(-3, 4)).to_bytes(8, "big"), b"\x92\x01\xa1x"]
    if kind == 5:  # a topic that is not UTF-8
        return [b"\xff\xfe", max(0, near_seq).to_bytes(8, "big"), junk]
    return [b"kv@w0@m", (2**64 - 2).to_bytes(8, "big"), b"\xc1"]  # near the end marker


def test_a_flood_of_garbage_frames_quarantines_that_worker_and_spares_the_others(rig):
    """3,000 garbage frame sets arrive on w0's SUB socket among its real batches. w0's
    history is broken (quarantined; its verdicts are unknown_* or right), w1 and w2 keep
    continuous streams and proven verdicts: routing_miss throughout, and once w0 clears its
    cache, every label. While w0 is quarantined the others' labels below routing_miss are
    unknown_history by design: w0 might have held the block, so routing cannot be ruled out."""
    engines = rig.engines(["w0", "w1", "w2"], buffer_steps=16)
    pub_ep, replay_ep = engines.endpoints("w0")
    proxy = LossyProxy(pub_ep).start()  # live side only: replay goes straight to w0
    rig.on_close(proxy.stop)
    assert proxy.wait_for(lambda p: p.upstream_connects >= 1), "proxy not connected"
    sink = rig.sink()
    kvmiss = rig.start_kvmiss({"w0": (proxy.endpoint, replay_ep), "w1": engines.endpoints("w1"),
                               "w2": engines.endpoints("w2")}, sink)
    bring_up(kvmiss, engines)
    A0, A1, A2, E2, N = 9000, 9001, 9002, 9003, 9999
    engines.publish("w0", stored=[A0])
    engines.publish("w1", stored=[A1])
    engines.publish("w2", stored=[E2])
    engines.publish("w2", stored=[A2], removed=[E2])
    for _ in range(20):  # more than w0's ring: a replay from seq 0 can no longer rebuild it
        engines.tick(["w0"])
    t_before = engines.mark()
    wait_applied(kvmiss, dict(engines.seqs))
    truth = engines.truth
    spans, sender = Spans(seed=4), Sender(kvmiss.http_port)
    requests: dict[str, tuple[str, float, int, tuple]] = {}

    def ask(rid: str, worker: str, t: float, block: int, allowed: tuple) -> None:
        requests[rid] = (worker, t, block, allowed)
        assert sender.try_once(spans.request(plain=10, routers=[router_attrs(rid, worker, block, t)])) == 200

    for worker in ("w0", "w1", "w2"):  # before the flood: every verdict proven
        for block in (A0, A1, A2, E2, N):
            ask(f"before-{worker}-{block}", worker, t_before, block, (truth.label(worker, block, t_before),))
    sink.wait_for(len(sender.acked))

    rng = random.Random(7)
    injected = 3000
    forwarded = len(proxy.forwarded)
    for i in range(injected):
        proxy.inject(garbage(rng, engines.seqs["w0"] + 1))
        if i % 250 == 0:
            engines.tick()  # real batches keep flowing on every worker, w0 included
    assert proxy.wait_for(lambda p: len(p.forwarded) >= forwarded + injected, timeout=30)
    for _ in range(5):
        engines.tick()
    t_flood = engines.mark()
    wait_applied(kvmiss, {"w1": engines.seqs["w1"], "w2": engines.seqs["w2"]})
    wait_until(lambda: kvmiss.scrape().get("kvmiss_stream_quarantined", worker="w0") == 1
               or (engines.tick() and False), "w0 quarantined", interval=0.1)
    t_quarantined = engines.mark()
    wait_applied(kvmiss, {"w1": engines.seqs["w1"], "w2": engines.seqs["w2"]})

    for t_name, t in (("flood", t_flood), ("quarantined", t_quarantined)):
        for worker in ("w0", "w1", "w2"):
            for block in (A0, A1, A2, E2, N):
                label = truth.label(worker, block, t)
                allowed = (label,) if label == "routing_miss" and block != A0 else (label,) + UNKNOWN
                ask(f"{t_name}-{worker}-{block}", worker, t, block, allowed)

    engines.publish("w0", cleared=True)  # w0's known-empty point: its history is whole again
    t_clear = engines.mark()
    wait_until(lambda: kvmiss.scrape().get("kvmiss_stream_quarantined", worker="w0") == 0
               or (engines.tick() and False), "w0 released by its cache clear", interval=0.1)
    t_clear = engines.mark()
    wait_applied(kvmiss, {"w1": engines.seqs["w1"], "w2": engines.seqs["w2"]})
    for worker in ("w1", "w2"):
        for block in (A0, A1, A2, E2, N):
            ask(f"clear-{worker}-{block}", worker, t_clear, block, (truth.label(worker, block, t_clear),))

    sink.wait_for(len(sender.acked), timeout=30)
    time.sleep(0.3)
    assert_exactly_once(sender.acked, sink)
    got = labels_at_sink(sink)
    labels = check_verdicts(got, {rid: allowed for rid, (_, _, _, allowed) in requests.items()})
    proven = {rid for rid, label in labels.items() if label not in UNKNOWN}
    assert {r for r in requests if r.startswith(("before-", "clear-"))} <= proven
    assert labels["quarantined-w1-9002"] == "routing_miss"  # w2 held it: w0's state is moot
    for rid in (f"quarantined-w0-{b}" for b in (A0, N)):
        assert labels[rid] in UNKNOWN, (rid, got[rid]["kvmiss.reason"])
    m = kvmiss.scrape()
    assert m.by("kvmiss_stream_unrecoverable_gaps", "worker").get("w0", 0) >= 1
    for worker in ("w1", "w2"):
        assert m.get("kvmiss_stream_gaps", worker=worker) == 0
        assert m.get("kvmiss_stream_epoch_changes", worker=worker) == 0
        assert m.get("kvmiss_stream_quarantined", worker=worker) == 0
    assert kvmiss.proc.poll() is None


# --- 5. the engines' clock is skewed against kvmiss's ---------------------------------------------


def wait_histogram(kvmiss: Kvmiss) -> dict[str, float]:
    m = kvmiss.scrape()
    return {l["le"]: v for n, l, v in m.samples if n == "kvmiss_history_wait_seconds_bucket"}


def waits_between(before: dict, after: dict, lo: str, hi: str) -> int:
    """Requests judged since ``before`` whose history wait was in (lo, hi] seconds."""
    return int((after[hi] - before[hi]) - (after[lo] - before[lo]))


SKEW_BOUND_S, PUBLISH_DELAY_S, PROBE_S = 0.5, 0.2, 0.1  # [history] clock_skew_s, publish_delay_s, tail_probe_interval_s


@pytest.mark.parametrize("skew_s", [0.3, -0.3], ids=["engine-ahead-300ms", "engine-behind-300ms"])
def test_clock_skew_between_engines_and_kvmiss_shifts_only_idle_history_waits(rig, skew_s):
    """The engines stamp batches ``skew_s`` off this host's (kvmiss's) clock; routers stamp
    lookup times on the engine clock (as vLLM's span start + queue time is).

    * Verdicts only compare lookup times with batch ts -- one clock -- so they are exact
      either way round, eviction ages included.
    * A busy engine's history reaches a lookup with its next batch (engine clock): the wait
      is one engine step whatever the skew.
    * An idle engine publishes nothing; its history reaches a lookup only through a tail
      probe, sent on kvmiss's clock and trusted through ``sent - clock_skew_s -
      publish_delay_s``. That wait is the one the skew moves: by +skew when the engines run
      ahead, -skew when behind (bounded: at most wait_s, then unknown_history "lagging").
      A lookup step the engine publishes late (within the margin) is still waited for, so
      its removal counts: the verdict stays right while |skew| <= clock_skew_s.
    """
    engines = rig.engines(["w0", "w1"], skew_s=skew_s)
    sink = rig.sink()
    kvmiss = rig.start_kvmiss({w: engines.endpoints(w) for w in engines.pubs}, sink, wait_s=3.0,
                              history={"clock_skew_s": SKEW_BOUND_S, "publish_delay_s": PUBLISH_DELAY_S,
                                       "tail_probe_interval_s": PROBE_S})
    margin = SKEW_BOUND_S + PUBLISH_DELAY_S
    bring_up(kvmiss, engines)
    A, B, E, N, G = 9101, 9102, 9103, 9999, 9104
    engines.publish("w0", stored=[A, E, G])
    engines.publish("w1", stored=[B])
    engines.publish("w0", removed=[E])
    t_past = engines.mark()
    wait_applied(kvmiss, dict(engines.seqs))
    truth = engines.truth
    spans, sender = Spans(seed=5), Sender(kvmiss.http_port)
    expected: dict[str, tuple] = {}
    posted: dict[str, float] = {}

    def ask(rid: str, t: float, block: int) -> None:
        expected[rid] = ()  # filled in once the engine steps around t are known
        posted[rid] = time.monotonic()
        assert sender.try_once(spans.request(plain=5, routers=[router_attrs(rid, "w0", block, t)])) == 200

    def arrived(rid: str) -> float | None:
        for when, request in list(sink.requests):
            for span in request.resource_spans[0].scope_spans[0].spans:
                if span.name == "route" and attributes(span).get("gen_ai.request.id") == rid:
                    return when
        return None

    # (a) lookups in the past: judged on arrival.
    before = wait_histogram(kvmiss)
    for block in (A, B, E, N):
        ask(f"past-{block}", t_past, block)
    sink.wait_for(len(sender.acked))
    after = wait_histogram(kvmiss)
    assert waits_between(before, after, "0.0", "10.0") == 0  # no request waited

    # (b) a busy engine: lookups at the engine's "now", its next steps 100 ms later.
    t_busy = engines.clock()
    for block in (A, B, E, N):
        ask(f"busy-{block}", t_busy, block)
    time.sleep(0.1)
    deadline = time.monotonic() + WAIT_S
    while len(sink.spans()) < len(sender.acked):
        assert time.monotonic() < deadline, "busy-engine verdicts did not arrive"
        engines.tick()
        time.sleep(0.02)
    before, after = after, wait_histogram(kvmiss)
    assert waits_between(before, after, "0.0", "0.5") == 4, "a busy engine's wait moved with the skew"

    # (c) idle engines: only tail probes (kvmiss clock) can show history reached the lookup.
    t_idle = engines.clock()
    ask("idle-A", t_idle, A)
    arrival = wait_until(lambda: arrived("idle-A"), "the idle-engine verdict")
    idle_wait = arrival - posted["idle-A"]
    print(f"idle wait {idle_wait:.3f} s, skew {skew_s}")
    assert margin + skew_s - 0.05 <= idle_wait <= margin + skew_s + PROBE_S + 0.5, (
        f"waited {idle_wait:.3f} s; expected about {margin + skew_s:.2f} s (margin {margin} + skew {skew_s})")

    # (d) the lookup's own step reaches the publisher 150 ms late and removes G (a removal in
    # the step holding the lookup came before it): kvmiss must still be waiting for it.
    t_late = engines.clock()
    ask("late-G", t_late, G)
    time.sleep(0.15)
    engines.publish("w0", removed=[G])
    engines.tick(["w1"])
    wait_until(lambda: arrived("late-G"), "the late-step verdict")

    for rid in expected:
        kind, block = rid.split("-")
        t = {"past": t_past, "busy": t_busy, "idle": t_idle, "late": t_late}[kind]
        block = {"A": A, "G": G}.get(block) or int(block)
        # the step containing t: the first batch at or after t, removals in it count
        expected[rid] = (truth.label("w0", block, t + 0.2 if kind == "late" else t),)
    assert expected["late-G"] == ("evicted",) and expected["idle-A"] == ("resident_miss",)
    sink.wait_for(len(sender.acked))
    time.sleep(0.2)
    assert_exactly_once(sender.acked, sink)
    got = labels_at_sink(sink)
    labels = check_verdicts(got, expected)
    assert [labels[f"past-{b}"] for b in (A, B, E, N)] == ["resident_miss", "routing_miss", "evicted", "no_match"]
    assert [labels[f"busy-{b}"] for b in (A, B, E, N)] == ["resident_miss", "routing_miss", "evicted", "no_match"]
    assert 0 <= got[f"past-{E}"]["kvmiss.eviction_age_ms"] < 100  # an engine-clock difference
    assert all(a.get("kvmiss.history") == "continuous" for a in got.values())


# --- 5b. one engine's clock goes beyond the bound, then comes back -------------------------------


BOUND_S, DELAY_S, WINDOW_S = 0.2, 0.2, 1.0  # [history] clock_skew_s, publish_delay_s, clock_skew_window_s
OFF_S = 1.5  # the skewed engine's clock error: well beyond the bound either way


def out_of_bounds(kvmiss: Kvmiss) -> dict[str, float]:
    m = kvmiss.scrape()
    return {l["worker"]: v for n, l, v in m.samples if n == "kvmiss_stream_clock_out_of_bounds"}


@pytest.mark.parametrize("direction", [-1, +1], ids=["engine-behind-1.5s", "engine-ahead-1.5s"])
def test_an_engine_clock_beyond_the_bound_is_refused_not_guessed_then_judged_again(rig, direction):
    """w1's host clock steps ``OFF_S`` off (its batches and its lookup times move with it);
    w0 and w2 stay right. kvmiss sees it in w1's receive lags (live batches only, sliding
    minimum over ``WINDOW_S``) and, while it lasts:

    * every w1 request is unknown_history, reason "clock skew", whatever the index would
      say -- including a lookup whose own step (removing the block) reaches the publisher
      150 ms late, which a tail probe trusted on a clock running behind would call
      resident_miss (the truth: evicted);
    * w0's and w2's clocks are not flagged; their routing_miss to an in-bound holder stands;
      what rests on w1's timing (w1 as the holder, or ruled out as one) is unknown_history;
    * never a wrong label.

    Once w1's clock is right again (immediately when it had been behind: one quick delivery
    bounds the offset; after the window when it had been ahead), every label is the truth --
    except, when it had been ahead, at the readings the clock set back repeats: those lookups
    cannot be ordered against w1's batches and are unknown_history, reason "clock step",
    until the clock has passed them.

    Without the check (measured): behind, skewed-w1-D came out no_match (truth routing_miss:
    w2's store looked later than w1's lookup) and skewed-w1-late-G resident_miss (truth
    evicted); ahead, skewed-w1-C's eviction age was 1.5 s too old.
    """
    engines = rig.engines(["w0", "w1", "w2"])
    sink = rig.sink()
    kvmiss = rig.start_kvmiss({w: engines.endpoints(w) for w in engines.pubs}, sink, wait_s=3.0,
                              history={"clock_skew_s": BOUND_S, "publish_delay_s": DELAY_S,
                                       "clock_skew_window_s": WINDOW_S, "tail_probe_interval_s": 0.1})
    bring_up(kvmiss, engines)
    A, B, C, D, G, N = 9201, 9202, 9203, 9204, 9205, 9999
    engines.publish("w0", stored=[A])
    engines.publish("w1", stored=[B, C, G])
    engines.publish("w2", stored=[D])
    engines.publish("w1", removed=[C])
    wait_applied(kvmiss, dict(engines.seqs))
    assert out_of_bounds(kvmiss) == {"w0": 0.0, "w1": 0.0, "w2": 0.0}
    truth = engines.truth
    spans, sender = Spans(seed=7), Sender(kvmiss.http_port)
    lookups: dict[str, tuple[str, int, float]] = {}  # rid -> (worker, block, t on the common clock)

    def ask(rid: str, worker: str, block: int, t: float) -> None:
        """``t`` on the fleet's common clock; the span carries it on ``worker``'s own."""
        lookups[rid] = (worker, block, t)
        own = t + engines.worker_skew.get(worker, 0.0)
        assert sender.try_once(spans.request(plain=2, routers=[router_attrs(rid, worker, block, own)])) == 200

    def tick_until(condition, what: str):
        def step():
            engines.tick()
            time.sleep(0.04)
            return condition()
        return wait_until(step, what, interval=0.0)

    # w1's clock steps off; kvmiss must notice from live batches alone.
    engines.worker_skew["w1"] = direction * OFF_S
    tick_until(lambda: out_of_bounds(kvmiss).get("w1") == 1.0, "w1 out of bounds")
    assert out_of_bounds(kvmiss) == {"w0": 0.0, "w1": 1.0, "w2": 0.0}

    t = engines.mark()
    for block in (B, C, N, D):
        ask(f"skewed-w1-{block}", "w1", block, t)
    ask("skewed-w0-D", "w0", D, t)  # held on w2, in bound: proven
    ask("skewed-w0-A", "w0", A, t)  # resident on w0, but w1 (out of bound) cannot be ruled out
    ask("skewed-w2-B", "w2", B, t)  # held on w1, out of bound: not proof
    t_late = engines.clock()
    ask("skewed-w1-late-G", "w1", G, t_late)
    time.sleep(0.15)
    engines.publish("w1", removed=[G])  # the lookup's own step, published late
    engines.tick(["w0", "w2"])
    tick_until(lambda: len(sink.spans()) >= len(sender.acked), "the skewed phase's verdicts")
    got = labels_at_sink(sink)
    assert truth.label("w1", G, t_late + 0.2) == "evicted"
    for rid in (f"skewed-w1-{b}" for b in (B, C, N, D, "late-G")):
        assert got[rid]["kvmiss.label"] == "unknown_history", (rid, got[rid])
        assert got[rid]["kvmiss.reason"].startswith("clock skew:"), got[rid]["kvmiss.reason"]
    assert got["skewed-w0-D"]["kvmiss.label"] == "routing_miss" == truth.label("w0", D, t)
    for rid in ("skewed-w0-A", "skewed-w2-B"):
        assert got[rid]["kvmiss.label"] == "unknown_history", (rid, got[rid])
        assert "clock beyond the skew bound" in got[rid]["kvmiss.reason"]
    assert (truth.label("w0", A, t), truth.label("w2", B, t)) == ("resident_miss", "routing_miss")

    # w1's clock is put right: judged again, every label the truth.
    engines.worker_skew["w1"] = 0.0
    set_right = engines.clock()
    tick_until(lambda: out_of_bounds(kvmiss).get("w1") == 0.0, "w1 back within bounds")
    if direction > 0:
        # Set back 1.5 s, w1's clock repeats readings its batches already carry: a lookup
        # at one of them cannot be ordered against its events (EpochResidency.clock_steps) until
        # the clock passes them, plus the tail margin.
        ask("repeated-w1-B", "w1", B, engines.mark())
        while engines.clock() < set_right + OFF_S + BOUND_S + DELAY_S + 0.1:
            engines.tick()
            time.sleep(0.04)
    t2 = engines.mark()
    after = {"w1": (B, C, N, D), "w0": (A, D, B), "w2": (B, A)}
    for worker, blocks in after.items():
        for block in blocks:
            ask(f"after-{worker}-{block}", worker, block, t2)
    tick_until(lambda: len(sink.spans()) >= len(sender.acked), "the verdicts after")
    time.sleep(0.2)
    assert_exactly_once(sender.acked, sink)
    got = labels_at_sink(sink)
    if direction > 0:
        repeated = got["repeated-w1-B"]
        if lookups["repeated-w1-B"][2] < set_right + OFF_S:  # (else the box was slow: past the repeats)
            assert repeated["kvmiss.label"] == "unknown_history", repeated
            assert repeated["kvmiss.reason"].startswith("clock step:"), repeated
        else:
            assert repeated["kvmiss.label"] in ("unknown_history", truth.label("w1", B, lookups["repeated-w1-B"][2]))
    expected = {rid: (truth.label(w, b, t_),) for rid, (w, b, t_) in lookups.items() if rid.startswith("after-")}
    labels = check_verdicts(got, expected)
    assert [labels[f"after-w1-{b}"] for b in (B, C, N, D)] == ["resident_miss", "evicted", "no_match", "routing_miss"]
    assert [labels[f"after-w0-{b}"] for b in (A, D, B)] == ["resident_miss", "routing_miss", "routing_miss"]
    assert all(got[rid]["kvmiss.history"] == "continuous" for rid in expected)
    assert log_count(kvmiss, "worker w1: engine clock beyond the skew bound") == 1
    assert log_count(kvmiss, "worker w1: engine clock back within the skew bound") == 1
    assert not any("worker w0: engine clock" in l or "worker w2: engine clock" in l for l in kvmiss.log)


# --- 6. kvmiss itself is SIGKILLed and restarted ----------------------------------------------------


def test_kvmiss_sigkilled_loses_nothing_it_acknowledged_the_journal_replays_it(rig):
    """A SIGKILL while kvmiss holds acknowledged spans -- held for assembly or for history, and
    in the export queue (the sink was down) -- loses none of them: the write-ahead journal
    had each body on disk before the OK, and the restarted process replays what was not
    exported before it opens its receivers. It rebuilds w0's history from the publisher's
    replay ring; replayed requests are judged by the same rules (their lookups in the
    future or facts that never complete are honest unknowns), later ones are proven."""
    engines = rig.engines(["w0"])
    sink = rig.sink()
    ports = (quiet_port(), quiet_port(), quiet_port())
    config = dict(ports=ports, wait_s=30.0, assemble_wait_s=30.0, max_pending_spans=5000,
                  journal=str(rig.tmp_path / "spans.journal"))
    kvmiss = rig.start_kvmiss({"w0": engines.endpoints("w0")}, sink, **config)
    bring_up(kvmiss, engines)
    K, N = 9201, 9999
    engines.publish("w0", stored=[K])
    t1 = engines.mark()
    wait_applied(kvmiss, dict(engines.seqs))
    spans, sender = Spans(seed=6), Sender(kvmiss.http_port)

    for i in range(3):  # delivered before the kill
        assert sender.try_once(spans.request(plain=99, routers=[router_attrs(f"early{i}", "w0", K, t1)])) == 200
    sink.wait_for(len(sender.acked))
    delivered_before = len(sender.acked)

    held: list[bytes] = []
    for i in range(2):  # waiting for history: the lookup is a minute in the engine's future
        request = spans.request(plain=99, routers=[router_attrs(f"future{i}", "w0", K, engines.clock() + 60)])
        assert sender.try_once(request) == 200
        held += span_ids(request)
    for i in range(2):  # waiting for the rest of the request: no cached-token count yet
        attrs = router_attrs(f"partial{i}", "w0", K, t1)
        del attrs["gen_ai.usage.cache_read.input_tokens"]
        request = spans.request(plain=99, routers=[attrs])
        assert sender.try_once(request) == 200
        held += span_ids(request)
    sink.stop()
    for i in range(2):  # in the export queue, retrying against the stopped sink
        request = spans.request(plain=100)
        assert sender.try_once(request) == 200
        held += span_ids(request)
    wait_until(lambda: kvmiss.scrape().get("kvmiss_spans_handed_to_export") >= delivered_before + 200,
               "the last two requests in the export queue")
    m = kvmiss.scrape()
    pending_at_kill = m.get("kvmiss_spans_received") - len(sink.spans())
    assert pending_at_kill == len(held) == 600

    kvmiss.kill()
    sink.start()
    # Same ports and journal; shorter waits, so the replayed requests whose facts never
    # complete are given up on quickly (what a verdict waits for is no part of the journal).
    config.update(wait_s=2.0, assemble_wait_s=2.0)
    kvmiss = rig.start_kvmiss({"w0": engines.endpoints("w0")}, sink, **config)
    bring_up(kvmiss, engines)  # w0 replayed from seq 0: the whole history is back
    t2 = engines.mark()
    wait_applied(kvmiss, dict(engines.seqs))
    for rid, t, block in (("late-K-t1", t1, K), ("late-N-t1", t1, N), ("late-K-t2", t2, K)):
        assert sender.try_once(spans.request(plain=99, routers=[router_attrs(rid, "w0", block, t)])) == 200
    sink.wait_for(len(sender.acked), timeout=30)
    time.sleep(0.3)

    delivered = [s.span_id for s in sink.spans()]
    assert set(sender.acked) <= set(delivered), "an acknowledged span was lost"
    assert set(delivered) <= set(sender.acked)
    duplicates = len(delivered) - len(set(delivered))
    m = kvmiss.scrape()
    assert m.get("kvmiss_journal_replayed_spans") == len(held) == 600
    assert duplicates <= m.get("kvmiss_journal_replayed_spans") - len(held)  # at least once: here exactly once
    assert m.get("kvmiss_journal_torn_records") == 0
    labels = check_verdicts(labels_at_sink(sink), {
        "early0": ("resident_miss",), "late-K-t1": ("resident_miss",), "late-N-t1": ("no_match",),
        "late-K-t2": ("resident_miss",), "future0": UNKNOWN, "future1": UNKNOWN,
        "partial0": ("unknown_history",), "partial1": ("unknown_history",)})
    assert labels["late-K-t1"] == "resident_miss"
    assert m.get("kvmiss_spans_received") == 300 + 600  # the new requests and the replayed ones
    assert kvmiss.stop() == 0
