"""The pipeline with a fleet that changes (docs/HISTORY.md, "Fleets that change"): a request
routed to a worker no source has announced yet waits (bounded) for it and is judged on its
history once it joined; departed workers are not waited for; a static fleet keeps judging a
span-named stranger at once."""

from __future__ import annotations

import asyncio
import os

from fleet_builders import H, WorkerFeed, removed, stored
from test_pipeline import Clock, attrs, export_request, make

from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.schemas.config import WorkerSpec
from kvmiss.schemas.fleet import FleetChange


def miss(worker: str, request_id: str, t: float = 1020.5, block: int = 77) -> dict:
    return {"name": "router", "trace_id": os.urandom(16), "gen_ai.request.id": request_id,
            "gen_ai.usage.input_tokens": 40, "gen_ai.usage.cache_read.input_tokens": 16,
            "kvmiss.route.worker": worker, "kvmiss.block_hashes": [7, block, 9],
            "kvmiss.lookup_time_unix_nano": int(t * 1e9)}


def a_followed(dynamic: bool) -> ResidencyIndex:
    index, a = ResidencyIndex(["A"], dynamic_membership=dynamic), WorkerFeed("A", ts0=1000.0)
    for batch in a.batches(range(0, 30)):
        index.apply(batch)
    return index


def test_a_request_routed_to_a_worker_not_yet_announced_waits_and_is_judged_on_its_history():
    index = a_followed(dynamic=True)
    clock = Clock(0.0)
    pipe, sink = make(index, clock, judge_on_arrival=True, history_wait_s=5.0)
    asyncio.run(pipe.consume(export_request(miss("C", "on-c", block=H - 2**64))))
    assert pipe.poll() == 0 and sink.spans() == []  # waiting: C may be joining
    # C joins one second later; its stream replays from seq 0: it stored H at 1005, evicted it at 1012.
    index.apply_fleet_change(FleetChange(at=1.0, source="file",
                                         joined=(WorkerSpec(id="C", endpoint="tcp://10.0.0.3:5557"),)))
    c = WorkerFeed("C", epoch=index.next_epoch("C"), ts0=1000.0)
    for batch in c.batches(range(0, 30), {5: [stored(H)], 12: [removed(H)]}):
        index.apply(batch)
    clock.t = 1.5
    assert pipe.poll() == 1
    (span,) = sink.spans()
    assert attrs(span)["kvmiss.label"] == "evicted", attrs(span)
    assert pipe.unsubscribed == {}  # announced: no longer a stranger


def test_a_request_routed_to_a_worker_that_never_joins_is_unknown_after_the_wait():
    index = a_followed(dynamic=True)
    clock = Clock(0.0)
    pipe, sink = make(index, clock, judge_on_arrival=True, history_wait_s=5.0)
    asyncio.run(pipe.consume(export_request(miss("C", "on-c"))))
    clock.t = 4.9
    assert pipe.poll() == 0
    clock.t = 5.0
    assert pipe.poll() == 1
    out = attrs(sink.spans()[0])
    assert out["kvmiss.label"] == "unknown_history" and out["kvmiss.history"] == "untracked"


def test_a_static_fleet_judges_a_span_named_stranger_at_once():
    index = a_followed(dynamic=False)
    pipe, sink = make(index, Clock(0.0), judge_on_arrival=True)
    asyncio.run(pipe.consume(export_request(miss("C", "on-c"))))
    assert len(sink.spans()) == 1 and attrs(sink.spans()[0])["kvmiss.history"] == "untracked"


def test_a_departed_worker_is_not_waited_for_nor_a_stranger_when_spans_name_it():
    index, a, b = ResidencyIndex(["A", "B"], dynamic_membership=True), WorkerFeed("A"), WorkerFeed("B")
    for batch in a.batches(range(0, 30)):
        index.apply(batch)
    for batch in b.batches(range(0, 18)):  # B's stream ends at 1017: it left at 1016
        index.apply(batch)
    clock = Clock(0.0)
    pipe, sink = make(index, clock, judge_on_arrival=True, history_wait_s=5.0)
    asyncio.run(pipe.consume(export_request(miss("A", "before-departure"))))
    assert sink.spans() == []  # B, behind t = 1020.5 by less than the wait, is waited for
    index.apply_fleet_change(FleetChange(at=1016.0, source="file", departed=("B",)))
    pipe.poll()
    assert [attrs(s)["kvmiss.label"] for s in sink.spans()] == ["no_match"]
    # Released later, a late span naming B is its own request's business, not a holder's.
    index.prune(1016.0 + index.retention_s + 10.0)
    assert "B" not in index.tracked
    asyncio.run(pipe.consume(export_request(miss("B", "late"))))
    assert attrs(sink.spans()[-1])["kvmiss.history"] == "untracked" and pipe.unsubscribed == {}


def test_a_worker_that_just_joined_is_waited_for_so_its_history_can_rule_it_out():
    index = a_followed(dynamic=True)  # A: continuous, H never stored
    clock = Clock(1019.0)
    pipe, sink = make(index, clock, judge_on_arrival=True, history_wait_s=5.0)
    index.apply_fleet_change(FleetChange(at=1018.0, source="file",
                                         joined=(WorkerSpec(id="C", endpoint="tcp://10.0.0.3:5557"),)))
    asyncio.run(pipe.consume(export_request(miss("A", "on-a"))))
    assert sink.spans() == []  # C, a member at t, joined 1 s ago and has no history yet: waited for
    c = WorkerFeed("C", epoch=index.next_epoch("C"), ts0=1000.0)
    for batch in c.batches(range(0, 30)):  # replayed from seq 0: C never held the block
        index.apply(batch)
    clock.t = 1020.5
    pipe.poll()
    assert [attrs(s)["kvmiss.label"] for s in sink.spans()] == ["no_match"]


def test_a_joiner_whose_history_never_begins_is_waited_for_no_longer_than_the_wait_after_it_joined():
    index = a_followed(dynamic=True)
    clock = Clock(1016.0)
    pipe, sink = make(index, clock, judge_on_arrival=True, history_wait_s=5.0)
    index.apply_fleet_change(FleetChange(at=1015.0, source="file",
                                         joined=(WorkerSpec(id="C", endpoint="tcp://10.0.0.3:5557"),)))
    asyncio.run(pipe.consume(export_request(miss("A", "on-a"))))
    clock.t = 1019.9
    pipe.poll()
    assert sink.spans() == []
    clock.t = 1020.1
    pipe.poll()
    out = attrs(sink.spans()[0])
    assert out["kvmiss.label"] == "unknown_history" and out["kvmiss.history"] == "lagging", out


def b_holds_h_and_departs_unseen(watched: bool):
    """A and B followed through 1030; B stored H at 1005. The router stops choosing B at 1020
    (its departure is written then); a request on A looks up H at 1020.5. ``watched``: the
    fleet's sources are polled (known through 1020.2 so far), else nothing says how far."""
    index = ResidencyIndex(["A", "B"], dynamic_membership=True, membership_uncertainty_s=2.0)
    if watched:
        index.membership.watched()
        index.membership.seen_through(1020.2)  # the sources were last asked before the departure
    for feed, events in ((WorkerFeed("A", ts0=1000.0), {}), (WorkerFeed("B", ts0=1000.0), {5: [stored(H)]})):
        for batch in feed.batches(range(0, 31), events):
            index.apply(batch)
    clock = Clock(0.0)
    pipe, sink = make(index, clock, judge_on_arrival=True, history_wait_s=5.0)
    asyncio.run(pipe.consume(export_request(miss("A", "on-a", t=1020.5, block=H - 2**64))))
    return index, pipe, sink, clock


def test_a_request_waits_until_the_sources_were_asked_a_band_after_its_lookup():
    """Without the wait, the request is judged before the departure is seen, on a fleet in
    which B is still a member: a routing miss on a worker the router could no longer choose."""
    _, pipe, sink, _ = b_holds_h_and_departs_unseen(False)
    pipe.poll()
    assert attrs(sink.spans()[0])["kvmiss.label"] == "routing_miss"  # what the wait prevents

    index, pipe, sink, _ = b_holds_h_and_departs_unseen(True)
    assert pipe.poll() == 0 and sink.spans() == []  # not known through t + band: waiting
    index.apply_fleet_change(FleetChange(at=1020.0, source="file", departed=("B",)))
    index.membership.seen_through(1022.4)  # asked again, not yet a band (2 s) after t
    assert pipe.poll() == 0
    index.membership.seen_through(1022.6)
    assert pipe.poll() == 1
    out = attrs(sink.spans()[0])  # B left 0.5 s before t, inside the band, holding H: unsettled
    assert out["kvmiss.label"] == "unknown_history" and "not settled" in out["kvmiss.reason"], out


def test_a_request_whose_wait_runs_out_before_the_sources_answer_is_not_judged_on_the_old_fleet():
    """The file cannot be read (or DNS does not answer) from before the departure on: the
    wait runs out with the fleet at t unknown. B, which held H, may have left unseen: not a
    routing miss, an honest unknown naming the membership."""
    _, pipe, sink, clock = b_holds_h_and_departs_unseen(True)
    assert pipe.poll() == 0
    clock.t = 5.1  # the wait (5 s) is over; the sources still have not answered
    assert pipe.poll() == 1
    out = attrs(sink.spans()[0])
    assert out["kvmiss.label"] == "unknown_history" and "not settled" in out["kvmiss.reason"], out


def test_a_router_seen_choosing_a_departed_worker_widens_the_band_and_says_so(caplog):
    """B departs at 1020 (band 0.5 s); a span that chose B for a lookup at 1023 shows the router
    lagging 3 s behind the source: the band becomes 4.5 s, once, with a WARNING, and a miss on A
    near the departure where B held the block is then unsettled, not judged without B."""
    index = ResidencyIndex(["A", "B"], dynamic_membership=True, membership_uncertainty_s=0.5)
    for feed, events in ((WorkerFeed("A", ts0=1000.0), {}), (WorkerFeed("B", ts0=1000.0), {5: [stored(H)]})):
        for batch in feed.batches(range(0, 31), events):
            index.apply(batch)
    index.apply_fleet_change(FleetChange(at=1020.0, source="file", departed=("B",)))
    clock = Clock(0.0)
    pipe, sink = make(index, clock, judge_on_arrival=True, history_wait_s=5.0)
    with caplog.at_level("WARNING", logger="kvmiss.pipeline"):
        asyncio.run(pipe.consume(export_request(miss("B", "late-choice", t=1023.0))))
        pipe.poll()
    assert index.membership.band_s == 4.5 and index.membership.band_widened == 1
    assert [r.getMessage() for r in caplog.records if "after its departure" in r.getMessage()] == [
        "the router chose worker 'B' 3.00 s after its departure, beyond the membership band of 0.50 s: the band is "
        "now 4.50 s ([fleet] membership_uncertainty_s should cover the router's lag behind the membership source)"]
    asyncio.run(pipe.consume(export_request(miss("A", "near", t=1021.0, block=H - 2**64))))
    pipe.poll()
    near = next(attrs(s) for s in sink.spans() if attrs(s)["gen_ai.request.id"] == "near")
    assert near["kvmiss.label"] == "unknown_history" and "not settled" in near["kvmiss.reason"], near


def test_a_router_span_naming_its_candidates_is_judged_on_them():
    """The same departure with the default band: a miss on A 0.2 s after it, where B held the
    block, is unsettled; the same miss from a router that says it chose among A alone is
    judged on A's own history, and one that still listed B is a routing miss."""
    index = ResidencyIndex(["A", "B"], dynamic_membership=True)
    for feed, events in ((WorkerFeed("A", ts0=1000.0), {}), (WorkerFeed("B", ts0=1000.0), {5: [stored(H)]})):
        for batch in feed.batches(range(0, 31), events):
            index.apply(batch)
    index.apply_fleet_change(FleetChange(at=1020.0, source="file", departed=("B",)))
    pipe, sink = make(index, Clock(0.0), judge_on_arrival=True, history_wait_s=5.0)
    for rid, candidates in (("plain", None), ("only-a", ["A"]), ("a-and-b", ["B", "A"])):
        request = export_request(miss("A", rid, t=1020.2, block=H - 2**64))
        if candidates is not None:  # a string array (the helper writes int arrays)
            kv = request.resource_spans[0].scope_spans[0].spans[0].attributes.add()
            kv.key = "kvmiss.route.candidates"
            for worker in candidates:
                kv.value.array_value.values.add().string_value = worker
        asyncio.run(pipe.consume(request))
    pipe.poll()
    labels = {attrs(s)["gen_ai.request.id"]: attrs(s)["kvmiss.label"] for s in sink.spans()}
    assert labels == {"plain": "unknown_history", "only-a": "no_match", "a-and-b": "routing_miss"}
