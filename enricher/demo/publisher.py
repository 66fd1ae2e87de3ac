"""A simulated engine process's KV-event publisher, speaking vLLM 0.33's wire protocol.

Why our own and not `schemas.events`: kvmiss's Structs are built to *decode* every engine
version, so every optional field has a default and is dropped when None. vLLM 0.33 declares
``parent_block_hash``, ``lora_id``, ``medium`` and ``lora_name`` without defaults, so its
publisher always writes them, as nil when None. The Structs below declare the fields the way
vLLM does, so a batch we publish is byte-identical to the one vLLM would publish
(tests/enricher/demo/test_demo.py checks it against the captured frames).

Transport (shared/reference/WIRE.md): a PUB socket sends ``[topic, seq(8 bytes BE), payload]``
with ``seq`` counting from 0 in every publisher instance; a ROUTER answers ``[b"", start]`` with
``[b"", topic, seq, payload]`` for every ring entry with ``seq >= start``, then the end marker
``[b"", b"", ff*8, b""]``. Malformed requests get no answer. The ring keeps the last
``buffer_steps`` batches, whether or not they made it onto the wire.

Thread contract: `publish`, `set_faults` and `shutdown` are called from one owner thread.
The sockets live on the publisher's own thread (as in vLLM): the owner hands batches over an
inproc PUSH/PULL pair, so a slow or delayed send never blocks the engine loop.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Any, Union

import msgspec
import zmq

END_SEQ = b"\xff" * 8  # (-1).to_bytes(8, "big", signed=True)
_INBOXES = itertools.count()  # unique inproc names: a restarted process must not reach the old one
_STOP_FLUSH, _STOP_CRASH = b"flush", b"crash"


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", omit_defaults=True,
                  gc=False):
    """vLLM 0.33 ``BlockStored``: fields before ``extra_keys`` have no default (always written)."""

    block_hashes: list[int | bytes]  # uint64, or raw digests (INT_BLOCK_HASHES=0)
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[int] | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", omit_defaults=True,
                   gc=False):
    """vLLM 0.33 ``BlockRemoved`` (one event per evicted block copy)."""

    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    """vLLM 0.33 ``AllBlocksCleared`` (prefix-cache reset)."""


WireEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's ``KVEventBatch``: ``[ts, events, data_parallel_rank]`` (array-like structs keep
    every element, so a None rank is written as nil)."""

    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack payload vLLM's publisher would send for ``batch``."""
    return _encoder.encode(batch)


class Faults(msgspec.Struct, kw_only=True):
    """What this publisher does wrong on purpose, for batches published from now on.

    ``drop``: how many next batches are lost on the wire (still kept in the ring, so replay
    recovers them while the ring holds them). ``delay_s``: each batch leaves this long after
    it was handed over, in order (a lagging stream; ``ts`` stays the step's publish time).
    """

    drop: int = 0
    delay_s: float = 0.0


class Publisher:
    """One engine process's PUB + replay ROUTER on loopback, with its own sending thread.

    ``pub_port`` / ``replay_port`` 0 pick free ports (read them back after `start`); a
    restarted process passes the old ports to rebind the same endpoints.
    """

    def __init__(self, ctx: zmq.Context, *, topic: str = "kv-events", buffer_steps: int = 10_000,
                 pub_port: int = 0, replay_port: int = 0, host: str = "127.0.0.1"):
        self.ctx = ctx
        self.topic = topic.encode()
        self.buffer_steps = buffer_steps
        self.host = host
        self.pub_port, self.replay_port = pub_port, replay_port
        self.faults = Faults()
        self.published = 0
        self.dropped_on_wire = 0
        self._seq = itertools.count()  # from 0 in every publisher instance, as in vLLM
        self._ring: collections.deque[tuple[bytes, bytes]] = collections.deque(maxlen=buffer_steps)
        self._inbox = f"inproc://kvmiss-demo-publisher-{next(_INBOXES)}"
        self._push: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._bound = threading.Event()
        self._error: BaseException | None = None

    @property
    def pub_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.pub_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.replay_port}"

    def start(self, timeout: float = 5.0) -> None:
        """Bind both sockets (retrying while a previous process's ports are released)."""
        self._thread = threading.Thread(target=self._run, name="kvmiss-demo-publisher", daemon=True)
        self._thread.start()
        if not self._bound.wait(timeout) or self._error is not None:
            raise RuntimeError(f"publisher could not bind {self.pub_endpoint}: {self._error}")
        self._push = self.ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 1000)
        self._push.connect(self._inbox)

    def publish(self, batch: EventBatch) -> int:
        """Hand one step's batch to the sending thread; returns its sequence number."""
        assert self._push is not None, "start() the publisher before publishing"
        seq = next(self._seq)
        drop = self.faults.drop > 0
        if drop:
            self.faults.drop -= 1
            self.dropped_on_wire += 1
        due = time.time() + self.faults.delay_s
        self._push.send_multipart([seq.to_bytes(8, "big"), encode_batch(batch),
                                   b"\x01" if drop else b"\x00", repr(due).encode()])
        self.published += 1
        return seq

    def shutdown(self, *, crash: bool = False, timeout: float = 5.0) -> None:
        """Stop the thread and close the sockets. ``crash``: batches not yet on the wire die
        with the process (as when an engine is killed); otherwise they are sent first."""
        if self._push is not None:
            self._push.send_multipart([_STOP_CRASH if crash else _STOP_FLUSH])
            self._push.close()
            self._push = None
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # --- the sending thread ---------------------------------------------------------------

    def _bind(self, sock: zmq.Socket, port: int) -> int:
        deadline = time.monotonic() + 3.0
        while True:
            try:
                if port == 0:
                    return sock.bind_to_random_port(f"tcp://{self.host}")
                sock.bind(f"tcp://{self.host}:{port}")
                return port
            except zmq.ZMQError as exc:  # the previous process's listener is still closing
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _run(self) -> None:
        pub, router, pull = (self.ctx.socket(kind) for kind in (zmq.PUB, zmq.ROUTER, zmq.PULL))
        for sock in (pub, router, pull):
            sock.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        try:
            pull.bind(self._inbox)
            self.pub_port = self._bind(pub, self.pub_port)
            self.replay_port = self._bind(router, self.replay_port)
        except zmq.ZMQError as exc:
            self._error = exc
            self._bound.set()
            for sock in (pub, router, pull):
                sock.close()
            return
        self._bound.set()
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        poller.register(router, zmq.POLLIN)
        pending: collections.deque[tuple[float, bytes, bytes, bool]] = collections.deque()
        stop: bytes | None = None
        try:
            while stop is None or (stop == _STOP_FLUSH and pending):
                wait_ms = 100.0
                if pending:
                    wait_ms = max(0.0, (pending[0][0] - time.time()) * 1000)
                if stop is not None:
                    wait_ms = 0.0
                ready = dict(poller.poll(wait_ms))
                if pull in ready:
                    stop = self._take(pull, pending) or stop
                if stop == _STOP_CRASH:
                    break
                while pending and (stop is not None or pending[0][0] <= time.time()):
                    _, seq, payload, drop = pending.popleft()
                    if not drop:
                        pub.send_multipart([self.topic, seq, payload])
                    self._ring.append((seq, payload))
                if router in ready:
                    self._answer_replays(router)
        finally:
            for sock in (pub, router, pull):
                sock.close()

    @staticmethod
    def _take(pull: zmq.Socket, pending: collections.deque) -> bytes | None:
        while True:
            try:
                frames = pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return None
            if len(frames) == 1:
                return frames[0]
            seq, payload, drop, due = frames
            pending.append((float(due), seq, payload, drop == b"\x01"))

    def _answer_replays(self, router: zmq.Socket) -> None:
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                continue  # vLLM logs and ignores anything else: the client times out
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._ring):
                if int.from_bytes(seq, "big") >= start:
                    router.send_multipart([identity, b"", self.topic, seq, payload])
            router.send_multipart([identity, b"", b"", END_SEQ, b""])
