"""The attribution core: request facts + index evidence -> one label, one owner, one reason.

``attribute`` follows the precedence list of shared/spec/ATTRIBUTION.md top to bottom; the
first rule that holds wins:

    hit / lookup_limit -> transfer_failure -> window_limit -> routing_miss
      -> (chosen worker's history insufficient: unknown_epoch / unknown_history)
      -> resident_miss -> evicted -> no_match

A hybrid model's evidence is read in the KV-cache group that limited the hit
(enricher/core/group_evidence.py); a limiting group of a kind kvmiss does not model is
``unknown_history`` naming it, right after the span-only transfer_failure and the clock.

One fact comes before every claim the index makes: the chosen worker's clock. Every such
claim (tier residency, another worker's hold, the chosen worker's own history) places event
times against the lookup time t, stamped on that worker's engine clock, and tail
confirmations on kvmiss's; with the engine clock out of the configured bound
(``Evidence.clock``, `ClockOffset.within_bound`) none of them stands, so the answer is
``unknown_history`` (reason "clock skew") right after the span-only transfer_failure; so is
it when the chosen worker's engine clock went back around t (``Evidence.clock_step_s``,
reason "clock step"). Other workers out of bound (``Evidence.skewed_workers``) were not
consulted, and others whose clock went back around t (``Evidence.stepped_workers``) cannot
be placed: like unresolved holders, they leave every label below routing_miss unprovable.

It is pure (no index, socket, clock or logging) and never raises on bad input: facts that
cannot be judged are an ``unknown_history`` verdict, because a wrong cause is worse than an
honest unknown. It trusts ``Evidence`` to be built as documented there (holders and tiers
listed only with continuous history; ``presence`` meaningful only when ``history`` is
CONTINUOUS); it does not re-derive what the index proved.

Facts beyond the label (holders, epoch, gap range, store/removal seqs, eviction age, window)
are copied onto every miss verdict, whichever label wins. Reasons are short fixed sentences
with counts, sequence numbers and durations only: never hashes, token ids, salts or paths.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable
from typing import Any

from kvmiss.enricher.core.geometry import first_miss_index, lookup_limit_tokens, missed_reusable
from kvmiss.schemas.attribution import (
    ClockOffset,
    Evidence,
    History,
    Label,
    Presence,
    RequestFacts,
    TransferAttempt,
    TransferResult,
    Verdict,
    WindowStart,
)
from kvmiss.schemas.fleet import Reach, StreamReach
from kvmiss.schemas.labels import LABELS

REASON_MAX_CHARS = 200

# Names that may appear in a reason. Anything else a span supplies (a worker id, a tier
# name, an unknown extra-key kind) stays out of the reason: it could be an address or a path.
_TIER_MEDIA = frozenset({"CPU", "STORAGE", "EXTERNAL"})
_EXTRA_KEY_KINDS = ("cache_salt", "lora", "mm", "prompt_embeds")
_FAILED_TRANSFER = {
    TransferResult.FAILED: "failed",
    TransferResult.TIMEOUT: "timed out",
    TransferResult.STALE: "hit stale ownership",
}


def failed_transfer(transfers: Iterable[TransferAttempt]) -> TransferAttempt | None:
    """The request's own failed transfer attempt, if a span reported one: it proves
    ``transfer_failure`` without the index (and so without a lookup time)."""
    return next((attempt for attempt in transfers if attempt.result in _FAILED_TRANSFER), None)


def needs_index(prompt_tokens: int, cached_tokens: int, block_size: int,
                transfers: Iterable[TransferAttempt] = ()) -> bool:
    """Whether the label of a request with these span facts rests on the index: a miss of
    a reusable block that the request's own spans do not already explain. Only then does
    judging need a lookup time and the chosen worker's history to reach it."""
    return missed_reusable(prompt_tokens, cached_tokens, block_size) and failed_transfer(transfers) is None


def attribute(
    facts: RequestFacts,
    evidence: Evidence | None,
    *,
    digest: Callable[[int], str] | None = None,
) -> Verdict:
    """Judge one request. ``evidence`` is about H = block_hashes[C // B] at the lookup time;
    None means the index has nothing for the chosen worker. ``digest`` maps H to its keyed
    digest (``DigestKey.digest_block``); without it no digest is reported."""
    invalid = _invalid_facts(facts)
    if invalid:
        history = evidence.history if evidence is not None else None
        return _verdict(Label.UNKNOWN_HISTORY, f"invalid request facts: {invalid}", history=history)

    b = facts.block_size
    limit = lookup_limit_tokens(facts.prompt_tokens, b)
    if facts.cached_tokens >= limit:  # (the common miss pays no call here)
        return _nothing_missed(facts, limit)
    block = first_miss_index(facts.cached_tokens, b)
    chain = facts.block_hashes
    first_miss = chain[block] if chain is not None and block < len(chain) else None
    known: dict[str, Any] = {
        "first_miss_block": block,
        "first_miss_token": block * b,
        "missed_tokens": limit - facts.cached_tokens,
        "extra_key_kinds": facts.extra_key_kinds,
    }
    if first_miss is not None and digest is not None:
        known["first_miss_digest"] = digest(first_miss)
    from_request = dict(known)  # what holds whatever the clocks say
    if evidence is not None:
        known.update(_evidence_facts(evidence, facts.lookup_time))

    # transfer_failure, from the request's own transfer spans: these prove a fault
    # without the index, so they outrank everything the index could (not) say.
    attempt = failed_transfer(facts.transfers)
    if attempt is not None:
        reason = (
            f"a transfer from {_source_kind(attempt.source)} "
            f"{_FAILED_TRANSFER[attempt.result]}, so the engine recomputed the prefix"
        )
        return _verdict(Label.TRANSFER_FAILURE, reason, **known)

    # Every later rule is a claim about H; without it the index evidence has no subject.
    if first_miss is None:
        reason = (
            "the request's block chain ends before the first missed block" if chain
            else facts.chain_unavailable
            or "the request carried no block chain, so the first missed block cannot be identified"
        )
        return _verdict(Label.UNKNOWN_HISTORY, reason, **known)
    if evidence is None:
        reason = _untracked_reason(facts)
        return _verdict(Label.UNKNOWN_HISTORY, reason, history=History.UNTRACKED, **known)

    return _on_evidence(facts, evidence, known, from_request)


def _nothing_missed(facts: RequestFacts, limit: int) -> Verdict:
    """hit / lookup_limit, for C >= L (``limit``: the lookup limit L in tokens): nothing
    reusable was missed. C > L (possible only with an engine that also serves the last token)
    missed nothing either, so it is a hit."""
    n, b, c = facts.prompt_tokens, facts.block_size, facts.cached_tokens
    if c == limit and n >= b and n % b == 0:
        return _verdict(
            Label.LOOKUP_LIMIT,
            "only the last full block was recomputed: the engine never serves the block "
            "holding the final prompt token from cache",
        )
    if c > limit:
        return _verdict(Label.HIT, "the engine reused beyond its lookup limit: nothing missed")
    return _verdict(Label.HIT, "every reusable prompt block was served from the prefix cache")


def _on_evidence(facts: RequestFacts, evidence: Evidence, known: dict[str, Any],
                 from_request: dict[str, Any]) -> Verdict:
    """The labels the index's evidence proves, first that holds (ATTRIBUTION.md precedence).
    ``from_request``: the facts that hold whatever the chosen worker's clock says."""
    unknown = Label.UNKNOWN_HISTORY
    # The chosen worker's clock out of bound, or gone back around t: t cannot be placed against
    # any event time, so no timed fact (holders, eviction age, store/removal) is reported.
    if evidence.clock is not None and not evidence.clock.within_bound:
        return _verdict(unknown, _clock_reason(evidence.clock), **from_request, history=evidence.history,
                        epoch=evidence.epoch)
    if evidence.clock_step_s is not None:
        return _verdict(unknown, _CLOCK_STEP.format(evidence.clock_step_s), **from_request,
                        history=evidence.history, epoch=evidence.epoch)
    if evidence.unmodelled is not None:  # never a label computed as if it were full attention (rule 8)
        return _verdict(unknown, _UNMODELLED + evidence.unmodelled, **known)
    if evidence.tiers:  # transfer_failure: a tier of the chosen worker held H, not loaded
        return _verdict(Label.TRANSFER_FAILURE, _TIER_HELD.format(_tier_kind(evidence.tiers[0].medium)), **known)
    if evidence.window_limit:  # established on continuous history by the evidence builder
        return _verdict(Label.WINDOW_LIMIT, _STATE_LIMIT if evidence.state_group else _WINDOW_LIMIT, **known)
    if evidence.holders and evidence.group is not None:  # a hybrid: the holder's other groups decide too
        return _verdict(unknown, _HYBRID_HOLDER, **known)
    if evidence.holders:  # routing_miss, whatever the chosen worker's own history
        count = len(evidence.holders)
        return _verdict(Label.ROUTING_MISS, _ROUTED_ELSEWHERE.format(count, "s" if count > 1 else ""), **known)
    # The chosen worker's history must support a claim before presence means anything.
    if evidence.history is History.EPOCH_UNKNOWN:
        return _verdict(Label.UNKNOWN_EPOCH, _EPOCH_OPEN, **known)
    if evidence.history is not History.CONTINUOUS:
        return _verdict(unknown, _insufficient_history_reason(facts, evidence), **known)
    # Below routing_miss only if no other worker (or tier) may have held H at t.
    if evidence.unresolved_holders:
        return _verdict(unknown, _unresolved_reason(evidence), **{**known, "history": evidence.unresolved_holders[0]})
    if evidence.skewed_workers or evidence.unsettled_members or evidence.stepped_workers:
        return _verdict(unknown, _unresolved_reason(evidence), **known)
    return _where_h_stood(facts, evidence, known)


_CLOCK_STEP = ("clock step: the chosen worker's engine clock went back {:.3f} s around the lookup, so its "
               "events cannot be ordered against the lookup time")
_UNMODELLED = "the hit was limited by KV-cache groups kvmiss does not model: "
_TIER_HELD = "the first missed block was on the chosen worker's {} at lookup, not loaded"
_STATE_LIMIT = ("the full-attention group held the first missed block, but the linear-attention (Mamba) "
                "group never kept a state at the boundary it reached (the engine keeps one at prompt ends)")
_WINDOW_LIMIT = ("the full-attention group held the first missed block, but the sliding-window group "
                 "never kept the window's state at that position (the engine keeps it near prompt ends)")
_HYBRID_HOLDER = ("another worker held the first missed block in its full-attention group; whether "
                  "its other KV-cache groups would have served it is not established")
_ROUTED_ELSEWHERE = "{} other tracked worker{} held the first missed block at lookup, but the request was routed elsewhere"
_EPOCH_OPEN = ("which process lifetime of the chosen worker served the request is not established "
               "(unresolved restart or reconnect, or an instance the index does not hold)")


def _where_h_stood(facts: RequestFacts, evidence: Evidence, known: dict[str, Any]) -> Verdict:
    """resident_miss / evicted / no_match, or unknown when the index cannot place H."""
    if evidence.presence is Presence.RESIDENT:
        return _verdict(
            Label.RESIDENT_MISS,
            "the index shows the first missed block resident on the chosen worker at lookup, "
            "yet the engine did not reuse it",
            **known,
        )
    if evidence.presence is Presence.EVICTED:
        reason = _evicted_reason(evidence, known.get("eviction_age_ms"))
        return _verdict(Label.EVICTED, reason, **known)
    if evidence.presence is Presence.ABSENT:
        return _verdict(Label.NO_MATCH, _no_match_reason(facts, evidence), **known)
    if evidence.re_announced:
        reason = ("a store with no parent of a block this verdict needs may re-announce a reused chain "
                  "(kv_cache_report_mode full) or be a second copy; the request it was for was not seen")
    elif evidence.same_step_copies:
        reason = ("two copies of the first missed block were stored in the engine step of the "
                  "lookup; whether one preceded it (a request skipping the cache) is not established")
    else:
        reason = ("the index cannot place the first missed block on the chosen worker at lookup, "
                  "although its history is continuous")
    return _verdict(Label.UNKNOWN_HISTORY, reason, **known)





def unsettled_lookup(verdict: Verdict, other: Label | None, window_s: float, *, contradicted: bool = False) -> Verdict:
    """The answer when the spans bound a request's lookup to a window only (vLLM's
    `llm_request`: queue time and time to first token) and ``verdict``, judged at its start,
    is not what every engine step in the window gives: ``other`` at a later step, or None when
    the window reaches more steps than are judged; ``contradicted``: in every step the engine's
    hit rule would have given more than it reported. The request's own facts stay."""
    if contradicted:
        why = "has no engine step where the engine's hit rule gives the cached tokens it reported"
    elif other is None:
        why = "reaches more engine steps than kvmiss judges one by one"
    else:
        why = f"holds engine steps that give {verdict.label.value} and {other.value}"
    reason = (f"the spans place the lookup only within a {window_s * 1000:.0f} ms window (vLLM's queue time and time "
              f"to first token; no exact lookup time), which {why}")
    return _verdict(Label.UNKNOWN_HISTORY, reason, history=verdict.history, epoch=verdict.epoch,
                    first_miss_block=verdict.first_miss_block, first_miss_token=verdict.first_miss_token,
                    first_miss_digest=verdict.first_miss_digest, extra_key_kinds=verdict.extra_key_kinds,
                    missed_tokens=verdict.missed_tokens)


def _verdict(label: Label, reason: str, **fields: Any) -> Verdict:
    """The only constructor: owner always from the label table, reason always within the bound."""
    if len(reason) > REASON_MAX_CHARS:
        reason = reason[: REASON_MAX_CHARS - 1] + "…"
    return Verdict(label=label, owner=LABELS[label].owner, reason=reason, **fields)


def _invalid_facts(facts: RequestFacts) -> str | None:
    """Why the counts cannot be judged, or None. Spans are outside input: never raise on them."""
    if facts.block_size <= 0:
        return "block size must be positive"
    if facts.prompt_tokens < 0 or facts.cached_tokens < 0:
        return "token counts must not be negative"
    if facts.cached_tokens > facts.prompt_tokens:
        return "cached tokens exceed prompt tokens"
    return None


def _evidence_facts(evidence: Evidence, lookup_time: float | None) -> dict[str, Any]:
    """Evidence facts reported on every miss verdict, whichever label wins."""
    known: dict[str, Any] = {
        "history": evidence.history,
        "holders": len(evidence.holders),
        "epoch": evidence.epoch,
        "stored_seq": evidence.stored_seq,
        "removed_seq": evidence.removed_seq,
        "window_start": evidence.window_start,
        "window_start_ts": evidence.window_start_ts,
        "gap_from_seq": evidence.gap_from_seq,
        "gap_to_seq": evidence.gap_to_seq,
        "kv_cache_group": evidence.group,
    }
    # An eviction age is a claim, not a raw observation: only continuous history supports it,
    # and a removal stamped after the lookup (inconsistent clocks or input) has no age at t.
    if (
        evidence.history is History.CONTINUOUS
        and evidence.presence is Presence.EVICTED
        and evidence.removed_ts is not None
        and lookup_time is not None
        and evidence.removed_ts <= lookup_time
    ):
        known["eviction_age_ms"] = round((lookup_time - evidence.removed_ts) * 1000)
    return known


def _source_kind(source: str | None) -> str:
    if source is not None and source.upper() in _TIER_MEDIA:
        return f"the {source.upper()} offload tier"
    return "a remote source" if source else "an unnamed source"


def _tier_kind(medium: str) -> str:
    return f"{medium.upper()} offload tier" if medium.upper() in _TIER_MEDIA else "offload tier"


def _untracked_reason(facts: RequestFacts) -> str:
    if facts.worker is None:
        return "untracked: the request names no chosen worker, so no residency history applies"
    return "untracked: the chosen worker's event stream is not tracked by the index"


def _gap_text(evidence: Evidence) -> str:
    lo, hi = evidence.gap_from_seq, evidence.gap_to_seq
    if lo is not None and hi is not None:
        return f" (seq {lo}..{hi})"
    if lo is not None:
        return f" (from seq {lo})"
    return ""


def _utc(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _blind_reason(reach: StreamReach) -> str:
    cause = f" ({reach.cause.value})" if reach.cause is not None else ""
    if reach.state is Reach.NEVER_CONNECTED:
        return ("never connected: kvmiss has not reached the chosen worker's event stream since it began "
                f"following it{cause}, so no history of it exists")
    since = "" if reach.since is None else " since " + _utc(reach.since)
    return f"unreachable{since}: the chosen worker's event stream is disconnected{cause}"


def _insufficient_history_reason(facts: RequestFacts, evidence: Evidence) -> str:
    """One sentence per History value that is neither CONTINUOUS nor EPOCH_UNKNOWN."""
    t = facts.lookup_time
    match evidence.history:
        case History.GAP:
            return (
                "gap: a hole in the chosen worker's event stream that replay could not fill"
                f"{_gap_text(evidence)} lies in the history this verdict needs"
            )
        case History.LAGGING if evidence.reach is not None and evidence.reach.blind:
            return _blind_reason(evidence.reach)
        case History.LAGGING:
            behind = ""
            if t is not None and evidence.applied_through_ts is not None:
                behind = f" (applied through {t - evidence.applied_through_ts:.3f} s before it)"
            return (
                "lagging: the chosen worker's events had not reached the lookup time when the "
                f"wait ended{behind}"
            )
        case History.AGED_OUT:
            horizon = ""
            if t is not None and evidence.window_start_ts is not None:
                horizon = f"; retention horizon {t - evidence.window_start_ts:.1f} s before lookup"
            return f"aged out: records this verdict needs were dropped by retention{horizon}"
        case History.QUARANTINED:
            return (
                "quarantined: the chosen worker's stream was quarantined at lookup after a hole "
                f"replay could not fill{_gap_text(evidence)}"
            )
        case _:  # UNTRACKED
            return _untracked_reason(facts)


_UNRESOLVED_TEXT = {
    History.QUARANTINED: "quarantined",
    History.LAGGING: "behind the lookup time",
    History.GAP: "missing the history around it",
    History.AGED_OUT: "aged out",
    History.EPOCH_UNKNOWN: "of unknown lifetime",
    History.UNTRACKED: "not subscribed to (named by spans, absent from [[workers]])",
}


def _clock_reason(clock: ClockOffset) -> str:
    """Which way the chosen worker's engine clock is off, against which bound. The lag is the
    offset plus the quickest delivery: below the bound it proves the engine runs ahead by at
    least that much; above it, every recent batch arrived that late (the engine runs behind)."""
    bound = f"outside the bound (receive lag {clock.low_s:.3f}..{clock.high_s:.3f} s)"
    if clock.lag_s < clock.low_s:
        return (f"clock skew: the chosen worker's engine clock is at least {-clock.lag_s:.3f} s "
                f"ahead of kvmiss's, {bound}: its event times cannot be placed against lookup")
    return (f"clock skew: the chosen worker's events arrive at least {clock.lag_s:.3f} s after "
            f"their engine timestamps, {bound}: its engine clock runs behind kvmiss's")


def _unresolved_reason(evidence: Evidence) -> str:
    count = (len(evidence.unresolved_holders) + len(evidence.skewed_workers) + len(evidence.unsettled_members)
             + len(evidence.stepped_workers))
    why = sorted({_UNRESOLVED_TEXT.get(h, h.value) for h in evidence.unresolved_holders}
                 | ({"with a clock beyond the skew bound"} if evidence.skewed_workers else set())
                 | ({"whose fleet membership at lookup is not settled"} if evidence.unsettled_members else set())
                 | ({"whose engine clock went back around it"} if evidence.stepped_workers else set()))
    return (
        f"whether another worker held the first missed block at lookup is not established "
        f"({count} stream{'s' if count > 1 else ''} {', '.join(why)}), so routing cannot be ruled out"
    )


def _evicted_reason(evidence: Evidence, age_ms: int | None) -> str:
    how = "cleared with all blocks from" if evidence.removed_by_clear else "removed from"
    when = f"{age_ms} ms before lookup" if age_ms is not None else "before lookup"
    where = "the chosen worker's GPU cache" if evidence.group is None else (
        f"KV-cache group {evidence.group} of the chosen worker's GPU cache")
    what = ("the state the linear-attention (Mamba) group needed" if evidence.state_group
            else "a block the sliding-window group needed" if evidence.window_group else "the first missed block")
    return f"{what} was {how} {where} {when}"


def _no_match_reason(facts: RequestFacts, evidence: Evidence) -> str:
    match evidence.window_start:
        case WindowStart.EPOCH_START:
            reason = "the first missed block was never on the chosen worker since it started"
        case WindowStart.CLEAR:
            reason = "the first missed block was never on the chosen worker since a cache clear"
        case WindowStart.HORIZON:
            span = ""
            if facts.lookup_time is not None and evidence.window_start_ts is not None:
                span = f" (last {facts.lookup_time - evidence.window_start_ts:.0f} s)"
            reason = (
                "no recent match: the first missed block was not on the chosen worker "
                f"within the retention window{span}"
            )
        case _:
            reason = "the first missed block was never on the chosen worker in the covered history"
    kinds = [kind for kind in _EXTRA_KEY_KINDS if kind in facts.extra_key_kinds]
    if kinds:
        reason += f"; extra keys: {', '.join(kinds)}"
    return reason
