"""Decoding every engine encoding into the one normalised event model."""

from __future__ import annotations

import msgspec
import pytest
from shared_data import frames, load_json

from kvmiss.collectors.frames import BatchMessage, parse_any
from kvmiss.schemas.events import (
    MASK64,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireError,
    canonical_hash,
    decode_batch,
)

NORMALISED_HASH_FIELDS = {"block_hashes", "parent_block_hash"}


def _expected_hash(value):
    if isinstance(value, dict):  # {"bin_hex": ...}: raw digest on the wire
        return int.from_bytes(bytes.fromhex(value["bin_hex"])[-8:], "big")
    return None if value is None else value & MASK64


def assert_event_matches(event, recorded: dict) -> None:
    """The decoded event carries exactly the recorded meaning, hashes canonicalised."""
    assert type(event).__name__ == recorded["type"]
    for field, value in recorded.items():
        if field == "type":
            continue
        got = getattr(event, field) if field != "token_ids" else event.tokens()
        if field == "block_hashes":
            assert got == [_expected_hash(v) for v in value]
        elif field == "parent_block_hash":
            assert got == _expected_hash(value)
        else:
            assert got == value, field
    if isinstance(event, BlockStored | BlockRemoved):
        raw = [v for v in recorded["block_hashes"] if isinstance(v, dict)]
        if raw:
            assert event.block_digests == [bytes.fromhex(v["bin_hex"]) for v in raw]
        else:
            assert event.block_digests is None


def vllm_messages():
    data = load_json("vllm-0.33.0-event-frames.json")
    for pub in data["publishers"]:
        for live in pub["live"]:
            yield "sub", live
        for replay in pub["replay"]:
            socket = "dealer" if replay["client_socket"] == "DEALER" else "req"
            for reply in replay["replies"]:
                yield socket, reply


class TestVllmCapturedFrames:
    def test_every_live_and_replayed_frame_decodes_to_its_recorded_meaning(self):
        checked = 0
        for socket, msg in vllm_messages():
            if socket == "req":
                socket = "sub"  # REQ strips the delimiter: the reply looks like a live message
            parsed = parse_any(frames(msg["frames_b64"]), socket)
            if msg.get("seq") == -1:
                assert type(parsed).__name__ == "ReplayEnd"
                continue
            assert isinstance(parsed, BatchMessage), parsed
            assert parsed.topic == msg["topic"]
            assert parsed.seq == msg["seq"]
            ts, events, rank = msg["payload_msgpack_untyped"]
            batch = parsed.decode()
            assert batch.ts == ts and batch.dp_rank == rank
            assert len(batch.events) == len(events)
            for event, recorded in zip(batch.events, events):
                assert_event_matches(event, recorded)
            checked += 1
        assert checked >= 15

    def test_raw_digest_hashes_become_the_external_uint64_and_keep_the_digest(self):
        msg = next(m for s, m in vllm_messages() if s == "sub" and m["seq"] == 6)
        event = parse_any(frames(msg["frames_b64"])).decode().events[0]
        assert event.block_hashes == [8041362033356180790, 301661034853959944]
        assert [d.hex()[:8] for d in event.block_digests] == ["95c33f7c", "77d10774"]

    def test_same_block_as_int_and_as_digest_is_the_same_canonical_hash(self):
        by_seq = {m["seq"]: m for s, m in vllm_messages() if s == "sub" and m["topic"]}
        as_int = parse_any(frames(by_seq[1]["frames_b64"])).decode().events[0]
        as_bin = parse_any(frames(by_seq[6]["frames_b64"])).decode().events[0]
        assert as_int.block_hashes == as_bin.block_hashes


class TestSglangCapturedFrames:
    def test_every_frame_decodes_to_its_recorded_meaning(self):
        data = load_json("sglang-0.5.23-event-frames.json")
        checked = 0
        for frame in data["frames"]:
            if frame["channel"] == "replay-request":
                continue
            socket = "dealer" if frame["channel"] == "replay" else "sub"
            parsed = parse_any(frames(frame["frames_b64"]), socket)
            decoded = frame["decoded"]
            if decoded.get("end_of_replay"):
                assert type(parsed).__name__ == "ReplayEnd"
                continue
            assert isinstance(parsed, BatchMessage)
            assert (parsed.topic, parsed.seq) == (decoded["topic"], decoded["seq"])
            ts, events, rank = decoded["payload"]
            batch = parsed.decode()
            assert (batch.ts, batch.dp_rank) == (ts, rank)
            for event, recorded in zip(batch.events, events, strict=True):
                assert_event_matches(event, recorded)
            checked += 1
        assert checked >= 12

    def test_negative_int64_hashes_map_to_their_twos_complement_uint64(self):
        payload = msgspec.msgpack.encode(
            [1.0, [{"type": "BlockStored", "block_hashes": [-5, -1], "parent_block_hash": -2}], 0]
        )
        event = decode_batch(payload).events[0]
        assert event.block_hashes == [2**64 - 5, 2**64 - 1]
        assert event.parent_block_hash == 2**64 - 2
        assert event.block_digests is None

    def test_attn_dp_rank_and_sglang_only_fields_are_kept(self):
        payload = msgspec.msgpack.encode(
            [
                2.5,
                [{"type": "BlockStored", "block_hashes": [1], "cache_salt": "s", "session_id": "x",
                  "medium": "CPU_PINNED"}],
                3,
            ]
        )
        batch = decode_batch(payload)
        assert batch.dp_rank == 3
        event = batch.events[0]
        assert (event.cache_salt, event.session_id, event.medium) == ("s", "x", "CPU_PINNED")


# Positional-array events of vLLM before 0.24: one field list per release (WIRE.md).
ARRAY_STORED_BY_RELEASE = {
    "0.10": ["BlockStored", [11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None],
    "0.11": ["BlockStored", [11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU"],
    "0.14": ["BlockStored", [11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, 7, "GPU", "my-lora"],
    "0.20": ["BlockStored", [11, 12], 10, [1, 2, 3, 4, 5, 6, 7, 8], 4, 7, "CPU", "my-lora",
             [["my-lora"], ["my-lora"]], 1],
    "0.22": ["BlockStored", [11, 12], 10, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None,
             [None, None], 0, "sliding_window", 128],
}


class TestOlderArrayEncodings:
    @pytest.mark.parametrize("release", sorted(ARRAY_STORED_BY_RELEASE))
    def test_block_stored_array_of_each_release(self, release):
        wire = ARRAY_STORED_BY_RELEASE[release]
        batch = decode_batch(msgspec.msgpack.encode([7.0, [wire], 0]))
        (event,) = batch.events
        assert isinstance(event, BlockStored)
        assert event.block_hashes == [11, 12]
        assert event.tokens() == [1, 2, 3, 4, 5, 6, 7, 8]
        assert event.block_size == 4
        names = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                 "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                 "kv_cache_spec_sliding_window"]
        for name, value in zip(names[4:], wire[5:]):
            assert getattr(event, name) == value, name
        for name in names[len(wire) - 1:]:
            assert getattr(event, name) is None, name

    def test_removed_and_cleared_arrays_and_a_two_element_batch(self):
        wire = [3.0, [["BlockRemoved", [2**64 - 1]], ["BlockRemoved", [5], "CPU"],
                      ["AllBlocksCleared"]]]
        batch = decode_batch(msgspec.msgpack.encode(wire))
        assert batch.dp_rank is None
        removed, removed_cpu, cleared = batch.events
        assert removed.block_hashes == [2**64 - 1] and removed.medium is None
        assert removed_cpu.medium == "CPU"
        assert isinstance(cleared, AllBlocksCleared)

    def test_a_batch_mixing_arrays_and_maps_decodes_each_event(self):
        wire = [1.0, [["BlockRemoved", [1]], {"type": "BlockRemoved", "block_hashes": [2]}], 0]
        assert [e.block_hashes for e in decode_batch(msgspec.msgpack.encode(wire)).events] == [[1], [2]]

    def test_extra_trailing_array_fields_are_tolerated(self):
        wire = [1.0, [["BlockRemoved", [1], "GPU", 0, "LOCAL", "future"]], 0, "future"]
        assert decode_batch(msgspec.msgpack.encode(wire)).events[0].group_idx == 0


class TestTolerance:
    def test_unknown_map_fields_are_ignored_and_missing_optional_ones_defaulted(self):
        wire = [1.0, [{"type": "BlockStored", "block_hashes": [9], "from_the_future": {"a": 1}}], 0]
        event = decode_batch(msgspec.msgpack.encode(wire)).events[0]
        assert event.block_hashes == [9]
        assert event.parent_block_hash is None and event.tokens() == []
        assert event.medium is None and event.group_idx is None

    def test_normalised_events_round_trip_through_the_map_wire_form(self):
        batch = EventBatch(
            ts=4.0,
            events=[BlockStored(block_hashes=[2**64 - 7], parent_block_hash=3, block_size=2,
                                token_ids=msgspec.Raw(msgspec.msgpack.encode([5, 6]))),
                    BlockRemoved(block_hashes=[1]), AllBlocksCleared()],
            dp_rank=0,
        )
        again = decode_batch(msgspec.msgpack.encode(batch))
        assert again.events[0].block_hashes == [2**64 - 7]
        assert again.events[0].tokens() == [5, 6]
        assert [type(e) for e in again.events] == [BlockStored, BlockRemoved, AllBlocksCleared]

    def test_canonical_hash_rules(self):
        assert canonical_hash(-1) == MASK64
        assert canonical_hash(b"\x00" * 24 + (42).to_bytes(8, "big")) == 42
        assert canonical_hash(bytes(16)) == 0
        with pytest.raises(WireError):
            canonical_hash("12")  # type: ignore[arg-type]


class TestMalformedPayloads:
    @pytest.mark.parametrize(
        "payload, fragment",
        [
            (b"\xc1", "not msgpack"),
            (msgspec.msgpack.encode({"ts": 1}), "batch must be"),
            (msgspec.msgpack.encode([1.0, [{"type": "BlockExploded", "block_hashes": []}], 0]),
             "event 0"),
            (msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1],
                                            "block_size": "16"}], 0]), "block_size"),
            (msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}], 0]), "block_hashes"),
            (msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}], 0]),
             "block_hashes"),
            (msgspec.msgpack.encode([1.0, [["Nope", [1]]], 0]), "event 0"),
        ],
    )
    def test_bad_payload_raises_a_wire_error_naming_what_is_wrong(self, payload, fragment):
        with pytest.raises(WireError) as info:
            decode_batch(payload)
        assert fragment in str(info.value)

    def test_an_unknown_tag_error_names_the_tag_field(self):
        with pytest.raises(WireError, match=r"event 1: .*type"):
            decode_batch(msgspec.msgpack.encode(
                [1.0, [{"type": "BlockRemoved", "block_hashes": [1]}, {"type": "Exploded"}], 0]))

    def test_bad_token_ids_fail_only_when_asked_for(self):
        wire = [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": ["x"]}], 0]
        event = decode_batch(msgspec.msgpack.encode(wire)).events[0]
        with pytest.raises(WireError, match="token_ids"):
            event.tokens()
