"""One worker's residency during one process lifetime (`EpochResidency`): per (medium, KV-cache
group) which blocks it held from when to when, as its applied batches say.

Inside, beside the tables (``tiers``: `Placement` -> `BlockTable`, enricher/core/residency_table.py;
the latest residency interval of each block, older ones chained behind it; copies counted, since
offload tiers and the lookup-limit recompute store one hash twice):
  * the batch log, runs, clears, tail confirmations and clock steps (`EpochLog`,
    enricher/core/epoch_log.py);
  * the stores not counted as copies until their request says so (`UncountedStores`,
    enricher/core/uncounted_stores.py);
  * ``pruned``: blocks whose records retention dropped (`AgedOutFilter`, enricher/core/aged_out.py).

Per-event work is O(1) (one call into the table per event, one probe per block);
AllBlocksCleared is O(resident blocks), as in every peer implementation, and rare.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from kvmiss.collectors.engines import canonical_medium  # each engine's medium spellings
from kvmiss.enricher.core.aged_out import AgedOutFilter
from kvmiss.enricher.core.divergence import SiblingRegistry
from kvmiss.enricher.core.epoch_log import EpochLog
from kvmiss.enricher.core.hit_rule import hybrid_hit, rule_for
from kvmiss.enricher.core.residency_table import Applier, BlockTable, bisect_left
from kvmiss.enricher.core.residency_types import GPU, HistoryRun, Interval, Placement
from kvmiss.enricher.core.uncounted_stores import UncountedStores
from kvmiss.schemas.attribution import KVCacheGroup
from kvmiss.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmiss.schemas.stream import AppliedBatch, RunStart

log = logging.getLogger("kvmiss.index")

# Residency tables one lifetime keeps, one per (medium, KV-cache group): an engine has a few
# groups on a few media (vLLM: at most ~8 x 4). Events naming a further one are refused --
# garbage in decodable events would otherwise add tables without bound -- and, since what
# they did is then missing, the lifetime is quarantined from that batch until a cache clear.
MAX_TIERS = 64


class EpochResidency(EpochLog, UncountedStores):
    """Residency of one worker during one process lifetime."""

    def __init__(self, worker: str, epoch: int, instance: str | None, *,
                 divergence_detail: bool = False, aged_out_horizon_s: float = float("inf"),
                 counts: collections.Counter[Any] | None = None, re_announcements: bool = True):
        self.worker = worker
        self.epoch = epoch
        self.instance = instance
        self.epoch_certain = True
        self._init_log()
        # Residency records (enricher/core/residency_table.py), one table per `Placement` (medium,
        # KV-cache group): the same hash in two groups is two different blocks. ``media``
        # holds the primary group's tables per medium -- the full-attention group once the
        # events named one (group 0 until then, and for engines that name no group): what a
        # prefix lookup is judged on. ``groups``: each group's spec, learned from its first
        # store (`KVCacheGroup`). Created at the first batch, relative to its seq.
        self.tiers: dict[Placement, BlockTable] = {}
        self.media: dict[str, BlockTable] = {}
        self.groups: dict[int, KVCacheGroup] = {}
        self.primary_group = 0
        self.hybrid = False  # see `_judge_hybrid`
        # Per-worker event facts for the metrics (the index's `anomalies`, shared by its views).
        self.counts: collections.Counter[Any] = counts if counts is not None else collections.Counter()
        self._tables: dict[tuple[str | None, int | None], tuple[bool, BlockTable]] = {}
        self._init_uncounted(re_announcements)
        self.pruned = AgedOutFilter(aged_out_horizon_s)
        self.horizon_ts: float | None = None  # records before this engine time may be gone
        self.first_ts: float | None = None
        self.first_seq = 0  # the first applied batch's seq: the residency tables count from it
        self.siblings = SiblingRegistry() if divergence_detail else None
        # Engine time since which the current run is continuous from a known-empty point (its
        # epoch start or a clear), None while it is not: lets the fleet view rule a worker
        # out in O(1) when it has no record of a block.
        self.known_empty_since: float | None = None
        self._applier = None if Applier is None else Applier(
            self._tables, self.same_step_copies, BlockStored, BlockRemoved,
            None if self.siblings is None else self.siblings.note)

    # --- applying -------------------------------------------------------------------
    # The hot path: every event of every worker passes here. Kept flat on purpose.

    def apply(self, batch: AppliedBatch) -> None:
        seq, ts = batch.seq, batch.ts
        engine_ts, self._engine_ts = self._engine_ts, ts
        if engine_ts is not None and ts < engine_ts:
            self._clock_stepped_back(ts)
        if self.last_ts is not None and ts < self.last_ts:
            ts = self.last_ts  # the log stays in order (see `clock_steps`)
        runs = self.runs
        if not runs or batch.run_start_seq != runs[-1].start_seq:
            runs.append(HistoryRun(batch))
            runs[-1].start_ts = ts
            self.known_empty_since = ts if batch.run_start is RunStart.EPOCH_START else None
        else:
            runs[-1].last_seq = seq
        self.epoch_certain = batch.epoch_certain
        if self.first_ts is None:
            self.first_ts, self.first_seq = ts, seq
        self.last_seq, self.last_ts = seq, ts
        self.log_seq.append(seq)
        self.log_ts.append(ts)
        events, applier = batch.events, self._applier
        copied = self._same_step_count() if self.hybrid else 0  # (kept only on a hybrid: no call otherwise)
        if applier is None:
            for at, event in enumerate(events):
                self._apply_event(event, seq, ts, events, at)
            self.log_removed.append(self._removed_in_python)
        else:
            # The compiled loop stops at what it leaves to Python (a clear, a first event of a
            # new medium or group, a store or removal `_apply_event` weighs); handle that one
            # here and resume after it.
            # (While stores are left uncounted, it leaves their removals to Python too.)
            applier.orphans = 1 if self.unproven else 0
            i, n = applier(events, seq, ts), len(events)
            while i < n:
                self._apply_event(events[i], seq, ts, events, i)
                applier.orphans = 1 if self.unproven else 0
                i = applier(events, seq, ts, i + 1)
            self.log_removed.append(applier.gpu_removed + self._removed_in_python)
        if self.hybrid and self._same_step_count() != copied:
            self._keep_copy_step(seq, events)

    # ``event``: BlockStored | BlockRemoved | AllBlocksCleared, dispatched on its class (Any: the checker
    # does not narrow on ``cls is``).
    def _apply_event(self, event: Any, seq: int, ts: float, batch: Sequence[Any] = (), at: int = -1) -> None:
        cls = event.__class__
        if cls is AllBlocksCleared:
            self._clear(seq, ts)
            return
        found = self._tables.get((event.medium, event.group_idx))
        if found is None:
            found = self._table(event)
            if found is None:
                self._refuse(seq)
                return
        gpu_group0, table = found
        if cls is BlockStored:
            hashes = event.block_hashes
            if not hashes:
                # No hash to keep: vLLM (0.32, `BlockPool.cache_full_blocks`) skips null blocks
                # but still sends the range's token ids when a sliding-window or Mamba group's
                # blocks there are all null. Nothing the index can hold or a lookup can name.
                self.counts[("stores_without_hashes", self.worker)] += 1
                return
            if (self.re_announcements and event.parent_block_hash is None and hashes and table.copies(hashes[-1])
                    and self._may_re_announce(event, batch, at, seq)):
                self._unproven_store(event, seq, table if gpu_group0 else None)
                return
            size = event.block_size
            if 0 < size < table.block_size and size < 1 << 32:
                # A partial-block store (fine-grained hash units). One of a hash this table
                # saw removed is vLLM #49125's shape: a stale partial hash re-registered
                # after its block was promoted. The engine serves it again, so it is applied
                # as a new store: never a revival of the interval its removal closed.
                stale = sum(1 for h in hashes if h in table and not table.copies(h))
                if stale:
                    self.counts[("stale_partial_stores", self.worker)] += stale
            if gpu_group0 and self.siblings is not None:
                self.siblings.note(event, seq)
            copies = table.store(event.block_hashes, seq)
            if copies is not None and gpu_group0:
                for key in copies:
                    self.same_step_copies[key] = seq
                self._same_step_in_python += len(copies)
        elif cls is BlockRemoved:
            hashes = event.block_hashes
            if self.unproven and hashes and not table.copies(hashes[0]):
                marks = self.unproven.get(Placement(canonical_medium(event.medium), event.group_idx or 0))
                if marks and all(h in marks and not table.copies(h) for h in hashes):
                    # The removal of a copy never counted: that store was a real copy after
                    # all. Its mark stays (absence claims since it stay open); no interval
                    # whose store predates our history is made of it.
                    self.counts[("uncounted_copies_removed", self.worker)] += len(hashes)
                    if gpu_group0:
                        self._removed_in_python += len(hashes)  # an eviction all the same
                    return
            table.remove(hashes, seq, ts)
            if gpu_group0:
                self._removed_in_python += len(event.block_hashes)

    def _refuse(self, seq: int) -> None:
        """An event of a (medium, group) past `MAX_TIERS`: not applied, counted, logged once;
        the lifetime proves nothing from this batch on until a clear (a hole of its own)."""
        refusals = self.refusals
        if not refusals or self.last_clear_between(refusals[-1], seq + 1) is not None:
            refusals.append(seq)
        self.known_empty_since = None
        self.counts[("events_refused_tiers", self.worker)] += 1
        if self.counts[("events_refused_tiers", self.worker)] == 1:
            log.warning("worker %s: an event names a (medium, KV-cache group) past the %d this engine lifetime "
                        "may have: refused (counted: kvmiss_index_events_refused_total); its history is "
                        "quarantined from that batch until a cache clear", self.worker, MAX_TIERS)

    def _table(self, event: BlockStored | BlockRemoved) -> tuple[bool, BlockTable] | None:
        """The (primary GPU table?, table) of the event's (medium, group), made on its first
        event; None past `MAX_TIERS` (refused). The group's spec is learned here from its
        first store (`_learn`); until then the entry is not cached, so the group's events keep
        coming here (a removal can come first after a mid-epoch join). Spellings of a medium
        are cached up to a bound too (more come here each time)."""
        raw_medium, raw_group = event.medium, event.group_idx
        group = raw_group or 0
        tier = Placement(canonical_medium(raw_medium), group)
        table = self.tiers.get(tier)
        if table is None:
            if len(self.tiers) >= MAX_TIERS:
                return None
            table = self.tiers[tier] = BlockTable(self.first_seq)
            if group == self.primary_group:
                self.media[tier.medium] = table
            known = self.groups.get(group)
            if known is not None and known.block_size > 0:
                table.block_size = known.block_size
        settled = raw_group is None or group in self.groups
        if event.__class__ is BlockStored and not settled:
            self._learn(event, group)
            settled = True
        found = (tier.medium == GPU and group == self.primary_group, table)
        if settled and len(self._tables) < 4 * MAX_TIERS:
            self._tables[(raw_medium, raw_group)] = found
        self._judge_hybrid()
        return found

    def _learn(self, event: BlockStored, group: int) -> None:
        """A group's spec from its first store; the first full-attention group becomes the
        primary one (and its tables ``media``)."""
        self.groups[group] = KVCacheGroup(group, event.kv_cache_spec_kind,
                                          event.kv_cache_spec_sliding_window, event.block_size)
        if 0 < event.block_size < 1 << 32:
            for tier, table in self.tiers.items():
                if tier.group == group:
                    table.block_size = event.block_size
        primary = self.groups.get(self.primary_group)
        if group != self.primary_group and self.groups[group].full_attention and (
                primary is None or not primary.full_attention):
            self.primary_group = group
            self.media = {tier.medium: table for tier, table in self.tiers.items() if tier.group == group}
            for key, (_, table) in list(self._tables.items()):
                medium, raw_group = key
                self._tables[key] = (canonical_medium(medium) == GPU and (raw_group or 0) == group, table)

    def _judge_hybrid(self) -> None:
        """``hybrid``: the events named more than one KV-cache group, or one that is not full
        attention -- prefix hits then follow `HybridKVCacheCoordinator`'s rule, not one run.
        Kept as an attribute (read per request), updated when a table or a group appears."""
        groups = self.groups
        if not groups:
            self.hybrid = False
        elif len(groups) > 1 or any(tier.group != self.primary_group for tier in self.tiers):
            self.hybrid = True
        else:
            only = next(iter(groups.values()))
            self.hybrid = only.kind is not None and not only.full_attention

    def all_tables(self) -> Iterator[BlockTable]:
        yield from self.tiers.values()

    def residency(self, group: int, keys: Iterable[int], step_seq: int) -> list[Interval | None]:
        """For each key, its latest interval on the GPU of KV-cache ``group`` whose store came
        before the lookup step (`interval_as_of` for one group, many keys in one call)."""
        table = self.tiers.get(Placement(GPU, group))
        if table is None:
            return [None for _ in keys]
        out: list[Interval | None] = []
        for key in keys:
            found = table.as_of(key, step_seq)
            if found is None:
                out.append(None)
            else:
                stored, removed, by_clear = found
                out.append(Interval(stored, self.ts_of(stored), removed, self.ts_of(removed), by_clear))
        return out

    def _clear(self, seq: int, ts: float) -> None:
        self.clears.append((seq, ts))
        self.known_empty_since = ts
        for table in self.all_tables():
            table.clear(seq, ts)

    # --- retention --------------------------------------------------------------------

    def prune(self, before_ts: float, limit: int | None = None) -> tuple[int, int | None]:
        """Drop closed intervals and log entries older than ``before_ts``; returns how many
        blocks lost records and what is left of ``limit`` (None: unlimited), the most
        retention-queue entries to take: a share of the work, the rest on the next call (0
        left: not finished; the batch log is then trimmed by the call that finishes).
        Resident intervals are never dropped (they are current). Records still held past
        ``before_ts`` are harmless: ``horizon_ts`` only says older ones may be gone."""
        cut = bisect_left(self.log_ts, before_ts)
        horizon_seq = self.log_seq[cut] if cut < len(self.log_seq) else None
        copies = self.same_step_copies  # in place: the compiled applier holds this dict
        for key in [k for k, q in copies.items() if horizon_seq is None or q < horizon_seq]:
            del copies[key]
        for key in [k for k, q in self.same_step_unproven.items() if horizon_seq is None or q < horizon_seq]:
            del self.same_step_unproven[key]
        for seq in [q for q in self.copy_steps if horizon_seq is None or q < horizon_seq]:
            del self.copy_steps[seq]
        for seq in [q for q in self.unproven_stores if horizon_seq is None or q < horizon_seq]:
            del self.unproven_stores[seq]
        for tier, marks in list(self.unproven.items()):
            old = [h for h, seqs in marks.items() if horizon_seq is None or seqs[0] < horizon_seq]
            for h in old:
                del marks[h]
            if old and self.unproven_pruned_ts is None:
                self.unproven_pruned_ts = before_ts
            self.pruned.add_many(old, before_ts)  # an absence claim that would need one answers aged out
            if not marks:
                del self.unproven[tier]  # (an empty dict would keep the view off the fast path)
        dropped = 0
        for table in self.all_tables():
            if limit == 0:
                break
            waiting = table.retained
            lost = table.prune(before_ts, horizon_seq, limit)
            if limit is not None:
                limit -= waiting - table.retained
            self.pruned.add_many(lost, before_ts)
            dropped += len(lost)
        if cut and limit != 0:
            del self.log_seq[:cut]
            del self.log_ts[:cut]
            del self.log_removed[:cut]
            self.log_base += cut
            self._trim_runs_and_clears()
        self.pruned.forget(before_ts)
        if dropped or cut:
            self.horizon_ts = before_ts if self.horizon_ts is None else max(self.horizon_ts, before_ts)
        return dropped, limit



    # --- queries ----------------------------------------------------------------------

    def interval_as_of(self, key: object, medium: str, step_seq: int) -> Interval | None:
        """The latest interval of ``key`` on ``medium`` whose store happened before the
        lookup step (a store in the lookup step happened after the lookup)."""
        table = self.media.get(medium)
        found = table.as_of(key, step_seq) if table is not None else None
        if found is None:
            return None
        stored, removed, by_clear = found
        return Interval(stored, self.ts_of(stored), removed, self.ts_of(removed), by_clear)

    def held(self, group: int, keys: Sequence[int], step_seq: int) -> list[bool]:
        """For each key, whether a counted copy of it (stored within the run of batch
        ``step_seq``, not removed in or before it) was on the GPU of ``group`` at a lookup in
        that step."""
        run = self.run_at_step(step_seq)
        if run is None:
            return [False for _ in keys]
        return [node is not None and node.stored_seq is not None and node.stored_seq >= run.start_seq
                and (node.removed_seq is None or node.removed_seq > step_seq)
                for node in self.residency(group, keys, step_seq)]

    def engine_would_hit(self, chain: Sequence[int], blocks: int, limit: int, block_size: int,
                         step_seq: int, assume_held: int | None = None,
                         also_held: dict[int, set[int]] | None = None) -> bool:
        """Whether the engine's prefix lookup in batch ``step_seq``, allowed at most ``limit``
        blocks (its lookup limit), would have hit at least ``blocks`` blocks of ``chain``, by
        its hit rule over what every GPU group provably held (`held`;
        `enricher/core/hit_rule.py`: a window group may accept a longer hit while refusing a
        shorter one). ``assume_held``: a block of ``chain`` taken as held in the primary group
        besides (a hypothesis to refute: the engine's hit only grows with what is held);
        ``also_held``: hashes per group of a hybrid taken as held besides (what its step stored
        before a copy, `stored_in_step_through`; one group needs no more than ``assume_held``). False
        whenever that is not proven: a group of a kind or block size the rule does not model."""
        limit = min(limit, len(chain))
        if blocks <= 0 or limit < blocks:
            return blocks <= 0
        if not self.hybrid:  # full attention: the leading run
            leading = self.held(self.primary_group, chain[:blocks], step_seq)
            if assume_held is not None and 0 <= assume_held < blocks:
                leading[assume_held] = True
            return all(leading)
        groups = [self.groups.get(t.group) for t in self.tiers if t.medium == GPU]
        if not all(rule_for(g, block_size).modelled for g in groups):
            return False
        held = {g.idx: self.held(g.idx, chain[:limit], step_seq) for g in groups}  # type: ignore[union-attr]
        if assume_held is not None and 0 <= assume_held < limit and self.primary_group in held:
            held[self.primary_group][assume_held] = True
        for group, hashes in (also_held or {}).items():
            if group in held:
                held[group] = [was or h in hashes for was, h in zip(held[group], chain)]
        hit, _ = hybrid_hit(groups, lambda group, i: held[group][i], limit)  # type: ignore[arg-type]
        return hit >= blocks
