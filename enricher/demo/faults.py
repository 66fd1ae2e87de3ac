"""The simulated fleet's workers across process lifetimes, and what goes wrong with them.

Each fault exercises one rule of ATTRIBUTION.md on real sockets:

  drop      two live batches of one worker are lost on the wire but kept in its replay
            ring: kvmiss must notice the jump, replay the hole and stay continuous.
  hole      one worker runs with a 3-batch replay ring and loses six batches in a row:
            replay cannot fill the hole, so kvmiss must quarantine the worker and answer
            unknown_history for it (never a guess from the rebuilt index).
  lag       one worker's publication falls behind: requests wait (bounded) for its events
            and answer unknown_history "lagging" when the wait ends first.
  restart   the hole worker is killed with two batches still unsent (they die with it)
            and comes back `DOWN_TICKS` later as a new process on the same endpoints, seq
            from 0, cache empty, ring size fixed: a new epoch, the quarantine released,
            nothing carried over, and lookups in the lost steps unknown_epoch.
  transfer  disaggregated requests' KV transfers fail: transfer_failure.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from kvmiss.enricher.demo.engine import Engine, SimRequest
from kvmiss.enricher.demo.publisher import EventBatch, Publisher

FAULTS = ("drop", "hole", "lag", "restart", "transfer")
DEFAULT_RING = 10_000  # vLLM's default buffer_steps
TINY_RING = 3  # batches: far below vLLM's default 10,000
HOLE_BATCHES = 6  # lost in a row on the tiny-ring worker: more than its ring holds
DROP_BATCHES = 2
LAG_S = 1.0  # publication delay of the lagging worker: beyond the chosen-worker wait
LAG_TICKS = 8  # steps published late
UNSENT_AT_CRASH = 2  # steps whose batches were still queued when the process died
DOWN_TICKS = 10  # how long the restarted worker is away


def parse_faults(text: str) -> frozenset[str]:
    """``all``, ``none``, or a comma list of `FAULTS`; raises ValueError naming a bad one."""
    text = text.strip()
    if text == "all":
        return frozenset(FAULTS)
    if text in ("none", ""):
        return frozenset()
    names = {name.strip() for name in text.split(",") if name.strip()}
    unknown = sorted(names - set(FAULTS))
    if unknown:
        raise ValueError(
            f"unknown fault {unknown[0]!r}; choose from {', '.join(FAULTS)}, all, none")
    return frozenset(names)


class SimWorker:
    """One worker id: its current engine process and publisher, on fixed endpoints."""

    def __init__(self, ctx: zmq.Context, worker: str, *, dp_rank: int, num_blocks: int,
                 block_size: int, buffer_steps: int):
        self.ctx, self.worker, self.dp_rank = ctx, worker, dp_rank
        self.published = 0  # batches handed to a publisher, over every lifetime
        self.num_blocks, self.block_size, self.buffer_steps = num_blocks, block_size, buffer_steps
        self.pub_port = self.replay_port = 0
        self.lifetimes = 0
        self.engine: Engine | None = None
        self.publisher: Publisher | None = None

    @property
    def alive(self) -> bool:
        return self.engine is not None

    def start(self) -> None:
        """A new process: empty cache, a new publisher (seq from 0) on the same endpoints."""
        self.engine = Engine(self.worker, num_blocks=self.num_blocks,
                             block_size=self.block_size, dp_rank=self.dp_rank)
        self.publisher = Publisher(self.ctx, buffer_steps=self.buffer_steps,
                                   pub_port=self.pub_port, replay_port=self.replay_port)
        self.publisher.start()
        self.pub_port, self.replay_port = self.publisher.pub_port, self.publisher.replay_port
        self.lifetimes += 1

    def publish(self, batch: EventBatch) -> None:
        assert self.publisher is not None
        self.publisher.publish(batch)
        self.published += 1

    def crash(self) -> list[SimRequest]:
        """Kill the process: unsent batches are lost; returns the requests to retry."""
        assert self.engine is not None and self.publisher is not None
        self.publisher.shutdown(crash=True)
        lost = self.engine.abort_all()
        self.engine = self.publisher = None
        return lost

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.shutdown()


@dataclass(frozen=True)
class FaultEvent:
    tick: int
    worker: str
    action: str  # drop | hole | lag_on | lag_off | stall | crash (a restart follows)
    note: str
    batches: int = 0  # for drop / hole: how many live batches are lost on the wire
    # Not before the worker published this many batches since its previous fault: a hole is
    # only a hole once a later batch reveals it, and a crash must not hide it.
    after_batches: int = 0


def plan_faults(faults: frozenset[str], workers: list[str],
                arrivals: list[int]) -> tuple[list[FaultEvent], dict[str, int]]:
    """When each fault strikes (ticks from the workload's arrival ticks, so the same seed
    gives the same plan) and the replay ring of each worker's first process."""
    def at(fraction: float) -> int:
        return arrivals[min(len(arrivals) - 1, int(fraction * len(arrivals)))]

    def pick(i: int) -> str:
        return workers[i % len(workers)]

    events: list[FaultEvent] = []
    rings = {w: DEFAULT_RING for w in workers}
    if "drop" in faults:
        for fraction in (0.2, 0.6):
            note = f"{DROP_BATCHES} live batches lost on the wire (kept in the ring)"
            events.append(FaultEvent(at(fraction), pick(1), "drop", note, DROP_BATCHES))
    hole_worker = pick(2)
    if "hole" in faults:
        rings[hole_worker] = TINY_RING
        events.append(FaultEvent(at(0.4), hole_worker, "hole",
                                 f"{HOLE_BATCHES} live batches lost, replay ring holds {TINY_RING}",
                                 HOLE_BATCHES))
    if "restart" in faults:
        events.append(FaultEvent(at(0.5), hole_worker, "stall",
                                 "publisher queue stalls before the crash",
                                 after_batches=HOLE_BATCHES + 2 if "hole" in faults else 0))
        events.append(FaultEvent(at(0.5), hole_worker, "crash",
                                 f"process killed, {UNSENT_AT_CRASH} batches never sent",
                                 after_batches=UNSENT_AT_CRASH))
    if "lag" in faults:
        start = at(0.7)
        events.append(FaultEvent(start, pick(3), "lag_on", f"publication delayed by {LAG_S:.1f} s"))
        events.append(FaultEvent(start + LAG_TICKS, pick(3), "lag_off", "publication back on time"))
    events.sort(key=lambda e: e.tick)
    return events, rings


class FaultRunner:
    """Carries the plan out in order. An event waits for its tick and for its worker to
    publish ``after_batches`` batches since the previous fault on it (later events wait
    behind it, so the order never changes); a crash schedules the restart."""

    def __init__(self, plan: list[FaultEvent], sims: dict[str, SimWorker],
                 say: Callable[[str], None]):
        self.queue = collections.deque(plan)
        self.sims, self.say = sims, say
        self.mark = {w: 0 for w in sims}  # `published` at the worker's previous fault
        self.restarts: dict[str, int] = {}  # worker -> tick it comes back
        self.struck: list[tuple[float, str, str, str]] = []  # (wall time, worker, action, note)

    def run(self, tick: int) -> tuple[list[SimRequest], list[str]]:
        """Apply what is due at ``tick``: (requests to route again, workers that crashed)."""
        lost: list[SimRequest] = []
        crashed: list[str] = []
        for worker, when in list(self.restarts.items()):
            if when <= tick:
                del self.restarts[worker]
                sim = self.sims[worker]
                sim.buffer_steps = DEFAULT_RING  # the operator fixed the ring size
                sim.start()
                self.struck.append((time.time(), worker, "restart", "back as a new process"))
                self.say(f"fault: {worker}: back as a new process on the same endpoints "
                         "(seq from 0, empty cache)")
        while self.queue and self._ready(self.queue[0], tick):
            event = self.queue.popleft()
            sim = self.sims[event.worker]
            self.mark[event.worker] = sim.published
            if sim.publisher is None:
                continue  # the worker is down: nothing to break
            self.struck.append((time.time(), event.worker, event.action, event.note))
            self.say(f"fault: {event.worker}: {event.note}")
            faults = sim.publisher.faults
            if event.action in ("drop", "hole"):
                faults.drop = event.batches
            elif event.action == "lag_on":
                faults.delay_s = LAG_S
            elif event.action == "lag_off":
                faults.delay_s = 0.0
            elif event.action == "stall":
                faults.delay_s = 3600.0  # queued until the crash destroys them
            elif event.action == "crash":
                lost += sim.crash()
                crashed.append(event.worker)
                self.restarts[event.worker] = tick + DOWN_TICKS
        return lost, crashed

    def _ready(self, event: FaultEvent, tick: int) -> bool:
        if event.tick > tick:
            return False
        sim = self.sims[event.worker]
        since = sim.published - self.mark[event.worker]
        return sim.publisher is None or since >= event.after_batches
