"""Workers added and removed while the collector runs (collectors/fleet.py `add`/`remove`,
collectors/subscriber.py `change_fleet`): real SGLang 0.5.23 publishers on loopback, a real
`Subscriber(Fleet(...))`. A removed worker's stream stops with its sockets, whatever it was
waiting for; one added again under its id is a new stream from a new epoch."""

from __future__ import annotations

import threading
import time

import pytest
import zmq
from sglang_publisher import batch, close, publisher
from zmq_ports import free_tcp

from kvmiss.collectors.continuity import Apply, StreamConfig
from kvmiss.collectors.fleet import Fleet
from kvmiss.collectors.subscriber import Subscriber
from kvmiss.schemas.config import WorkerSpec
from kvmiss.schemas.fleet import FleetChange

WAIT_S = 5.0
QUIET = StreamConfig(tail_probe_interval_s=None, replay_on_connect=False)


class Sink:
    def __init__(self) -> None:
        self.applied: list[tuple[str, int, int]] = []  # (worker, epoch, seq)
        self.facts: list[tuple[str, object]] = []
        self.cond = threading.Condition()

    def __call__(self, worker: str, action) -> None:
        with self.cond:
            if isinstance(action, Apply):
                self.applied.append((worker, action.batch.epoch, action.batch.seq))
            else:
                self.facts.append((worker, action))
            self.cond.notify_all()

    def of(self, worker: str) -> list[tuple[int, int]]:
        with self.cond:
            return [(e, s) for w, e, s in self.applied if w == worker]


class Engine:
    def __init__(self, worker: str, *, replay: bool = False):
        self.endpoint = free_tcp()
        self.replay = free_tcp() if replay else None
        self.pub = publisher(endpoint=self.endpoint, replay_endpoint=self.replay)
        self.spec = WorkerSpec(id=worker, endpoint=self.endpoint, replay_endpoint=self.replay)
        self.seq = 0

    def publish(self) -> None:
        self.pub.publish(batch(1000.0 + self.seq, stored=[([self.seq + 1], None)]))
        self.seq += 1


def seen(sink: Sink, engine: Engine, worker: str, after: int = 0) -> None:
    """Publish until ``worker`` has more than ``after`` batches applied (a SUB that has just
    connected misses what was sent before its subscription reached the publisher)."""
    deadline = time.monotonic() + WAIT_S
    while len(sink.of(worker)) <= after:
        assert time.monotonic() < deadline, f"{worker}: nothing applied"
        engine.publish()
        time.sleep(0.05)


@pytest.fixture
def engines():
    made: list[Engine] = []

    def make(worker: str, **kw) -> Engine:
        made.append(Engine(worker, **kw))
        return made[-1]

    yield make
    for engine in made:
        close(engine.pub)


def sockets_of(sub: Subscriber, worker: str) -> int:
    return sum(1 for _, owner, _ in list(sub._roles.values()) if owner == worker)


def wait(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_worker_added_at_run_time_is_followed_and_a_removed_one_stops(engines):
    a, b = engines("a"), engines("b")
    sink = Sink()
    fleet = Fleet([a.spec], sink, config=QUIET)
    sub = Subscriber(fleet)
    sub.start()
    try:
        seen(sink, a, "a")
        sub.change_fleet(FleetChange(at=time.time(), source="file", joined=(b.spec,)))
        wait(lambda: "b" in fleet.streams, "b joined")
        seen(sink, b, "b")
        assert sub.connection("b") == "connected"

        sub.change_fleet(FleetChange(at=time.time(), source="file", departed=("a",)))
        wait(lambda: "a" not in fleet.streams and sockets_of(sub, "a") == 0, "a's sockets closed")
        before = len(sink.of("a"))
        for _ in range(20):  # a keeps publishing: nothing of it is applied any more
            a.publish()
        seen(sink, b, "b", after=len(sink.of("b")))  # b still is, after a's batches were sent
        assert len(sink.of("a")) == before
        assert sub.connection("a") == "never" and sub.alive
    finally:
        sub.shutdown()


def test_a_worker_removed_and_added_again_is_a_new_stream_from_a_new_epoch(engines):
    a = engines("a")
    sink = Sink()
    fleet = Fleet([a.spec], sink, config=QUIET)
    sub = Subscriber(fleet)
    sub.start()
    try:
        seen(sink, a, "a")
        old_epoch = sink.of("a")[-1][0]
        old_stream = fleet.streams["a"]
        sub.change_fleet(FleetChange(at=time.time(), source="file", departed=("a",)))
        sub.change_fleet(FleetChange(at=time.time(), source="file", joined=(a.spec,)))
        wait(lambda: "a" in fleet.streams and fleet.streams["a"] is not old_stream, "a re-added")
        applied = len(sink.of("a"))
        seen(sink, a, "a", after=applied)
        epochs = {e for e, _ in sink.of("a")[applied:]}
        assert epochs and min(epochs) > old_epoch  # the index sees a new epoch, not a continuation
    finally:
        sub.shutdown()


def test_a_removed_workers_outstanding_replay_is_dropped_with_its_socket():
    """The replay endpoint never answers: the stream waits on its replay DEALER. Removed,
    the DEALER is closed and no time-out, retry or write-off of it follows."""
    ctx = zmq.Context.instance()
    mute = ctx.socket(zmq.ROUTER)  # takes the request, never answers
    replay = free_tcp()
    mute.bind(replay)
    spec = WorkerSpec(id="a", endpoint=free_tcp(), replay_endpoint=replay)
    sink = Sink()
    fleet = Fleet([], sink, config=StreamConfig(tail_probe_interval_s=None, replay_on_connect=True))
    sub = Subscriber(fleet)
    sub.start()
    engine_pub = ctx.socket(zmq.PUB)
    engine_pub.bind(spec.endpoint)
    try:
        sub.change_fleet(FleetChange(at=time.time(), source="file", joined=(spec,)))
        wait(lambda: "a" in sub._dealers, "a replay request out")  # replay on connect, unanswered
        assert mute.poll(WAIT_S * 1000)
        sub.change_fleet(FleetChange(at=time.time(), source="file", departed=("a",)))
        wait(lambda: "a" not in fleet.streams, "a removed")
        wait(lambda: sockets_of(sub, "a") == 0 and "a" not in sub._dealers, "a's sockets closed")
        facts = len(sink.facts)
        time.sleep(1.0)  # past the first replay time-out
        assert len(sink.facts) == facts and sub.alive
    finally:
        sub.shutdown()
        engine_pub.close(0)
        mute.close(0)


def test_a_joined_worker_whose_socket_cannot_be_opened_is_listed_and_tried_again(engines):
    holder = zmq.Context.instance().socket(zmq.PUB)
    endpoint = free_tcp()
    holder.bind(endpoint)  # the port kvmiss must bind is taken
    sink = Sink()
    fleet = Fleet([], sink, config=QUIET)
    sub = Subscriber(fleet)
    sub.start()
    try:
        spec = WorkerSpec(id="bound", endpoint=endpoint, bind=True)
        sub.change_fleet(FleetChange(at=time.time(), source="file", joined=(spec,)))
        wait(lambda: sub.connection("bound") == "unopened", "the bind refused")
        assert "bound" in fleet.streams and sockets_of(sub, "bound") == 0 and sub.alive
        holder.close(0)
        wait(lambda: sub.connection("bound") == "never", "the bind retried")
        assert sockets_of(sub, "bound") == 2
    finally:
        sub.shutdown()
        holder.close(0)


def test_a_departed_worker_is_followed_for_the_linger_then_closed(engines):
    """``linger_s``: a draining engine's batches after its departure still reach the sink
    (the index needs them for lookups of the membership band), and then its sockets close."""
    a = engines("a")
    sink = Sink()
    fleet = Fleet([a.spec], sink, config=QUIET)
    sub = Subscriber(fleet, linger_s=3.0)  # room for a batch to arrive on a loaded machine
    sub.start()
    try:
        seen(sink, a, "a")
        departed = time.monotonic()
        sub.change_fleet(FleetChange(at=time.time(), source="file", departed=("a",)))
        wait(lambda: "a" in sub.lingering, "a lingering")
        seen(sink, a, "a", after=len(sink.of("a")))  # still applied after its departure
        wait(lambda: "a" not in fleet.streams and sockets_of(sub, "a") == 0, "a closed after the linger")
        assert time.monotonic() - departed >= 2.9
        before = len(sink.of("a"))
        for _ in range(10):
            a.publish()
        time.sleep(0.2)
        assert len(sink.of("a")) == before and not sub.lingering
    finally:
        sub.shutdown()


def test_a_lingering_worker_that_joins_again_is_a_new_stream_at_once(engines):
    a = engines("a")
    sink = Sink()
    fleet = Fleet([a.spec], sink, config=QUIET)
    sub = Subscriber(fleet, linger_s=30.0)
    sub.start()
    try:
        seen(sink, a, "a")
        old = fleet.streams["a"]
        sub.change_fleet(FleetChange(at=time.time(), source="file", departed=("a",)))
        sub.change_fleet(FleetChange(at=time.time(), source="file", joined=(a.spec,)))
        wait(lambda: fleet.streams.get("a") is not old, "a new stream")
        # one SUB and its monitor, not two (the monitor opens a moment after the SUB)
        wait(lambda: sockets_of(sub, "a") == 2, "the new stream's SUB and monitor")
        assert not sub.lingering and sockets_of(sub, "a") == 2
        applied = len(sink.of("a"))
        seen(sink, a, "a", after=applied)
        assert min(e for e, _ in sink.of("a")[applied:]) > sink.of("a")[0][0]
    finally:
        sub.shutdown()
