"""Assembling one request's facts from the spans that carry them.

Spans of one request arrive in different export batches and at different times (the
router span usually ends after the engine span; vLLM exports ``llm_request`` when the
request finishes). Fragments are grouped by trace id and request id; fragments without a
request id (a transfer span, a router that does not set one) join the trace's only named
request, or stand alone when the trace has none or several.

Pure: no clock, no I/O. The pipeline decides when to stop waiting.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvmiss.enricher.hashing import BlockHasher, HashingError, external_hash, extras_from_spec
from kvmiss.schemas.prompt import ExtraKeysSpec
from kvmiss.enricher.spans import SpanFacts
from kvmiss.schemas.attribution import RequestFacts


_extra_keys_decoder = msgspec.json.Decoder(ExtraKeysSpec)


class Fragment(msgspec.Struct):
    """One span's facts, and where to write the verdict if this span is chosen."""

    facts: SpanFacts
    span: Any  # the protobuf Span (owned by a pending export batch)
    batch: Any  # the pending batch holding it
    instance: str | None = None


class Assembly:
    """Every fragment seen so far for one (trace, request)."""

    __slots__ = ("trace_id", "request_id", "fragments", "first_seen", "done")

    def __init__(self, trace_id: bytes, request_id: str | None, now: float):
        self.trace_id = trace_id
        self.request_id = request_id
        self.fragments: list[Fragment] = []
        self.first_seen = now
        self.done = False

    def merged(self) -> SpanFacts:
        """Field by field, the first fragment that has a value wins; an explicit lookup
        time beats one derived from queue time."""
        out = SpanFacts()
        for fragment in self.fragments:
            for field in fragment.facts.__struct_fields__:
                value = getattr(fragment.facts, field)
                if value is not None and getattr(out, field) is None and field != "transfer":
                    setattr(out, field, value)
        if out.instance is None:
            out.instance = next((f.instance for f in self.fragments if f.instance), None)
        return out

    def transfers(self) -> tuple:
        return tuple(f.facts.transfer for f in self.fragments if f.facts.transfer is not None)

    def outcome_fragment(self) -> Fragment:
        """The span that carries the request's cache outcome gets the verdict: the one with
        cached tokens, else the one with prompt tokens, else the first."""
        for wanted in ("cached_tokens", "prompt_tokens"):
            for fragment in self.fragments:
                if getattr(fragment.facts, wanted) is not None:
                    return fragment
        return self.fragments[0]


class MissingFacts(msgspec.Struct, frozen=True):
    """Why an assembly cannot be judged yet (or ever): the names of the missing facts."""

    missing: tuple[str, ...]


def to_request_facts(assembly: Assembly, *, hasher: BlockHasher | None, default_block_size: int,
                     errors: list[str]) -> RequestFacts | MissingFacts:
    """The `RequestFacts` of an assembly, or what is still missing. Problems that make a
    fact unusable (bad extra-key JSON, unhashable tokens) are appended to ``errors`` by
    name only: they may concern prompt material."""
    m = assembly.merged()
    missing = tuple(name for name, value in (
        ("prompt_tokens", m.prompt_tokens), ("cached_tokens", m.cached_tokens),
    ) if value is None)
    if missing:
        return MissingFacts(missing)
    block_size = m.block_size or default_block_size
    kinds = tuple(m.extra_key_kinds or ())
    chain = m.block_hashes
    spec = _extra_keys(m, errors)
    if spec is not None:
        kinds = kinds or spec.kinds()
    if chain is None and m.token_ids is not None and hasher is not None and "kvmiss.extra_keys" not in errors:
        chain = _hash_tokens(m.token_ids, spec, hasher, errors)
    lookup_time = m.lookup_time if m.lookup_time is not None else m.queue_lookup_time
    return RequestFacts(
        request_id=assembly.request_id or m.request_id,
        prompt_tokens=m.prompt_tokens,  # type: ignore[arg-type]
        cached_tokens=m.cached_tokens,  # type: ignore[arg-type]
        block_size=block_size,
        worker=m.worker,
        dp_rank=m.dp_rank,
        lookup_time=lookup_time,
        block_hashes=chain,
        extra_key_kinds=kinds,
        transfers=assembly.transfers(),
        instance_hint=m.instance,
        route_policy=m.route_policy,
        predicted_cached_tokens=m.predicted_cached_tokens,
        token_ids=m.token_ids,
        extra_keys=spec,
    )


def _extra_keys(m: SpanFacts, errors: list[str]) -> ExtraKeysSpec | None:
    if m.extra_keys is None:
        return None
    try:
        return _extra_keys_decoder.decode(m.extra_keys)
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
