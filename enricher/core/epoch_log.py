"""One lifetime's log: which batches were applied when, the runs of continuous history, the
cache clears and the clock steps -- what places a lookup time among the engine's steps and says
whether history reaches it. A part of `EpochResidency` (enricher/core/epoch_residency.py), whose
state it reads; kept apart because it is a concept of its own.
"""

from __future__ import annotations

import collections
import logging
from array import array
from bisect import bisect_right
from typing import Any, NamedTuple

from kvmiss.enricher.core.residency_table import bisect_left
from kvmiss.enricher.core.residency_types import HistoryRun
from kvmiss.schemas.attribution import History
from kvmiss.schemas.stream import RunStart

log = logging.getLogger("kvmiss.index")

# How long after a lookup a tail confirmation must have been sent to prove history reached
# it (schemas/config.py: history.clock_skew_s + history.publish_delay_s).
TAIL_MARGIN_S = 1.25


class LookupPoint(NamedTuple):
    """Where a lookup at t falls in one lifetime's history, with the doubts that leaves.

    ``doubt``: AGED_OUT (t is before what retention kept: ``horizon_ts``) or LAGGING (no
    applied step reaches t); then nothing else is set. Otherwise ``step_seq`` is the engine step
    of the lookup, ``run`` its stretch of continuous history, ``gap`` where that stretch's
    history broke (evidence fields), ``clock_step_s`` how far the engine clock went back around
    t (t cannot be placed), ``hole`` the unfilled hole a quarantine leaves before the step."""

    doubt: History | None
    horizon_ts: float | None = None
    step_seq: int = -1
    run: HistoryRun | None = None
    gap: dict[str, Any] = {}
    clock_step_s: float | None = None
    hole: tuple[int | None, int | None] | None = None


class EpochLog:
    """The batch log's queries and upkeep (state: ``log_seq``, ``log_ts``, ``runs``, ``clears``,
    ``tail``, ``clock_steps``, set by `EpochResidency.__init__`)."""

    # Declared for the type checker only (no values: `EpochResidency.__init__` sets them).
    worker: str
    counts: collections.Counter[Any]
    log_seq: array[int]
    log_ts: array[float]
    log_removed: array[int]
    runs: list[HistoryRun]
    clears: list[tuple[int, float]]
    refusals: list[int]
    clock_steps: list[tuple[float, float]]
    last_seq: int | None
    last_ts: float | None
    tail: tuple[int, float] | None
    horizon_ts: float | None

    def _init_log(self) -> None:
        """The log's state, empty (called by `EpochResidency.__init__`)."""
        self.log_seq = array("q")
        self.log_ts = array("d")
        # GPU (group 0) hashes removed through each logged batch, cumulative: the evictions
        # between two batches, for what-if sizing (enricher/estimates/whatif.py).
        self.log_removed = array("Q")
        self._removed_in_python = 0  # the part of it applied by `_apply_event`
        self.log_base = 0  # entries dropped from the front of the log by retention
        self.runs = []
        self.clears = []
        self.last_seq = None  # the last applied batch (kept when the log is pruned)
        self.last_ts = None
        # Engine times at which a lookup cannot be placed among this lifetime's batches: the
        # engine clock went back (a wall-clock step), so the same readings occur before and
        # after the step. (low, high): the first batch stamped after the step, and the latest
        # stamp before it. From the step on, batches are logged at ``high`` until the clock
        # passes it again, so the log stays in order and a bisect in it stays valid; evidence
        # widens each window by the tail margin (a lookup precedes its batch by at most that)
        # and answers unknown inside it (`clock_step_at`). Dropped by `ResidencyIndex.prune`
        # once a window ends before the retention horizon less the margin.
        self.clock_steps = []
        # Seqs of batches with refused events (`MAX_TIERS`), the first after each clear: a
        # lookup in or after one, with no clear since, is quarantined (`quarantined_at`).
        self.refusals = []
        self._engine_ts: float | None = None  # the last batch's own stamp
        self.tail = None  # (seq, kvmiss time) of the latest confirmation

    def lookup_point(self, t: float, margin: float) -> LookupPoint:
        """The lookup at ``t`` placed among this lifetime's steps: the one question evidence
        asks the log before it asks about blocks."""
        if self.horizon_ts is not None and t < self.horizon_ts:
            return LookupPoint(History.AGED_OUT, horizon_ts=self.horizon_ts)
        step_seq = self.lookup_step(t, margin)
        if step_seq is None:
            return LookupPoint(History.LAGGING)
        stepped_back = self.clock_step_at(t, margin) if self.clock_steps else None
        run = self.run_at_step(step_seq)
        assert run is not None, "every applied batch belongs to a run"
        return LookupPoint(None, self.horizon_ts, step_seq, run, _gap_of(run), stepped_back,
                           self.quarantine_hole(run, step_seq))

    def quarantine_hole(self, run: HistoryRun, step_seq: int) -> tuple[int | None, int | None] | None:
        """The hole that leaves the lookup's step quarantined: events the index refused
        (`epoch_residency.MAX_TIERS`), or a run after an unfilled hole with no clear since."""
        refused = self.quarantined_at(step_seq) if self.refusals else None
        if refused is not None:
            return refused, refused
        if run.start is RunStart.AFTER_GAP and self.last_clear_between(run.start_seq, step_seq + 1) is None:
            return run.gap_from_seq, run.gap_to_seq
        return None

    def quarantined_at(self, step_seq: int) -> int | None:
        """The seq of a batch with refused events at or before ``step_seq`` with no clear
        since (the lookup's history lacks what they did), else None."""
        refusals = self.refusals
        if not refusals or refusals[0] > step_seq:
            return None
        seq = refusals[bisect_right(refusals, step_seq) - 1]
        return seq if self.last_clear_between(seq, step_seq + 1) is None else None

    def _clock_stepped_back(self, ts: float) -> None:
        """A batch stamped before the one applied last: the engine clock went back."""
        high = self.last_ts if self.last_ts is not None else ts
        steps = self.clock_steps
        if steps and ts <= steps[-1][1]:  # inside the last window: one ambiguous stretch
            steps[-1] = (min(steps[-1][0], ts), max(steps[-1][1], high))
        else:
            steps.append((ts, high))
        self.counts[("clock_steps_back", self.worker)] += 1
        if self.counts[("clock_steps_back", self.worker)] == 1:
            log.warning("worker %s: engine clock went back %.3f s (a batch stamped before the one before it): "
                        "lookups between the two stamps cannot be ordered against its events and are "
                        "unknown_history (counted: kvmiss_index_clock_steps_back_total)", self.worker, high - ts)

    def clock_step_at(self, t: float, margin: float) -> float | None:
        """How far the engine clock went back, when ``t`` lies within ``margin`` of a window
        of `clock_steps`; None when ``t`` can be placed among this lifetime's batches."""
        for low, high in reversed(self.clock_steps):
            if low - margin <= t <= high + margin:
                return high - low
        return None

    def forget_clock_steps(self, before_ts: float) -> None:
        """Drop the windows that end before ``before_ts`` (older lookups are aged out)."""
        if self.clock_steps and self.clock_steps[0][1] < before_ts:
            self.clock_steps = [w for w in self.clock_steps if w[1] >= before_ts]

    def _trim_runs_and_clears(self) -> None:
        """Bound the run and clear lists by the log (one entry per gap or clear would
        otherwise grow with the lifetime). A lookup step is a logged batch or the one after
        the last, so only runs reaching into the log are asked for; the first run is kept
        too (its start says whether the lifetime began at seq 0). Of the clears before the
        log, the latest is kept: it may be the known-empty point of a long run."""
        first = self.log_seq[0] if self.log_seq else (self.last_seq or 0) + 1
        runs = self.runs
        if len(runs) > 2 and runs[1].last_seq < first:
            keep = next((i for i in range(1, len(runs) - 1) if runs[i].last_seq >= first), len(runs) - 1)
            del runs[1:keep]
        clears = self.clears
        if len(clears) > 1 and clears[1][0] < first:
            keep = next((i for i in range(1, len(clears)) if clears[i][0] >= first), len(clears))
            del clears[:keep - 1]
        refusals = self.refusals  # the latest before the log may still apply
        if len(refusals) > 1 and refusals[1] < first:
            keep = next((i for i in range(1, len(refusals)) if refusals[i] >= first), len(refusals))
            del refusals[:keep - 1]

    def confirm_tail(self, seq: int, at: float) -> None:
        """The publisher had published nothing after batch ``seq`` when it answered a probe
        sent at ``at`` (kvmiss clock). Counts only while ``seq`` is the last applied batch:
        a confirmation of a seq the index never applied (written off) proves nothing."""
        if seq == self.last_seq and (self.tail is None or self.tail[0] != seq or at > self.tail[1]):
            self.tail = (seq, at)

    def step_at(self, t: float) -> tuple[int, float] | None:
        """(seq, ts) of the first applied batch stamped at or after ``t``: the engine step
        that contains a lookup made at ``t``. None when no applied batch is stamped at or
        after ``t`` (see `lookup_step` for an idle worker)."""
        i: int = bisect_left(self.log_ts, t)
        if i == len(self.log_ts):
            return None
        return self.log_seq[i], self.log_ts[i]

    def reached_through(self, margin: float) -> float | None:
        """Engine time through which history is proven: the last applied batch's ``ts``, or
        a confirmation of that batch as the tail, sent at ``at``, as ``at - margin``.

        ``margin`` bounds how far the confirmation's kvmiss-clock time may run ahead of the
        engine clock, plus how long a lookup's step may take to reach the publisher's ring
        (a step publishes its batch after it ran): a probe answered before that tells nothing
        about the lookup."""
        through, tail = self.last_ts, self.tail
        if tail is not None and tail[0] == self.last_seq:
            confirmed = tail[1] - margin
            if through is None or confirmed > through:
                return confirmed
        return through

    def reaches(self, t: float, margin: float) -> bool:
        """Whether history reaches ``t``: an applied batch stamped at or after ``t``, or a
        tail confirmation of the last applied batch sent at least ``margin`` after ``t``."""
        through = self.reached_through(margin)
        return through is not None and through >= t

    def removals_between(self, after_seq: int, through_seq: int) -> int | None:
        """GPU hashes removed by the batches after ``after_seq`` through ``through_seq`` (both
        applied in this view); None when either batch has left the log."""
        i: int = bisect_left(self.log_seq, after_seq)
        j: int = bisect_left(self.log_seq, through_seq + 1) - 1
        if i >= len(self.log_seq) or self.log_seq[i] != after_seq or j < i:
            return None
        return self.log_removed[j] - self.log_removed[i]

    def lookup_step(self, t: float, margin: float) -> int | None:
        """The seq of the engine step containing a lookup at ``t``: the first applied batch
        stamped at or after ``t``; when the worker was idle past ``t`` (a tail confirmation
        reaches it), the virtual step after the last applied batch -- every store and removal
        applied so far came before ``t``. None when history has not reached ``t``."""
        step = self.step_at(t)
        if step is not None:
            return step[0]
        last = self.last_seq
        if last is not None and self.last_ts is not None and self.last_ts < t and self.reaches(t, margin):
            return last + 1
        return None

    def run_at_step(self, step_seq: int) -> HistoryRun | None:
        """The run of a lookup step (the last run for the virtual step after the last batch)."""
        if self.last_seq is not None and step_seq == self.last_seq + 1 and self.runs:
            return self.runs[-1]
        return self.run_containing(step_seq)

    def run_containing(self, seq: int) -> HistoryRun | None:
        for run in reversed(self.runs):
            if run.start_seq <= seq <= run.last_seq:
                return run
        return None

    def last_clear_between(self, lo_seq: int, hi_seq: int) -> tuple[int, float] | None:
        """The latest clear with lo_seq <= seq < hi_seq (a known-empty point)."""
        for clear in reversed(self.clears):
            if lo_seq <= clear[0] < hi_seq:
                return clear
        return None

    def ts_of(self, seq: int | None) -> float | None:
        """Engine time of an applied batch, while the log still holds it."""
        if seq is None:
            return None
        i: int = bisect_left(self.log_seq, seq)
        return self.log_ts[i] if i < len(self.log_seq) and self.log_seq[i] == seq else None

    @property
    def applied_through_ts(self) -> float | None:
        """Engine time of the last applied batch (what was applied, not what a tail
        confirmation proves: see `reached_through`)."""
        return self.last_ts


def _gap_of(run: HistoryRun) -> dict[str, Any]:
    """Where the history behind this run broke: an unfilled hole, or everything before a
    mid-epoch join (seq 0 .. first seen - 1)."""
    if run.start is RunStart.AFTER_GAP:
        return dict(gap_from_seq=run.gap_from_seq, gap_to_seq=run.gap_to_seq)
    if run.start is RunStart.JOINED:
        return dict(gap_from_seq=0, gap_to_seq=run.start_seq - 1)
    return {}
