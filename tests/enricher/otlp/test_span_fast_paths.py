"""The fast span paths (enricher/otlp/spans.py, assembly.py, enricher/service/pipeline.py) against the plain rules
they replace, kept here as references: reading every attribute of every element one by one,
copying every field of every fragment, upserting through `add()`.

Each property draws spans, values or verdicts, runs both and requires the same result --
facts, names of unusable attributes, exported bytes."""

from __future__ import annotations

import asyncio
import enum
import math
import os

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1 import trace_pb2

from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.core.verdict import needs_index
from kvmiss.enricher.otlp import spans as S
from kvmiss.enricher.otlp.assembly import ENGINE_FACTS, FINISH_FACTS, Assembly, Fragment, to_request_facts
from kvmiss.enricher.service.pipeline import WAIT_BUCKETS, PendingBatch, Pipeline, WaitHistogram
from kvmiss.schemas import span_attributes as names
from kvmiss.schemas.attribution import (
    Divergence,
    DivergenceKind,
    History,
    Label,
    Owner,
    TransferAttempt,
    TransferResult,
    Verdict,
    WindowStart,
)
from kvmiss.schemas.events import MASK64
from kvmiss.schemas.span_attributes import InputNames

SETTINGS = settings(max_examples=int(os.environ.get("KVMISS_FUZZ_EXAMPLES", 300)), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
INT64 = st.integers(-(2**63), 2**63 - 1)


# --- references: the plain rules --------------------------------------------------------------


def unwrap_reference(value: AnyValue):
    """An AnyValue as the SDK would hold it, every array element looked at one by one."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [unwrap_reference(item) for item in value.array_value.values]
    if kind in ("string_value", "int_value", "double_value", "bool_value"):
        return getattr(value, kind)
    return S._UNUSABLE


def read_reference(reader: S.SpanReader, span, bad: list[str], resource_worker=None):
    hits = [(kv.key, unwrap_reference(kv.value)) for kv in span.attributes if reader.is_input(kv.key)]
    if not hits:
        return None
    return reader._facts(hits, span.start_time_unix_nano, bad, span.name, resource_worker, span.end_time_unix_nano)


def upsert_reference(span, values: dict, drop=()) -> None:
    remove = set(values) | set(drop)
    if any(key in names.OUTPUTS for key in values):  # a verdict: no stale output stays beside it
        remove |= set(names.OUTPUTS)
    kept = [kv for kv in span.attributes if kv.key not in remove]
    copies = [type(kv)() for kv in kept]
    for copy, kv in zip(copies, kept):
        copy.CopyFrom(kv)
    del span.attributes[:]
    span.attributes.extend(copies)
    for key, value in values.items():
        kv = span.attributes.add()
        kv.key = key
        S._set(kv, value)


def merged_reference(assembly: Assembly) -> S.SpanFacts:
    out = S.SpanFacts()
    ordered = sorted(assembly.fragments, key=lambda f: f.facts.engine_lookup)
    for fragment in ordered:
        for field in fragment.facts.__struct_fields__:
            value = getattr(fragment.facts, field)
            if value is not None and getattr(out, field) is None and field != "transfer":
                setattr(out, field, value)
    for fragment in assembly.fragments:
        if fragment.facts.engine_lookup:
            for field in ENGINE_FACTS:
                value = getattr(fragment.facts, field)
                if value is not None:
                    setattr(out, field, value)
            break
    for fragment in assembly.fragments:  # vLLM's llm_request (its time in queue) gives the what-if facts
        if fragment.facts.queue_lookup_time is not None and not fragment.facts.engine_lookup:
            for field in FINISH_FACTS:
                value = getattr(fragment.facts, field)
                if value is not None:
                    setattr(out, field, value)
            break
    for fragment in assembly.fragments:
        chain = fragment.facts.block_hashes
        if chain is not None and len(chain) > len(out.block_hashes or ()):
            out.block_hashes = chain
    if out.instance is None:
        out.instance = next((f.instance for f in assembly.fragments if f.instance), None)
    return out


def verdict_attributes_reference(verdict: Verdict, lookup_time=None) -> dict:
    out = {names.LABEL: verdict.label.value, names.OWNER: verdict.owner.value, names.REASON: verdict.reason}
    if verdict.history is not None:
        out[names.HISTORY] = verdict.history.value
    if verdict.first_miss_block is not None:
        out[names.FIRST_MISS_BLOCK] = verdict.first_miss_block
        out[names.MISSED_TOKENS] = verdict.missed_tokens
        out[names.HOLDERS] = verdict.holders
    optional = {
        names.FIRST_MISS_DIGEST: verdict.first_miss_digest, names.EVICTION_AGE_MS: verdict.eviction_age_ms,
        names.EPOCH: verdict.epoch, names.STORED_SEQ: verdict.stored_seq, names.REMOVED_SEQ: verdict.removed_seq,
        names.GAP_FROM_SEQ: verdict.gap_from_seq, names.GAP_TO_SEQ: verdict.gap_to_seq,
        names.WINDOW_START: verdict.window_start.value if verdict.window_start else None,
    }
    out.update({k: v for k, v in optional.items() if v is not None})
    if verdict.extra_key_kinds:
        out[names.EXTRA_KEY_KINDS] = list(verdict.extra_key_kinds)
    if verdict.window_start_ts is not None and lookup_time is not None:
        out[names.WINDOW_SECONDS] = round(lookup_time - verdict.window_start_ts, 3)
    if verdict.divergence is not None:
        out[names.DIVERGENCE_KIND] = verdict.divergence.kind.value
        if verdict.divergence.first_token_index is not None:
            out[names.DIVERGENCE_TOKEN] = verdict.divergence.first_token_index
    return out


def as_dict(facts):
    """A comparable form (repr: NaN reads equal to NaN)."""
    return None if facts is None else repr(msgspec.structs.asdict(facts))


# --- strategies ------------------------------------------------------------------------------


@st.composite
def any_values(draw, depth: int = 0, ints_likely: bool = False) -> AnyValue:
    value = AnyValue()
    kinds = ["string", "int", "double", "bool", "bytes", "array", "kvlist", "empty"]
    kind = draw(st.sampled_from(["int", "int_array"] if ints_likely else kinds) if not ints_likely
                else st.sampled_from(["int_array", "int_array", "mixed_array"] + kinds))
    if kind == "string":
        value.string_value = draw(st.sampled_from(["", "12", "-7", " 3 ", "--5", "\u00b2", "9" * 30, "x"]) | st.text(max_size=8))
    elif kind == "int":
        value.int_value = draw(st.sampled_from([0, 1, -1, 2**63 - 1, -(2**63)]) | INT64)
    elif kind == "double":
        value.double_value = draw(st.sampled_from([0.0, -0.0, 16.0, 0.25, 1e30, math.inf, math.nan]) | st.floats())
    elif kind == "bool":
        value.bool_value = draw(st.booleans())
    elif kind == "bytes":
        value.bytes_value = draw(st.binary(max_size=8))
    elif kind == "int_array":
        value.array_value.SetInParent()
        for n in draw(st.lists(st.sampled_from([0, -1, 2**63 - 1, -(2**63)]) | INT64, max_size=70)):
            value.array_value.values.add().int_value = n
    elif kind in ("array", "mixed_array") and depth < 2:
        value.array_value.SetInParent()
        for item in draw(st.lists(any_values(depth + 1, ints_likely=kind == "mixed_array"), max_size=6)):
            value.array_value.values.add().CopyFrom(item)
    elif kind == "kvlist" and depth < 2:
        value.kvlist_value.SetInParent()
        kv = value.kvlist_value.values.add()
        kv.key = "k"
        kv.value.CopyFrom(draw(any_values(depth + 1)))
    return value


def _input_keys(inputs: InputNames) -> list[str]:
    return sorted({a for field in inputs.__struct_fields__ for a in getattr(inputs, field)})


CUSTOM = InputNames(prompt_tokens=["usage.in", "gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens"],
                    block_hashes=["router.chain", "kvmiss.block_hashes"], token_ids=["router.tokens"],
                    worker=["router.backend", "kvmiss.route.worker"],
                    output_tokens=["router.completion_tokens", "gen_ai.usage.completion_tokens"])
READERS = {"default": S.SpanReader(), "custom": S.SpanReader(CUSTOM)}
NOISE = ["http.method", "gen_ai.request.model", "url.path", names.LABEL, names.REASON, names.EXTRA_KEY_KINDS,
         "kvmiss.token_ids", "kvmiss.extra_keys"]


@st.composite
def spans(draw, reader_name: str) -> trace_pb2.Span:
    inputs = InputNames() if reader_name == "default" else CUSTOM
    keys = _input_keys(inputs) + NOISE
    span = trace_pb2.Span(name=draw(st.sampled_from(["route", names.PREFIX_LOOKUP_SPAN])),
                          start_time_unix_nano=draw(st.integers(0, 2**64 - 1)),
                          end_time_unix_nano=draw(st.sampled_from([0, 1, 2**64 - 1]) | st.integers(0, 2**64 - 1)))
    for key in draw(st.lists(st.sampled_from(keys), max_size=12)):  # repeats included
        kv = span.attributes.add()
        kv.key = key
        if draw(st.integers(0, 20)):  # now and then a KeyValue without a value
            chain = key in ("kvmiss.block_hashes", "router.chain", "kvmiss.token_ids", "router.tokens")
            kv.value.CopyFrom(draw(any_values(ints_likely=chain)))
    return span


# --- reading ---------------------------------------------------------------------------------


@SETTINGS
@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=80))
def test_the_c_chain_decoder_equals_reading_each_element_for_any_uint64(hashes):
    value = AnyValue()
    for h in hashes:  # as OTel carries them: int64 two's complement
        value.array_value.values.add().int_value = h - (1 << 64) if h >= 1 << 63 else h
    assert S._int_array(value, S._ArrayU64) == hashes
    assert S._int_array(value, S._ArrayI64) == [item.int_value for item in value.array_value.values]
    assert S._hash_list(S._unwrap(value)) == [item.int_value & MASK64 for item in value.array_value.values]


@SETTINGS
@given(any_values(ints_likely=True))
def test_the_c_chain_decoder_takes_only_arrays_of_ints_and_the_slow_rule_gives_the_same(value):
    fast = S._int_array(value, S._ArrayI64)
    reference = unwrap_reference(value)
    all_ints = (isinstance(reference, list) and reference != []
                and all(type(item) is int for item in reference))
    assert (fast is not None) == all_ints
    if all_ints:
        assert fast == reference
        assert S._int_array(value, S._ArrayU64) == [i & MASK64 for i in reference]
    # whatever the array holds, the converters see the same Python value
    assert S._hash_list(S._unwrap(value)) == S._hash_list(reference)
    assert S._int_list(S._unwrap(value)) == S._int_list(reference)
    assert S._str_list(S._unwrap(value)) == S._str_list(reference)


@pytest.mark.parametrize("reader_name", sorted(READERS))
@SETTINGS
@given(data=st.data())
def test_one_pass_reading_equals_the_plain_rules(reader_name, data):
    reader = READERS[reader_name]
    span = data.draw(spans(reader_name))
    worker = data.draw(st.sampled_from([None, "w-res"]))
    bad_fast: list[str] = []
    bad_reference: list[str] = []
    fast = reader.read(span, bad_fast, resource_worker=worker)
    reference = read_reference(reader, span, bad_reference, resource_worker=worker)
    assert as_dict(fast) == as_dict(reference)
    assert bad_fast == bad_reference
    found = reader.scanner(reader.raw_names())(span, None, worker)
    if found is not None and found[0] is not None:  # the fields dict is the facts' non-None fields
        expected = {k: v for k, v in msgspec.structs.asdict(found[0]).items()
                    if v is not None and k != "engine_lookup"}
        assert found[1].keys() == expected.keys()
        assert repr([found[1][k] for k in expected]) == repr(list(expected.values()))


@pytest.mark.parametrize("reader_name", sorted(READERS))
@SETTINGS
@given(data=st.data())
def test_marks_name_every_raw_input_and_output_where_it_is(reader_name, data):
    reader = READERS[reader_name]
    drop = reader.raw_names(keep_block_hashes=data.draw(st.booleans()))
    span = data.draw(spans(reader_name))
    _, marks = reader.scan(span, [], drop=drop)
    expected = [(i, kv.key) for i, kv in enumerate(span.attributes) if kv.key in drop or kv.key in names.OUTPUTS]
    if not expected:
        assert marks is None
        return
    assert marks.at == expected and marks.count == len(span.attributes)
    assert marks.raw == sum(1 for _, key in expected if key in drop)
    stripped, reference = trace_pb2.Span(), trace_pb2.Span()
    stripped.CopyFrom(span)
    reference.CopyFrom(span)
    S.strip_marked(stripped, marks, drop)
    S.strip_raw_inputs(reference, drop)
    assert stripped == reference


def test_a_chain_with_an_element_of_another_kind_is_a_bad_attribute_and_the_span_passes_through():
    index = ResidencyIndex(["w0"])
    sink: list = []

    class Sink:
        def has_capacity(self, spans):
            return True

        def put(self, request, tag=None):
            sink.append(request)
            return True

    pipe = Pipeline(Attributor(index), Sink(), clock=lambda: 0.0, judge_on_arrival=True)
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8)
    for key, value in (("gen_ai.request.id", "r1"), ("kvmiss.route.worker", "w0")):
        kv = span.attributes.add(key=key)
        kv.value.string_value = value
    kv = span.attributes.add(key="kvmiss.block_hashes")
    kv.value.array_value.values.add().int_value = 7
    kv.value.array_value.values.add().string_value = "not a hash"
    kv.value.array_value.values.add()  # no value at all
    asyncio.run(pipe.consume(request))
    pipe.poll(final=True)
    assert pipe.stats.bad_attributes["kvmiss.block_hashes"] == 1
    assert len(sink) == 1 and pipe.stats.spans_out == 1
    exported = {kv.key: kv.value for kv in sink[0].resource_spans[0].scope_spans[0].spans[0].attributes}
    assert "kvmiss.block_hashes" not in exported  # stripped all the same
    assert list(exported)[:2] == ["gen_ai.request.id", "kvmiss.route.worker"]
    assert exported[names.LABEL].string_value == "unknown_history"  # no counts on it: facts incomplete


# --- writing ---------------------------------------------------------------------------------


class Color(str, enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 3


output_values = (st.text(max_size=12) | st.sampled_from(["", "hit", "é", "\U0001f600"]) | INT64 | st.booleans()
                 | st.floats() | st.sampled_from([0.0, -0.0, math.nan, math.inf]) | st.sampled_from([Color.RED, Level.HIGH])
                 | st.lists(st.text(max_size=4) | st.integers(0, 9), max_size=3)
                 | st.tuples(st.text(max_size=4)) | st.just([]) | st.just(()))


@SETTINGS
@given(st.dictionaries(st.sampled_from(list(names.OUTPUTS) + ["other", ""]), output_values, max_size=8),
       st.lists(st.sampled_from(list(names.OUTPUTS[:4]) + ["other", "kvmiss.token_ids"]), max_size=5))
def test_upserts_through_one_merge_build_what_add_builds(values, existing):
    span = trace_pb2.Span(name="s")
    for key in existing:
        span.attributes.add(key=key).value.string_value = "old"
    fast, reference = trace_pb2.Span(), trace_pb2.Span()
    fast.CopyFrom(span)
    reference.CopyFrom(span)
    drop = frozenset({"kvmiss.token_ids"})
    S.upsert_attributes(fast, values, drop=drop)
    upsert_reference(reference, values, drop=drop)
    assert fast.SerializeToString() == reference.SerializeToString()
    marked = trace_pb2.Span()
    marked.CopyFrom(span)
    _, marks = S.SpanReader().scan(marked, [], drop=drop)
    S.upsert_marked(marked, values, marks, drop)
    assert marked.SerializeToString() == reference.SerializeToString()


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, "\ud800", ["ok", "\udfff"]])
def test_values_add_refuses_are_still_refused_the_same_way(value):
    fast, reference = trace_pb2.Span(), trace_pb2.Span()
    with pytest.raises(Exception) as expected:
        upsert_reference(reference, {"kvmiss.label": value})
    with pytest.raises(type(expected.value)):
        S.upsert_attributes(fast, {"kvmiss.label": value})


def test_a_marked_span_changed_since_its_scan_is_rescanned():
    drop = frozenset({"kvmiss.token_ids"})
    span = trace_pb2.Span()
    for key in ("a", "kvmiss.token_ids", "kvmiss.label"):
        span.attributes.add(key=key).value.string_value = "x"
    _, marks = S.SpanReader().scan(span, [], drop=drop)
    del span.attributes[0]  # positions moved: the marks no longer hold
    S.upsert_marked(span, {"kvmiss.label": "hit"}, marks, drop)
    assert [(kv.key, kv.value.string_value) for kv in span.attributes] == [("kvmiss.label", "hit")]
    span.attributes.add(key="kvmiss.token_ids")
    S.strip_marked(span, marks, drop)
    assert [kv.key for kv in span.attributes] == ["kvmiss.label"]


verdicts = st.builds(
    Verdict, label=st.sampled_from(Label), owner=st.sampled_from(Owner), reason=st.text(max_size=20),
    history=st.none() | st.sampled_from(History), first_miss_block=st.none() | st.integers(0, 10**6),
    first_miss_digest=st.none() | st.text(max_size=10), extra_key_kinds=st.lists(st.text(max_size=4), max_size=2).map(tuple),
    missed_tokens=st.integers(0, 10**6), eviction_age_ms=st.none() | st.integers(0, 10**9),
    holders=st.integers(0, 8), epoch=st.none() | st.integers(0, 9), stored_seq=st.none() | st.integers(0, 2**40),
    removed_seq=st.none() | st.integers(0, 2**40), window_start=st.none() | st.sampled_from(WindowStart),
    window_start_ts=st.none() | st.floats(0, 2e9), gap_from_seq=st.none() | st.integers(0, 99),
    gap_to_seq=st.none() | st.integers(0, 99),
    divergence=st.none() | st.builds(Divergence, kind=st.sampled_from(DivergenceKind),
                                     first_token_index=st.none() | st.integers(0, 999)))


@SETTINGS
@given(verdicts, st.none() | st.floats(0, 2e9))
def test_verdict_attributes_are_the_same_entries_in_the_same_order(verdict, lookup_time):
    fast = S.verdict_attributes(verdict, lookup_time)
    reference = verdict_attributes_reference(verdict, lookup_time)
    assert list(fast.items()) == list(reference.items())


# --- assembly --------------------------------------------------------------------------------


span_facts = st.builds(
    S.SpanFacts, request_id=st.none() | st.sampled_from(["r1", "r1-abcdefgh"]),
    prompt_tokens=st.none() | st.integers(0, 999), cached_tokens=st.none() | st.integers(0, 999),
    block_size=st.none() | st.sampled_from([0, 16]), worker=st.none() | st.sampled_from(["w0", "w1"]),
    block_hashes=st.none() | st.lists(st.integers(0, 9), max_size=4), instance=st.none() | st.just("i"),
    lookup_time=st.none() | st.floats(0, 10), queue_lookup_time=st.none() | st.floats(0, 10),
    extra_key_kinds=st.none() | st.lists(st.just("lora"), max_size=1),
    transfer=st.none() | st.builds(TransferAttempt, st.sampled_from(TransferResult), st.none() | st.just("cpu")),
    resource_worker=st.none() | st.just("w2"), engine_lookup=st.booleans(), route_policy=st.none() | st.just("p"),
    output_tokens=st.none() | st.integers(0, 999), finish_time=st.none() | st.floats(0, 10))


@SETTINGS
@given(st.lists(st.tuples(span_facts, st.none() | st.sampled_from(["", "inst-a", "inst-b"]), st.booleans()),
                min_size=1, max_size=4))
def test_merging_set_fields_equals_copying_every_field(fragments):
    assembly = Assembly(b"t" * 16, "r1", 0.0)
    for facts, instance, with_fields in fragments:
        fields = ({k: v for k, v in msgspec.structs.asdict(facts).items() if v is not None and k != "engine_lookup"}
                  if with_fields else None)  # as the scanner hands them over, or derived
        assembly.fragments.append(Fragment(facts, None, None, instance, None, fields))
    assert as_dict(assembly.merged()) == as_dict(merged_reference(assembly))
    reference = merged_reference(assembly)
    facts = to_request_facts(assembly, hasher=None, default_block_size=16, errors=[])
    lookup = reference.lookup_time if reference.lookup_time is not None else reference.queue_lookup_time
    if reference.prompt_tokens is None or reference.cached_tokens is None:
        assert set(facts.missing) == {n for n in ("prompt_tokens", "cached_tokens") if getattr(reference, n) is None}
    elif lookup is None and needs_index(reference.prompt_tokens, reference.cached_tokens, reference.block_size or 16,
                                        tuple(f.transfer for f, _, _ in fragments if f.transfer is not None)):
        # a miss is judged at its lookup time, or waits -- unless its own spans prove the label
        assert facts.missing == ("lookup_time",)
    else:
        assert facts.worker == (reference.worker or reference.resource_worker)
        assert facts.block_hashes == reference.block_hashes
        assert facts.lookup_time == (reference.lookup_time if reference.lookup_time is not None
                                     else reference.queue_lookup_time)
        assert facts.instance_hint == reference.instance
        assert facts.transfers == tuple(f.transfer for f, _, _ in fragments if f.transfer is not None)
        assert (facts.finish_time, facts.output_tokens) == (reference.finish_time, reference.output_tokens)


# --- metrics ---------------------------------------------------------------------------------


@SETTINGS
@given(st.lists(st.floats(allow_nan=True) | st.sampled_from(list(WAIT_BUCKETS)), max_size=50))
def test_the_wait_histogram_counts_as_the_cumulative_rule(values):
    h = WaitHistogram()
    for v in values:
        h.observe(v)
    assert h.counts == [sum(1 for v in values if v <= bound) for bound in WAIT_BUCKETS]
    assert h.total == len(values)


def test_a_released_batch_leaves_no_reference_cycle_behind():
    """Fragments point at their batch and the batch at its carriers: released, nothing may
    be left for the cyclic GC (a held request's whole upb arena would wait for a full
    collection)."""
    import gc

    class Discard:
        def has_capacity(self, spans):
            return True

        def put(self, request, tag=None):
            return True

    pipe = Pipeline(Attributor(ResidencyIndex(["w0"])), Discard(), clock=lambda: 0.0, judge_on_arrival=True)

    def batch(n: int) -> ExportTraceServiceRequest:
        request = ExportTraceServiceRequest()
        spans = request.resource_spans.add().scope_spans.add().spans
        for i in range(n):
            span = spans.add(trace_id=bytes([i + 1]) * 16, span_id=b"\x02" * 8)
            for key, value in (("gen_ai.request.id", f"r{i}"), ("kvmiss.route.worker", "w0")):
                span.attributes.add(key=key).value.string_value = value
            for key in ("gen_ai.usage.input_tokens", "gen_ai.usage.cache_read.input_tokens"):
                span.attributes.add(key=key).value.int_value = 32
            span.attributes.add(key="kvmiss.block_hashes").value.array_value.values.add().int_value = 5
            spans.add(trace_id=bytes([i + 1]) * 16, span_id=b"\x03" * 8).attributes.add(
                key="kvmiss.token_ids").value.array_value.values.add().int_value = 1  # raw input, no facts
        return request

    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            coroutine = pipe.consume(batch(8))
            with pytest.raises(StopIteration):
                coroutine.send(None)
        pipe.poll(final=True)
        assert pipe.stats.spans_out == 48 and pipe.pending_spans == 0
        held = [o for o in gc.get_objects() if isinstance(o, (Fragment, PendingBatch))]
        assert held == []  # freed by reference counting alone: no cycle kept them
    finally:
        gc.enable()
