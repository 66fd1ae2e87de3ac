"""The residency index: which worker held which block, on which medium, from when to when.

Fed in order by the collector's `AppliedBatch` stream (schemas/stream.py); queried *as of a
lookup time in the past* by `enricher.evidence`. Pure state: no sockets, no clocks (time is
the batches' engine ``ts`` and the ``now`` a caller passes to `prune`). Not thread-safe: one
owner applies and queries (the pipeline's event loop).

Layout per worker: one `EpochView` per process lifetime (the previous one is kept read-only
so that late requests that looked up before a restart can still be judged; residency is
never carried across). Inside a view:

  * ``log_seq`` / ``log_ts``: every applied batch (seq, engine ts), for "which engine step
    contains the lookup" and "has history reached t" (bisect, O(log n)).
  * ``runs``: stretches of continuous history (see `schemas.stream.RunStart`).
  * ``clears``: observed AllBlocksCleared (seq, ts): known-empty points.
  * ``media``: medium -> {block key -> `Interval`}, the *latest* residency interval of each
    block on that medium. Older intervals of the same block hang off ``Interval.prev``.
    Copies are reference-counted per (medium, group): tiers and the lookup-limit recompute
    store one hash twice, and one `BlockRemoved` does not mean the hash left.
  * ``pruned``: a no-false-negative filter of blocks whose records retention dropped, so a
    query that would need one answers "aged out" instead of guessing.

Per-event work is O(1) (a dict lookup and a small object per stored block); AllBlocksCleared
is O(resident blocks), as in every peer implementation, and rare.
"""

from __future__ import annotations

import bisect
import collections
from array import array
from typing import Iterable, Iterator

from kvmiss.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmiss.schemas.stream import AppliedBatch, RunStart

GPU = "GPU"

# Wire spellings of each medium (vLLM, its connectors, SGLang) -> one canonical tier name.
_MEDIUM_ALIASES = {
    None: GPU,
    "GPU": GPU,
    "CPU": "CPU",
    "CPU_PINNED": "CPU",
    "STORAGE": "STORAGE",
    "DISK": "STORAGE",
    "EXTERNAL": "EXTERNAL",
}


def canonical_medium(raw: str | None) -> str:
    """GPU / CPU / STORAGE / EXTERNAL; unknown spellings pass through upper-cased."""
    found = _MEDIUM_ALIASES.get(raw)
    if found is not None:
        return found
    upper = raw.upper()  # type: ignore[union-attr]
    return _MEDIUM_ALIASES.get(upper, upper)


def block_key(block_hash: int, group_idx: int | None) -> int | tuple[int, int]:
    """Blocks of KV-cache group 0 (full attention) are keyed by hash alone, others by
    (group, hash): the same hash in two groups is two different blocks."""
    return block_hash if not group_idx else (group_idx, block_hash)


class Interval:
    """One stretch during which a block was resident on one medium of one worker epoch.

    ``refs`` counts live copies; the interval closes when it drops to zero or a clear is
    seen. ``stored_seq`` is None when the removal was seen but the store predates our
    history (mid-epoch join): such an interval proves nothing about when it was stored.
    """

    __slots__ = ("refs", "stored_seq", "stored_ts", "removed_seq", "removed_ts",
                 "removed_by_clear", "prev")

    def __init__(self, stored_seq: int | None, stored_ts: float | None, prev: Interval | None):
        self.refs = 1
        self.stored_seq = stored_seq
        self.stored_ts = stored_ts
        self.removed_seq: int | None = None
        self.removed_ts: float | None = None
        self.removed_by_clear = False
        self.prev = prev

    def close(self, seq: int, ts: float, by_clear: bool) -> None:
        self.refs = 0
        self.removed_seq = seq
        self.removed_ts = ts
        self.removed_by_clear = by_clear

    def history(self) -> Iterator[Interval]:
        """This interval and the older ones of the same block, newest first."""
        node: Interval | None = self
        while node is not None:
            yield node
            node = node.prev


class Run:
    """A stretch of one epoch in which every batch was applied (live or via replay)."""

    __slots__ = ("start_seq", "start", "start_ts", "gap_from_seq", "gap_to_seq", "last_seq")

    def __init__(self, batch: AppliedBatch):
        self.start_seq = batch.run_start_seq
        self.start = batch.run_start
        self.start_ts = batch.ts
        self.gap_from_seq = batch.gap_from_seq
        self.gap_to_seq = batch.gap_to_seq
        self.last_seq = batch.seq


class PrunedFilter:
    """Bloom filter over block hashes whose records were dropped: no false negatives.

    Block hashes are already uniform digests, so bit positions are slices of the hash
    itself (no re-hashing on the hot path).
    """

    __slots__ = ("_bits", "_mask", "count")

    def __init__(self, bits_log2: int = 20):
        self._bits = bytearray(1 << (bits_log2 - 3))
        self._mask = (1 << bits_log2) - 1
        self.count = 0

    def _positions(self, block_hash: int) -> tuple[int, int, int]:
        m = self._mask
        return block_hash & m, (block_hash >> 21) & m, (block_hash >> 42) & m

    def add(self, block_hash: int) -> None:
        for p in self._positions(block_hash):
            self._bits[p >> 3] |= 1 << (p & 7)
        self.count += 1

    def __contains__(self, block_hash: int) -> bool:
        return all(self._bits[p >> 3] & (1 << (p & 7)) for p in self._positions(block_hash))


class EpochView:
    """Residency of one worker during one process lifetime."""

    def __init__(self, worker: str, epoch: int, instance: str | None):
        self.worker = worker
        self.epoch = epoch
        self.instance = instance
        self.epoch_certain = True
        self.log_seq = array("q")
        self.log_ts = array("d")
        self.log_base = 0  # entries dropped from the front of the log by retention
        self.runs: list[Run] = []
        self.clears: list[tuple[int, float]] = []
        self.media: dict[str, dict[object, Interval]] = {GPU: {}}
        self.closed: collections.deque[tuple[float, str, object]] = collections.deque()
        self.pruned = PrunedFilter()
        self.horizon_ts: float | None = None  # records before this engine time may be gone
        self.first_ts: float | None = None

    # --- applying -------------------------------------------------------------------

    def apply(self, batch: AppliedBatch) -> None:
        seq, ts = batch.seq, batch.ts
        run = self.runs[-1] if self.runs else None
        if run is None or batch.run_start_seq != run.start_seq:
            self.runs.append(Run(batch))
        else:
            run.last_seq = seq
        self.epoch_certain = batch.epoch_certain
        if self.first_ts is None:
            self.first_ts = ts
        self.log_seq.append(seq)
        self.log_ts.append(ts)
        for event in batch.events:
            cls = event.__class__
            if cls is BlockStored:
                self._store(event, seq, ts)
            elif cls is BlockRemoved:
                self._remove(event, seq, ts)
            elif cls is AllBlocksCleared:
                self._clear(seq, ts)

    def _table(self, medium: str | None) -> dict[object, Interval]:
        name = canonical_medium(medium)
        table = self.media.get(name)
        if table is None:
            table = self.media[name] = {}
        return table

    def _store(self, event: BlockStored, seq: int, ts: float) -> None:
        table = self._table(event.medium)
        group = event.group_idx
        for h in event.block_hashes:
            key = h if not group else (group, h)
            current = table.get(key)
            if current is not None and current.removed_seq is None:
                current.refs += 1
            else:
                table[key] = Interval(seq, ts, current)

    def _remove(self, event: BlockRemoved, seq: int, ts: float) -> None:
        medium = canonical_medium(event.medium)
        table = self._table(medium)
        group = event.group_idx
        for h in event.block_hashes:
            key = h if not group else (group, h)
            current = table.get(key)
            if current is None or current.removed_seq is not None:
                # Stored before our history began: the removal is real, the store unknown.
                current = table[key] = Interval(None, None, current)
            current.refs -= 1
            if current.refs <= 0:
                current.close(seq, ts, by_clear=False)
                self.closed.append((ts, medium, key))

    def _clear(self, seq: int, ts: float) -> None:
        self.clears.append((seq, ts))
        for medium, table in self.media.items():
            for key, current in table.items():
                if current.removed_seq is None:
                    current.close(seq, ts, by_clear=True)
                    self.closed.append((ts, medium, key))

    # --- retention --------------------------------------------------------------------

    def prune(self, before_ts: float) -> int:
        """Drop closed intervals and log entries older than ``before_ts``; returns how many
        intervals were dropped. Resident intervals are never dropped (they are current)."""
        dropped = 0
        closed = self.closed
        while closed and closed[0][0] < before_ts:
            _, medium, key = closed.popleft()
            current = self.media[medium].get(key)
            if current is None:
                continue
            # Cut every closed interval older than the horizon off this block's chain.
            keep: Interval | None = None
            for node in current.history():
                if node.removed_ts is not None and node.removed_ts < before_ts:
                    if keep is None:
                        del self.media[medium][key]
                    else:
                        keep.prev = None
                    self.pruned.add(key if isinstance(key, int) else key[1])
                    dropped += 1
                    break
                keep = node
        cut = bisect.bisect_left(self.log_ts, before_ts)
        if cut:
            del self.log_seq[:cut]
            del self.log_ts[:cut]
            self.log_base += cut
        if dropped or cut:
            self.horizon_ts = before_ts if self.horizon_ts is None else max(self.horizon_ts, before_ts)
        return dropped

    # --- queries ----------------------------------------------------------------------

    def step_at(self, t: float) -> tuple[int, float] | None:
        """(seq, ts) of the first applied batch stamped at or after ``t``: the engine step
        that contains a lookup made at ``t``. None when history has not reached ``t``."""
        i = bisect.bisect_left(self.log_ts, t)
        if i == len(self.log_ts):
            return None
        return self.log_seq[i], self.log_ts[i]

    def run_containing(self, seq: int) -> Run | None:
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

    def interval_as_of(self, key: object, medium: str, step_seq: int) -> Interval | None:
        """The latest interval of ``key`` on ``medium`` whose store happened before the
        lookup step (a store in the lookup step happened after the lookup)."""
        current = self.media.get(medium, {}).get(key)
        if current is None:
            return None
        for node in current.history():
            if node.stored_seq is None or node.stored_seq < step_seq:
                return node
        return None

    @property
    def applied_through_ts(self) -> float | None:
        return self.log_ts[-1] if self.log_ts else None


class ResidencyIndex:
    """All tracked workers' epoch views. ``retention_s`` bounds closed records by engine
    time; `prune(now_engine_ts)` applies it (call it periodically, not per batch)."""

    def __init__(self, workers: Iterable[str] = (), *, retention_s: float = 600.0,
                 keep_previous_epochs: int = 1):
        self.retention_s = retention_s
        self.keep_previous_epochs = keep_previous_epochs
        self.current: dict[str, EpochView] = {}
        self.previous: dict[str, collections.deque[EpochView]] = {}
        self.tracked: set[str] = set(workers)

    def apply(self, batch: AppliedBatch) -> None:
        view = self.current.get(batch.worker)
        if view is None or view.epoch != batch.epoch:
            if view is not None and self.keep_previous_epochs > 0:
                older = self.previous.setdefault(
                    batch.worker, collections.deque(maxlen=self.keep_previous_epochs))
                older.appendleft(view)  # read-only from now on
            view = self.current[batch.worker] = EpochView(batch.worker, batch.epoch, batch.instance)
            self.tracked.add(batch.worker)
        view.apply(batch)

    def prune(self, now_ts: float) -> int:
        horizon = now_ts - self.retention_s
        views = [*self.current.values(), *(v for older in self.previous.values() for v in older)]
        return sum(v.prune(horizon) for v in views)

    def views(self, worker: str) -> list[EpochView]:
        """The worker's epoch views, newest first."""
        current = self.current.get(worker)
        return ([current] if current is not None else []) + list(self.previous.get(worker, ()))

    def workers(self) -> list[str]:
        return sorted(self.tracked)
