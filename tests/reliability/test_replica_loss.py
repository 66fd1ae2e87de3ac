"""Losing one of two active-active replicas mid-load (examples/collector/replicas.yaml).

Two ``kvmiss serve`` processes follow the whole fleet; spans are spread by trace id. One
replica is SIGKILLed while it holds spans it has acknowledged. What the test proves:

* the other replica goes on: every span it acknowledged, before and after the kill, reaches
  the sink exactly once with the right verdicts;
* nothing it had acknowledged is lost: kvmiss answered 200 for those, so no Collector
  retries them, and the write-ahead journal replays them when the replica comes back
  (``kvmiss_journal_replayed_spans_total``);
* what was sent to the dead replica while it was down is refused at the socket, so the
  sender (the Collector's per-replica queue) retries it, and it arrives once the replica is
  back, enriched from the history it rebuilt from the replay rings.
"""

from __future__ import annotations

import random
import time

from reliability_rig import (
    BLOCK,
    PARENT,
    PROMPT_TOKENS,
    TAIL,
    Kvmiss,
    Sender,
    attributes,
    bring_up,
    kvmiss_config,
    post,
    quiet_port,
    wait_applied,
    wait_until,
)
from test_replicas import by_trace, trace_request

WORKERS = ["w0", "w1"]


def start(rig, workers, sink, ports, journal, wait_s: float = 30.0) -> Kvmiss:
    http, grpc, metrics = ports
    text = kvmiss_config(http_port=http, grpc_port=grpc, metrics_port=metrics, sink_port=sink.port, workers=workers,
                         wait_s=wait_s, assemble_wait_s=wait_s, journal=journal)
    kvmiss = Kvmiss(text, rig.tmp_path, http_port=http, metrics_port=metrics, grpc_port=grpc)
    rig.on_close(kvmiss.kill)
    return kvmiss


def test_a_replica_killed_mid_load_loses_nothing_it_had_acknowledged(rig):
    rng = random.Random(14)
    engines = rig.engines(WORKERS)
    workers = {w: engines.endpoints(w) for w in WORKERS}
    sink = rig.sink()
    ports = [(quiet_port(), quiet_port(), quiet_port()) for _ in range(2)]
    journals = [str(rig.tmp_path / f"journal-{i}") for i in range(2)]
    replicas = [start(rig, workers, sink, ports[i], journals[i]) for i in range(2)]
    for replica in replicas:
        bring_up(replica, engines)
    held, never_held = 5001, 5002
    engines.publish("w1", stored=[held])
    t = engines.mark()
    for replica in replicas:
        wait_applied(replica, dict(engines.seqs))
    senders = [Sender(r.http_port) for r in replicas]

    def request(rid: str, *, lookup: float, complete: bool = True):
        trace_id = rng.randbytes(16)
        attrs = {"gen_ai.request.id": rid, "kvmiss.route.worker": "w0", "gen_ai.usage.input_tokens": PROMPT_TOKENS,
                 "kvmiss.block_hashes": [PARENT, held if rid.endswith("routed") else never_held, TAIL],
                 "kvmiss.lookup_time_unix_nano": int(lookup * 1e9)}
        if complete:
            attrs["gen_ai.usage.cache_read.input_tokens"] = BLOCK
        return by_trace(trace_id, 2), trace_request(trace_id, [("route", attrs), ("db", {"db.system": "x"})], rng)

    expected: dict[str, str] = {}
    for i in range(20):  # before the kill: judged and delivered by both replicas
        rid = f"before-{i}-" + ("routed" if i % 2 else "never")
        target, body = request(rid, lookup=t)
        assert senders[target].send(body) == 200
        expected[rid] = "routing_miss" if i % 2 else "no_match"
    sink.wait_for(len(senders[0].acked) + len(senders[1].acked))

    # Replica 1 holds spans it acknowledged: requests whose cached-token count never comes.
    pending: list[bytes] = []
    while len(pending) < 6:
        target, body = request(f"held-{len(pending)}", lookup=t, complete=False)
        if target == 1:
            assert senders[1].try_once(body) == 200
            pending += [s.span_id for rs in body.resource_spans for ss in rs.scope_spans for s in ss.spans]
    replicas[1].kill()

    # Load goes on. Replica 0 takes its share; replica 1's share is refused at the socket and
    # queued by the sender, as the Collector's per-replica sending queue does.
    queued = []
    for i in range(20):
        rid = f"during-{i}-" + ("routed" if i % 2 else "never")
        target, body = request(rid, lookup=t)
        expected[rid] = "routing_miss" if i % 2 else "no_match"
        if target == 0:
            assert senders[0].send(body) == 200
        else:
            try:
                status, _ = post(ports[1][0], body, timeout=2)
            except OSError:  # connection refused: nothing was accepted
                status = None
            assert status is None
            queued.append(body)
    first_share = len(senders[0].acked)
    wait_until(lambda: len([s for s in sink.spans() if s.span_id in set(senders[0].acked)]) == first_share,
               "replica 0's spans delivered while replica 1 is down")

    # Same ports and journal (short waits: the replayed requests' facts never complete).
    replicas[1] = start(rig, workers, sink, ports[1], journals[1], wait_s=2.0)
    bring_up(replicas[1], engines)  # history rebuilt from the replay rings
    wait_applied(replicas[1], dict(engines.seqs))
    for body in queued:  # the queue drains into the replica that is back
        assert senders[1].send(body) == 200
    acked = senders[0].acked + senders[1].acked
    sink.wait_for(len(acked), timeout=30)
    time.sleep(0.3)

    delivered = [s.span_id for s in sink.spans()]
    assert len(delivered) == len(set(delivered)), "a span was delivered twice"
    assert set(acked) == set(delivered)  # what replica 1 held at the kill came back from its journal
    assert replicas[1].scrape().get("kvmiss_journal_replayed_spans") == len(pending)
    assert replicas[0].scrape().get("kvmiss_journal_replayed_spans") == 0
    got = {attributes(s)["gen_ai.request.id"]: attributes(s)["kvmiss.label"]
           for s in sink.spans() if "kvmiss.label" in attributes(s)}
    assert {rid: got.get(rid) for rid in expected} == expected
