"""Speculative entries: confirmed by stores, expired by TTL, never evidence of residency."""

from __future__ import annotations

from fleet_builders import H, WorkerFeed, request

from kvmiss.enricher.core.evidence import gather
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.demo.speculative import LatencyReservoir, SpeculativeEntries
from kvmiss.schemas.attribution import Presence


def test_a_store_confirms_a_routed_block_and_measures_route_to_store_latency():
    spec = SpeculativeEntries(ttl_s=2.0)
    spec.route("A", [1, 2], now=100.0)
    spec.stored("A", [2], recv_ts=100.25)
    spec.stored("B", [1], recv_ts=100.30)  # another worker's store confirms nothing
    assert (spec.entered, spec.confirmed) == (2, 1)
    assert spec.latency.percentiles(0.5) == (0.25,)
    assert spec.is_pending("A", 1) and not spec.is_pending("A", 2)


def test_unconfirmed_entries_expire_after_the_ttl_and_are_counted():
    spec = SpeculativeEntries(ttl_s=2.0)
    spec.route("A", [1], now=100.0)
    spec.route("A", [2], now=101.0)
    assert spec.expire(now=101.5) == 0
    assert spec.expire(now=102.0) == 1 and spec.expired == 1
    assert not spec.is_pending("A", 1) and spec.is_pending("A", 2)


def test_the_bound_refuses_and_counts():
    spec = SpeculativeEntries(max_entries=2)
    spec.route("A", [1, 2, 3], now=0.0)
    assert spec.entered == 2 and spec.dropped == 1


def test_percentiles_and_the_suggested_ttl():
    spec = SpeculativeEntries()
    for i in range(100):
        spec.route("A", [i], now=0.0)
        spec.stored("A", [i], recv_ts=i / 100)
    p50, p95, p99 = spec.latency.percentiles(0.5, 0.95, 0.99)
    assert (p50, p95, p99) == (0.5, 0.95, 0.99)
    assert abs(spec.suggested_ttl_s() - 1.485) < 1e-9
    assert LatencyReservoir().percentiles(0.5) == (None,)


def test_a_speculative_entry_is_never_evidence_of_residency():
    index, a = ResidencyIndex(), WorkerFeed("A")
    for b in a.batches(range(0, 10)):
        index.apply(b)
    spec = SpeculativeEntries()
    spec.route("A", [H], now=a.ts(3))
    ev = gather(index, request("A", a.ts(8)))
    assert spec.is_pending("A", H) and ev.presence is Presence.ABSENT
