"""Attribution types: what a request claims, what the residency index proves, what we conclude.

    RequestFacts (from spans or a request record)
      + Evidence (from the residency index, judged at the lookup time)
      -> Verdict (label, owner, reason, facts)            see shared/spec/ATTRIBUTION.md

Times are engine wall-clock seconds (float), the clock that stamps KV-event batches.
Block hashes are canonical uint64 ints (engine external form). Nothing here carries token
ids, salts or adapter paths: these Structs may be written to attribution-record files.
"""

from __future__ import annotations

import enum

import msgspec

from kvmiss.schemas.fleet import StreamReach

# Defined with the label table; Verdict names them, and code that has always imported them
# from here still can.
from kvmiss.schemas.labels import LABEL_OWNER as LABEL_OWNER, Label as Label, Owner as Owner
from kvmiss.schemas.prompt import ExtraKeysSpec


class History(str, enum.Enum):
    """How good the chosen worker's history is for the claim the verdict needs."""

    CONTINUOUS = "continuous"
    GAP = "gap"  # a hole replay could not fill lies inside the needed interval
    LAGGING = "lagging"  # applied history had not reached the lookup time when the wait ended
    AGED_OUT = "aged_out"  # a record the claim needs was dropped by retention
    EPOCH_UNKNOWN = "epoch_unknown"  # which process lifetime served the request is not established
    UNTRACKED = "untracked"  # the chosen worker is not one we subscribe to (or none was named)
    QUARANTINED = "quarantined"  # the worker's stream is quarantined at the lookup time


class Presence(str, enum.Enum):
    """Where the first-miss block H stood on the chosen worker's GPU at the lookup time."""

    RESIDENT = "resident"  # stored before t, not removed or cleared before t
    EVICTED = "evicted"  # stored earlier in this epoch, removed or cleared before t
    ABSENT = "absent"  # never stored in the covered window
    UNKNOWN = "unknown"  # history does not allow a claim (see History)


class WindowStart(str, enum.Enum):
    """What the covered window of a `no_match` starts from."""

    EPOCH_START = "epoch_start"  # seq 0 of this epoch, nothing missed since
    CLEAR = "clear"  # an observed AllBlocksCleared, continuous since
    HORIZON = "horizon"  # the retention horizon: this is only "no recent match"


class TransferResult(str, enum.Enum):
    COMPLETED = "completed"
    FAILED = "failed"
    TIMEOUT = "timeout"
    STALE = "stale"


class TransferAttempt(msgspec.Struct, frozen=True):
    """A connector or router's attempt to bring blocks in from a remote worker or a tier."""

    result: TransferResult
    source: str | None = None  # worker id or tier name (low cardinality)


class RequestFacts(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the spans (or a request record) say about one request's cache lookup."""

    request_id: str | None = None
    prompt_tokens: int  # N
    cached_tokens: int  # C, as the engine reported
    block_size: int  # B
    worker: str | None = None  # chosen worker id (collector's id); None when not routed/known
    dp_rank: int | None = None
    lookup_time: float | None = None  # engine-clock seconds of the first cache probe
    # When ``lookup_time`` is only the earliest the lookup can have been (vLLM's `llm_request`:
    # span start + time in queue), the latest it can have been (span start + time to first
    # token - prefill time); the verdict must then hold at every engine step between them.
    lookup_time_latest: float | None = None
    # The request's full-block chain, canonical uint64: a list, or (read from OTLP bytes in C)
    # an array('Q') -- only its length and elements are read.
    block_hashes: list[int] | None = None
    # Why no chain could be made of the request's token ids (its worker's engine hashes blocks
    # in a way kvmiss does not compute): the reason its first miss cannot be identified.
    chain_unavailable: str | None = None
    extra_key_kinds: tuple[str, ...] = ()  # lora, cache_salt, mm, prompt_embeds
    transfers: tuple[TransferAttempt, ...] = ()
    instance_hint: str | None = None  # e.g. resource service.instance.id
    route_policy: str | None = None
    # The router's candidate set for this request (`kvmiss.route.candidates`), sorted: the
    # fleet at t as the router saw it. None: not sent (membership sources decide).
    route_candidates: tuple[str, ...] | None = None
    predicted_cached_tokens: int | None = None
    # vLLM's `kv_cache_report_mode` of the request ("full": the engine re-announced the chain
    # it reused -- what tells that store from a duplicate, ATTRIBUTION.md rule 7).
    kv_cache_report_mode: str | None = None
    # vLLM's `skip_reading_prefix_cache` of the request (prompt logprobs set it): False proves
    # it read the prefix cache, so the engine's hit rule applies to it even when it hit
    # nothing; None: not known (a request that hit a block read it all the same).
    skip_reading_prefix_cache: bool | None = None
    # A full-report request's lookups before the one that admitted it: (engine-clock seconds,
    # cached tokens found). Each that hit re-announced what it hit, in its own step.
    earlier_lookups: tuple[tuple[float, int], ...] = ()
    # Opt-in prompt material, for divergence detail only: used in memory, never written out.
    token_ids: list[int] | None = None
    extra_keys: ExtraKeysSpec | None = None
    # When the request finished (engine clock, seconds) and how many tokens it generated: for
    # what-if sizing (`kvmiss whatif`); the finish also bounds, in a lookup window, when its
    # own prompt was stored (`Attributor._stored_nothing_from`).
    finish_time: float | None = None
    output_tokens: int | None = None


class RequestRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """One line of a request-records file (``[export] request_records``): a judged request's
    `RequestFacts` less the opt-in prompt material -- there is no field for token ids or
    extra keys (salts, adapter paths) -- and its trace id. `kvmiss attribute` and
    `kvmiss whatif` read it as `RequestFacts` (the trace id is ignored there). Never tracked
    by the cyclic GC (``gc=False``): it holds numbers, strings and frozen structs, no cycle,
    and thousands of them may wait for the writer."""

    request_id: str | None = None
    trace_id: str | None = None  # hex
    prompt_tokens: int
    cached_tokens: int
    block_size: int
    worker: str | None = None
    dp_rank: int | None = None
    lookup_time: float | None = None
    lookup_time_latest: float | None = None
    block_hashes: list[int] | None = None  # what the engines publish on their KV-event streams
    extra_key_kinds: tuple[str, ...] = ()
    transfers: tuple[TransferAttempt, ...] = ()
    instance_hint: str | None = None
    route_policy: str | None = None
    route_candidates: tuple[str, ...] | None = None  # the router's candidate set
    predicted_cached_tokens: int | None = None
    kv_cache_report_mode: str | None = None
    skip_reading_prefix_cache: bool | None = None
    earlier_lookups: tuple[tuple[float, int], ...] = ()
    finish_time: float | None = None
    output_tokens: int | None = None
    chain_unavailable: str | None = None  # why no chain was made of the token ids (no token id in it)


# KV-cache group kinds (vLLM's `kv_cache_spec_kind`) whose hit rule kvmiss models: the
# leading run of full attention, and the sliding window's right-to-left search for
# cdiv(W - 1, B) contiguous blocks. Any other kind (mamba, chunked_local_attention, a kind
# this release does not know) is judged `unknown_history` naming it (ATTRIBUTION.md rule 8).
FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
STATE_KINDS = frozenset({"mamba"})  # one state per block boundary (vLLM's MambaManager)


class KVCacheGroup(msgspec.Struct, frozen=True):
    """One KV-cache group of a worker epoch, as its events describe it: the group index,
    the spec kind (None: the engine did not say, as before vLLM 0.22), the sliding window in
    tokens (window kinds) and the group's block size (0: not seen yet)."""

    idx: int
    kind: str | None = None
    window_tokens: int | None = None
    block_size: int = 0

    @property
    def full_attention(self) -> bool:
        return self.kind in FULL_ATTENTION_KINDS

    @property
    def window_blocks(self) -> int | None:
        """Contiguous blocks a hit needs, ending at it, in a window group: cdiv(W - 1, B) (the
        token at the hit position is itself inside the window); in a Mamba / linear-attention
        state group 1 (its state at the hit's last boundary); None when neither is modelled."""
        if self.kind in STATE_KINDS and self.block_size > 0:
            return 1
        if self.kind not in WINDOW_KINDS or not self.window_tokens or self.block_size <= 0:
            return None
        return max(0, -(-(self.window_tokens - 1) // self.block_size))


class TierHolding(msgspec.Struct, frozen=True):
    """H held on an offload tier of the chosen worker at t, with continuous history."""

    medium: str  # canonical medium: CPU, STORAGE, EXTERNAL
    stored_ts: float | None  # None once the batch log around the store aged out


class Holder(msgspec.Struct, frozen=True):
    """Another tracked worker that held H at t, its history continuous over [stored, t]."""

    worker: str
    medium: str
    stored_ts: float | None


class ClockOffset(msgspec.Struct, frozen=True):
    """A worker's engine clock against kvmiss's, as measured when a request is judged.

    ``lag_s``: the smallest receive lag (kvmiss receive time minus engine ``ts``) of the
    worker's recent live batches (collectors.continuity.LagWindow) -- the clock offset
    (kvmiss minus engine) plus the quickest delivery, so never below the offset. The
    worker's timing is trusted while ``low_s <= lag_s <= high_s``:

    * ``low_s = -history.clock_skew_s``: a lag below it proves the engine clock runs ahead
      of kvmiss's by more than the bound (a delivery takes no negative time);
    * ``high_s = history.clock_skew_s + history.publish_delay_s``: a lag above it, for every
      recent batch, means the engine clock runs behind by more than the bound, unless no
      batch was delivered within the publish delay (then the bound on that is broken).

    Outside, kvmiss's assumptions about the worker's clock are broken: lookup times and
    tail probes cannot be placed against its event times, and no claim resting on them is
    made (``unknown_history``, reason "clock skew"). Back inside, it is judged again.
    """

    lag_s: float
    low_s: float
    high_s: float

    @property
    def within_bound(self) -> bool:
        return self.low_s <= self.lag_s <= self.high_s


class Evidence(msgspec.Struct, frozen=True, kw_only=True):
    """What the residency index proves about H = h[C // B] at the lookup time t.

    Built by `enricher.evidence` from the index; judged here by `enricher.verdict`.
    ``history`` already accounts for which interval the reported `presence` needs: a
    store-then-removal needs continuity only from the store, an `ABSENT` needs it from
    ``window_start`` — so `presence` is only meaningful when ``history`` is CONTINUOUS.
    """

    history: History
    presence: Presence = Presence.UNKNOWN
    epoch: int | None = None
    # The store and removal of H behind RESIDENT / EVICTED.
    stored_seq: int | None = None
    stored_ts: float | None = None
    removed_seq: int | None = None
    removed_ts: float | None = None
    removed_by_clear: bool = False
    # The covered window behind ABSENT.
    window_start: WindowStart | None = None
    window_start_ts: float | None = None
    # Where history broke, when it did (for unknown_* and attributes).
    gap_from_seq: int | None = None
    gap_to_seq: int | None = None
    applied_through_ts: float | None = None
    lookup_step_seq: int | None = None  # the batch of the engine step containing the lookup
    # Fleet view at t.
    tiers: tuple[TierHolding, ...] = ()
    holders: tuple[Holder, ...] = ()
    # Why some other worker (or tier) may have held H at t though neither could be proven:
    # while any remain, no label below routing_miss is provable.
    unresolved_holders: tuple[History, ...] = ()
    # H was stored twice in the lookup's own engine step: one copy may predate the lookup
    # (a request that skips the prefix cache), so absence or eviction is not provable.
    same_step_copies: bool = False
    # Whether the chosen worker's stream was connected at judging time, when its history had
    # not reached the lookup (None: not watched -- offline, in-process).
    reach: StreamReach | None = None
    # The chosen worker's clock at judging time (None: not measured, no live batch yet, or
    # a deployment that does not measure it). Out of bound, no index claim stands.
    clock: ClockOffset | None = None
    # Other tracked workers whose clock is out of bound: every fleet claim about them
    # (held H at t, or provably did not) compares their event times with t, so they are
    # neither holders nor ruled out -- like `unresolved_holders`, no label below
    # routing_miss is provable while any remain.
    skewed_workers: tuple[ClockOffset, ...] = ()
    # Other workers whose fleet membership at t is not settled (t within the uncertainty
    # band of their join or departure, or a hold before they joined) and that held or may
    # have held H: neither holders nor ruled out (docs/HISTORY.md, "Fleets that change").
    unsettled_members: tuple[str, ...] = ()
    # The chosen worker's engine clock went back around t (a wall-clock step): the same clock
    # readings occur before and after the step, so which of its batches came before t is not
    # established, nor how t compares with any other event time (like a clock out of bound,
    # no index claim stands). How far it went back, in seconds; None: t can be placed.
    clock_step_s: float | None = None
    # Other workers with a record of H (or no known-empty point) whose engine clock went back
    # around t: neither holders nor ruled out, like `unresolved_holders`.
    stepped_workers: tuple[str, ...] = ()
    # KV-cache groups (a hybrid model: several groups, or one that is not full attention).
    # ``group``: the group the facts above were read in -- the one that limited the hit
    # (None: one full-attention group, nothing to choose). ``window_limit``: that group is
    # a sliding-window group, every block of the window it needed at the longest hit the
    # full-attention group allowed was never stored in it (continuous history), and the
    # full-attention group held the first missed block at t; or a state group, whose window
    # is the state at that hit's last block boundary. ``unmodelled``: why the hit
    # rule cannot be reproduced (a group kind kvmiss does not model, block sizes it does
    # not, a model with no full-attention group): a short fixed phrase naming the kind.
    group: int | None = None
    window_group: bool = False  # ``group`` is a sliding-window or state group (not full attention)
    state_group: bool = False  # ``group`` is a Mamba / linear-attention state group
    window_limit: bool = False
    unmodelled: str | None = None
    # The block the claim needed was announced only by a store that may be a re-announcement
    # (vLLM's `kv_cache_report_mode: "full"`; ATTRIBUTION.md rule 7): never stored is not proven.
    re_announced: bool = False


class DivergenceKind(str, enum.Enum):
    TOKENS = "tokens"  # a sibling under the same parent differs in tokens
    EXTRA_KEYS = "extra_keys"  # same tokens, different extra keys
    UNKNOWN = "unknown"  # no sibling known, or not comparable


class Divergence(msgspec.Struct, frozen=True):
    """Where a `no_match` request left a chain the worker had: indices and kinds only."""

    kind: DivergenceKind
    first_token_index: int | None = None  # within the prompt
    differing_kinds: tuple[str, ...] = ()


class Verdict(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The attribution of one request. Safe to export: indices, kinds, keyed digests only."""

    label: Label
    owner: Owner
    reason: str
    history: History | None = None
    first_miss_block: int | None = None
    first_miss_token: int | None = None
    first_miss_digest: str | None = None
    extra_key_kinds: tuple[str, ...] = ()
    missed_tokens: int = 0
    eviction_age_ms: int | None = None
    holders: int = 0
    epoch: int | None = None
    stored_seq: int | None = None
    removed_seq: int | None = None
    window_start: WindowStart | None = None
    window_start_ts: float | None = None
    gap_from_seq: int | None = None
    gap_to_seq: int | None = None
    divergence: Divergence | None = None
    kv_cache_group: int | None = None  # hybrid models: the group the facts were read in


class AttributionRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One line of `kvmiss attribute` output: the request's identity and its verdict."""

    request_id: str | None = None
    trace_id: str | None = None
    worker: str | None = None
    lookup_time: float | None = None
    prompt_tokens: int
    cached_tokens: int
    verdict: Verdict
