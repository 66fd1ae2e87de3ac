"""Prefix comparison: where do two renderings of a prompt stop sharing cache blocks, and why?

For application CI (`kvmiss compare`): hash a reference and a candidate exactly as the engine
would, find the first block whose hash differs, and say whether the tokens diverged (the
first differing token index) or only the extra keys (which kinds differ, each side's value
as a keyed digest). Only indices, kinds and digests leave this module; token values are
shown only through `snippet`, an explicit opt-in.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import msgspec

from kvmiss.enricher.core.hashing import BlockHasher, extras_from_spec
from kvmiss.schemas.prompt import HashRequest


class Result(str, enum.Enum):
    IDENTICAL_CHAIN = "identical_chain"  # the same full blocks, as many on both sides
    CANDIDATE_IS_PREFIX = "candidate_is_prefix"  # every candidate block is the reference's; it has fewer
    REFERENCE_IS_PREFIX = "reference_is_prefix"  # the candidate extends the reference
    SHORTER_THAN_ONE_BLOCK = "shorter_than_one_block"  # a side has no full block: nothing to share
    DIVERGED = "diverged"


# The engine settings both sides must be hashed with; a difference is an input error, not a
# divergence (the same prompt under another block size is another chain by construction).
SETTINGS = ("algo", "block_size", "seed", "extra_keys_format", "lookahead_tokens")


class SettingsMismatch(ValueError):
    """The two prompts were described with different engine settings; names the setting."""


class Comparison(msgspec.Struct, kw_only=True):
    """Every key is always present (None or empty where it does not apply), so a CI script
    can read any of them without checking first."""

    result: Result
    shared_blocks: int
    shared_tokens: int
    block_size: int
    reference_blocks: int
    candidate_blocks: int
    first_differing_block: int | None = None
    first_differing_token: int | None = None  # None when only extra keys differ
    cause: str | None = None  # "tokens" | "extra_keys" when diverged
    differing_kinds: tuple[str, ...] = ()
    digests: dict[str, dict[str, str | None]] = {}  # kind -> {"reference": d, "candidate": d}


def check_settings(reference: HashRequest, candidate: HashRequest) -> None:
    """Raise `SettingsMismatch` naming the first engine setting the two sides disagree on."""
    for name in SETTINGS:
        ref, cand = getattr(reference, name), getattr(candidate, name)
        if ref != cand:
            raise SettingsMismatch(
                f"{name} differs: reference {ref!r}, candidate {cand!r} (both prompts must be "
                "described with the engine's settings; compare renderings, not engines)")


def _first_token_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _block_extra_values(req: HashRequest, block: int, block_size: int) -> dict[str, object]:
    """What each extra-key kind contributes to one block's hash (values, never exported)."""
    start, end = block * block_size, (block + 1) * block_size
    digests = req.prompt_embeds_block_digests or []
    return {
        "lora": (req.lora.name, req.lora.path) if req.lora else None,
        "cache_salt": req.cache_salt if block == 0 and req.cache_salt else None,
        "mm": tuple((m.id, m.offset - start) for m in req.mm
                    if m.offset < end and m.offset + m.length > start),
        "prompt_embeds": digests[block] if block < len(digests) else None,
    }


def compare(reference: HashRequest, candidate: HashRequest, *,
            digest: Callable[[str], str]) -> Comparison:
    """Compare two prompts hashed with one engine's settings (`SettingsMismatch` when the
    two sides name different ones).

    ``digest`` maps a kind's value (as text) to a keyed digest; it is how differing salts
    or adapters are reported without showing them.
    """
    check_settings(reference, candidate)
    hasher = BlockHasher(reference.algo, seed=reference.seed, block_size=reference.block_size,
                         extra_keys_format=reference.extra_keys_format,
                         lookahead_tokens=reference.lookahead_tokens)
    ref_chain = hasher.hash_request(reference.token_ids, extras_from_spec(reference))
    cand_chain = hasher.hash_request(candidate.token_ids, extras_from_spec(candidate))
    b = hasher.block_size
    shared = 0
    for x, y in zip(ref_chain, cand_chain):
        if x != y:
            break
        shared += 1
    common: dict[str, Any] = dict(block_size=b, reference_blocks=len(ref_chain), candidate_blocks=len(cand_chain))
    if not ref_chain or not cand_chain:
        return Comparison(result=Result.SHORTER_THAN_ONE_BLOCK, shared_blocks=0, shared_tokens=0,
                          **common)
    if shared == min(len(ref_chain), len(cand_chain)):
        if len(ref_chain) == len(cand_chain):
            result = Result.IDENTICAL_CHAIN
        elif shared == len(cand_chain):
            result = Result.CANDIDATE_IS_PREFIX
        else:
            result = Result.REFERENCE_IS_PREFIX
        return Comparison(result=result, shared_blocks=shared, shared_tokens=shared * b, **common)
    token_index = _first_token_difference(reference.token_ids, candidate.token_ids)
    if token_index is not None and token_index < (shared + 1) * b:
        return Comparison(result=Result.DIVERGED, shared_blocks=shared, shared_tokens=shared * b,
                          first_differing_block=shared, first_differing_token=token_index,
                          cause="tokens", **common)
    ref_values = _block_extra_values(reference, shared, b)
    cand_values = _block_extra_values(candidate, shared, b)
    kinds = tuple(k for k in ref_values if ref_values[k] != cand_values[k])
    digests = {
        k: {"reference": None if not ref_values[k] else digest(repr(ref_values[k])),
            "candidate": None if not cand_values[k] else digest(repr(cand_values[k]))}
        for k in kinds
    }
    return Comparison(result=Result.DIVERGED, shared_blocks=shared, shared_tokens=shared * b,
                      first_differing_block=shared, cause="extra_keys", differing_kinds=kinds,
                      digests=digests, **common)


def snippet(reference: HashRequest, candidate: HashRequest, around: int, width: int = 8) -> dict[str, Any]:
    """Token ids around a divergence (opt-in debugging only: this is prompt material)."""
    lo = max(0, around - width)
    return {"from_token": lo,
            "reference": reference.token_ids[lo:around + width],
            "candidate": candidate.token_ids[lo:around + width]}
