"""The collector's wake-ups (collectors/subscriber.py): it waits in an epoll on each socket's
ZMQ_FD, which signals a change, not "a message is waiting". These cases would stall with a
wake-up rule that trusts the edge alone; the once-a-second sweep that backs it up is turned
off here, so only the rule itself can deliver.

Real SGLang 0.5.23 publishers on loopback, a real `Subscriber(Fleet(...))`.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from sglang_publisher import batch, close, publisher
from zmq_ports import free_tcp

from kvmiss.collectors import subscriber as subscriber_module
from kvmiss.collectors.continuity import Apply, StreamConfig
from kvmiss.collectors.fleet import Fleet
from kvmiss.collectors.subscriber import MAX_MESSAGES_PER_SOCKET, Subscriber
from kvmiss.schemas.config import WorkerSpec

WAIT_S = 5.0
QUIET = StreamConfig(tail_probe_interval_s=None, replay_on_connect=False)


@pytest.fixture(autouse=True)
def no_sweep(monkeypatch):
    monkeypatch.setattr(subscriber_module, "SWEEP_INTERVAL_S", float("inf"))


class Applied:
    def __init__(self) -> None:
        self.seqs: dict[str, list[int]] = {}
        self._cond = threading.Condition()

    def __call__(self, worker: str, action) -> None:
        if isinstance(action, Apply):
            with self._cond:
                self.seqs.setdefault(worker, []).append(action.batch.seq)
                self._cond.notify_all()

    def wait_for(self, predicate, timeout: float = WAIT_S) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.seqs), timeout)


class Publishers:
    """``n`` real SGLang publishers, one worker each, and a collector subscribed to all."""

    def __init__(self, n: int, *, replay: bool = False, config: StreamConfig = QUIET) -> None:
        self.pubs, specs = [], []
        for i in range(n):
            endpoint, replay_endpoint = free_tcp(), (free_tcp() if replay else None)
            self.pubs.append(publisher(endpoint=endpoint, replay_endpoint=replay_endpoint))
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
