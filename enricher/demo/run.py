"""`kvmiss demo`: a simulated vLLM fleet through kvmiss's real collector and attribution.

Wiring, all on loopback in one process:

    Workload -> Router -> Engine (per worker) -> Publisher (real PUB + replay ROUTER)
        ~~ ZeroMQ ~~> Subscriber(Fleet) [collector thread] -> queue -> ResidencyIndex
    finished request -> request_facts() -> Attributor -> attribution record
                                         \\-> ground truth from the simulator -> agreement

The engines step on the main thread, one after another, with one strictly increasing wall
clock: lookups are stamped during a step, batches after it, as in vLLM. The collector's
sink runs on its own thread and only enqueues; the main thread applies and attributes, so
the index has one owner. A request is attributed once every worker's applied history has
passed its lookup time (routing evidence needs the whole fleet), or when a bounded wait
ends: then kvmiss answers from what it has, which is an honest unknown for a lagging worker.
"""

from __future__ import annotations

import collections
import math
import queue
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import msgspec
import zmq

from kvmiss.collectors.continuity import (
    Apply, EpochUncertain, Hole, NewEpoch, Quarantine, Release, StreamConfig,
)
from kvmiss.collectors.fleet import Fleet
from kvmiss.collectors.subscriber import Subscriber
from kvmiss.enricher.attribution import Attributor
from kvmiss.enricher.demo.engine import SimRequest
from kvmiss.enricher.demo.faults import FAULTS, FaultEvent, FaultRunner, SimWorker, plan_faults
from kvmiss.enricher.demo.report import DemoReport
from kvmiss.enricher.demo.router import Router
from kvmiss.enricher.demo.truth import Agreement, holder_as_seen, judge, truth_label
from kvmiss.enricher.demo.workload import Workload
from kvmiss.enricher.index import ResidencyIndex
from kvmiss.enricher.privacy import DigestKey
from kvmiss.schemas.attribution import RequestFacts
from kvmiss.schemas.config import WorkerSpec

BLOCK_SIZE = 16
NUM_BLOCKS = 150  # per worker: small enough for LRU pressure from the long documents
TICK_S = 0.012  # one engine step of every worker
# Bounded waits for events to reach a request's lookup time: its own worker's (past it,
# kvmiss answers "lagging"), and the rest of the fleet's (routing evidence needs them; a
# longer wait costs latency, never correctness).
WAIT_CHOSEN_S = 0.5
WAIT_FLEET_S = 2.0
PROGRESS_EVERY = 100
DEMO_DIGEST_SECRET = "kvmiss-demo: not a deployment secret"


@dataclass(frozen=True)
class DemoOptions:
    requests: int = 600
    workers: int = 4
    seed: int = 7
    faults: frozenset[str] = field(default_factory=lambda: frozenset(FAULTS))
    out: str = "./kvmiss-demo-out"


class StrictClock:
    """Wall-clock seconds, strictly increasing: a lookup and the batch stamped after its
    step must never share a timestamp, nor may two steps' batches."""

    def __init__(self) -> None:
        self.last = 0.0

    def __call__(self) -> float:
        now = time.time()
        self.last = now if now > self.last else math.nextafter(self.last, math.inf)
        return self.last


def request_facts(request: SimRequest, block_size: int) -> RequestFacts:
    """What the request's spans would say: the one place facts are built (a later step
    emits them as OTel spans instead)."""
    return RequestFacts(
        request_id=request.id, prompt_tokens=len(request.token_ids),
        cached_tokens=request.cached_tokens, block_size=block_size, worker=request.worker,
        lookup_time=request.lookup_time,
        block_hashes=request.chain[:len(request.token_ids) // block_size],
        extra_key_kinds=request.extra_key_kinds,
        transfers=(request.transfer,) if request.transfer is not None else (),
        route_policy=request.route_policy,
    )


class Attributions:
    """Attributes finished requests when the evidence is in, writes records, keeps score."""

    def __init__(self, index: ResidencyIndex, workers: list[str], out_dir: Path, log: IO[str]):
        self.index, self.workers, self.log = index, workers, log
        self.attributor = Attributor(index, DigestKey(DEMO_DIGEST_SECRET))
        self.report = DemoReport()
        # (request, monotonic time it finished), in finishing order
        self.pending: collections.deque[tuple[SimRequest, float]] = collections.deque()
        self.records = open(out_dir / "attributions.jsonl", "wb")
        self.truths = open(out_dir / "ground_truth.jsonl", "wb")
        self.encoder = msgspec.json.Encoder()

    def add(self, request: SimRequest) -> None:
        self.pending.append((request, time.monotonic()))

    def caught_up(self, worker: str, t: float) -> bool:
        return any((through := v.applied_through_ts) is not None and through >= t
                   for v in self.index.views(worker))

    def ready(self, request: SimRequest, waited: float) -> bool:
        t = request.lookup_time
        if not self.caught_up(request.worker, t):
            return waited >= WAIT_CHOSEN_S
        return waited >= WAIT_FLEET_S or all(self.caught_up(w, t) for w in self.workers)

    def run(self) -> int:
        """Attribute every pending request that is ready; returns how many were."""
        now, still, done = time.monotonic(), collections.deque(), 0
        for request, finished in self.pending:
            if not self.ready(request, now - finished):
                still.append((request, finished))
                continue
            self._attribute(request)
            done += 1
        self.pending = still
        return done

    def _attribute(self, request: SimRequest) -> None:
        facts = request_facts(request, BLOCK_SIZE)
        record = self.attributor.record(facts)
        truth = truth_label(facts.prompt_tokens, facts.cached_tokens, BLOCK_SIZE, request.truth)
        agreement = judge(truth, record.verdict.label)
        index_saw = []
        if agreement is Agreement.WRONG and request.truth.other_holders:
            first_miss = request.chain[facts.cached_tokens // BLOCK_SIZE]
            index_saw = [holder_as_seen(self.index, w, first_miss, facts.lookup_time)
                         for w in request.truth.other_holders]
        wrong = self.report.add(record, truth, agreement, kind=request.kind,
                                policy=request.route_policy, index_saw=index_saw)
        if wrong is not None:
            print(f"!!! {wrong.line()}", file=self.log, flush=True)
        self.records.write(self.encoder.encode(record) + b"\n")
        self.truths.write(self.encoder.encode({
            "request_id": request.id, "kind": request.kind, "worker": request.worker,
            "route_policy": request.route_policy, "truth": truth.value,
            "verdict": record.verdict.label.value, "agreement": agreement.value,
            "lookup_facts": request.truth,
        }) + b"\n")

    def close(self) -> None:
        self.records.close()
        self.truths.close()


def run_demo(options: DemoOptions, log: IO[str] = sys.stderr) -> tuple[dict[str, Any], DemoReport]:
    """Run the whole demo; returns the JSON summary and the report (for rendering)."""
    started = time.monotonic()
    out_dir = Path(options.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    def say(text: str) -> None:
        print(f"[{time.monotonic() - started:5.1f}s] {text}", file=log, flush=True)

    requests = Workload(options.seed, block_size=BLOCK_SIZE).generate(options.requests)
    ids = [f"w{i}" for i in range(options.workers)]
    plan, rings = plan_faults(options.faults, ids, [r.arrival_tick for r in requests])
    ctx = zmq.Context()
    sims = {w: SimWorker(ctx, w, dp_rank=0, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                         buffer_steps=rings[w]) for w in ids}
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    index = ResidencyIndex(ids)
    attributions = Attributions(index, ids, out_dir, log)
    subscriber: Subscriber | None = None
    try:
        say(f"phase: starting {len(ids)} simulated vLLM workers (PUB + replay ROUTER on loopback)")
        for sim in sims.values():
            sim.start()
        specs = [WorkerSpec(id=w, endpoint=f"tcp://127.0.0.1:{s.pub_port}",
                            replay_endpoint=f"tcp://127.0.0.1:{s.replay_port}")
                 for w, s in sims.items()]
        # An unanswered replay is retried after 0.5 s, not llm-d's (and kvmiss's default)
        # 2 s: the demo's waits for evidence are shorter than that.
        fleet = Fleet(specs, lambda worker, action: inbox.put((worker, action)),
                      config=StreamConfig(replay_timeout_s=0.5))
        subscriber = Subscriber(fleet, context=ctx)
        subscriber.start()
        time.sleep(0.3)  # let the SUB subscriptions reach the publishers
        say(f"phase: kvmiss collector subscribed; driving {len(requests)} requests "
            f"(seed {options.seed}, faults: {','.join(sorted(options.faults)) or 'none'})")
        _drive(requests, sims, plan, index, attributions, inbox, options, say)
        say("phase: workload done; waiting for the last events")
        while attributions.pending:
            _drain(inbox, index, say)
            attributions.run()
            time.sleep(0.01)
    finally:
        if subscriber is not None:
            subscriber.shutdown()
        for sim in sims.values():
            sim.shutdown()
        attributions.close()
        ctx.destroy(linger=0)
    extra = {"seed": options.seed, "workers": len(ids), "faults": sorted(options.faults),
             "fault_events": [f"tick {e.tick} {e.worker}: {e.action}: {e.note}" for e in plan],
             "runtime_s": round(time.monotonic() - started, 2), "out": str(out_dir)}
    summary = attributions.report.as_json(fleet.streams, extra)
    (out_dir / "summary.json").write_bytes(msgspec.json.format(msgspec.json.encode(summary)))
    return summary, attributions.report


def _drive(requests: list[SimRequest], sims: dict[str, SimWorker], plan: list[FaultEvent],
           index: ResidencyIndex, attributions: Attributions, inbox: queue.SimpleQueue,
           options: DemoOptions, say) -> None:
    """The simulation loop: faults, arrivals, one step of every live worker, attribution."""
    clock = StrictClock()
    router = Router(list(sims), seed=options.seed + 1, disaggregate="transfer" in options.faults)
    arrivals = collections.deque(requests)
    retry: list[SimRequest] = []
    faults = FaultRunner(plan, sims, say)
    attributed, tick = 0, 0
    while arrivals or retry or any(s.engine is not None and s.engine.load for s in sims.values()):
        began = time.monotonic()
        lost, crashed = faults.run(tick)
        for worker in crashed:
            router.forget(worker)
        for request in lost:  # the router retries what a dead process dropped
            request.worker = request.route_policy = request.transfer = None
        retry += lost
        incoming, retry = retry, []
        while arrivals and arrivals[0].arrival_tick <= tick:
            incoming.append(arrivals.popleft())
        loads = {w: s.engine.load for w, s in sims.items() if s.engine is not None}
        for request in incoming:
            if not loads:
                retry.append(request)
                continue
            worker = router.route(request, loads)
            sims[worker].engine.submit(request)
            loads[worker] += 1
        for worker, sim in sims.items():
            if sim.engine is None:
                continue
            finished, batch = sim.engine.step(clock, _probe(sims, worker))
            if batch is not None:
                sim.publish(batch)
            for request in finished:
                attributions.add(request)
        _drain(inbox, index, say)
        done = attributions.run()
        if (attributed + done) // PROGRESS_EVERY > attributed // PROGRESS_EVERY:
            report = attributions.report
            counts = collections.Counter()
            for per_label in report.agreement.values():
                counts.update(per_label)
            say(f"progress: {attributed + done}/{len(requests)} attributed "
                f"({counts[Agreement.AGREE]} agree, {counts[Agreement.UNKNOWN]} unknown, "
                f"{counts[Agreement.WRONG]} wrong)")
        attributed += done
        tick += 1
        time.sleep(max(0.0, TICK_S - (time.monotonic() - began)))


def _probe(sims: dict[str, SimWorker], me: str):
    def probe(block_hash: int) -> tuple[str, ...]:
        return tuple(w for w, s in sims.items()
                     if w != me and s.engine is not None and s.engine.pool.holds(block_hash))
    return probe


def _drain(inbox: queue.SimpleQueue, index: ResidencyIndex, say) -> None:
    """Apply what the collector thread produced; narrate the stream events that matter."""
    while True:
        try:
            worker, action = inbox.get_nowait()
        except queue.Empty:
            return
        if isinstance(action, Apply):
            index.apply(action.batch)
        elif isinstance(action, Hole):
            say(f"kvmiss: {worker} hole seq {action.from_seq}..{action.to_seq} "
                f"({action.reason.value}{': ' + action.detail if action.detail else ''})")
        elif isinstance(action, Quarantine):
            say(f"kvmiss: {worker} quarantined from seq {action.from_seq}")
        elif isinstance(action, Release):
            say(f"kvmiss: {worker} released at seq {action.seq} ({action.cause.value})")
        elif isinstance(action, NewEpoch):
            say(f"kvmiss: {worker} new epoch {action.epoch} ({action.cause.value})")
        elif isinstance(action, EpochUncertain):
            say(f"kvmiss: {worker} epoch {action.epoch} uncertain ({action.reason.value})")
