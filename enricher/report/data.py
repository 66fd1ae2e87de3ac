"""The report's input: one row per attributed request, from either file kvmiss writes.

  * attribution records (``kvmiss attribute`` output, `AttributionRecord` JSON lines);
  * enriched spans (OTLP/JSON lines, as ``[export] file`` writes them): every span that
    carries ``kvmiss.label`` is one request; its prompt tokens are joined from the other
    spans of its trace with the same ``gen_ai.request.id`` (vLLM's ``llm_request``).

Only what kvmiss exports is read: labels, owners, counts, indices, kinds and keyed digests.
An optional context (``report_context.json``, written by ``kvmiss demo``) adds what no
span carries: stream health over time, route-to-BlockStored latency, ground truth.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from kvmiss.schemas.attribution import AttributionRecord
from kvmiss.schemas.labels import LABELS as LABEL_TABLE, NOT_MISSES as NOT_MISS_LABELS, UNKNOWN_LABELS, owner_of

# Rows carry labels as plain strings, and the report formats them (str() of a member is not
# its value): the label table's sets as values, and every label in precedence order.
UNKNOWN = frozenset(label.value for label in UNKNOWN_LABELS)
NOT_MISSES = frozenset(label.value for label in NOT_MISS_LABELS)
LABELS = [label.value for label in LABEL_TABLE]


class Row(msgspec.Struct, kw_only=True):
    """One attributed request, as the report needs it."""

    label: str
    owner: str
    request_id: str | None = None
    trace_id: str | None = None
    worker: str | None = None
    route_policy: str | None = None
    lookup_time: float | None = None  # unix seconds (engine clock)
    reason: str = ""
    history: str | None = None
    missed_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    first_miss_block: int | None = None
    first_miss_digest: str | None = None
    extra_key_kinds: tuple[str, ...] = ()
    divergence_kind: str | None = None
    divergence_token: int | None = None
    holders: int = 0
    eviction_age_ms: int | None = None


class InputError(ValueError):
    """The input file cannot be read as the format asked for."""


# --- attribution records ----------------------------------------------------------------

_record_decoder = msgspec.json.Decoder(AttributionRecord)


def row_from_record(record: AttributionRecord) -> Row:
    v = record.verdict
    return Row(
        label=v.label.value, owner=v.owner.value, request_id=record.request_id,
        trace_id=record.trace_id, worker=record.worker, lookup_time=record.lookup_time,
        reason=v.reason, history=v.history.value if v.history else None,
        missed_tokens=v.missed_tokens, prompt_tokens=record.prompt_tokens,
        cached_tokens=record.cached_tokens, first_miss_block=v.first_miss_block,
        first_miss_digest=v.first_miss_digest, extra_key_kinds=tuple(v.extra_key_kinds),
        divergence_kind=v.divergence.kind.value if v.divergence else None,
        divergence_token=v.divergence.first_token_index if v.divergence else None,
        holders=v.holders, eviction_age_ms=v.eviction_age_ms,
    )


def load_records(path: str | Path, errors: list[str] | None = None) -> list[Row]:
    """Rows from an attribution-record file; a bad line is reported in ``errors``."""
    rows = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(row_from_record(_record_decoder.decode(line)))
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                if errors is not None:
                    errors.append(f"line {number}: {exc}")
    return rows


# --- enriched spans (OTLP/JSON lines) -----------------------------------------------------


def any_value(value: dict) -> Any:
    """An OTLP/JSON ``AnyValue`` as Python (int64 travels as a JSON string)."""
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [any_value(v) for v in value["arrayValue"].get("values", [])]
    return None


def attributes(items: Iterable[dict]) -> dict[str, Any]:
    return {kv["key"]: any_value(kv.get("value", {})) for kv in items}


class JsonSpan(msgspec.Struct):
    trace_id: str
    span_id: str
    name: str
    start_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]


def spans_of_line(line: str | bytes) -> Iterator[JsonSpan]:
    """The spans of one OTLP/JSON ``ExportTraceServiceRequest`` line."""
    document = json.loads(line)
    for resource_spans in document.get("resourceSpans", ()):
        resource = attributes(resource_spans.get("resource", {}).get("attributes", ()))
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                yield JsonSpan(span.get("traceId", ""), span.get("spanId", ""),
                               span.get("name", ""), int(span.get("startTimeUnixNano", 0)),
                               attributes(span.get("attributes", ())), resource)


def row_from_span(span: JsonSpan) -> Row | None:
    """The request row of a span carrying ``kvmiss.label`` (None for any other span)."""
    a = span.attributes
    label = a.get("kvmiss.label")
    if label not in LABELS:
        return None
    lookup_ns = a.get("kvmiss.lookup_time_unix_nano")
    lookup = lookup_ns / 1e9 if isinstance(lookup_ns, int) else (span.start_ns / 1e9 or None)
    prompt = a.get("gen_ai.usage.input_tokens", a.get("gen_ai.usage.prompt_tokens"))
    cached = a.get("gen_ai.usage.cache_read.input_tokens", a.get("kvmiss.cached_tokens"))
    kinds = a.get("kvmiss.extra_key_kinds") or ()
    return Row(
        label=label, owner=a.get("kvmiss.owner") or owner_of(label).value,
        request_id=a.get("gen_ai.request.id"), trace_id=span.trace_id or None,
        worker=a.get("kvmiss.route.worker"), route_policy=a.get("kvmiss.route.policy"),
        lookup_time=lookup, reason=a.get("kvmiss.reason") or "", history=a.get("kvmiss.history"),
        missed_tokens=a.get("kvmiss.missed_tokens") or 0,
        prompt_tokens=prompt if isinstance(prompt, int) else None,
        cached_tokens=cached if isinstance(cached, int) else None,
        first_miss_block=a.get("kvmiss.first_miss_block"),
        first_miss_digest=a.get("kvmiss.first_miss_digest"),
        extra_key_kinds=tuple(str(k) for k in kinds),
        divergence_kind=a.get("kvmiss.divergence_kind"),
        divergence_token=a.get("kvmiss.divergence_token"),
        holders=a.get("kvmiss.holders") or 0, eviction_age_ms=a.get("kvmiss.eviction_age_ms"),
    )


def load_spans(path: str | Path, errors: list[str] | None = None) -> list[Row]:
    """Rows from an enriched OTLP/JSON-lines file (prompt tokens joined within a trace)."""
    rows: list[Row] = []
    prompts: dict[tuple[str, Any], int] = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                spans = list(spans_of_line(line))
            except (ValueError, TypeError, AttributeError) as exc:
                if errors is not None:
                    errors.append(f"line {number}: not OTLP/JSON ({type(exc).__name__})")
                continue
            for span in spans:
                a = span.attributes
                prompt = a.get("gen_ai.usage.input_tokens", a.get("gen_ai.usage.prompt_tokens"))
                if isinstance(prompt, int):
                    prompts[(span.trace_id, a.get("gen_ai.request.id"))] = prompt
                row = row_from_span(span)
                if row is not None:
                    rows.append(row)
    for row in rows:
        if row.prompt_tokens is None:
            row.prompt_tokens = prompts.get((row.trace_id or "", row.request_id))
    return rows


class SpanFileTail:
    """Reads the rows appended to a growing OTLP/JSON-lines file (complete lines only)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.offset = 0
        self.lines = 0

    def read_new(self) -> list[Row]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        rows = []
        for line in data[:end].splitlines():
            if line.strip():
                self.lines += 1
                rows += [r for r in map(row_from_span, spans_of_line(line)) if r is not None]
        return rows


# --- totals -------------------------------------------------------------------------------


class Totals:
    """Requests, misses and missed tokens by label and owner; the unknown share."""

    def __init__(self, rows: list[Row]):
        self.requests = len(rows)
        self.by_label: collections.Counter[str] = collections.Counter(r.label for r in rows)
        self.tokens_by_label: collections.Counter[str] = collections.Counter()
        self.by_owner: collections.Counter[str] = collections.Counter()
        for r in rows:
            self.tokens_by_label[r.label] += r.missed_tokens
            self.by_owner[r.owner] += 1
        self.misses = sum(n for label, n in self.by_label.items() if label not in NOT_MISSES)
        self.unknown = sum(self.by_label[label] for label in UNKNOWN)
        self.unknown_share = self.unknown / self.misses if self.misses else 0.0
        self.missed_tokens = sum(self.tokens_by_label.values())

    def labels(self) -> list[str]:
        """The labels present, in precedence order."""
        return [label for label in LABELS if self.by_label[label]]


def load_context(path: str | Path | None) -> dict[str, Any]:
    """The optional report context (``kvmiss demo``'s report_context.json)."""
    if path is None:
        return {}
    try:
        context = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: cannot read the report context: {exc}") from None
    if not isinstance(context, dict):
        raise InputError(f"{path}: the report context must be a JSON object")
    return context
