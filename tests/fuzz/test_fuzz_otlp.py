"""OTLP bodies as the receivers get them: protobuf and OTLP/JSON, plain or compressed (gzip,
zstd, deflate, zlib). Every body is decoded or answered 400/413 (`_Rejected`);
`parse_otlp_json` raises only ValueError; `SpanReader` reads any attribute value of any type
without raising, and the compiled wire scanner reads the same bytes as it does or abstains;
what decodes round-trips (protobuf bytes, and OTLP/JSON through the exporter's own writer)."""

from __future__ import annotations

import gzip
import json
import zlib

from fuzz_support import (
    FLOAT_EDGES,
    INT_EDGES,
    fuzz_settings,
    hash_requests,
    mutate_bytes,
    mutate_tree,
    seeds,
)
from google.protobuf.message import DecodeError
from hypothesis import given, strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from wire_scan_check import check_against_reference

from kvmiss.enricher.otlp.exporter import to_otlp_json
from kvmiss.enricher.otlp.receiver import (
    _INFLATERS,
    JSON,
    PROTOBUF,
    Receivers,
    _Rejected,
    drop_invalid_spans,
    parse_otlp_json,
)
from kvmiss.enricher.otlp.spans import WIRE_SCAN, SpanFacts, SpanReader
from kvmiss.schemas.config import OtlpConfig
from kvmiss.schemas.span_attributes import InputNames

try:  # Python 3.14 has it; before, its backport (a kvmiss dependency)
    from compression import zstd
except ImportError:
    from backports import zstd

MAX_BODY = 1 << 20


def _input_keys() -> list[str]:
    names = InputNames()
    return sorted({a for field in names.__struct_fields__ for a in getattr(names, field)})


INPUT_KEYS = _input_keys()


class _NoConsumer:
    async def consume(self, request, body=None, gzipped=None):  # pragma: no cover - never reached by _decode
        raise AssertionError


_receivers = Receivers(OtlpConfig(grpc=None, http=None, max_body_bytes=MAX_BODY), _NoConsumer())
_reader = SpanReader()


# --- attribute values of every type ------------------------------------------------------

numeric_strings = st.sampled_from(
    ["12", " 12 ", "-7", "--5", "-", "", "\u00b2", "\u0663", "1e3", "0x10", "9" * 30, "9" * 5000,
     "-" + "9" * 19, str(2**63), str(2**64), "18446744073709551615", "NaN", "inf"])


@st.composite
def any_values(draw, depth: int = 0) -> AnyValue:
    value = AnyValue()
    kind = draw(st.sampled_from(["string", "int", "double", "bool", "bytes", "array", "kvlist", "empty"]))
    if kind == "string":
        value.string_value = draw(numeric_strings | st.text(max_size=20))
    elif kind == "int":
        value.int_value = draw(st.sampled_from([i for i in INT_EDGES if -2**63 <= i < 2**63]) | st.integers(-2**63, 2**63 - 1))
    elif kind == "double":
        value.double_value = draw(st.sampled_from(FLOAT_EDGES + [1e300, 2.0**63, 2.0**64, 16.0, -1.0]) | st.floats())
    elif kind == "bool":
        value.bool_value = draw(st.booleans())
    elif kind == "bytes":
        value.bytes_value = draw(st.binary(max_size=16))
    elif kind == "array" and depth < 3:
        value.array_value.SetInParent()
        for item in draw(st.lists(any_values(depth + 1), max_size=5)):
            value.array_value.values.add().CopyFrom(item)
    elif kind == "kvlist" and depth < 3:
        value.kvlist_value.SetInParent()
        for item in draw(st.lists(any_values(depth + 1), max_size=3)):
            kv = value.kvlist_value.values.add()
            kv.key = draw(st.text(max_size=6))
            kv.value.CopyFrom(item)
    return value


@st.composite
def spans_requests(draw) -> ExportTraceServiceRequest:
    """Requests whose spans carry kvmiss's input attributes with values of any type, some
    of them the real token ids, salts and adapters of the vLLM hash vectors."""
    request = ExportTraceServiceRequest()
    for _ in range(draw(st.integers(1, 2))):
        rs = request.resource_spans.add()
        if draw(st.booleans()):
            kv = rs.resource.attributes.add()
            kv.key = "service.instance.id"
            kv.value.CopyFrom(draw(any_values()))
        ss = rs.scope_spans.add()
        for _ in range(draw(st.integers(0, 3))):
            span = ss.spans.add(
                trace_id=draw(st.sampled_from([bytes(16), b"\x01" * 16]) | st.binary(max_size=17)),
                span_id=draw(st.sampled_from([b"\x02" * 8]) | st.binary(max_size=9)),
                start_time_unix_nano=draw(st.integers(0, 2**64 - 1)),
                name=draw(st.text(max_size=8)),
            )
            for key in draw(st.lists(st.sampled_from(INPUT_KEYS), max_size=8)):
                kv = span.attributes.add()
                kv.key = key
                kv.value.CopyFrom(draw(any_values()))
            if draw(st.booleans()):
                seed = draw(seeds(hash_requests))
                kv = span.attributes.add()
                kv.key = "kvmiss.token_ids"
                for t in seed["token_ids"]:
                    kv.value.array_value.values.add().int_value = t
                kv = span.attributes.add()
                kv.key = "kvmiss.extra_keys"
                extra = {k: seed[k] for k in ("lora", "cache_salt", "mm", "prompt_embeds_block_digests")}
                kv.value.string_value = json.dumps(extra)
    return request


def check_read(request: ExportTraceServiceRequest) -> None:
    """What the pipeline does with every request it accepts, minus the index."""
    drop_invalid_spans(request)
    for rs in request.resource_spans:
        _reader.instance_of(rs.resource.attributes)
        for ss in rs.scope_spans:
            for span in ss.spans:
                assert len(span.trace_id) == 16 and len(span.span_id) == 8
                bad: list[str] = []
                facts = _reader.read(span, bad)
                assert facts is None or isinstance(facts, SpanFacts)
                assert all(name in INPUT_KEYS for name in bad)


def decode_body(body: bytes, ctype: str) -> ExportTraceServiceRequest | None:
    try:
        request = _receivers._decode(body, ctype)
    except _Rejected as rejected:
        assert rejected.status == 400
        return None
    assert isinstance(request, ExportTraceServiceRequest)
    return request


# --- protobuf --------------------------------------------------------------------------


@fuzz_settings(40)
@given(spans_requests())
def test_span_attributes_of_any_type_are_read_without_raising(request):
    check_read(request)


@fuzz_settings(50)
@given(spans_requests(), st.data())
def test_mutated_protobuf_bodies_decode_or_are_answered_400(request, data):
    body = data.draw(mutate_bytes(request.SerializeToString()))
    try:
        parsed = ExportTraceServiceRequest.FromString(body)
    except DecodeError:
        assert decode_body(body, PROTOBUF) is None
        return
    again = ExportTraceServiceRequest.FromString(parsed.SerializeToString())
    assert again.SerializeToString(deterministic=True) == parsed.SerializeToString(deterministic=True)
    if WIRE_SCAN:  # the compiled scanner on the same bytes: the reference's answer, or none
        check_against_reference(_reader, _reader.raw_names(), body, may_abstain=True)
    check_read(decode_body(body, PROTOBUF))


def _raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-15)
    return packer.compress(data) + packer.flush()


# Content-Encoding -> how a client compresses (both deflate forms).
COMPRESS = {"gzip": [gzip.compress], "zstd": [zstd.compress], "deflate": [zlib.compress, _raw_deflate],
            "zlib": [zlib.compress]}


def test_every_encoding_the_receiver_takes_is_fuzzed_here():
    assert set(COMPRESS) == set(_INFLATERS)


@fuzz_settings(20)
@given(spans_requests(), st.sampled_from(sorted(COMPRESS)), st.data())
def test_mutated_compressed_bodies_decompress_within_the_cap_or_are_answered_400_or_413(request, encoding, data):
    compress = data.draw(st.sampled_from(COMPRESS[encoding]))
    packed = compress(request.SerializeToString())
    if data.draw(st.booleans()):  # a second member or frame, and maybe a bomb past the cap
        packed += compress(b"\x00" * data.draw(st.sampled_from([0, 10, MAX_BODY])))
    body = data.draw(mutate_bytes(packed))
    try:
        out = _INFLATERS[encoding](body, MAX_BODY)
    except _Rejected as rejected:
        assert rejected.status in (400, 413)
        return
    assert len(out) <= MAX_BODY


# --- OTLP/JSON ---------------------------------------------------------------------------

OTLP_KEYS = ["traceId", "spanId", "kind", "value", "intValue", "arrayValue", "values", "attributes",
             "key", "spans", "startTimeUnixNano"]


def _json_containers(children: st.SearchStrategy) -> st.SearchStrategy:
    keys = st.sampled_from(OTLP_KEYS) | st.text(max_size=6)
    return st.lists(children, max_size=3) | st.dictionaries(keys, children, max_size=3)


json_values = st.recursive(
    st.none() | st.booleans() | st.sampled_from(INT_EDGES + [10**30, -(10**30)])
    | st.integers() | st.sampled_from(FLOAT_EDGES) | st.floats()
    | st.text(max_size=12) | st.sampled_from(["00" * 16, "zz", "0x1", "\u0663" * 16, "AAAA"]),
    _json_containers,
    max_leaves=10,
)


def parsed_json(body: bytes) -> ExportTraceServiceRequest | None:
    try:
        request = parse_otlp_json(body)
    except ValueError:  # documented (JSONDecodeError and UnicodeDecodeError are ValueErrors)
        assert decode_body(body, JSON) is None
        return None
    assert isinstance(request, ExportTraceServiceRequest)
    return request


def assert_json_round_trip(request: ExportTraceServiceRequest) -> None:
    text = to_otlp_json(request)
    # Compared as text: a NaN attribute never equals itself, and JSON drops a NaN's sign.
    assert to_otlp_json(parse_otlp_json(text.encode())) == text


@fuzz_settings(20)
@given(spans_requests())
def test_otlp_json_written_by_the_exporter_parses_back_to_the_same_request(request):
    drop_invalid_spans(request)  # the writer needs 16/8-byte ids to print them as hex
    assert_json_round_trip(request)


@fuzz_settings(40)
@given(spans_requests(), st.data())
def test_mutated_otlp_json_documents_parse_or_raise_value_error(request, data):
    document = json.loads(to_otlp_json(request))
    mutated = data.draw(mutate_tree(document, json_values))
    text = json.dumps(mutated).encode()
    how = data.draw(st.sampled_from(["as_is", "bytes", "deep_array", "deep_object", "deep_value"]))
    if how == "bytes":
        text = data.draw(mutate_bytes(text))
    elif how.startswith("deep") and text.startswith(b"{") and len(text) > 2:
        depth = data.draw(st.integers(50, 50_000))
        if how == "deep_array":
            nest = b"[" * depth + b"]" * depth
        elif how == "deep_object":
            nest = b'{"a":' * depth + b"1" + b"}" * depth
        else:  # an attribute value nested past any recursion limit, in valid OTLP/JSON
            nest = b'{"arrayValue":{"values":[' * depth + b'{"intValue":1}' + b"]}}" * depth
            nest = b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"attributes":[{"key":"k","value":' + nest + b"}]}]}]}]}"
            text = nest
        if how != "deep_value":
            text = b'{"x":' + nest + b"," + text[1:]
    request = parsed_json(text)
    if request is not None:
        check_read(request)


@fuzz_settings(30)
@given(st.binary(max_size=128))
def test_arbitrary_bytes_as_otlp_json_parse_or_raise_value_error(body):
    parsed_json(body)
