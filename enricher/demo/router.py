"""The demo's request router: prefix-aware like llm-d or Dynamo, and fallible like them.

Its prefix knowledge is its own routing history (which chains it sent where), not the
engines' caches: it does not see evictions, so it keeps sending a prompt to a worker that
has since evicted it (``evicted``). When the best worker is much busier than the least busy
one it trades locality for queue depth, and a share of traffic is sent round-robin (both
``routing_miss`` when another worker held the prefix). Disaggregated requests prefill on
the worker that holds the prefix and move their KV cache to another one; the simulated
transfer fails (``transfer_failure``).
"""

from __future__ import annotations

import random

from kvmiss.enricher.demo.engine import SimRequest
from kvmiss.schemas.attribution import TransferAttempt, TransferResult


class Router:
    """Chooses a worker for each request. Deterministic given ``seed`` and the loads."""

    def __init__(self, workers: list[str], *, seed: int, block_size: int = 16,
                 disaggregate: bool = True, round_robin_share: float = 0.12,
                 max_load_skew: int = 6):
        self.workers = list(workers)
        self.block_size = block_size
        self.disaggregate = disaggregate
        self.rng = random.Random(seed)
        self.round_robin_share = round_robin_share
        self.max_load_skew = max_load_skew
        self.known: dict[str, set[int]] = {w: set() for w in workers}
        self._next = 0

    def forget(self, worker: str) -> None:
        """The worker restarted: nothing the router sent there before is cached any more."""
        self.known[worker] = set()

    def route(self, request: SimRequest, loads: dict[str, int]) -> str:
        """Pick one of the workers in ``loads`` (the live ones) and record the choice."""
        alive = [w for w in self.workers if w in loads]
        least = min(alive, key=lambda w: (loads[w], alive.index(w)))
        best, score = max(((w, self._known_prefix(w, request.chain)) for w in alive),
                          key=lambda ws: (ws[1], -loads[ws[0]]))
        if request.kind == "disagg" and self.disaggregate and score > 0:
            others = [w for w in alive if w != best]
            if others:
                worker = min(others, key=lambda w: (loads[w], others.index(w)))
                request.transfer = TransferAttempt(result=TransferResult.FAILED, source=best)
                return self._chose(request, worker, "disaggregated")
        if self.rng.random() < self.round_robin_share:
            worker = alive[self._next % len(alive)]
            self._next += 1
            return self._chose(request, worker, "round_robin")
        if score > 0 and loads[best] - loads[least] <= self.max_load_skew:
            return self._chose(request, best, "prefix")
        return self._chose(request, least, "least_loaded")

    def _known_prefix(self, worker: str, chain: list[int]) -> int:
        known, count = self.known[worker], 0
        for block_hash in chain:
            if block_hash not in known:
                break
            count += 1
        return count

    def _chose(self, request: SimRequest, worker: str, policy: str) -> str:
        request.worker, request.route_policy = worker, policy
        known = self.known[worker]
        # The prompt blocks this worker has not been sent before: what the router expects
        # it to compute and store (entered as speculative residency by the run loop).
        prompt = request.chain[:len(request.token_ids) // self.block_size]
        request.expected_blocks = [h for h in dict.fromkeys(prompt) if h not in known]
        known.update(request.chain)
        return worker
