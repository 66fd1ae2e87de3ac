"""The ZeroMQ edge of the collector: one thread, one epoll, any number of workers.

Per worker: a SUB socket (connect, or bind for publishers that connect out) with a monitor
socket watching its connection, and while a replay is outstanding one DEALER opened for
that request alone (the socket is the fence between requests: replies carry no id).
ZeroMQ reconnects by itself with exponential backoff (``RECONNECT_IVL`` doubling up to
``RECONNECT_IVL_MAX``); the monitor tells the stream when a connection came back, so it can
verify the publisher's identity before trusting continuity.

The thread waits in an epoll on each socket's ZMQ_FD, so a wait costs the sockets that have
something, not the fleet (zmq_poll asks every socket: ~1 us each, a core at 128 busy workers).
ZMQ_FD is edge-triggered: it signals a change, and a socket is only known empty once a
receive returned EAGAIN. A socket read up to the per-socket cap, or touched by a send, is
kept "pending" and read again without waiting. Without epoll (macOS) the same fds are
waited on with zmq_poll (`_PolledFds`).

Everything the sockets deliver goes to the `Fleet` (state machines) and, if a recorder is
given, to the recording first. Sink calls happen on this thread.

The fleet may change while it runs: `change_fleet` (any thread) queues a `FleetChange`, and
the loop carries it out between two polls (within `POLL_INTERVAL_S`): a joined worker's
sockets are opened as at start-up; a departed worker's are closed and its stream dropped,
after ``linger_s`` of following it still (a draining engine's history keeps reaching the
lookups of the membership band).
"""

from __future__ import annotations

import collections
import logging
import os
import select
import threading
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvmiss.collectors.continuity import RequestReplay
from kvmiss.collectors.fleet import CONNECTED, DEALER, MONITOR, RECONNECTED, SUB, TICK, UNREAD, Fleet
from kvmiss.collectors.frames import encode_replay_request
from kvmiss.collectors.recording import RecordedMessage, RecordingWriter
from kvmiss.collectors.topic_feed import TOPICS, TOPICS_MONITOR, TopicFeed
from kvmiss.schemas.config import WorkerSpec
from kvmiss.schemas.fleet import FleetChange

log = logging.getLogger("kvmiss.collectors")

def _compiled_receiver() -> Callable[[int, int], list[list[bytes]]] | None:
    """collectors/_kvwire.c's `recv_messages`, bound to the libzmq pyzmq loaded (found in
    /proc/self/maps); None where that cannot be done (no compiled module, not Linux, a
    libzmq without the calls, KVMISS_PURE_PYTHON_INGEST=1): pyzmq's recv_multipart then."""
    if os.environ.get("KVMISS_PURE_PYTHON_INGEST") == "1":
        return None
    try:
        from kvmiss.collectors import _kvwire
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[-1].strip() for line in maps if "libzmq" in line}
    except (ImportError, OSError):
        return None
    for path in sorted(p for p in paths if p.startswith("/")):
        if _kvwire.bind_libzmq(path):
            return _kvwire.recv_messages
    return None


class _PolledFds:
    """Where `select.epoll` is missing (macOS, for a developer's `make demo`): zmq_poll on the
    same ZMQ_FDs, with epoll's interface. The same wake-up rules hold; a wait costs every
    socket again."""

    def __init__(self) -> None:
        self._poller = zmq.Poller()

    def register(self, fd: int, _events: int) -> None:
        self._poller.register(fd, zmq.POLLIN)

    def unregister(self, fd: int) -> None:
        self._poller.unregister(fd)

    def poll(self, timeout: float) -> list[tuple[int, int]]:
        return self._poller.poll(timeout * 1000)

    def close(self) -> None:
        pass


def _fd_poller() -> select.epoll | _PolledFds:
    return select.epoll() if hasattr(select, "epoll") else _PolledFds()


# Bounded draining keeps one busy worker from starving the others and the timers.
MAX_MESSAGES_PER_SOCKET = 256
POLL_INTERVAL_S = 0.05
# Between two waits that find messages: a wake-up costs ~15 us of Python whatever it reads, so
# waking for every message took 0.28 cores at 12,800 batches/s from 8 workers; waiting 1 ms
# reads them in tens. The index applies what arrived every 20 ms, so nothing waits longer
# for it. More sockets, a longer gap (their per-call reads), up to 5 ms.
MIN_POLL_GAP_S = 0.001
POLL_GAP_PER_SOCKET_S = 5e-6
MAX_POLL_GAP_S = 0.005
MIN_SLEEP_S = 0.0002
# Every socket is read once this often whether or not its ZMQ_FD signalled: a backstop, so
# that a wake-up lost in a way not foreseen (an EINTR mid-drain) costs a delay, not a stall.
SWEEP_INTERVAL_S = 1.0
SUB_RCVHWM = 200_000  # above the publishers' default 100,000 send HWM
# Sockets one worker may hold at once: its SUB, the SUB's monitor pair, a replay DEALER and a
# tail probe's, with room to spare. ZeroMQ's default cap (1,023 per context) ran out at ~224
# workers with replay (benchmarks/bench_ceiling.py): the collector thread died mid-fleet.
SOCKETS_PER_WORKER = 8
# ZMTP heartbeats on each SUB (`[collector] heartbeat_interval_s` / `heartbeat_timeout_s`): a SUB
# sends nothing after subscribing, so a connection whose packets are silently dropped (a
# firewall, a lost route, a host gone) looks open forever; measured across network namespaces
# (benchmarks/netns_halfopen.py), it was never noticed. A PING every interval and no reply within
# the timeout close it, and ZeroMQ reconnects. The TTL asks the publisher to drop its end as well;
# a connect that gets no answer is given up after the same timeout and tried again, so that once
# the path is back the next try is seconds away, not a SYN retransmit (1, 2, 4 ... 64 s) later.
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 4.0
# The context's socket cap is fixed once its first socket exists: room for this many workers
# at least, so a fleet that grows at run time (`change_fleet`) does not run out.
MIN_WORKERS_SIZED = 256
# A joined worker whose socket could not be opened (a bind port still held) is tried again
# this often; meanwhile it is listed, and unreachable.
REOPEN_INTERVAL_S = 1.0


class Subscriber:
    """Runs the fleet's sockets. `start()` spawns the thread; `shutdown()` is idempotent."""

    def __init__(
        self,
        fleet: Fleet,
        *,
        context: zmq.Context | None = None,
        recorder: RecordingWriter | None = None,
        clock: Callable[[], float] = time.time,
        reconnect_ivl_ms: int = 100,
        reconnect_ivl_max_ms: int = 5_000,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
        topics: TopicFeed | None = None,
        linger_s: float = 0.0,
    ):
        self.fleet = fleet
        self.topics = topics  # [fleet.topics]: one bound SUB for every publisher that connects out
        self.recorder = recorder
        self.clock = clock
        self._own_context = context is None
        if context is None:  # its own context, sized to the fleet (see SOCKETS_PER_WORKER)
            context = zmq.Context()
            context.set(zmq.MAX_SOCKETS, max(context.get(zmq.MAX_SOCKETS),
                                             SOCKETS_PER_WORKER * max(len(fleet.specs), MIN_WORKERS_SIZED) + 64))
        self._ctx = context
        self._reconnect = (reconnect_ivl_ms, reconnect_ivl_max_ms)
        self._heartbeat = (round(heartbeat_interval_s * 1000), round(heartbeat_timeout_s * 1000))
        self._recv_messages = _compiled_receiver()
        self._due: float | None = None  # the soonest timer as of the last round or replay request
        self._last_poll = float("-inf")  # monotonic time of the last poll
        self._found = False  # whether it found a socket ready
        self._last_round = float("-inf")  # when timers last ran
        self._last_sweep = float("-inf")  # when every socket was last read (SWEEP_INTERVAL_S)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._epoll: select.epoll | _PolledFds | None = None  # opened on the loop's thread, in _open
        self._by_fd: dict[int, zmq.Socket] = {}
        self._fds: dict[zmq.Socket, int] = {}
        self._pending: set[zmq.Socket] = set()  # not known empty: read without waiting
        self._roles: dict[zmq.Socket, tuple[str, str, int | None]] = {}
        self._dealers: dict[str, zmq.Socket] = {}
        self._connected_once: set[str] = set()
        self._disconnected: set[str] = set()
        self._changes: collections.deque[FleetChange] = collections.deque()  # from any thread
        self.unopened: dict[str, str] = {}  # joined workers whose sockets failed to open: why
        self._last_reopen = float("-inf")
        # A departed worker's stream is followed this long after its departure, then closed:
        # its history keeps reaching the lookups of the membership band around the change
        # (a draining engine's), so they can be judged. 0: closed at once.
        self.linger_s = linger_s
        self.lingering: dict[str, float] = {}  # departed worker -> when its sockets close
        self.ready = threading.Event()  # set once every socket is connected or bound
        self.error: Exception | None = None  # why the sockets could not be opened
        self.failed: Exception | None = None  # why the running loop stopped, if it did

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn the loop; raises what `run` could not open (a bad endpoint, a port in use)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._serve, name="kvmiss-collector", daemon=True)
            self._thread.start()
            self.ready.wait(10)
            if self.error is not None:
                raise self.error

    def shutdown(self, timeout: float = 5.0) -> bool:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def run(self) -> None:
        """The event loop; returns after `shutdown()`. Sockets live and die on this thread."""
        try:
            try:
                self._open()
            except Exception as exc:
                self.error = exc
                raise
            finally:
                self.ready.set()
            while not self._stop.is_set():
                self._poll_once()
        finally:
            self._close()

    def _serve(self) -> None:
        try:
            self.run()
        except Exception as exc:
            if exc is not self.error:  # an open failure is raised by start() instead
                self.failed = exc
                log.critical("the KV-event collector stopped (%s: %s): no worker's events are applied from "
                             "now on; /readyz answers 503 (restart kvmiss serve)", type(exc).__name__, exc)
                raise

    @property
    def alive(self) -> bool:
        """The loop runs (or has not been started): false once it died."""
        return self.failed is None and (self._thread is None or self._thread.is_alive() or self._stop.is_set())

    # --- sockets ---------------------------------------------------------------------------

    def _open(self) -> None:
        self._epoll = _fd_poller()
        if self.topics is not None:
            sub, monitor = self.topics.open(self._ctx, self._configure_sub)
            self._register(sub, TOPICS, "")
            self._register(monitor, TOPICS_MONITOR, "")
            self.topics.bind()
        for spec in self.fleet.specs.values():
            self._open_worker(spec)

    def _configure_sub(self, sub: zmq.Socket) -> None:
        ivl, ivl_max = self._reconnect
        sub.setsockopt(zmq.RCVHWM, SUB_RCVHWM)
        sub.setsockopt(zmq.RECONNECT_IVL, ivl)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, ivl_max)
        sub.setsockopt(zmq.LINGER, 0)
        heartbeat_ms, timeout_ms = self._heartbeat
        if heartbeat_ms > 0:  # 0: off
            sub.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms)
            sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
            sub.setsockopt(zmq.HEARTBEAT_TTL, timeout_ms)
            sub.setsockopt(zmq.CONNECT_TIMEOUT, timeout_ms)

    def _open_worker(self, spec: WorkerSpec) -> None:
        if self.topics is not None and self.topics.scheme.feeds(spec):
            # Its events come on the shared SUB: nothing to open; what it sent meanwhile, now.
            self.topics.joined(spec, self._deliver_topic)
            return
        sub = self._ctx.socket(zmq.SUB)
        self._configure_sub(sub)
        sub.setsockopt(zmq.SUBSCRIBE, spec.topic.encode())
        monitor = sub.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._register(sub, SUB, spec.id)  # first, so a failed connect still closes them
        self._register(monitor, MONITOR, spec.id)
        if spec.bind:
            sub.bind(spec.sub_endpoint())
        else:
            sub.connect(spec.sub_endpoint())

    def _close_worker(self, worker: str) -> None:
        """Every socket of ``worker`` (SUB, monitor, a replay or probe DEALER), closed."""
        socks = [sock for sock, (_, owner, _) in self._roles.items() if owner == worker]
        for sock in socks:
            if self._roles[sock][0] == SUB:
                try:
                    sock.disable_monitor()
                except zmq.ZMQError:
                    pass
        for sock in socks:
            self._unregister(sock)
        self._dealers.pop(worker, None)
        if self.topics is not None:
            self.topics.departed(worker)
        self._connected_once.discard(worker)
        self._disconnected.discard(worker)

    # --- the fleet changing ----------------------------------------------------------------

    def change_fleet(self, change: FleetChange) -> None:
        """Any thread: carry ``change`` out on the loop's thread before its next poll."""
        self._changes.append(change)

    def connection(self, worker: str) -> str:
        """Any thread (a scrape): "connected", "disconnected" (since its last connection),
        "never" (no connection yet) or "unopened" (its socket could not be opened)."""
        if worker in self.unopened:
            return "unopened"
        if self.topics is not None and worker in self.fleet.specs and self.topics.scheme.feeds(self.fleet.specs[worker]):
            return self.topics.connection(worker)
        if worker not in self._connected_once:
            return "never"
        return "disconnected" if worker in self._disconnected else "connected"

    def _apply_changes(self) -> None:
        while self._changes:
            change = self._changes.popleft()
            for worker in change.departed:
                if self.linger_s > 0 and worker in self.fleet.streams and worker not in self.unopened:
                    self.lingering.setdefault(worker, self.clock() + self.linger_s)
                else:
                    self._drop_worker(worker)
            for spec in change.joined:
                if spec.id in self.fleet.streams:  # lingering, or listed twice: a new stream
                    self._drop_worker(spec.id)
                self.fleet.add(spec)
                self._try_open(spec)
        self._due = self.fleet.next_deadline()

    def _drop_worker(self, worker: str) -> None:
        self.lingering.pop(worker, None)
        self._close_worker(worker)
        self.unopened.pop(worker, None)
        self.fleet.remove(worker)

    def _end_lingering(self, now: float) -> None:
        for worker in [w for w, until in self.lingering.items() if until <= now]:
            self._drop_worker(worker)

    def _try_open(self, spec: WorkerSpec) -> None:
        try:
            self._open_worker(spec)
        except (zmq.ZMQError, ValueError) as exc:
            self._close_worker(spec.id)
            if spec.id not in self.unopened:
                log.error("worker %s: cannot open its socket (%s); listed and unreachable, tried again every %g s",
                          spec.id, exc, REOPEN_INTERVAL_S)
            self.unopened[spec.id] = str(exc)
        else:
            if self.unopened.pop(spec.id, None) is not None:
                log.info("worker %s: socket opened", spec.id)

    def _reopen(self, now: float) -> None:
        self._last_reopen = now
        for worker in list(self.unopened):
            spec = self.fleet.specs.get(worker)
            if spec is None:
                del self.unopened[worker]
            else:
                self._try_open(spec)

    def _register(self, sock: zmq.Socket, role: str, worker: str, request_id: int | None = None) -> None:
        fd = sock.getsockopt(zmq.FD)
        self._roles[sock] = (role, worker, request_id)
        self._by_fd[fd] = sock
        self._fds[sock] = fd
        self._epoll.register(fd, select.POLLIN)
        # Whatever was done to the socket so far (options, connect, a send) may have taken
        # the edge its ZMQ_FD would have signalled.
        self._pending.add(sock)

    def _unregister(self, sock: zmq.Socket) -> None:
        self._roles.pop(sock, None)
        self._pending.discard(sock)
        fd = self._fds.pop(sock, None)
        if fd is not None:
            del self._by_fd[fd]
            self._epoll.unregister(fd)
        sock.close(linger=0)

    def _close(self) -> None:
        for sock in list(self._roles):
            role, _, _ = self._roles[sock]
            if role in (SUB, TOPICS):
                try:
                    sock.disable_monitor()
                except zmq.ZMQError:
                    pass
            self._unregister(sock)
        self._dealers.clear()
        if self._epoll is not None:
            self._epoll.close()
        if self._own_context:
            self._ctx.destroy(linger=0)  # this thread held its every socket

    # --- the loop --------------------------------------------------------------------------

    def _poll_once(self) -> None:
        if self._changes:
            self._apply_changes()
        # After a wait that found messages the next one waits out the gap (see MIN_POLL_GAP_S),
        # so they are read in batches (ZeroMQ holds them): one wake-up and one receive call
        # per socket for many messages, not one per message.
        gap = min(MAX_POLL_GAP_S, max(MIN_POLL_GAP_S, POLL_GAP_PER_SOCKET_S * len(self._roles)))
        wait = self._last_poll + gap - time.monotonic()
        if self._found and wait > MIN_SLEEP_S:  # (below that, sleep overshoots)
            time.sleep(wait)
        due = self._due
        timeout = POLL_INTERVAL_S
        if due is not None:
            timeout = max(0.0, min(timeout, due - self.clock()))
        if self._pending:
            timeout = 0.0
        self._last_poll = time.monotonic()
        ready = self._pending
        self._pending = set()
        by_fd = self._by_fd
        for fd, _ in self._epoll.poll(timeout):
            sock = by_fd.get(fd)
            if sock is not None:
                ready.add(sock)
        if self._last_poll - self._last_sweep >= SWEEP_INTERVAL_S:
            self._last_sweep = self._last_poll
            ready.update(self._roles)
        self._found = bool(ready)
        # Connection facts first: a reconnect must reach the stream before the new
        # connection's first batch does.
        for sock in sorted(ready, key=lambda s: self._roles.get(s, ("",))[0] != MONITOR):
            if sock in self._roles:
                self._drain(sock)
        now = self.clock()
        # Timers run when one is due, and every poll interval anyway (time-based health keeps
        # up). Not after every wake-up: a round asks every stream, and with hundreds of workers
        # that was most of the collector's CPU at low batch rates (bench_ceiling.py).
        if (self._due is None or self._due > now) and now - self._last_round < POLL_INTERVAL_S:
            return
        self._last_round = now
        if self.unopened and now - self._last_reopen >= REOPEN_INTERVAL_S:
            self._reopen(now)
        if self.lingering:
            self._end_lingering(now)
        unread = self._unread_workers()
        if self.recorder is not None:  # playback must run each timer at this same point
            for worker, stream in self.fleet.streams.items():
                due = stream.next_deadline
                if due is not None and due <= now:
                    self.recorder.write(RecordedMessage(now, worker, TICK, [UNREAD] if worker in unread else []))
        for worker, replay in self.fleet.on_tick(now, unread):
            self._send_replay(worker, replay)
        self._due = self.fleet.next_deadline()

    def _unread_workers(self) -> set[str]:
        """Workers whose SUB socket may hold messages not yet read: read to the cap, or
        signalled since it was last read (a drain that waited on the hand-over takes time)."""
        roles, by_fd = self._roles, self._by_fd
        socks = set(self._pending)
        socks.update(sock for fd, _ in self._epoll.poll(0) if (sock := by_fd.get(fd)) is not None)
        unread = {roles[sock][1] for sock in socks if sock in roles and roles[sock][0] == SUB}
        if self.topics is not None and self.topics.sub in socks:  # the shared SUB: any of them
            feeds = self.topics.scheme.feeds
            unread.update(w for w, spec in self.fleet.specs.items() if feeds(spec))
        return unread

    def _drain(self, sock: zmq.Socket) -> None:
        role, worker, request_id = self._roles[sock]
        if role in (TOPICS, TOPICS_MONITOR):  # the monitor is read with every message
            if self.topics.drain(self._deliver_topic, MAX_MESSAGES_PER_SOCKET):
                self._pending.add(self.topics.sub)
            return
        if role != MONITOR and self._recv_messages is not None:
            try:
                messages = self._recv_messages(sock.underlying, MAX_MESSAGES_PER_SOCKET)
            except OSError:  # let pyzmq raise (or handle) the same failure, worded its way
                messages = None
            if messages is not None:
                for frames in messages:
                    self._deliver(sock, worker, role, frames, request_id)
                    if sock not in self._roles:  # a replay request replaced this dealer
                        return
                if len(messages) == MAX_MESSAGES_PER_SOCKET:  # capped, not known empty
                    self._pending.add(sock)
                return
        for _ in range(MAX_MESSAGES_PER_SOCKET):
            try:
                if role == MONITOR:
                    frames = self._monitor_fact(worker, recv_monitor_message(sock, zmq.NOBLOCK))
                    if frames is None:
                        continue
                else:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._deliver(sock, worker, role, frames, request_id)
            if sock not in self._roles:  # a replay request replaced this dealer
                return
        self._pending.add(sock)  # capped, not known empty

    def _deliver(self, sock: zmq.Socket, worker: str, role: str, frames: list[bytes],
                 request_id: int | None) -> None:
        now = self.clock()
        if self.recorder is not None:
            self.recorder.write(RecordedMessage(now, worker, role, frames, request_id))
        for replay in self.fleet.on_message(worker, role, frames, now, request_id):
            self._send_replay(worker, replay)

    def _deliver_topic(self, worker: str, role: str, frames: list[bytes]) -> None:
        self._deliver(self.topics.sub, worker, role, frames, None)

    def _monitor_fact(self, worker: str, event: dict) -> list[bytes] | None:
        kind = event["event"]
        if kind == zmq.EVENT_DISCONNECTED:
            self._disconnected.add(worker)
            log.info("worker %s: publisher disconnected", worker)
            return None
        if kind in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
            first = worker not in self._connected_once
            self._connected_once.add(worker)
            if first:
                return [CONNECTED]
            if worker in self._disconnected:
                self._disconnected.discard(worker)
                log.info("worker %s: publisher reconnected", worker)
                return [RECONNECTED]
        return None

    def _send_replay(self, worker: str, replay: RequestReplay) -> None:
        old = self._dealers.pop(worker, None)
        if old is not None:
            self._unregister(old)
        address = self.fleet.specs[worker].replay_address()
        if address is None:
            return
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(address)
        dealer.send_multipart(encode_replay_request(replay.start_seq))
        self._dealers[worker] = dealer
        self._register(dealer, DEALER, worker, replay.request_id)
        # Its time-out is the one timer a message can bring closer than the next round (a tail
        # probe falls due an interval of silence later): keep the poll from sleeping past it.
        due = self.fleet.streams[worker].next_deadline
        if due is not None and (self._due is None or due < self._due):
            self._due = due
