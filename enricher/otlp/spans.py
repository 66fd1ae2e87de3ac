"""OTLP spans <-> kvmiss: read request facts from span attributes, write verdicts back.

Reading is one pass over a span's attributes with a dict from attribute name to the fact it
feeds (built once from the configured `InputNames`); values of the wrong type are skipped
and reported, never raised. Writing upserts the output attributes (a replayed span never
gets a label twice) and strips raw prompt material before export.

Works on the protobuf messages of ``opentelemetry.proto`` directly (the receiver forwards
the request it received; converting to SDK spans would be lossy and slow). These are the
reference rules; `WireScanner`, `rewrite_request` and the C half of `encode_attributes` are
their compiled twin on the request's wire bytes (enricher/otlp/_otlpwire.c), which hands back to
them whatever it does not take. The same reader
also takes an SDK span's attribute mapping (`SpanReader.read_attributes`, for the in-process
exporter, enricher/service/inprocess.py): both unwrap values to Python and share one set of rules.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import msgspec
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from opentelemetry.proto.trace.v1.trace_pb2 import Span as _SpanType

from kvmiss.enricher.otlp.interfaces import WIRE
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
    route_candidates: list[str] | None = None
    predicted_cached_tokens: int | None = None
    instance: str | None = None
    block_hashes: Sequence[int] | None = None  # a list, or from the wire scanner an array('Q')
    token_ids: list[int] | None = None
    extra_keys: str | None = None
    extra_key_kinds: list[str] | None = None
    lookup_time: float | None = None  # seconds, engine wall clock
    queue_lookup_time: float | None = None  # span start + time in queue (vLLM), seconds
    # span start + time to first token - prefill time (vLLM), seconds: the latest the lookup
    # can have been when the time above is all there is (see `InputNames.time_to_first_token_s`)
    queue_lookup_latest: float | None = None
    transfer: TransferAttempt | None = None
    recomputed_tokens: int | None = None
    kv_cache_report_mode: str | None = None
    skip_reading_prefix_cache: bool | None = None
    earlier_lookup_times_unix_nano: list[int] | None = None
    earlier_lookup_cached_tokens: list[int] | None = None
    tenant_policy: str | None = None
    adapter: str | None = None
    model_revision: str | None = None
    template_version: str | None = None
    # Worker named by the span's resource (``kvmiss.worker``); a span attribute wins over it.
    resource_worker: str | None = None
    # For what-if sizing only (`kvmiss whatif`), never for a verdict: the tokens the request
    # generated, and when it finished -- the span's end (seconds), on a span that carries
    # other facts too, is neither an engine lookup nor a transfer span (those end early).
    output_tokens: int | None = None
    finish_time: float | None = None
    # The span is the kvmiss vLLM plugin's `PREFIX_LOOKUP_SPAN`: its request id is the
    # engine's, which may extend the API-level id (enricher/otlp/assembly.py joins them).
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


def _bool(value: Any) -> bool | None:
    if type(value) is bool:
        return value
    if type(value) is str and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return None


class _Ints(list):
    """An unwrapped OTLP array whose elements were all ``int_value``s (int64 by construction):
    `_int_list` need not look at them one by one."""


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
    "worker": _str, "dp_rank": _int, "route_policy": _str, "route_candidates": _str_list,
    "predicted_cached_tokens": _int,
    "instance": _str, "block_hashes": _hash_list, "token_ids": _int_list, "extra_keys": _str,
    "extra_key_kinds": _str_list, "lookup_time_unix_nano": _int, "time_in_queue_s": _float,
    "time_to_first_token_s": _float, "prefill_time_s": _float,
    "transfer_result": _transfer_result, "transfer_source": _str, "recomputed_tokens": _int,
    "kv_cache_report_mode": _str, "skip_reading_prefix_cache": _bool, "tenant_policy": _str, "adapter": _str,
    "model_revision": _str, "template_version": _str, "output_tokens": _int,
    "earlier_lookup_times_unix_nano": _int_list, "earlier_lookup_cached_tokens": _int_list,
}

# Facts that never make a span a fragment on their own: a span carrying only them (an LLM
# client's span with its token usage) passes through as if it carried none, as it did
# before they were read -- it is no request kvmiss could judge.
_RIDERS = frozenset({"output_tokens", "time_to_first_token_s", "prefill_time_s", "earlier_lookup_times_unix_nano",
                     "earlier_lookup_cached_tokens"})

_UNUSABLE = object()  # kvlist / bytes / empty values: no converter accepts it
_KEY = operator.attrgetter("key")


# Int arrays (block-hash chains, token ids) are decoded in C: the ``ArrayValue`` is serialized
# once and parsed back as a *shadow* message whose singular ``values`` field makes upb merge
# every element into one message, appending each element's ``int_value`` (field 3) to one
# repeated int field -- a list in one slice instead of a Python-level access per element.
# Elements of another kind (string, bool, empty...) leave no int behind, so the count tells
# whether every element was an int; otherwise the per-element rule (`_unwrap_items`) applies.
# The uint64 twin reads the two's-complement uint64 of each int64 directly (block hashes).
def _shadow_classes() -> tuple[type, type]:
    F = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="kvmiss/_shadow_int_arrays.proto",
                                              package="kvmiss.shadow", syntax="proto3")
    for suffix, kind in (("I64", F.TYPE_INT64), ("U64", F.TYPE_UINT64)):
        ints = file.message_type.add(name=f"Ints{suffix}")  # AnyValue: int_value = 3
        ints.field.add(name="int_value", number=3, type=kind, label=F.LABEL_REPEATED)
        array = file.message_type.add(name=f"Array{suffix}")  # ArrayValue: values = 1
        array.field.add(name="values", number=1, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL,
                        type_name=f".kvmiss.shadow.Ints{suffix}")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return tuple(message_factory.GetMessageClass(pool.FindMessageTypeByName(f"kvmiss.shadow.Array{s}"))
                 for s in ("I64", "U64"))  # type: ignore[return-value]


_ArrayI64, _ArrayU64 = _shadow_classes()


def _int_array(value: Any, shadow: type) -> list[int] | None:
    """The ``int_value`` of every element of ``value``'s array, decoded in C (int64 or uint64
    per ``shadow``); None unless ``value`` is a non-empty array of ints only."""
    array = value.array_value  # an empty default when value is not an array
    count = len(array.values)
    if not count:
        return None
    ints = shadow.FromString(array.SerializeToString()).values.int_value[:]
    return ints if len(ints) == count else None


def _unwrap(value: Any) -> Any:
    """An OTLP ``AnyValue`` as the Python value the SDK would hold for it."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        ints = _int_array(value, _ArrayI64)
        return _Ints(ints) if ints is not None else _unwrap_items(value.array_value.values)
    if kind in ("string_value", "int_value", "double_value", "bool_value"):
        return getattr(value, kind)
    return _UNUSABLE


def _unwrap_items(items: Any) -> list[Any]:
    """The per-element rule. A nested array is unwrapped the same way, never by `_int_array`
    (each level would serialize its whole subtree again; no converter takes a nested array)."""
    out = []
    for item in items:
        kind = item.WhichOneof("value")
        if kind == "array_value":
            out.append(_unwrap_items(item.array_value.values))
        elif kind in ("string_value", "int_value", "double_value", "bool_value"):
            out.append(getattr(item, kind))
        else:
            out.append(_UNUSABLE)
    return out


# How the OTLP reader takes each fact's value: the typed accessor the fact expects, tried
# first (a oneof member reads as its default unless set, so a non-default value proves the
# kind), else the generic `_unwrap` + converter. Same results as the generic rule alone.
_STR, _INT, _FLOAT, _HASHES, _INTS, _OTHER = range(6)
_ACCESS = {_str: _STR, _int: _INT, _float: _FLOAT, _hash_list: _HASHES, _int_list: _INTS}

# What a scanned attribute is besides (maybe) an input: raw prompt material to strip, or an
# output kvmiss writes (upserted). Spans are marked with the positions of both.
_MARK_RAW, _MARK_OUTPUT = 1, 2
OUTPUT_NAMES = frozenset(names.OUTPUTS)  # what kvmiss writes (SPANS.md): upserted, never duplicated
_MISSING = object()


class Marks(msgspec.Struct):
    """Where a scanned span's raw inputs and output-named attributes are: (position, name)
    pairs in attribute order, the span's attribute count then, and how many are raw."""

    at: list[tuple[int, str]]
    count: int
    raw: int

    def positions(self, drop: frozenset[str], verdict: bool = False) -> tuple[int, ...]:
        """The marked positions a write removes, ascending: raw inputs in ``drop`` and, when
        a verdict is written, every output name the span came with -- whatever the new
        verdict writes, the span leaves with kvmiss's outputs only (what `strip_marked` /
        `upsert_marked` delete)."""
        return tuple(i for i, key in self.at if key in drop or (verdict and key in OUTPUT_NAMES))

    def foreign_outputs(self) -> int:
        """How many output-named attributes the span came with (a verdict write replaces them)."""
        return sum(1 for _, key in self.at if key in OUTPUT_NAMES)


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
        # drop set -> `scanner` (built on first use; a benign race at worst builds twice)
        self._scanners: dict[frozenset[str], Callable[..., Any]] = {}

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
        found = self.scanner()(span, bad, resource_worker)
        return None if found is None else found[0]

    def scan(self, span: Any, bad: list[str] | None = None, *, resource_worker: str | None = None,
             drop: frozenset[str] = frozenset()) -> tuple[SpanFacts | None, Marks | None]:
        """`read`, and from the same single pass over the attributes the `Marks` of every
        attribute named in ``drop`` (`raw_names`) or an output name (SPANS.md), so that
        stripping and upserting need not scan the span again (`strip_marked`,
        `upsert_marked`); None when there is none."""
        found = self.scanner(drop)(span, bad, resource_worker)
        return (None, None) if found is None else (found[0], found[2])

    def scanner(self, drop: frozenset[str] = frozenset()) -> Callable[
            [Any, list[str] | None, str | None], tuple[SpanFacts | None, dict[str, Any] | None, Marks | None] | None]:
        """`scan` as a function of (span, bad, resource_worker), for a loop over many spans:
        None for a span with no attribute of interest (most spans, found without a Python
        loop over the attributes), else (facts, the facts' non-None fields as a dict --
        `SpanFacts` field -> value, ``engine_lookup`` left out --, marks)."""
        scan = self._scanners.get(drop)
        if scan is None:
            scan = self._scanners[drop] = self._make_scanner(drop)
        return scan

    def _scan_table(self, drop: frozenset[str]) -> dict[str, tuple[str | None, int, int, int]]:
        """Attribute name -> (fact or None, rank, how its value is taken, mark flags): every
        name a scan looks at, for both scanners (`scanner`, `wire_scanner`)."""
        table: dict[str, tuple[str | None, int, int, int]] = {}
        for attr in sorted(self._lookup.keys() | drop | OUTPUT_NAMES):
            fact, rank = self._lookup.get(attr, (None, 0))
            access = _ACCESS.get(_CONVERTERS[fact], _OTHER) if fact is not None else _OTHER
            mark = (_MARK_RAW if attr in drop else 0) | (_MARK_OUTPUT if attr in OUTPUT_NAMES else 0)
            table[attr] = (fact, rank, access, mark)
        return table

    def wire_scanner(self, drop: frozenset[str] = frozenset()) -> WireScanner | None:
        """`scanner` for a whole request's protobuf bytes, compiled (enricher/otlp/_otlpwire.c);
        None when the extension was not built (or KVMISS_PURE_PYTHON_OTLP=1)."""
        if _Scanner is None:
            return None
        return WireScanner(self._scan_table(drop))

    def _make_scanner(self, drop: frozenset[str]) -> Callable[..., Any]:
        table = self._scan_table(drop)
        wanted = frozenset(table)
        get = table.get
        build = _build
        riders = _RIDERS

        def scan(span: Any, bad: list[str] | None, resource_worker: str | None) -> Any:
            # A slice, not iteration: the container has no iterator of its own, and the
            # sequence protocol's fallback ends every span on a formatted IndexError.
            attributes = span.attributes[:]
            keys = list(map(_KEY, attributes))  # a C loop: most spans end at the next line
            if wanted.isdisjoint(keys):
                return None
            values: dict[str, Any] = {}
            ranks: dict[str, int] | None = None  # only ranks > 0: a fact's first name is rank 0
            marks: list[tuple[int, str]] | None = None
            raw = 0
            for i, key in enumerate(keys):
                entry = get(key)
                if entry is None:
                    continue
                fact, rank, access, mark = entry
                if mark:
                    if marks is None:
                        marks = [(i, key)]
                    else:
                        marks.append((i, key))
                    if mark & _MARK_RAW:
                        raw += 1
                    if fact is None:
                        continue
                if fact in values and (ranks.get(fact, 0) if ranks else 0) <= rank:
                    continue
                value = attributes[i].value
                if access == _STR:
                    converted = value.string_value or _str(_unwrap(value))
                elif access == _INT:
                    converted = value.int_value or _int(_unwrap(value))
                elif access == _HASHES:
                    converted = _int_array(value, _ArrayU64)
                    if converted is None:
                        converted = _hash_list(_unwrap(value))
                elif access == _FLOAT:
                    converted = value.double_value or _float(_unwrap(value))
                elif access == _INTS:
                    converted = _int_array(value, _ArrayI64)
                    if converted is None:
                        converted = _int_list(_unwrap(value))
                else:
                    converted = _CONVERTERS[fact](_unwrap(value))  # type: ignore[index]
                if converted is None:
                    if bad is not None:
                        bad.append(key)
                    continue
                values[fact] = converted  # type: ignore[index]
                if rank:
                    if ranks is None:
                        ranks = {}
                    ranks[fact] = rank  # type: ignore[index]
                elif ranks:
                    ranks.pop(fact, None)  # type: ignore[arg-type]
            found = None if marks is None else Marks(marks, len(keys), raw)
            if not values or riders.issuperset(values):
                return None if found is None else (None, None, found)
            start = span.start_time_unix_nano if "time_in_queue_s" in values else 0
            return (*build(values, start, span.name == names.PREFIX_LOOKUP_SPAN, resource_worker,
                           span.end_time_unix_nano), found)

        return scan

    def read_attributes(self, attributes: Mapping[str, Any], start_time_unix_nano: int | None,
                        bad: list[str] | None = None, *, name: str = "",
                        resource_worker: str | None = None,
                        end_time_unix_nano: int | None = None) -> SpanFacts | None:
        """`read` for an SDK ``ReadableSpan``: its attributes, start time (ns; used with
        vLLM's time in queue), name and end time (ns; the request's finish, for what-if)."""
        lookup = self._lookup
        hits = [(key, value) for key, value in attributes.items() if key in lookup]
        if not hits:
            return None
        return self._facts(hits, start_time_unix_nano or 0, bad, name, resource_worker, end_time_unix_nano or 0)

    def _facts(self, hits: list[tuple[str, Any]], start_time_unix_nano: int, bad: list[str] | None,
               span_name: str, resource_worker: str | None, end_time_unix_nano: int = 0) -> SpanFacts | None:
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
        if not values or _RIDERS.issuperset(values):
            return None
        facts = SpanFacts(resource_worker=resource_worker, engine_lookup=span_name == names.PREFIX_LOOKUP_SPAN)
        if end_time_unix_nano and not facts.engine_lookup and "transfer_result" not in values:
            facts.finish_time = end_time_unix_nano / 1e9
        for fact, (_, value) in values.items():
            if fact == "lookup_time_unix_nano":
                facts.lookup_time = value / 1e9
            elif fact == "time_in_queue_s":
                facts.queue_lookup_time = start_time_unix_nano / 1e9 + value
                facts.queue_lookup_latest = _latest_lookup(start_time_unix_nano, value,
                                                           values.get("time_to_first_token_s", (0, None))[1],
                                                           values.get("prefill_time_s", (0, None))[1])
            elif fact in ("time_to_first_token_s", "prefill_time_s"):
                pass
            elif fact == "transfer_result":
                source = values.get("transfer_source", (0, None))[1]
                facts.transfer = TransferAttempt(value, source)
            elif fact != "transfer_source":
                setattr(facts, fact, value)
        return facts


# --- the compiled twin of `SpanReader.scanner`: a whole request's wire bytes in one C call ---------

_Scanner = None if WIRE is None else WIRE.Scanner
_rewrite = None if WIRE is None else WIRE.rewrite
_encode_c = None if WIRE is None else WIRE.encode_attributes

WIRE_SCAN = _Scanner is not None  # whether enricher/otlp/_otlpwire.c was built and is used
_FACTS = tuple(_CONVERTERS)  # the C scanner's fact indexes -> names (its values dicts' keys)
_FACT_INDEX = {fact: i for i, fact in enumerate(_FACTS)}

# One span the wire scanner found an attribute of interest on: (resource, scope and span
# index in the request, trace id, values by fact name -- None when the span's values need the
# reference rules --, marks as (position, name) or None, attribute count, raw-mark count,
# start_time_unix_nano, end_time_unix_nano, whether it is an engine lookup span).
WireHit = tuple[int, int, int, bytes, "dict[str, Any] | None", "list[tuple[int, str]] | None", int, int, int, int,
                bool]


class WireScanner:
    """`SpanReader.scanner`'s reading of every span of an ``ExportTraceServiceRequest`` at
    once, from the protobuf bytes the request was parsed from (enricher/otlp/_otlpwire.c). The
    same table, ranks and value rules: values of the types a fact takes directly are
    converted in C; a span with any other value is handed back for the reference scanner
    (its values None). `scan` answers None for encodings it does not model (repeated
    singular sub-messages, a second oneof member, unexpected wire types), and the caller
    reads the parsed message instead."""

    __slots__ = ("scan",)

    def __init__(self, table: dict[str, tuple[str | None, int, int, int]]):
        assert _Scanner is not None
        entries = tuple((-1 if fact is None else _FACT_INDEX[fact], rank, access, mark)
                        for fact, rank, access, mark in table.values())
        self.scan: Callable[[bytes], list[WireHit] | None] = _Scanner(
            tuple(table), entries, _FACTS, names.PREFIX_LOOKUP_SPAN.encode()).scan

    @staticmethod
    def found(hit: WireHit, resource_worker: str | None) -> tuple[SpanFacts | None, dict[str, Any] | None, Marks | None]:
        """What `SpanReader.scanner` returns for the hit's span (the hit's values not None)."""
        values, marks = hit[4], hit[5]
        found = None if marks is None else Marks(marks, hit[6], hit[7])
        if not values or _RIDERS.issuperset(values):
            return None, None, found
        return (*_build(values, hit[8], hit[10], resource_worker, hit[9]), found)  # type: ignore[arg-type]


def rewrite_request(body: bytes, edits: list[tuple[int, int, int, tuple[int, ...], bytes]]) -> bytes:
    """``body`` (an encoded request `WireScanner.scan` read) with ``edits`` applied, in C: per
    span, at (resource, scope, span index) in wire order, the attribute positions to delete
    (ascending: the marks of raw inputs and replaced outputs) and `encode_attributes` bytes
    to append. Only the messages holding an edited span are re-encoded, the rest is copied.
    The same request `strip_marked` / `upsert_marked` would make of the parsed message.
    Raises ValueError for an edit that does not fit the body."""
    assert _rewrite is not None, "only with the compiled wire scanner"
    return _rewrite(body, edits)


def _latest_lookup(start_time_unix_nano: int, queue_s: float, first_token_s: float | None,
                   prefill_s: float | None) -> float | None:
    """vLLM's `llm_request`: the latest its engine lookup can have been, span start + time to
    first token - prefill time (seconds), or None without both or when they contradict the
    earliest, start + time in queue (the bound is then not one)."""
    if first_token_s is None or prefill_s is None or prefill_s < 0:
        return None
    latest = first_token_s - prefill_s
    if latest < queue_s:
        return None
    return start_time_unix_nano / 1e9 + latest


def _build(values: dict[str, Any], start_time_unix_nano: int, engine_lookup: bool,
           resource_worker: str | None, end_time_unix_nano: int) -> tuple[SpanFacts, dict[str, Any]]:
    """`SpanFacts` from converted values by fact name (`_CONVERTERS`' keys) of an OTLP span
    (its start time, needed with a time in queue only, whether it is an engine lookup span,
    and its end time), and its non-None fields (``values``, renamed in place)."""
    if end_time_unix_nano and not engine_lookup and "transfer_result" not in values:
        values["finish_time"] = end_time_unix_nano / 1e9  # (a transfer or lookup span ends early)
    if "lookup_time_unix_nano" in values:
        values["lookup_time"] = values.pop("lookup_time_unix_nano") / 1e9
    first_token, prefill = values.pop("time_to_first_token_s", None), values.pop("prefill_time_s", None)
    if "time_in_queue_s" in values:
        queue = values.pop("time_in_queue_s")
        values["queue_lookup_time"] = start_time_unix_nano / 1e9 + queue
        latest = _latest_lookup(start_time_unix_nano, queue, first_token, prefill)
        if latest is not None:
            values["queue_lookup_latest"] = latest
    if "transfer_source" in values or "transfer_result" in values:
        source = values.pop("transfer_source", None)
        result = values.pop("transfer_result", _MISSING)
        if result is not _MISSING:
            values["transfer"] = TransferAttempt(result, source)
    if resource_worker is not None:
        values["resource_worker"] = resource_worker
    return SpanFacts(**values, engine_lookup=engine_lookup), values


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
    # ``_value_`` is what an enum member's ``value`` property returns, without the property.
    out: dict[str, Any] = {
        names.LABEL: verdict.label._value_,
        names.OWNER: verdict.owner._value_,
        names.REASON: verdict.reason,
    }
    if verdict.history is not None:
        out[names.HISTORY] = verdict.history._value_
    if verdict.first_miss_block is not None:
        out[names.FIRST_MISS_BLOCK] = verdict.first_miss_block
        out[names.MISSED_TOKENS] = verdict.missed_tokens
        out[names.HOLDERS] = verdict.holders
    if verdict.first_miss_digest is not None:
        out[names.FIRST_MISS_DIGEST] = verdict.first_miss_digest
    if verdict.eviction_age_ms is not None:
        out[names.EVICTION_AGE_MS] = verdict.eviction_age_ms
    if verdict.epoch is not None:
        out[names.EPOCH] = verdict.epoch
    if verdict.stored_seq is not None:
        out[names.STORED_SEQ] = verdict.stored_seq
    if verdict.removed_seq is not None:
        out[names.REMOVED_SEQ] = verdict.removed_seq
    if verdict.gap_from_seq is not None:
        out[names.GAP_FROM_SEQ] = verdict.gap_from_seq
    if verdict.gap_to_seq is not None:
        out[names.GAP_TO_SEQ] = verdict.gap_to_seq
    if verdict.window_start:
        out[names.WINDOW_START] = verdict.window_start._value_
    if verdict.extra_key_kinds:
        out[names.EXTRA_KEY_KINDS] = list(verdict.extra_key_kinds)
    if verdict.window_start_ts is not None and lookup_time is not None:
        out[names.WINDOW_SECONDS] = round(lookup_time - verdict.window_start_ts, 3)
    if verdict.kv_cache_group is not None:
        out[names.KV_CACHE_GROUP] = verdict.kv_cache_group
    if verdict.divergence is not None:
        out[names.DIVERGENCE_KIND] = verdict.divergence.kind._value_
        if verdict.divergence.first_token_index is not None:
            out[names.DIVERGENCE_TOKEN] = verdict.divergence.first_token_index
    return out


def upsert_attributes(span: Any, values: dict[str, Any], *, drop: Iterable[str] = ()) -> None:
    """Set ``values`` on ``span`` replacing any attribute of the same key, and remove the
    keys in ``drop``. Keys stay unique (OTLP requires it). Writing any output name (a
    verdict) removes every output name the span had: no stale output stays beside it."""
    remove = set(values) | set(drop)
    if not OUTPUT_NAMES.isdisjoint(values):
        remove |= OUTPUT_NAMES
    attributes = span.attributes
    delete_attributes(attributes, [i for i, kv in enumerate(attributes) if kv.key in remove])
    _append(span, values)


def delete_attributes(attributes: Any, indexes: Sequence[int]) -> None:
    """Delete the attributes at ``indexes`` (ascending) in place, from the end so earlier
    indexes stay valid: ~2x cheaper than copying the kept attributes into a new list."""
    for i in reversed(indexes):
        del attributes[i]


def strip_raw_inputs(span: Any, drop: frozenset[str]) -> None:
    """Remove the attributes in ``drop`` (`SpanReader.raw_names`) from a span before export."""
    attributes = span.attributes
    delete_attributes(attributes, [i for i, kv in enumerate(attributes) if kv.key in drop])


# --- the same, for a span `SpanReader.scan` has marked -------------------------------------------


def _strip(span: Any, marks: Marks, drop: frozenset[str]) -> bool:
    """Delete the marked attributes named in ``drop``, if the span is still as scanned
    (attribute count and every such name at its position); False (having deleted only
    verified ones) if it is not."""
    attributes = span.attributes
    if len(attributes) != marks.count:
        return False
    for i, key in reversed(marks.at):  # from the end: earlier positions stay valid
        if key in drop:
            if attributes[i].key != key:
                return False
            del attributes[i]
    return True


def strip_marked(span: Any, marks: Marks, drop: frozenset[str]) -> None:
    """`strip_raw_inputs` for a span scanned with ``drop`` and not changed since: deletes the
    marked positions without looking at the other attributes. Should the span have changed
    after all (count or a marked name differs), scans it like `strip_raw_inputs`."""
    if not _strip(span, marks, drop):
        strip_raw_inputs(span, drop)  # only what is left of them: deleted ones were in drop


def upsert_marked(span: Any, values: dict[str, Any], marks: Marks | None, drop: frozenset[str]) -> None:
    """`upsert_attributes(span, values, drop=drop)` for a span scanned with ``drop`` and not
    changed since (``marks`` as `SpanReader.scan` returned them): only the marked positions
    are looked at. Falls back to the scanning version if the span changed after all, or
    for a key that is not an output name (only those are marked)."""
    if not OUTPUT_NAMES.issuperset(values):
        upsert_attributes(span, values, drop=drop)
        return
    if marks is not None:
        attributes = span.attributes
        if len(attributes) != marks.count:
            upsert_attributes(span, values, drop=drop)
            return
        verdict = bool(values)
        for i, key in reversed(marks.at):  # raw inputs in drop, and with a verdict every output name
            if key in drop or (verdict and key in OUTPUT_NAMES):
                if attributes[i].key != key:
                    upsert_attributes(span, values, drop=drop)  # what is left to delete
                    return
                del attributes[i]
    _append(span, values)


# Writing: the new attributes are encoded as the wire bytes of Span.attributes entries (field
# 9) and appended with one `MergeFromString` -- a repeated field's entries are appended on
# merge -- instead of a KeyValue + AnyValue message built through upb per attribute. The bytes
# are what `_set` would have built; any value it would treat differently (out of int64 range,
# not encodable as UTF-8...) falls back to `_set`, which raises what it raised before.
_SPAN_ATTRIBUTES_TAG = b"\x4a"  # Span.attributes: field 9, length-delimited
_VARINTS = tuple(bytes((n,)) if n < 0x80 else bytes((n & 0x7F | 0x80, n >> 7)) for n in range(1 << 14))
_INT64_MIN, _INT64_END = -(1 << 63), 1 << 63
_TRUE, _FALSE = b"\x10\x01", b"\x10\x00"  # AnyValue.bool_value (field 2)
_DOUBLE = struct.Struct("<d").pack  # AnyValue.double_value (field 4), fixed64
_key_fields: dict[str, bytes] = {}  # key -> KeyValue.key field bytes (names are few and fixed)
_entries: dict[str, dict[str | int, bytes]] = {}  # key -> value -> Span.attributes entry bytes
_CACHE_MAX, _CACHE_PER_KEY = 1024, 512


def _varint(n: int) -> bytes:
    """Protobuf varint of 0 <= n < 2**64."""
    if n < 0x4000:
        return _VARINTS[n]
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _string(text: str) -> bytes:
    """An AnyValue.string_value (field 1) or ArrayValue element payload."""
    data = text.encode()
    return b"\x0a" + _varint(len(data)) + data


class NotEncodable(Exception):
    pass


def _any_value(value: Any) -> bytes | None:
    """The AnyValue bytes `_set` would build for ``value``; None for no value at all (an
    empty list: `_set` adds no element, so the KeyValue is left without a value)."""
    if type(value) is str:
        return _string(value)
    if isinstance(value, bool):
        return _TRUE if value else _FALSE
    if isinstance(value, int):
        if not _INT64_MIN <= value < _INT64_END:
            raise NotEncodable
        return b"\x18" + _varint(value & MASK64)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE(value)
    if isinstance(value, (list, tuple)):
        if not value:
            return None
        items = b"".join([b"\x0a" + _varint(len(item)) + item for item in map(_string, map(str, value))])
        return b"\x2a" + _varint(len(items)) + items
    return _string(str(value))


def encode_attributes(values: dict[str, Any]) -> bytes:
    """``values`` as Span.attributes wire bytes (raises `NotEncodable` or an encoding error
    where `_set` would not build the same message). In C when every key is a str and every
    value a str, int (in int64), bool or float (enricher/otlp/_otlpwire.c); otherwise here, where
    whole entries of str and int values are cached per key (a bounded dict each): labels,
    owners, reasons, small counts repeat."""
    if _encode_c is not None:
        data = _encode_c(values)
        if data is not None:
            return data
    parts = []
    varints = _VARINTS
    for key, value in values.items():
        kind = type(value)
        cache = None
        if kind is str or kind is int:  # exact types only: True == 1 == 1.0 as dict keys
            cache = _entries.get(key)
            if cache is not None:
                entry = cache.get(value)
                if entry is not None:
                    parts.append(entry)
                    continue
            if kind is str:
                data = value.encode()
                size = len(data)
                any_value = b"\x0a" + (varints[size] if size < 0x4000 else _varint(size)) + data
            else:
                if not _INT64_MIN <= value < _INT64_END:
                    raise NotEncodable
                any_value = b"\x18" + _varint(value & MASK64)
        else:
            any_value = _any_value(value)
        field = _key_fields.get(key)
        if field is None:
            field = _key_field(key)
        if any_value is not None:
            size = len(any_value)
            field += b"\x12" + (varints[size] if size < 0x4000 else _varint(size)) + any_value
        size = len(field)
        entry = _SPAN_ATTRIBUTES_TAG + (varints[size] if size < 0x4000 else _varint(size)) + field
        if kind is str or kind is int:
            if cache is None:
                if len(_entries) >= _CACHE_MAX:
                    _entries.clear()
                cache = _entries[key] = {}
            elif len(cache) >= _CACHE_PER_KEY:  # a key of unique values (digests): start over
                cache.clear()
            cache[value] = entry
        parts.append(entry)
    return b"".join(parts)


def _key_field(key: str) -> bytes:
    """The KeyValue.key field bytes of ``key`` (cached)."""
    if type(key) is not str:
        raise NotEncodable
    data = key.encode()
    field = b"\x0a" + _varint(len(data)) + data
    if len(_key_fields) >= _CACHE_MAX:
        _key_fields.clear()
    _key_fields[key] = field
    return field


def _append(span: Any, values: dict[str, Any]) -> None:
    """Append ``values`` as attributes (the caller removed same-named ones)."""
    if type(span) is _SpanType:
        try:
            data = encode_attributes(values)
        except (NotEncodable, UnicodeError):
            pass
        else:
            span.MergeFromString(data)
            return
    attributes = span.attributes
    for key, value in values.items():
        kv = attributes.add()
        kv.key = key
        _set(kv, value)

