"""The compiled wire scanner (enricher/otlp/_otlpwire.c) against the reference scanner it replaces
on the hot path (`SpanReader.scanner` over the parsed message, enricher/otlp/spans.py).

The rule under test: for the bytes of any request upb accepts, the wire scanner either
answers exactly what the reference reads from the parsed message -- which spans carry an
attribute of interest, their trace ids, facts, set fields and marks -- or abstains (None),
and it never abstains on what a real SDK writes (canonical encoding). Requests are drawn
with the fast-path tests' span strategy and then encoded the way a hostile or merely odd
sender might: fields in any order, unknown fields (groups included) at every level, a
scalar sent twice (the last wins), a sub-message split in two (they merge), a oneof member
sent before another."""

from __future__ import annotations

import asyncio
import math
import os
import struct
from array import array

import pytest
from google.protobuf.descriptor import FieldDescriptor as FD
from hypothesis import given, settings, strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from test_span_fast_paths import CUSTOM, READERS, SETTINGS, spans
from wire_scan_check import check_against_reference

from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.otlp import interfaces, spans as S
from kvmiss.enricher.service.pipeline import Pipeline
from kvmiss.schemas import span_attributes as names
from kvmiss.schemas.events import BlockStored
from kvmiss.schemas.stream import AppliedBatch, RunStart

# Whole requests cost more to draw than single spans: fewer of them (KVMISS_FUZZ_EXAMPLES still rules).
REQUEST_SETTINGS = settings(SETTINGS, max_examples=int(os.environ.get("KVMISS_FUZZ_EXAMPLES", 100)))
compiled = pytest.mark.skipif(not S.WIRE_SCAN,
                              reason="the compiled OTLP wire path is not in use (not built, or KVMISS_PURE_PYTHON_OTLP=1)")


def test_the_compiled_scanner_is_built_where_ci_requires_it():
    if os.environ.get("KVMISS_REQUIRE_ACCELERATED") != "1":
        pytest.skip("set KVMISS_REQUIRE_ACCELERATED=1 to require the compiled scanner")
    assert S.WIRE_SCAN and interfaces.count_spans(b"") == (0, 0)


# --- an encoder that writes what upb accepts, not only what it writes ---------------------------

_WIRE = {FD.TYPE_INT64: 0, FD.TYPE_UINT64: 0, FD.TYPE_INT32: 0, FD.TYPE_UINT32: 0, FD.TYPE_BOOL: 0, FD.TYPE_ENUM: 0,
         FD.TYPE_FIXED64: 1, FD.TYPE_SFIXED64: 1, FD.TYPE_DOUBLE: 1, FD.TYPE_FIXED32: 5, FD.TYPE_SFIXED32: 5,
         FD.TYPE_FLOAT: 5, FD.TYPE_STRING: 2, FD.TYPE_BYTES: 2, FD.TYPE_MESSAGE: 2}
_FIXED = {FD.TYPE_FIXED64: "<Q", FD.TYPE_SFIXED64: "<q", FD.TYPE_DOUBLE: "<d", FD.TYPE_FIXED32: "<I",
          FD.TYPE_SFIXED32: "<i", FD.TYPE_FLOAT: "<f"}


def varint(n: int) -> bytes:
    return S._varint(n & ((1 << 64) - 1))  # negative ints as their 10-byte two's complement


def tag(field: int, wire: int) -> bytes:
    return varint(field << 3 | wire)


def length_delimited(field: int, payload: bytes) -> bytes:
    return tag(field, 2) + varint(len(payload)) + payload


class Oddities:
    """Which liberties the encoder takes (each drawn per request)."""

    def __init__(self, draw, allow: frozenset[str]):
        self.draw = draw
        self.allow = allow

    def maybe(self, what: str) -> bool:
        return what in self.allow and self.draw(st.integers(0, 5)) == 0


def _unknown(odd: Oddities) -> bytes:
    field = odd.draw(st.integers(1000, 1010))
    kind = odd.draw(st.sampled_from(["varint", "i64", "len", "i32"] + (["group"] if "groups" in odd.allow else [])))
    if kind == "varint":
        return tag(field, 0) + varint(odd.draw(st.integers(0, 2**64 - 1)))
    if kind == "i64":
        return tag(field, 1) + b"\x00" * 8
    if kind == "len":
        return length_delimited(field, odd.draw(st.binary(max_size=6)))
    if kind == "i32":
        return tag(field, 5) + b"\x00" * 4
    return tag(field, 3) + tag(1, 0) + b"\x01" + tag(field, 4)  # a group holding one varint


def _scalar(fd, value) -> bytes:
    if fd.type == FD.TYPE_STRING:
        return varint(len(value.encode())) + value.encode()
    if fd.type == FD.TYPE_BYTES:
        return varint(len(value)) + value
    if fd.type in _FIXED:
        return struct.pack(_FIXED[fd.type], value)
    return varint(int(value))


def encode(message, odd: Oddities) -> bytes:
    """``message``'s wire bytes with the liberties ``odd`` allows; upb parses them back to an
    equal message (checked by the callers)."""
    queues = []  # per field: its entries in order (a repeated field's order is kept)
    for fd, value in message.ListFields():
        values = list(value) if fd.is_repeated else [value]
        entries = []
        for item in values:
            if fd.type == FD.TYPE_MESSAGE:
                payload = encode(item, odd)
                if not fd.is_repeated and odd.maybe("split"):  # an empty part first: they merge
                    entries.append(length_delimited(fd.number, b""))
                entries.append(length_delimited(fd.number, payload))
            else:
                if not fd.is_repeated and odd.maybe("twice"):  # a stale value first: the last wins
                    stale = {FD.TYPE_STRING: "stale", FD.TYPE_BYTES: b"stale", FD.TYPE_BOOL: True,
                             FD.TYPE_DOUBLE: 2.5, FD.TYPE_FLOAT: 2.5}.get(fd.type, 7)
                    if fd.containing_oneof is not None and odd.maybe("other_member"):
                        entries.append(_other_member(message, fd))
                    else:
                        entries.append(tag(fd.number, _WIRE[fd.type]) + _scalar(fd, stale))
                entries.append(tag(fd.number, _WIRE[fd.type]) + _scalar(fd, item))
        queues.append(entries)
    out = []
    order = "reorder" in odd.allow and odd.draw(st.booleans())
    while any(queues):
        live = [q for q in queues if q]
        queue = live[odd.draw(st.integers(0, len(live) - 1))] if order else live[0]
        out.append(queue.pop(0))
        if odd.maybe("unknown"):
            out.append(_unknown(odd))
    return b"".join(out)


def _other_member(message, fd) -> bytes:
    """Another member of ``fd``'s oneof (it loses: the later member wins)."""
    other = next(f for f in fd.containing_oneof.fields if f.number != fd.number and f.type != FD.TYPE_MESSAGE)
    stale = {FD.TYPE_STRING: "stale", FD.TYPE_BYTES: b"stale", FD.TYPE_BOOL: True, FD.TYPE_DOUBLE: 2.5}.get(other.type, 7)
    return tag(other.number, _WIRE[other.type]) + _scalar(other, stale)


@st.composite
def requests(draw, reader_name: str) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    for r in range(draw(st.integers(0, 3))):
        resource_spans = request.resource_spans.add()
        if draw(st.booleans()):
            kv = resource_spans.resource.attributes.add(key=draw(st.sampled_from(["kvmiss.worker", "service.name"])))
            kv.value.string_value = f"w{r}"
        for _ in range(draw(st.integers(0, 2))):
            scope_spans = resource_spans.scope_spans.add()
            for _ in range(draw(st.integers(0, 4))):
                span = scope_spans.spans.add()
                span.CopyFrom(draw(spans(reader_name)))
                span.trace_id = draw(st.sampled_from([b"\x01" * 16, b"\x02" * 16, b"", b"\x03" * 15]))
                span.span_id = draw(st.sampled_from([b"\x04" * 8, b"\x05" * 8, b"\x06" * 9]))
                if draw(st.booleans()):  # fields after the attributes (10, 11, 15)
                    span.dropped_attributes_count = draw(st.integers(0, 3))
                    span.events.add(name="exception").attributes.add(key="kvmiss.cached_tokens").value.int_value = 1
                    span.status.code = draw(st.sampled_from([0, 1, 2]))
    return request


# --- the property -------------------------------------------------------------------------------

ODDITIES = frozenset({"reorder", "unknown", "twice", "split", "other_member", "groups"})


@compiled
@pytest.mark.parametrize("reader_name", sorted(READERS))
@REQUEST_SETTINGS
@given(data=st.data())
def test_canonical_bytes_read_exactly_as_the_reference_reads_the_message(reader_name, data):
    reader = READERS[reader_name]
    drop = reader.raw_names(keep_block_hashes=data.draw(st.booleans()))
    request = data.draw(requests(reader_name))
    check_against_reference(reader, drop, request.SerializeToString(), may_abstain=False)


@compiled
@pytest.mark.parametrize("reader_name", sorted(READERS))
@REQUEST_SETTINGS
@given(data=st.data())
def test_any_encoding_upb_accepts_reads_the_same_or_is_left_to_the_reference(reader_name, data):
    reader = READERS[reader_name]
    drop = reader.raw_names()
    request = data.draw(requests(reader_name))
    allow = frozenset(data.draw(st.sets(st.sampled_from(sorted(ODDITIES)))))
    body = encode(request, Oddities(data.draw, allow))
    parsed = ExportTraceServiceRequest.FromString(body)
    parsed.DiscardUnknownFields()  # kept by upb (and forwarded), but not part of the comparison
    assert parsed == request  # the encoder's own promise
    check_against_reference(reader, drop, body, may_abstain=bool(allow - {"reorder", "unknown"} or "groups" in allow))


@compiled
@REQUEST_SETTINGS
@given(data=st.data())
def test_field_order_and_plain_unknown_fields_never_make_it_abstain(data):
    reader = READERS["default"]
    request = data.draw(requests("default"))
    body = encode(request, Oddities(data.draw, frozenset({"reorder", "unknown"})))
    check_against_reference(reader, reader.raw_names(), body, may_abstain=False)


@compiled
def test_the_cache_write_count_is_read_by_the_wire_scanner_as_by_the_reference():
    reader = READERS["default"]
    request = ExportTraceServiceRequest()
    spans_out = request.resource_spans.add().scope_spans.add().spans
    for name in ("gen_ai.usage.cache_write.input_tokens", "gen_ai.usage.cache_creation.input_tokens"):
        span = spans_out.add(trace_id=os.urandom(16), span_id=os.urandom(8), name="router")
        for key, value in (("gen_ai.request.id", None), ("gen_ai.usage.input_tokens", 100), (name, 68)):
            kv = span.attributes.add(key=key)
            if value is None:
                kv.value.string_value = "r1"
            else:
                kv.value.int_value = value
    check_against_reference(reader, reader.raw_names(), request.SerializeToString(), may_abstain=False)


# --- what it abstains on, one by one ------------------------------------------------------------


def _one_span(attribute: bytes) -> bytes:
    span = length_delimited(1, b"\x01" * 16) + length_delimited(2, b"\x02" * 8) + length_delimited(9, attribute)
    return length_delimited(1, length_delimited(2, length_delimited(2, span)))


def _kv(key: str, *value_fields: bytes) -> bytes:
    return length_delimited(1, key.encode()) + b"".join(length_delimited(2, v) for v in value_fields)


@compiled
@pytest.mark.parametrize("attribute, why", [
    (_kv("kvmiss.route.worker", length_delimited(1, b"w0"), length_delimited(1, b"w1")), "KeyValue.value twice"),
    (_kv("kvmiss.route.worker", length_delimited(1, b"w0") + length_delimited(1, b"w1")), "a oneof member twice"),
    (_kv("kvmiss.cached_tokens", tag(3, 0) + b"\x05" + tag(1, 2) + b"\x01x"), "two oneof members"),
    (_kv("kvmiss.cached_tokens", tag(3, 2) + b"\x01x"), "int_value with the wrong wire type"),
    (length_delimited(1, b"kvmiss.cached_tokens") + tag(2, 0) + b"\x01", "KeyValue.value as a varint"),
])
def test_encodings_it_does_not_model_are_left_to_the_reference(attribute, why):
    body = _one_span(attribute)
    ExportTraceServiceRequest.FromString(body)  # upb takes each of them
    reader = S.SpanReader()
    assert S.WireScanner(reader._scan_table(reader.raw_names())).scan(body) is None, why


@compiled
def test_a_value_the_fact_does_not_take_directly_hands_the_span_back():
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8)
    span.attributes.add(key="kvmiss.cached_tokens").value.string_value = "32"  # a count as a string
    span.attributes.add(key="kvmiss.route.worker").value.string_value = "w0"
    reader = S.SpanReader()
    (hit,) = S.WireScanner(reader._scan_table(reader.raw_names())).scan(request.SerializeToString())
    assert hit[:3] == (0, 0, 0) and hit[4] is None  # the reference reads it: "32" -> 32
    facts, _, _ = reader.scanner(reader.raw_names())(span, [], None)
    assert facts.cached_tokens == 32 and facts.worker == "w0"


@compiled
def test_a_chain_reads_as_uint64_and_token_ids_as_int64():
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8,
                                                                    name=names.PREFIX_LOOKUP_SPAN)
    for key in ("kvmiss.block_hashes", "kvmiss.token_ids"):
        values = span.attributes.add(key=key).value.array_value.values
        for n in (-1, 0, 2**63 - 1, -(2**63)):
            values.add().int_value = n
    reader = S.SpanReader()
    (hit,) = S.WireScanner(reader._scan_table(reader.raw_names())).scan(request.SerializeToString())
    assert hit[4] == {"block_hashes": array("Q", [2**64 - 1, 0, 2**63 - 1, 2**63]),
                      "token_ids": [-1, 0, 2**63 - 1, -(2**63)]}
    assert hit[5] == [(0, "kvmiss.block_hashes"), (1, "kvmiss.token_ids")] and hit[6:8] == (2, 2)
    assert hit[10] is True  # the plugin's lookup span


@compiled
def test_a_body_that_is_not_a_request_is_no_crash():
    reader = S.SpanReader()
    scanner = S.WireScanner(reader._scan_table(reader.raw_names()))
    for body in (b"\xff", b"\x0a\x05ab", b"\x0a\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01", bytes(range(256))):
        assert scanner.scan(body) is None and interfaces.count_spans(body) is None
    assert scanner.scan(b"") == [] and scanner.scan(memoryview(b"")) == []


# --- the pipeline reads and writes the same through either door ---------------------------------


class _Keep:
    def __init__(self):
        self.out: list[bytes] = []
        self.encoded = 0  # requests handed on as rewritten bytes

    def has_capacity(self, spans):
        return True

    def put(self, request, tag=None):
        self.out.append(interfaces.request_bytes(request))
        self.encoded += type(request) is interfaces.EncodedRequest
        return True


def _pipeline(sink) -> Pipeline:
    index = ResidencyIndex(["w0", "w1"])
    index.apply(AppliedBatch(worker="w0", epoch=0, seq=0, ts=1.0, recv_ts=1.0, run_start_seq=0,
                             run_start=RunStart.EPOCH_START,
                             events=[BlockStored(block_hashes=[7, 8], block_size=16)]))
    return Pipeline(Attributor(index), sink, clock=lambda: 5.0, judge_on_arrival=True, assemble_wait_s=1.0)


@compiled
@REQUEST_SETTINGS
@given(st.lists(requests("default"), min_size=1, max_size=3))
def test_the_pipeline_exports_the_same_bytes_whether_it_works_on_the_bytes_or_the_message(batch):
    results = []
    for with_body in (False, True):
        sink = _Keep()
        pipe = _pipeline(sink)

        async def run():
            for request in batch:
                copy = ExportTraceServiceRequest()
                copy.CopyFrom(request)
                await pipe.consume(copy, copy.SerializeToString() if with_body else None)
            pipe.poll(10.0, final=True)

        asyncio.run(run())
        results.append((sink.out, dict(pipe.stats.verdicts), dict(pipe.stats.bad_attributes),
                        dict(pipe.stats.unenriched), pipe.stats.spans_out))
        # Through the bytes, every request leaves as rewritten bytes (upb's own encoding of the
        # written message, byte for byte, for canonical input); through the message, none does.
        assert sink.encoded == (len(sink.out) if with_body else 0)
    assert results[0] == results[1]


def test_the_scanner_refuses_a_table_it_cannot_hold():
    if not S.WIRE_SCAN:
        pytest.skip("the compiled OTLP wire path is not in use")
    from kvmiss.enricher.otlp._otlpwire import Scanner

    with pytest.raises(ValueError, match="twice"):
        Scanner(("a", "a"), ((-1, 0, 5, 1), (-1, 0, 5, 1)), (), b"")
    with pytest.raises(ValueError, match="out of range"):
        Scanner(("a",), ((3, 0, 5, 0),), ("f",), b"")
    with pytest.raises(TypeError):
        Scanner((1,), ((-1, 0, 5, 0),), (), b"")


@compiled
@pytest.mark.parametrize("order", [(2, 0, 1, 0), (0, 0, 2, 1), (1, 2, 1, 0), (2, 1, 2, 1)])
def test_the_best_ranked_name_wins_and_the_first_of_equals(order):
    """`prompt_tokens` from three names ranked 0-2 (CUSTOM), in any order and repeated: the
    lowest rank wins, and of two equal ones the first -- as the reference reads it."""
    reader = READERS["custom"]
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8)
    for n, rank in enumerate(order):
        span.attributes.add(key=CUSTOM.prompt_tokens[rank]).value.int_value = 100 + n
    for n in range(2):  # the same name twice
        span.attributes.add(key="router.backend").value.string_value = f"w{n}"
    (hit,) = S.WireScanner(reader._scan_table(reader.raw_names())).scan(request.SerializeToString())
    reference = reader.scanner(reader.raw_names())(span, [], None)
    assert hit[4] == reference[1] == {"prompt_tokens": 100 + order.index(min(order)), "worker": "w0"}


# --- rewriting the bytes: the same request the parsed message becomes ----------------------------

output_values = st.dictionaries(st.sampled_from(list(names.OUTPUTS)),
                                st.text(max_size=6) | st.integers(-(2**63), 2**63 - 1) | st.booleans(), max_size=4)


@st.composite
def edited(draw, body: bytes):
    """Edits in wire order for some spans of ``body``: attribute positions to delete, and
    attributes (as the pipeline encodes them) to append."""
    request = ExportTraceServiceRequest.FromString(body)
    edits = []
    for r, resource_spans in enumerate(request.resource_spans):
        for s, scope_spans in enumerate(resource_spans.scope_spans):
            for i, span in enumerate(scope_spans.spans):
                if draw(st.booleans()):
                    deletes = tuple(sorted(draw(st.sets(st.integers(0, len(span.attributes) - 1)))
                                           if span.attributes else ()))
                    edits.append((r, s, i, deletes, S.encode_attributes(draw(output_values))))
    return edits


def apply_to_message(body: bytes, edits) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest.FromString(body)
    for r, s, i, deletes, data in edits:
        span = request.resource_spans[r].scope_spans[s].spans[i]
        for position in reversed(deletes):
            del span.attributes[position]
        span.MergeFromString(data)
    return request


@compiled
@REQUEST_SETTINGS
@given(data=st.data())
def test_rewriting_the_bytes_makes_what_editing_the_message_makes(data):
    request = data.draw(requests("default"))
    canonical = data.draw(st.booleans())
    body = request.SerializeToString() if canonical else encode(request, Oddities(data.draw, frozenset({"reorder", "unknown", "twice"})))
    edits = data.draw(edited(body))
    out = S.rewrite_request(body, edits)
    expected = apply_to_message(body, edits)
    if canonical:  # upb's own encoding of the edited message, byte for byte
        assert out == expected.SerializeToString()
    got = ExportTraceServiceRequest.FromString(out)
    got.DiscardUnknownFields()
    expected.DiscardUnknownFields()
    assert got == expected
    assert S.rewrite_request(body, []) == body  # nothing to edit: the same bytes


@compiled
def test_an_edit_that_does_not_fit_the_body_is_refused():
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8)
    span.attributes.add(key="a").value.int_value = 1
    body = request.SerializeToString()
    for edits, why in (([(0, 0, 0, (1,), b"")], "not in the span"), ([(0, 0, 1, (), b"")], "not in the request"),
                       ([(0, 1, 0, (), b"")], "not in the request"), ([(0, 0, 0, (0, 0), b"")], "ascending"),
                       ([(0, 0, 0, (), b""), (0, 0, 0, (), b"")], "sorted")):
        with pytest.raises(ValueError, match=why):
            S.rewrite_request(body, edits)
    with pytest.raises(TypeError):
        S.rewrite_request(body, [(0, 0, 0, [0], b"")])


any_output_value = (st.text() | st.integers(-(2**64), 2**64) | st.booleans() | st.floats(allow_nan=False)
                    | st.sampled_from([math.nan, -0.0, "\ud800", "é"]) | st.lists(st.text(max_size=3), max_size=2))


@compiled
@SETTINGS
@given(st.dictionaries(st.text(max_size=20) | st.sampled_from(list(names.OUTPUTS)), any_output_value, max_size=10))
def test_the_compiled_attribute_encoder_writes_what_the_python_one_writes_or_leaves_it_to_it(values):
    from kvmiss.enricher.otlp._otlpwire import encode_attributes as encode_c

    fast = encode_c(values)
    saved = S._encode_c
    S._encode_c = None  # the Python encoder alone
    try:
        try:
            reference = S.encode_attributes(values)
        except (S.NotEncodable, UnicodeError):
            reference = None
    finally:
        S._encode_c = saved
    if fast is not None:
        assert fast == reference
    simple = all(type(k) is str and (type(v) in (str, bool, float) or (type(v) is int and -(2**63) <= v < 2**63))
                 for k, v in values.items())
    surrogate = any("\ud800" in x for k, v in values.items() for x in (k, v) if type(x) is str)
    assert (fast is not None) == (simple and not surrogate)
