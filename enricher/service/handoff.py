"""The hand-over from the collector thread to the residency index's owner.

The ZeroMQ collector runs on its own thread; the index has exactly one owner (the service's
event loop, or the in-process exporter under its lock). `IndexFeed.put` is the collector's
`Fleet` sink: applied batches and tail confirmations go on a lock-free deque, in order; any
other stream fact is returned to the caller to log. `IndexFeed.drain`, on the owner's side,
applies them and prunes the index now and then.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

from kvmiss.collectors.continuity import Apply, StreamAction, TailConfirmed
from kvmiss.enricher.core.index import ResidencyIndex

PRUNE_EVERY_S = 1.0
# Retention-queue entries one drain prunes (~5 ms at ~250 ns each); a prune with more due goes
# on at the next drain. At a million events a second a whole second's prune held the loop for
# ~150 ms (benchmarks/bench_ingest_serve.py --scrape-hz: /healthz answers stalled).
PRUNE_SHARE = 20_000
# Index anomalies logged once per worker when first seen (they are counted on /metrics).
LOGGED_ONCE = {
    "stores_without_hashes": "worker %s: a BlockStored with no block hash (vLLM caching a range whose blocks are "
                             "all null in a sliding-window or Mamba group sends token ids only): nothing stored; "
                             "counted in kvmiss_index_stores_without_hashes",
}

log = logging.getLogger("kvmiss.index")


class IndexFeed:
    """Collector actions on their way into one index. `put`: any thread; `drain`: the owner."""

    def __init__(self, index: ResidencyIndex, clock: Callable[[], float]):
        self.index = index
        self.clock = clock
        self._queue: collections.deque[Apply | tuple[str, TailConfirmed]] = collections.deque()
        self._last_prune = clock()
        self.applied = 0  # batches applied to the index so far
        self._prune_at = 0.0  # the engine time the prune under way prunes to
        self._logged: set[tuple[str, str]] = set()  # (anomaly, worker) already logged

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

    def drain(self, budget_s: float | None = None) -> bool:
        """Apply what was queued when called, in order, for at most ``budget_s`` seconds (None:
        all of it); then prune a share towards the retention horizon, every second or while a
        prune is under way (horizon from the newest engine time applied: the index's clock).

        What is left waits for the next call: under a sustained burst the collector thread
        adds as fast as the owner applies, and a backlog applied in one go kept the event loop
        (OTLP, /metrics, /healthz) away for over a second. A request judged before its batches
        are applied waits for history as it would for a late batch. Returns whether the budget
        ran out with batches or a prune share left: call again soon, not at the next tick."""
        queue, index = self._queue, self.index
        deadline = None if budget_s is None else time.monotonic() + budget_s
        behind = False
        for n in range(len(queue)):
            if deadline is not None and n & 511 == 511 and time.monotonic() > deadline:
                behind = True
                break
            item = queue.popleft()
            if isinstance(item, Apply):
                index.apply(item.batch)
                self.applied += 1
            else:
                worker, tail = item
                index.confirm_tail(worker, tail.epoch, tail.seq, tail.at)
        now = self.clock()
        if index.prune_pending or now - self._last_prune >= PRUNE_EVERY_S:
            if not index.prune_pending:
                self._last_prune = now
                self._prune_at = max((v.applied_through_ts or 0.0 for v in index.current.values()), default=0.0)
            if self._prune_at:
                index.prune(self._prune_at, PRUNE_SHARE)
            self._log_new_anomalies()
        return behind or index.prune_pending

    def _log_new_anomalies(self) -> None:
        for (name, worker), n in list(self.index.anomalies.items()):
            if n and name in LOGGED_ONCE and (name, worker) not in self._logged:
                if len(self._logged) < 4096:
                    self._logged.add((name, worker))
                    log.warning(LOGGED_ONCE[name], worker[:64])
