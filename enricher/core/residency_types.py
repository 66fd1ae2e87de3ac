"""The residency index's record types: where a table lives, one interval of a block, one
stretch of continuous history."""

from __future__ import annotations

from typing import NamedTuple

from kvmiss.schemas.stream import AppliedBatch

GPU = "GPU"  # the medium a prefix lookup reads; every other is an offload tier


class Placement(NamedTuple):
    """Where a residency table lives: a canonical medium and a KV-cache group (a group the
    engine does not name is 0). Not an offload tier: GPU is a placement too."""

    medium: str
    group: int


class Interval(NamedTuple):
    """A read-only view of one residency interval of a block on one medium.

    ``stored_seq`` is None when the removal was seen but the store predates our history
    (mid-epoch join): such an interval proves nothing about when it was stored. Times are
    None once the batch log around them has aged out.
    """

    stored_seq: int | None
    stored_ts: float | None
    removed_seq: int | None
    removed_ts: float | None
    removed_by_clear: bool


class HistoryRun:
    """A stretch of one epoch in which every batch was applied (live or via replay)."""

    __slots__ = ("start_seq", "start", "start_ts", "gap_from_seq", "gap_to_seq", "last_seq")

    def __init__(self, batch: AppliedBatch):
        self.start_seq = batch.run_start_seq
        self.start = batch.run_start
        self.start_ts = batch.ts
        self.gap_from_seq = batch.gap_from_seq
        self.gap_to_seq = batch.gap_to_seq
        self.last_seq = batch.seq
