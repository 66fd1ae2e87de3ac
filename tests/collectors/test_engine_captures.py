"""Frames captured from real vLLM engines (examples/vllm-cpu/run_field.py --capture), one file
per release in tests/data/engines/: the first live messages of a run and one replay reply.
They span the wire eras -- positional-array events before 0.24, tagged maps from 0.24, a topic
frame in replay replies from 0.26 -- and each must decode as the engine meant it."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import msgspec
import pytest

from kvmiss.collectors.frames import BatchMessage, FrameError, ReplayEnd, parse_live, parse_replay
from kvmiss.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored

DATA = Path(__file__).resolve().parents[1] / "data" / "engines"
CAPTURES = sorted(DATA.glob("vllm-*-frames.jsonl"))


def release(path: Path) -> tuple[int, ...]:
    return tuple(int(x) for x in path.name.split("-")[1].split("."))


def messages(path: Path, source: str) -> list[list[bytes]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [[base64.b64decode(f) for f in row["frames"]] for row in rows if row["source"] == source]


def plain(event) -> tuple[str, list[int]]:
    """(type, block hashes) read with no kvmiss code: both wire forms, hashes as uint64."""
    if isinstance(event, dict):
        kind, hashes = event["type"], event.get("block_hashes", [])
    else:
        kind, hashes = event[0], (event[1] if len(event) > 1 else [])
    return kind, [h & (2**64 - 1) for h in hashes]


def test_captures_of_every_wire_era_are_present():
    eras = {release(p) < (0, 24, 0) for p in CAPTURES}, {release(p) >= (0, 26, 0) for p in CAPTURES}
    assert len(CAPTURES) >= 4 and eras == ({True, False}, {True, False}), [p.name for p in CAPTURES]


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.name)
def test_every_live_message_decodes_to_what_the_engine_sent(path):
    live = messages(path, "live")
    assert live
    kinds = set()
    for frames in live:
        message = parse_live(frames)
        assert isinstance(message, BatchMessage), message
        batch = message.decode()
        raw = msgspec.msgpack.decode(frames[2])
        assert len(batch.events) == len(raw[1])
        arrays = [not isinstance(e, dict) for e in raw[1]]
        assert all(arrays) == (release(path) < (0, 24, 0)) or not raw[1]  # the era's event form
        for event, sent in zip(batch.events, raw[1]):
            kind, hashes = plain(sent)
            assert type(event).__name__ == kind
            kinds.add(kind)
            if isinstance(event, (BlockStored, BlockRemoved)):
                assert event.block_hashes == hashes
            else:
                assert isinstance(event, AllBlocksCleared)
            if isinstance(event, BlockStored):
                assert event.block_size == 32 and len(event.tokens()) == 32 * len(hashes)
    assert {"BlockStored", "BlockRemoved"} <= kinds


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.name)
def test_the_replay_reply_has_its_eras_layout_and_ends_with_the_marker(path):
    replies = messages(path, "replay")
    assert replies
    with_topic = release(path) >= (0, 26, 0)
    for frames in replies[:-1]:
        assert len(frames) == (4 if with_topic else 3)
        message = parse_replay(frames)
        assert isinstance(message, BatchMessage) and not isinstance(message, FrameError), message
        message.decode()
    assert isinstance(parse_replay(replies[-1]), ReplayEnd)
