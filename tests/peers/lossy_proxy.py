"""A real ZeroMQ forwarder between a KV-event publisher and the collector, for fault injection.

Live side::

    publisher PUB  -->  SUB [LossyProxy] XPUB  -->  collector SUB

Replay side (optional)::

    collector DEALER  -->  ROUTER [LossyProxy] DEALER (one per client)  -->  publisher ROUTER

Everything forwarded is the real publisher's traffic. The proxy only decides, by the
sequence number it reads from frame 2 (8 bytes, big-endian), whether a live message is
forwarded, dropped, delayed, held back behind a later one, or has its payload replaced;
`pause()` discards everything (a consumer outage) until `resume()`. On the replay side it
forwards requests and replies unchanged, or, with ``answer_replay=False``, receives requests
and never answers (a replay endpoint that hangs).

Every rule is one-shot: ``drop(5)`` drops the next message with seq 5 only, so a rule set
for a restarted publisher's seq 0 does not touch the previous process's seq 0 if that one
has already passed.

All sockets live on the proxy's own thread; the test thread talks to it through a command
queue and reads what happened (``received``, ``forwarded``, ``dropped``, ``discarded``,
``replay_requests``) under a lock, waiting with `wait_for` instead of sleeping.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

_TICK_S = 0.005  # how often the thread looks at its command queue and delayed messages


def seq_of(frames: list[bytes]) -> int | None:
    """The sequence number of a live message, or None when frame 2 is not 8 bytes."""
    if len(frames) >= 2 and len(frames[1]) == 8:
        return int.from_bytes(frames[1], "big")
    return None


class LossyProxy:
    """Forward a publisher's live (and optionally replay) traffic, with faults on request.

    ``upstream``: the publisher's PUB endpoint (the proxy connects to it).
    ``replay_upstream``: the publisher's replay ROUTER, or None for no replay side.
    ``answer_replay``: False makes the replay side swallow requests (never answers);
    ``host``, ``port``, ``replay_port``: where it binds (default: 127.0.0.1, free ports).
    with ``replay_upstream=None`` and ``answer_replay=False`` it is a bare silent ROUTER.
    After `start()`, ``endpoint`` / ``replay_endpoint`` are the proxy's bound addresses.
    """

    def __init__(self, upstream: str, *, replay_upstream: str | None = None,
                 answer_replay: bool = True, context: zmq.Context | None = None,
                 host: str = "127.0.0.1", port: int | None = None, replay_port: int | None = None):
        self.upstream = upstream
        # Where the proxy binds: an address of its own (127.0.0.x) and fixed ports stand in for
        # a pod of a fleet whose engines all listen on the same ports ([fleet.dns] tests).
        self.binds = (f"tcp://{host}:{port or '*'}", f"tcp://{host}:{replay_port or '*'}")
        self.replay_upstream = replay_upstream
        self.answer_replay = answer_replay
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None
        self._ctx = context or zmq.Context.instance()
        self._lock = threading.Condition()
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread: threading.Thread | None = None
        # rules (one-shot, by seq)
        self._drop: set[int] = set()
        self._delay: dict[int, float] = {}
        self._after: dict[int, int] = {}  # seq -> forward it right after this other seq
        self._replace: dict[int, bytes] = {}
        self._paused = False
        # what happened (read under the lock)
        self.received: list[int | None] = []
        self.forwarded: list[int | None] = []
        self.dropped: list[int | None] = []
        self.discarded: list[int | None] = []  # while paused
        self.upstream_connects = 0  # handshakes with the publisher (a restart adds one)
        self.subscriptions = 0  # subscribe messages from collectors
        self.replay_requests: list[int | None] = []  # start seqs asked for
        # thread-side state
        self._delayed: list[tuple[float, int, list[bytes]]] = []
        self._waiting: dict[int, list[list[bytes]]] = {}  # after-seq -> held messages
        self._order = itertools.count()

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self, timeout: float = 5.0) -> LossyProxy:
        self._thread = threading.Thread(target=self._run, name="lossy-proxy", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError("lossy proxy did not start")
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> LossyProxy:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- faults (callable from any thread) ----------------------------------------------------

    def drop(self, *seqs: int) -> None:
        """Drop the next live message carrying each of these seqs."""
        with self._lock:
            self._drop.update(seqs)

    def delay(self, seq: int, seconds: float) -> None:
        """Forward the next message with ``seq`` ``seconds`` late; later ones overtake it."""
        with self._lock:
            self._delay[seq] = seconds

    def reorder(self, seq: int, after: int) -> None:
        """Hold the next message with ``seq`` until the one with ``after`` has been forwarded."""
        with self._lock:
            self._after[seq] = after

    def replace_payload(self, seq: int, payload: bytes) -> None:
        """Forward the next message with ``seq`` with ``payload`` instead of its own."""
        with self._lock:
            self._replace[seq] = payload

    def inject(self, frames: list[bytes]) -> None:
        """Publish ``frames`` on the proxy's PUB now, as if the publisher had sent them."""
        self._commands.put(lambda: self._send(list(frames)))

    def pause(self) -> None:
        """Stop forwarding; everything received meanwhile is discarded (consumer outage)."""
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._paused = False

    def set_answer_replay(self, answer: bool) -> None:
        with self._lock:
            self.answer_replay = answer

    # --- observing ----------------------------------------------------------------------------

    def wait_for(self, predicate: Callable[[LossyProxy], bool], timeout: float = 5.0) -> bool:
        """Wait until ``predicate(self)`` holds (evaluated under the lock); False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: predicate(self), timeout)

    def wait_ready(self, subscribers: int = 1, timeout: float = 5.0) -> bool:
        """Connected to the publisher and ``subscribers`` collector subscriptions received."""
        return self.wait_for(
            lambda p: p.upstream_connects >= 1 and p.subscriptions >= subscribers, timeout)

    def wait_forwarded(self, seq: int, count: int = 1, timeout: float = 5.0) -> bool:
        return self.wait_for(lambda p: p.forwarded.count(seq) >= count, timeout)

    def wait_received(self, n: int, timeout: float = 5.0) -> bool:
        """``n`` live messages in total have come from the publisher."""
        return self.wait_for(lambda p: len(p.received) >= n, timeout)

    # --- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        ctx = self._ctx
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RECONNECT_IVL, 20)  # find a restarted publisher quickly
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 200)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sub.connect(self.upstream)
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every (re)subscription is reported
        pub.bind(self.binds[0])
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._pub = pub
        router = None
        if self.replay_upstream is not None or not self.answer_replay:
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(self.binds[1])
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        dealers: dict[zmq.Socket, bytes] = {}  # upstream dealer -> client identity
        by_client: dict[bytes, zmq.Socket] = {}
        poller = zmq.Poller()
        for sock in (sub, monitor, pub) + ((router,) if router is not None else ()):
            poller.register(sock, zmq.POLLIN)
        self._started.set()
        try:
            while not self._stop.is_set():
                wait = _TICK_S
                if self._delayed:
                    wait = max(0.0, min(wait, self._delayed[0][0] - time.monotonic()))
                ready = dict(poller.poll(wait * 1000))
                while True:
                    try:
                        self._commands.get_nowait()()
                    except queue.Empty:
                        break
                if monitor in ready:
                    self._drain(monitor, self._on_monitor, monitor=True)
                if pub in ready:
                    self._drain(pub, self._on_subscription)
                if sub in ready:
                    self._drain(sub, self._route)
                while self._delayed and self._delayed[0][0] <= time.monotonic():
                    self._send(heapq.heappop(self._delayed)[2])
                if router is not None and router in ready:
                    for frames in self._recv_all(router):
                        self._on_replay_request(frames, dealers, by_client, poller)
                for dealer, client in list(dealers.items()):
                    if dealer in ready:
                        for frames in self._recv_all(dealer):
                            router.send_multipart([client] + frames)
        finally:
            sub.disable_monitor()
            for sock in [sub, monitor, pub, router, *dealers]:
                if sock is not None:
                    sock.close(linger=0)

    @staticmethod
    def _recv_all(sock: zmq.Socket) -> list[list[bytes]]:
        out = []
        while True:
            try:
                out.append(sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return out

    def _drain(self, sock: zmq.Socket, handle: Callable, monitor: bool = False) -> None:
        while True:
            try:
                item = recv_monitor_message(sock, zmq.NOBLOCK) if monitor else sock.recv_multipart(
                    zmq.NOBLOCK)
            except zmq.Again:
                return
            handle(item)

    def _on_monitor(self, event: dict) -> None:
        if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            with self._lock:
                self.upstream_connects += 1
                self._lock.notify_all()

    def _on_subscription(self, frames: list[bytes]) -> None:
        if frames and frames[0][:1] == b"\x01":
            with self._lock:
                self.subscriptions += 1
                self._lock.notify_all()

    def _route(self, frames: list[bytes]) -> None:
        seq = seq_of(frames)
        with self._lock:
            self.received.append(seq)
            self._lock.notify_all()
            if self._paused:
                self.discarded.append(seq)
                return
            if seq in self._drop:
                self._drop.discard(seq)
                self.dropped.append(seq)
                return
            if seq in self._replace:
                frames = frames[:2] + [self._replace.pop(seq)]
            if seq in self._delay:
                due = time.monotonic() + self._delay.pop(seq)
                heapq.heappush(self._delayed, (due, next(self._order), frames))
                return
            if seq in self._after:
                self._waiting.setdefault(self._after.pop(seq), []).append(frames)
                return
        self._send(frames)

    def _send(self, frames: list[bytes]) -> None:
        seq = seq_of(frames)
        self._pub.send_multipart(frames)
        with self._lock:
            self.forwarded.append(seq)
            held = self._waiting.pop(seq, []) if seq is not None else []
            self._lock.notify_all()
        for later in held:
            self._send(later)

    def _on_replay_request(self, frames: list[bytes], dealers: dict, by_client: dict,
                           poller: zmq.Poller) -> None:
        client, body = frames[0], frames[1:]
        start = int.from_bytes(body[1], "big") if len(body) == 2 and len(body[1]) == 8 else None
        with self._lock:
            self.replay_requests.append(start)
            answer = self.answer_replay and self.replay_upstream is not None
            self._lock.notify_all()
        if not answer:
            return
        dealer = by_client.get(client)
        if dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.replay_upstream)
            poller.register(dealer, zmq.POLLIN)
            dealers[dealer] = client
            by_client[client] = dealer
        dealer.send_multipart(body)  # [b"", start_seq]: the publisher sees a plain DEALER
