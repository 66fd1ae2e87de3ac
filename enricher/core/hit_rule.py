"""The engine's prefix-hit rule per KV-cache group kind, and which group limits a hit.

Pure (schemas only). Written from vLLM's managers (``vllm/v1/core/single_type_kv_cache_manager.py``,
``kv_cache_coordinator.py``, 0.32):

  * full attention (`FullAttentionManager`): the leading run of cached blocks -- the hashes
    are chained, so the first missing block ends the hit;
  * sliding window (`SlidingWindowManager`): a right-to-left search for ``need = cdiv(W - 1, B)``
    contiguous cached blocks; the hit ends at the right edge of the rightmost such run. With
    no such run, a run that starts at block 0 is a hit of its own length (shorter than
    ``need``: the window then reaches back past the prompt's start);
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

from kvmiss.schemas.attribution import KVCacheGroup

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


def group_hit(group: KVCacheGroup, resident: Callable[[int], bool], max_blocks: int) -> int:
    """One group's longest hit of at most ``max_blocks`` blocks (a modelled kind only)."""
    if group.full_attention:
        return full_attention_hit(resident, max_blocks)
    need = group.window_blocks
    if need is None:
        raise ValueError(f"the hit rule of KV-cache group kind {group.kind!r} is not modelled")
    return window_hit(resident, max_blocks, need)


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
            found = group_hit(group, lambda i, g=group.idx: resident(g, i), hit)
            if found < hit:
                hit, limiting = found, group.idx
        if hit >= start:
            return hit, limiting
