"""Assembling one request's facts from the spans that carry them.

Spans of one request arrive in different export batches and at different times (the
router span usually ends after the engine span; vLLM exports ``llm_request`` when the
request finishes). Fragments are grouped by trace id and request id; fragments without a
request id (a transfer span, a router that does not set one) join the trace's only named
request, or stand alone when the trace has none or several.

The kvmiss vLLM plugin's lookup spans (``kvmiss.prefix_lookup``, SpanFacts.engine_lookup)
carry the *engine's* request id, which vLLM derives from the API id on ``llm_request`` and
router spans by appending ``-<8 chars>`` (older versions: equal). A lookup joins the open
request of its trace whose id it equals or extends at a ``-``; failing that, the trace's only
request when the trace holds one request and one lookup. Until a request span comes, a lookup
waits (bounded by the pipeline); then it is judged alone -- its facts are complete. Router
facts (route decision, cached tokens, transfers) win over the lookup's; the engine's own
lookup time, block chain and block size win over anyone's.

Pure: no clock, no I/O. The pipeline decides when to stop waiting.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from kvmiss.enricher.core.hashing import BlockHasher, HashingError, external_hash, extras_from_spec
from kvmiss.enricher.core.verdict import needs_index
from kvmiss.enricher.otlp.spans import SpanFacts
from kvmiss.schemas.attribution import Label, RequestFacts, Verdict
from kvmiss.schemas.labels import LABELS
from kvmiss.schemas.prompt import ExtraKeysSpec

_extra_keys_decoder = msgspec.json.Decoder(ExtraKeysSpec)


class Fragment(msgspec.Struct):
    """One span's facts, and where to write the verdict if this span is chosen."""

    facts: SpanFacts
    span: Any  # the protobuf Span (owned by a pending export batch), or None: see ``at``
    batch: Any  # the pending batch holding it
    instance: str | None = None
    # Where the span's raw inputs and output-named attributes are (`spans.Marks`, from the
    # pipeline's one scan), or `WRITTEN` once the verdict is written (raw inputs stripped).
    marks: Any = None
    # ``facts``' non-None fields but ``engine_lookup`` (`SpanReader.scanner` gives them;
    # derived from ``facts`` when not given). Read-only.
    fields: dict[str, Any] | None = None
    # (resource, scope, span index) in the batch's request: where the span is when the
    # pipeline writes the batch's bytes and holds no parsed span (``span`` None).
    at: tuple[int, int, int] | None = None

    def set_fields(self) -> dict[str, Any]:
        fields = self.fields
        if fields is None:
            fields = self.fields = {k: v for k, v in zip(_FIELDS, msgspec.structs.astuple(self.facts))
                                    if v is not None and k != "engine_lookup"}
        return fields


WRITTEN = "written"  # Fragment.marks once the pipeline wrote the span (see Pipeline._write)


class Assembly(msgspec.Struct):
    """Every fragment seen so far for one (trace, request)."""

    trace_id: bytes
    request_id: str | None
    first_seen: float
    fragments: list[Fragment] = msgspec.field(default_factory=list)
    done: bool = False  # closed to new fragments of other requests: joined, judged, or waiting
    # Its facts are complete and it waits for the fleet's history: a later span of the same
    # request still joins it (and leaves with it), never starts a second judgement.
    awaiting_history: bool = False

    def merged(self) -> SpanFacts:
        """Field by field, the first fragment that has a value wins -- except that an engine
        lookup span's measured facts (`ENGINE_FACTS`) beat everyone's, and vLLM's
        ``llm_request`` gives the what-if facts (`FINISH_FACTS`); an explicit lookup time
        beats one derived from queue time. (Never the transfer, which `transfers` collects,
        nor ``engine_lookup``.)"""
        return SpanFacts(**self.merged_fields())

    def merged_fields(self) -> dict[str, Any]:
        """`merged` as a dict of its non-None fields (a new dict)."""
        fragments = self.fragments
        if len(fragments) == 1:  # its own values win every rule
            fragment = fragments[0]
            found = dict(fragment.set_fields())
            found.pop("transfer", None)
            if "instance" not in found and fragment.instance:
                found["instance"] = fragment.instance
            return found
        engine = None
        for fragment in fragments:
            if fragment.facts.engine_lookup:
                engine = fragment
                break
        found = {}
        for fragment in reversed(fragments if engine is None else self._request_spans_first()):
            found.update(fragment.set_fields())  # the first fragment's values update last
        found.pop("transfer", None)
        if engine is not None:
            fields = engine.set_fields()
            for field in ENGINE_FACTS:
                if field in fields:
                    found[field] = fields[field]
        for fragment in fragments:
            fields = fragment.set_fields()
            if "queue_lookup_time" in fields and not fragment.facts.engine_lookup:  # vLLM's llm_request
                for field in FINISH_FACTS:
                    if field in fields:
                        found[field] = fields[field]
                break
        # The engine's chain stops at its own first miss; a router's cached count may reach
        # further (tokens loaded from elsewhere): then the longer chain is the usable one.
        longest = found.get("block_hashes")
        for fragment in fragments:
            chain = fragment.facts.block_hashes
            if chain is not None and len(chain) > len(longest or ()):
                found["block_hashes"] = longest = chain
        if "instance" not in found:
            for fragment in fragments:
                if fragment.instance:
                    found["instance"] = fragment.instance
                    break
        return found

    def _request_spans_first(self) -> list[Fragment]:
        fragments = self.fragments
        for fragment in fragments:
            if fragment.facts.engine_lookup:
                return sorted(fragments, key=lambda f: f.facts.engine_lookup)  # stable
        return fragments

    def awaits_request_span(self) -> bool:
        """Only engine lookup spans so far (plus maybe spans without a request id): the
        request's own span (``llm_request``, a router's) has not come yet."""
        lookup = False
        for fragment in self.fragments:
            if fragment.facts.engine_lookup:
                lookup = True
            elif fragment.facts.request_id is not None:
                return False
        return lookup

    def request_ids(self) -> set[str]:
        ids = set()
        for fragment in self.fragments:
            request_id = fragment.facts.request_id
            if request_id is not None:
                ids.add(request_id)
        if self.request_id is not None:
            ids.add(self.request_id)
        return ids

    def transfers(self) -> tuple:
        found = []
        for fragment in self.fragments:
            transfer = fragment.facts.transfer
            if transfer is not None:
                found.append(transfer)
        return tuple(found)

    def outcome_fragment(self) -> Fragment:
        """The span that carries the request's cache outcome gets the verdict: the one with
        cached tokens, else the one with prompt tokens, else the first (a request's own
        spans before engine lookup spans)."""
        ordered = self._request_spans_first()
        for fragment in ordered:
            if fragment.facts.cached_tokens is not None:
                return fragment
        for fragment in ordered:
            if fragment.facts.prompt_tokens is not None:
                return fragment
        return self.fragments[0]


_FIELDS = SpanFacts.__struct_fields__

# Measured by the engine at the lookup itself: an engine lookup span's value wins.
ENGINE_FACTS = ("lookup_time", "block_hashes", "block_size", "resource_worker")
# For what-if sizing, and to bound when a request's prompt was stored: vLLM's `llm_request` -- the span carrying
# its time in queue -- gives them over a router's span. Its end is when the engine finished
# the request, on the engine host's clock, which stamps the KV events and the lookup time
# derived from that span; a router's span ends later (the response still streams to the
# client), on the router's clock. Its completion tokens are the engine's own count.
FINISH_FACTS = ("finish_time", "output_tokens")


def ids_related(engine_id: str, request_id: str) -> bool:
    """The engine id is the API id, or extends it at a ``-`` (vLLM's random suffix)."""
    return engine_id == request_id or engine_id.startswith(request_id + "-")


def join_target(assembly: Assembly, trace: dict[str | None, Assembly]) -> Assembly | None:
    """The open assembly of the same trace that ``assembly``'s fragments belong to, if any.

    A fragment set without a request id joins the trace's only open request (or, while the
    trace has none, its only waiting engine lookup); an engine lookup with no request span
    joins the request whose id its engine id equals or extends, else the trace's only request
    when the trace holds one request and this one lookup."""
    if assembly.request_id is not None and not assembly.awaits_request_span():
        return None  # a request's own spans: they are the target
    others = [a for key, a in trace.items() if key is not None and not a.done and a is not assembly]
    requests = [a for a in others if not a.awaits_request_span()]
    if assembly.request_id is None:
        if len(requests) == 1:
            return requests[0]
        lookups = [a for a in others if a.awaits_request_span()]
        return lookups[0] if not requests and len(lookups) == 1 else None
    related = [a for a in requests if any(ids_related(assembly.request_id, i) for i in a.request_ids())]
    if related:
        return max(related, key=lambda a: len(a.request_id or ""))
    if len(requests) == 1 and len(requests) == len(others):
        return requests[0]  # one request, one lookup: the trace join
    return None


class Judged(msgspec.Struct, array_like=True, gc=False):
    """One judged request, remembered so later spans of it are not judged again: its ids,
    the span that carries its verdict and that verdict's attributes (as items: a re-sent
    copy of the span gets them again)."""

    request_ids: tuple[str, ...]
    span_id: bytes
    verdict: tuple[tuple[str, Any], ...]


class JudgedRequests:
    """Requests judged recently, by trace: for ``keep_s`` after judging (and at most
    ``max_traces`` traces, the oldest forgotten first and counted in ``forgotten_early``;
    per trace the newest ``max_per_trace`` requests, older ones counted in
    ``forgotten_in_trace``: a trace whose spans keep coming -- a long agent session, or a
    sender that puts every span in one trace -- is touched for ever and must not grow).

    A span that arrives after its request was judged is never judged again (ATTRIBUTION:
    one verdict per request): a copy of the span that carries the verdict (the same span id:
    a re-send) gets the same verdict; any other span of the request -- the same request id,
    or an id one extends at a ``-`` (a router and vLLM's ``llm_request`` share vLLM's id, the
    plugin's lookup span extends it) -- passes through without one. Two requests of one
    trace with unrelated ids stay two requests.

    Pure: the pipeline passes the time in."""

    def __init__(self, keep_s: float = 60.0, max_traces: int = 262_144, max_per_trace: int = 64):
        self.keep_s = keep_s
        self.max_traces = max_traces
        self.max_per_trace = max_per_trace
        self.forgotten_early = 0  # traces dropped by the count bound before keep_s
        self.forgotten_in_trace = 0  # requests dropped by the per-trace bound
        # trace id -> (judged at, its judged requests), oldest judging first.
        self._by_trace: collections.OrderedDict[bytes, tuple[float, tuple[Judged, ...]]] = collections.OrderedDict()

    def add(self, assembly: Assembly, span_id: bytes, verdict: dict[str, Any], now: float) -> None:
        ids = assembly.request_ids()
        if not ids:
            return
        judged = Judged(tuple(sorted(ids)), span_id, tuple(verdict.items()))
        trace_id = assembly.trace_id
        known = self._by_trace.pop(trace_id, None)
        requests: tuple[Judged, ...] = (judged,)
        if known is not None:
            older = known[1]
            if len(older) >= self.max_per_trace:
                self.forgotten_in_trace += len(older) - self.max_per_trace + 1
                older = older[len(older) - self.max_per_trace + 1:]
            requests = older + requests
        self._by_trace[trace_id] = (now, requests)
        if len(self._by_trace) > self.max_traces:
            self._by_trace.popitem(last=False)
            self.forgotten_early += 1

    def expire(self, now: float) -> None:
        by_trace, horizon = self._by_trace, now - self.keep_s
        while by_trace:
            trace_id, (at, _) = next(iter(by_trace.items()))
            if at >= horizon:
                break
            del by_trace[trace_id]

    def touch(self, trace_id: bytes, now: float) -> None:
        """The trace's spans still come: keep its judged requests ``keep_s`` from now."""
        known = self._by_trace.pop(trace_id, None)
        if known is not None:
            self._by_trace[trace_id] = (now, known[1])

    def judged_request(self, assembly: Assembly) -> Judged | None:
        """The judged request of the same trace that ``assembly``'s spans belong to."""
        known = self._by_trace.get(assembly.trace_id)
        if known is None:
            return None
        mine = assembly.request_ids()
        for judged in known[1]:
            for a in mine:
                for b in judged.request_ids:
                    if ids_related(a, b) or ids_related(b, a):
                        return judged
        return None

    def __len__(self) -> int:
        return len(self._by_trace)


class MissingFacts(msgspec.Struct, frozen=True):
    """Why an assembly cannot be judged yet (or ever): the names of the missing facts."""

    missing: tuple[str, ...]


def incomplete_verdict(missing: MissingFacts) -> Verdict:
    """The honest unknown for a request whose facts never completed (names only)."""
    return Verdict(label=Label.UNKNOWN_HISTORY, owner=LABELS[Label.UNKNOWN_HISTORY].owner,
                   reason=f"request facts incomplete: no {', '.join(missing.missing)} on its spans")


def to_request_facts(assembly: Assembly, *, hasher: BlockHasher | None, default_block_size: int,
                     errors: list[str], lookup_wanted: bool = False,
                     unhashable: Callable[[str | None], str | None] | None = None) -> RequestFacts | MissingFacts:
    """The `RequestFacts` of an assembly, or what is still missing. Problems that make a
    fact unusable (bad extra-key JSON, unhashable tokens) are appended to ``errors`` by
    name only: they may concern prompt material. ``lookup_wanted``: a hit in full report
    mode waits for a lookup time too (its label needs none, but only the time tells which
    store was its re-announcement); once the wait is over it is judged without.
    ``unhashable(worker)``: why that worker's engine's chain cannot be hashed from token ids
    (None: it can); such token ids are never hashed, and the reason goes into the facts."""
    m = assembly.merged_fields()
    prompt_tokens, cached_tokens = m.get("prompt_tokens"), m.get("cached_tokens")
    if prompt_tokens is None or cached_tokens is None:
        return MissingFacts(tuple(name for name, value in (
            ("prompt_tokens", prompt_tokens), ("cached_tokens", cached_tokens)) if value is None))
    block_size = m.get("block_size") or default_block_size
    kinds = tuple(m.get("extra_key_kinds") or ())
    chain = m.get("block_hashes")
    token_ids = m.get("token_ids")
    spec = _extra_keys(m.get("extra_keys"), errors)
    if spec is not None:
        kinds = kinds or spec.kinds()
    worker = m.get("worker") or m.get("resource_worker")
    chain_unavailable = None
    if chain is None and token_ids is not None and unhashable is not None:
        chain_unavailable = unhashable(worker)  # a chain hashed the wrong way would mislabel
    if chain is None and token_ids is not None and hasher is not None and chain_unavailable is None \
            and "kvmiss.extra_keys" not in errors:
        chain = _hash_tokens(token_ids, spec, hasher, errors)
    lookup_time = m.get("lookup_time")
    transfers = assembly.transfers()
    lookup_time_latest = None
    if lookup_time is None:
        lookup_time = m.get("queue_lookup_time")
        lookup_time_latest = m.get("queue_lookup_latest") if lookup_time is not None else None
        if lookup_time is None and (needs_index(prompt_tokens, cached_tokens, block_size, transfers) or (
                lookup_wanted and m.get("kv_cache_report_mode") == "full" and cached_tokens >= block_size > 0)):
            # A miss is judged against the index at its lookup time, and only a span can say
            # when that was (a router's own, or vLLM's `llm_request`, which may come seconds
            # later): wait for it, never judge from a guessed time. A label the request's own
            # spans prove (a failed transfer) needs neither.
            return MissingFacts(("lookup_time",))
    return RequestFacts(
        request_id=assembly.request_id or m.get("request_id"),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        block_size=block_size,
        worker=worker,
        dp_rank=m.get("dp_rank"),
        lookup_time=lookup_time,
        lookup_time_latest=lookup_time_latest,
        block_hashes=chain,
        chain_unavailable=chain_unavailable,
        extra_key_kinds=kinds,
        transfers=transfers,
        instance_hint=m.get("instance"),
        route_policy=m.get("route_policy"),
        route_candidates=_candidates(m.get("route_candidates")),
        kv_cache_report_mode=m.get("kv_cache_report_mode"),
        skip_reading_prefix_cache=m.get("skip_reading_prefix_cache"),
        earlier_lookups=_earlier_lookups(m.get("earlier_lookup_times_unix_nano"),
                                         m.get("earlier_lookup_cached_tokens"), errors),
        predicted_cached_tokens=m.get("predicted_cached_tokens"),
        token_ids=token_ids,
        extra_keys=spec,
        finish_time=m.get("finish_time"),
        output_tokens=m.get("output_tokens"),
    )


def _candidates(names: Sequence[str] | None) -> tuple[str, ...] | None:
    """The router's candidate set, sorted and without repeats (None: not sent). An empty list
    is a set too: the router had no one else to choose."""
    return None if names is None else tuple(sorted(set(names)))


def _earlier_lookups(times: Sequence[int] | None, cached: Sequence[int] | None,
                     errors: list[str]) -> tuple[tuple[float, int], ...]:
    """The plugin's earlier lookups as (engine-clock seconds, cached tokens); two lists of
    unequal length (or one alone) say nothing sure: none, and the input is named bad."""
    if not times and not cached:
        return ()
    if times is None or cached is None or len(times) != len(cached) or any(c < 0 for c in cached):
        errors.append("kvmiss.earlier_lookup_times_unix_nano")
        return ()
    return tuple((t / 1e9, c) for t, c in zip(times, cached))


def _extra_keys(text: str | None, errors: list[str]) -> ExtraKeysSpec | None:
    if text is None:
        return None
    try:
        return _extra_keys_decoder.decode(text)
    except (msgspec.ValidationError, msgspec.DecodeError):
        errors.append("kvmiss.extra_keys")
        return None


def _hash_tokens(tokens: list[int], spec: ExtraKeysSpec | None, hasher: BlockHasher,
                 errors: list[str]) -> list[int] | None:
    try:
        extras = extras_from_spec(spec) if spec is not None else None
        return [external_hash(d) for d in hasher.hash_request(tokens, extras)]
    except (HashingError, ValueError):
        errors.append("kvmiss.token_ids")
        return None
