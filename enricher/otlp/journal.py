"""The span journal: what was acknowledged upstream but never finished downstream.

kvmiss holds spans in memory while it judges them and while the export queue delivers
them; a crash loses those. The journal makes that loss visible instead of silent: a line
``a <n>`` when ``n`` spans are accepted (the sender got its OK), ``f <n>`` when ``n`` leave
the export queue (sent, or failed/dropped and counted there). Each line is one small
``O_APPEND`` write, so it survives a SIGKILL (the page cache keeps it; only power loss needs
fsync). At start-up the previous run's accepted minus finished is the number lost, reported
once (`lost_on_restart`, metric ``kvmiss_spans_lost_on_restart_total``), and the file starts
afresh. It records counts only -- never span contents.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("kvmiss.journal")


def _read_balance(path: str) -> int:
    accepted = finished = 0
    try:
        with open(path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break  # a torn last write: its count may be cut short
                kind, _, count = line.strip().partition(b" ")
                if not count.isdigit():
                    continue
                if kind == b"a":
                    accepted += int(count)
                elif kind == b"f":
                    finished += int(count)
    except FileNotFoundError:
        return 0
    return max(0, accepted - finished)


class SpanJournal:
    """Counts in, counts out. Thread-safe for appends (one ``os.write`` each)."""

    def __init__(self, path: str):
        self.path = path
        self.lost_on_restart = _read_balance(path)
        if self.lost_on_restart:
            log.warning("%d spans acknowledged by the previous run were never exported (lost in "
                        "a crash); counted in kvmiss_spans_lost_on_restart_total", self.lost_on_restart)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)

    def accepted(self, spans: int) -> None:
        if spans:
            os.write(self._fd, b"a %d\n" % spans)

    def finished(self, spans: int) -> None:
        if spans:
            os.write(self._fd, b"f %d\n" % spans)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
