"""Helpers for the tests of examples/: where the examples are, the metric names kvmiss really
exports (scraped from a KvmissCollector over a small real pipeline), and the metric names a
PromQL expression uses."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest as text_exposition
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_exposition

from kvmiss.collectors.continuity import HoleReason
from kvmiss.collectors.stream import WorkerStream
from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.core.privacy import DigestKey
from kvmiss.enricher.service.metrics import KvmissCollector
from kvmiss.enricher.service.pipeline import Pipeline

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


# --- the names kvmiss exports ---------------------------------------------------------------

class _Sink:
    def has_capacity(self, spans: int) -> bool:
        return True

    def put(self, request, tag=None) -> bool:
        return True


def _request(worker: str) -> ExportTraceServiceRequest:
    """One router span with every input kvmiss needs, for a worker the index never saw."""
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add(
        trace_id=bytes(range(16)), span_id=b"\x01" * 8, name="route")
    values = {"gen_ai.request.id": "r1", "gen_ai.usage.input_tokens": 40,
              "gen_ai.usage.cache_read.input_tokens": 16, "kvmiss.route.worker": worker,
              "kvmiss.route.policy": "prefix", "kvmiss.lookup_time_unix_nano": 10**18}
    for key, value in values.items():
        kv = span.attributes.add(key=key)
        if isinstance(value, str):
            kv.value.string_value = value
        else:
            kv.value.int_value = value
    hashes = span.attributes.add(key="kvmiss.block_hashes")
    for h in (11, 12, 13):
        hashes.value.array_value.values.add().int_value = h
    return request


def scrape_kvmiss_metrics() -> str:
    """The /metrics text of a KvmissCollector after a real pipeline judged one request and a
    worker stream has every health field set (so that every family has samples)."""
    now = [0.0]
    pipe = Pipeline(Attributor(ResidencyIndex(), DigestKey("examples-test-secret-0001")), _Sink(),
                    history_wait_s=0.0, clock=lambda: now[0])
    asyncio.run(pipe.consume(_request("w9")))
    pipe.poll()
    now[0] = 1.0
    pipe.poll()
    assert sum(pipe.stats.verdicts.values()) == 1, "the small pipeline judged nothing"
    pipe.stats.unenriched["facts_incomplete"] += 1
    pipe.stats.bad_attributes["kvmiss.block_hashes"] += 1
    pipe.stats.whatif_evicted_tokens["w0"] += 16  # what-if counters: set as an evicted miss sets them
    pipe.stats.whatif_kept_tokens[("w0", "2")] += 16

    stream = WorkerStream("w0", replay=True)
    health = stream.health
    health.batches_applied, health.gaps_detected = 10, 1
    health.unrecoverable_gaps = {HoleReason.MISSING: 1}
    health.last_contiguous_seq, health.oldest_replayable_seq, health.peak_batches_per_s = 9, 2, 4
    registry = CollectorRegistry()
    registry.register(KvmissCollector(pipe.stats, lambda: {"w0": stream}, unknown_budget=0.05))
    return text_exposition(registry).decode() + openmetrics_exposition(registry).decode()


def sample_names(exposition: str) -> set[str]:
    names = set()
    for line in exposition.splitlines():
        if line and not line.startswith("#"):
            names.add(re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0))
    return names


# --- PromQL -----------------------------------------------------------------------------------

PROMQL_FUNCTIONS_AND_KEYWORDS = {
    # aggregation operators and modifiers
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
    "topk", "quantile", "limitk", "limit_ratio", "by", "without", "on", "ignoring", "group_left",
    "group_right", "bool", "offset", "and", "or", "unless", "atan2",
}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression selects. Grafana variables ($x, ${x}) are dropped, as
    are label matchers, label lists of by/without/on/ignoring/group_*, range durations,
    strings, numbers, function names and keywords."""
    text = re.sub(r"#[^\n]*", " ", expr)  # PromQL comments
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', " ", text)  # strings
    text = re.sub(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]", " 1 ", text)  # Grafana variables
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range / subquery durations
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", text):
        word, call = match.group(1), match.group(2)
        if call or word in PROMQL_FUNCTIONS_AND_KEYWORDS or word in ("inf", "nan", "Inf", "NaN"):
            continue
        names.add(word)
    return names


def grafana_variables(expr: str) -> set[str]:
    return {m.group(1) or m.group(2) or m.group(3)
            for m in re.finditer(r"\$\{(\w+)[^}]*\}|\$(\w+)|\[\[(\w+)\]\]", expr)}


def fenced_blocks(markdown: str, language: str) -> list[str]:
    return [m.group(1) for m in re.finditer(rf"^```{language}\n(.*?)^```", markdown, re.M | re.S)]


# --- addresses ----------------------------------------------------------------------------------

def host_port(address: str) -> tuple[str, int]:
    """'0.0.0.0:4317', 'grpc://host:4417', 'http://127.0.0.1:5317' -> (host, port)."""
    address = re.sub(r"^[a-z]+://", "", address).rstrip("/")
    host, _, port = address.rpartition(":")
    return host, int(port)


LOOPBACK = {"127.0.0.1", "localhost", "::1"}


# --- the Collector's ${env:NAME:-default} references ------------------------------------------

ENV_REFERENCE = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def with_env_defaults(text: str) -> str:
    """A Collector config as it runs with no variable set: each ``${env:NAME:-default}`` is its
    default (the value is YAML, as the Collector's env provider reads it). A reference without a
    default is an error here: the shipped files must run as they are."""
    def default(match: re.Match) -> str:
        assert match.group(2) is not None, f"${{env:{match.group(1)}}} has no default"
        return match.group(2)
    return ENV_REFERENCE.sub(default, text)
