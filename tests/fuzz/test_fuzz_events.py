"""KV-event payloads (msgpack batches): `decode_batch` returns a normalised `EventBatch` or
raises `WireError`, nothing else, for any bytes; valid batches of every wire form decode to
what was encoded; a decoded batch re-encodes to a fixed point."""

from __future__ import annotations

from typing import Any

import msgspec
from fuzz_support import (
    INT_EDGES,
    captured_payloads,
    fuzz_settings,
    msgpack_garbage,
    msgpack_values,
    mutate_bytes,
    mutate_tree,
    seeds,
)
from hypothesis import given, strategies as st

from kvmiss.schemas.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireError,
    canonical_hash,
    decode_batch,
    event_to_builtins,
)

MASK64 = (1 << 64) - 1
_json = msgspec.json.Encoder()


def checked_decode(payload: bytes) -> EventBatch | None:
    """The contract every input must keep; returns the batch when it decoded."""
    try:
        batch = decode_batch(payload)
    except WireError:
        return None
    assert isinstance(batch, EventBatch)
    for event in batch.events:
        assert isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared))
        if not isinstance(event, AllBlocksCleared):
            assert all(0 <= h <= MASK64 for h in event.block_hashes)
        if isinstance(event, BlockStored) and event.parent_block_hash is not None:
            assert 0 <= event.parent_block_hash <= MASK64
        for include_raw in (False, True):  # what `kvmiss decode` prints must always print
            try:
                _json.encode(event_to_builtins(event, include_raw=include_raw))
            except WireError:  # token_ids that are not a list of ints: documented
                pass
    return batch


def assert_fixed_point(batch: EventBatch) -> None:
    """encode(decode(x)) is stable: re-decoding what we encode gives the same bytes."""
    once = msgspec.msgpack.encode(batch)
    again = decode_batch(once)
    assert msgspec.msgpack.encode(again) == once


# --- structured generation: valid batches of every wire form -----------------------------

int_hashes = st.integers(0, MASK64) | st.sampled_from([h & MASK64 for h in INT_EDGES])
signed_hashes = st.integers(-2**63, -1)  # SGLang: signed int64
digest_hashes = st.binary(min_size=32, max_size=32) | st.binary(min_size=16, max_size=16)
any_hash = int_hashes | signed_hashes | digest_hashes
opt_str = st.none() | st.text(max_size=16)
media = st.none() | st.sampled_from(["GPU", "CPU", "STORAGE", "cpu", "CPU_PINNED", "DISK", "EXTERNAL"])
small_int = st.none() | st.integers(-2**63, 2**63 - 1)
untagged_keys = st.none() | st.lists(
    st.text(max_size=8) | st.tuples(st.text(max_size=8), st.integers(-64, 64)).map(list)
    | st.binary(min_size=32, max_size=32) | msgpack_values, max_size=3)  # list[Any] on the wire

# Positional order of the fields (vLLM < 0.24 arrays append fields release by release).
STORED_FIELDS = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                 "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                 "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
                 "cache_salt", "lookahead_token_ids"]
REMOVED_FIELDS = ["block_hashes", "medium", "group_idx", "locality", "ownership"]
TRAILING_DEFAULTS = {"token_ids": [], "block_size": 0}  # every other field defaults to None


@st.composite
def stored_fields(draw, hashes: st.SearchStrategy) -> dict:
    return {
        "block_hashes": draw(st.lists(hashes, max_size=6)),
        "parent_block_hash": draw(st.none() | hashes),
        "token_ids": draw(st.lists(st.integers(0, 2**63 - 1) | st.integers(-2**63, -1), max_size=40)),
        "block_size": draw(st.integers(-2**63, 2**63 - 1)),
        "lora_id": draw(small_int),
        "medium": draw(media),
        "lora_name": draw(opt_str),
        "extra_keys": draw(untagged_keys),
        "group_idx": draw(small_int),
        "kv_cache_spec_kind": draw(opt_str),
        "kv_cache_spec_sliding_window": draw(small_int),
        "locality": draw(opt_str),
        "ownership": draw(opt_str),
        "session_id": draw(opt_str),
        "cache_salt": draw(opt_str),
        "lookahead_token_ids": draw(st.none() | st.lists(st.lists(st.integers(0, 2**31), max_size=3), max_size=4)),
    }


@st.composite
def removed_fields(draw, hashes: st.SearchStrategy) -> dict:
    return {"block_hashes": draw(st.lists(hashes, max_size=6)), "medium": draw(media),
            "group_idx": draw(small_int), "locality": draw(opt_str), "ownership": draw(opt_str)}


@st.composite
def wire_event(draw, hashes: st.SearchStrategy = any_hash) -> tuple[str, dict, Any]:
    """(type, fields, wire object): a map (None fields omitted) or a positional array."""
    kind = draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]))
    if kind == "AllBlocksCleared":
        return kind, {}, draw(st.sampled_from([{"type": kind}, [kind]]))
    names = STORED_FIELDS if kind == "BlockStored" else REMOVED_FIELDS
    fields = draw(stored_fields(hashes) if kind == "BlockStored" else removed_fields(hashes))
    if draw(st.booleans()):
        wire = {"type": kind, **{k: v for k, v in fields.items() if v is not None}}
        if draw(st.booleans()):  # newer publishers: fields this decoder does not know
            wire[draw(st.text(min_size=1, max_size=10).filter(lambda k: k not in names and k != "type"))] = draw(msgpack_values)
    else:
        keep = draw(st.integers(1, len(names)))  # missing trailing fields default
        for name in names[keep:]:
            fields[name] = TRAILING_DEFAULTS.get(name)
        wire = [kind, *(fields[n] for n in names[:keep])]
    return kind, fields, wire


def _expected_digests(hashes: list) -> list[bytes] | None:
    return [h for h in hashes if isinstance(h, bytes)] or None


def assert_event_matches(event, kind: str, fields: dict) -> None:
    assert type(event).__name__ == kind
    if kind == "AllBlocksCleared":
        return
    assert event.block_hashes == [canonical_hash(h) for h in fields["block_hashes"]]
    assert event.block_digests == _expected_digests(fields["block_hashes"])
    for name in ("medium", "group_idx", "locality", "ownership"):
        assert getattr(event, name) == fields[name]
    if kind == "BlockStored":
        parent = fields["parent_block_hash"]
        assert event.parent_block_hash == (None if parent is None else canonical_hash(parent))
        assert event.tokens() == fields["token_ids"]
        for name in STORED_FIELDS[3:]:
            if name != "extra_keys":
                assert getattr(event, name) == fields[name], name
        # Compared encoded: NaN never equals itself.
        assert msgspec.msgpack.encode(event.extra_keys) == msgspec.msgpack.encode(fields["extra_keys"])


@st.composite
def valid_batch(draw, hashes: st.SearchStrategy = any_hash):
    events = draw(st.lists(wire_event(hashes), max_size=5))
    ts = draw(st.floats(allow_nan=False))
    rank = draw(st.none() | st.integers(-2**63, 2**63 - 1))
    wire = [ts, [w for _, _, w in events]]
    if draw(st.booleans()) or rank is not None:  # real traffic always has 3 elements
        wire.append(rank)
    return msgspec.msgpack.encode(wire), events, ts, rank


@fuzz_settings(50)
@given(valid_batch())
def test_valid_batches_of_every_wire_form_decode_to_what_was_sent(case):
    payload, events, ts, rank = case
    batch = checked_decode(payload)
    assert batch is not None, "a valid batch was refused"
    assert batch.ts == ts and batch.dp_rank == rank and len(batch.events) == len(events)
    for event, (kind, fields, _) in zip(batch.events, events):
        assert_event_matches(event, kind, fields)
    assert_fixed_point(batch)


@fuzz_settings(20)
@given(valid_batch(int_hashes))
def test_the_fast_path_and_the_slow_path_agree(case):
    """Canonical uint64 hashes take the strict decoder; one negative hash sends the whole
    batch down the lenient one. Both must give the same events."""
    payload, events, ts, rank = case
    fast = decode_batch(payload)
    ts_, events_, *rest = msgspec.msgpack.decode(payload, type=list[msgspec.Raw])
    events_ = msgspec.msgpack.decode(events_, type=list[msgspec.Raw])
    events_.append(msgspec.Raw(msgspec.msgpack.encode({"type": "BlockRemoved", "block_hashes": [-1]})))
    slow = decode_batch(msgspec.msgpack.encode([ts_, events_, *rest]))
    assert msgspec.msgpack.encode(slow.events[:-1]) == msgspec.msgpack.encode(fast.events)  # NaN-safe


# --- mutations of real captures and of generated batches ---------------------------------


@fuzz_settings(70)
@given(st.data())
def test_mutated_capture_bytes_decode_or_raise_wire_error(data):
    pool = captured_payloads()
    payload = data.draw(seeds(captured_payloads))
    mutated = data.draw(mutate_bytes(payload, pool))
    batch = checked_decode(mutated)
    if batch is not None:
        assert_fixed_point(batch)


@fuzz_settings(70)
@given(st.data())
def test_structurally_mutated_captures_decode_or_raise_wire_error(data):
    """Wrong types, missing and extra fields, huge ints, ext types and deep nesting in any
    place of a real batch."""
    payload = data.draw(seeds(captured_payloads))
    tree = msgspec.msgpack.decode(payload)
    mutated = data.draw(mutate_tree(tree, msgpack_garbage))
    batch = checked_decode(msgspec.msgpack.encode(mutated))
    if batch is not None:
        assert_fixed_point(batch)


@fuzz_settings(35)
@given(st.data())
def test_structurally_mutated_generated_batches_decode_or_raise_wire_error(data):
    payload, *_ = data.draw(valid_batch())
    mutated = data.draw(mutate_tree(msgspec.msgpack.decode(payload), msgpack_garbage))
    batch = checked_decode(msgspec.msgpack.encode(mutated))
    if batch is not None:
        assert_fixed_point(batch)


@fuzz_settings(35)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_decode_or_raise_wire_error(payload):
    checked_decode(payload)
