"""The service's clock check, wired as `kvmiss serve` wires it but fed by hand: live frames
into the real `Fleet` (the collector's state machines, which keep each worker's sliding
minimum of receive lags), the real hand-over into the index, the real `Attributor` and
metrics. No sockets: the receive time of every frame is the test's to choose, so an engine
clock can be put exactly where the bound is (the end-to-end case with real publishers is in
tests/reliability/test_fault_matrix.py)."""

from __future__ import annotations

import logging

import msgspec
import pytest
from fleet_builders import PARENT, H, request, stored
from prometheus_client.openmetrics.exposition import generate_latest

from kvmiss.collectors.fleet import SUB
from kvmiss.enricher.service.serve import Service
from kvmiss.schemas.attribution import ClockOffset, Label
from kvmiss.schemas.config import ConfigError, HistoryConfig, parse_config
from kvmiss.schemas.events import EventBatch

SKEW, DELAY, WINDOW = 0.25, 0.5, 2.0  # [history] clock_skew_s, publish_delay_s, clock_skew_window_s


def service() -> Service:
    workers = "".join(f'[[workers]]\nid = "{w}"\nendpoint = "tcp://127.0.0.1:{port}"\n'
                      for w, port in (("A", 1), ("B", 2)))
    return Service(parse_config(
        f'[metrics]\nlisten = ""\n[history]\nclock_skew_s = {SKEW}\npublish_delay_s = {DELAY}\n'
        f'clock_skew_window_s = {WINDOW}\n' + workers))


class Engines:
    """Live frames from two engines into one service; ``offset[w]``: that engine's clock
    minus kvmiss's. Every step takes 0.1 s and is delivered 10 ms after its stamp."""

    def __init__(self, svc: Service):
        self.svc = svc
        self.now = 1000.0  # kvmiss's clock
        self.seq = {"A": 0, "B": 0}
        self.offset = {"A": 0.0, "B": 0.0}

    def step(self, worker: str, *events) -> float:
        """One step of ``worker``: returns its engine-clock stamp."""
        ts = self.now + self.offset[worker]
        payload = msgspec.msgpack.encode(EventBatch(ts, list(events), 0))
        frames = [b"kv", self.seq[worker].to_bytes(8, "big"), payload]
        self.svc.fleet.on_message(worker, SUB, frames, self.now + 0.01)
        self.seq[worker] += 1
        self.now += 0.1
        return ts

    def steps(self, count: int) -> None:
        for _ in range(count):
            for worker in self.seq:
                self.step(worker)

    def lookup(self, worker: str) -> float:
        """A lookup time on ``worker``'s clock, between two of its steps."""
        t = self.now + self.offset[worker] - 0.05
        self.steps(1)
        self.svc.drain()  # as before every judging round
        return t


def judge(svc: Service, worker: str, t: float):
    return svc.attributor.attribute(request(worker, t))


def gauges(svc: Service) -> dict[str, float]:
    text = generate_latest(svc.registry).decode()
    return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("kvmiss_stream_clock_out_of_bounds{")}


@pytest.mark.parametrize("offset", [-3.0, +3.0], ids=["engine-behind", "engine-ahead"])
def test_a_worker_out_of_bound_is_refused_the_others_are_not_and_it_comes_back(offset, caplog):
    caplog.set_level(logging.WARNING, logger="kvmiss.serve")
    svc = service()
    engines = Engines(svc)
    engines.step("A", stored(PARENT, H))
    engines.step("B")
    engines.steps(20)
    t = engines.lookup("A")
    assert judge(svc, "A", t).label is Label.RESIDENT_MISS
    assert judge(svc, "B", engines.lookup("B")).label is Label.ROUTING_MISS  # A holds H
    assert gauges(svc) == {"A": 0.0, "B": 0.0}

    engines.offset["A"] = offset  # A's host clock steps
    engines.steps(40)  # 4 s of steps: past the window, 40 samples
    assert gauges(svc) == {"A": 1.0, "B": 0.0}
    clock = svc.worker_clock("A")
    assert clock is not None and not clock.within_bound
    assert clock.lag_s == pytest.approx(0.01 - offset)

    for lookup in (t, engines.lookup("A")):  # an old lookup, and one on A's new clock
        verdict = judge(svc, "A", lookup)
        assert verdict.label is Label.UNKNOWN_HISTORY and verdict.reason.startswith("clock skew:")
    verdict = judge(svc, "B", engines.lookup("B"))  # A was the holder: no proof now
    assert verdict.label is Label.UNKNOWN_HISTORY
    assert "clock beyond the skew bound" in verdict.reason
    assert svc.worker_clock("B").within_bound

    engines.offset["A"] = 0.0  # back within
    engines.steps(40)
    assert gauges(svc) == {"A": 0.0, "B": 0.0}
    assert judge(svc, "A", engines.lookup("A")).label is Label.RESIDENT_MISS
    assert judge(svc, "B", engines.lookup("B")).label is Label.ROUTING_MISS
    logged = [r.getMessage() for r in caplog.records]
    assert sum("worker A: engine clock beyond the skew bound" in m for m in logged) == 1
    assert sum("worker A: engine clock back within the skew bound" in m for m in logged) == 1
    assert not any("worker B" in m for m in logged)


def test_one_stalled_or_replayed_batch_does_not_flip_a_worker():
    svc = service()
    engines = Engines(svc)
    engines.step("A", stored(PARENT, H))
    engines.steps(20)
    ts = engines.now
    stalled = msgspec.msgpack.encode(EventBatch(ts, [], 0))
    svc.fleet.on_message("A", SUB, [b"kv", engines.seq["A"].to_bytes(8, "big"), stalled], ts + 30.0)
    assert svc.fleet.streams["A"].health.receive_lag_s == pytest.approx(30.0)
    assert svc.worker_clock("A").within_bound
    assert gauges(svc)["A"] == 0.0


def test_a_worker_with_no_live_batch_yet_has_no_clock_fact():
    svc = service()
    assert svc.worker_clock("A") is None and svc.worker_clock("nobody") is None
    assert gauges(svc) == {}


def test_the_bound_and_window_come_from_history_config():
    svc = service()
    assert svc.clock_bounds == (-SKEW, SKEW + DELAY)
    assert svc.fleet.streams["A"].config.clock_window_s == WINDOW
    assert HistoryConfig().clock_skew_window_s == 30.0
    with pytest.raises(ConfigError, match="clock_skew_window_s"):
        parse_config("[history]\nclock_skew_window_s = 0\n")


def test_the_edges_of_the_bound_are_inside():
    low, high = -SKEW, SKEW + DELAY
    assert ClockOffset(low, low, high).within_bound and ClockOffset(high, low, high).within_bound
    assert not ClockOffset(low - 1e-9, low, high).within_bound
    assert not ClockOffset(high + 1e-9, low, high).within_bound
