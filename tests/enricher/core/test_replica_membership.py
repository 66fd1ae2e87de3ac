"""Several replicas of kvmiss follow one fleet, each seeing a change at its own moment. Fed the
same batches, two replicas whose observations of the same joins and departures are at most
twice the uncertainty band apart never contradict each other: for every request their labels
are equal or one of them is unknown_* (docs/HISTORY.md, "Fleets that change": the bound).
Beyond twice the band they can (a test shows a case), which is why the bound is stated for
sources that give a point. Sources that date a change between two answers (DNS, a poll)
give an interval that holds the true time: replicas then never contradict, however far
apart their answers and whatever the band."""

from __future__ import annotations

import random

from fleet_builders import cleared, removed, request, stored
from hypothesis import given, settings, strategies as st

from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.schemas.attribution import Label
from kvmiss.schemas.config import WorkerSpec
from kvmiss.schemas.fleet import FleetChange
from kvmiss.schemas.stream import AppliedBatch, RunStart

KEYS = [11, 12, 13, 14, 15, 16]
UNKNOWN = {Label.UNKNOWN_HISTORY, Label.UNKNOWN_EPOCH}


def script(rng: random.Random):
    """Batches of a small fleet over ~60 s, and membership changes (departures of static
    workers, joins of new ones followed from their seq 0) at true times inside it."""
    static = ["w0", "w1", "w2"]
    joiners = ["j0", "j1"]
    seq = {w: 0 for w in static + joiners}
    run = {w: (0, RunStart.EPOCH_START, None) for w in seq}
    batches: list[AppliedBatch] = []
    now = 1000.0
    for _ in range(rng.randint(60, 200)):
        now += rng.choice([0.05, 0.1, 0.2, 0.5])
        worker = rng.choice(list(seq))
        if rng.random() < 0.01:  # a hole replay could not fill
            gap_from = seq[worker]
            seq[worker] += rng.randint(1, 3)
            run[worker] = (seq[worker], RunStart.AFTER_GAP, (gap_from, seq[worker] - 1))
        events = []
        for _ in range(rng.randint(0, 2)):
            roll, key = rng.random(), rng.choice(KEYS)
            events.append(stored(key) if roll < 0.3 else removed(key) if roll < 0.98 else cleared())
        start, kind, gap = run[worker]
        batches.append(AppliedBatch(
            worker=worker, epoch=0, seq=seq[worker], ts=now, recv_ts=now, events=events,
            run_start_seq=start, run_start=kind, gap_from_seq=gap[0] if gap else None,
            gap_to_seq=gap[1] if gap else None))
        seq[worker] += 1
    end = now
    changes = []
    for worker in rng.sample(static, rng.randint(0, 2)):
        changes.append(("depart", worker, rng.uniform(1000.0, end)))
    for worker in rng.sample(joiners, rng.randint(0, 2)):
        changes.append(("join", worker, rng.uniform(1000.0, end)))
    return static, batches, changes, end


def replica(static, batches, changes, band, shift, since=None) -> Attributor:
    """``since``: worker -> how long before its observed time the answer before it was
    (the change dated between them); none: a point."""
    index = ResidencyIndex(static, membership_uncertainty_s=band, tail_margin_s=0.5)
    for kind, worker, at in changes:
        at += shift[worker]
        earlier = None if since is None else at - since[worker]
        if kind == "depart":
            index.apply_fleet_change(FleetChange(at=at, since=earlier, source="dns", departed=(worker,)))
        else:
            index.apply_fleet_change(FleetChange(at=at, since=earlier, source="dns", joined=(
                WorkerSpec(id=worker, endpoint=f"tcp://10.0.0.9:{5000 + int(worker[1:])}"),)))
    for batch in batches:
        index.apply(batch)
    return Attributor(index)


def disagreements(seed: int, band: float, apart: float, dated: bool = False, y_band: float | None = None,
                  candidates: bool = False):
    """Requests on which two replicas give different labels, neither of them unknown.
    ``dated``: each replica dates each change between two answers, up to ``apart`` apart, that
    hold its true time (as DNS answers do), instead of at a point up to ``apart`` off.
    ``y_band``: the second replica's band, when it differs (the router's own choices widened
    it there and not yet in the first). ``candidates``: every request names the router's
    candidate set (the fleet's true members at its lookup), as both replicas receive it."""
    rng = random.Random(seed)
    static, batches, changes, end = script(rng)
    workers = ("w0", "w1", "w2", "j0", "j1")
    if dated:
        def interval():
            late = {w: rng.uniform(0.0, apart) for w in workers}  # answer after the change
            return late, {w: late[w] + rng.uniform(0.0, apart) for w in workers}  # and before it
        (x_shift, x_since), (y_shift, y_since) = interval(), interval()
    else:
        x_since = y_since = None
        x_shift = {w: rng.uniform(-apart / 2, apart / 2) for w in workers}
        y_shift = {w: x_shift[w] + rng.choice([-apart, apart, rng.uniform(-apart, apart)]) for w in x_shift}
        for w in x_shift:  # at most `apart` between the two replicas' observations
            y_shift[w] = max(x_shift[w] - apart, min(x_shift[w] + apart, y_shift[w]))
    x = replica(static, batches, changes, band, x_shift, x_since)
    y = replica(static, batches, changes, band if y_band is None else y_band, y_shift, y_since)
    found = []
    times = [rng.uniform(1000.0, end) for _ in range(6)]
    times += [at + d * max(band, apart) for _, _, at in changes
              for d in (-3.0, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0)]
    for t in times:
        for chosen in ("w0", "w1", "w2", "j0", "j1"):
            for key in KEYS:
                facts = request(chosen, t, first_miss=key, **(
                    {"route_candidates": members_at(static, changes, t)} if candidates else {}))
                vx, vy = x.attribute(facts).label, y.attribute(facts).label
                if vx != vy and vx not in UNKNOWN and vy not in UNKNOWN:
                    found.append((chosen, key, t, vx, vy))
    return found


def members_at(static: list[str], changes: list, t: float) -> tuple[str, ...]:
    """The fleet's true members at ``t`` (the router's candidate set)."""
    members = set(static)
    for kind, worker, at in sorted(changes, key=lambda c: c[2]):
        if at <= t:
            (members.discard if kind == "depart" else members.add)(worker)
    return tuple(sorted(members))


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), band=st.sampled_from([0.5, 2.0]),
       share=st.floats(0.0, 1.0))
def test_replicas_whose_observations_differ_by_at_most_the_band_never_contradict(seed, band, share):
    assert disagreements(seed, band, apart=share * band) == []


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), band=st.sampled_from([0.5, 2.0]))
def test_the_bound_is_twice_the_band(seed, band):
    assert disagreements(seed, band, apart=2.0 * band) == []


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), band=st.sampled_from([0.0, 0.5, 2.0]),
       apart=st.sampled_from([0.5, 5.0, 30.0]))
def test_replicas_that_date_changes_between_answers_never_contradict(seed, band, apart):
    assert disagreements(seed, band, apart=apart, dated=True) == []


def test_replicas_further_apart_than_twice_the_band_can_contradict():
    """B held H throughout; one replica saw B leave at 1010, the other at 1020 (band 2 s): at
    t = 1015 the first says A's own eviction, the second routing_miss. Both are consistent
    with what each was told; the stated bound is what keeps them from being told this."""
    from fleet_builders import H, WorkerFeed

    labels = []
    for departed_at in (1010.0, 1020.0):
        index, a, b = ResidencyIndex(["A", "B"], membership_uncertainty_s=2.0), WorkerFeed("A"), WorkerFeed("B")
        for x in a.batches(range(0, 40), {3: [stored(H)], 10: [removed(H)]}):
            index.apply(x)
        for x in b.batches(range(0, 40), {4: [stored(H)]}):
            index.apply(x)
        index.apply_fleet_change(FleetChange(at=departed_at, source="file", departed=("B",)))
        labels.append(Attributor(index).attribute(request("A", 1015.0)).label)
    assert labels == [Label.EVICTED, Label.ROUTING_MISS]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), bands=st.sampled_from([(0.5, 1.5), (0.5, 4.5), (2.0, 6.0)]),
       apart=st.sampled_from([0.5, 5.0]))
def test_a_band_widened_in_one_replica_only_never_contradicts(seed, bands, apart):
    """The router's own choices widen the band (`Membership.chosen`) in each replica when that
    replica judges the span that shows the lag: for a while one replica's band is wider. A
    wider band only turns a settled standing into an unsettled one, so labels still differ
    only by unknown."""
    assert disagreements(seed, bands[0], apart=apart, dated=True, y_band=bands[1]) == []


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), band=st.sampled_from([0.5, 2.0]), apart=st.sampled_from([5.0, 30.0]))
def test_replicas_given_the_routers_candidates_never_contradict_however_far_apart(seed, band, apart):
    """With the candidate set on every span the fleet at a lookup is the router's word, the
    same for every replica: their own observations, even far more than twice the band apart,
    no longer matter."""
    assert disagreements(seed, band, apart=apart, candidates=True) == []
