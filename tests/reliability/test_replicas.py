"""Active-active replicas, as examples/collector/replicas.yaml deploys them: two separate
``kvmiss serve`` processes, each subscribed to every worker's event stream, spans spread over
them by trace id (what the Collector's ``loadbalancing`` exporter with ``routing_key: traceID``
does: every span of one trace reaches one replica).

Real parts only: kvmiss's demo publishers (vLLM's wire protocol over ZeroMQ PUB + replay),
each behind a lossy proxy that drops live batches (both replicas recover them by replay), real
OTLP/HTTP posts, one real sink behind both replicas. The truth is what the test published.

Pass: no wrong verdict, every acknowledged span out exactly once, the unknown share of misses
within budget -- with blocks held on every worker, drops on every stream, and one replica
restarted mid-run (its requests are retried until it is back, as a Collector retries).
"""

from __future__ import annotations

import random
import time

from lossy_proxy import LossyProxy
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from reliability_rig import (
    BLOCK,
    PARENT,
    PROMPT_TOKENS,
    TAIL,
    UNKNOWN,
    Kvmiss,
    Sender,
    _set,
    assert_exactly_once,
    attributes,
    bring_up,
    kvmiss_config,
    quiet_port,
    wait_applied,
    wait_until,
)

WORKERS = ["w0", "w1", "w2", "w3"]
UNKNOWN_BUDGET = 0.10  # injected drops are all recoverable: nearly every miss must be proven


class Replica:
    """One ``kvmiss serve`` process on fixed ports (so a restart comes back on the same ones)."""

    def __init__(self, rig, workers: dict[str, tuple[str, str]], sink_port: int, name: str):
        self.rig, self.workers, self.sink_port, self.name = rig, workers, sink_port, name
        self.ports = (quiet_port(), quiet_port(), quiet_port())
        self.kvmiss: Kvmiss | None = None
        self.start()

    def start(self) -> None:
        http, grpc, metrics = self.ports
        text = kvmiss_config(http_port=http, grpc_port=grpc, metrics_port=metrics, sink_port=self.sink_port,
                             workers=self.workers, wait_s=3.0, assemble_wait_s=2.0)
        self.kvmiss = Kvmiss(text, self.rig.tmp_path, http_port=http, metrics_port=metrics, grpc_port=grpc)
        self.rig.on_close(self.kvmiss.kill)


def trace_request(trace_id: bytes, spans: list[tuple[str, dict]], rng: random.Random) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    _set(rs.resource.attributes, "service.name", "replica-test")
    ss = rs.scope_spans.add()
    now = time.time_ns()
    for name, attrs in spans:
        span = ss.spans.add(trace_id=trace_id, span_id=rng.randbytes(8), name=name, kind=2,
                            start_time_unix_nano=now, end_time_unix_nano=now + 1_000_000)
        for key, value in attrs.items():
            _set(span.attributes, key, value)
    return request


def by_trace(trace_id: bytes, replicas: int) -> int:
    """The replica a trace goes to (the Collector hashes the trace id the same way for every span)."""
    return int.from_bytes(trace_id[:8], "big") % replicas


def test_two_replicas_each_following_the_whole_fleet_give_one_right_verdict_per_request(rig):
    rng = random.Random(18)
    engines = rig.engines(WORKERS)
    proxies = {}
    for worker in WORKERS:
        pub, replay = engines.endpoints(worker)
        proxies[worker] = rig_proxy = LossyProxy(pub, replay_upstream=replay).start()
        rig.on_close(rig_proxy.stop)
    subscriptions = {w: (p.endpoint, p.replay_endpoint) for w, p in proxies.items()}
    sink = rig.sink()
    replicas = [Replica(rig, subscriptions, sink.port, f"kvmiss-{i}") for i in range(2)]
    for replica in replicas:
        bring_up(replica.kvmiss, engines)
    senders = [Sender(r.kvmiss.http_port) for r in replicas]

    universe = list(range(5000, 5060))
    expected: dict[str, tuple[str, ...]] = {}
    sent = 0
    for round_ in range(8):
        for worker in WORKERS:  # every worker holds some blocks, evicts others
            seq = engines.seqs.get(worker, -1) + 1
            if rng.random() < 0.5:
                proxies[worker].drop(seq)  # lost live; both replicas must recover it by replay
            engines.publish(worker, stored=rng.sample(universe, 4),
                            removed=rng.sample(universe, 2) if round_ else ())
        t = engines.mark()
        for replica in replicas:
            wait_applied(replica.kvmiss, dict(engines.seqs))
        if round_ == 4:  # one replica restarts: it rebuilds its history from the replay rings
            replicas[1].kvmiss.stop()
            replicas[1].start()
            bring_up(replicas[1].kvmiss, engines)  # (on the same ports: its sender goes on)
        for i in range(12):
            worker, block = rng.choice(WORKERS), rng.choice(universe)
            rid = f"r{round_}-{i}"
            expected[rid] = (engines.truth.label(worker, block, t),)
            trace_id = rng.randbytes(16)
            target = by_trace(trace_id, len(replicas))
            router = {"gen_ai.request.id": rid, "kvmiss.route.worker": worker,
                      "gen_ai.usage.cache_read.input_tokens": BLOCK, "gen_ai.usage.input_tokens": PROMPT_TOKENS,
                      "kvmiss.block_hashes": [PARENT, block, TAIL], "kvmiss.lookup_time_unix_nano": int(t * 1e9)}
            engine = {"gen_ai.request.id": rid, "gen_ai.usage.prompt_tokens": PROMPT_TOKENS}
            # the router's and the engine's exporters send separately, to the same replica
            for spans in ([("route", router)], [("llm_request", engine), ("db", {"db.system": "x"})]):
                assert senders[target].send(trace_request(trace_id, spans, rng)) == 200
                sent += len(spans)
    acked = [s for sender in senders for s in sender.acked]
    assert len(acked) == sent
    sink.wait_for(sent, timeout=30)
    time.sleep(0.5)
    assert_exactly_once(acked, sink)

    labels: dict[str, list[str]] = {}
    for span in sink.spans():
        a = attributes(span)
        if "kvmiss.label" in a:
            labels.setdefault(a["gen_ai.request.id"], []).append(a["kvmiss.label"])
    assert all(len(v) == 1 for v in labels.values()), {k: v for k, v in labels.items() if len(v) > 1}
    assert set(labels) == set(expected)
    wrong = {rid: (labels[rid][0], want) for rid, want in expected.items()
             if labels[rid][0] not in want + UNKNOWN}
    assert not wrong, wrong
    truths = {want[0] for want in expected.values()}
    assert {"routing_miss", "no_match", "resident_miss"} <= truths  # holders everywhere; every kind tried
    misses = list(expected)
    unknown = [rid for rid in misses if labels[rid][0] in UNKNOWN]
    assert len(unknown) <= UNKNOWN_BUDGET * len(misses), [(rid, labels[rid]) for rid in unknown]
    for replica in replicas:
        m = replica.kvmiss.scrape()
        assert m.get("kvmiss_workers_unsubscribed") == 0
        assert m.get("kvmiss_stream_replays_recovered") >= 1  # the drops happened, and were filled
    print(f"{len(misses)} requests, {len(unknown)} unknown, truths {sorted(truths)}")


def test_a_replica_missing_part_of_the_fleet_answers_unknown_never_a_wrong_cause(rig):
    """The deployment error that made sharding by worker wrong: a replica subscribed to half
    the fleet, receiving spans by trace id that name the other half. It cannot rule the other
    half out as holders, so a block held only there is never no_match or evicted."""
    rng = random.Random(7)
    engines = rig.engines(WORKERS)
    sink = rig.sink()
    half = {w: engines.endpoints(w) for w in WORKERS[:2]}
    kvmiss = rig.start_kvmiss(half, sink, wait_s=2.0)
    bring_up(kvmiss, engines, workers=WORKERS[:2])
    held_elsewhere, never = 6001, 6002
    engines.publish("w3", stored=[held_elsewhere])
    t = engines.mark()
    wait_applied(kvmiss, {w: engines.seqs[w] for w in WORKERS[:2]})
    sender = Sender(kvmiss.http_port)

    def request(rid: str, worker: str, block: int) -> ExportTraceServiceRequest:
        return trace_request(rng.randbytes(16), [("route", {
            "gen_ai.request.id": rid, "kvmiss.route.worker": worker, "gen_ai.usage.cache_read.input_tokens": BLOCK,
            "gen_ai.usage.input_tokens": PROMPT_TOKENS, "kvmiss.block_hashes": [PARENT, block, TAIL],
            "kvmiss.lookup_time_unix_nano": int(t * 1e9)})], rng)

    assert sender.send(request("on-w3", "w3", never)) == 200  # the fleet is larger than this replica follows
    assert sender.send(request("routed", "w0", held_elsewhere)) == 200  # truth: routing_miss (w3 held it)
    assert sender.send(request("never", "w0", never)) == 200  # truth: no_match, not provable here
    assert engines.truth.label("w0", held_elsewhere, t) == "routing_miss"
    sink.wait_for(3)
    got = {attributes(s)["gen_ai.request.id"]: attributes(s) for s in sink.spans()}
    assert got["on-w3"]["kvmiss.history"] == "untracked"
    for rid in ("routed", "never"):
        assert got[rid]["kvmiss.label"] == "unknown_history", (rid, got[rid]["kvmiss.reason"])
        assert "not subscribed to" in got[rid]["kvmiss.reason"]
    wait_until(lambda: kvmiss.scrape().get("kvmiss_workers_unsubscribed") == 1, "the unsubscribed gauge")
