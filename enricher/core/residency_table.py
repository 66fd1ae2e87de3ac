"""The residency records of one medium (and KV-cache group) of one worker epoch.

`BlockTable` is what `enricher.index.EpochResidency` keeps per medium: for each block hash, its
latest residency interval and the older ones behind it, reference-counted while resident,
plus a retention queue of intervals that closed. Sequence numbers are the applied batches'
(engine) seqs; an interval's store is None when its removal was seen but the store predates
our history (a mid-epoch join).

Two implementations with one interface:

  * ``kvmiss.enricher.core._blocktable.BlockTable`` (enricher/core/_blocktable.c), compiled at install
    time: one 16-byte slot per block at a load factor of 0.53-0.8 (20-30 bytes) and no
    Python object per block (benchmarks/RESULTS.md: the memory and throughput targets). Used
    whenever it imported.
  * `PyBlockTable` below: the reference model, plain and slow. It states the rules; the
    tests run both on the same random event streams and require identical answers
    (tests/enricher/core/test_residency_table.py). It is the fallback where no compiler was
    available at install time, or when KVMISS_PURE_PYTHON_TABLE=1 (`ACCELERATED` is False
    then, and serve warns at start-up).
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Iterable
from typing import Any

# One interval: (stored seq or None, removed seq or None while resident, removed by a clear)
IntervalRecord = tuple[int | None, int | None, bool]

# Seqs are kept relative to the epoch's first applied batch in 31 bits (the C table packs a
# closed interval's two seqs into one word beside the key): 2.1 * 10^9 batches, ~250 days of
# an engine publishing 100 batches/s. Past it the index starts a fresh view of the worker.
SEQ_SPAN = (1 << 31) - 1


class PyBlockTable:
    """Reference model of `BlockTable` (see the module docstring)."""

    def __init__(self, base_seq: int = 0):
        self.base_seq = base_seq
        # The KV-cache group's block size, set by the index when it learns it (0: not known).
        self.block_size = 0
        # hash -> [live copies, [(stored, removed, by_clear), ...] newest first]
        self._records: dict[int, list[Any]] = {}
        self._closed: collections.deque[tuple[float, int]] = collections.deque()

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq - self.base_seq < SEQ_SPAN:
            raise OverflowError(f"batch seq {seq} outside this epoch's range "
                                f"(first applied seq {self.base_seq})")

    @staticmethod
    def _check_hash(h: int) -> None:
        if not isinstance(h, int) or not 0 <= h < 1 << 64:
            raise OverflowError("a block hash must be an int in [0, 2**64)")

    def store(self, hashes: Iterable[int], seq: int) -> list[int] | None:
        """One BlockStored of batch ``seq``; returns hashes that already had a live copy
        stored in this same batch (same-step copies), or None."""
        self._check_seq(seq)
        same_step: list[int] = []
        for h in hashes:
            self._check_hash(h)
            entry = self._records.get(h)
            if entry is None:
                self._records[h] = [1, [(seq, None, False)]]
            elif entry[1][0][1] is None:  # resident: one more live copy
                entry[0] += 1
                if entry[1][0][0] == seq:
                    same_step.append(h)
            else:  # stored again after its removal
                entry[0] = 1
                entry[1].insert(0, (seq, None, False))
        return same_step or None

    def remove(self, hashes: Iterable[int], seq: int, ts: float) -> int:
        """One BlockRemoved: a block loses one live copy; the interval closes with the last.
        A removal of a block not resident here opens and closes an interval whose store
        predates our history. Returns how many intervals closed."""
        self._check_seq(seq)
        closed = 0
        for h in hashes:
            self._check_hash(h)
            entry = self._records.get(h)
            if entry is None:
                self._records[h] = [0, [(None, seq, False)]]
            elif entry[1][0][1] is not None:
                entry[1].insert(0, (None, seq, False))
            elif entry[0] > 1:
                entry[0] -= 1
                continue
            else:
                entry[0] = 0
                entry[1][0] = (entry[1][0][0], seq, False)
            self._closed.append((ts, h))
            closed += 1
        return closed

    def clear(self, seq: int, ts: float) -> int:
        """AllBlocksCleared: every resident interval closes, by a clear."""
        self._check_seq(seq)
        closed = 0
        for h, entry in self._records.items():
            if entry[1][0][1] is None:
                entry[0] = 0
                entry[1][0] = (entry[1][0][0], seq, True)
                self._closed.append((ts, h))
                closed += 1
        return closed

    def prune(self, before_ts: float, horizon_seq: int | None, limit: int | None = None) -> list[int]:
        """Drop intervals closed before ``before_ts`` (and before batch ``horizon_seq``),
        with everything older of the same block; never a resident interval. Returns the
        hashes that lost records. ``limit``: take at most that many entries of the retention
        queue; the rest wait for the next call."""
        dropped, taken = [], 0
        while self._closed and self._closed[0][0] < before_ts and (limit is None or taken < limit):
            taken += 1
            _, h = self._closed.popleft()
            entry = self._records.get(h)
            if entry is None:
                continue
            for i, (_, removed, _) in enumerate(entry[1]):
                if removed is not None and (horizon_seq is None or removed < horizon_seq):
                    del entry[1][i:]
                    if not entry[1]:
                        del self._records[h]
                    dropped.append(h)
                    break
        return dropped

    def as_of(self, h: int, step_seq: int) -> IntervalRecord | None:
        """The latest interval whose store came before batch ``step_seq`` (a store in the
        lookup's own step came after the lookup; an unknown store counts as before)."""
        entry = self._records.get(h)
        record: IntervalRecord
        for record in entry[1] if entry is not None else ():
            if record[0] is None or record[0] < step_seq:
                return record
        return None

    def chain(self, h: int) -> list[IntervalRecord]:
        """Every interval of ``h``, newest first."""
        self._check_hash(h)
        entry = self._records.get(h)
        return list(entry[1]) if entry is not None else []

    def copies(self, h: int) -> int:
        """Live copies of a resident block (0 when not resident)."""
        self._check_hash(h)
        entry = self._records.get(h)
        return entry[0] if entry is not None and entry[1][0][1] is None else 0

    def __contains__(self, h: object) -> bool:
        return h in self._records

    def __len__(self) -> int:
        return len(self._records)

    @property
    def older(self) -> int:
        return sum(len(entry[1]) - 1 for entry in self._records.values())

    @property
    def retained(self) -> int:
        return len(self._closed)

    @property
    def nbytes(self) -> int:
        """Not measured for the reference model (see benchmarks/bench_index_memory.py)."""
        return 0


try:
    if os.environ.get("KVMISS_PURE_PYTHON_TABLE") == "1":  # to rule the C table in or out
        raise ImportError("KVMISS_PURE_PYTHON_TABLE=1")
    # (`X as X`: re-exported, for the type checker's strict mode)
    from kvmiss.enricher.core._blocktable import (
        Applier as Applier,
        BlockTable as BlockTable,
        bisect_left as bisect_left,
        bloom_add as bloom_add,
        holding as holding,
    )
    ACCELERATED = True
except ImportError:  # built without a C compiler: the reference model, correct but slower
    from bisect import bisect_left as bisect_left  # (the batch log's search; boxes each probe)
    BlockTable = PyBlockTable
    Applier = None  # EpochResidency applies events in Python (index.py `_apply_event`)
    bloom_add = None  # AgedOutFilter sets its bits in Python (index.py `_BloomStage.add`)
    ACCELERATED = False

    def holding(block_hash: object, tables: tuple[Any, ...]) -> list[int]:
        """The positions in ``tables`` of the tables with a record of ``block_hash``."""
        return [i for i, table in enumerate(tables) if block_hash in table]


_warned = False


def warn_if_not_accelerated() -> bool:
    """Warn once, loudly, when the index runs on the reference model; returns ACCELERATED."""
    global _warned
    if not ACCELERATED and not _warned:
        _warned = True
        logging.getLogger("kvmiss.index").warning(
            "!!! the residency index is using its pure-Python reference table, not the compiled "
            "one (enricher/core/_blocktable.c was not built: no C compiler at install time, or "
            "KVMISS_PURE_PYTHON_TABLE=1): ingest is several times slower and each block costs "
            "~4x the memory. Reinstall kvmiss with a C compiler present. !!!")
    return ACCELERATED
