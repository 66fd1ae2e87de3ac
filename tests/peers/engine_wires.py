"""TensorRT-LLM's and ATOM's KV-event wires, for tests: payloads and a publisher.

Neither engine's publisher runs here (TensorRT-LLM needs CUDA; ATOM is not on PyPI), so these
are written from their sources (docs/ENGINES.md names the files and commits read):
TensorRT-LLM's `tensorrt_llm/_torch/pyexecutor/kv_cache_events.py` (msgspec maps) and its
native serializer in `streamingEventSink.cpp` (every int packed as msgpack int64), ATOM's
`atom/distributed/kv_events.py` (msgspec ``array_like`` events, every field written, and its
replay ROUTER). The structs below are laid out as theirs; the code is kvmiss's own.
"""

from __future__ import annotations

import struct
import threading
from collections import deque
from typing import Any

import msgspec
import zmq

END = b"\xff" * 8


def signed(h: int) -> int:
    """TensorRT-LLM's wire form of a 64-bit hash: the same 8 bytes as a signed int64."""
    return h - (1 << 64) if h >= 1 << 63 else h


# --- TensorRT-LLM: tagged maps, ``type`` first, Nones omitted by omit_defaults ---------------

class _TrtEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class TrtMmKey(msgspec.Struct, omit_defaults=True, tag="mm_key"):
    hash: str
    start_offset: int
    uuid: str | None = None


class TrtStored(_TrtEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int | str]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    mm_keys: list[list[TrtMmKey]] | None = None


class TrtRemoved(_TrtEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class TrtCleared(_TrtEvent, tag="AllBlocksCleared"):
    pass


class TrtBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def trt_stored(hashes: list[int], parent: int | None, tokens: list, block_size: int = 4, **more) -> TrtStored:
    """One coalesced store as TensorRT-LLM writes it: hashes (given as uint64) signed."""
    return TrtStored(block_hashes=[signed(h) for h in hashes], parent_block_hash=None if parent is None else signed(parent),
                     token_ids=tokens, block_size=block_size, lora_id=None, medium="GPU", lora_name=None, **more)


def trt_removed(hashes: list[int]) -> TrtRemoved:
    return TrtRemoved(block_hashes=[signed(h) for h in hashes], medium="GPU")


def trt_payload(ts: float, events: list, rank: int = 0) -> bytes:
    return msgspec.msgpack.encode(TrtBatch(ts=ts, events=events, data_parallel_rank=rank))


def trt_native_payload(ts: float, stores: list[tuple[list[int], int | None, list[int]]],
                       removals: list[list[int]], block_size: int, rank: int) -> bytes:
    """The native serializer's bytes: fixed 8-key store maps and 3-key removal maps, every
    int as msgpack int64 (0xd3), the timestamp as float64."""
    out = bytearray()

    def i64(v: int) -> None:
        out.extend(b"\xd3" + struct.pack(">q", v))

    def text(s: str) -> None:
        out.extend(bytes([0xA0 | len(s)]) + s.encode())

    def ints(values: list[int]) -> None:
        out.extend(bytes([0x90 | len(values)]) if len(values) <= 15 else b"\xdc" + struct.pack(">H", len(values)))
        for v in values:
            i64(v)

    out.extend(b"\x93\xcb" + struct.pack(">d", ts))
    count = len(stores) + len(removals)
    out.extend(bytes([0x90 | count]))
    for hashes, parent, tokens in stores:
        out.extend(b"\x88")
        text("type"), text("BlockStored"), text("block_hashes"), ints([signed(h) for h in hashes])
        text("parent_block_hash")
        out.extend(b"\xc0") if parent is None else i64(signed(parent))
        text("token_ids"), ints(tokens), text("block_size"), i64(block_size)
        text("lora_id"), out.extend(b"\xc0"), text("medium"), text("GPU"), text("lora_name"), out.extend(b"\xc0")
    for hashes in removals:
        out.extend(b"\x83")
        text("type"), text("BlockRemoved"), text("block_hashes"), ints([signed(h) for h in hashes])
        text("medium"), text("GPU")
    i64(rank)
    return bytes(out)


# --- ATOM: positional arrays, tag first, every field written ---------------------------------

class _AtomEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class AtomStored(_AtomEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    token_offset: int | None = None


class AtomRemoved(_AtomEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = "GPU"
    group_idx: int | None = None


class AtomCleared(_AtomEvent, tag="AllBlocksCleared"):
    medium: str | None = None


class AtomTransferred(_AtomEvent, tag="BlockTransferred"):
    block_hashes: list[int]
    from_medium: str
    to_medium: str
    group_idx: int | None = None


class AtomBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def atom_payload(ts: float, events: list, rank: int | None = None) -> bytes:
    return msgspec.msgpack.encode(AtomBatch(ts=ts, events=events, data_parallel_rank=rank))


# --- a publisher with either engine's replay layout -------------------------------------------

class WirePublisher:
    """A bound PUB sending ``[topic, seq, payload]`` from seq 0, and a replay ROUTER.

    ``engine`` picks the replay layout: "trtllm" replies ``[id, b"", topic, seq, payload]``
    and ends with ``[id, b"", b"", ff*8, b""]``; "atom" replies ``[id, b"", seq, payload]``
    and ends with ``[id, b"", ff*8, msgpack([oldest, latest])]``. ``publish(..., lost=True)``
    buffers a batch without sending it live: a gap only replay can fill."""

    def __init__(self, engine: str, endpoint: str, replay_endpoint: str, topic: str = "kv"):
        self.engine, self.topic = engine, topic.encode()
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(endpoint)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(replay_endpoint)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=1000)
        self.seq = 0
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve_replay, daemon=True)
        self.thread.start()

    def publish(self, payload: bytes, *, lost: bool = False) -> int:
        with self.lock:
            seq, self.seq = self.seq, self.seq + 1
            self.buffer.append((seq, payload))
            if not lost:
                self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        with self.lock:
            self.pub.send_multipart(frames)

    def _serve_replay(self) -> None:
        while not self.stopping.is_set():
            if not self.router.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            with self.lock:
                buffered = list(self.buffer)
            for seq, payload in buffered:
                if seq >= first:
                    body = [self.topic] if self.engine == "trtllm" else []
                    self.router.send_multipart([client, b"", *body, seq.to_bytes(8, "big"), payload])
            if self.engine == "trtllm":
                self.router.send_multipart([client, b"", b"", END, b""])
            else:
                window = [buffered[0][0], buffered[-1][0]] if buffered else [None, None]
                self.router.send_multipart([client, b"", END, msgspec.msgpack.encode(window)])

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(2)
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()
