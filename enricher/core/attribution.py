"""Attributing one request: gather evidence from the index, then judge it.

The one code path shared by offline attribution (`kvmiss attribute`), the span pipeline
and the demo: `Attributor.attribute(facts)` = `verdict.attribute(facts, evidence.gather(...))`
with the deployment's digest key and evidence options applied.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection

import msgspec

from kvmiss.enricher.core.divergence import diverge
from kvmiss.enricher.core.evidence import Clocks, FleetRound, gather, read_the_cache
from kvmiss.enricher.core.geometry import first_miss_index, lookup_limit_blocks, missed_reusable
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.core.privacy import DigestKey
from kvmiss.enricher.core.verdict import attribute, unsettled_lookup
from kvmiss.schemas.attribution import (
    AttributionRecord,
    Divergence,
    Evidence,
    History,
    Label,
    RequestFacts,
    Verdict,
)
from kvmiss.schemas.fleet import StreamReach
from kvmiss.schemas.labels import SETTLED_AT_ANY_TIME, UNKNOWN_LABELS

# Engine steps (of all workers) a lookup known only within a window may fall in, beyond which
# the verdict is not settled step by step (each one is another evidence gather): unknown.
MAX_WINDOW_STEPS = 64


class Attributor:
    """Judges requests against one residency index. Not thread-safe (the index is not)."""

    def __init__(self, index: ResidencyIndex, digest_key: DigestKey | None = None, *,
                 aged_out_as_recent_match: bool = False, clocks: Clocks | None = None,
                 reach: Callable[[str], StreamReach | None] | None = None):
        """``clocks``: each worker's measured engine-clock offset at judging time (the
        service's stream health); None where kvmiss and the engines share one clock or
        nothing was measured (offline, in-process), and then no clock is checked. ``reach``:
        whether a worker's stream is connected, so a history that never arrived is told
        from one that is late."""
        self.reach = reach
        self.index = index
        self.digest_key = digest_key
        self.aged_out_as_recent_match = aged_out_as_recent_match
        self.clocks = clocks
        # Workers of the fleet that spans name and the index does not follow (kept by the
        # pipeline): none of them can be ruled out as a holder.
        self.unsubscribed: Collection[str] = ()
        self._round: FleetRound | None = None  # while the index and the clocks stay the same
        # Marks of stores with no parent told apart so far (`note_re_announcements`): a
        # verdict held for one (`confirmation_may_settle`) is judged again when it moves.
        self.confirmed = 0

    def clocks_changed(self) -> None:
        """The clocks ``clocks`` reads have moved (the index's changes are seen by itself)."""
        self._round = None

    def fleet_round(self) -> FleetRound:
        """The fleet view's key-independent part for the index as it is now."""
        fleet = self._round
        if fleet is None or fleet.generation != self.index.generation:
            fleet = self._round = FleetRound(self.index, self.clocks)
        return fleet

    def attribute(self, facts: RequestFacts) -> Verdict:
        """The request's re-announcements noted (`note_re_announcements`), then its verdict."""
        self.note_re_announcements(facts)
        return self.judge(facts)

    def judge(self, facts: RequestFacts) -> Verdict:
        """The verdict alone, for a request whose re-announcements were noted already: a caller
        that notes a round of requests first, then judges them, or judges one again."""
        verdict = self._attribute_at(facts)
        t, latest = facts.lookup_time, facts.lookup_time_latest
        if (latest is None or t is None or latest <= t or verdict.label in SETTLED_AT_ANY_TIME
                or not missed_reusable(facts.prompt_tokens, facts.cached_tokens, facts.block_size)):
            return verdict
        return self._across_window(facts, verdict)

    def _across_window(self, facts: RequestFacts, verdict: Verdict) -> Verdict:
        """The spans bound the lookup to [lookup_time, lookup_time_latest] only (vLLM's
        `llm_request`). The lookup was in one of the engine steps the window reaches (of any
        worker: the one containing its start, and the one after each batch inside it); a
        label stands only if every possible step gives it, otherwise nothing proves which
        step it was and the answer is unknown.

        A step is not possible where the engine's own hit rule contradicts its count, whatever
        label it gives: for a request that read the cache (`read_the_cache`: one that skips it
        misses what it holds), KV-cache groups that held what vLLM's hit rule needs for a hit
        through the first missed block would have given it (`ResidencyIndex.engine_would_hit`;
        a `resident_miss` there is the request's own recompute, or another store inside the
        window, seen from a step after it: ATTRIBUTION.md rule 4; an `evicted` there names a
        block the window group needed for the longest hit while a shorter one stood). A window
        with no possible step contradicts the spans: unknown."""
        t, latest = facts.lookup_time, facts.lookup_time_latest
        assert t is not None and latest is not None  # (`attribute` asks only then)
        stamps = self.index.step_stamps_between(t, latest, MAX_WINDOW_STEPS)
        if stamps is None:
            return unsettled_lookup(verdict, None, latest - t)
        blocks = first_miss_index(facts.cached_tokens, facts.block_size) + 1
        read_cache = read_the_cache(facts)
        kept: Verdict | None = None
        for at in (t, *(math.nextafter(stamp, math.inf) for stamp in stamps)):  # just after a batch: the next step
            judged = verdict if at == t else self._attribute_at(msgspec.structs.replace(facts, lookup_time=at))
            if (read_cache and facts.worker is not None
                    and facts.block_hashes is not None
                    and self.index.engine_would_hit(facts.worker, at, facts.block_hashes, blocks,
                                                    lookup_limit_blocks(facts.prompt_tokens, facts.block_size), facts.block_size)):
                continue  # the engine would have hit the block here: not where it looked up
            if not read_cache and at != t and self._stored_nothing_from(facts, at):
                continue  # its own prompt's store came before this step: not where it looked up
            if kept is None:
                kept = judged
            elif judged.label is not kept.label:
                return unsettled_lookup(kept, judged.label, latest - t)
        return kept if kept is not None else unsettled_lookup(verdict, None, latest - t, contradicted=True)

    def _stored_nothing_from(self, facts: RequestFacts, at: float) -> bool:
        """Whether no block of a request that hit nothing was stored on its worker's GPU from
        the step after ``at`` through its finish -- proven, else False. vLLM caches the full
        blocks it computes for a request when it schedules them (its first one at the admitting
        lookup, from block 0 with no parent), so its own store is at its lookup step or after,
        and before it finished: a step after which none came is not its lookup step. Stores
        leave a record only where they start an interval or are not counted (`unproven`), so
        the rule asks only where a parentless store of resident blocks is not counted: one KV
        group, full report mode possible."""
        worker, chain, finish = facts.worker, facts.block_hashes, facts.finish_time
        if worker is None or not chain or finish is None or facts.cached_tokens != 0 or facts.block_size <= 0:
            return False
        return self.index.stored_nothing_between(worker, chain[:facts.prompt_tokens // facts.block_size], at, finish)

    def _attribute_at(self, facts: RequestFacts) -> Verdict:
        # Gathered for a failed transfer too: the facts beyond the label are reported.
        needs_evidence = missed_reusable(facts.prompt_tokens, facts.cached_tokens, facts.block_size)
        evidence = (
            gather(self.index, facts, aged_out_as_recent_match=self.aged_out_as_recent_match,
                   clocks=self.clocks, unsubscribed=self.unsubscribed, fleet=self.fleet_round())
            if needs_evidence else None
        )
        if evidence is not None and evidence.history is History.LAGGING and self.reach is not None \
                and facts.worker is not None:
            evidence = msgspec.structs.replace(evidence, reach=self.reach(facts.worker))
        digest = self.digest_key.digest_block if self.digest_key is not None else None
        verdict = attribute(facts, evidence, digest=digest)
        if verdict.label is Label.NO_MATCH and facts.token_ids is not None and evidence is not None:
            divergence = self._divergence(facts, evidence, verdict.first_miss_block)
            if divergence is not None:
                verdict = msgspec.structs.replace(verdict, divergence=divergence)
        return verdict

    def note_re_announcements(self, facts: RequestFacts, *, admitted: bool = True) -> None:
        """A request in full report mode (its spans say `kv_cache_report_mode` "full") that hit
        blocks tells its own step's store with no parent of exactly them apart from a
        recomputed duplicate: it was its re-announcement (ATTRIBUTION.md rule 7;
        `ResidencyIndex.confirm_re_announcement`: the first such store at or after its lookup
        step, within its lookup window; none when its lookup time is not known -- a store of
        the same chain may be a real copy: the pipeline waits for a span that says when), and
        one for each earlier lookup of it that hit (vLLM looks a waiting request up each step
        until it is admitted; the plugin says when: `RequestFacts.earlier_lookups`; ``admitted``
        False: those only, from a span that came after the request was judged). A request not
        known to be in that mode
        confirms nothing: beside it, a request that skips the cache can store a real second
        copy of the very chain it hit. Only the index's marks change."""
        b, chain, t, worker = facts.block_size, facts.block_hashes, facts.lookup_time, facts.worker
        if facts.kv_cache_report_mode != "full":
            return  # only a request in full report mode re-announces (a duplicate looks the same)
        if b <= 0 or not chain or worker is None:
            return
        if not self.index.has_uncounted_stores(worker):
            return
        # Looked up before, not admitted then (its blocks did not fit): each of those lookups
        # that hit re-announced too, in its own step (the plugin's exact times) -- first, so
        # that a lookup known only within a window does not take one of theirs.
        for at, cached in facts.earlier_lookups:
            if cached >= b and cached // b <= len(chain):
                self.confirmed += self.index.confirm_re_announcement(worker, at, list(chain[:cached // b]), at)
        if admitted and facts.cached_tokens >= b and t is not None:  # (without a time: which store?)
            self.confirmed += self.index.confirm_re_announcement(
                worker, t, list(chain[:first_miss_index(facts.cached_tokens, b)]),
                                               facts.lookup_time_latest)

    def confirmation_may_settle(self, verdict: Verdict) -> bool:
        """Whether a request not yet noted may still settle ``verdict``: it is unknown while a
        store with no parent is not yet told apart on a tracked worker. Such a store (or its
        second copy in a lookup's own step) is often another request's re-announcement, whose
        spans may come after this request's: once noted, the same evidence may prove a label."""
        if verdict.label not in UNKNOWN_LABELS:
            return False
        return self.index.has_unconfirmed_stores()

    def _divergence(self, facts: RequestFacts, evidence: Evidence, block: int | None) -> Divergence | None:
        """Which sibling under the request's parent block it left, and how (None when the
        index keeps no siblings or the miss is at the chain's root)."""
        if not block or not facts.block_hashes or evidence.lookup_step_seq is None:
            return None
        siblings = self.index.siblings_at(facts.worker or "", evidence.epoch, facts.block_hashes[block - 1],
                                          evidence.lookup_step_seq)
        if siblings is None:
            return None
        assert facts.token_ids is not None  # (the caller asks only then)
        return diverge(facts.token_ids, facts.extra_keys, block, facts.block_size, siblings)

    def record(self, facts: RequestFacts, *, trace_id: str | None = None, noted: bool = False) -> AttributionRecord:
        """``noted``: the request's re-announcements were noted already (judged only)."""
        return AttributionRecord(
            request_id=facts.request_id, trace_id=trace_id, worker=facts.worker,
            lookup_time=facts.lookup_time, prompt_tokens=facts.prompt_tokens,
            cached_tokens=facts.cached_tokens, verdict=self.judge(facts) if noted else self.attribute(facts),
        )

