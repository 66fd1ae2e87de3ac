"""A blind kvmiss says so: each member's event stream, connected or not, and why not.

The collector knows whether a worker's SUB is connected, not why it is not, and a socket that
never connects is silent. `WorkerWatch` runs on the service's loop: once a second it reads
every member's connection, asks the network why one has stayed unconnected past a grace
(`collectors.reachability.diagnose`), and logs at WARNING when a worker becomes unreachable,
when the cause changes, and when it recovers -- never once a second. Its answers feed /readyz,
`kvmiss status`, the unreachable-workers metric and the verdict's reason for a worker it cannot
hear (`StreamReach`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Container, Mapping

import msgspec

from kvmiss.collectors.reachability import diagnose
from kvmiss.schemas.config import WorkerSpec
from kvmiss.schemas.fleet import Reach, StreamReach, Unreachable

log = logging.getLogger("kvmiss.serve")

CHECK_INTERVAL_S = 1.0
# A member not connected this long after start-up or its join is unreachable; a reconnect
# after a publisher restart takes well under it (ZeroMQ retries every 0.1-5 s).
GRACE_S = 5.0
# While a worker stays unreachable its cause is asked again this often (a name that starts to
# resolve, a port that starts to listen); a changed cause is logged.
REDIAGNOSE_S = 30.0
# Connected, yet not a batch nor a tail-probe answer in this long: an idle engine without a
# replay endpoint looks the same as a topic filter that matches nothing, so it is said once.
SILENT_AFTER_S = 30.0


class WorkerWatch:
    """Loop thread. ``connection(worker)``: the collector's "connected" / "disconnected" /
    "never" / "unopened"; ``heard(worker)``: whether anything (a batch, a tail-probe answer)
    came from it; ``unopened``: why a socket could not be opened."""

    def __init__(self, *, specs: Callable[[], Mapping[str, WorkerSpec]], connection: Callable[[str], str],
                 heard: Callable[[str], bool], unopened: Mapping[str, str], member_since: Mapping[str, float],
                 departed: Container[str], clock: Callable[[], float], grace_s: float = GRACE_S,
                 diagnose_endpoint=diagnose):
        self.specs, self.connection, self.heard, self.unopened = specs, connection, heard, unopened
        self.member_since, self.departed, self.clock = member_since, departed, clock
        self.grace_s = grace_s
        self.diagnose = diagnose_endpoint
        self.reach: dict[str, StreamReach] = {}
        self._logged: dict[str, tuple[Reach, Unreachable | None]] = {}  # what the last WARNING said
        self._diagnosed_at: dict[str, float] = {}
        self._diagnosing: set[str] = set()
        self._connected_at: dict[str, float] = {}
        self._silence_said: set[str] = set()
        self._task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kvmiss-worker-watch")

    async def shutdown(self) -> None:
        for task in (self._task, *self._tasks):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (self._task, *self._tasks) if t is not None), return_exceptions=True)
        self._task = None

    async def _run(self) -> None:
        while True:
            self.check()
            await asyncio.sleep(CHECK_INTERVAL_S)

    # --- the rule -------------------------------------------------------------------------

    def check(self) -> None:
        """Each member's reach now; diagnoses started for the blind ones that are due."""
        now, specs = self.clock(), self.specs()
        for worker in [w for w in self.reach if w not in specs or w in self.departed]:
            self._forget(worker)
        for worker, spec in specs.items():
            if worker in self.departed:
                continue
            self._update(worker, spec, self.connection(worker), now)

    def _update(self, worker: str, spec: WorkerSpec, connection: str, now: float) -> None:
        known = self.reach.get(worker)
        if connection == "connected":
            self._connected_at.setdefault(worker, now)
            if known is None or known.state is not Reach.CONNECTED:
                self.reach[worker] = StreamReach(state=Reach.CONNECTED, since=now)
                if worker in self._logged:
                    down = now - (known.since or now) if known is not None else 0.0
                    log.warning("worker %s: event stream connected (%s) after %.0f s unreachable",
                                worker, spec.sub_endpoint(), down)
                    del self._logged[worker]
            self._check_silence(worker, spec, now)
            return
        self._connected_at.pop(worker, None)
        joined = self.member_since.get(worker, now)
        if connection == "disconnected":
            state, since = Reach.DISCONNECTED, (known.since if known and known.state is Reach.DISCONNECTED else now)
        elif now - joined < self.grace_s and connection != "unopened":
            self.reach[worker] = StreamReach(state=Reach.CONNECTING, since=joined)
            return
        else:
            state, since = Reach.NEVER_CONNECTED, joined
        cause, detail = (known.cause, known.detail) if known is not None and known.state is state else (None, "")
        if connection == "unopened":
            cause, detail = Unreachable.NOT_OPENED, self.unopened.get(worker, "")
        self.reach[worker] = StreamReach(state=state, since=since, cause=cause, detail=detail)
        if now - since < self.grace_s:
            return  # a publisher restart reconnects within it
        if cause is None or (cause is not Unreachable.NOT_OPENED
                             and now - self._diagnosed_at.get(worker, float("-inf")) >= REDIAGNOSE_S):
            self._start_diagnosis(worker, spec, now)
        elif self._logged.get(worker) != (state, cause):
            self._warn(worker, spec)

    def _start_diagnosis(self, worker: str, spec: WorkerSpec, now: float) -> None:
        if worker in self._diagnosing:
            return
        self._diagnosing.add(worker)
        self._diagnosed_at[worker] = now
        task = asyncio.get_running_loop().create_task(self._diagnose(worker, spec))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _diagnose(self, worker: str, spec: WorkerSpec) -> None:
        try:
            cause, detail = await self.diagnose(spec.sub_endpoint(), bind=spec.bind)
        finally:
            self._diagnosing.discard(worker)
        known = self.reach.get(worker)
        if known is None or not known.blind or self.specs().get(worker) is not spec:
            return  # connected, departed or replaced meanwhile
        self.reach[worker] = msgspec.structs.replace(known, cause=cause, detail=detail)
        if self._logged.get(worker) != (known.state, cause):
            self._warn(worker, spec)

    def _warn(self, worker: str, spec: WorkerSpec) -> None:
        reach = self.reach[worker]
        what = ("not connected once in" if reach.state is Reach.NEVER_CONNECTED
                else "disconnected for")
        log.warning("worker %s: event stream %s %s %.0f s (%s: %s); requests routed to it are judged "
                    "unknown_history until it connects", worker, spec.sub_endpoint(), what,
                    self.clock() - (reach.since or 0.0), reach.cause.value if reach.cause else "cause unknown",
                    reach.detail)
        self._logged[worker] = (reach.state, reach.cause)

    def _check_silence(self, worker: str, spec: WorkerSpec, now: float) -> None:
        if worker in self._silence_said or self.heard(worker):
            return
        if now - self._connected_at[worker] >= SILENT_AFTER_S:
            self._silence_said.add(worker)
            log.warning("worker %s: connected to %s %.0f s ago and nothing received yet: an idle engine, or "
                        "a topic filter (%r) that matches nothing it publishes%s", worker, spec.sub_endpoint(),
                        now - self._connected_at[worker], spec.topic,
                        "" if spec.replay_endpoint else " (with a replay_endpoint kvmiss could tell them apart)")

    def _forget(self, worker: str) -> None:
        for table in (self.reach, self._logged, self._diagnosed_at, self._connected_at):
            table.pop(worker, None)
        self._silence_said.discard(worker)

    # --- answers --------------------------------------------------------------------------

    def status(self, worker: str) -> StreamReach | None:
        return self.reach.get(worker)

    def unreachable_by_cause(self) -> dict[str, int]:
        counts: collections.Counter[str] = collections.Counter()
        for reach in self.reach.values():
            if reach.blind and reach.cause is not None:
                counts[reach.cause.value] += 1
        return dict(counts)

    def past_grace(self, reach: StreamReach, now: float) -> bool:
        """Blind for longer than the grace: unreachable, as readiness counts it."""
        return reach.blind and reach.since is not None and now - reach.since >= self.grace_s

    def connected_share(self) -> float | None:
        """Members connected, or still within their grace, over all members; None: no member."""
        if not self.reach:
            return None
        now = self.clock()
        blind = sum(1 for reach in self.reach.values() if self.past_grace(reach, now))
        return 1.0 - blind / len(self.reach)

