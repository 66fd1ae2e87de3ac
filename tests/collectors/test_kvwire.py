"""collectors/_kvwire.c against the rule it accelerates (schemas/events.py `decode_batch`).

The contract: `scan_batch(payload)` is None, or the reference decodes the payload too and
the two agree -- on ts and dp_rank, on the events the sequence gives back, and on what the
index reads from the packed form (type, medium, group, hashes). Payloads are real msgpack:
Structs encoded by msgspec, hand-built maps with hostile values and key orders, encodings
msgspec never writes (wide integer forms, str8 for short strings, duplicate keys), and
mutations of all of those. Plus `recv_messages` over a real ZeroMQ socket pair.
"""

from __future__ import annotations

import math
import os
import struct
import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvmiss.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, WireError, decode_batch

kvwire = pytest.importorskip("kvmiss.collectors._kvwire") if os.environ.get("KVMISS_REQUIRE_ACCELERATED") != "1" \
    else __import__("kvmiss.collectors._kvwire", fromlist=["_"])
scan_batch = kvwire.scan_batch


def agree(payload: bytes) -> bool:
    """Check the contract on one payload; True when the compiled reader took it."""
    scanned = scan_batch(payload)
    try:
        ref = decode_batch(payload)
    except WireError:
        assert scanned is None, "scan_batch accepted a payload the reference refuses"
        return False
    if scanned is None:
        return False
    ts, dp_rank, events = scanned
    assert ts == ref.ts or (math.isnan(ts) and math.isnan(ref.ts))
    assert dp_rank == ref.dp_rank and type(dp_rank) is type(ref.dp_rank)
    assert len(events) == len(ref.events)
    assert list(events) == ref.events
    assert events.has_clear == any(isinstance(e, AllBlocksCleared) for e in ref.events)
    expect = []
    for e in ref.events:
        if isinstance(e, AllBlocksCleared):
            expect.append(("AllBlocksCleared", None, None, [], False, 0))
        elif isinstance(e, BlockStored):
            size = e.block_size if 0 <= e.block_size < 2**32 else 0
            expect.append(("BlockStored", e.medium, e.group_idx, list(e.block_hashes), e.parent_block_hash is None, size))
        else:
            expect.append(("BlockRemoved", e.medium, e.group_idx, list(e.block_hashes), False, 0))
    assert events.packed() == expect
    return True


# --- msgpack by hand: the encodings msgspec never writes -----------------------------------------


def mp_int(v: int, wide: bool) -> bytes:
    if not wide:
        return msgspec.msgpack.encode(v)
    if v >= 0:
        return b"\xcf" + struct.pack(">Q", v) if v >= 2**63 else b"\xd3" + struct.pack(">q", v)
    return b"\xd3" + struct.pack(">q", v)


def mp_str(s: str, wide: bool) -> bytes:
    raw = s.encode()
    if wide:  # str8/str16 for any length (msgspec writes fixstr below 32 bytes)
        return b"\xd9" + bytes([len(raw)]) + raw if len(raw) < 256 else b"\xda" + struct.pack(">H", len(raw)) + raw
    return msgspec.msgpack.encode(s)


def mp_array(items: list[bytes], wide: bool) -> bytes:
    head = b"\xdc" + struct.pack(">H", len(items)) if wide or len(items) > 15 else bytes([0x90 | len(items)])
    return head + b"".join(items)


def mp_map(pairs: list[tuple[bytes, bytes]], wide: bool) -> bytes:
    head = b"\xde" + struct.pack(">H", len(pairs)) if wide or len(pairs) > 15 else bytes([0x80 | len(pairs)])
    return head + b"".join(k + v for k, v in pairs)


hash_value = st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 1000), st.integers(-2**63, -1))
any_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=5),
    st.binary(max_size=5), st.just("ñ"))
value = st.recursive(any_leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(st.text(max_size=3), inner, max_size=2)),
                     max_leaves=6)
FIELD_VALUES = {
    "block_hashes": st.lists(hash_value, max_size=4),
    "parent_block_hash": st.one_of(st.none(), hash_value),
    "token_ids": value,
    "block_size": st.one_of(st.integers(0, 64), st.none(), st.floats()),
    "medium": st.one_of(st.none(), st.sampled_from(["GPU", "CPU", "cpu_pinned", "DISK", "GPÜ"]), st.integers(-9, 9)),
    "group_idx": st.one_of(st.none(), st.integers(-3, 3), st.integers(2**63, 2**64 - 1)),
    "extra_keys": st.one_of(st.none(), st.lists(value, max_size=3)),
    "kv_cache_spec_kind": st.one_of(st.none(), st.just("full_attention"), st.integers(0, 9)),
    "lora_id": st.one_of(st.none(), st.integers(0, 9), st.text(max_size=2)),
    "lora_name": st.one_of(st.none(), st.text(max_size=4)),
    "cache_salt": st.one_of(st.none(), st.text(max_size=4)),
    "lookahead_token_ids": st.one_of(st.none(), st.lists(st.lists(st.integers(0, 9), max_size=3), max_size=2),
                                     st.lists(st.integers(-9, 9), max_size=2)),
    "block_digests": st.one_of(st.none(), st.lists(st.binary(max_size=4), max_size=2)),
    "unknown_field": value,
}


@st.composite
def hand_event(draw) -> bytes:
    wide = draw(st.booleans())
    kind = draw(st.sampled_from(["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"]))
    names = draw(st.lists(st.sampled_from(sorted(FIELD_VALUES)), max_size=7, unique=True))
    if kind != "AllBlocksCleared" and draw(st.integers(0, 9)) > 0 and "block_hashes" not in names:
        names.append("block_hashes")
    pairs = []
    for name in names:
        v = draw(FIELD_VALUES[name])
        if name == "block_hashes" and draw(st.booleans()):
            encoded = mp_array([mp_int(h, wide) for h in v], wide)
        else:
            encoded = msgspec.msgpack.encode(v)
        pairs.append((mp_str(name, wide), encoded))
    pairs.insert(draw(st.integers(0, len(pairs))), (mp_str("type", wide), mp_str(kind, wide)))
    if pairs and draw(st.integers(0, 9)) == 0:  # a duplicated key
        pairs.append(draw(st.sampled_from(pairs)))
    return mp_map(pairs, wide)


@st.composite
def hand_batch(draw) -> bytes:
    wide = draw(st.booleans())
    events = draw(st.lists(hand_event(), max_size=6))
    ts = draw(st.one_of(st.floats(), st.floats(width=32), st.integers(0, 2**40)))
    single = isinstance(ts, float) and (math.isnan(ts) or math.isinf(ts) or abs(ts) < 3e38) and draw(st.booleans())
    ts_bytes = b"\xca" + struct.pack(">f", ts) if single else msgspec.msgpack.encode(ts)
    parts = [ts_bytes, mp_array(events, wide)]
    tail = draw(st.sampled_from(["none", "nil", "int", "negative", "extra"]))
    if tail == "nil":
        parts.append(b"\xc0")
    elif tail == "int":
        parts.append(mp_int(draw(st.integers(0, 2**64 - 1)), wide))
    elif tail == "negative":
        parts.append(mp_int(-draw(st.integers(1, 5)), wide))
    elif tail == "extra":
        parts += [b"\x00", b"\x01"]
    return mp_array(parts, wide)


struct_event = st.one_of(
    st.builds(BlockStored, block_hashes=st.lists(st.integers(0, 2**64 - 1), max_size=5),
              parent_block_hash=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
              token_ids=st.lists(st.integers(0, 2**20), max_size=40).map(lambda t: msgspec.Raw(msgspec.msgpack.encode(t))),
              block_size=st.integers(0, 64), medium=st.sampled_from([None, "GPU", "CPU"]),
              group_idx=st.sampled_from([None, 0, 1]), extra_keys=st.one_of(st.none(), st.lists(st.none(), max_size=3)),
              kv_cache_spec_kind=st.sampled_from([None, "full_attention", "sliding_window"]),
              lookahead_token_ids=st.one_of(st.none(), st.lists(st.lists(st.integers(0, 9), max_size=3), max_size=2))),
    st.builds(BlockRemoved, block_hashes=st.lists(st.integers(0, 2**64 - 1), max_size=5),
              medium=st.sampled_from([None, "GPU", "CPU"]), group_idx=st.sampled_from([None, 0, 1])),
    st.just(AllBlocksCleared()),
)
struct_batch = st.builds(lambda ts, events, dp: msgspec.msgpack.encode(EventBatch(ts, events, dp)),
                         st.floats(allow_nan=False), st.lists(struct_event, max_size=8),
                         st.sampled_from([None, 0, 3]))


@settings(max_examples=600, deadline=None)
@given(struct_batch)
def test_every_batch_the_engines_structs_encode_is_read_as_the_reference_reads_it(payload):
    assert agree(payload), "the compiled reader must take the current wire form"


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hand_batch())
def test_hand_encoded_and_hostile_batches_are_read_as_the_reference_reads_them_or_left_to_it(payload):
    agree(payload)


@settings(max_examples=800, deadline=None)
@given(struct_batch, st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
       st.integers(0, 10_000))
def test_mutated_and_truncated_payloads_never_make_the_two_disagree(payload, flips, cut):
    data = bytearray(payload)
    for at, byte in flips:
        if data:
            data[at % len(data)] = byte
    agree(bytes(data))
    agree(payload[: cut % (len(payload) + 1)])


def test_the_forms_left_to_the_reference_are_still_decoded_by_it():
    """Array-form events (vLLM < 0.24), signed hashes (SGLang), raw digests: not read here,
    and the reference still takes them (so the stream applies them the slow way)."""
    array_form = msgspec.msgpack.encode([1.0, [["BlockStored", [1, 2], None, [], 16, None, "GPU"]], 0])
    signed = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [-5]}], 0])
    digest = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [b"\x00" * 32]}], 0])
    for payload in (array_form, signed, digest):
        assert scan_batch(payload) is None
        assert decode_batch(payload).events


def test_real_engine_captures_are_read_by_the_compiled_reader():
    """Frames captured from vLLM's own publishers (tests/data/engines): releases >= 0.24 are
    read here, older ones (array-form events) are left to the reference; both agree."""
    import base64
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "data" / "engines"
    taken = {}
    for path in sorted(root.glob("vllm-*-frames.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        payloads = [base64.b64decode(r["frames"][-1]) for r in rows if r["source"] == "live"]
        taken[rows[0]["vllm"]] = [agree(p) for p in payloads if p]
    assert taken, "no captures found"
    for release, read in taken.items():
        modern = tuple(int(x) for x in release.split(".")[:2]) >= (0, 24)
        assert read and all(read) == modern and any(read) == modern, (release, read)


@pytest.mark.skipif(os.environ.get("KVMISS_PURE_PYTHON_INGEST") == "1",
                    reason="KVMISS_PURE_PYTHON_INGEST=1 rules the compiled receiver out")
def test_recv_messages_drains_a_real_socket_as_recv_multipart_would():
    import zmq

    from kvmiss.collectors.subscriber import _compiled_receiver

    recv = _compiled_receiver()
    assert recv is not None, "the compiled receiver binds to pyzmq's libzmq on Linux"
    ctx = zmq.Context()
    try:
        pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        sub.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.3)
        sent = [[b"kv@a@m", i.to_bytes(8, "big"), bytes([i % 256]) * (i * 37)] for i in range(300)]
        sent.append([b"single"])
        sent.append([b"", b"", b"\xff" * 8, b""])
        for frames in sent:
            pub.send_multipart(frames)
        got, deadline = [], time.monotonic() + 5
        while len(got) < len(sent) and time.monotonic() < deadline:
            batch = recv(sub.underlying, 64)
            assert len(batch) <= 64
            got += batch
            if not batch:
                time.sleep(0.01)
        assert got == sent
        assert recv(sub.underlying, 64) == []  # nothing waiting: no block, no error
    finally:
        ctx.destroy(linger=0)
