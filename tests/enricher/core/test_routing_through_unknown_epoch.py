"""A routing_miss is proven by another member's hold of the first missed block, whatever the
chosen worker's own history says -- even when which of its lifetimes served the lookup is open
(a silent outage of its stream, then a restart), as long as no lifetime it may have been in
could have given a label above routing_miss (an offload tier: transfer_failure; a hybrid's
window group: window_limit). docs/HISTORY.md, "An open epoch does not hide a routing miss"."""

from __future__ import annotations

from fleet_builders import H, WorkerFeed, request, stored

from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.evidence import gather
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.schemas.attribution import History, Label


def restarted_a_and_holding_b(tier: bool = False) -> tuple[ResidencyIndex, float]:
    """A's stream goes silent, A restarts 10 s later; B stored H before and holds it. The
    lookup falls between A's two lifetimes."""
    index = ResidencyIndex()
    old = WorkerFeed("A", epoch=0)
    for b in old.batches(range(0, 5), {2: [stored(H, medium="cpu")]} if tier else {}):
        index.apply(b)
    new = WorkerFeed("A", epoch=1, ts0=old.ts(4) + 10)
    for b in new.batches(range(0, 3)):
        index.apply(b)
    holder = WorkerFeed("B", epoch=0, ts0=old.ts(0) - 1)
    for b in holder.batches(range(0, 40), {1: [stored(H)]}):
        index.apply(b)
    return index, old.ts(4) + 3


def test_another_members_proven_hold_is_a_routing_miss_though_the_epoch_is_open():
    index, t = restarted_a_and_holding_b()
    evidence = gather(index, request("A", t))
    assert evidence.history is History.EPOCH_UNKNOWN and [h.worker for h in evidence.holders] == ["B"]
    verdict = Attributor(index).attribute(request("A", t))
    assert verdict.label is Label.ROUTING_MISS and verdict.holders == 1


def test_with_no_holder_the_open_epoch_stays_unknown_epoch():
    index, t = restarted_a_and_holding_b()
    facts = request("A", t, first_miss=H + 999)  # a block nobody stored
    assert Attributor(index).attribute(facts).label is Label.UNKNOWN_EPOCH


def test_a_lifetime_with_an_offload_tier_keeps_the_epoch_open():
    # The old lifetime had a CPU tier: had it served t, the block may have been there
    # (transfer_failure outranks routing_miss), so nothing is claimed.
    index, t = restarted_a_and_holding_b(tier=True)
    assert gather(index, request("A", t)).holders == ()
    assert Attributor(index).attribute(request("A", t)).label is Label.UNKNOWN_EPOCH


def test_an_instance_the_index_does_not_hold_keeps_the_epoch_open():
    index, t = restarted_a_and_holding_b()
    assert Attributor(index).attribute(request("A", t, instance_hint="pod-9")).label is Label.UNKNOWN_EPOCH
