"""The write-ahead journal under real crashes: ``kvmiss serve`` SIGKILLed mid-load at the
soak rate, the journal's disk bound reached, a record torn by the crash. A real process, a
real publisher, a real OTLP/HTTP sender that retries what was refused (as a Collector does)
and a real sink; the truth is what the test published.

Delivery across a crash is at least once: every acknowledged span reaches the sink, and a
span may arrive twice only if its request was replayed (``kvmiss_journal_replayed_spans``
bounds the duplicates).
"""

from __future__ import annotations

import collections
import threading
import time

from reliability_rig import (
    UNKNOWN,
    Sender,
    Spans,
    bring_up,
    check_verdicts,
    labels_at_sink,
    post,
    quiet_port,
    router_attrs,
    span_ids,
    wait_applied,
    wait_until,
)

RATE_SPANS_S = 25_000  # the soak's rate
SPANS_PER_REQUEST = 500


class Load:
    """Requests of ~500 spans at a fixed rate from a thread; a refused or failed POST is
    retried (after Retry-After, or 0.2 s when the connection is refused) until accepted."""

    def __init__(self, port: int, spans: Spans, make_request, seconds: float):
        self.port, self.spans, self.make_request, self.seconds = port, spans, make_request, seconds
        self.acked: list[bytes] = []
        self.refused = collections.Counter()
        # Spans of requests sent again after an answer that never came (the connection broke
        # mid-request): kvmiss may have taken them the first time -- the client-side duplicate
        # every OTLP retry can make, journal or not.
        self.resent_unanswered = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        interval = SPANS_PER_REQUEST / RATE_SPANS_S
        start = time.monotonic()
        i = 0
        while time.monotonic() - start < self.seconds:
            request = self.make_request(i)
            while True:
                try:
                    status, headers = post(self.port, request, timeout=5)
                except OSError as exc:  # kvmiss is down: the Collector's queue holds it and retries
                    self.refused["down"] += 1
                    if not isinstance(getattr(exc, "reason", exc), ConnectionRefusedError):
                        self.resent_unanswered += len(span_ids(request))
                    time.sleep(0.2)
                    continue
                if status == 200:
                    self.acked += span_ids(request)
                    break
                self.refused[status] += 1
                time.sleep(float(headers.get("Retry-After", "0.2")))
            i += 1
            time.sleep(max(0.0, start + i * interval - time.monotonic()))

    def join(self, timeout: float = 60.0) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the load never finished"


def start(rig, engines, sink, ports, journal, **extra):
    return rig.start_kvmiss({"w0": engines.endpoints("w0")}, sink, ports=ports, journal=journal,
                            wait_s=2.0, assemble_wait_s=2.0, **extra)


def test_sigkill_mid_load_at_the_soak_rate_loses_nothing_acknowledged_and_no_verdict_is_wrong(rig):
    engines = rig.engines(["w0"])
    sink = rig.sink()
    ports = (quiet_port(), quiet_port(), quiet_port())
    journal = str(rig.tmp_path / "journal")
    kvmiss = start(rig, engines, sink, ports, journal)
    bring_up(kvmiss, engines)
    K, N = 7101, 7999
    engines.publish("w0", stored=[K])
    t = engines.mark()
    wait_applied(kvmiss, dict(engines.seqs))
    spans = Spans(seed=14)
    expected = {}

    def make_request(i: int):
        rid = f"r{i}"
        block = K if i % 2 else N
        expected[rid] = (engines.truth.label("w0", block, t),) + UNKNOWN  # replayed: may lose history
        return spans.request(plain=SPANS_PER_REQUEST - 1, routers=[router_attrs(rid, "w0", block, t)])

    load = Load(ports[0], spans, make_request, seconds=4.0)
    wait_until(lambda: len(load.acked) >= 20 * SPANS_PER_REQUEST, "load under way", timeout=30)
    sink.stop()  # the export queue now holds what kvmiss acknowledges
    wait_until(lambda: len(load.acked) >= 30 * SPANS_PER_REQUEST, "load acknowledged, unexported", timeout=30)
    kvmiss.kill()  # mid-load: whatever it acknowledged and had not exported is in the journal only
    acked_at_kill = len(load.acked)
    sink.start()
    kvmiss = start(rig, engines, sink, ports, journal)
    bring_up(kvmiss, engines)
    load.join()
    sink.wait_for(len(load.acked), timeout=60)
    time.sleep(0.5)

    delivered = collections.Counter(s.span_id for s in sink.spans())
    assert set(load.acked) <= set(delivered), f"{len(set(load.acked) - set(delivered))} acknowledged spans lost"
    assert set(delivered) <= set(load.acked)
    duplicates = sum(n - 1 for n in delivered.values())
    m = kvmiss.scrape()
    replayed = m.get("kvmiss_journal_replayed_spans")
    assert duplicates <= replayed + load.resent_unanswered and m.get("kvmiss_journal_torn_records") <= 1
    assert replayed >= SPANS_PER_REQUEST  # the requests held in the export queue at the kill
    assert acked_at_kill >= 20 * SPANS_PER_REQUEST and load.refused["down"] >= 1
    got = labels_at_sink(sink)
    check_verdicts(got, {rid: allowed for rid, allowed in expected.items() if rid in got})
    assert len(got) == len(expected)  # every request labelled (a duplicate carries the same label)
    print(f"acked {len(load.acked)} spans, delivered {sum(delivered.values())}, duplicates {duplicates}, "
          f"replayed {replayed:.0f}, resent unanswered {load.resent_unanswered}, refused while down "
          f"{load.refused['down']}")


def test_the_disk_bound_pushes_back_and_nothing_is_lost(rig):
    """The sink is down, so nothing is exported and nothing in the journal is done: at
    journal_max_bytes kvmiss answers 503 + Retry-After (counted); once the sink is back the
    journal drains and every request the sender kept retrying goes through, once."""
    engines = rig.engines(["w0"])
    sink = rig.sink()
    ports = (quiet_port(), quiet_port(), quiet_port())
    kvmiss = start(rig, engines, sink, ports, str(rig.tmp_path / "journal"), journal_max_bytes=1 << 20,
                   max_pending_spans=100_000)
    bring_up(kvmiss, engines)
    sink.stop()
    spans, sender = Spans(seed=15), Sender(kvmiss.http_port)
    statuses = []
    for _ in range(40):  # ~40 KiB each: the 1 MiB bound is reached within the first 30
        statuses.append(sender.try_once(spans.request(plain=SPANS_PER_REQUEST)))
    assert 503 in statuses and statuses[0] == 200
    m = kvmiss.scrape()
    assert m.get("kvmiss_journal_refused") == statuses.count(503)
    assert m.get("kvmiss_journal_bytes") >= m.get("kvmiss_journal_max_bytes") == 1 << 20  # live bodies
    assert all(retry_after for status, retry_after in sender.statuses if status == 503)
    sink.start()
    for _ in range(5):  # the sender's retries succeed once the journal drains
        assert sender.send(spans.request(plain=SPANS_PER_REQUEST), timeout=60) == 200
    sink.wait_for(len(sender.acked), timeout=60)
    delivered = [s.span_id for s in sink.spans()]
    assert sorted(delivered) == sorted(sender.acked)  # every acknowledged span, once


def test_a_record_torn_by_the_crash_costs_only_itself(rig):
    engines = rig.engines(["w0"])
    sink = rig.sink()
    ports = (quiet_port(), quiet_port(), quiet_port())
    journal = rig.tmp_path / "journal"
    kvmiss = start(rig, engines, sink, ports, str(journal))
    bring_up(kvmiss, engines)
    sink.stop()
    spans, sender = Spans(seed=16), Sender(kvmiss.http_port)
    kept = []
    for _ in range(3):
        request = spans.request(plain=100)
        assert sender.try_once(request) == 200
        kept += span_ids(request)
    kvmiss.kill()
    (segment,) = sorted(journal.glob("seg-*.wal"))
    with open(segment, "ab") as f:
        f.write(b"R\xff\x00\x00\x00")  # a body record the crash cut after five bytes
    sink.start()
    kvmiss = start(rig, engines, sink, ports, str(journal))  # starts, whatever the tail holds
    sink.wait_for(len(kept), timeout=30)
    assert sorted(s.span_id for s in sink.spans()) == sorted(kept)
    m = kvmiss.scrape()
    assert m.get("kvmiss_journal_torn_records") == 1 and m.get("kvmiss_journal_replayed_spans") == 300
