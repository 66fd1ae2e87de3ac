"""The service's side of a fleet that changes: polls each membership source, turns a new
answer into a `FleetChange` (`FleetMembers`), and hands it to the service; a refused one
is logged once, counted, and changes nothing (docs/FLEET.md).

Also the faces of it: the counters and the histogram of the time from a change to a joined
worker's first applied batch, read by the metrics at scrape time.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import logging
from collections.abc import Callable

from kvmiss.collectors.membership import Desired, FleetMembers, MembershipSource, Refusal
from kvmiss.enricher.core.membership import Membership
from kvmiss.schemas.fleet import FleetChange

log = logging.getLogger("kvmiss.fleet")

# Seconds from a change being seen to the joined worker's first batch applied: a connect and a
# replay from seq 0 take tens of ms; an engine that starts slowly, seconds.
FIRST_BATCH_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class FirstBatchDelays:
    """A histogram: bucket counts (cumulative at read time), sum and count. Observed on the
    collector thread, read at scrape time (each value a whole int or float write)."""

    def __init__(self) -> None:
        self.counts = [0] * len(FIRST_BATCH_BUCKETS)
        self.total = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(FIRST_BATCH_BUCKETS, seconds)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += 1
        self.sum += seconds

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip(FIRST_BATCH_BUCKETS, self.counts):
            running += n
            out.append((str(bound), running))
        return out + [("+Inf", self.total)]


class FleetStats:
    """What `kvmiss_fleet_*` counts: joins and departures applied, updates refused by
    (source, reason), and the first-batch delays of joined workers."""

    def __init__(self, membership: Membership | None = None) -> None:
        self.joins = 0
        self.departures = 0
        self.refused: collections.Counter[tuple[str, str]] = collections.Counter()
        self.first_batch = FirstBatchDelays()
        self.membership = membership  # the index's: its band, and how often the router widened it


class FleetWatch:
    """Polls ``sources`` every ``interval_s`` on the event loop; each change goes to
    ``apply`` (the service's `apply_fleet_change`), in source order."""

    def __init__(self, sources: list[MembershipSource], members: FleetMembers,
                 apply: Callable[[FleetChange], None], *, interval_s: float, clock: Callable[[], float],
                 stats: FleetStats | None = None, seen_through: Callable[[float], None] | None = None):
        self.sources = sources
        self.members = members
        self.apply = apply
        self.interval_s = interval_s
        self.clock = clock
        self.stats = stats if stats is not None else FleetStats()
        self._task: asyncio.Task | None = None
        self._known_through = float("-inf")  # see `known_through`
        self._asked: dict[str, float] = {}  # source -> when its previous poll began
        self.seen_through = seen_through  # told each new `known_through` (the index's membership)
        self._failing: set[str] = set()  # sources whose last poll raised

    def known_through(self) -> float:
        """The time (this clock) up to which every source's changes have been seen: the start
        of the last complete round of polls, or earlier where a source says its answer is
        older (`known_through` of a source: DNS, the start of its last answered resolution)."""
        return self._known_through

    async def poll_once(self) -> list[FleetChange]:
        """Ask every source once; apply and return the changes that were made."""
        started = self.clock()
        changes, answered = [], True
        for source in self.sources:
            asked = self.clock()
            try:
                answer = await source.poll()
            except Exception as exc:  # noqa: BLE001 - a source's bug must not stop the others
                if source.name not in self._failing:  # logged once until it answers again
                    self._failing.add(source.name)
                    log.exception("fleet %s: polling %s failed (%s); its last good fleet stays",
                                  source.name, source.where, type(exc).__name__)
                answered = False
                continue
            if source.name in self._failing:
                self._failing.discard(source.name)
                log.info("fleet %s: polling %s works again", source.name, source.where)
            previous, self._asked[source.name] = self._asked.get(source.name), asked
            if answer is None:
                continue
            if isinstance(answer, Desired):
                # Made after the previous poll (which did not show it) and by now, unless the
                # source says more exactly.
                since = answer.since if answer.since is not None else previous
                answer = self.members.propose(source.name, answer,
                                              self.clock() if answer.at is None else answer.at, since)
            if isinstance(answer, Refusal):
                self.stats.refused[(source.name, answer.reason.value)] += 1
                kept = len(self.members.by_source.get(source.name, {}))
                log.warning("fleet %s: update refused (%s): %s; the last good fleet stays (%d workers from %s)",
                            source.name, answer.reason.value, answer.detail, kept, source.name)
                continue
            if not answer.empty:
                self.apply(answer)
                changes.append(answer)
        if answered:  # (a source that raised has told nothing new)
            self._known_through = min([started, *(getattr(s, "known_through", started) for s in self.sources)])
            if self.seen_through is not None:
                self.seen_through(self._known_through)
        return changes

    def start(self) -> None:
        if self.sources and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._forever(), name="kvmiss-fleet-watch")

    async def shutdown(self) -> None:
        for source in self.sources:
            close = getattr(source, "close", None)  # a resolution in flight (DNS)
            if close is not None:
                close()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.poll_once()
