"""The collector's output: applied batches per worker, each with the continuity facts
that make the residency index's claims provable (shared/spec/ATTRIBUTION.md, rules 1-3).

A *run* is a maximal stretch of one worker epoch in which every batch was applied, live or
through replay. A run starts at seq 0 of an epoch (a known-empty point), at a mid-epoch
join (history before it unknown), or after a hole replay could not fill. The index sees an
``AllBlocksCleared`` itself and treats it as a known-empty point inside a run.
"""

from __future__ import annotations

import enum

import msgspec

from kvmiss.schemas.events import KVEvent


class RunStart(str, enum.Enum):
    EPOCH_START = "epoch_start"  # seq 0 of this epoch applied, nothing before it: known-empty
    JOINED = "joined"  # first batch seen mid-epoch, no full replay from 0: history before unknown
    AFTER_GAP = "after_gap"  # resumed after an unrecoverable hole [gap_from_seq, gap_to_seq]


class AppliedBatch(msgspec.Struct, frozen=True, kw_only=True):
    """One batch the index must apply, in order, for one worker.

    ``epoch`` is kvmiss's own counter of process lifetimes for this worker (bumped on every
    detected restart); ``instance`` is the deployment's instance id when the topic carries
    one. ``epoch_certain`` is False while a reconnect without an instance id has not been
    verified (downstream: ``unknown_epoch``).
    """

    worker: str
    epoch: int
    seq: int
    ts: float  # engine wall clock, seconds (batch publish time)
    recv_ts: float  # kvmiss wall clock at receipt, seconds
    events: list[KVEvent]
    run_start_seq: int
    run_start: RunStart
    gap_from_seq: int | None = None
    gap_to_seq: int | None = None
    instance: str | None = None
    epoch_certain: bool = True
    replayed: bool = False
