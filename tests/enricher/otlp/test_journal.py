"""The write-ahead span journal: bodies on disk before the OK, replayed after a crash until
done, torn records cost only themselves, segments go when done, a bound on disk."""

from __future__ import annotations

import asyncio

import pytest

from kvmiss.enricher.otlp.journal import JournalError, SpanJournal


def crash(journal: SpanJournal) -> None:
    """What a SIGKILL leaves: the written records (page cache), no close, no fsync."""
    import os

    os.close(journal._fd)
    journal._fd = -1


def test_a_body_not_done_is_replayed_after_a_crash_and_a_done_one_is_not(tmp_path):
    journal = SpanJournal(str(tmp_path))
    a, b = journal.append(b"body-a", 3), journal.append(b"body-b", 5)
    journal.done(a)
    crash(journal)
    again = SpanJournal(str(tmp_path))
    assert again.recovered == [b"body-b"] and again.recovered_spans == 5 and again.torn_records == 0
    assert b != a


def test_a_torn_last_record_costs_only_itself_and_never_stops_start_up(tmp_path):
    journal = SpanJournal(str(tmp_path))
    journal.append(b"kept-1", 1)
    journal.append(b"kept-2", 2)
    journal.append(b"torn" * 100, 4)
    crash(journal)
    (segment,) = sorted(tmp_path.glob("seg-*.wal"))
    segment.write_bytes(segment.read_bytes()[:-150])  # the crash cut the last write short
    again = SpanJournal(str(tmp_path))
    assert again.recovered == [b"kept-1", b"kept-2"] and again.torn_records == 1


def test_a_damaged_record_ends_its_segment_what_follows_is_not_trusted(tmp_path):
    journal = SpanJournal(str(tmp_path))
    journal.append(b"first", 1)
    journal.append(b"second", 1)
    crash(journal)
    (segment,) = sorted(tmp_path.glob("seg-*.wal"))
    data = bytearray(segment.read_bytes())
    data[20] ^= 0xFF  # inside the first record: its checksum fails
    segment.write_bytes(bytes(data))
    again = SpanJournal(str(tmp_path))
    assert again.recovered == [] and again.torn_records == 1


def test_replayed_bodies_are_journaled_again_and_the_old_segments_removed(tmp_path):
    journal = SpanJournal(str(tmp_path))
    journal.append(b"x", 1)
    crash(journal)
    again = SpanJournal(str(tmp_path))
    old = set(tmp_path.glob("seg-*.wal"))
    rid = again.append(again.recovered[0], 1)  # as the service replays it
    again.forget_recovered()
    assert not (old - {again._segments[again._current].path}) & set(tmp_path.glob("seg-*.wal"))
    crash(again)
    third = SpanJournal(str(tmp_path))
    assert third.recovered == [b"x"]  # still owed: not done yet
    assert rid > 0


def test_segments_rotate_and_go_when_every_body_in_them_is_done(tmp_path):
    journal = SpanJournal(str(tmp_path), segment_bytes=64)
    ids = [journal.append(b"y" * 40, 1) for _ in range(6)]
    assert len(list(tmp_path.glob("seg-*.wal"))) >= 3
    for rid in ids:
        journal.done(rid)
    assert len(list(tmp_path.glob("seg-*.wal"))) == 1  # only the one being written
    journal.close()
    assert SpanJournal(str(tmp_path)).recovered == []


@pytest.mark.parametrize("segment_bytes", [300, 64 << 20])  # rotating, and all in the segment being written
def test_the_bound_on_disk_makes_the_journal_full_until_bodies_are_done(tmp_path, segment_bytes):
    journal = SpanJournal(str(tmp_path), max_bytes=1000, segment_bytes=segment_bytes)
    ids = []
    while not journal.full():
        ids.append(journal.append(b"z" * 100, 1))
    assert journal.live_bytes >= 1000 and len(ids) <= 10
    for rid in ids:
        journal.done(rid)
    assert not journal.full()


def test_durable_returns_once_an_fsync_covered_the_body(tmp_path, monkeypatch):
    import os

    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    journal = SpanJournal(str(tmp_path))

    async def accept_two():
        journal.append(b"a", 1)
        journal.append(b"b", 1)
        await asyncio.gather(journal.durable(), journal.durable())

    asyncio.run(accept_two())
    assert len(synced) == 1  # group commit: one fsync for both
    asyncio.run(journal.durable())  # nothing new: returns at once
    assert len(synced) == 1


def test_a_journal_path_that_is_a_file_is_a_clear_error(tmp_path):
    path = tmp_path / "file"
    path.write_text("not a directory")
    with pytest.raises(JournalError, match="journal"):
        SpanJournal(str(path))


def test_a_body_journaled_as_it_came_in_gzipped_is_replayed_as_its_protobuf_bytes(tmp_path):
    import gzip

    journal = SpanJournal(str(tmp_path))
    body = b"\x0a\x00" * 500
    journal.append(gzip.compress(body), 7, gzipped=True)
    crash(journal)
    again = SpanJournal(str(tmp_path))
    assert again.recovered == [body] and again.recovered_spans == 7
