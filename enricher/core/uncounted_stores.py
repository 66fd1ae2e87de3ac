"""Stores kvmiss does not count as copies until the request they were for says so: vLLM's
full report mode re-announces a reused chain as a store with no parent, on the wire the same as
a recomputed second copy (docs/HISTORY.md). Their marks, their confirmation, and the engine steps
that stored one block twice. A part of `EpochResidency`, whose state it reads.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from kvmiss.collectors.engines import canonical_medium
from kvmiss.enricher.core.hit_rule import window_needed
from kvmiss.enricher.core.residency_table import BlockTable
from kvmiss.enricher.core.residency_types import GPU, Placement
from kvmiss.schemas.attribution import KVCacheGroup
from kvmiss.schemas.events import BlockStored

if TYPE_CHECKING:
    from kvmiss.enricher.core.aged_out import AgedOutFilter

# The most batches a view keeps in order for their same-step copies (`EpochResidency.copy_steps`):
# ~1-2 KB each, so a few MB per hybrid worker at most however long its retention.
MAX_COPY_STEPS = 2048


class UncountedStores:
    """The uncounted-store bookkeeping (state: ``unproven``, ``copy_steps`` and the marks'
    counters, set by `EpochResidency.__init__`)."""

    # Declared for the type checker only (no values: `EpochResidency.__init__` sets them).
    worker: str
    counts: collections.Counter[Any]
    tiers: dict[Placement, BlockTable]
    groups: dict[int, KVCacheGroup]
    primary_group: int
    unproven: dict[Placement, dict[int, list[int]]]
    unproven_stores: dict[int, list[tuple[Placement, tuple[int, ...]]]]
    unproven_pruned_ts: float | None
    _window_checks: dict[int, bool]
    _window_checks_seq: int | None
    pruned: AgedOutFilter
    known_empty_since: float | None
    same_step_copies: dict[object, int]
    same_step_unproven: dict[object, int]
    copy_steps: dict[int, Sequence[Any]]
    _same_step_in_python: int
    _applier: Any  # the compiled `Applier`, or None

    def _init_uncounted(self, re_announcements: bool) -> None:
        """The bookkeeping's state, empty (called by `EpochResidency.__init__`)."""
        # Stores not counted as copies (ATTRIBUTION.md rule 7): a BlockStored with no parent
        # whose last block was already resident is vLLM's `kv_cache_report_mode: "full"`
        # re-announcement of a reused chain -- or a recomputed duplicate, which looks the
        # same. Placement -> hash -> the seqs of such stores, one entry each, ascending. Counts stay
        # a lower bound (a resident claim stands); an absence claim after one is not proven --
        # until the request it re-announced for confirms it (`confirm_re_announcement`).
        # Pruned with the log.
        self.unproven = {}
        # The same stores as events: seq -> [(tier, hashes)], for `confirm_re_announcement`.
        self.unproven_stores = {}
        # The engine time of the first prune that dropped such marks (None: none yet): from
        # then on a block may be held by a store the view no longer remembers (`_tail_readable`).
        self.unproven_pruned_ts = None
        # A window group's parentless stores of the batch being applied, by index: whether
        # each may have been a re-announcement (`_may_re_announce`).
        self._window_checks = {}
        self._window_checks_seq = None
        # False: the deployment promises no request re-announces ([history] kv_cache_report_mode
        # = "incremental"), so a store with no parent re-storing a resident chain is a copy.
        self.re_announcements = re_announcements
        # Blocks stored twice in one engine step (GPU): a request that skips the prefix
        # cache (prompt logprobs) can store a block *before* another request's lookup in the
        # same step, so for those the "stores in the lookup step come after it" rule fails.
        # Rare; pruned with the log.
        self.same_step_copies = {}
        # The same, where the second store was one not counted (`_unproven_store`): a
        # re-announcement by a request that hit the block -- stored earlier in the step, which
        # proves nothing against the rule -- or a duplicate. Gone when its request confirms it.
        self.same_step_unproven = {}
        # The events of those batches on a hybrid (seq -> events, in the engine's order), pruned
        # with them and bounded: what was stored in the step before a copy tells whether the
        # engine would have hit the block had that copy preceded the lookup
        # (`stored_in_step_through`).
        self.copy_steps = {}
        self._same_step_in_python = 0  # same-step copies recorded by `_apply_event`

    def _same_step_count(self) -> int:
        """Same-step copies recorded so far, by the compiled applier and by `_apply_event`."""
        applier = self._applier
        return self._same_step_in_python + (applier.same_step_stores if applier is not None else 0)

    def _keep_copy_step(self, seq: int, events: Sequence[Any]) -> None:
        """`copy_steps`, at most `MAX_COPY_STEPS` (the oldest go first: a step whose order is
        gone keeps its doubt)."""
        steps = self.copy_steps
        steps[seq] = events
        if len(steps) > MAX_COPY_STEPS:
            del steps[next(iter(steps))]

    def _unproven_store(self, event: BlockStored, seq: int, primary: BlockTable | None) -> None:
        """A possible re-announcement (see ``unproven``): nothing is stored, every block of
        it is marked, and it is counted. On the primary GPU table a block stored earlier in
        the same step is a same-step copy all the same (a request that skips the cache)."""
        tier = Placement(canonical_medium(event.medium), event.group_idx or 0)
        marks = self.unproven.setdefault(tier, {})
        self.unproven_stores.setdefault(seq, []).append((tier, tuple(event.block_hashes)))
        for h in event.block_hashes:
            marks.setdefault(h, []).append(seq)
            if primary is not None:
                found = primary.as_of(h, seq + 1)
                if found is not None and found[0] == seq and found[1] is None:
                    self.same_step_unproven[h] = seq
                    self._same_step_in_python += 1
        self.counts[("re_announced_stores", self.worker)] += 1
        self.counts[("re_announced_blocks", self.worker)] += len(event.block_hashes)

    def _may_re_announce(self, event: BlockStored, batch: Sequence[Any], at: int, seq: int) -> bool:
        """Whether a store with no parent re-storing a resident chain (``batch[at]``) may be a
        re-announcement. vLLM re-announces a reused chain in one call, group by group in group
        order (`KVCacheCoordinator.emit_cached_block_events`), every group with the same hashes
        (one block size) and parentless -- and a sliding-window group only re-announces a chain
        whose last ``cdiv(W - 1, B)`` blocks it held (what its hit needed). So:

          * a window group's store is a re-announcement only beside the full-attention group's
            store of the same chain, and only if the group held that tail; else it is the
            group's own store (a window stores its blocks with no parent too);
          * a full-attention store is one only if each window group's event of the call --
            the nearest of that group in the run of such stores around it -- may be one too.
            A recompute after a `window_limit` miss re-stores the full-attention chain with no
            parent, but its window store is of a tail the group did not hold: a real copy.

        The tail is read only while the view's history is whole (`_tail_readable`)."""
        group = event.group_idx or 0
        primary = self.groups.get(self.primary_group)
        if primary is None or not primary.full_attention:
            return True
        hashes = event.block_hashes
        if group != self.primary_group:
            if not any(e.__class__ is BlockStored and (e.group_idx or 0) == self.primary_group
                       and e.parent_block_hash is None and e.block_hashes == hashes for e in batch):
                return False
            spec = self.groups.get(group)
            if spec is None or spec.window_blocks is None or not self._tail_readable():
                return True
            held = self._window_tail_held(group, event.medium, hashes, spec.window_blocks)
            if self._window_checks_seq != seq:
                self._window_checks_seq = seq
                self._window_checks.clear()
            self._window_checks[at] = held
            return held
        if at < 0 or canonical_medium(event.medium) != GPU or not self._tail_readable():
            return True
        for spec in self.groups.values():
            if spec.idx != group and spec.window_blocks is not None and spec.block_size == primary.block_size:
                if not self._window_call_may_re_announce(spec, batch, at, seq, hashes):
                    return False
        return True

    def _window_call_may_re_announce(self, spec: KVCacheGroup, batch: Sequence[Any], at: int, seq: int,
                                     hashes: list[int]) -> bool:
        """Whether window group ``spec``'s event in the re-announcement call ``batch[at]`` would
        belong to may be a re-announcement: the nearest event of that group in the run of
        parentless stores of the same chain around ``at`` -- before it when the group comes
        first, after it otherwise -- exists and the group held the chain's tail at it."""
        step = -1 if spec.idx < (batch[at].group_idx or 0) else 1
        i = at + step
        while 0 <= i < len(batch):
            e = batch[i]
            if e.__class__ is not BlockStored or e.parent_block_hash is not None or e.block_hashes != hashes:
                return False  # the run ended without the group's event: no call covered it
            if (e.group_idx or 0) == spec.idx:
                if step < 0:  # applied already: as it was judged (unjudged: its last block was not held)
                    return self._window_checks_seq == seq and self._window_checks.get(i, False)
                # Still to come: between here and there only other groups' stores, so the
                # group's table is as it will be at its event.
                # (window_blocks: not None, the caller's condition for asking)
                return self._window_tail_held(spec.idx, e.medium, hashes, cast(int, spec.window_blocks))
            i += step
        return False

    def _window_tail_held(self, group: int, medium: str | None, hashes: list[int], need: int) -> bool:
        """Whether a window group may have held, now, the blocks its hit of the chain
        ``hashes`` needed -- counted, or stored by a store not counted (`unproven`), or aged
        out of the records (`pruned`)."""
        tier = Placement(canonical_medium(medium), group)
        table = self.tiers.get(tier)
        marks = self.unproven.get(tier, {})
        for i in window_needed(len(hashes), need):
            h = hashes[i]
            if not (table is not None and table.copies(h)) and h not in marks and not (
                    self.unproven_pruned_ts is not None and h in self.pruned):
                return False
        return True

    def _tail_readable(self) -> bool:
        """Whether a block with no copy and no mark was surely not held: the run is whole
        from a known-empty point (epoch start or a clear) and no store left uncounted has been
        forgotten by the aged-out filter."""
        if self.known_empty_since is None:
            return False
        since, forgotten = self.unproven_pruned_ts, self.pruned.forgotten_through
        return since is None or forgotten is None or forgotten < since

    def unproven_before(self, group: int, key: int, seq: int, medium: str = GPU) -> bool:
        """Whether a store of ``key`` not counted as a copy (see ``unproven``) came before
        batch ``seq`` on ``medium`` of ``group``."""
        marks = self.unproven.get(Placement(medium, group))
        seqs = marks.get(key) if marks else None
        return seqs is not None and seqs[0] < seq

    def confirm_re_announcement(self, hashes: list[int], from_seq: int | None = None,
                                to_seq: int | None = None) -> int:
        """A request in full report mode hit exactly ``hashes`` (its first C / B blocks): one
        store with no parent of exactly that chain, the first not yet told apart in or after
        batch ``from_seq`` (its lookup step, or the earliest it can have been; None: not known)
        and not after ``to_seq`` (the latest it can have been), was its re-announcement -- no
        copy: a request that hit a block did not recompute it. That store goes in each tier
        (another one alike stays open: a duplicate for all anyone knows); a store of a longer
        or another chain -- a request that recomputed its prompt -- is never taken for it.
        Returns how many blocks' marks went."""
        chain = tuple(hashes)
        found = [seq for seq, stores in self.unproven_stores.items()
                 if (from_seq is None or seq >= from_seq) and (to_seq is None or seq <= to_seq)
                 and any(stored == chain for _, stored in stores)]
        if not found:
            return 0
        step_seq = min(found)
        stores = self.unproven_stores[step_seq]
        gone, done = 0, set()
        for i in range(len(stores) - 1, -1, -1):
            tier, stored = stores[i]
            if stored != chain or tier in done:
                continue
            done.add(tier)
            del stores[i]
            marks = self.unproven.get(tier, {})
            for h in stored:
                seqs = marks.get(h)
                if seqs and step_seq in seqs:
                    seqs.remove(step_seq)
                    gone += 1
                    if not seqs:
                        del marks[h]
            if not marks:
                self.unproven.pop(tier, None)
        still_open = {h for _, stored in stores for h in stored}
        for h in chain:
            if self.same_step_unproven.get(h) == step_seq and h not in still_open:
                del self.same_step_unproven[h]  # that second store was its re-announcement
        if not stores:
            del self.unproven_stores[step_seq]
        return gone

    def copied_in_step(self, key: object, step_seq: int) -> bool:
        """Whether ``key`` was stored twice on the primary GPU table in batch ``step_seq``
        (`same_step_copies`, or a second store not yet told apart: `same_step_unproven`)."""
        return self.same_step_copies.get(key) == step_seq or self.same_step_unproven.get(key) == step_seq

    def stored_in_step_through(self, step_seq: int, key: int) -> dict[int, set[int]] | None:
        """What batch ``step_seq`` stored on the GPU, per group, up to and including its first
        store of ``key`` in the primary group: held at any lookup after that store in the step
        (blocks a running request just stored are pinned; nothing in the step evicts them).
        None when the batch's order was not kept (`copy_steps`) or it never stored ``key``."""
        events = self.copy_steps.get(step_seq)
        if events is None:
            return None
        stored: dict[int, set[int]] = {}
        for event in events:
            if event.__class__ is not BlockStored or canonical_medium(event.medium) != GPU:
                continue
            group = event.group_idx or 0
            stored.setdefault(group, set()).update(event.block_hashes)
            if group == self.primary_group and key in event.block_hashes:
                return stored
        return None
