"""The hand-over from the collector thread to the residency index's owner.

The ZeroMQ collector runs on its own thread; the index has exactly one owner (the service's
event loop, or the in-process exporter under its lock). `IndexFeed.put` is the collector's
`Fleet` sink: applied batches and tail confirmations go on a lock-free deque, in order; any
other stream fact is returned to the caller to log. `IndexFeed.drain`, on the owner's side,
applies them and prunes the index now and then.
"""

from __future__ import annotations

import collections
from typing import Callable

from kvmiss.collectors.continuity import Apply, StreamAction, TailConfirmed
from kvmiss.enricher.core.index import ResidencyIndex

PRUNE_EVERY_S = 5.0


class IndexFeed:
    """Collector actions on their way into one index. `put`: any thread; `drain`: the owner."""

    def __init__(self, index: ResidencyIndex, clock: Callable[[], float]):
        self.index = index
        self.clock = clock
        self._queue: collections.deque[Apply | tuple[str, TailConfirmed]] = collections.deque()
        self._last_prune = clock()
        self.applied = 0  # batches applied to the index so far

    def put(self, worker: str, action: StreamAction) -> bool:
        """Queue what the index needs; False for a stream fact it does not (log it)."""
        if isinstance(action, Apply):
            self._queue.append(action)
        elif isinstance(action, TailConfirmed):  # repeats while a worker idles: never logged
            self._queue.append((worker, action))
        else:
            return False
        return True

    def __len__(self) -> int:
        return len(self._queue)

    def drain(self) -> None:
        """Apply everything queued, in order; prune to the retention horizon every few seconds
        (horizon from the newest engine time applied: the index's own clock)."""
        queue, index = self._queue, self.index
        while queue:
            item = queue.popleft()
            if isinstance(item, Apply):
                index.apply(item.batch)
                self.applied += 1
            else:
                worker, tail = item
                index.confirm_tail(worker, tail.epoch, tail.seq, tail.at)
        now = self.clock()
        if now - self._last_prune >= PRUNE_EVERY_S:
            self._last_prune = now
            newest = max((v.applied_through_ts or 0.0 for v in index.current.values()), default=0.0)
            if newest:
                index.prune(newest)
