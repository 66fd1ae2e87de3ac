"""A simulated vLLM worker: the block pool and scheduler semantics that decide cache hits.

What is modelled, because attribution depends on it (vLLM ``v1/core/block_pool.py``,
``kv_cache_manager.py``, ``scheduler.py``), for one full-attention KV-cache group:

  * Free-block queue with LRU reuse: a freed block goes to the tail and keeps its hash
    (still a cache hit) until it is reallocated from the head; reallocation evicts it and
    emits one ``BlockRemoved`` per evicted copy. A request's blocks are freed tail first,
    so its last blocks are evicted first.
  * Prefix lookup: scan the request's full-block chain until the first hash not cached,
    capped at ``(N - 1) // B`` blocks (the last prompt token is always recomputed).
  * Pinning: blocks of running requests are ref-counted and never evicted.
  * Caching at schedule time: the request's new full prompt blocks are stored as soon as it
    is scheduled (a later request in the same step hits them), and every block its generated
    tokens fill is stored too. One hash may be held by two blocks (the lookup-limit
    recompute, a request that skips the cache): each copy is stored and evicted on its own.

A simulated step decodes one block (``B`` tokens) per running request, so a busy engine
publishes a batch nearly every step, as a real one does; a request's blocks are reserved
when it is scheduled (no preemption).

One `Engine.step` is one engine step: finish, schedule (lookups, evictions, stores), and
return the step's events as one batch stamped after the step. Everything here is
deterministic given the clock; no sockets (the run loop hands batches to a `Publisher`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmiss.enricher.demo.publisher import BlockRemoved, BlockStored, EventBatch, WireEvent
from kvmiss.enricher.demo.truth import LookupTruth
from kvmiss.schemas.attribution import TransferAttempt

GPU = "GPU"

Clock = Callable[[], float]
# probe(hash) -> ids of the *other* live workers whose pool holds it right now
Probe = Callable[[int], tuple[str, ...]]


@dataclass(slots=True, eq=False)
class Block:
    id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # external uint64 form while cached


class BlockPool:
    """Blocks, the LRU free queue and the hash -> cached copies map; records its events."""

    def __init__(self, num_blocks: int):
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is LRU order: popitem(last=False) takes the head.
        self.free: collections.OrderedDict[int, Block] = collections.OrderedDict(
            (b.id, b) for b in self.blocks)
        self.cached: dict[int, dict[int, Block]] = {}
        self.ever_stored: set[int] = set()  # hashes stored in this process lifetime (truth)
        self.events: list[WireEvent] = []

    def holds(self, block_hash: int) -> bool:
        return block_hash in self.cached

    def copies(self, block_hash: int) -> int:
        return len(self.cached.get(block_hash, ()))

    def lookup(self, chain: list[int], max_blocks: int) -> list[Block]:
        """The cached prefix of ``chain``: blocks up to the first miss, at most ``max_blocks``."""
        hit: list[Block] = []
        for block_hash in chain[:max_blocks]:
            copies = self.cached.get(block_hash)
            if not copies:
                break
            hit.append(next(iter(copies.values())))
        return hit

    def touch(self, blocks: list[Block]) -> None:
        """Pin hit blocks: a block with no other user leaves the free queue (not evicted)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free[block.id]
            block.ref_cnt += 1

    def allocate(self, count: int) -> list[Block]:
        """Take ``count`` blocks from the free queue's head, evicting their cached hashes."""
        if count > len(self.free):
            raise RuntimeError(
                f"allocate({count}) with {len(self.free)} free blocks: a scheduler bug")
        out = []
        for _ in range(count):
            _, block = self.free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        copies = self.cached[block.block_hash]
        del copies[block.id]
        if not copies:
            del self.cached[block.block_hash]
        self.events.append(BlockRemoved(block_hashes=[block.block_hash], medium=GPU, group_idx=0))
        block.block_hash = None

    def cache(self, blocks: list[Block], hashes: list[int], parent: int | None,
              token_ids: list[int], block_size: int, *, lora_id: int | None,
              lora_name: str | None, extra_keys: list) -> None:
        """Store newly full blocks under their hashes: one ``BlockStored`` for all of them."""
        for block, block_hash in zip(blocks, hashes):
            block.block_hash = block_hash
            self.cached.setdefault(block_hash, {})[block.id] = block
            self.ever_stored.add(block_hash)
        self.events.append(BlockStored(
            block_hashes=list(hashes), parent_block_hash=parent, token_ids=token_ids,
            block_size=block_size, lora_id=lora_id, medium=GPU, lora_name=lora_name,
            extra_keys=extra_keys, group_idx=0, kv_cache_spec_kind="full_attention",
        ))

    def free_blocks(self, blocks: list[Block]) -> None:
        """Unpin a finished request's blocks, tail first (so its tail is evicted first)."""
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free[block.id] = block

    def take_events(self) -> list[WireEvent]:
        events, self.events = self.events, []
        return events


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request as the simulator knows it (the prompt never leaves the simulator)."""

    id: str
    kind: str  # workload class, for the report
    token_ids: list[int]  # the prompt
    output_ids: list[int]  # what it will generate: ``decode_steps * B`` tokens
    chain: list[int]  # full-block hashes of prompt + output, engine external uint64 form
    event_extra_keys: list  # per block, as vLLM publishes them (untagged, no LoRA path)
    extra_key_kinds: tuple[str, ...] = ()
    # The opt-in ``kvmiss.extra_keys`` JSON (an ExtraKeysSpec: salt, LoRA name and path):
    # prompt material, sent only on spans that opt in and stripped by kvmiss before export.
    extra_keys_json: str | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    decode_steps: int = 0  # steps after the prefill step, one output block each
    skip_cache_read: bool = False  # e.g. prompt logprobs: vLLM does not read the cache
    transfer: TransferAttempt | None = None  # a KV transfer the connector attempted first
    arrival_tick: int = 0
    # Set by the router and the engine:
    worker: str | None = None
    route_policy: str | None = None
    routed_at: float | None = None  # wall clock of the routing decision
    expected_blocks: list[int] = field(default_factory=list)  # prompt blocks new to the worker
    lookup_time: float | None = None
    cached_tokens: int = 0
    truth: LookupTruth | None = None
    blocks: list[Block] = field(default_factory=list)
    remaining_steps: int = 0
    stored_blocks: int = 0  # full blocks of prompt + output cached so far
    decoded: int = 0  # output tokens generated so far


class Engine:
    """One worker process: waiting queue, running set, block pool. Not thread-safe."""

    def __init__(self, worker: str, *, num_blocks: int, block_size: int, dp_rank: int = 0,
                 max_running: int = 16, max_batched_tokens: int = 2048):
        self.worker = worker
        self.block_size = block_size
        self.dp_rank = dp_rank
        self.max_running = max_running
        self.max_batched_tokens = max_batched_tokens
        self.pool = BlockPool(num_blocks)
        self.waiting: collections.deque[SimRequest] = collections.deque()
        self.running: list[SimRequest] = []

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def submit(self, request: SimRequest) -> None:
        self.waiting.append(request)

    def step(self, clock: Clock, probe: Probe) -> tuple[list[SimRequest], EventBatch | None]:
        """Run one engine step: schedule what fits, decode, then retire finished requests.

        Returns the requests that finished in this step and the step's event batch (None
        when the step produced no events: vLLM publishes nothing then), stamped with
        ``clock()`` after every lookup of the step.
        """
        decoding = list(self.running)
        self._schedule(clock, probe)
        for request in decoding:  # one block of output each
            request.decoded += self.block_size
            self._cache_full_blocks(request, len(request.token_ids) + request.decoded)
        finished = []
        for request in self.running:
            request.remaining_steps -= 1
            if request.remaining_steps <= 0:
                self.pool.free_blocks(request.blocks)
                finished.append(request)
        self.running = [r for r in self.running if r.remaining_steps > 0]
        events = self.pool.take_events()
        if not events:
            return finished, None
        return finished, EventBatch(ts=clock(), events=events, data_parallel_rank=self.dp_rank)

    def abort_all(self) -> list[SimRequest]:
        """The process died: every queued or running request must be retried elsewhere."""
        lost = list(self.waiting) + self.running
        self.waiting.clear()
        self.running = []
        for request in lost:
            request.lookup_time, request.truth, request.blocks = None, None, []
            request.cached_tokens = request.stored_blocks = request.decoded = 0
        return lost

    def _schedule(self, clock: Clock, probe: Probe) -> None:
        budget = self.max_batched_tokens
        size = self.block_size
        while self.waiting and len(self.running) < self.max_running:
            request = self.waiting[0]
            n = len(request.token_ids)
            t = clock()
            max_blocks = (n - 1) // size
            hit = [] if request.skip_cache_read else self.pool.lookup(request.chain, max_blocks)
            new_tokens = n - len(hit) * size
            need = -(-(n + len(request.output_ids)) // size) - len(hit)
            reusable_free = sum(1 for b in hit if b.ref_cnt == 0)
            if need > len(self.pool.free) - reusable_free or (
                    new_tokens > budget and budget < self.max_batched_tokens):
                return  # FCFS: it waits for the next step, and its lookup is redone then
            self.waiting.popleft()
            budget -= new_tokens
            request.lookup_time = t
            request.cached_tokens = len(hit) * size
            request.truth = self._truth(request, probe)
            self.pool.touch(hit)
            fresh = self.pool.allocate(need)
            request.blocks = hit + fresh
            request.stored_blocks = len(hit)
            self._cache_full_blocks(request, n)
            request.remaining_steps = request.decode_steps + 1
            self.running.append(request)

    def _cache_full_blocks(self, request: SimRequest, num_tokens: int) -> None:
        """Store the request's blocks that ``num_tokens`` tokens fill and are not stored yet."""
        size, start = self.block_size, request.stored_blocks
        full = num_tokens // size
        if full <= start:
            return
        tokens = request.token_ids + request.output_ids
        self.pool.cache(
            request.blocks[start:full], request.chain[start:full],
            request.chain[start - 1] if start else None, tokens[start * size:full * size], size,
            lora_id=request.lora_id, lora_name=request.lora_name,
            extra_keys=request.event_extra_keys[start:full],
        )
        request.stored_blocks = full

    def _truth(self, request: SimRequest, probe: Probe) -> LookupTruth:
        """What the fleet looked like at this lookup, for the request's first-miss block."""
        i = request.cached_tokens // self.block_size
        failed = request.transfer is not None and request.transfer.result.value != "completed"
        if i >= len(request.token_ids) // self.block_size:  # nothing reusable was missed
            return LookupTruth(transfer_failed=failed)
        first_miss = request.chain[i]
        return LookupTruth(
            transfer_failed=failed,
            other_holders=probe(first_miss),
            resident=self.pool.holds(first_miss),
            stored_this_epoch=first_miss in self.pool.ever_stored,
        )
