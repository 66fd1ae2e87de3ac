"""Ground truth for kvmiss's what-if cache sizing: a seeded workload run through vLLM's own
prefix cache, recorded the way kvmiss records a real worker.

vLLM's ``KVCacheManager`` (with its ``BlockPool``, ``Request`` objects and block hasher) is
imported from the installed wheel and driven, without an engine or a model, by a small
discrete-event copy of the *sequence* the v1 scheduler runs each step (not its code):

* step k starts at ``k * step``. Running requests first, in order: ``allocate_slots(request,
  1)`` for the decode token (a new block only when the last one is full; output blocks are
  cached as they fill). If that fails, the last running request is preempted (FCFS:
  ``free``, ``num_computed_tokens = 0``, back to the front of the waiting queue), and no
  waiting request is admitted in that step.
* then waiting requests, FCFS, while fewer than ``--max-seqs`` run:
  ``get_computed_blocks`` (the lookup; its result is the request's ``cached_tokens``) and
  ``allocate_slots(request, num_tokens - hit, num_new_computed_tokens=hit,
  new_computed_blocks=..., full_sequence_must_fit=True)`` (hits touched, the rest of the
  prompt allocated, full prompt blocks cached). When it returns None the queue waits for the
  next step (head-of-line): an *admission wait*.
* every scheduled request computes its tokens in that step (a whole prefill takes one step,
  a decode token one step) and samples its next token; a request that has its
  ``max_tokens`` finishes and is ``free``d at the end of the step (vLLM's ``free_blocks``:
  tail first; blocks with a cached hash go to the *end* of the free queue, blocks without one
  -- the partial last block, the block whose last token was never computed -- to the *front*).
* the step's events (``take_events``) are published as one batch, ``ts`` = end of the step,
  topic ``kv``, sequence numbers from 0, payload encoded by vLLM's own ``KVEventBatch`` and
  msgspec encoder (byte for byte what its ZMQ publisher sends), and appended to a kvmiss
  recording as a ``sub`` message of worker ``w0``.

Outputs for ``--pool-blocks M`` (``num_gpu_blocks``: block 0 is vLLM's null block, so M - 1
blocks hold data), in ``--out DIR``:

* ``events-M.rec``: the kvmiss recording;
* ``requests-M.jsonl``: one line per request: request_id, worker, prompt_tokens, cached_tokens
  (what vLLM's pool gave at the first admission), block_size, lookup_time (the admission
  lookup, same clock as the batches' ts), finish_time (the free, just before that step's batch
  is published), output_tokens, block_hashes (the prompt's full-block chain, uint64 external
  form), admission_wait_s (admission lookup - arrival); plus arrival_time, kind, session_id,
  turn, pool_wait_steps (steps it stood in the queue while admission failed for lack of
  blocks), preemptions and output_block_hashes (the blocks after the prompt's full blocks that
  vLLM cached for it, in order: ground truth for output chains rebuilt from events);
* ``summary-M.json``: pool size, requests, prompt/cached tokens, token hit ratio, admission
  waits, max in-use blocks and the self-checks below.

Self-checks (always on; a failure exits 1): at every admission the hit vLLM returned equals
(a) a brute-force prefix scan of the pool's hash map and (b) the same scan over the cached set
rebuilt from nothing but the events emitted so far (including the step's unpublished ones);
every request's chain equals kvmiss's own hashing (``BlockHasher("sha256_cbor")``) and vLLM's
``BlockStored`` parent links; after the run the recording, read back with kvmiss's reader and
decoder, rebuilds exactly the pool's cached multiset.

Run in vLLM's venv (vLLM and kvmiss installed there)::

    /work/vllm-venv/bin/python benchmarks/whatif_vllm_pool.py --pool-blocks 64 128 256 \\
        --out /tmp/whatif --seed 1
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import whatif_workload  # noqa: E402  (this folder)

SCHED_OFFSET_S = 100e-6  # the schedule (and its lookups) runs this long after the step starts
LOOKUP_SPACING_S = 1e-6  # successive lookups within one step
FREE_BEFORE_PUBLISH_S = 50e-6  # finished requests are freed this long before the batch's ts


class CheckFailed(AssertionError):
    pass


def _vllm():
    """vLLM's classes, from the wheel (imported late: it takes seconds)."""
    import torch
    import vllm
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request, RequestStatus

    return argparse.Namespace(**locals())


class Run:
    def __init__(self, workload: whatif_workload.Workload, pool_blocks: int, *, max_seqs: int,
                 step_s: float, token_budget: int, out: Path, topic: bytes, worker: str,
                 encoder: str = "vllm"):
        self.v = v = _vllm()
        self.w = workload
        self.B = B = workload.params.block_size
        self.M = pool_blocks
        self.max_seqs = max_seqs
        self.step_s = step_s
        self.token_budget = token_budget
        self.topic = topic
        self.worker = worker
        max_len = math.ceil(workload.max_total_tokens() / B) * B
        if pool_blocks - 1 < max_len // B:
            raise SystemExit(
                f"--pool-blocks {pool_blocks}: the longest request needs {max_len // B} blocks and "
                f"the pool holds {pool_blocks - 1} (vLLM would refuse max_model_len {max_len})")
        v.kv_cache_utils.init_none_hash(v.sha256_cbor)
        self.none_hash_seed = v.kv_cache_utils.get_none_hash_seed()
        self.hasher = v.kv_cache_utils.get_request_block_hasher(B, v.sha256_cbor)
        spec = v.FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=8, dtype=v.torch.float32)
        config = v.KVCacheConfig(num_blocks=pool_blocks, kv_cache_tensors=[],
                                 kv_cache_groups=[v.KVCacheGroupSpec(["layer.0"], spec)])
        self.kvm = v.KVCacheManager(config, max_model_len=max_len, scheduler_block_size=B,
                                    hash_block_size=B, enable_caching=True,
                                    enable_kv_cache_events=True, watermark=0.0)
        self.pool = self.kvm.block_pool
        self.stm = self.kvm.coordinator.single_type_managers[0]
        import msgspec

        self.msgspec = msgspec
        self.encoder = msgspec.msgpack.Encoder()  # what vLLM's publisher uses
        self.encoder_kind = encoder
        out.mkdir(parents=True, exist_ok=True)
        self.paths = {k: out / f"{k}-{pool_blocks}.{ext}" for k, ext in
                      (("events", "rec"), ("requests", "jsonl"), ("summary", "json"))}
        for p in self.paths.values():
            if p.exists():
                p.unlink()
        # Cached set rebuilt from the events alone: external hash -> copies.
        self.mirror: collections.Counter[int] = collections.Counter()
        self.mirrored = 0  # events of the pool's current (untaken) queue already mirrored
        self.stats = collections.Counter()

    # --- events -------------------------------------------------------------------------

    def _mirror_event(self, ev) -> None:
        v = self.v
        if isinstance(ev, v.BlockStored):
            for h in ev.block_hashes:
                self.mirror[h] += 1
            self.stats["stored_blocks"] += len(ev.block_hashes)
        elif isinstance(ev, v.BlockRemoved):
            for h in ev.block_hashes:
                self.mirror[h] -= 1
                if self.mirror[h] < 0:
                    raise CheckFailed(f"BlockRemoved of {h} that no event stored")
                if not self.mirror[h]:
                    del self.mirror[h]
            self.stats["removed_blocks"] += len(ev.block_hashes)
        elif isinstance(ev, v.AllBlocksCleared):
            self.mirror.clear()

    def _catch_up_mirror(self) -> None:
        queue = self.pool.kv_event_queue
        for ev in queue[self.mirrored:]:
            self._mirror_event(ev)
        self.mirrored = len(queue)

    def _kvmiss_batch(self, ts: float, events):
        """The same batch in kvmiss's own structs (``--encoder kvmiss``)."""
        from kvmiss.schemas import events as ke

        out = []
        for ev in events:
            if isinstance(ev, self.v.BlockStored):
                out.append(ke.BlockStored(
                    block_hashes=list(ev.block_hashes), parent_block_hash=ev.parent_block_hash,
                    token_ids=self.msgspec.Raw(self.encoder.encode(list(ev.token_ids))),
                    block_size=ev.block_size, lora_id=ev.lora_id, medium=ev.medium,
                    lora_name=ev.lora_name, extra_keys=ev.extra_keys, group_idx=ev.group_idx,
                    kv_cache_spec_kind=ev.kv_cache_spec_kind,
                    kv_cache_spec_sliding_window=ev.kv_cache_spec_sliding_window,
                    session_id=ev.session_id))
            elif isinstance(ev, self.v.BlockRemoved):
                out.append(ke.BlockRemoved(block_hashes=list(ev.block_hashes), medium=ev.medium,
                                           group_idx=ev.group_idx))
            else:
                out.append(ke.AllBlocksCleared())
        return ke.EventBatch(ts=ts, events=out, dp_rank=0)

    def _check_decoded(self, payload: bytes, events) -> None:
        """kvmiss's decoder reads the payload back to the very events the pool emitted."""
        from kvmiss.schemas import events as ke

        batch = ke.decode_batch(payload)
        if len(batch.events) != len(events):
            raise CheckFailed("decoded batch has a different number of events")
        for got, ev in zip(batch.events, events):
            if isinstance(ev, self.v.BlockStored):
                same = (isinstance(got, ke.BlockStored) and got.block_hashes == ev.block_hashes
                        and got.parent_block_hash == ev.parent_block_hash
                        and got.tokens() == list(ev.token_ids) and got.block_size == ev.block_size
                        and got.medium == ev.medium == "GPU" and got.group_idx == ev.group_idx)
            elif isinstance(ev, self.v.BlockRemoved):
                same = (isinstance(got, ke.BlockRemoved) and got.block_hashes == ev.block_hashes
                        and got.medium == ev.medium)
            else:
                same = isinstance(got, ke.AllBlocksCleared)
            if not same:
                raise CheckFailed(f"kvmiss decodes {got!r} for {ev!r}")
        self.stats["checked_batches"] += 1

    def _publish(self, ts: float) -> None:
        self._catch_up_mirror()
        events = self.kvm.take_events()
        self.mirrored = 0
        if not events:
            return
        if self.encoder_kind == "vllm":  # vLLM's publisher: its struct, msgspec's encoder
            payload = self.encoder.encode(
                self.v.KVEventBatch(ts=ts, events=events, data_parallel_rank=0))
        else:
            payload = self.encoder.encode(self._kvmiss_batch(ts, events))
        self._check_decoded(payload, events)
        frames = [self.topic, self.seq.to_bytes(8, "big"), payload]
        self.writer.write(self.RecordedMessage(recv_ts=ts, worker=self.worker, socket="sub",
                                               frames=frames))
        self.seq += 1
        self.stats["batches"] += 1
        for ev in events:
            if isinstance(ev, self.v.BlockStored):
                self._check_parent_links(ev)

    def _check_parent_links(self, ev) -> None:
        """Each stored run is a run of some request's chain, linked to the hash before it
        (a chained hash has one parent, whichever request it came from)."""
        parents = self.parent_of
        prev = ev.parent_block_hash
        for h in ev.block_hashes:
            if h not in parents or parents[h] != prev:
                raise CheckFailed(f"BlockStored {h}: parent {prev}, chain says {parents.get(h, '?')}")
            prev = h
        self.stats["checked_stores"] += 1

    def _register_chain(self, chain: list[int], start: int) -> None:
        for pos in range(start, len(chain)):
            self.parent_of.setdefault(chain[pos], chain[pos - 1] if pos else None)

    # --- the checks at a lookup ---------------------------------------------------------

    def _brute_force_hit(self, request, vllm_hit_tokens: int) -> None:
        B = self.B
        limit = (request.num_tokens - 1) // B
        ext = [self._ext(h) for h in request.block_hashes]
        # (a) the pool's own hash map, one block at a time
        n_pool = 0
        for h in request.block_hashes[:limit]:
            if self.pool.get_cached_block(h, [0]) is None:
                break
            n_pool += 1
        # (b) the cached set rebuilt from events only
        self._catch_up_mirror()
        n_ev = 0
        for h in ext[:limit]:
            if self.mirror.get(h, 0) <= 0:
                break
            n_ev += 1
        if not (n_pool * B == n_ev * B == vllm_hit_tokens):
            raise CheckFailed(f"{request.request_id}: vLLM hit {vllm_hit_tokens} tokens, pool scan "
                              f"{n_pool * B}, event scan {n_ev * B}")
        self.stats["checked_lookups"] += 1

    def _ext(self, digest: bytes) -> int:
        return self.external_hash(digest)

    # --- the engine loop ----------------------------------------------------------------

    def run(self) -> dict:
        from kvmiss.collectors.recording import RecordedMessage, RecordingWriter

        try:
            from kvmiss.enricher.core.hashing import external_hash
        except ImportError:  # kvmiss installed --no-deps without xxhash: the same function
            from kvmiss.schemas.events import canonical_hash as external_hash

        self.RecordedMessage = RecordedMessage
        self.external_hash = external_hash
        self.writer = RecordingWriter(self.paths["events"])
        self.seq = 0
        v, kvm, B, dt = self.v, self.kvm, self.B, self.step_s
        plan = self.w.requests
        info: dict[str, dict] = {}
        self.parent_of: dict[int, int | None] = {}  # external hash -> its parent's (None: root)
        waiting: collections.deque = collections.deque()
        running: list = []
        pi = 0
        k = 0
        max_in_use = 0
        usable = self.M - 1
        t_wall = time.perf_counter()
        while pi < len(plan) or waiting or running:
            if not waiting and not running:  # idle: the engine wakes at the next arrival
                k = max(k, math.ceil((plan[pi].arrival_time - SCHED_OFFSET_S) / dt - 1e-9))
            t0 = k * dt
            sched_t = t0 + SCHED_OFFSET_S
            while pi < len(plan) and plan[pi].arrival_time <= sched_t:
                p = plan[pi]
                pi += 1
                req = v.Request(p.request_id, list(p.prompt),
                                v.SamplingParams(max_tokens=len(p.output), ignore_eos=True), None,
                                arrival_time=p.arrival_time, block_hasher=self.hasher)
                info[p.request_id] = dict(plan=p, req=req, pool_wait_steps=0, preemptions=0,
                                          lookup_time=None, cached_tokens=None)
                waiting.append(req)
            kvm.new_step_starts()
            scheduled: list = []
            preempted = False
            budget = self.token_budget
            # 1. running requests (decode)
            i = 0
            while i < len(running):
                req = running[i]
                num_new = req.num_tokens - req.num_computed_tokens
                new_blocks = None
                while True:
                    new_blocks = kvm.allocate_slots(req, num_new)
                    if new_blocks is not None:
                        break
                    victim = running.pop()
                    kvm.free(victim)
                    victim.status = v.RequestStatus.PREEMPTED
                    victim.num_computed_tokens = 0
                    victim.num_preemptions += 1
                    info[victim.request_id]["preemptions"] += 1
                    self.stats["preemptions"] += 1
                    waiting.appendleft(victim)
                    preempted = True
                    if victim is req:
                        break
                if new_blocks is None:
                    break
                scheduled.append((req, num_new))
                budget -= num_new
                i += 1
            # 2. waiting requests (admission), FCFS, head-of-line
            lookups = 0
            if not preempted:
                while waiting:
                    if len(running) >= self.max_seqs:
                        self.stats["seq_cap_wait_steps"] += 1
                        break
                    req = waiting[0]
                    blocks, hit, _ = kvm.get_computed_blocks(req)
                    lookup_t = sched_t + lookups * LOOKUP_SPACING_S
                    lookups += 1
                    self._brute_force_hit(req, hit)
                    num_new = req.num_tokens - hit
                    if num_new > budget:
                        self.stats["token_budget_wait_steps"] += 1
                        break
                    new_blocks = kvm.allocate_slots(
                        req, num_new, num_new_computed_tokens=hit, new_computed_blocks=blocks,
                        full_sequence_must_fit=True, has_scheduled_reqs=bool(running))
                    if new_blocks is None:
                        for queued in waiting:
                            info[queued.request_id]["pool_wait_steps"] += 1
                        self.stats["pool_wait_steps"] += 1
                        break
                    waiting.popleft()
                    req.status = v.RequestStatus.RUNNING
                    req.num_computed_tokens = hit
                    running.append(req)
                    scheduled.append((req, num_new))
                    budget -= num_new
                    rec = info[req.request_id]
                    if rec["lookup_time"] is None:  # the first admission decides cached tokens
                        rec["lookup_time"] = lookup_t
                        rec["cached_tokens"] = hit
                        chain = [self._ext(h) for h in req.block_hashes]
                        rec["chain"] = chain
                        self._register_chain(chain, 0)
            in_use = usable - self.pool.get_num_free_blocks()
            max_in_use = max(max_in_use, in_use)
            # 3. the step runs; every scheduled request samples its next token
            finish_t = t0 + dt - FREE_BEFORE_PUBLISH_S
            for req, num_new in scheduled:
                req.num_computed_tokens += num_new
                if req.num_computed_tokens < req.num_tokens:
                    continue  # cannot happen without chunked prefill
                p = info[req.request_id]["plan"]
                before = len(req.block_hashes)
                req.append_output_token_ids(p.output[req.num_output_tokens])
                if len(req.block_hashes) > before:  # output blocks' hashes
                    chain = info[req.request_id]["chain"]
                    chain.extend(self._ext(h) for h in req.block_hashes[before:])
                    self._register_chain(chain, before)
                if req.num_output_tokens >= len(p.output):
                    rec = info[req.request_id]
                    prompt_full = len(p.prompt) // B
                    cached_blocks = self.stm.num_cached_block.get(req.request_id, 0)
                    rec["output_block_hashes"] = rec["chain"][prompt_full:cached_blocks]
                    rec["finish_time"] = finish_t
                    req.status = v.RequestStatus.FINISHED_LENGTH_CAPPED
                    running.remove(req)
                    kvm.free(req)
            # 4. publish the step's events
            self._publish(t0 + dt)
            self.stats["steps"] += 1
            k += 1
        self.writer.close()
        self.last_step = k
        wall = time.perf_counter() - t_wall
        return self._finish(info, max_in_use, wall)

    # --- outputs and the end-of-run checks ----------------------------------------------

    def _finish(self, info, max_in_use, wall) -> dict:
        B = self.B
        lines = []
        early_turns = 0
        waited = 0
        prompt_tokens = cached_tokens = 0
        for rid, rec in info.items():
            p = rec["plan"]
            prompt_full = len(p.prompt) // B
            if rec["pool_wait_steps"]:
                waited += 1
            if p.prev_request_id is not None and info[p.prev_request_id]["finish_time"] > p.arrival_time:
                early_turns += 1
            prompt_tokens += len(p.prompt)
            cached_tokens += rec["cached_tokens"]
            lines.append(dict(
                request_id=rid, worker=self.worker, prompt_tokens=len(p.prompt),
                cached_tokens=rec["cached_tokens"], block_size=B,
                lookup_time=round(rec["lookup_time"], 6), finish_time=round(rec["finish_time"], 6),
                output_tokens=len(p.output), block_hashes=rec["chain"][:prompt_full],
                admission_wait_s=round(rec["lookup_time"] - p.arrival_time, 6),
                arrival_time=p.arrival_time, kind=p.kind, session_id=p.session_id, turn=p.turn,
                pool_wait_steps=rec["pool_wait_steps"], preemptions=rec["preemptions"],
                output_block_hashes=rec["output_block_hashes"]))
        lines.sort(key=lambda d: d["lookup_time"])
        with open(self.paths["requests"], "w") as f:
            for d in lines:
                f.write(json.dumps(d) + "\n")
        checks = self._end_checks(info)
        s = self.stats
        summary = dict(
            pool_blocks=self.M, usable_blocks=self.M - 1, block_size=B, seed=self.w.seed,
            requests=len(lines), prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
            token_hit_ratio=round(cached_tokens / prompt_tokens, 6) if prompt_tokens else 0.0,
            admission_waits=waited, pool_wait_steps=s["pool_wait_steps"],
            seq_cap_wait_steps=s["seq_cap_wait_steps"],
            token_budget_wait_steps=s["token_budget_wait_steps"], preemptions=s["preemptions"],
            early_turns=early_turns, max_in_use_blocks=max_in_use,
            max_in_use_share=round(max_in_use / (self.M - 1), 4),
            stored_blocks=s["stored_blocks"], removed_blocks=s["removed_blocks"],
            batches=s["batches"], steps=s["steps"], last_step=self.last_step,
            sim_end_time=round(max(d["finish_time"] for d in lines), 6),
            max_seqs=self.max_seqs, step_s=self.step_s, token_budget=self.token_budget,
            hash_algo="sha256_cbor", none_hash_seed=self.none_hash_seed,
            vllm_version=self.v.vllm.__version__,
            workload={k: list(v) if isinstance(v, tuple) else v
                      for k, v in vars(self.w.params).items()},
            kinds=dict(collections.Counter(d["kind"] for d in lines)),
            checks=checks, wall_s=round(wall, 2),
            files={k: str(p) for k, p in self.paths.items()})
        self.paths["summary"].write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def _end_checks(self, info) -> dict:
        from kvmiss.collectors.recording import ReadStats, read_recording
        from kvmiss.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

        # 1. the pool's cached multiset, straight from its hash map
        pool_set: collections.Counter[int] = collections.Counter()
        for key, blocks in self.pool.cached_block_hash_to_block._cache.items():
            n = len(blocks) if isinstance(blocks, dict) else 1
            pool_set[self._ext(self.v.kv_cache_utils.get_block_hash(key))] += n
        if +self.mirror != pool_set:
            raise CheckFailed("the live event mirror differs from the pool's cached set")
        # 2. the recording, read back by kvmiss, rebuilds the same set
        stats = ReadStats()
        rebuilt: collections.Counter[int] = collections.Counter()
        seqs = []
        ts_prev = -1.0
        for msg in read_recording(self.paths["events"], stats):
            topic, seq, payload = msg.frames
            if topic != self.topic or msg.worker != self.worker or msg.socket != "sub":
                raise CheckFailed("unexpected frame envelope in the recording")
            seqs.append(int.from_bytes(seq, "big"))
            batch = decode_batch(payload)
            if batch.ts != msg.recv_ts or batch.ts < ts_prev or batch.dp_rank != 0:
                raise CheckFailed("batch ts / rank out of order")
            ts_prev = batch.ts
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    if ev.block_size != self.B or ev.medium != "GPU":
                        raise CheckFailed("BlockStored block_size/medium")
                    if len(ev.tokens()) != self.B * len(ev.block_hashes):
                        raise CheckFailed("BlockStored token_ids length")
                    for h in ev.block_hashes:
                        rebuilt[h] += 1
                elif isinstance(ev, BlockRemoved):
                    for h in ev.block_hashes:
                        rebuilt[h] -= 1
                elif isinstance(ev, AllBlocksCleared):
                    rebuilt.clear()
        if stats.torn_tail or seqs != list(range(len(seqs))):
            raise CheckFailed("recording torn or sequence numbers not 0..n-1")
        if any(c < 0 for c in rebuilt.values()) or +rebuilt != pool_set:
            raise CheckFailed("the recording does not rebuild the pool's cached set")
        # 3. kvmiss's hashing reproduces vLLM's chains (prompt + the output blocks)
        try:
            from kvmiss.enricher.core.hashing import BlockHasher
        except ImportError as exc:  # xxhash missing in this venv
            hashing = f"skipped ({exc})"
        else:
            hasher = BlockHasher("sha256_cbor", seed=os.environ.get("PYTHONHASHSEED"),
                                 block_size=self.B)
            for rec in info.values():
                p = rec["plan"]
                mine = [self._ext(d) for d in hasher.hash_request(p.prompt + p.output)]
                if rec["chain"] != mine:
                    raise CheckFailed(f"{p.request_id}: kvmiss hashing differs from vLLM's")
            hashing = True
        return dict(lookups_brute_forced=self.stats["checked_lookups"],
                    stores_parent_checked=self.stats["checked_stores"],
                    final_cached_hashes=sum(pool_set.values()),
                    recording_batches=len(seqs), batches_decoded_by_kvmiss=self.stats["checked_batches"],
                    encoder=self.encoder_kind, recording_rebuilds_pool=True,
                    event_mirror_matches_every_lookup=True, kvmiss_hashing_matches=hashing)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool-blocks", type=int, nargs="+", required=True,
                    help="vLLM num_gpu_blocks (block 0 is the null block); several = one run each")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=whatif_workload.WorkloadParams.conversation_rate,
                    help="new conversations per second")
    ap.add_argument("--step-ms", type=float, default=10.0, help="engine step (prefill = 1 step)")
    ap.add_argument("--max-seqs", type=int, default=8, help="vLLM max_num_seqs")
    ap.add_argument("--token-budget", type=int, default=16384,
                    help="max_num_batched_tokens (large: prefills are never chunked)")
    ap.add_argument("--workload", action="append", default=[], metavar="KEY=VALUE",
                    help="override a WorkloadParams field (tuples as a,b), e.g. turns=2,4")
    ap.add_argument("--encoder", choices=("vllm", "kvmiss"), default="vllm",
                    help="payload structs: vLLM's KVEventBatch (byte-exact publisher output) or "
                         "kvmiss's EventBatch (omits nil lora_id/parent/lora_name)")
    ap.add_argument("--topic", default="kv")
    ap.add_argument("--worker", default="w0")
    args = ap.parse_args(argv)
    step_s = args.step_ms / 1000.0
    overrides = {}
    defaults = whatif_workload.WorkloadParams()
    for item in args.workload:
        key, _, value = item.partition("=")
        if not hasattr(defaults, key) or key == "mix":
            ap.error(f"--workload: unknown field {key!r}")
        current = getattr(defaults, key)
        overrides[key] = (tuple(type(current[0])(x) for x in value.split(","))
                          if isinstance(current, tuple) else type(current)(value))
    params = whatif_workload.WorkloadParams(**{**overrides, "requests": args.requests,
                                               "step_s": step_s,
                                               "conversation_rate": args.rate})
    workload = whatif_workload.generate(args.seed, params)
    status = 0
    for m in args.pool_blocks:
        try:
            s = Run(workload, m, max_seqs=args.max_seqs, step_s=step_s,
                    token_budget=args.token_budget, out=args.out, topic=args.topic.encode(),
                    worker=args.worker, encoder=args.encoder).run()
        except CheckFailed as exc:
            print(f"M={m}: SELF-CHECK FAILED: {exc}", file=sys.stderr)
            status = 1
            continue
        print(f"M={m:5d}  hit ratio {s['token_hit_ratio']:.4f}  cached {s['cached_tokens']}/"
              f"{s['prompt_tokens']}  admission waits {s['admission_waits']} "
              f"({s['pool_wait_steps']} steps)  preemptions {s['preemptions']}  "
              f"max in use {s['max_in_use_blocks']}/{s['usable_blocks']}  "
              f"removed {s['removed_blocks']}  early turns {s['early_turns']}  "
              f"checks ok  ({s['wall_s']} s)", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
