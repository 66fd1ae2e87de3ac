"""Blocks whose residency records retention dropped, remembered for a horizon of engine time,
so that a miss needing one answers "aged out" instead of "never stored" (`AgedOutFilter`).

A scalable Bloom filter in rotating generations: no false negatives inside the horizon, memory
bounded by the eviction rate times the horizon.
"""

from __future__ import annotations

import collections

from kvmiss.enricher.core.residency_table import bloom_add


class _BloomStage:
    """One fixed-size Bloom filter: ``bits_log2`` bits, `AgedOutFilter.HASHES` positions per
    hash by double hashing over the (already uniform) 64-bit block hash."""

    __slots__ = ("bits", "mask", "count", "capacity")

    def __init__(self, bits_log2: int):
        self.bits = bytearray(1 << (bits_log2 - 3))
        self.mask = (1 << bits_log2) - 1
        self.count = 0
        self.capacity = (1 << bits_log2) // AgedOutFilter.BITS_PER_ENTRY

    def positions(self, block_hash: int) -> list[int]:
        h1, h2, m = block_hash & 0xFFFFFFFF, (block_hash >> 32) | 1, self.mask
        return [(h1 + i * h2) & m for i in range(AgedOutFilter.HASHES)]

    def add(self, block_hash: int) -> None:
        bits = self.bits
        for p in self.positions(block_hash):
            bits[p >> 3] |= 1 << (p & 7)
        self.count += 1

    def add_many(self, hashes: list[int]) -> None:
        """`add` for each hash; in C when the table is compiled (pruning adds millions)."""
        if bloom_add is None:
            for h in hashes:
                self.add(h)
            return
        bloom_add(self.bits, self.mask, hashes, AgedOutFilter.HASHES)
        self.count += len(hashes)

    def __contains__(self, block_hash: int) -> bool:
        bits = self.bits
        return all(bits[p >> 3] & (1 << (p & 7)) for p in self.positions(block_hash))


class _Generation:
    """A scalable Bloom filter (a full stage is followed by one twice its size) over the
    records dropped by the prunes of one stretch of engine time, ``first_ts .. last_ts``
    (their ``before_ts``: every record in it closed before ``last_ts``)."""

    __slots__ = ("stages", "count", "first_ts", "last_ts", "first_bits_log2")

    def __init__(self, at_ts: float | None, first_bits_log2: int):
        self.stages: list[_BloomStage] = []
        self.count = 0
        self.first_ts = self.last_ts = at_ts
        self.first_bits_log2 = first_bits_log2

    def add_many(self, hashes: list[int]) -> None:
        stages, done = self.stages, 0
        while done < len(hashes):
            if not stages or stages[-1].count >= stages[-1].capacity:
                stages.append(_BloomStage(self.first_bits_log2 + len(stages)))
            stage = stages[-1]
            take = hashes[done:done + stage.capacity - stage.count]
            stage.add_many(take)
            done += len(take)
        self.count += len(hashes)

    def __contains__(self, block_hash: int) -> bool:
        return any(block_hash in stage for stage in reversed(self.stages))


class AgedOutFilter:
    """Blocks whose records retention dropped, remembered for ``horizon_s`` of engine time
    after they were dropped: no false negatives inside that horizon, and memory bounded by
    the eviction rate times the horizon, however long the engine runs.

    Rotating generations: the records dropped by the prunes of each ``horizon_s /
    GENERATIONS`` of engine time share one generation, and a generation is forgotten as a
    whole once even its newest prune is more than ``horizon_s`` old. A record dropped at a
    prune within the horizon is therefore still in its (kept) generation; knowledge reaches
    back ``horizon_s`` to ``horizon_s * (1 + 1/GENERATIONS)``. ``forgotten_through``: every
    forgotten record closed before this engine time, so a block absent from the index and
    from the filter was not held at any time since (evidence answers "no recent match" from
    it, the window reported: docs/HISTORY.md, `no_match`).

    Inside a generation, a full stage is followed by one twice its size, so the
    false-positive rate stays bounded however many records it takes (a fixed filter drifts
    towards "maybe" for everything, turning `no_match` into aged-out unknowns): at 12 bits and
    6 positions per entry a full stage answers "maybe" wrongly ~0.4 % of the time. A new
    generation starts at the size the last one reached, so a steady eviction rate fills
    ~1 stage per generation: 1.5-3 bytes per remembered record.
    """

    BITS_PER_ENTRY = 12
    HASHES = 6
    FIRST_STAGE_BITS_LOG2 = 20
    GENERATIONS = 4

    __slots__ = ("_generations", "count", "horizon_s", "forgotten_through", "forgotten")

    def __init__(self, horizon_s: float = float("inf")) -> None:
        self._generations: collections.deque[_Generation] = collections.deque()
        self.count = 0  # records remembered
        self.horizon_s = horizon_s
        self.forgotten_through: float | None = None
        self.forgotten = 0  # records forgotten (aged past the horizon)

    def add(self, block_hash: int, at_ts: float | None = None) -> None:
        self.add_many([block_hash], at_ts)

    def add_many(self, hashes: list[int], at_ts: float | None = None) -> None:
        """Remember ``hashes``, dropped by a prune at engine time ``at_ts`` (its
        ``before_ts``; None: the current generation's time)."""
        if not hashes:
            return
        gens = self._generations
        current = gens[-1] if gens else None
        if current is None or (at_ts is not None and current.first_ts is not None
                               and at_ts - current.first_ts >= self.horizon_s / self.GENERATIONS):
            bits_log2 = self.FIRST_STAGE_BITS_LOG2
            if current is not None:  # sized for what the last one took
                while (1 << bits_log2) // self.BITS_PER_ENTRY < current.count:
                    bits_log2 += 1
            current = _Generation(at_ts, bits_log2)
            gens.append(current)
        if at_ts is not None:
            current.first_ts = at_ts if current.first_ts is None else current.first_ts
            current.last_ts = at_ts if current.last_ts is None else max(current.last_ts, at_ts)
        current.add_many(hashes)
        self.count += len(hashes)

    def forget(self, before_ts: float) -> int:
        """Forget the generations whose newest prune is older than ``before_ts -
        horizon_s`` (called by every prune at ``before_ts``); returns how many records."""
        gens, limit, forgotten = self._generations, before_ts - self.horizon_s, 0
        while gens and gens[0].last_ts is not None and gens[0].last_ts < limit:
            gen = gens.popleft()
            assert gen.last_ts is not None  # (the loop's condition; per generation, not per record)
            forgotten += gen.count
            self.forgotten_through = gen.last_ts if self.forgotten_through is None else max(
                self.forgotten_through, gen.last_ts)
        self.count -= forgotten
        self.forgotten += forgotten
        return forgotten

    def __contains__(self, block_hash: int) -> bool:
        return any(block_hash in gen for gen in reversed(self._generations))

    @property
    def bytes_used(self) -> int:
        return sum(len(stage.bits) for gen in self._generations for stage in gen.stages)
