"""Privacy under hostile input: random token ids, cache salts, adapter paths and the digest
secret, pushed through the real pieces (`kvmiss decode`, `Pipeline.consume` + `poll` with
hashing, the residency index with divergence detail, the metrics collector, the request
records) with values of every type, never show up in exported spans, request records,
metrics exposition, log records (all loggers, DEBUG) or error messages.

Injected values are recognisable on sight: token ids are 9-10 digit numbers (no count, seq
or time in these scenarios has that shape), salts start with ``SALT``, adapter paths with
``/adapters/ADPT``, the digest secret with ``DKEY``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import re
import string
import tempfile

import msgspec
from fuzz.fuzz_support import all_logs_at_debug, fuzz_settings, mutate_bytes
from google.protobuf import json_format
from hypothesis import given, strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client import CollectorRegistry, exposition as prom_text
from prometheus_client.openmetrics import exposition as openmetrics

from kvmiss.collectors.stream import WorkerStream
from kvmiss.enricher.cli import decode_cmd
from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.hashing import BlockHasher, external_hash, extras_from_spec
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.core.privacy import DigestKey
from kvmiss.enricher.otlp.spans import SpanReader
from kvmiss.enricher.service.metrics import KvmissCollector
from kvmiss.enricher.service.pipeline import Pipeline
from kvmiss.enricher.service.request_records import RequestRecords
from kvmiss.schemas.events import BlockStored
from kvmiss.schemas.prompt import ExtraKeysSpec, LoraSpec
from kvmiss.schemas.span_attributes import InputNames
from kvmiss.schemas.stream import AppliedBatch, RunStart

SAFE = string.ascii_letters + string.digits
BLOCK = 4
TS0 = 1000.0
TRACE = bytes(range(16))


class Secrets(msgspec.Struct, frozen=True):
    tokens: list[int]  # >= 16 distinct ids
    salt: str
    path: str
    key: str

    def leaks(self, text: str) -> list[str]:
        """What of this leaked into ``text`` (a rendering of spans, metrics, logs, errors)."""
        found = [name for name, value in (("salt", self.salt), ("adapter path", self.path),
                                          ("digest secret", self.key)) if value in text]
        numbers = "|".join(str(t) for t in self.tokens)
        hit = re.search(rf"(?<![0-9])(?:{numbers})(?![0-9])", text)
        if hit:
            found.append(f"token id {hit.group()}")
        return found


secrets = st.builds(
    Secrets,
    tokens=st.lists(st.integers(10**8 + 1, 2**31 - 1), min_size=16, max_size=40, unique=True),
    salt=st.text(SAFE, min_size=6, max_size=16).map(lambda s: "SALT" + s),
    path=st.text(SAFE, min_size=6, max_size=16).map(lambda s: "/adapters/ADPT" + s),
    key=st.text(SAFE, min_size=16, max_size=32).map(lambda s: "DKEY" + s),
)


# --- the pipeline: spans carrying raw prompt material, of any type -----------------------

HASHER = BlockHasher("sha256_cbor", seed="0", block_size=BLOCK)


def spec_of(s: Secrets) -> ExtraKeysSpec:
    return ExtraKeysSpec(lora=LoraSpec(name="lora-a", path=s.path), cache_salt=s.salt)


def index_holding(s: Secrets) -> ResidencyIndex:
    """Worker A stored the first 3 blocks of the secret prompt (seq 5), with divergence
    detail on, so a request that leaves that chain is compared token by token."""
    index = ResidencyIndex(["A"], divergence_detail=True)
    prompt = s.tokens[:3 * BLOCK]
    chain = [external_hash(d) for d in HASHER.hash_request(prompt, extras_from_spec(spec_of(s)))]
    stored = BlockStored(block_hashes=chain, token_ids=msgspec.Raw(msgspec.msgpack.encode(prompt)),
                         block_size=BLOCK, medium="GPU", lora_name="lora-a", cache_salt=s.salt,
                         extra_keys=[["lora-a", s.salt], ["lora-a"], ["lora-a", s.path]])
    for seq in range(30):
        index.apply(AppliedBatch(worker="A", epoch=0, seq=seq, ts=TS0 + seq, recv_ts=TS0 + seq,
                                 events=[stored] if seq == 5 else [], run_start_seq=0,
                                 run_start=RunStart.EPOCH_START))
    return index


def request_tokens(s: Secrets) -> list[int]:
    """Shares block 0 and half of block 1 with the stored prompt, then other secret ids."""
    return s.tokens[:BLOCK + 2] + s.tokens[3 * BLOCK:]


def set_value(value, v) -> None:
    """Python value -> OTLP AnyValue (lists of mixed types allowed)."""
    if isinstance(v, bool):
        value.bool_value = v
    elif isinstance(v, int):
        value.int_value = v
    elif isinstance(v, float):
        value.double_value = v
    elif isinstance(v, str):
        value.string_value = v
    elif isinstance(v, bytes):
        value.bytes_value = v
    elif isinstance(v, dict):
        value.kvlist_value.SetInParent()
        for k, item in v.items():
            kv = value.kvlist_value.values.add()
            kv.key = k
            set_value(kv.value, item)
    else:
        value.array_value.SetInParent()
        for item in v:
            set_value(value.array_value.values.add(), item)


@st.composite
def token_attribute(draw, tokens: list[int]):
    """``kvmiss.token_ids`` as sent, or as a hostile sender might: text, strings, doubles,
    a kvlist, bytes, one bad element."""
    return draw(st.sampled_from([
        tokens,
        tokens,
        [str(t) for t in tokens],
        [float(t) for t in tokens],
        json.dumps(tokens),
        ", ".join(map(str, tokens)),
        {"ids": tokens},
        json.dumps(tokens).encode(),
        [*tokens[:-1], "x"],
        [tokens],
    ]))


@st.composite
def extra_keys_attribute(draw, s: Secrets):
    spec = {"lora": {"name": "lora-a", "path": s.path}, "cache_salt": s.salt}
    text = json.dumps(spec)
    return draw(st.sampled_from([
        text,
        text,
        text[: len(text) // 2],  # truncated JSON, the salt still in it
        json.dumps({**spec, "unknown": s.salt}),
        json.dumps({"lora": s.path, "cache_salt": [s.salt]}),
        [s.salt, s.path],
        {"cache_salt": s.salt, "lora_path": s.path},
        text.encode(),
        json.dumps(spec) + s.salt,
    ]))


def _garbage_lists(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(children.filter(lambda v: v is not None), max_size=3)


garbage_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**7, 10**7) | st.sampled_from([2**63 - 1, -2**63])
    | st.floats() | st.text(SAFE + " -.", max_size=12) | st.binary(max_size=8),
    _garbage_lists, max_leaves=5,
).filter(lambda v: v is not None)
INPUT_KEYS = ["gen_ai.request.id", "gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens",
              "gen_ai.usage.cache_read.input_tokens", "kvmiss.block_size", "kvmiss.route.worker",
              "kvmiss.route.policy", "kvmiss.block_hashes", "kvmiss.extra_key_kinds",
              "kvmiss.lookup_time_unix_nano", "gen_ai.latency.time_in_queue", "kvmiss.transfer.result",
              "kvmiss.transfer.source", "kvmiss.route.dp_rank"]


@st.composite
def export_requests(draw, s: Secrets) -> list[ExportTraceServiceRequest]:
    """A router span with the request's raw inputs and an engine span, in one or two
    export requests, plus spans whose inputs are garbage of every type."""
    tokens = request_tokens(s)
    router = {
        "gen_ai.request.id": "r1", "kvmiss.route.worker": "A", "kvmiss.route.policy": "prefix",
        "gen_ai.usage.cache_read.input_tokens": BLOCK,
        "kvmiss.lookup_time_unix_nano": int((TS0 + 20.5) * 1e9),
        "kvmiss.token_ids": draw(token_attribute(tokens)),
        "kvmiss.extra_keys": draw(extra_keys_attribute(s)),
    }
    engine = {"gen_ai.request.id": "r1", "gen_ai.usage.prompt_tokens": len(tokens) + 1}
    if draw(st.booleans()):  # the same raw inputs twice, once garbled
        engine["kvmiss.token_ids"] = draw(token_attribute(tokens))
        engine["kvmiss.extra_keys"] = draw(extra_keys_attribute(s))
    for key in draw(st.lists(st.sampled_from(INPUT_KEYS[2:5] + INPUT_KEYS[8:]), max_size=3)):
        router.setdefault(key, draw(garbage_values))
    spans = [router, engine]
    for _ in range(draw(st.integers(0, 2))):
        spans.append({key: draw(garbage_values) for key in draw(st.lists(st.sampled_from(INPUT_KEYS), max_size=6))}
                     | {"kvmiss.token_ids": draw(token_attribute(s.tokens[-BLOCK * 2:])),
                        "kvmiss.extra_keys": draw(extra_keys_attribute(s))})
    split = draw(st.integers(1, len(spans)))
    return [_request(spans[:split]), _request(spans[split:])] if split < len(spans) else [_request(spans)]


def _request(spans: list[dict]) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    for i, attributes in enumerate(spans):
        span = scope.spans.add(trace_id=TRACE, span_id=bytes([i + 1] * 8), name=f"span{i}")
        for key, value in attributes.items():
            kv = span.attributes.add()
            kv.key = key
            set_value(kv.value, value)
    return request


class Sink:
    def __init__(self, refuse: bool) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.refuse = refuse

    def has_capacity(self, spans: int) -> bool:
        return True

    def put(self, request, tag=None) -> bool:
        self.requests.append(request)
        return not self.refuse  # a refusal is logged by the pipeline


class Clock:
    def __init__(self) -> None:
        self.t = TS0 + 25

    def __call__(self) -> float:
        return self.t


def run_pipeline(s: Secrets, requests: list[ExportTraceServiceRequest], refuse: bool,
                 reader: SpanReader | None = None):
    """Consume, poll and scrape; returns (exported text, metrics text, verdict reasons and
    the request records written, the pipeline)."""
    exemplars: dict = {}
    reasons: list[str] = []
    folder = tempfile.TemporaryDirectory()
    records = RequestRecords(os.path.join(folder.name, "requests.jsonl"))

    def on_verdict(facts, verdict, trace_id):
        exemplars[(verdict.label, facts.route_policy or "", facts.worker or "")] = trace_id.hex()
        reasons.append(msgspec.json.encode(verdict).decode())
        records.put(facts, trace_id)

    clock = Clock()
    pipe = Pipeline(Attributor(index_holding(s), DigestKey(s.key)), Sink(refuse), hasher=HASHER,
                    default_block_size=BLOCK, clock=clock, on_verdict=on_verdict, reader=reader)
    for request in requests:
        asyncio.run(pipe.consume(request))
    pipe.poll()
    clock.t += 30
    pipe.poll(final=True)
    exported = []
    for request in pipe.sink.requests:
        exported.append(json_format.MessageToJson(request))
        exported.append(request.SerializeToString().decode("latin-1"))
    registry = CollectorRegistry()
    registry.register(KvmissCollector(pipe.stats, lambda: {"A": WorkerStream("A", replay=True)},
                                      exemplars=exemplars))
    metrics = prom_text.generate_latest(registry).decode() + openmetrics.generate_latest(registry).decode()
    records.shutdown()
    with folder:
        path = os.path.join(folder.name, "requests.jsonl")
        written = open(path).read() if os.path.exists(path) else ""
    assert written.count("\n") == len(reasons)  # one record per verdict
    return "\n".join(exported), metrics, "\n".join(reasons) + "\n" + written, pipe


def test_the_scenario_reaches_hashing_divergence_and_export():
    """Without garbling, the secret prompt is hashed, judged no_match with a token
    divergence inside block 1, and every span is exported with its raw inputs removed."""
    s = Secrets(tokens=list(range(10**8 + 1, 10**8 + 25)), salt="SALTabcdef", path="/adapters/ADPTxyz",
                key="DKEY" + "k" * 20)
    request = _request([
        {"gen_ai.request.id": "r1", "kvmiss.route.worker": "A", "gen_ai.usage.cache_read.input_tokens": BLOCK,
         "kvmiss.lookup_time_unix_nano": int((TS0 + 20.5) * 1e9), "kvmiss.token_ids": request_tokens(s),
         "kvmiss.extra_keys": json.dumps({"lora": {"name": "lora-a", "path": s.path}, "cache_salt": s.salt})},
        {"gen_ai.request.id": "r1", "gen_ai.usage.prompt_tokens": len(request_tokens(s)) + 1},
    ])
    exported, metrics, verdicts, pipe = run_pipeline(s, [request], refuse=False)
    assert '"label":"no_match"' in verdicts and '"first_token_index":6' in verdicts
    assert "kvmiss.divergence_kind" in exported and "kvmiss.token_ids" not in exported
    assert pipe.stats.spans_out == 2 and not s.leaks(exported + metrics + verdicts)


def test_raw_inputs_read_under_configured_attribute_names_are_not_exported():
    s = Secrets(tokens=list(range(10**8 + 1, 10**8 + 25)), salt="SALTabcdef", path="/adapters/ADPTxyz",
                key="DKEY" + "k" * 20)
    reader = SpanReader(InputNames(token_ids=["router.prompt_ids"], extra_keys=["router.prompt_extras"]))
    request = _request([
        {"gen_ai.request.id": "r1", "kvmiss.route.worker": "A", "gen_ai.usage.cache_read.input_tokens": BLOCK,
         "gen_ai.usage.prompt_tokens": 30, "router.prompt_ids": request_tokens(s),
         "router.prompt_extras": json.dumps({"cache_salt": s.salt})}])
    exported, *_ = run_pipeline(s, [request], refuse=False, reader=reader)
    assert not s.leaks(exported), s.leaks(exported)


@fuzz_settings(20)
@given(secrets, st.data())
def test_no_raw_prompt_material_reaches_spans_metrics_or_logs(s, data):
    requests = data.draw(export_requests(s))
    refuse = data.draw(st.booleans())
    with all_logs_at_debug() as logs:
        exported, metrics, verdicts, pipe = run_pipeline(s, requests, refuse)
    assert pipe.stats.spans_in == sum(len(ss.spans) for r in requests for rs in r.resource_spans for ss in rs.scope_spans)
    assert "kvmiss.token_ids" not in exported and "kvmiss.extra_keys" not in exported
    assert "token_ids" not in verdicts and "extra_keys" not in verdicts  # (with the request records)
    for where, text in (("exported spans", exported), ("metrics", metrics),
                        ("verdicts and request records", verdicts), ("logs", "\n".join(logs.texts))):
        assert not s.leaks(text), (where, s.leaks(text))


# --- `kvmiss decode`: events carrying raw prompt material, intact or corrupted ----------


@st.composite
def decode_input(draw, s: Secrets) -> bytes:
    events = [
        {"type": "BlockStored", "block_hashes": [1, 2], "token_ids": s.tokens[:8], "block_size": BLOCK,
         "cache_salt": s.salt, "lora_name": "lora-a", "extra_keys": [[s.salt, s.path], [["mm", 3]]],
         "lookahead_token_ids": s.tokens[8:10], "medium": "GPU"},
        ["BlockStored", [3], 2, s.tokens[10:14], BLOCK, None, "GPU", "lora-a", [[s.path]]],
        {"type": "BlockRemoved", "block_hashes": [1]},
    ]
    payload = msgspec.msgpack.encode([TS0, draw(st.permutations(events)), 0])
    if draw(st.booleans()):
        payload = draw(mutate_bytes(payload))
    frames = [b"kv@A", (7).to_bytes(8, "big"), payload]
    if draw(st.booleans()):
        frames = [b"", *frames]
    return json.dumps({"frames": [base64.b64encode(f).decode() for f in frames]}).encode()


@fuzz_settings(35)
@given(secrets, st.data())
def test_decode_never_prints_raw_prompt_material_or_leaks_it_in_errors(s, data):
    lines = [data.draw(decode_input(s)) for _ in range(data.draw(st.integers(1, 3)))]
    out = io.BytesIO()
    with all_logs_at_debug() as logs:
        decode_cmd.run(argparse.Namespace(raw=False), stdin=io.BytesIO(b"\n".join(lines) + b"\n"), stdout=out)
    text = out.getvalue().decode()
    assert not s.leaks(text), s.leaks(text)
    assert not s.leaks("\n".join(logs.texts))
