"""The engine's prefix-hit rule per KV-cache group kind, and which group limits a hit.

Pure (schemas only). Written from vLLM's managers (``vllm/v1/core/single_type_kv_cache_manager.py``,
``kv_cache_coordinator.py``, 0.32):

  * full attention (`FullAttentionManager`): the leading run of cached blocks -- the hashes
    are chained, so the first missing block ends the hit;
  * sliding window (`SlidingWindowManager`): a right-to-left search for ``need = cdiv(W - 1, B)``
    contiguous cached blocks; the hit ends at the right edge of the rightmost such run. With
    no such run, a run that starts at block 0 is a hit of its own length (shorter than
    ``need``: the window then reaches back past the prompt's start);
  * a Mamba / linear-attention state group (`MambaManager`, kind ``mamba``): a right-to-left
    search for the rightmost block whose state it holds; a hit of ``p`` blocks needs only the
    state at the end of block ``p - 1`` (a window of one block). Which states it keeps (in
    cache mode "align", the prompt's last boundary below ``N - 1`` and a shared-prefix
    junction) is the stream's to say, not the rule's;
  * a hybrid (`HybridKVCacheCoordinator`): the longest length every group accepts, found by
    asking each group in turn for its longest hit not past the current candidate until none
    shortens it (full attention first).

A group *accepts* a hit of ``p`` blocks when its own rule, asked for at most ``p``, returns
``p``. The group that limited a hit is the first (full attention first, then by index) that
does not accept the next longer length the others would have allowed. EAGLE's dropped last
block and fine-grained (sub-block) hits are not modelled here: evidence answers
``unknown_history`` for them (`Evidence.unmodelled`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvmiss.schemas.attribution import FULL_ATTENTION_KINDS, WINDOW_KINDS, KVCacheGroup

Resident = Callable[[int, int], bool]  # (group index, block index) -> cached at lookup


def full_attention_hit(resident: Callable[[int], bool], max_blocks: int) -> int:
    """Blocks of the leading run of cached blocks, at most ``max_blocks``."""
    run = 0
    while run < max_blocks and resident(run):
        run += 1
    return run


def window_hit(resident: Callable[[int], bool], max_blocks: int, need: int) -> int:
    """Blocks of a sliding-window group's hit of at most ``max_blocks``: the right edge of
    the rightmost run of ``need`` contiguous cached blocks, else a run from block 0."""
    if need <= 0:
        return max_blocks
    contiguous = 0
    for i in range(max_blocks - 1, -1, -1):
        if resident(i):
            contiguous += 1
            if contiguous >= need:
                return i + need
        else:
            contiguous = 0
    return contiguous  # the run that reached block 0 (all of it, when every block is cached)


def window_needed(hit_blocks: int, need: int) -> range:
    """The blocks a window group needs cached to accept a hit of ``hit_blocks`` blocks."""
    return range(max(0, hit_blocks - need), hit_blocks)


# vLLM's KVCacheSpecKind values: the only wire strings a reason may repeat (others could
# carry anything).
KNOWN_KINDS = frozenset({
    "full_attention", "mla_attention", "sliding_window", "sliding_window_mla", "mamba",
    "chunked_local_attention", "sink_full_attention", "encoder_only_attention", "cross_attention",
    "unknown",
})


def kind_name(group: KVCacheGroup | None) -> str:
    """A group's kind as a reason may show it."""
    if group is None or group.kind is None:
        return "an unannounced kind"
    return group.kind if group.kind in KNOWN_KINDS else "a kind this release does not know"


class GroupRule:
    """How one KV-cache group decides a hit, as vLLM's per-kind manager does. ``modelled``
    False: kvmiss does not know the rule (``reason`` says which group), and no label may rest
    on it."""

    modelled = True
    reason: str | None = None
    keeps_state = False  # a Mamba / linear-attention state group (its verdicts say so)

    def hit(self, resident: Callable[[int], bool], max_blocks: int) -> int:
        """Blocks of the group's longest hit of at most ``max_blocks``."""
        raise NotImplementedError

    def needed(self, hit_blocks: int) -> range:
        """The blocks the group needs cached to accept a hit of ``hit_blocks`` blocks."""
        raise NotImplementedError


class FullAttentionRule(GroupRule):
    def hit(self, resident: Callable[[int], bool], max_blocks: int) -> int:
        return full_attention_hit(resident, max_blocks)

    def needed(self, hit_blocks: int) -> range:
        return range(hit_blocks)


class SlidingWindowRule(GroupRule):
    def __init__(self, need: int):
        self.need = need  # contiguous blocks a hit needs: cdiv(W - 1, B)

    def hit(self, resident: Callable[[int], bool], max_blocks: int) -> int:
        return window_hit(resident, max_blocks, self.need)

    def needed(self, hit_blocks: int) -> range:
        return window_needed(hit_blocks, self.need)


class StateRule(GroupRule):
    """A Mamba / linear-attention group: one state per block boundary, no window behind it.
    vLLM's `MambaManager.find_longest_cache_hit` (0.32, block = hash block = scheduler block)
    returns ``i + 1`` blocks for the rightmost ``i`` below the bound whose state is cached."""

    keeps_state = True

    def hit(self, resident: Callable[[int], bool], max_blocks: int) -> int:
        return window_hit(resident, max_blocks, 1)

    def needed(self, hit_blocks: int) -> range:
        return window_needed(hit_blocks, 1)


class UnmodelledRule(GroupRule):
    modelled = False

    def __init__(self, reason: str):
        self.reason = reason

    def hit(self, resident: Callable[[int], bool], max_blocks: int) -> int:
        raise ValueError(f"the hit rule of {self.reason} is not modelled")

    def needed(self, hit_blocks: int) -> range:
        raise ValueError(f"the hit rule of {self.reason} is not modelled")


def _window_rule(group: KVCacheGroup) -> GroupRule:
    need = group.window_blocks
    return SlidingWindowRule(need) if need is not None else UnmodelledRule(f"a {kind_name(group)} group")


# Kind -> the rule's maker: adding a kind means one class and one entry here.
RULES: dict[str, Callable[[KVCacheGroup], GroupRule]] = {
    **{kind: (lambda group: FullAttentionRule()) for kind in FULL_ATTENTION_KINDS},
    **{kind: _window_rule for kind in WINDOW_KINDS},
    "mamba": lambda group: StateRule(),
}


def rule_for(group: KVCacheGroup | None, block_size: int | None = None) -> GroupRule:
    """The group's rule; unmodelled for a kind without one, and (``block_size`` given) for a
    group hashed in other blocks than the request (H may sit inside one of them)."""
    make = RULES.get(group.kind) if group is not None and group.kind is not None else None
    # (``make`` is found only for a group, so ``group`` is not None where it is read below)
    rule = make(group) if make is not None else UnmodelledRule(f"a {kind_name(group)} group")  # type: ignore[arg-type]
    if rule.modelled and block_size is not None and group.block_size != block_size:  # type: ignore[union-attr]
        return UnmodelledRule(f"groups of block size {group.block_size} for requests hashed in blocks of {block_size}")  # type: ignore[union-attr]
    return rule


def group_hit(group: KVCacheGroup, resident: Callable[[int], bool], max_blocks: int) -> int:
    """One group's longest hit of at most ``max_blocks`` blocks (a modelled kind only)."""
    return rule_for(group).hit(resident, max_blocks)


def ordered(groups: Sequence[KVCacheGroup]) -> list[KVCacheGroup]:
    """The order the engine asks its groups in: full attention first, then by index."""
    return sorted(groups, key=lambda g: (not g.full_attention, g.idx))


def hybrid_hit(groups: Sequence[KVCacheGroup], resident: Resident, max_blocks: int) -> tuple[int, int | None]:
    """(blocks of the hit every group accepts, the group that limited it). The limiting group
    is None when nothing did (the hit is ``max_blocks``, the lookup limit). Every group must
    be of a modelled kind and of the request's block size."""
    order = ordered(groups)
    hit, limiting = max_blocks, None
    while True:
        start = hit
        for group in order:
            found = group_hit(group, lambda i, g=group.idx: resident(g, i), hit)  # type: ignore[misc]
            if found < hit:
                hit, limiting = found, group.idx
        if hit >= start:
            return hit, limiting
