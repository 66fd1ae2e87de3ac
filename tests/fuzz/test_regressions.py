"""Every crash the fuzzers found, as a plain test of the input that caused it (fixed since).

Each case names the parser, what the input was and what escaped before the fix.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import struct
import tracemalloc
import zlib

import msgspec
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvmiss.collectors.recording import MAGIC, ReadStats, RecordedMessage, RecordingWriter, read_recording
from kvmiss.enricher.cli import decode_cmd
from kvmiss.enricher.cli.hash_cmd import compute
from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.hashing import BlockHasher
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.otlp.receiver import JSON, Receivers, _Rejected, parse_otlp_json
from kvmiss.enricher.otlp.spans import SpanReader
from kvmiss.enricher.service.pipeline import Pipeline
from kvmiss.schemas.config import ConfigError, OtlpConfig, parse_config
from kvmiss.schemas.events import WireError, decode_batch, event_to_builtins

DEEP = 5000  # far past the interpreter's recursion limit (1000)


def mp(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


def nested_raw(depth: int = DEEP) -> msgspec.Raw:
    return msgspec.Raw(b"\x91" * depth + b"\xc0")


def stored(**fields) -> dict:
    return {"type": "BlockStored", "block_hashes": [1], **fields}


# --- decode_batch / kvmiss decode (schemas/events.py, enricher/cli/decode_cmd.py) ---------


@pytest.mark.parametrize("payload", [
    mp([1.0, [stored(future_field=nested_raw())], 0]),  # an unknown field: skipped, but recursively
    mp([1.0, [stored(extra_keys=[nested_raw()])], 0]),  # list[Any]
    mp([1.0, [stored(token_ids=nested_raw())], 0]),  # msgspec.Raw, skipped recursively
    mp([1.0, [nested_raw()], 0]),  # an event
    mp([1.0, [{"type": "BlockStored", "block_hashes": [-1], "x": nested_raw()}], 0]),  # slow path
], ids=["unknown-field", "extra-keys", "token-ids", "event", "slow-path"])
def test_decode_batch_msgpack_nested_past_the_recursion_limit_is_a_wire_error(payload):
    """Was: RecursionError out of decode_batch (and out of `kvmiss decode`, the collector)."""
    with pytest.raises(WireError, match="nested too deeply"):
        decode_batch(payload)


def test_decode_shows_a_msgpack_ext_in_extra_keys_instead_of_raising():
    """Was: NotImplementedError from event_to_builtins' enc_hook (kvmiss decode crashed)."""
    (event,) = decode_batch(mp([1.0, [stored(extra_keys=[msgspec.msgpack.Ext(5, b"\x01\x02")])], 0])).events
    assert event_to_builtins(event, include_raw=True)["extra_keys"] == [{"ext_type": 5, "data_hex": "0102"}]
    assert "extra_keys" not in event_to_builtins(event) and event_to_builtins(event)["has_extra_keys"]


@pytest.mark.parametrize("key", [b"\xc0", b"\xc3", b"\x92\x01\x02"], ids=["nil", "true", "array"])
def test_decode_raw_prints_extra_keys_keyed_by_nil_bool_or_array(key):
    """Was: TypeError from the JSON encoder in `kvmiss decode --raw` (map keys JSON lacks).
    msgpack arrays as map keys are refused by msgspec already (unhashable): a WireError."""
    event_bytes = (b"\x83" + mp("type") + mp("BlockStored") + mp("block_hashes") + mp([1])
                   + mp("extra_keys") + b"\x91\x81" + key + b"\x01")
    payload = b"\x93" + mp(1.0) + b"\x91" + event_bytes + b"\x00"
    line = json.dumps({"frames": [base64.b64encode(f).decode() for f in (b"kv", bytes(8), payload)]})
    out = io.BytesIO()
    decode_cmd.run(argparse.Namespace(raw=True), stdin=io.BytesIO(line.encode() + b"\n"), stdout=out)
    (printed,) = [json.loads(x) for x in out.getvalue().splitlines()]
    if printed["kind"] == "error":
        assert key == b"\x92\x01\x02" and "hashable" in printed["error"]
    else:
        assert printed["events"][0]["extra_keys_unprintable"] is True


def test_decode_hides_lookahead_token_ids_unless_raw():
    """Was a leak, not a crash: lookahead token ids (vLLM 0.33) were printed without --raw."""
    (event,) = decode_batch(mp([1.0, [stored(lookahead_token_ids=[[123456789], [223456789]])], 0])).events
    hidden = event_to_builtins(event)
    assert "lookahead_token_ids" not in hidden and hidden["num_lookahead_tokens"] == 2
    assert event_to_builtins(event, include_raw=True)["lookahead_token_ids"] == [[123456789], [223456789]]


def test_decode_an_input_line_nested_past_the_recursion_limit_is_an_error_line():
    """Was: RecursionError out of decode_line (unknown fields of the input line are skipped)."""
    line = b'{"frames": [], "x": ' + b"[" * DEEP + b"]" * DEEP + b"}"
    assert decode_cmd.decode_line(line) == {"kind": "error", "error": "input line is nested too deeply"}


# --- read_recording (collectors/recording.py) --------------------------------------------


def test_a_record_with_a_valid_crc_and_nesting_past_the_limit_ends_the_recording(tmp_path):
    """Was: RecursionError out of read_recording (a trailing field the decoder skips)."""
    path = tmp_path / "r.rec"
    first = RecordedMessage(1.0, "w", "sub", [b"a"])
    with RecordingWriter(path) as writer:
        writer.write(first)
    body = mp([2.0, "w", "sub", [b"b"], None, nested_raw()])
    with open(path, "ab") as f:
        f.write(struct.pack("<II", len(body), zlib.crc32(body)) + body)
    stats = ReadStats()
    assert list(read_recording(path, stats)) == [first]
    assert stats.torn_tail and stats.torn_offset > len(MAGIC)


# --- OTLP/JSON (enricher/otlp/receiver.py) ------------------------------------------------

DEEP_VALUE = (b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"attributes":[{"key":"k","value":'
              + b'{"arrayValue":{"values":[' * 600 + b'{"intValue":1}' + b"]}}" * 600 + b"}]}]}]}]}")


@pytest.mark.parametrize("body, fragment", [
    (b"[" * DEEP, "nested too deeply"),  # json.loads
    (b'{"x": ' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"}", "nested too deeply"),
    (DEEP_VALUE, "nested too deeply"),  # valid OTLP/JSON; json_format.ParseDict recurses
    (b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"kind": 1e400}]}]}]}', "out of range"),
    (b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"kind": -Infinity}]}]}]}', "out of range"),
], ids=["deep-array", "deep-object", "deep-any-value", "kind-1e400", "kind-infinity"])
def test_otlp_json_that_crashed_the_parser_is_a_value_error_and_a_400(body, fragment):
    """Was: RecursionError / OverflowError out of parse_otlp_json, so OTLP/HTTP answered 500."""
    with pytest.raises(ValueError, match=fragment):
        parse_otlp_json(body)

    class Unused:
        async def consume(self, request, body=None, gzipped=None):
            raise AssertionError

    with pytest.raises(_Rejected) as rejected:
        Receivers(OtlpConfig(grpc=None, http=None), Unused())._decode(body, JSON)
    assert rejected.value.status == 400


# --- configuration (schemas/config.py) ----------------------------------------------------


@pytest.mark.parametrize("value", ["[" * DEEP + "]" * DEEP, "{a = " * DEEP + "1" + "}" * DEEP])
def test_a_config_nested_past_the_recursion_limit_is_a_config_error(value):
    """Was: RecursionError out of parse_config (tomllib recurses into inline values)."""
    with pytest.raises(ConfigError, match="nested too deeply"):
        parse_config(f"x = {value}\n", source="k.toml")


def test_a_worker_port_of_thousands_of_digits_does_not_escape_as_value_error():
    """Was: ValueError (int() digit limit) from offset_endpoint while checking a config with
    dp_rank != 0. Such an endpoint is now refused at load, naming the worker, in a short line."""
    endpoint = "tcp://h:" + "9" * 5000
    with pytest.raises(ConfigError) as info:
        parse_config(f"[[workers]]\nid = 'a'\nendpoint = '{endpoint}'\ndp_rank = 1\n")
    assert "workers[0] (id 'a').endpoint" in str(info.value) and "is outside 1-65535" in str(info.value)
    assert len(str(info.value)) < 300
    assert parse_config("[[workers]]\nid='a'\nendpoint='tcp://h:5557'\ndp_rank=2\n").workers[0].sub_endpoint() == "tcp://h:5559"


# --- span attributes (enricher/otlp/spans.py) and the pipeline behind them ----------------


def _span_request(attributes: dict) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add(trace_id=bytes(16), span_id=bytes(8))
    for key, value in attributes.items():
        kv = span.attributes.add()
        kv.key = key
        if isinstance(value, float):
            kv.value.double_value = value
        elif isinstance(value, int):
            kv.value.int_value = value
        else:
            kv.value.string_value = value
    return request


@pytest.mark.parametrize("value", ["--5", "\u00b2", "9" * 5000, "9" * 30, 1e30, "-" + "9" * 25])
def test_a_count_that_is_not_an_int64_is_a_bad_attribute_not_an_exception(value):
    """Was: ValueError from int() ("--5", "²", 5000 digits) in SpanReader.read -- the whole
    OTLP request answered 500 -- or, for values beyond int64, a ValueError / OverflowError
    later in Pipeline.poll (writing kvmiss.missed_tokens, dividing lookup_time_unix_nano),
    which would stop the service's judging loop."""
    attrs = {"gen_ai.request.id": "r1", "gen_ai.usage.cache_read.input_tokens": 0,
             "gen_ai.usage.prompt_tokens": value, "kvmiss.lookup_time_unix_nano": value,
             "kvmiss.route.worker": "A"}
    request = _span_request(attrs)
    bad: list[str] = []
    facts = SpanReader().read(request.resource_spans[0].scope_spans[0].spans[0], bad)
    assert facts.prompt_tokens is None and facts.lookup_time is None
    assert bad == ["gen_ai.usage.prompt_tokens", "kvmiss.lookup_time_unix_nano"]

    class Sink:
        def has_capacity(self, spans):
            return True

        def put(self, request, tag=None):
            return True

    pipe = Pipeline(Attributor(ResidencyIndex(["A"])), Sink(), clock=lambda: 0.0)
    asyncio.run(pipe.consume(_span_request({**attrs, "gen_ai.usage.prompt_tokens": 40})))
    asyncio.run(pipe.consume(request))
    pipe.poll(final=True)
    assert pipe.stats.spans_out == 2


# --- kvmiss hash / compare (enricher/core/hashing.py) -------------------------------------


def test_a_huge_block_size_hashes_nothing_instead_of_overflowing():
    """Was: OverflowError out of `kvmiss hash` / `kvmiss compare` for block_size >= 2**63."""
    out = compute(json.dumps({"algo": "sha256_cbor", "seed": "0", "block_size": 2**63,
                              "token_ids": list(range(40))}).encode())
    assert out["block_hashes"] == []


def test_a_large_block_size_costs_no_memory_in_the_block_size():
    """Was: a list of ``block_size`` references per call -- block_size 2**31 took > 16 GB and
    the kernel killed the process."""
    hasher = BlockHasher("sha256_cbor", seed="0", block_size=2**24)
    tracemalloc.start()
    try:
        assert hasher.hash_request(list(range(100))) == []
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_compare_keeps_its_error_to_one_line_when_the_input_names_a_key_with_a_newline(tmp_path):
    """Was: ``Object contains unknown field `\\n``` printed across two lines (found by
    test_fuzz_prompts): scripts reading the one error line got half of it."""
    from kvmiss.enricher.cli import compare_cmd

    good = {"algo": "sha256", "seed": "0", "block_size": 16, "token_ids": list(range(32))}
    (tmp_path / "ref.json").write_text(json.dumps(good))
    (tmp_path / "cand.json").write_text(json.dumps({**good, "\n": 1}))
    args = argparse.Namespace(reference=str(tmp_path / "ref.json"), candidate=str(tmp_path / "cand.json"),
                              expect_shared_tokens=None, digest_key_env=None, show_snippet=False)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert compare_cmd.run(args) == 2
    assert err.getvalue().count("\n") == 1 and "unknown field `\\n`" in err.getvalue()
