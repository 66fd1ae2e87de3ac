"""Span attribute names: what kvmiss reads (configurable) and writes (fixed).

See shared/spec/SPANS.md. Inputs are lists of alternatives, tried in order (the first
attribute present wins); users map their own router's names onto them in the config file
(``[attributes]`` table) without code. Output names are flat: none is a prefix of another,
because trace stores that nest dotted keys would collide.
"""

from __future__ import annotations

import msgspec


class InputNames(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where each request fact is read from. Every field is a list of attribute names."""

    request_id: list[str] = msgspec.field(default_factory=lambda: ["gen_ai.request.id"])
    prompt_tokens: list[str] = msgspec.field(
        default_factory=lambda: ["gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens"])
    cached_tokens: list[str] = msgspec.field(
        default_factory=lambda: ["gen_ai.usage.cache_read.input_tokens", "kvmiss.cached_tokens"])
    block_size: list[str] = msgspec.field(default_factory=lambda: ["kvmiss.block_size"])
    worker: list[str] = msgspec.field(default_factory=lambda: ["kvmiss.route.worker"])
    dp_rank: list[str] = msgspec.field(default_factory=lambda: ["kvmiss.route.dp_rank"])
    route_policy: list[str] = msgspec.field(default_factory=lambda: ["kvmiss.route.policy"])
    # The workers the router could choose from for this request (its candidate set, worker ids
    # as `worker`): the fleet at the lookup, settled by the router itself (docs/FLEET.md).
    route_candidates: list[str] = msgspec.field(default_factory=lambda: ["kvmiss.route.candidates"])
    predicted_cached_tokens: list[str] = msgspec.field(
        default_factory=lambda: ["kvmiss.route.predicted_cached_tokens"])
    instance: list[str] = msgspec.field(default_factory=lambda: ["service.instance.id"])
    # Read from the span's *resource* when no span attribute names the worker (the kvmiss
    # vLLM plugin's spans: OTEL_RESOURCE_ATTRIBUTES=kvmiss.worker=<id>).
    resource_worker: list[str] = msgspec.field(default_factory=lambda: ["kvmiss.worker"])
    block_hashes: list[str] = msgspec.field(default_factory=lambda: ["kvmiss.block_hashes"])
    token_ids: list[str] = msgspec.field(default_factory=lambda: ["kvmiss.token_ids"])
    extra_keys: list[str] = msgspec.field(default_factory=lambda: ["kvmiss.extra_keys"])
    extra_key_kinds: list[str] = msgspec.field(default_factory=lambda: ["kvmiss.extra_key_kinds"])
    lookup_time_unix_nano: list[str] = msgspec.field(
        default_factory=lambda: ["kvmiss.lookup_time_unix_nano"])
    time_in_queue_s: list[str] = msgspec.field(
        default_factory=lambda: ["gen_ai.latency.time_in_queue"])
    # vLLM's `llm_request` beside its time in queue: the span starts when the API server took
    # the request, before the engine core queued it, so start + time in queue is only the
    # earliest the lookup can have been; the latest is start + time to first token - prefill
    # time (the engine's first token came after its lookup by the prefill time, and reached
    # the API server no earlier).
    time_to_first_token_s: list[str] = msgspec.field(
        default_factory=lambda: ["gen_ai.latency.time_to_first_token"])
    prefill_time_s: list[str] = msgspec.field(
        default_factory=lambda: ["gen_ai.latency.time_in_model_prefill"])
    # For what-if sizing only (`kvmiss whatif`), never for a verdict: the tokens the request
    # generated (vLLM's `llm_request` carries the older name; the GenAI conventions the newer).
    output_tokens: list[str] = msgspec.field(
        default_factory=lambda: ["gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens"])
    # vLLM's per-request `kv_cache_report_mode` ("full": the engine re-announces the chain the
    # request reused); set by the router that sets `vllm_xargs`, or the kvmiss vLLM plugin.
    kv_cache_report_mode: list[str] = msgspec.field(default_factory=lambda: ["kvmiss.kv_cache_report_mode"])
    # vLLM's per-request `skip_reading_prefix_cache` (a bool; prompt logprobs set it): false
    # proves the request read the prefix cache even when it hit nothing, so the engine's hit
    # rule applies to it; set by the kvmiss vLLM plugin, or a router that knows its requests.
    skip_reading_prefix_cache: list[str] = msgspec.field(
        default_factory=lambda: ["kvmiss.skip_reading_prefix_cache"])
    # A full-report request's lookups before the one that admitted it (vLLM looks a waiting
    # request up again each step until its blocks fit, and each lookup that hit re-announced
    # what it hit): their times (unix nanoseconds, engine clock) and the cached tokens each
    # found, index for index; set by the kvmiss vLLM plugin.
    earlier_lookup_times_unix_nano: list[str] = msgspec.field(
        default_factory=lambda: ["kvmiss.earlier_lookup_times_unix_nano"])
    earlier_lookup_cached_tokens: list[str] = msgspec.field(
        default_factory=lambda: ["kvmiss.earlier_lookup_cached_tokens"])
    transfer_result: list[str] = msgspec.field(default_factory=lambda: ["kvmiss.transfer.result"])
    transfer_source: list[str] = msgspec.field(default_factory=lambda: ["kvmiss.transfer.source"])
    # Prompt tokens the engine computed (and wrote to the cache): the GenAI conventions' cache
    # write count, under its current name and the one it replaced (``cache_creation``).
    recomputed_tokens: list[str] = msgspec.field(
        default_factory=lambda: ["kvmiss.recomputed_tokens", "gen_ai.usage.cache_write.input_tokens",
                                 "gen_ai.usage.cache_creation.input_tokens"])
    tenant_policy: list[str] = msgspec.field(default_factory=lambda: ["kvmiss.tenant_policy"])
    adapter: list[str] = msgspec.field(default_factory=lambda: ["kvmiss.adapter"])
    model_revision: list[str] = msgspec.field(default_factory=lambda: ["kvmiss.model_revision"])
    template_version: list[str] = msgspec.field(
        default_factory=lambda: ["kvmiss.template_version"])


# The span the kvmiss vLLM plugin (enricher/service/vllm_plugin.py) emits for each prefix-cache
# lookup. Its request id is the engine's (vLLM appends "-<8 chars>" to the API id).
PREFIX_LOOKUP_SPAN = "kvmiss.prefix_lookup"

# Raw prompt material: hashed or read, then removed from every exported span.
RAW_INPUTS = ("kvmiss.token_ids", "kvmiss.extra_keys")
# Removed by default too (high cardinality, engine-internal); `export.keep_block_hashes` keeps it.
BLOCK_HASHES = "kvmiss.block_hashes"

# Outputs (SPANS.md), written with upsert semantics on the span carrying the cache outcome.
LABEL = "kvmiss.label"
OWNER = "kvmiss.owner"
REASON = "kvmiss.reason"
HISTORY = "kvmiss.history"
FIRST_MISS_BLOCK = "kvmiss.first_miss_block"
FIRST_MISS_DIGEST = "kvmiss.first_miss_digest"
EXTRA_KEY_KINDS = "kvmiss.extra_key_kinds"
MISSED_TOKENS = "kvmiss.missed_tokens"
EVICTION_AGE_MS = "kvmiss.eviction_age_ms"
HOLDERS = "kvmiss.holders"
# Developer additions under the same flat rule.
EPOCH = "kvmiss.epoch"
STORED_SEQ = "kvmiss.stored_seq"
REMOVED_SEQ = "kvmiss.removed_seq"
GAP_FROM_SEQ = "kvmiss.gap_from_seq"
GAP_TO_SEQ = "kvmiss.gap_to_seq"
WINDOW_START = "kvmiss.window_start"
WINDOW_SECONDS = "kvmiss.window_seconds"
DIVERGENCE_KIND = "kvmiss.divergence_kind"
DIVERGENCE_TOKEN = "kvmiss.divergence_token"
# Hybrid models: the KV-cache group the facts were read in (the one that limited the hit).
KV_CACHE_GROUP = "kvmiss.kv_cache_group"
# What-if estimates on `evicted` misses (enricher/estimates/whatif.py): never part of the label.
WHATIF_SCALE = "kvmiss.whatif.scale"
WHATIF_REUSE_DISTANCE = "kvmiss.whatif.reuse_distance_blocks"

OUTPUTS = (
    LABEL, OWNER, REASON, HISTORY, FIRST_MISS_BLOCK, FIRST_MISS_DIGEST, EXTRA_KEY_KINDS,
    MISSED_TOKENS, EVICTION_AGE_MS, HOLDERS, EPOCH, STORED_SEQ, REMOVED_SEQ, GAP_FROM_SEQ,
    GAP_TO_SEQ, WINDOW_START, WINDOW_SECONDS, DIVERGENCE_KIND, DIVERGENCE_TOKEN,
    WHATIF_SCALE, WHATIF_REUSE_DISTANCE, KV_CACHE_GROUP,
)
