"""The fleet view: a label below routing_miss needs proof that no other tracked worker held
the first-miss block at lookup time; a worker whose hold can be neither proven nor ruled out
(quarantined, behind t, a removal straddling t) leaves the answer unknown. Found by the
demo's ground truth (a quarantined holder made an eviction look like the cause)."""
from fleet_builders import H, WorkerFeed, removed, request, stored

from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.schemas.attribution import Label
from kvmiss.schemas.stream import RunStart


def judge(index, facts):
    return Attributor(index).attribute(facts)


def _b_never_stores_h(index, upto=13):
    b = WorkerFeed("B")
    for batch in b.batches(range(0, upto)):
        index.apply(batch)
    return b


def test_a_quarantined_worker_that_held_the_block_before_its_hole_leaves_routing_open():
    # A stored H at seq 0, then lost seq 6..7 (replay could not fill): quarantined.
    index, a = ResidencyIndex(), WorkerFeed("A")
    for batch in a.batches(range(0, 6), {0: [stored(H)]}):
        index.apply(batch)
    a.start_run(8, RunStart.AFTER_GAP, gap=(6, 7))
    for batch in a.batches(range(8, 13)):
        index.apply(batch)
    b = _b_never_stores_h(index)
    v = judge(index, request("B", b.ts(10) - 0.5))
    # A may well still hold H at t (in the demo it did): routing_miss cannot be ruled out.
    assert v.label is Label.UNKNOWN_HISTORY, v.label


def test_a_worker_whose_history_has_not_reached_the_lookup_leaves_routing_open():
    index, a = ResidencyIndex(), WorkerFeed("A")
    for batch in a.batches(range(0, 6), {0: [stored(H)]}):  # A applied through ts 1005 only
        index.apply(batch)
    b = _b_never_stores_h(index)
    v = judge(index, request("B", b.ts(10) - 0.5))  # t = 1009.5: A is lagging (or idle)
    assert v.label is Label.UNKNOWN_HISTORY, v.label


def test_a_holder_is_found_in_the_lifetime_that_served_the_lookup_even_after_a_restart():
    # A held H continuously from seq 3 through its whole epoch 0 (ts 1000..1020), then
    # restarted (epoch 1 from ts 1030). t = 1015 is inside epoch 0 with full proof.
    index, a0 = ResidencyIndex(), WorkerFeed("A", epoch=0)
    for batch in a0.batches(range(0, 21), {3: [stored(H)]}):
        index.apply(batch)
    a1 = WorkerFeed("A", epoch=1, ts0=1030.0)
    for batch in a1.batches(range(0, 10)):
        index.apply(batch)
    _b_never_stores_h(index, upto=40)
    v = judge(index, request("B", 1015.0))
    assert v.label is Label.ROUTING_MISS, v.label


def test_a_removal_in_the_step_straddling_the_lookup_leaves_routing_open():
    # A stored H at seq 2 and removed it in seq 10, the step whose batch is the first one
    # stamped after t: the removal may have happened after t (A's step ran past t).
    index, a = ResidencyIndex(), WorkerFeed("A")
    for batch in a.batches(range(0, 13), {2: [stored(H)], 10: [removed(H)]}):
        index.apply(batch)
    _b_never_stores_h(index)
    v = judge(index, request("B", a.ts(10) - 0.5))
    assert v.label is Label.UNKNOWN_HISTORY, v.label


def test_workers_that_provably_never_held_the_block_leave_no_match_standing():
    index = ResidencyIndex()
    others = [WorkerFeed(w) for w in ("A", "C")]
    for feed in others:
        for batch in feed.batches(range(0, 13)):
            index.apply(batch)
    b = _b_never_stores_h(index)
    assert judge(index, request("B", b.ts(10) - 0.5)).label is Label.NO_MATCH


def test_a_worker_that_evicted_the_block_before_the_lookup_leaves_no_match_standing():
    index, a = ResidencyIndex(), WorkerFeed("A")
    for batch in a.batches(range(0, 13), {2: [stored(H)], 5: [removed(H)]}):
        index.apply(batch)
    b = _b_never_stores_h(index)
    assert judge(index, request("B", b.ts(10) - 0.5)).label is Label.NO_MATCH
