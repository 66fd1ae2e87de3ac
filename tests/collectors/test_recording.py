"""Recordings: append-only, crash-safe, read back exactly."""

from __future__ import annotations

import pytest

from kvmiss.collectors.recording import (
    MAGIC,
    ReadStats,
    RecordedMessage,
    RecordingError,
    RecordingWriter,
    read_recording,
)


def _messages(n: int) -> list[RecordedMessage]:
    return [
        RecordedMessage(100.0 + i, f"w{i % 3}", "sub" if i % 2 else "dealer",
                        [b"kv", i.to_bytes(8, "big"), bytes([i % 256]) * (i * 7 % 50)])
        for i in range(n)
    ]


def test_messages_read_back_in_order_and_unchanged(tmp_path):
    path, msgs = tmp_path / "r.kvrec", _messages(40)
    with RecordingWriter(path) as w:
        for m in msgs:
            w.write(m)
    stats = ReadStats()
    assert list(read_recording(path, stats)) == msgs
    assert stats.records == 40 and not stats.torn_tail


def test_appending_to_an_existing_recording_keeps_one_header(tmp_path):
    path, msgs = tmp_path / "r.kvrec", _messages(6)
    for chunk in (msgs[:3], msgs[3:]):
        with RecordingWriter(path) as w:
            for m in chunk:
                w.write(m)
    assert list(read_recording(path)) == msgs
    assert path.read_bytes().count(MAGIC) == 1


@pytest.mark.parametrize("cut", [1, 4, 8, 9, 20])
def test_a_torn_last_record_is_detected_and_skipped(tmp_path, cut):
    path, msgs = tmp_path / "r.kvrec", _messages(5)
    with RecordingWriter(path) as w:
        for m in msgs:
            w.write(m)
    data = path.read_bytes()
    path.write_bytes(data[:-cut])
    stats = ReadStats()
    assert list(read_recording(path, stats)) == msgs[:4]
    assert stats.torn_tail and stats.records == 4


def test_a_corrupted_record_stops_the_read_there(tmp_path):
    path, msgs = tmp_path / "r.kvrec", _messages(5)
    with RecordingWriter(path) as w:
        for m in msgs:
            w.write(m)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    stats = ReadStats()
    assert list(read_recording(path, stats)) == msgs[:4]
    assert stats.torn_tail


def test_a_file_that_is_not_a_recording_is_refused_by_reader_and_writer(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(RecordingError):
        list(read_recording(path))
    with pytest.raises(RecordingError):
        RecordingWriter(path)
