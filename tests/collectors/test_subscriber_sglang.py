"""The collector against the real SGLang publisher on loopback: real PUB, ROUTER, SUB, DEALER."""

from __future__ import annotations

import queue
import time

import pytest
from sglang_publisher import batch, close, publisher
from zmq_ports import free_tcp

from kvmiss.collectors.continuity import Apply
from kvmiss.collectors.fleet import Fleet
from kvmiss.collectors.subscriber import Subscriber
from kvmiss.schemas.config import WorkerSpec
from kvmiss.schemas.stream import RunStart


class Collected:
    def __init__(self):
        self.actions: queue.Queue = queue.Queue()

    def __call__(self, worker, action):
        self.actions.put((worker, action))

    def applied_until(self, count: int, timeout: float = 10.0) -> list:
        applied, deadline = [], time.monotonic() + timeout
        while len(applied) < count and time.monotonic() < deadline:
            try:
                _, action = self.actions.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(action, Apply):
                applied.append(action.batch)
        return applied


@pytest.fixture
def sglang_worker():
    pub_ep, replay_ep = free_tcp(), free_tcp()
    pub = publisher(endpoint=pub_ep, replay_endpoint=replay_ep)
    yield pub, WorkerSpec(id="w0", endpoint=pub_ep, replay_endpoint=replay_ep)
    close(pub)


def test_every_batch_of_the_real_publisher_is_applied_once_in_order(sglang_worker):
    pub, spec = sglang_worker
    sink = Collected()
    sub = Subscriber(Fleet([spec], sink))
    sub.start()
    try:
        time.sleep(0.3)
        for i in range(20):
            pub.publish(batch(1000.0 + i, stored=[([100 + i], None)]))
            time.sleep(0.01)
        applied = sink.applied_until(20)
    finally:
        sub.shutdown()
    assert [b.seq for b in applied] == list(range(20))
    assert applied[0].run_start is RunStart.EPOCH_START
    assert [b.events[0].block_hashes for b in applied] == [[100 + i] for i in range(20)]
