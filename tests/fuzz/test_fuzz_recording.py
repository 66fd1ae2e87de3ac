"""Recordings (`kvmiss attribute --events FILE`, collector playback): any file either fails
its header check with `RecordingError` or yields intact records and stops at the first torn
one; whatever was written whole reads back exactly."""

from __future__ import annotations

import os
import struct
import tempfile
import zlib

import msgspec
from fuzz_support import captured_messages, fuzz_settings, msgpack_garbage, mutate_bytes, seeds
from hypothesis import given, strategies as st

from kvmiss.collectors.recording import (
    MAGIC,
    ReadStats,
    RecordedMessage,
    RecordingError,
    RecordingWriter,
    read_recording,
)

_HEADER = struct.Struct("<II")
_DIR = tempfile.mkdtemp(prefix="kvmiss-fuzz-rec-")


def _path(name: str) -> str:
    return os.path.join(_DIR, name)


def read_all(data: bytes) -> tuple[list[RecordedMessage] | None, ReadStats]:
    """Read ``data`` as a recording file; None when the header check refused it."""
    path = _path("read.rec")
    with open(path, "wb") as f:
        f.write(data)
    stats = ReadStats()
    try:
        messages = list(read_recording(path, stats))
    except RecordingError:
        assert not data.startswith(MAGIC)
        return None, stats
    assert all(isinstance(m, RecordedMessage) for m in messages)
    assert stats.records == len(messages)
    if stats.torn_tail:
        assert stats.torn_offset is not None and len(MAGIC) <= stats.torn_offset <= len(data)
    return messages, stats


@st.composite
def recorded_messages(draw) -> RecordedMessage:
    frames, socket = draw(seeds(captured_messages))
    return RecordedMessage(
        recv_ts=draw(st.floats(allow_nan=False)),
        worker=draw(st.text(max_size=8)),
        socket=draw(st.sampled_from([socket, "monitor", "tick"]) | st.text(max_size=6)),
        frames=list(frames) if draw(st.booleans()) else draw(st.lists(st.binary(max_size=16), max_size=4)),
        request_id=draw(st.none() | st.integers(-2**63, 2**64 - 1)),
    )


def written(messages: list[RecordedMessage]) -> bytes:
    path = _path("write.rec")
    if os.path.exists(path):
        os.unlink(path)
    with RecordingWriter(path) as writer:
        for m in messages:
            writer.write(m)
    with open(path, "rb") as f:
        return f.read()


def record(body: bytes) -> bytes:
    return _HEADER.pack(len(body), zlib.crc32(body)) + body


@fuzz_settings(20)
@given(st.lists(recorded_messages(), max_size=6), st.data())
def test_what_was_written_reads_back_and_a_truncation_yields_a_prefix(messages, data):
    raw = written(messages)
    back, stats = read_all(raw)
    assert back == messages and not stats.torn_tail
    boundaries = [len(MAGIC)]
    while boundaries[-1] < len(raw):
        boundaries.append(boundaries[-1] + _HEADER.size + _HEADER.unpack_from(raw, boundaries[-1])[0])
    cut = data.draw(st.integers(len(MAGIC), len(raw)))
    prefix, stats = read_all(raw[:cut])
    assert prefix == messages[: len(prefix)]
    assert len(prefix) == sum(1 for b in boundaries[1:] if b <= cut)
    assert stats.torn_tail == (cut not in boundaries)


@fuzz_settings(50)
@given(st.lists(recorded_messages(), max_size=4), st.data())
def test_mutated_recordings_yield_intact_records_or_a_header_error(messages, data):
    raw = written(messages)
    mutated = data.draw(mutate_bytes(raw))
    read_all(mutated)


@fuzz_settings(35)
@given(st.lists(msgpack_garbage, max_size=8), st.lists(recorded_messages(), max_size=2))
def test_records_with_a_valid_crc_but_any_body_never_escape_as_exceptions(bodies, messages):
    """The CRC only proves a record is whole; its body can still be anything (a recording
    from another tool, a hand-edited file, nesting past the recursion limit)."""
    raw = written(messages) + b"".join(record(msgspec.msgpack.encode(b)) for b in bodies)
    back, _ = read_all(raw)
    assert back is not None and back[: len(messages)] == messages


@fuzz_settings(20)
@given(recorded_messages(), st.lists(msgpack_garbage, min_size=1, max_size=3))
def test_records_from_a_newer_writer_with_trailing_fields_never_escape_as_exceptions(message, extra):
    body = msgspec.msgpack.encode([*msgspec.to_builtins(message, builtin_types=(bytes,)), *extra])
    back, _ = read_all(written([message]) + record(body))
    assert back is not None and back[0] == message
