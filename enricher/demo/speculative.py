"""Speculative residency and route-to-BlockStored latency.

Between a routing decision and the engine's BlockStored reaching kvmiss there is a blind
spot: the blocks are being computed but no event says so yet. A router (or the demo) may
enter the request's expected blocks here as *speculative* with a TTL; the index's stores
confirm them, and the time from route to confirmation is the latency that sizes history
waits and TTLs (ATTRIBUTION.md rule 3). Speculative entries are bookkeeping only: the
evidence builder never reads them, so they can never count as residency in a verdict.

Pure: times are arguments (kvmiss wall clock, seconds). Not thread-safe.
"""

from __future__ import annotations

import collections


class LatencyReservoir:
    """The most recent ``size`` latencies, for percentiles (seconds)."""

    def __init__(self, size: int = 10_000):
        self._values: collections.deque[float] = collections.deque(maxlen=size)
        self.count = 0

    def add(self, value: float) -> None:
        self._values.append(value)
        self.count += 1

    def percentiles(self, *qs: float) -> tuple[float | None, ...]:
        ordered = sorted(self._values)
        if not ordered:
            return tuple(None for _ in qs)
        return tuple(ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in qs)


class SpeculativeEntries:
    """Expected (worker, block) pairs awaiting their BlockStored, each with a TTL."""

    def __init__(self, ttl_s: float = 2.0, *, max_entries: int = 1_000_000):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._pending: dict[tuple[str, int], float] = {}
        self._order: collections.deque[tuple[float, str, int]] = collections.deque()
        self.latency = LatencyReservoir()
        self.entered = 0
        self.confirmed = 0
        self.expired = 0
        self.dropped = 0  # refused at the bound

    def route(self, worker: str, block_hashes: list[int], now: float) -> None:
        """A request was routed to ``worker`` expecting these blocks to be stored."""
        for h in block_hashes:
            if len(self._pending) >= self.max_entries:
                self.dropped += 1
                continue
            if (worker, h) not in self._pending:
                self._pending[(worker, h)] = now
                self._order.append((now, worker, h))
                self.entered += 1

    def stored(self, worker: str, block_hashes: list[int], recv_ts: float) -> None:
        """The index applied a store on ``worker`` received at ``recv_ts``."""
        pending = self._pending
        for h in block_hashes:
            routed = pending.pop((worker, h), None)
            if routed is not None:
                self.confirmed += 1
                self.latency.add(max(0.0, recv_ts - routed))

    def expire(self, now: float) -> int:
        """Drop entries older than the TTL; returns how many expired."""
        expired = 0
        order, pending = self._order, self._pending
        while order and order[0][0] <= now - self.ttl_s:
            routed, worker, h = order.popleft()
            if pending.get((worker, h)) == routed:
                del pending[(worker, h)]
                expired += 1
        self.expired += expired
        return expired

    def is_pending(self, worker: str, block_hash: int) -> bool:
        return (worker, block_hash) in self._pending

    def suggested_ttl_s(self, margin: float = 1.5) -> float | None:
        """A TTL (and history wait) covering the observed p99 with a margin."""
        (p99,) = self.latency.percentiles(0.99)
        return None if p99 is None else p99 * margin
