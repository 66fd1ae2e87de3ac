"""The collector's wake-ups (collectors/subscriber.py): it waits in an epoll on each socket's
ZMQ_FD, which signals a change, not "a message is waiting". These cases would stall with a
wake-up rule that trusts the edge alone; the once-a-second sweep that backs it up is turned
off here, so only the rule itself can deliver. Each case runs on epoll and on the zmq_poll
fallback used where epoll is missing.

Real SGLang 0.5.23 publishers on loopback, a real `Subscriber(Fleet(...))`.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import pytest
from sglang_publisher import batch, close, publisher
from zmq_ports import free_tcp

from kvmiss.collectors import subscriber as subscriber_module
from kvmiss.collectors.continuity import Apply, Hole, Quarantine, StreamConfig
from kvmiss.collectors.fleet import Fleet
from kvmiss.collectors.subscriber import MAX_MESSAGES_PER_SOCKET, Subscriber
from kvmiss.schemas.config import WorkerSpec

WAIT_S = 5.0
QUIET = StreamConfig(tail_probe_interval_s=None, replay_on_connect=False)


@pytest.fixture(autouse=True, params=["epoll", "zmq_poll"])
def no_sweep(request, monkeypatch):
    monkeypatch.setattr(subscriber_module, "SWEEP_INTERVAL_S", float("inf"))
    if request.param == "zmq_poll":  # where select.epoll is missing: the same rules on zmq_poll
        monkeypatch.setattr(subscriber_module, "_fd_poller", subscriber_module._PolledFds)


class Applied:
    def __init__(self) -> None:
        self.seqs: dict[str, list[int]] = {}
        self.facts: list[tuple[str, object]] = []
        self.hold: Callable[[str, int], None] | None = None  # runs before an apply: a slow hand-over
        self._cond = threading.Condition()

    def __call__(self, worker: str, action) -> None:
        if not isinstance(action, Apply):
            self.facts.append((worker, action))
            return
        if self.hold is not None:
            self.hold(worker, action.batch.seq)
        with self._cond:
            self.seqs.setdefault(worker, []).append(action.batch.seq)
            self._cond.notify_all()

    def wait_for(self, predicate, timeout: float = WAIT_S) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.seqs), timeout)


class Publishers:
    """``n`` real SGLang publishers, one worker each, and a collector subscribed to all."""

    def __init__(self, n: int, *, replay: bool = False, config: StreamConfig = QUIET,
                 buffer_steps: int = 10_000) -> None:
        self.pubs, specs = [], []
        for i in range(n):
            endpoint, replay_endpoint = free_tcp(), (free_tcp() if replay else None)
            self.pubs.append(publisher(endpoint=endpoint, replay_endpoint=replay_endpoint,
                                       buffer_steps=buffer_steps))
            specs.append(WorkerSpec(id=f"w{i}", endpoint=endpoint, replay_endpoint=replay_endpoint))
        self.next_seq = [0] * n
        self.applied = Applied()
        self.fleet = Fleet(specs, self.applied, config=config)
        self.sub = Subscriber(self.fleet)

    def publish(self, i: int, count: int = 1) -> None:
        for _ in range(count):
            seq = self.next_seq[i]
            self.pubs[i].publish(batch(1000.0 + seq, stored=[([i * 1_000_000 + seq], None)]))
            self.next_seq[i] += 1

    def connect(self) -> None:
        """Start the collector; publish one batch at a time per worker until each is seen (a
        SUB that just connected misses what is sent before its subscription arrives)."""
        self.sub.start()
        for i in range(len(self.pubs)):
            worker = f"w{i}"
            for _ in range(40):
                self.publish(i)
                if self.applied.wait_for(lambda s: worker in s, timeout=0.25):
                    break
            else:
                raise AssertionError(f"{worker}: nothing seen")

    def close(self) -> None:
        self.sub.shutdown()
        for pub in self.pubs:
            close(pub)


@pytest.fixture
def fleet_of():
    made: list[Publishers] = []

    def make(n: int, **kwargs) -> Publishers:
        made.append(Publishers(n, **kwargs))
        return made[-1]

    yield make
    for p in made:
        p.close()


def published_all(p: Publishers):
    return lambda seqs: all(
        seqs.get(f"w{i}", [])[-1:] == [n - 1] for i, n in enumerate(p.next_seq) if n)


def test_a_burst_longer_than_one_read_is_applied_in_full_with_no_message_after_it(fleet_of):
    p = fleet_of(1)
    p.connect()
    p.publish(0, 5 * MAX_MESSAGES_PER_SOCKET + 7)  # then silence: no later edge to wake on
    assert p.applied.wait_for(published_all(p)), (
        f"applied up to {p.applied.seqs['w0'][-1]} of {p.next_seq[0] - 1}")
    first = p.applied.seqs["w0"][0]
    assert p.applied.seqs["w0"] == list(range(first, p.next_seq[0]))  # in order, once each


def test_single_batches_on_many_quiet_workers_each_arrive_alone(fleet_of):
    p = fleet_of(12)
    p.connect()
    rng = random.Random(7)
    for _ in range(60):  # one batch at a time on a random worker, the others silent
        i = rng.randrange(12)
        p.publish(i)
        worker, last = f"w{i}", p.next_seq[i] - 1
        assert p.applied.wait_for(lambda s: s[worker][-1] == last), f"{worker} seq {last} not applied"


def test_a_replay_answer_after_the_request_wakes_the_collector(fleet_of):
    p = fleet_of(2, replay=True, config=StreamConfig(tail_probe_interval_s=None, replay_on_connect=True))
    for i in range(2):
        p.publish(i, 30)  # published before the collector connected: only replay has them
    time.sleep(0.05)  # the publishers' threads put them in their rings
    p.sub.start()
    # The first connection asks each ring for everything from seq 0 on a fresh DEALER; the
    # answer comes after the send, with no live traffic to wake on.
    assert p.applied.wait_for(lambda s: all(s.get(f"w{i}", [])[:30] == list(range(30)) for i in range(2)))


def test_a_worker_whose_batches_wait_behind_a_slow_hand_over_is_not_probed_as_quiet(fleet_of):
    # w0 is idle; a slow hand-over of w1's batch keeps the collector away from its sockets for
    # longer than the probe interval while w0 publishes more than its ring holds. Once the
    # collector is back, w0 has been "silent" for 0.7 s, but only because its batches sit
    # unread in its own socket: a probe then asks from a tail the ring no longer holds, and
    # an answer read before those batches writes them off as a hole.
    p = fleet_of(2, replay=True, buffer_steps=8,
                 config=StreamConfig(tail_probe_interval_s=0.5, replay_on_connect=False))
    p.connect()
    held_at, w0 = p.next_seq[1], p.fleet.streams["w0"]
    seen_when_applied: dict[int, tuple[int, int]] = {}  # w0 seq -> (probes sent, deferred) then

    def slow(worker: str, seq: int) -> None:  # runs on the collector thread, before each apply
        if worker == "w1" and seq == held_at:
            time.sleep(0.7)
        if worker == "w0":
            seen_when_applied[seq] = (w0.health.tail_probes, w0.health.tail_probes_deferred)

    p.applied.hold = slow
    p.publish(1)  # the collector takes it and is held
    time.sleep(0.05)
    p.publish(0, 30)  # meanwhile: well past w0's ring of 8
    assert p.applied.wait_for(published_all(p))
    last = p.next_seq[0] - 1
    probes, deferred = seen_when_applied[last]
    assert probes == 0 and deferred >= 1  # asked to wait, then read: nothing to ask
    assert [f for w, f in p.applied.facts if w == "w0" and isinstance(f, (Hole, Quarantine))] == []
    first = p.applied.seqs["w0"][0]
    assert p.applied.seqs["w0"] == list(range(first, last + 1))
