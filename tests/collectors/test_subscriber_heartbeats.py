"""ZMTP heartbeats on the collector's SUB sockets (`[collector] heartbeat_interval_s`).

A SUB sends nothing once subscribed, so a connection whose packets stop (a firewall that
drops without RST, a lost route, a dead host) looks open to it forever. The loopback twin of
that: a TCP relay between the real SGLang publisher and a real `Subscriber(Fleet(...))` that,
when held, stops carrying bytes either way without closing anything. With heartbeats the
subscriber notices within interval + timeout and reconnects once the relay carries bytes
again; without them it notices nothing. The real thing, across network namespaces with
dropped packets, is tests/reliability/test_network_faults.py.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time

import pytest
from sglang_publisher import batch, close, publisher
from zmq_ports import quiet_tcp

from kvmiss.collectors.continuity import Apply, StreamConfig
from kvmiss.collectors.fleet import Fleet
from kvmiss.collectors.subscriber import Subscriber
from kvmiss.schemas.config import WorkerSpec

NOTICED = "publisher disconnected"


class HoldingRelay:
    """Loopback TCP relay to ``upstream`` (host, port); `hold()` stops reading, writing and
    accepting (every socket stays open: nothing is closed or reset), `release()` resumes."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.held = threading.Event()
        self._stop = threading.Event()
        self._peer: dict[socket.socket, socket.socket] = {}
        self.accepted = 0
        self.carried = 0  # bytes, either way
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def hold(self) -> None:
        self.held.set()

    def release(self) -> None:
        self.held.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in [self.listener, *self._peer]:
            sock.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.held.is_set():
                time.sleep(0.01)
                continue
            readable, _, _ = select.select([self.listener, *self._peer], [], [], 0.01)
            for sock in readable:
                if sock is self.listener:
                    client, _ = self.listener.accept()
                    server = socket.create_connection(self.upstream)
                    self._peer[client], self._peer[server] = server, client
                    self.accepted += 1
                    continue
                if sock not in self._peer:
                    continue
                try:
                    data = sock.recv(65536)
                    if data:
                        self._peer[sock].sendall(data)
                        self.carried += len(data)
                except OSError:  # reset (a socket closed with unread data): as closed
                    data = b""
                if not data:  # one side closed: close both
                    other = self._peer.pop(sock)
                    self._peer.pop(other, None)
                    sock.close()
                    other.close()


class Applied:
    def __init__(self) -> None:
        self.seqs: list[int] = []
        self._cond = threading.Condition()

    def __call__(self, worker: str, action) -> None:
        if isinstance(action, Apply):
            with self._cond:
                self.seqs.append(action.batch.seq)
                self._cond.notify_all()

    def wait_for(self, n: int, timeout: float = 10.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.seqs) >= n, timeout)


def noticed(caplog) -> int:
    return sum(NOTICED in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("heartbeat_s", [0.2, 0.0], ids=["heartbeats", "off"])
def test_a_connection_that_stops_carrying_bytes_is_noticed_only_with_heartbeats(heartbeat_s, caplog):
    caplog.set_level(logging.INFO, logger="kvmiss.collectors")
    # Below the ephemeral range: the relay's own listener and upstream connection take ports from
    # it, and one could take the publisher's before it has bound (it binds on its own thread).
    endpoint, replay = quiet_tcp(), quiet_tcp()
    pub = publisher(endpoint=endpoint, replay_endpoint=replay)
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    relay = HoldingRelay((host, int(port)))
    applied = Applied()
    fleet = Fleet([WorkerSpec(id="w0", endpoint=relay.endpoint, replay_endpoint=replay)], applied,
                  config=StreamConfig(tail_probe_interval_s=None))
    sub = Subscriber(fleet, heartbeat_interval_s=heartbeat_s, heartbeat_timeout_s=3 * heartbeat_s)
    seq = 0

    def publish(n: int = 1) -> None:
        nonlocal seq
        for _ in range(n):
            pub.publish(batch(1000.0 + seq, stored=[([seq + 1], None)]))
            seq += 1

    try:
        sub.start()
        for _ in range(40):  # until the subscription has landed
            publish()
            if applied.wait_for(1, timeout=0.25):
                break
        assert applied.wait_for(seq), "nothing applied before the hold"
        relay.hold()
        held_at = time.monotonic()
        publish(5)
        if heartbeat_s:
            deadline = held_at + 10
            while not noticed(caplog) and time.monotonic() < deadline:
                time.sleep(0.02)
            took = time.monotonic() - held_at
            assert noticed(caplog) >= 1, "the held connection was never noticed"
            assert took < 3.0, f"noticed after {took:.2f} s (interval + timeout: {4 * heartbeat_s:.1f} s)"
        else:
            time.sleep(3.0)  # what the heartbeats above are given
            assert noticed(caplog) == 0
        relay.release()
        publish(5)
        # Every batch is applied once, in order: what the held connection lost comes back
        # through replay once the reconnect is verified, or through the old connection.
        assert applied.wait_for(seq), (f"applied {applied.seqs} of {seq}", [r.getMessage() for r in caplog.records],
                                       f"relay: {relay.accepted} accepted, {relay.carried} bytes carried")
        time.sleep(0.2)
        assert applied.seqs == list(range(seq))
        if heartbeat_s:
            assert any("publisher reconnected" in r.getMessage() for r in caplog.records)
    finally:
        sub.shutdown()
        relay.close()
        close(pub)
