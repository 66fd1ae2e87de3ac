"""OTLP spans <-> kvmiss: read request facts from span attributes, write verdicts back.

Reading is one pass over a span's attributes with a dict from attribute name to the fact it
feeds (built once from the configured `InputNames`); values of the wrong type are skipped
and reported, never raised. Writing upserts the output attributes (a replayed span never
gets a label twice) and strips raw prompt material before export.

Works on the protobuf messages of ``opentelemetry.proto`` directly (the receiver forwards
the request it received; converting to SDK spans would be lossy and slow).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import msgspec

from kvmiss.schemas import span_attributes as names
from kvmiss.schemas.attribution import TransferAttempt, TransferResult, Verdict
from kvmiss.schemas.events import MASK64
from kvmiss.schemas.span_attributes import InputNames


class SpanFacts(msgspec.Struct, kw_only=True):
    """The request facts one span carries (every field optional)."""

    request_id: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    block_size: int | None = None
    worker: str | None = None
    dp_rank: int | None = None
    route_policy: str | None = None
    predicted_cached_tokens: int | None = None
    instance: str | None = None
    block_hashes: list[int] | None = None
    token_ids: list[int] | None = None
    extra_keys: str | None = None
    extra_key_kinds: list[str] | None = None
    lookup_time: float | None = None  # seconds, engine wall clock
    queue_lookup_time: float | None = None  # span start + time in queue (vLLM), seconds
    transfer: TransferAttempt | None = None
    recomputed_tokens: int | None = None
    tenant_policy: str | None = None
    adapter: str | None = None
    model_revision: str | None = None
    template_version: str | None = None


def _int(value: Any) -> int | None:
    kind = value.WhichOneof("value")
    if kind == "int_value":
        return value.int_value
    if kind == "double_value" and value.double_value.is_integer():
        return int(value.double_value)
    if kind == "string_value" and value.string_value.strip().lstrip("-").isdigit():
        return int(value.string_value)
    return None


def _float(value: Any) -> float | None:
    kind = value.WhichOneof("value")
    if kind == "double_value":
        return value.double_value
    if kind == "int_value":
        return float(value.int_value)
    return None


def _str(value: Any) -> str | None:
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return value.string_value
    if kind == "int_value":
        return str(value.int_value)
    return None


def _int_list(value: Any) -> list[int] | None:
    if value.WhichOneof("value") != "array_value":
        return None
    out = []
    for item in value.array_value.values:
        n = _int(item)
        if n is None:
            return None
        out.append(n)
    return out


def _hash_list(value: Any) -> list[int] | None:
    """OTel ints are signed 64-bit: values >= 2^63 travel as two's complement."""
    ints = _int_list(value)
    return None if ints is None else [i & MASK64 for i in ints]


def _str_list(value: Any) -> list[str] | None:
    if value.WhichOneof("value") != "array_value":
        return None
    out = [item.string_value for item in value.array_value.values
           if item.WhichOneof("value") == "string_value"]
    return out if len(out) == len(value.array_value.values) else None


def _transfer_result(value: Any) -> TransferResult | None:
    text = _str(value)
    try:
        return TransferResult(text.lower()) if text is not None else None
    except ValueError:
        return None


_CONVERTERS: dict[str, Callable[[Any], Any]] = {
    "request_id": _str, "prompt_tokens": _int, "cached_tokens": _int, "block_size": _int,
    "worker": _str, "dp_rank": _int, "route_policy": _str, "predicted_cached_tokens": _int,
    "instance": _str, "block_hashes": _hash_list, "token_ids": _int_list, "extra_keys": _str,
    "extra_key_kinds": _str_list, "lookup_time_unix_nano": _int, "time_in_queue_s": _float,
    "transfer_result": _transfer_result, "transfer_source": _str, "recomputed_tokens": _int,
    "tenant_policy": _str, "adapter": _str, "model_revision": _str, "template_version": _str,
}


class SpanReader:
    """Reads `SpanFacts` from protobuf spans. Thread-safe after construction (read-only)."""

    def __init__(self, inputs: InputNames | None = None):
        inputs = inputs or InputNames()
        # attribute name -> (fact, rank): a lower rank wins when a span has several.
        self._lookup: dict[str, tuple[str, int]] = {}
        for fact in _CONVERTERS:
            for rank, attr in enumerate(getattr(inputs, fact)):
                self._lookup.setdefault(attr, (fact, rank))
        self._instance_names = list(inputs.instance)

    def instance_of(self, resource_attributes: Iterable[Any]) -> str | None:
        found = {kv.key: kv.value for kv in resource_attributes if kv.key in self._instance_names}
        for name in self._instance_names:
            if name in found:
                return _str(found[name])
        return None

    def read(self, span: Any, bad: list[str] | None = None) -> SpanFacts | None:
        """The facts on ``span``, or None when it carries none. Names of attributes with an
        unusable value are appended to ``bad`` (names only: values may be prompt material)."""
        values: dict[str, tuple[int, Any]] = {}
        for kv in span.attributes:
            hit = self._lookup.get(kv.key)
            if hit is None:
                continue
            fact, rank = hit
            if fact in values and values[fact][0] <= rank:
                continue
            converted = _CONVERTERS[fact](kv.value)
            if converted is None:
                if bad is not None:
                    bad.append(kv.key)
                continue
            values[fact] = (rank, converted)
        if not values:
            return None
        facts = SpanFacts()
        for fact, (_, value) in values.items():
            if fact == "lookup_time_unix_nano":
                facts.lookup_time = value / 1e9
            elif fact == "time_in_queue_s":
                facts.queue_lookup_time = span.start_time_unix_nano / 1e9 + value
            elif fact == "transfer_result":
                source = values.get("transfer_source", (0, None))[1]
                facts.transfer = TransferAttempt(value, source)
            elif fact != "transfer_source":
                setattr(facts, fact, value)
        return facts


def _set(kv: Any, value: Any) -> None:
    if isinstance(value, bool):
        kv.value.bool_value = value
    elif isinstance(value, int):
        kv.value.int_value = value
    elif isinstance(value, float):
        kv.value.double_value = value
    elif isinstance(value, (list, tuple)):
        array = kv.value.array_value
        for item in value:
            array.values.add().string_value = str(item)
    else:
        kv.value.string_value = str(value)


def verdict_attributes(verdict: Verdict, lookup_time: float | None = None) -> dict[str, Any]:
    """The output attributes for one verdict (SPANS.md), None-valued ones left out."""
    out: dict[str, Any] = {
        names.LABEL: verdict.label.value,
        names.OWNER: verdict.owner.value,
        names.REASON: verdict.reason,
    }
    if verdict.history is not None:
        out[names.HISTORY] = verdict.history.value
    if verdict.first_miss_block is not None:
        out[names.FIRST_MISS_BLOCK] = verdict.first_miss_block
        out[names.MISSED_TOKENS] = verdict.missed_tokens
        out[names.HOLDERS] = verdict.holders
    optional = {
        names.FIRST_MISS_DIGEST: verdict.first_miss_digest,
        names.EVICTION_AGE_MS: verdict.eviction_age_ms,
        names.EPOCH: verdict.epoch,
        names.STORED_SEQ: verdict.stored_seq,
        names.REMOVED_SEQ: verdict.removed_seq,
        names.GAP_FROM_SEQ: verdict.gap_from_seq,
        names.GAP_TO_SEQ: verdict.gap_to_seq,
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


def upsert_attributes(span: Any, values: dict[str, Any], *, drop: Iterable[str] = ()) -> None:
    """Set ``values`` on ``span`` replacing any attribute of the same key, and remove the
    keys in ``drop``. Keys stay unique (OTLP requires it)."""
    remove = set(values) | set(drop)
    attributes = span.attributes
    if any(kv.key in remove for kv in attributes):
        kept = [kv for kv in attributes if kv.key not in remove]
        del attributes[:]
        attributes.extend(kept)
    for key, value in values.items():
        kv = attributes.add()
        kv.key = key
        _set(kv, value)


def strip_raw_inputs(span: Any, *, keep_block_hashes: bool = False) -> None:
    """Remove prompt material (and, by default, block hashes) from a span before export."""
    drop = names.RAW_INPUTS if keep_block_hashes else (*names.RAW_INPUTS, names.BLOCK_HASHES)
    if any(kv.key in drop for kv in span.attributes):
        upsert_attributes(span, {}, drop=drop)
