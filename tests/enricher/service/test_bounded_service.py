"""The service's bounded structures: configuration and what /metrics shows of them."""

from __future__ import annotations

import pytest


def test_aged_out_horizon_is_configured_validated_and_reaches_the_index():
    from kvmiss.enricher.service.serve import Service
    from kvmiss.schemas.config import ConfigError, HistoryConfig, parse_config

    assert HistoryConfig().aged_out_horizon_s == 3600.0
    config = parse_config('[metrics]\nlisten = ""\n[[workers]]\nid = "A"\nendpoint = "tcp://127.0.0.1:1"\n'
                          '[history]\naged_out_horizon_s = 7200\n')
    assert Service(config).index.aged_out_horizon_s == 7200.0
    for bad in ("0", "-5", "nan"):
        with pytest.raises(ConfigError, match="aged_out_horizon_s"):
            parse_config(f"[history]\naged_out_horizon_s = {bad}\n")


def test_the_aged_out_filter_is_shown_on_metrics_remembered_bytes_and_forgotten():
    from prometheus_client.openmetrics.exposition import generate_latest

    from kvmiss.enricher.service.serve import Service
    from kvmiss.schemas.config import parse_config
    from kvmiss.schemas.events import BlockRemoved, BlockStored
    from kvmiss.schemas.stream import AppliedBatch, RunStart

    config = parse_config('[metrics]\nlisten = ""\n[[workers]]\nid = "A"\nendpoint = "tcp://127.0.0.1:1"\n'
                          '[history]\nretention_s = 10\naged_out_horizon_s = 20\n')
    service = Service(config)
    for seq in range(100):  # one block stored and removed every engine second
        events = [BlockStored(block_hashes=[1000 + seq], parent_block_hash=None, block_size=16),
                  BlockRemoved(block_hashes=[1000 + seq])]
        service.index.apply(AppliedBatch(worker="A", epoch=0, seq=seq, ts=float(seq), recv_ts=float(seq),
                                         events=events, run_start_seq=0, run_start=RunStart.EPOCH_START))
        service.index.prune(float(seq))
    text = generate_latest(service.registry).decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line.startswith("kvmiss_index_aged_out")}
    # at engine time 99: dropped at prunes 10..99 (records closed before 0..89); the
    # generations (5 s each) of prunes older than 99 - 10 - 20 = 69 are forgotten
    assert 20 <= values["kvmiss_index_aged_out_remembered"] <= 26
    assert values["kvmiss_index_aged_out_bytes"] > 0
    assert values["kvmiss_index_aged_out_forgotten_total"] + values["kvmiss_index_aged_out_remembered"] == 89


# --- in-process twins: simulated hours, the structure's size stops growing -----------------------


def test_judged_requests_stay_bounded_over_hours_of_traffic_and_a_trace_that_never_ends():
    """An hour at 5 requests/s in fresh traces plus one trace that gets a request every
    second for the whole run (an agent session, or a sender putting every span in one
    trace): the remembered traces stay at rate x keep_s, the endless trace at its newest 64
    requests (it held every request it ever had, 3,600 by the end, and each add copied them)."""
    import tracemalloc

    from kvmiss.enricher.otlp.assembly import Assembly, Fragment, JudgedRequests
    from kvmiss.enricher.otlp.spans import SpanFacts

    def assembly(trace: bytes, request_id: str) -> Assembly:
        a = Assembly(trace, request_id, 0.0)
        a.fragments.append(Fragment(SpanFacts(request_id=request_id), None, None))
        return a

    judged = JudgedRequests(keep_s=25.0)
    session = b"s" * 16
    sizes = []
    tracemalloc.start()
    try:
        for second in range(3600):
            now = float(second)
            for k in range(5):
                judged.add(assembly(second.to_bytes(8, "big") + k.to_bytes(8, "big"), f"r{second}-{k}"),
                           b"span", {"kvmiss.label": "hit"}, now)
            judged.add(assembly(session, f"step{second}"), b"span", {"kvmiss.label": "no_match"}, now)
            judged.touch(session, now)
            judged.expire(now)
            if second % 300 == 299:
                sizes.append((len(judged), tracemalloc.get_traced_memory()[0]))
    finally:
        tracemalloc.stop()
    assert all(n <= 5 * 26 + 1 for n, _ in sizes), sizes
    assert len(judged._by_trace[session][1]) == 64 and judged.forgotten_in_trace == 3600 - 64
    assert judged.judged_request(assembly(session, "step3599")) is not None  # the newest are kept
    second_half = [m for _, m in sizes[len(sizes) // 2:]]
    assert max(second_half) - second_half[0] < 64 * 1024, sizes


def _pipeline(index, clock):
    from kvmiss.enricher.core.attribution import Attributor
    from kvmiss.enricher.service.pipeline import Pipeline

    class Sink:
        def has_capacity(self, spans: int) -> bool:
            return True

        def put(self, request, tag=None) -> bool:
            return True

    return Pipeline(Attributor(index), Sink(), clock=clock, judge_on_arrival=True)


def _router_request(worker: str, request_id: str, trace: bytes):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    req = ExportTraceServiceRequest()
    span = req.resource_spans.add().scope_spans.add().spans.add(trace_id=trace, span_id=trace[:8], name="router")
    for key, value in (("gen_ai.request.id", request_id), ("kvmiss.route.worker", worker)):
        kv = span.attributes.add()
        kv.key, kv.value.string_value = key, value
    for key, value in (("gen_ai.usage.input_tokens", 48), ("gen_ai.usage.cache_read.input_tokens", 16),
                       ("kvmiss.lookup_time_unix_nano", 10**18)):
        kv = span.attributes.add()
        kv.key, kv.value.int_value = key, value
    kv = span.attributes.add()
    kv.key = "kvmiss.block_hashes"
    for h in (7, 8, 9):
        kv.value.array_value.values.add().int_value = h
    return req


def test_span_named_workers_nobody_follows_are_bounded_and_forgotten_over_hours():
    """A new worker name every 10 s for three simulated hours (pods that come and go, which
    no [[workers]] entry follows): the unsubscribed registry holds at most 64 names, and
    once spans stop naming them it empties after unsubscribed_keep_s."""
    import asyncio

    from kvmiss.enricher.core.index import ResidencyIndex
    from kvmiss.enricher.service.pipeline import MAX_UNSUBSCRIBED

    clock = type("Clock", (), {"t": 0.0, "__call__": lambda self: self.t})()
    pipe = _pipeline(ResidencyIndex(["A"]), clock)
    largest = 0
    for step in range(3 * 360):
        clock.t = step * 10.0
        trace = step.to_bytes(16, "big")
        asyncio.run(pipe.consume(_router_request(f"pod-{step}", f"r{step}", trace)))
        pipe.poll(clock.t)
        largest = max(largest, len(pipe.unsubscribed))
    assert 0 < largest <= MAX_UNSUBSCRIBED
    assert sum(pipe.stats.verdicts.values()) == 3 * 360  # every request judged, none held
    clock.t += pipe.unsubscribed_keep_s + 1
    pipe.poll(clock.t)
    assert not pipe.unsubscribed


def test_verdict_counters_of_released_workers_fold_into_untracked():
    """A fleet whose workers come and go for ever: counters keyed by every id ever seen
    would grow for as long as kvmiss runs. Once the index releases a departed worker (past
    retention), its counts move to "untracked", the label /metrics already showed for it."""
    from kvmiss.enricher.core.index import ResidencyIndex
    from kvmiss.schemas.attribution import Label, Owner, RequestFacts, Verdict
    from kvmiss.schemas.config import WorkerSpec
    from kvmiss.schemas.fleet import FleetChange

    index = ResidencyIndex(retention_s=30.0)
    clock = type("Clock", (), {"t": 0.0, "__call__": lambda self: self.t})()
    pipe = _pipeline(index, clock)
    verdict = Verdict(label=Label.NO_MATCH, owner=Owner.APPLICATION, reason="r", missed_tokens=32)
    total = 0
    for generation in range(50):  # 50 workers in turn, each judged 3 times, then gone
        worker, at = f"pod-{generation}", generation * 100.0
        index.apply_fleet_change(FleetChange(at=at, source="file", joined=(
            WorkerSpec(id=worker, endpoint=f"tcp://127.0.0.1:{2000 + generation}"),)))
        for _ in range(3):
            key = pipe.metric_key(RequestFacts(prompt_tokens=48, cached_tokens=16, block_size=16, worker=worker),
                                  verdict)
            pipe.stats.verdicts[key] += 1
            pipe.stats.missed_tokens[key] += 32
            total += 1
        index.apply_fleet_change(FleetChange(at=at + 10, source="file", departed=(worker,)))
        index.prune(at + 90)  # releases workers that left more than retention + band ago
        clock.t = at + 90
        pipe.poll(clock.t)
    assert len(pipe.stats.verdicts) <= 3, pipe.stats.verdicts  # untracked + the workers not yet released
    assert sum(pipe.stats.verdicts.values()) == total and sum(pipe.stats.missed_tokens.values()) == 32 * total
    assert pipe.stats.verdicts[(Label.NO_MATCH, "", "untracked")] >= total - 6
