"""What-if cache sizing: how much of each worker's prompts a larger prefix-cache pool would
have served. An *estimate*, kept apart from the proofs: nothing here reads or changes a
verdict, and its output never names a label.

The model replays one worker's requests through a pool that behaves as vLLM's block pool
does (shared/reference/WHATIF.md, checked against vLLM's own ``BlockPool`` in
benchmarks/whatif_vllm_pool.py):

* blocks are taken from the head of a free queue; a taken block that still holds a cached
  hash is evicted (least recently *freed* first);
* at admission (the lookup time) the request's cached prefix is the longest run of its
  chain whose hashes the pool holds, capped by the lookup limit; those blocks are touched
  (in use, out of the free queue) and the rest of the prompt and its output are allocated;
  its full prompt blocks are cached then, its full output blocks (their hashes from the
  worker's ``BlockStored`` parent links) as they fill;
* at finish every block is freed, tail first: a block caching a hash to the end of the free
  queue (a chain's tail is evicted before its head), a block without one (a partial last
  block) to its front, to be reused first. Blocks in use are never evicted.

Where the recorded pool ran so full that requests must have waited for admission, a bigger
pool would have changed the schedule itself, and no trace replay predicts that well: the
replay at the recorded size says so (`PoolResult.uncertain`).

Pure: requests in, predictions out; no clock, no I/O.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

import msgspec

from kvmiss.enricher.core.geometry import lookup_limit_blocks

DEFAULT_SCALES = (1.0, 1.25, 1.5, 2.0, 4.0, 8.0)
# At the recorded size, a replay in which more than this share of admissions found too few
# free blocks ran where admission waits decide the schedule: its estimates for other sizes
# are uncertain. (A single short admission in thousands changes little: replayed through
# vLLM's own pool, such runs were still predicted within 0.3 points at 2x and 4x, while one
# with ~2 % of requests waiting was not -- benchmarks/RESULTS.md, "What-if".)
CROWDED_ADMISSIONS = 0.01


class PoolRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One request as the pool saw it (engine clock, seconds)."""

    lookup_time: float
    finish_time: float
    prompt_tokens: int
    output_tokens: int
    chain: Sequence[int]  # the prompt's full-block hashes
    output_chain: Sequence[int] = ()  # hashes of the output blocks it filled, in order
    observed_cached_tokens: int = 0


class PoolResult(msgspec.Struct, kw_only=True):
    """One replay at one pool size."""

    pool_blocks: int
    requests: int = 0
    prompt_tokens: int = 0
    observed_cached_tokens: int = 0
    predicted_cached_tokens: int = 0
    peak_in_use_blocks: int = 0
    short_admissions: int = 0  # admissions that found fewer free blocks than they needed
    uncertain: bool = False
    reason: str | None = None
    per_request: list[int] = msgspec.field(default_factory=list)  # predicted cached tokens, input order

    @property
    def predicted_hit_ratio(self) -> float:
        return self.predicted_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def observed_hit_ratio(self) -> float:
        return self.observed_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class BlockPoolModel:
    """vLLM's block pool at ``pool_blocks`` blocks (the engine's ``num_gpu_blocks``; block 0
    is the null block, so ``pool_blocks - 1`` hold data)."""

    def __init__(self, pool_blocks: int, block_size: int):
        if pool_blocks < 2 or block_size < 1:
            raise ValueError("a pool needs at least 2 blocks and a positive block size")
        self.block_size = block_size
        usable = range(1, pool_blocks)
        # block id -> None: the free queue, head first (front insertions for unhashed blocks)
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(usable)
        self.hash_of: dict[int, int] = {}  # block id -> the hash it caches
        self.blocks_of: dict[int, set[int]] = collections.defaultdict(set)  # hash -> blocks caching it
        self.refs: dict[int, int] = {}  # block id -> users, for blocks in use
        self.short = 0

    def in_use(self) -> int:
        return len(self.refs)

    def _touch(self, block: int) -> None:
        self.refs[block] = self.refs.get(block, 0) + 1
        self.free.pop(block, None)

    def _take(self) -> int | None:
        if not self.free:
            return None
        block = next(iter(self.free))
        del self.free[block]
        cached = self.hash_of.pop(block, None)
        if cached is not None:  # evicted: the least recently freed block with a hash
            holders = self.blocks_of[cached]
            holders.discard(block)
            if not holders:
                del self.blocks_of[cached]
        self.refs[block] = 1
        return block

    def _cache(self, block: int, block_hash: int) -> None:
        self.hash_of[block] = block_hash
        self.blocks_of[block_hash].add(block)

    def admit(self, request: PoolRequest) -> tuple[int, list[int]]:
        """(predicted cached tokens, the request's blocks in chain order)."""
        size = self.block_size
        limit = lookup_limit_blocks(request.prompt_tokens, size)
        hits: list[int] = []
        for block_hash in request.chain[:limit]:
            holders = self.blocks_of.get(block_hash)
            if not holders:
                break
            hits.append(min(holders))
        for block in hits:
            self._touch(block)
        total = -(-(request.prompt_tokens + request.output_tokens) // size)
        blocks = list(hits)
        for i in range(len(hits), total):
            block = self._take()
            if block is None:
                self.short += 1  # the engine would have made it wait: a schedule we cannot replay
                break
            if i < len(request.chain):
                self._cache(block, request.chain[i])
            blocks.append(block)
        return len(hits) * size, blocks

    def finish(self, request: PoolRequest, blocks: list[int]) -> None:
        full_prompt = len(request.chain)
        for i, block_hash in enumerate(request.output_chain):
            at = full_prompt + i
            if at < len(blocks) and blocks[at] not in self.hash_of:
                self._cache(blocks[at], block_hash)
        for block in reversed(blocks):  # tail first: the head stays cached longest
            users = self.refs[block] - 1
            if users:
                self.refs[block] = users
            else:
                del self.refs[block]
                self.free[block] = None
                if block not in self.hash_of:  # nothing cached in it: reused first
                    self.free.move_to_end(block, last=False)


def replay(requests: Sequence[PoolRequest], pool_blocks: int, block_size: int) -> PoolResult:
    """Every request through `BlockPoolModel` in engine time order (finishes before
    admissions at the same instant, as a step frees before it schedules)."""
    pool = BlockPoolModel(pool_blocks, block_size)
    result = PoolResult(pool_blocks=pool_blocks, per_request=[0] * len(requests))
    timeline: list[tuple[float, int, int]] = []  # (time, 0 finish / 1 admit / 2 finish, index)
    for i, r in enumerate(requests):
        timeline.append((r.lookup_time, 1, i))
        # a request finishing at the instant it was admitted still finishes after it
        timeline.append((r.finish_time, 0, i) if r.finish_time > r.lookup_time else (r.lookup_time, 2, i))
    timeline.sort()
    held: dict[int, list[int]] = {}
    for _, kind, i in timeline:
        r = requests[i]
        if kind == 1:
            cached, blocks = pool.admit(r)
            held[i] = blocks
            result.per_request[i] = cached
            result.peak_in_use_blocks = max(result.peak_in_use_blocks, pool.in_use())
        else:
            pool.finish(r, held.pop(i))
    for i, r in enumerate(requests):
        result.requests += 1
        result.prompt_tokens += r.prompt_tokens
        result.observed_cached_tokens += r.observed_cached_tokens
        result.predicted_cached_tokens += result.per_request[i]
    result.short_admissions = pool.short
    return result


def curve(requests: Sequence[PoolRequest], pool_blocks: int, block_size: int,
          scales: Iterable[float] = DEFAULT_SCALES) -> dict[float, PoolResult]:
    """Replays at each scale of the recorded pool; every one is marked uncertain when the
    replay at the recorded size ran crowded (see the module docstring)."""
    out = {scale: replay(requests, max(2, round(pool_blocks * scale)), block_size) for scale in scales}
    base = out.get(1.0) or replay(requests, pool_blocks, block_size)
    reason = None
    if base.short_admissions > CROWDED_ADMISSIONS * max(1, base.requests):
        reason = (f"at the recorded size {base.short_admissions} of {base.requests} admissions found too few free "
                  "blocks: requests waited, and a bigger pool changes the schedule itself")
    if reason is not None:
        for result in out.values():
            result.uncertain, result.reason = True, reason
    return out


def output_chains(stores: Iterable[tuple[float, int | None, Sequence[int]]],
                  requests: Sequence[tuple[float, float, Sequence[int], int]]) -> list[list[int]]:
    """Each request's output-block hashes, from one worker's ``BlockStored`` events:
    ``stores`` are (ts, parent hash, hashes) in order; ``requests`` (lookup time, finish
    time, prompt chain, output blocks wanted). A request's output blocks are the stores that
    continue its chain by parent link between its lookup and its finish."""
    children: dict[int, list[tuple[float, Sequence[int]]]] = collections.defaultdict(list)
    for ts, parent, hashes in stores:
        if parent is not None and hashes:
            children[parent].append((ts, hashes))
    out: list[list[int]] = []
    for lookup, finish, chain, wanted in requests:
        found: list[int] = []
        tip = chain[-1] if chain else None
        while tip is not None and len(found) < wanted:
            step = next((hashes for ts, hashes in children.get(tip, ()) if lookup <= ts <= finish + 1.0), None)
            if step is None:
                break
            found.extend(step)
            tip = step[-1]
        out.append(found[:wanted])
    return out


# --- per request, live: how much larger a pool would have kept an evicted block ------------------

LADDER = (1.25, 1.5, 2.0, 4.0, 8.0)  # pool sizes, as multiples of the worker's, on spans and metrics
BEYOND = ">8"


def ladder_label(scale: float) -> str:
    return f"{scale:g}"


class EvictionEstimate(msgspec.Struct, frozen=True):
    """For an ``evicted`` miss: the blocks the worker's pool gave up from the first missed
    block's removal through the lookup (itself included), and the smallest ladder size that
    many extra blocks would have been -- at which it would still have been cached."""

    reuse_distance_blocks: int
    scale: str  # a `LADDER` label, or `BEYOND`


def eviction_estimate(view, removed_seq: int | None, lookup_time: float | None, margin: float,
                      pool_blocks: int) -> EvictionEstimate | None:
    """Under vLLM's pool policy a freed block is evicted when it is the least recently freed
    one and a block is needed; with ``extra`` more blocks, every eviction after it would have
    taken one of those instead, so it survives the lookup when ``extra`` covers the evictions
    from its own through the lookup step. None when that cannot be counted: the pool size is
    not known, the removal was a cache reset (a bigger pool keeps nothing across a reset), or
    the batches have left the log. ``view``: the chosen worker's `EpochResidency` at the lookup."""
    if pool_blocks < 2 or removed_seq is None or lookup_time is None:
        return None
    if any(seq == removed_seq for seq, _ in view.clears):
        return None
    step = view.lookup_step(lookup_time, margin)
    between = None if step is None else view.removals_between(removed_seq, step)
    if between is None:
        return None
    distance = between + 1
    usable = pool_blocks - 1
    for scale in LADDER:
        if (scale - 1.0) * usable >= distance:
            return EvictionEstimate(distance, ladder_label(scale))
    return EvictionEstimate(distance, BEYOND)
