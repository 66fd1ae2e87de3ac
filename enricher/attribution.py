"""Attributing one request: gather evidence from the index, then judge it.

The one code path shared by offline attribution (`kvmiss attribute`), the span pipeline
and the demo: `Attributor.attribute(facts)` = `verdict.attribute(facts, evidence.gather(...))`
with the deployment's digest key and evidence options applied.
"""

from __future__ import annotations

from kvmiss.enricher.evidence import gather
from kvmiss.enricher.index import ResidencyIndex
from kvmiss.enricher.privacy import DigestKey
from kvmiss.enricher.verdict import attribute, lookup_limit_tokens
from kvmiss.schemas.attribution import AttributionRecord, RequestFacts, Verdict


class Attributor:
    """Judges requests against one residency index. Not thread-safe (the index is not)."""

    def __init__(self, index: ResidencyIndex, digest_key: DigestKey | None = None, *,
                 aged_out_as_recent_match: bool = False):
        self.index = index
        self.digest_key = digest_key
        self.aged_out_as_recent_match = aged_out_as_recent_match

    def attribute(self, facts: RequestFacts) -> Verdict:
        needs_evidence = (
            facts.block_size > 0
            and facts.cached_tokens < lookup_limit_tokens(facts.prompt_tokens, facts.block_size)
        )
        evidence = (
            gather(self.index, facts, aged_out_as_recent_match=self.aged_out_as_recent_match)
            if needs_evidence else None
        )
        digest = self.digest_key.digest_block if self.digest_key is not None else None
        return attribute(facts, evidence, digest=digest)

    def record(self, facts: RequestFacts, *, trace_id: str | None = None) -> AttributionRecord:
        return AttributionRecord(
            request_id=facts.request_id, trace_id=trace_id, worker=facts.worker,
            lookup_time=facts.lookup_time, prompt_tokens=facts.prompt_tokens,
            cached_tokens=facts.cached_tokens, verdict=self.attribute(facts),
        )
