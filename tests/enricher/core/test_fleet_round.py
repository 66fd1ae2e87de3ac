"""The fleet view's short cut (fleet_view.FleetRound) against judging every other worker one by
one: on random fleets -- gaps, restarts, unsettled epochs, clears, tail confirmations, a second
medium, retention, skewed clocks -- both give the same holders, unresolved reasons and skewed
clocks, in the same order, for every chosen worker, block and lookup time. And the Attributor's
cached round follows the index and the clocks as they change."""

from __future__ import annotations

import random

from fleet_builders import cleared, removed, request, stored
from hypothesis import given, settings, strategies as st

from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.evidence import gather
from kvmiss.enricher.core.fleet_view import FleetRound, _other_worker, _Stepped, _Unsettled, others_at
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.core.membership import Standing
from kvmiss.enricher.core.residency_table import BlockTable, holding
from kvmiss.schemas.attribution import ClockOffset, Holder
from kvmiss.schemas.config import WorkerSpec
from kvmiss.schemas.fleet import FleetChange
from kvmiss.schemas.stream import AppliedBatch, RunStart

IN_BOUND, AHEAD = ClockOffset(0.05, -0.25, 1.25), ClockOffset(-2.0, -0.25, 1.25)
KEYS = [11, 12, 13, 14, 2**64 - 1]


def one_by_one(index, chosen, key, t, clocks):
    """The fleet view as it was: every tracked worker asked in turn (those that left the
    fleet clearly before t are not asked at all)."""
    holders, unresolved, skewed, unsettled, stepped = [], [], [], [], []
    for worker in sorted(index.tracked):
        if worker == chosen or index.membership.standing(worker, t) is Standing.DEPARTED:
            continue
        clock = clocks(worker) if clocks is not None else None
        if clock is not None and not clock.within_bound:
            skewed.append(clock)
            continue
        found = _other_worker(index, worker, key, t, index.tail_margin_s)
        if isinstance(found, Holder):
            holders.append(found)
        elif isinstance(found, _Unsettled):
            unsettled.append(str(found))
        elif isinstance(found, _Stepped):
            stepped.append(str(found))
        elif found is not None:
            unresolved.append(found)
    return tuple(holders), tuple(unresolved), tuple(skewed), tuple(unsettled), tuple(stepped)


class RandomFleet:
    """Applies a random script to a fleet of workers, as the collector would hand it over."""

    def __init__(self, rng: random.Random, workers: int):
        self.rng = rng
        self.index = ResidencyIndex(retention_s=rng.choice([5.0, 30.0, 600.0]), tail_margin_s=0.5,
                                    membership_uncertainty_s=rng.choice([0.0, 0.5, 2.0]))
        self.now = 1000.0
        self.state = {f"w{i}": dict(epoch=0, seq=0, run_start=0, kind=RunStart.EPOCH_START, gap=None,
                                    certain=True) for i in range(workers)}
        self.index.tracked.update(self.state)  # as the service declares its fleet
        self.churn = rng.random() < 0.7  # workers leave and (re)join, as a membership source says

    def step(self) -> None:
        rng, index = self.rng, self.index
        worker = rng.choice(sorted(self.state))
        s = self.state[worker]
        self.now += rng.choice([0.1, 0.5, 1.0, 2.0])
        if rng.random() < 0.03:
            self.now -= rng.choice([0.8, 3.0])  # the host's clock set back (EpochResidency.clock_steps)
        roll = rng.random()
        if self.churn and roll < 0.08:
            at = self.now + rng.choice([-1.0, 0.0, 0.3])
            if index.membership.is_member(worker) and worker in index.tracked:
                index.apply_fleet_change(FleetChange(at=at, source="file", departed=(worker,)))
            else:  # back under the same id: a new stream, its epochs past the old views'
                spec = WorkerSpec(id=worker, endpoint=f"tcp://127.0.0.1:{rng.randint(1000, 2000)}")
                index.apply_fleet_change(FleetChange(at=at, source="file", joined=(spec,)))
                s.update(epoch=index.next_epoch(worker), seq=0, run_start=0, kind=RunStart.EPOCH_START,
                         gap=None, certain=True)
            return
        if roll < 0.05:  # restart: a new lifetime from seq 0
            s.update(epoch=s["epoch"] + 1, seq=0, run_start=0, kind=RunStart.EPOCH_START, gap=None)
        elif roll < 0.10:  # a hole replay could not fill
            gap_from = s["seq"]
            s["seq"] += rng.randint(1, 3)
            s.update(run_start=s["seq"], kind=RunStart.AFTER_GAP, gap=(gap_from, s["seq"] - 1))
        elif roll < 0.13:
            s["certain"] = not s["certain"]
        elif roll < 0.20:
            index.confirm_tail(worker, s["epoch"], s["seq"] - 1, self.now + rng.choice([-1.0, 0.0, 2.0]))
            return
        elif roll < 0.25:
            index.prune(self.now)
            return
        events = []
        for _ in range(rng.randint(0, 3)):
            kind = rng.random()
            key = rng.choice(KEYS)
            medium = rng.choice([None, None, None, "CPU"])
            if kind < 0.5:
                events.append(stored(key, medium=medium))
            elif kind < 0.95:
                events.append(removed(key, medium=medium))
            else:
                events.append(cleared())
        index.apply(AppliedBatch(
            worker=worker, epoch=s["epoch"], seq=s["seq"], ts=self.now, recv_ts=self.now, events=events,
            run_start_seq=s["run_start"], run_start=s["kind"],
            gap_from_seq=s["gap"][0] if s["gap"] else None, gap_to_seq=s["gap"][1] if s["gap"] else None,
            epoch_certain=s["certain"]))
        s["seq"] += 1

    def clocks(self):
        chosen = {w: self.rng.choice([None, IN_BOUND, IN_BOUND, AHEAD]) for w in self.state}
        return chosen.get

    def lookup_times(self) -> list[float]:
        ts = [self.now - d for d in (0.0, 0.25, 1.0, 3.0, 10.0, 40.0, 200.0)]
        ts += [self.now + 0.3, float("nan"), float("inf")]
        return ts


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), workers=st.integers(2, 7), steps=st.integers(1, 120))
def test_the_round_gives_what_asking_every_worker_gives(seed, workers, steps):
    rng = random.Random(seed)
    fleet = RandomFleet(rng, workers)
    for _ in range(steps):
        fleet.step()
        if rng.random() < 0.2:
            clocks = fleet.clocks() if rng.random() < 0.5 else None
            round_ = FleetRound(fleet.index, clocks)
            for t in fleet.lookup_times():
                for chosen in fleet.state:
                    for key in KEYS:
                        assert others_at(fleet.index, chosen, key, t, clocks, fleet=round_) == \
                            one_by_one(fleet.index, chosen, key, t, clocks), (chosen, key, t)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_the_attributors_round_follows_the_index_and_the_clocks(seed):
    """Judged through one Attributor while the fleet changes under it, every request gets
    the evidence a fresh look at the index gives."""
    rng = random.Random(seed)
    fleet = RandomFleet(rng, rng.randint(2, 5))
    measured: dict[str, ClockOffset] = {}
    attributor = Attributor(fleet.index, clocks=measured.get)
    for _ in range(80):
        fleet.step()
        if rng.random() < 0.1:
            measured[rng.choice(sorted(fleet.state))] = rng.choice([IN_BOUND, AHEAD])
            attributor.clocks_changed()
        worker, t = rng.choice(sorted(fleet.state)), fleet.now - rng.choice([0.0, 1.0, 5.0])
        facts = request(worker, t, first_miss=rng.choice(KEYS))
        cached = gather(fleet.index, facts, clocks=measured.get, fleet=attributor.fleet_round())
        assert cached == gather(fleet.index, facts, clocks=measured.get)


def test_holding_finds_exactly_the_tables_with_a_record():
    rng = random.Random(7)
    tables = tuple(BlockTable(0) for _ in range(70))  # more than one prefetch chunk
    keys = [rng.getrandbits(64) for _ in range(50)]
    for table in tables:
        for key in rng.sample(keys, 10):
            table.store([key], 0)
            if rng.random() < 0.5:
                table.remove([key], 1, 1.0)  # a closed record is a record too
    for key in keys + [0, 2**64 - 1]:
        assert holding(key, tables) == [i for i, table in enumerate(tables) if key in table]
    assert holding(-1, tables) == [] and holding("11", tables) == [] and holding(2**64, tables) == []
