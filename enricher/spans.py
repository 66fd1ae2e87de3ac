"""OTLP spans <-> kvmiss: read request facts from span attributes, write verdicts back.

Reading is one pass over a span's attributes with a dict from attribute name to the fact it
feeds (built once from the configured `InputNames`); values of the wrong type are skipped
and reported, never raised. Writing upserts the output attributes (a replayed span never
gets a label twice) and strips raw prompt material before export.

Works on the protobuf messages of ``opentelemetry.proto`` directly (the receiver forwards
the request it received; converting to SDK spans would be lossy and slow). The same reader
also takes an SDK span's attribute mapping (`SpanReader.read_attributes`, for the in-process
exporter, enricher/inprocess.py): both unwrap values to Python and share one set of rules.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

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
    # Worker named by the span's resource (``kvmiss.worker``); a span attribute wins over it.
    resource_worker: str | None = None
    # The span is the kvmiss vLLM plugin's `PREFIX_LOOKUP_SPAN`: its request id is the
    # engine's, which may extend the API-level id (enricher/assembly.py joins them).
    engine_lookup: bool = False


# Converters take the *Python* value of an attribute -- str, bool, int, float, or a list /
# tuple of those -- which is what the SDK holds (`ReadableSpan.attributes`) and what
# `_unwrap` makes of an OTLP ``AnyValue``. One set of rules serves both readers.
# ``type(x) is int`` on purpose: bool is an int subclass, and a bool is never a count.


_INT64 = range(-(1 << 63), 1 << 63)  # OTLP int attributes; larger values overflow on export


def _int(value: Any) -> int | None:
    kind = type(value)
    if kind is int:
        n = value
    elif kind is float and value.is_integer():
        n = int(value)
    elif kind is str and value.strip().lstrip("-").isdigit():
        try:
            n = int(value)
        except ValueError:  # "--5", "²", 5000 digits: str.isdigit() is wider than int()
            return None
    else:
        return None
    return n if n in _INT64 else None


def _float(value: Any) -> float | None:
    kind = type(value)
    if kind is float:
        return value
    if kind is int:
        return float(value)
    return None


def _str(value: Any) -> str | None:
    kind = type(value)
    if kind is str:
        return value
    if kind is int:
        return str(value)
    return None


class _Ints(list):
    """An unwrapped OTLP array whose elements were all non-zero ``int_value``s: `_int_list`
    need not look at them one by one."""


def _int_list(value: Any) -> list[int] | None:
    if type(value) is _Ints:
        return value
    if not isinstance(value, (list, tuple)):
        return None
    out = []
    for item in value:
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
    if not isinstance(value, (list, tuple)) or any(type(item) is not str for item in value):
        return None
    return list(value)


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

_UNUSABLE = object()  # kvlist / bytes / empty values: no converter accepts it


def _unwrap(value: Any) -> Any:
    """An OTLP ``AnyValue`` as the Python value the SDK would hold for it."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        # Fast path for int arrays (block chains; ~3x faster per element): an element of
        # another kind reads as int_value 0, so without a 0 every element is an int.
        items = value.array_value.values
        ints = _Ints([item.int_value for item in items])
        return ints if 0 not in ints else [_unwrap(item) for item in items]
    if kind in ("string_value", "int_value", "double_value", "bool_value"):
        return getattr(value, kind)
    return _UNUSABLE


class SpanReader:
    """Reads `SpanFacts` from spans: OTLP protobuf spans (`read`, `instance_of`) or the
    attribute mapping of an SDK ``ReadableSpan`` (`read_attributes`), with the same names,
    ranks and value rules. Thread-safe after construction (read-only)."""

    def __init__(self, inputs: InputNames | None = None):
        inputs = inputs or InputNames()
        # attribute name -> (fact, rank): a lower rank wins when a span has several.
        self._lookup: dict[str, tuple[str, int]] = {}
        for fact in _CONVERTERS:
            for rank, attr in enumerate(getattr(inputs, fact)):
                self._lookup.setdefault(attr, (fact, rank))
        self._instance_names = list(inputs.instance)
        self._worker_names = list(inputs.resource_worker)

    def raw_names(self, *, keep_block_hashes: bool = False) -> frozenset[str]:
        """Every attribute never exported: prompt material (token ids, extra keys) under the
        default names and every configured name kvmiss reads it from, and, unless kept, the
        block hashes likewise."""
        facts = ("token_ids", "extra_keys") + (() if keep_block_hashes else ("block_hashes",))
        configured = {attr for attr, (fact, _) in self._lookup.items() if fact in facts}
        defaults = names.RAW_INPUTS if keep_block_hashes else (*names.RAW_INPUTS, names.BLOCK_HASHES)
        return frozenset(configured | set(defaults))

    def is_input(self, attribute: str) -> bool:
        """Whether ``attribute`` is read as some fact (the configured names)."""
        return attribute in self._lookup

    def instance_of(self, resource_attributes: Iterable[Any]) -> str | None:
        """The engine instance from OTLP resource attributes (protobuf KeyValues)."""
        found = {kv.key: kv.value for kv in resource_attributes if kv.key in self._instance_names}
        for name in self._instance_names:
            if name in found:
                return _str(_unwrap(found[name]))
        return None

    def instance_of_attributes(self, resource_attributes: Mapping[str, Any]) -> str | None:
        """`instance_of` for an SDK ``Resource.attributes`` mapping."""
        return next((_str(resource_attributes[n]) for n in self._instance_names if n in resource_attributes), None)

    def worker_of_attributes(self, resource_attributes: Mapping[str, Any]) -> str | None:
        """`worker_of` for an SDK ``Resource.attributes`` mapping."""
        return next((_str(resource_attributes[n]) for n in self._worker_names if n in resource_attributes), None)

    def worker_of(self, resource_attributes: Iterable[Any]) -> str | None:
        """The worker a resource names (protobuf KeyValues), for spans that name none."""
        found = {kv.key: kv.value for kv in resource_attributes if kv.key in self._worker_names}
        for name in self._worker_names:
            if name in found:
                return _str(_unwrap(found[name]))
        return None

    def read(self, span: Any, bad: list[str] | None = None, *,
             resource_worker: str | None = None) -> SpanFacts | None:
        """The facts on OTLP ``span``, or None when it carries none. Names of attributes with
        an unusable value are appended to ``bad`` (names only: values may be prompt material).
        ``resource_worker``: `worker_of` the span's resource."""
        lookup = self._lookup
        hits = [(kv.key, kv.value) for kv in span.attributes if kv.key in lookup]
        if not hits:
            return None
        return self._facts([(key, _unwrap(value)) for key, value in hits],
                           span.start_time_unix_nano, bad, span.name, resource_worker)

    def read_attributes(self, attributes: Mapping[str, Any], start_time_unix_nano: int | None,
                        bad: list[str] | None = None, *, name: str = "",
                        resource_worker: str | None = None) -> SpanFacts | None:
        """`read` for an SDK ``ReadableSpan``: its attributes, start time (ns; used with
        vLLM's time in queue) and name."""
        lookup = self._lookup
        hits = [(key, value) for key, value in attributes.items() if key in lookup]
        if not hits:
            return None
        return self._facts(hits, start_time_unix_nano or 0, bad, name, resource_worker)

    def _facts(self, hits: list[tuple[str, Any]], start_time_unix_nano: int, bad: list[str] | None,
               span_name: str, resource_worker: str | None) -> SpanFacts | None:
        """The facts of (attribute name, Python value) pairs whose names are inputs."""
        values: dict[str, tuple[int, Any]] = {}
        for key, raw in hits:
            fact, rank = self._lookup[key]
            if fact in values and values[fact][0] <= rank:
                continue
            converted = _CONVERTERS[fact](raw)
            if converted is None:
                if bad is not None:
                    bad.append(key)
                continue
            values[fact] = (rank, converted)
        if not values:
            return None
        facts = SpanFacts(resource_worker=resource_worker, engine_lookup=span_name == names.PREFIX_LOOKUP_SPAN)
        for fact, (_, value) in values.items():
            if fact == "lookup_time_unix_nano":
                facts.lookup_time = value / 1e9
            elif fact == "time_in_queue_s":
                facts.queue_lookup_time = start_time_unix_nano / 1e9 + value
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
    _delete(attributes, [i for i, kv in enumerate(attributes) if kv.key in remove])
    for key, value in values.items():
        kv = attributes.add()
        kv.key = key
        _set(kv, value)


def _delete(attributes: Any, indexes: list[int]) -> None:
    """Delete in place, from the end so earlier indexes stay valid: ~2x cheaper than
    copying the kept attributes into a new list."""
    for i in reversed(indexes):
        del attributes[i]


def strip_raw_inputs(span: Any, drop: frozenset[str]) -> None:
    """Remove the attributes in ``drop`` (`SpanReader.raw_names`) from a span before export."""
    attributes = span.attributes
    _delete(attributes, [i for i, kv in enumerate(attributes) if kv.key in drop])