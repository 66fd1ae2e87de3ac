"""A request's geometry: what its token counts and the block size say before any history.

One home for the arithmetic every layer needs -- the lookup limit, the first missed block, the
blocks a hit covers -- so that the verdict, the evidence, the pipeline's wait, the vLLM plugin
and the estimates cannot drift apart.
"""

from __future__ import annotations


def lookup_limit_tokens(prompt_tokens: int, block_size: int) -> int:
    """L: the most prompt tokens the engine can serve from cache, whole blocks within ``N - 1``.

    The last prompt token is always recomputed (its logits are needed), so a prompt of exactly
    ``k`` blocks can hit at most ``k - 1`` of them. 0 for an empty prompt."""
    if prompt_tokens <= 0:
        return 0
    return (prompt_tokens - 1) // block_size * block_size


def lookup_limit_blocks(prompt_tokens: int, block_size: int) -> int:
    """L in blocks: how many leading blocks a lookup may hit at most."""
    return lookup_limit_tokens(prompt_tokens, block_size) // block_size


def first_miss_index(cached_tokens: int, block_size: int) -> int:
    """The index of the first block the engine did not serve from cache: ``C // B``."""
    return cached_tokens // block_size


def max_cache_hit_tokens(prompt_tokens: int, block_size: int, cached_blocks: int) -> int:
    """Tokens vLLM reports as cached when the first ``cached_blocks`` blocks are resident.

    Full-attention models only; ignores the EAGLE/MTP rule that drops the last matched block."""
    return min(cached_blocks * block_size, lookup_limit_tokens(prompt_tokens, block_size))


def missed_reusable(prompt_tokens: int, cached_tokens: int, block_size: int) -> bool:
    """Whether the request missed a reusable block (C < L): only then is there a first-miss
    block for the index to judge (``hit`` and ``lookup_limit`` need no index)."""
    return block_size > 0 and cached_tokens < lookup_limit_tokens(prompt_tokens, block_size)
