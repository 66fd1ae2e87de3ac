"""The one SUB socket [fleet.topics] binds, on the collector thread: every publisher that
connects out sends to it, and each message goes to the worker its topic names
(collectors/membership_topics.py says who is a member and how one joins and departs).

Connections without a socket of their own: a worker's connection facts (first connection,
reconnection) cannot come from a per-worker monitor. Each received message carries the file
descriptor of the connection it came on (ZMQ_SRCFD), and the shared SUB's monitor reports
each connection that closed. A worker's first message is its first connection; a message on
another descriptor than its last one, or on one that closed since, is a reconnection -- the
stream then re-identifies the publisher through replay before trusting continuity, exactly
as for a SUB of its own (docs/HISTORY.md, "Epochs"). The monitor is read after each message
is received and before it is handed on, so a reconnection is known before the batch it
brought. Messages are read with pyzmq (the compiled receiver does not return the descriptor).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvmiss.collectors.fleet import CONNECTED, MONITOR, RECONNECTED, SUB, Fleet
from kvmiss.collectors.membership_topics import Announcements, TopicScheme
from kvmiss.schemas.config import WorkerSpec

log = logging.getLogger("kvmiss.collectors")

TOPICS, TOPICS_MONITOR = "topics", "topics-monitor"  # the shared SUB's roles in the Subscriber
# Messages of an announced worker held until its join is applied (the loop polls sources every
# [fleet] poll_interval_s); beyond, the newest are dropped: a hole its replay fills.
MAX_HELD_MESSAGES = 4096
HELD_TIMEOUT_S = 30.0  # an announcement never applied (refused: an id another source lists)

Deliver = Callable[[str, str, list[bytes]], None]  # (worker, role, frames): Subscriber._deliver


class TopicFeed:
    """Routes the shared SUB's messages to workers; see the module docstring. Collector
    thread only, but for the counters (read at scrape time)."""

    def __init__(self, scheme: TopicScheme, fleet: Fleet, announcements: Announcements | None):
        self.scheme = scheme
        self.fleet = fleet
        self.announcements = announcements  # None: members = "listed"
        self.sub: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self._conn: dict[str, int] = {}  # worker -> descriptor of its last message
        self._on_fd: dict[int, set[str]] = collections.defaultdict(set)  # descriptor -> its workers
        self._dropped: set[str] = set()  # workers whose last connection closed
        self._held: dict[str, tuple[float, list[tuple[int, list[bytes]]]]] = {}
        self.counts: collections.Counter[str] = collections.Counter()  # unmatched, unlisted, held_dropped, refused
        self._logged: set[str] = set()

    # --- sockets ---------------------------------------------------------------------------

    def open(self, ctx: zmq.Context, configure: Callable[[zmq.Socket], None]) -> tuple[zmq.Socket, zmq.Socket]:
        sub = ctx.socket(zmq.SUB)
        configure(sub)  # the Subscriber's options: HWM, linger, heartbeats
        sub.setsockopt(zmq.SUBSCRIBE, self.scheme.subscription.encode())
        self.monitor = sub.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.sub = sub
        return sub, self.monitor

    def bind(self) -> None:
        self.sub.bind(self.scheme.config.bind)

    def close(self) -> None:
        if self.sub is not None:
            try:
                self.sub.disable_monitor()
            except zmq.ZMQError:
                pass

    # --- the collector loop ----------------------------------------------------------------

    def drain(self, deliver: Deliver, limit: int) -> bool:
        """Read up to ``limit`` messages; True if it stopped at the limit (not known empty)."""
        self._read_monitor()
        for _ in range(limit):
            try:
                frames = self.sub.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            fd = frames[0].get(zmq.SRCFD)
            self._read_monitor()  # what happened to connections up to this message's
            self._route(fd, [f.bytes for f in frames], deliver)
        else:
            return True
        if self._held:
            self._expire_held()
        return False

    def _route(self, fd: int, frames: list[bytes], deliver: Deliver) -> None:
        try:
            topic = frames[0].decode("utf-8")
        except UnicodeDecodeError:
            topic = None
        worker = None if topic is None or len(frames) != 3 else self.scheme.worker_of(topic)
        if worker is None:
            self._count("unmatched", "a message whose topic does not fit [fleet.topics] topic_template "
                        "(or not 3 frames) was dropped; counted in kvmiss_fleet_topic_messages_dropped")
            return
        spec = self.fleet.specs.get(worker)
        if spec is not None and self.scheme.feeds(spec):
            if worker in self._held:  # (its join is being applied: keep the order)
                self._hold(worker, fd, frames)
                return
            self._give(worker, fd, frames, deliver)
        elif self.announcements is None:
            self._count("unlisted", f"a message from worker {worker!r}, which no source lists, was dropped "
                        "([fleet.topics] members = \"listed\"); counted in kvmiss_fleet_topic_messages_dropped")
        else:
            new = self.scheme.spec(worker)
            if new is None or not self.announcements.announce(new):
                self._count("refused", f"worker {worker!r} was not admitted ([fleet.topics] max_workers = "
                            f"{self.announcements.max_workers}, or an id the id template cannot give)")
                return
            self._hold(worker, fd, frames)

    def _give(self, worker: str, fd: int, frames: list[bytes], deliver: Deliver) -> None:
        last = self._conn.get(worker)
        if last is None:
            deliver(worker, MONITOR, [CONNECTED])
        elif last != fd or worker in self._dropped:
            deliver(worker, MONITOR, [RECONNECTED])
        if last != fd:
            if last is not None:
                self._on_fd[last].discard(worker)
            self._on_fd[fd].add(worker)
            self._conn[worker] = fd
        self._dropped.discard(worker)
        deliver(worker, SUB, frames)

    def _hold(self, worker: str, fd: int, frames: list[bytes]) -> None:
        since, held = self._held.setdefault(worker, (time.monotonic(), []))
        if len(held) < MAX_HELD_MESSAGES:
            held.append((fd, frames))
        else:
            self.counts["held_dropped"] += 1

    def joined(self, spec: WorkerSpec, deliver: Deliver) -> None:
        """The loop applied ``spec``'s join: its held messages go to its new stream, in order."""
        _, held = self._held.pop(spec.id, (0.0, []))
        for fd, frames in held:
            self._give(spec.id, fd, frames, deliver)

    def departed(self, worker: str) -> None:
        fd = self._conn.pop(worker, None)
        if fd is not None:
            self._on_fd[fd].discard(worker)
            if not self._on_fd[fd]:
                del self._on_fd[fd]
        self._dropped.discard(worker)
        self._held.pop(worker, None)

    def connection(self, worker: str) -> str:
        """As `Subscriber.connection`: "connected", "disconnected" or "never"."""
        if worker not in self._conn:
            return "never"
        return "disconnected" if worker in self._dropped else "connected"

    def _read_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                for worker in self._on_fd.pop(event["value"], ()):
                    self._dropped.add(worker)
                    log.info("worker %s: publisher disconnected", worker)

    def _expire_held(self) -> None:
        horizon = time.monotonic() - HELD_TIMEOUT_S
        for worker in [w for w, (since, _) in self._held.items() if since < horizon]:
            self.counts["held_dropped"] += len(self._held.pop(worker)[1])

    def _count(self, reason: str, message: str) -> None:
        self.counts[reason] += 1
        if reason not in self._logged:  # once per reason: a misconfigured fleet is one line
            self._logged.add(reason)
            log.warning("fleet topics: %s", message)
