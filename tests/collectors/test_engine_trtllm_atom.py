"""TensorRT-LLM's and ATOM's KV events: each adapter reads its engine's layouts, refuses what
it cannot apply by name, and a worker configured with it follows the engine's stream over
real ZeroMQ sockets, replay included.

Frames are built to the engines' layouts from their sources and tests (tests/peers/engine_wires.py
says which); neither publisher runs here."""

from __future__ import annotations

import queue
import time

import msgspec
import pytest
from engine_wires import (
    AtomCleared,
    AtomRemoved,
    AtomStored,
    AtomTransferred,
    TrtCleared,
    TrtMmKey,
    WirePublisher,
    atom_payload,
    signed,
    trt_native_payload,
    trt_payload,
    trt_removed,
    trt_stored,
)
from zmq_ports import free_tcp

from kvmiss.collectors.continuity import Apply, Hole, HoleReason
from kvmiss.collectors.engines import ADAPTERS, canonical_medium
from kvmiss.collectors.fleet import SUB, Fleet
from kvmiss.collectors.frames import BatchMessage, FrameError, ReplayEnd
from kvmiss.collectors.subscriber import Subscriber
from kvmiss.schemas.config import WorkerSpec, parse_config
from kvmiss.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, WireError

TRT, ATOM = ADAPTERS["trtllm"], ADAPTERS["atom"]
HIGH = [0x8000_0000_0000_0001, 0xFFFF_FFFF_FFFF_FFFE, 0x0123_4567_89AB_CDEF]  # two read negative on the wire


# --- TensorRT-LLM --------------------------------------------------------------------------------


def test_trtllm_signed_hashes_come_out_as_the_same_8_bytes_unsigned():
    payload = trt_payload(5.0, [trt_stored(HIGH, None, list(range(12))), trt_removed(HIGH[1:])], rank=3)
    assert any(h < 0 for h in msgspec.msgpack.decode(payload)[1][0]["block_hashes"])
    batch = TRT.decode(payload)
    stored, removed = batch.events
    assert (batch.ts, batch.dp_rank) == (5.0, 3)
    assert isinstance(stored, BlockStored) and stored.block_hashes == HIGH and stored.parent_block_hash is None
    assert stored.block_size == 4 and stored.tokens() == list(range(12))
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == HIGH[1:]  # one event, many hashes
    assert canonical_medium(stored.medium) == canonical_medium(removed.medium) == "GPU"


def test_trtllm_native_serializer_bytes_decode_as_the_msgspec_form_does():
    """The C++ serializer packs every int as int64 and writes nil fields; same events."""
    stores = [(HIGH[:2], None, list(range(8))), (HIGH[2:], HIGH[1], [9, 9, 9, 9])]
    native = trt_native_payload(7.5, stores, [[HIGH[0]]], block_size=4, rank=1)
    python = trt_payload(7.5, [trt_stored(h, p, t) for h, p, t in stores] + [trt_removed([HIGH[0]])], rank=1)
    assert native != python
    assert shape(TRT.decode(native)) == shape(TRT.decode(python))


def shape(batch) -> tuple:
    """A batch's meaning: token ids as values (their msgpack width differs between encoders)."""
    return batch.ts, batch.dp_rank, [
        (type(e).__name__, e.block_hashes, e.parent_block_hash, e.tokens(), e.block_size, e.medium)
        if isinstance(e, BlockStored) else (type(e).__name__, e.block_hashes, e.medium) for e in batch.events]


def test_trtllm_tolerates_its_multimodal_keys_locality_and_fields_yet_to_come():
    extra = trt_stored(HIGH[:1], 42, [1, 2, 3, 4], locality="local",
                       mm_keys=[[TrtMmKey(hash="ab" * 16, start_offset=0)]])
    raw = msgspec.msgpack.decode(trt_payload(1.0, [extra, TrtCleared()]))
    raw[1][0]["a_future_field"] = {"nested": [1, 2]}
    batch = TRT.decode(msgspec.msgpack.encode(raw))
    assert batch.events[0].block_hashes == HIGH[:1] and batch.events[0].parent_block_hash == 42
    assert batch.events[0].locality == "local" and isinstance(batch.events[1], AllBlocksCleared)


def test_trtllm_string_token_ids_are_dropped_not_passed_to_the_index():
    payload = trt_payload(1.0, [trt_stored(HIGH[:1], None, [1, "mm:ab12", 3, 4])])
    stored = TRT.decode(payload).events[0]
    assert stored.block_hashes == HIGH[:1] and stored.tokens() == []


@pytest.mark.parametrize("field, value, named", [
    ("block_size", "four", "block_size"),
    ("block_hashes", ["x"], "block_hashes"),
    ("token_ids", [1.5], "token_ids"),
    ("parent_block_hash", 1.5, "parent_block_hash"),
])
def test_trtllm_bad_fields_raise_wire_errors_naming_them(field, value, named):
    raw = msgspec.msgpack.decode(trt_payload(1.0, [trt_stored(HIGH[:1], None, [1, 2, 3, 4])]))
    raw[1][0][field] = value
    with pytest.raises(WireError, match=named) as info:
        TRT.decode(msgspec.msgpack.encode(raw))
    assert "event 0" in str(info.value)


def test_trtllm_refuses_positional_events_it_never_sends():
    with pytest.raises(WireError, match="positional array"):
        TRT.decode(atom_payload(1.0, [AtomRemoved(block_hashes=[1])]))


# --- ATOM ----------------------------------------------------------------------------------------


def test_atom_positional_events_with_its_token_offset_decode():
    payload = atom_payload(2.0, [
        AtomStored(block_hashes=HIGH, parent_block_hash=11, token_ids=list(range(48)), block_size=16, token_offset=32),
        AtomRemoved(block_hashes=[HIGH[0]]), AtomCleared()], rank=1)
    assert msgspec.msgpack.decode(payload)[1][0][-1] == 32  # vLLM's `locality` slot holds an int here
    stored, removed, cleared = ATOM.decode(payload).events
    assert stored.block_hashes == HIGH and stored.parent_block_hash == 11 and stored.block_size == 16
    assert stored.medium == "GPU" and stored.tokens() == list(range(48))
    assert removed.block_hashes == [HIGH[0]] and isinstance(cleared, AllBlocksCleared)
    with pytest.raises(WireError):  # what it guards against: the vLLM reader takes slot 11 as locality
        ADAPTERS["vllm"].decode(payload)


def test_atom_events_short_of_trailing_fields_or_longer_than_known_decode():
    short = ["BlockStored", [5], None, [1, 2], 2]
    longer = ["BlockRemoved", [5], "CPU", 0, "a later field"]
    batch = ATOM.decode(msgspec.msgpack.encode([1.0, [short, longer]]))
    assert batch.dp_rank is None and batch.events[0].block_hashes == [5] and batch.events[0].medium is None
    assert batch.events[1].medium == "CPU" and batch.events[1].group_idx == 0


def test_atom_media_read_as_kvmiss_media():
    spelled = {m: canonical_medium(m) for m in ("GPU", "CPU", "DISK", "REMOTE")}
    assert spelled == {"GPU": "GPU", "CPU": "CPU", "DISK": "STORAGE", "REMOTE": "EXTERNAL"}
    remote = AtomStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2], block_size=2, medium="REMOTE")
    assert ATOM.decode(atom_payload(1.0, [remote])).events[0].medium == "REMOTE"


def test_atom_block_size_under_decode_context_parallelism_is_the_tokens_per_hash():
    """With DCP 2 ATOM writes the physical block size (16) but hashes 32 tokens per block."""
    dcp = AtomStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(64)), block_size=16)
    plain = AtomStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(32)), block_size=16)
    assert [ATOM.decode(atom_payload(1.0, [e])).events[0].block_size for e in (dcp, plain)] == [32, 16]


@pytest.mark.parametrize("event, named", [
    (AtomCleared(medium="CPU"), "AllBlocksCleared.medium is 'CPU'"),
    (AtomTransferred(block_hashes=[1], from_medium="GPU", to_medium="CPU"), "BlockTransferred"),
    (AtomStored(block_hashes=[1], parent_block_hash=None, token_ids=[1], block_size="2"), r"\$\[4\]"),
])
def test_atom_events_kvmiss_cannot_apply_are_refused_by_name(event, named):
    with pytest.raises(WireError, match=named):
        ATOM.decode(atom_payload(1.0, [AtomRemoved(block_hashes=[3]), event]))


def test_atom_messages_without_a_sequence_frame_are_refused_naming_the_old_layout():
    payload = atom_payload(1.0, [AtomRemoved(block_hashes=[3])])
    for frames in ([payload], [b"kv", payload]):
        parsed = ATOM.frames.live(frames)
        assert isinstance(parsed, FrameError) and "no sequence number" in parsed.reason
    assert isinstance(ATOM.frames.live([b"kv", (4).to_bytes(8, "big"), payload]), BatchMessage)


def test_atom_replay_replies_and_end_marker_with_its_window_parse():
    reply = ATOM.frames.replay([b"", (9).to_bytes(8, "big"), b"payload"])
    assert isinstance(reply, BatchMessage) and reply.seq == 9
    assert isinstance(ATOM.frames.replay([b"", b"\xff" * 8, msgspec.msgpack.encode([3, 9])]), ReplayEnd)


# --- configuration: names, ranks ------------------------------------------------------------------


def test_both_engines_are_config_values_and_suffix_ipc_endpoints_per_rank():
    text = ('[[workers]]\nid = "t"\nendpoint = "ipc:///tmp/kv"\ndp_rank = 2\nengine = "trtllm"\n'
            '[[workers]]\nid = "a"\nendpoint = "tcp://10.0.0.1:5557"\ndp_rank = 2\nengine = "atom"\n'
            '[[workers]]\nid = "v"\nendpoint = "ipc:///tmp/kv"\ndp_rank = 2\n')
    t, a, v = parse_config(text).workers
    assert (t.engine, a.engine) == ("trtllm", "atom")
    assert (t.sub_endpoint(), a.sub_endpoint(), v.sub_endpoint()) == (
        "ipc:///tmp/kv_dp2", "tcp://10.0.0.1:5559", "ipc:///tmp/kv")


# --- real sockets ---------------------------------------------------------------------------------


class Collected:
    def __init__(self):
        self.actions: queue.Queue = queue.Queue()

    def __call__(self, worker, action):
        self.actions.put(action)

    def until(self, applied: int, timeout: float = 10.0) -> list:
        seen, deadline = [], time.monotonic() + timeout
        while sum(isinstance(a, Apply) for a in seen) < applied and time.monotonic() < deadline:
            try:
                seen.append(self.actions.get(timeout=0.1))
            except queue.Empty:
                pass
        return seen


def stores(engine: str, ts: float, hashes: list[int], parent: int | None) -> bytes:
    if engine == "trtllm":
        return trt_payload(ts, [trt_stored(hashes, parent, list(range(4 * len(hashes))))])
    return atom_payload(ts, [AtomStored(block_hashes=hashes, parent_block_hash=parent,
                                        token_ids=list(range(4 * len(hashes))), block_size=4)])


@pytest.mark.parametrize("engine", ["trtllm", "atom"])
def test_a_worker_follows_the_engines_stream_and_replays_a_lost_batch(engine):
    """Live batches, one lost in flight (recovered from the engine's replay ROUTER in its own
    layout), then a malformed one: applied in order, the bad one a named, counted hole."""
    pub_ep, replay_ep = free_tcp(), free_tcp()
    pub = WirePublisher(engine, pub_ep, replay_ep)
    sink = Collected()
    sub = Subscriber(Fleet([WorkerSpec(id="w", endpoint=pub_ep, replay_endpoint=replay_ep, engine=engine)], sink))
    sub.start()
    try:
        time.sleep(0.3)
        pub.publish(stores(engine, 100.0, HIGH[:1], None))
        pub.publish(stores(engine, 100.1, HIGH[1:2], HIGH[0]), lost=True)
        pub.publish(stores(engine, 100.2, HIGH[2:], HIGH[1]))
        pub.publish(b"\x93\xcb")  # truncated msgpack
        pub.publish(stores(engine, 100.4, [77], None))
        seen = sink.until(4)
    finally:
        sub.shutdown()
        pub.close()
    applied = [a.batch for a in seen if isinstance(a, Apply)]
    assert [b.seq for b in applied] == [0, 1, 2, 4]
    assert [b.events[0].block_hashes for b in applied] == [HIGH[:1], HIGH[1:2], HIGH[2:], [77]]
    assert applied[1].events[0].parent_block_hash == HIGH[0]
    malformed = [a for a in seen if isinstance(a, Hole) and a.reason is HoleReason.MALFORMED]
    assert [(h.from_seq, h.to_seq) for h in malformed] == [(3, 3)]


def test_a_fleet_of_both_engines_reads_each_through_its_own_adapter():
    """The same ATOM batch: applied by the ATOM worker, a malformed hole on the TensorRT-LLM one."""
    config = parse_config('[[workers]]\nid = "t"\nendpoint = "tcp://127.0.0.1:5557"\nengine = "trtllm"\n'
                          '[[workers]]\nid = "a"\nendpoint = "tcp://127.0.0.1:5567"\nengine = "atom"\n')
    out: list = []
    fleet = Fleet(config.workers, lambda worker, action: out.append((worker, action)))
    payload = atom_payload(3.0, [AtomRemoved(block_hashes=[signed(HIGH[0]) & (2**64 - 1)])])
    for worker in ("t", "a"):
        fleet.on_message(worker, SUB, [b"kv", (0).to_bytes(8, "big"), payload], 10.0)
    kinds = {w: type(a).__name__ for w, a in out if isinstance(a, (Apply, Hole))}
    assert kinds == {"t": "Hole", "a": "Apply"}
    assert fleet.streams["t"].adapter is TRT and fleet.streams["a"].adapter is ATOM
