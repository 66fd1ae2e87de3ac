"""Divergence detail on no_match: the first differing token, or the differing extra-key kinds."""

from __future__ import annotations

import msgspec
from fleet_builders import WorkerFeed

from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.hashing import BlockHasher, external_hash, extras_from_spec
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.schemas.attribution import DivergenceKind, Label, RequestFacts
from kvmiss.schemas.events import BlockStored
from kvmiss.schemas.prompt import ExtraKeysSpec, LoraSpec, MMSpec

B = 16
HASHER = BlockHasher("sha256_cbor", seed="0", block_size=B)
PROMPT = list(range(500, 500 + 3 * B + 1))


def chain(tokens, spec=None) -> list[int]:
    extras = extras_from_spec(spec) if spec else None
    return [external_hash(d) for d in HASHER.hash_request(tokens, extras)]


def event_keys(spec: ExtraKeysSpec, block: int):
    """The untagged per-block extra keys vLLM publishes: lora name, then (mm id, offset)."""
    start = block * B
    keys = [spec.lora.name] if spec.lora else []
    keys += [[m.id, m.offset - start] for m in spec.mm if m.offset < start + B and m.offset + m.length > start]
    return keys or None


def worker_holding(tokens, spec=None, *, detail=True):
    """Worker A stored the full blocks of ``tokens`` at seq 2 (as vLLM publishes them)."""
    index, a = ResidencyIndex(divergence_detail=detail), WorkerFeed("A")
    hashes = chain(tokens, spec)
    full = len(hashes) * B
    event = BlockStored(block_hashes=hashes, parent_block_hash=None, block_size=B,
                        token_ids=msgspec.Raw(msgspec.msgpack.encode(tokens[:full])),
                        lora_name=spec.lora.name if spec and spec.lora else None,
                        extra_keys=[event_keys(spec, k) for k in range(len(hashes))] if spec else None)
    for b in a.batches(range(0, 10), {2: [event]}):
        index.apply(b)
    return index, a


def judge(index, a, tokens, spec=None):
    hashes = chain(tokens, spec)
    cached = next(i for i, (x, y) in enumerate(zip(hashes, chain(PROMPT))) if x != y) * B
    facts = RequestFacts(prompt_tokens=len(tokens), cached_tokens=cached, block_size=B, worker="A",
                         lookup_time=a.ts(8), block_hashes=hashes, token_ids=tokens, extra_keys=spec,
                         extra_key_kinds=spec.kinds() if spec else ())
    return Attributor(index).attribute(facts)


def test_one_changed_token_reports_its_index_within_the_prompt():
    index, a = worker_holding(PROMPT)
    changed = PROMPT.copy()
    changed[B + 5] = 7
    verdict = judge(index, a, changed)
    assert verdict.label is Label.NO_MATCH and verdict.first_miss_block == 1
    assert verdict.divergence.kind is DivergenceKind.TOKENS
    assert verdict.divergence.first_token_index == B + 5


def test_same_tokens_with_another_image_differ_only_in_extra_keys():
    held = ExtraKeysSpec(mm=[MMSpec("image-1", offset=20, length=8)])
    index, a = worker_holding(PROMPT, held)
    verdict = judge(index, a, PROMPT, ExtraKeysSpec(mm=[MMSpec("image-2", offset=20, length=8)]))
    assert verdict.label is Label.NO_MATCH and verdict.first_miss_block == 1
    assert verdict.divergence.kind is DivergenceKind.EXTRA_KEYS
    assert verdict.divergence.differing_kinds == ("mm",)
    assert "image" not in msgspec.json.encode(verdict).decode()


def test_another_adapter_diverges_at_the_root_where_there_is_no_parent_to_compare_under():
    index, a = worker_holding(PROMPT, ExtraKeysSpec(lora=LoraSpec("support-a", "/adapters/a")))
    verdict = judge(index, a, PROMPT, ExtraKeysSpec(lora=LoraSpec("support-b", "/adapters/b")))
    assert verdict.label is Label.NO_MATCH and verdict.first_miss_block == 0
    assert verdict.divergence is None


def test_no_sibling_under_the_parent_means_the_divergence_is_unknown():
    index, a = worker_holding(PROMPT[:B + 1])  # only block 0 was ever stored
    changed = PROMPT.copy()
    changed[B + 1] = 3
    verdict = judge(index, a, changed)
    assert verdict.divergence.kind is DivergenceKind.UNKNOWN


def test_without_divergence_detail_nothing_is_reported_and_nothing_leaks():
    index, a = worker_holding(PROMPT, detail=False)
    changed = PROMPT.copy()
    changed[B + 5] = 7
    verdict = judge(index, a, changed)
    assert verdict.label is Label.NO_MATCH and verdict.divergence is None
    encoded = msgspec.json.encode(verdict).decode()
    assert "507" not in encoded and "[500" not in encoded
