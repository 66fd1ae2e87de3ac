"""Has the fleet's history reached a lookup time: would waiting longer change the evidence?

The index's answer, asked once per judging round by whoever holds requests until their history
arrives (the span pipeline). Pure: ``now`` and the wait are arguments.
"""

from __future__ import annotations

from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.core.membership import Standing


class HistoryReach:
    """The index as it is at one judging round: how far each current lifetime's history is
    proven, least advanced first, and the members that joined within the wait with no
    history yet. Build a new one whenever the index may have moved on."""

    __slots__ = ("index", "wait_s", "through", "joining")

    def __init__(self, index: ResidencyIndex, *, now: float, wait_s: float):
        self.index, self.wait_s = index, wait_s
        membership, margin = index.membership, index.tail_margin_s
        departed = membership.departed
        # (engine time history is proven through, worker) of every established, present lifetime
        self.through = sorted(
            (through, worker) for worker, view in index.current.items()
            if view.epoch_certain and worker not in departed
            and (through := view.reached_through(margin)) is not None)
        # Members a source announced less than the wait ago whose history has not begun (their
        # stream is connecting or replaying): an unresolved holder each, for which a wait may help.
        current = index.current
        self.joining = [
            worker for worker in membership.specs
            if worker not in current and (at := membership.joined_at(worker)) is not None
            and now - at < wait_s] if membership.specs else []

    def reached(self, worker: str | None, t: float | None) -> bool:
        """Whether waiting longer could not change the evidence at ``t`` for a lookup on
        ``worker``: its history reaches ``t`` (a batch stamped at or after it, or a confirmed
        idle tail), and so does every other tracked worker that still may -- one behind ``t``
        could have held the first-miss block, which leaves every label below routing_miss
        unprovable. A worker that has proven nothing for more than the wait before ``t`` (down,
        or far behind) is not waited for: the wait would not help; nor is one that departed (its
        stream is gone). A worker that joined within the wait is waited for where it counts at t."""
        index = self.index
        views = index.views(worker) if worker else []
        if not views or t is None or not index.reaches(views[0], t):
            return False
        membership = index.membership
        if membership.known_through < t + membership.band_s:
            # A change the router made before t is seen at most a band late: until the sources
            # were asked that long after t, the fleet at t may not be the one kvmiss holds.
            return False
        if self.joining:
            standing = membership.standing
            for other in self.joining:
                if other != worker and standing(other, t) is not Standing.DEPARTED:
                    return False
        for through, other in self.through:  # least advanced first
            if other == worker:
                continue
            if through >= t:
                return True
            if through >= t - self.wait_s:
                return False
        return True
