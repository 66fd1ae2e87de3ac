"""Multipart frames -> live batches, replayed batches, end markers, or precise errors."""

from __future__ import annotations

import msgspec
import pytest

from kvmiss.collectors.frames import (
    BatchMessage,
    Channel,
    FrameError,
    ReplayEnd,
    encode_replay_request,
    parse_any,
    parse_live,
    parse_replay,
)

PAYLOAD = msgspec.msgpack.encode([1.0, [], 0])
SEQ7 = (7).to_bytes(8, "big")


class TestLive:
    def test_three_frames_give_topic_seq_and_undecoded_payload(self):
        msg = parse_live([b"kv@a", SEQ7, PAYLOAD])
        assert msg == BatchMessage(Channel.LIVE, "kv@a", 7, PAYLOAD)

    def test_sequence_is_unsigned_big_endian(self):
        assert parse_live([b"", b"\x80" + bytes(7), PAYLOAD]).seq == 2**63

    @pytest.mark.parametrize("frames", [[b"t", SEQ7], [b"t", SEQ7, PAYLOAD, b"x"], []])
    def test_wrong_frame_count_is_an_error_value(self, frames):
        result = parse_live(frames)
        assert isinstance(result, FrameError) and "3 frames" in result.reason

    def test_truncated_sequence_frame_is_named(self):
        result = parse_live([b"t", b"\x00\x01", PAYLOAD])
        assert isinstance(result, FrameError) and "8 bytes, got 2" in result.reason

    def test_non_utf8_topic_keeps_the_sequence_for_continuity(self):
        result = parse_live([b"\xff\xfe", SEQ7, PAYLOAD])
        assert result == FrameError("topic frame is not UTF-8", 7)


class TestReplay:
    def test_reply_with_topic_frame(self):
        assert parse_replay([b"", b"kv", SEQ7, PAYLOAD]) == BatchMessage(Channel.REPLAY, "kv", 7, PAYLOAD)

    def test_reply_without_topic_frame_from_vllm_before_0_26(self):
        assert parse_replay([b"", SEQ7, PAYLOAD]) == BatchMessage(Channel.REPLAY, "", 7, PAYLOAD)

    @pytest.mark.parametrize("frames", [[b"", b"", b"\xff" * 8, b""], [b"", b"\xff" * 8, b""]])
    def test_end_marker_in_both_forms(self, frames):
        assert parse_replay(frames) == ReplayEnd()

    def test_missing_delimiter_is_an_error(self):
        assert isinstance(parse_replay([b"kv", SEQ7, PAYLOAD]), FrameError)

    def test_request_frames(self):
        assert encode_replay_request(201) == [b"", (201).to_bytes(8, "big")]


class TestSocketGuessing:
    def test_four_frames_with_empty_first_are_replay(self):
        assert parse_any([b"", b"kv", SEQ7, PAYLOAD]).channel is Channel.REPLAY

    def test_three_frames_are_live_even_with_an_empty_topic(self):
        assert parse_any([b"", SEQ7, PAYLOAD]).channel is Channel.LIVE

    def test_the_old_three_frame_replay_needs_the_socket_kind(self):
        assert parse_any([b"", SEQ7, PAYLOAD], "dealer").channel is Channel.REPLAY

    def test_old_end_marker_is_recognised_without_a_hint(self):
        assert parse_any([b"", b"\xff" * 8, b""]) == ReplayEnd()

    def test_unknown_socket_kind_is_an_error(self):
        assert "unknown socket kind" in parse_any([b"", SEQ7, PAYLOAD], "pub").reason


def test_vllm_033_spec_decode_batches_decode_with_their_per_block_lookahead_lists():
    from kvmiss.schemas.events import BlockStored, decode_batch

    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
                "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None,
                "lookahead_token_ids": [[5, 6], [7, 8]]}], None])
    (event,) = decode_batch(payload).events
    assert isinstance(event, BlockStored) and event.lookahead_token_ids == [[5, 6], [7, 8]]
    assert event.block_hashes == [1, 2]


def test_vllm_033_spec_decode_frames_built_with_vllms_own_classes_decode(tmp_path):
    """vLLM's own structs where its wheel imports without the engine (a vLLM 0.33 venv)."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    from kvmiss.schemas.events import decode_batch

    fields = kv_events.BlockStored.__struct_fields__
    if "lookahead_token_ids" not in fields:
        pytest.skip("this vLLM has no lookahead_token_ids (0.33+)")
    stored = kv_events.BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
                                   lora_id=None, medium="GPU", lora_name=None, lookahead_token_ids=[[5], [6]])
    payload = msgspec.msgpack.encode(kv_events.KVEventBatch(ts=1.0, events=[stored], data_parallel_rank=0))
    (event,) = decode_batch(payload).events
    assert event.lookahead_token_ids == [[5], [6]]
