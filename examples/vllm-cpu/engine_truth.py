"""The truth of each request, from the engine's own gap-free event stream: which blocks each
KV-cache group held when the request was looked up, the cached tokens vLLM's hit rule gives from
them, and the label that follows. Plain Python over plain msgpack-decoded events -- none of
kvmiss's code -- so it can judge kvmiss.

The hit rule is vLLM's (0.32/0.33, ``HybridKVCacheCoordinator.find_longest_cache_hit``): the
full-attention group's leading run of cached blocks, up to ``(N - 1) // B``; then each
sliding-window group keeps the longest length ``p`` at or below it whose last
``cdiv(W - 1, B)`` blocks it holds (``SlidingWindowManager``'s right-to-left search; a run of
fewer blocks reaching block 0 also counts), and each Mamba / linear-attention state group
(kind ``mamba``, blocks of ``B`` tokens) the longest whose last block's state it holds
(``MambaManager``'s right-to-left search: a window of one block), repeated until no group
shortens it. The prediction is checked against the cached tokens the engine reported; a
request whose prediction fails is reported, never judged. A group whose rule is not modelled
(another kind, or a state group of another block size) is judged only where the
full-attention group itself ended the hit; where that group held the first missed block, the
truth is an ``unknown_history`` naming the kind.

Where the request's lookup sits cannot be seen on the wire: a step's events share one batch,
and with concurrent traffic several steps may store its first missed block while it is in
flight. Every placement is tried (each such step; the step's removals before or after the
lookup; the step's stores of the blocks it hit, made by requests scheduled before it, or not),
and only those that predict the engine's count are kept. When they disagree on the label, the
request is *ambiguous*: excluded and counted.

``kv_cache_report_mode: "full"`` re-announces a request's reused chain as a ``BlockStored``
with no parent (``BlockPool.emit_cached_block_events``): those events are not new copies and
are skipped, recognised by the request they belong to.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

# The batch of a request's lookup step is published when the step is scheduled, before the
# forward pass; the client has its answer after it. Measured on the runs in RESULTS: the batch
# arrived at most 16 ms after the answer (the subscriber's thread on a loaded box).
SLACK_S = 0.1
FULL_KINDS = {"full_attention", "mla_attention", "sink_full_attention", None}
WINDOW_KINDS = {"sliding_window", "sliding_window_mla"}
STATE_KINDS = {"mamba"}  # one state per block boundary: a hit needs its last block's state


@dataclass
class Group:
    idx: int
    kind: str | None = None
    window: int | None = None
    block_size: int | None = None

    def window_blocks(self, block: int) -> int | None:
        if self.kind in STATE_KINDS:
            return 1 if (self.block_size or block) == block else None
        if self.kind not in WINDOW_KINDS or not self.window:
            return None
        return -(-(self.window - 1) // (self.block_size or block))


@dataclass
class Lookup:
    """One request as the oracle needs it (client clock = the receive clock of the batches)."""

    key: str
    chain: list[int]  # full-block hashes as uint64
    prompt_tokens: int
    cached: int  # the engine's own count (API usage.prompt_tokens_details.cached_tokens)
    sent_at: float
    done_at: float
    full_report: bool = False


@dataclass
class Truth:
    label: str | None = None  # None: not judged (see ``excluded``)
    excluded: str | None = None  # why not judged: ambiguous, no_store_seen, oracle_mismatch
    predicted: int | None = None  # cached tokens by the hit rule on the stream
    step: int | None = None  # index of the lookup's batch in the recorded stream
    limiting_group: int | None = None
    reading: str | None = None  # which reading of the step decided (removals before / after)
    detail: dict = field(default_factory=dict)


def _field(event, name: str, position: int | None = None, default=None):
    if isinstance(event, dict):
        return event.get(name, default)
    if position is not None and len(event) > position:
        return event[position]
    return default


def kind_of(event) -> str:
    return event["type"] if isinstance(event, dict) else event[0]


def hashes_of(event) -> list[int]:
    return [h & (2**64 - 1) for h in (_field(event, "block_hashes", 1) or [])]


def group_of(event) -> int:
    return _field(event, "group_idx") or 0


class Stream:
    """The recorded batches ``(seq, receive time, events)`` and what they say about groups."""

    def __init__(self, batches: list[tuple[int, float, list]], block: int):
        self.batches, self.block = batches, block
        self.groups: dict[int, Group] = {}
        for _, _, events in batches:
            for e in events:
                if kind_of(e) == "BlockStored":
                    g = self.groups.setdefault(group_of(e), Group(group_of(e)))
                    g.kind = _field(e, "kv_cache_spec_kind") or g.kind
                    g.window = _field(e, "kv_cache_spec_sliding_window") or g.window
                    g.block_size = _field(e, "block_size", 4) or g.block_size
        if not self.groups:
            self.groups[0] = Group(0, "full_attention")
        fulls = [g.idx for g in self.groups.values() if g.kind in FULL_KINDS]
        self.full = min(fulls) if fulls else None
        self.unmodelled = sorted({g.kind or "?" for g in self.groups.values()
                                  if g.kind not in FULL_KINDS and g.kind not in WINDOW_KINDS
                                  and g.window_blocks(block) is None})
        self.skipped: set[tuple[int, int]] = set()  # (batch index, event index) re-announcements
        self.holders: collections.Counter = collections.Counter()  # hash -> requests whose chain has it

    def note_lookups(self, lookups: list[Lookup]) -> None:
        """Which hashes only one request of the run could store (``judge`` then knows that every
        store of its first missed block is its own: the first is its lookup, later ones are
        recomputations after a preemption, which vLLM does not count again)."""
        for lk in lookups:
            self.holders.update(set(lk.chain))

    def mark_re_announcements(self, lookups: list[Lookup], slack_s: float = SLACK_S) -> int:
        """Skip the full-report re-announcements: a parentless store of exactly
        ``chain[:cached / B]`` of a full-report request in flight, every block of which the
        request hit in its group is already held there when the event comes (in the engine's
        order: a block the request hit was resident and pinned). A parentless store of blocks
        not all held is a real one -- e.g. the first computation, in the same batch, of the
        blocks a concurrent repeat then hit and re-announced. vLLM re-announces the whole
        chain in every group (``KVCacheCoordinator.emit_cached_block_events``: one event per
        group, ``len(group_blocks)`` hashes from block 0), but a sliding-window group hit only
        the last ``cdiv(W - 1, B)`` of them and a state group only the last one (the rest are
        its null blocks): only those must be held there."""
        wanted: dict[tuple, list[Lookup]] = collections.defaultdict(list)
        for lk in lookups:
            if lk.full_report and lk.cached >= self.block:
                wanted[tuple(lk.chain[:lk.cached // self.block])].append(lk)
        copies: collections.Counter = collections.Counter()
        for i, (_, recv, events) in enumerate(self.batches):
            for j, e in enumerate(events):
                kind = kind_of(e)
                if kind == "AllBlocksCleared":
                    copies.clear()
                elif kind == "BlockRemoved":
                    for h in hashes_of(e):
                        copies[(group_of(e), h)] = max(0, copies[(group_of(e), h)] - 1)
                elif kind == "BlockStored":
                    hashes, g = hashes_of(e), group_of(e)
                    need = self.groups[g].window_blocks(self.block) if g in self.groups else None
                    hit = hashes[-need:] if need else hashes
                    if (_field(e, "parent_block_hash", 2) is None and all(copies[(g, h)] > 0 for h in hit)
                            and any(lk.sent_at <= recv <= lk.done_at + slack_s for lk in wanted.get(tuple(hashes), ()))):
                        self.skipped.add((i, j))
                        continue
                    for h in hashes:
                        copies[(g, h)] += 1
        return len(self.skipped)

    def state(self, upto: int, step_removals: bool, step_stores: set[int] = frozenset(),
              step_full_stores: set[int] = frozenset()) -> tuple[collections.Counter, set]:
        """Copies per (group, hash) and every (group, hash) ever stored, after batches
        ``[0, upto)``, plus, from batch ``upto``, its removals when ``step_removals``, its
        stores of the hashes in ``step_stores`` (every group) and of those in
        ``step_full_stores`` (the full-attention group only)."""
        copies: collections.Counter = collections.Counter()
        ever: set = set()
        for i, (_, _, events) in enumerate(self.batches[:upto + 1]):
            in_step = i == upto
            for j, e in enumerate(events):
                kind = kind_of(e)
                if kind == "AllBlocksCleared" and not in_step:
                    copies.clear()
                elif kind == "BlockStored" and (i, j) not in self.skipped:
                    full_here = group_of(e) == (self.full if self.full is not None else 0)
                    for h in hashes_of(e):
                        if not in_step or h in step_stores or (full_here and h in step_full_stores):
                            copies[(group_of(e), h)] += 1
                            ever.add((group_of(e), h))
                elif kind == "BlockRemoved" and (not in_step or step_removals):
                    for h in hashes_of(e):
                        key = (group_of(e), h)
                        copies[key] = max(0, copies[key] - 1)
        return copies, ever

    def hit(self, chain: list[int], max_blocks: int, copies) -> tuple[int, int, int | None]:
        """(hit blocks, the full-attention run, the group that cut the hit below that run)."""
        held = {g: (lambda i, g=g: copies[(g, chain[i])] > 0) for g in self.groups}
        full = self.full if self.full is not None else 0
        run = 0
        while run < max_blocks and held[full](run):
            run += 1
        p, limiting = run, None
        changed = True
        while changed:
            changed = False
            for g in self.groups.values():
                need = g.window_blocks(self.block)
                if need is None:
                    continue
                q = p
                while q > 0 and not all(held[g.idx](i) for i in range(max(0, q - need), q)):
                    q -= 1
                if q < p:
                    p, limiting, changed = q, g.idx, True
        return p, run, limiting

    def label(self, lk: Lookup, copies, ever) -> tuple[str, int, int | None, dict]:
        n, b = lk.prompt_tokens, self.block
        max_blocks = (n - 1) // b
        p, run, limiting = self.hit(lk.chain, max_blocks, copies)
        k = lk.cached // b
        full = self.full if self.full is not None else 0
        if self.unmodelled and run > k:
            # The full-attention group held the first missed block: a group whose rule is
            # not modelled (Mamba state) cut the hit. The honest answer names that kind; the
            # engine's own count stands for the prediction (the rule cannot check it).
            return "unknown_history", lk.cached, None, {"unmodelled": self.unmodelled, "full_run_blocks": run}
        if self.unmodelled and run == k:
            p = k  # the full-attention group alone ended the hit here, whatever the others hold
        if limiting is None or run == k:  # the full-attention group ended the run at the first miss
            key = (full, lk.chain[k])
            label = "resident_miss" if copies[key] > 0 else "evicted" if key in ever else "no_match"
            return label, p * b, full if run == k else None, {"first_miss_block": k}
        g = self.groups[limiting]
        need = g.window_blocks(b)
        missing = [i for i in range(max(0, run - need), run) if copies[(limiting, lk.chain[i])] == 0]
        removed = [i for i in missing if (limiting, lk.chain[i]) in ever]
        label = "evicted" if removed else "window_limit"
        return label, p * b, limiting, {"full_run_blocks": run, "window_missing": missing, "window_removed": removed}

    def judge(self, lk: Lookup, slack_s: float = SLACK_S) -> Truth:
        """The label every placement of the lookup consistent with the engine's count agrees on.

        A placement is a candidate step (one that stored the first missed block in the
        full-attention group while the request was in flight) and a reading of that step: its
        removals before or after the lookup, its stores of the blocks the request hit made
        by requests scheduled before it in the step, or not, and -- where the step stored the
        first missed block twice -- one copy of it in the full-attention group before the
        lookup, or not. Placements whose predicted cached tokens differ from the engine's are
        impossible and dropped."""
        n, b, c = lk.prompt_tokens, self.block, lk.cached
        limit = (n - 1) // b * b
        if c >= limit:
            return Truth(label="lookup_limit" if n % b == 0 and n >= b and c == limit else "hit")
        h = lk.chain[c // b]
        full = self.full if self.full is not None else 0
        steps = [i for i, (_, recv, events) in enumerate(self.batches)
                 if lk.sent_at <= recv <= lk.done_at + slack_s
                 and any(kind_of(e) == "BlockStored" and group_of(e) == full and h in hashes_of(e)
                         and (i, j) not in self.skipped for j, e in enumerate(events))]
        if not steps:
            return Truth(excluded="no_store_seen")
        if self.holders[h] == 1:
            steps = steps[:1]
        hit_prefix = set(lk.chain[:c // b])
        consistent, predicted = [], []
        for step in steps:
            # Two stores of the first missed block in the step: one may be another request's,
            # scheduled first (the lookup then saw it held in the full-attention group, and on a
            # hybrid a window group may still have cut the hit). Tried with that copy alone.
            copies_of_h = sum(1 for j, e in enumerate(self.batches[step][2]) if kind_of(e) == "BlockStored"
                              and group_of(e) == full and h in hashes_of(e) and (step, j) not in self.skipped)
            missed = (frozenset(), frozenset({h})) if copies_of_h >= 2 else (frozenset(),)
            for removals in (True, False):
                for stores in (frozenset(), hit_prefix):
                    for first in missed:
                        copies, ever = self.state(step, removals, stores, first)
                        label, tokens, limiting, detail = self.label(lk, copies, ever)
                        predicted.append(tokens)
                        if tokens == c:
                            reading = ("removals_before" if removals else "removals_after") + (
                                "+earlier_stores" if stores else "") + ("+earlier_copy_of_miss" if first else "")
                            consistent.append((label, step, limiting, reading, detail))
        if not consistent:
            return Truth(excluded="oracle_mismatch", predicted=predicted[0], step=steps[0],
                         detail={"steps": steps, "predicted": sorted(set(predicted))})
        labels = {x[0] for x in consistent}
        if len(labels) > 1:
            return Truth(excluded="ambiguous: placements consistent with the engine's count disagree", predicted=c,
                         detail={"labels": sorted(labels), "steps": sorted({x[1] for x in consistent})})
        label, step, limiting, reading, detail = consistent[0]
        return Truth(label=label, predicted=c, step=step, limiting_group=limiting, reading=reading,
                     detail={**detail, "placements": len(consistent)})
