"""The span journal: acknowledged minus finished, carried across a crash, then reset."""

from __future__ import annotations

from kvmiss.enricher.otlp.journal import SpanJournal


def test_a_clean_run_leaves_nothing_to_report(tmp_path):
    path = str(tmp_path / "j")
    journal = SpanJournal(path)
    journal.accepted(512)
    journal.finished(512)
    journal.close()
    assert SpanJournal(path).lost_on_restart == 0


def test_spans_accepted_but_never_finished_are_reported_once(tmp_path):
    path = str(tmp_path / "j")
    journal = SpanJournal(path)
    for _ in range(3):
        journal.accepted(100)
    journal.finished(100)  # then the process dies: no close
    again = SpanJournal(path)
    assert again.lost_on_restart == 200
    again.close()
    assert SpanJournal(path).lost_on_restart == 0  # the new run started afresh


def test_a_torn_last_line_is_ignored(tmp_path):
    path = tmp_path / "j"
    path.write_bytes(b"a 100\nf 40\na 5")  # the last write was cut short
    assert SpanJournal(str(path)).lost_on_restart == 60


def test_it_records_counts_only(tmp_path):
    path = tmp_path / "j"
    journal = SpanJournal(str(path))
    journal.accepted(7)
    journal.finished(3)
    assert path.read_bytes() == b"a 7\nf 3\n"
