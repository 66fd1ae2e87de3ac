"""A prompt as kvmiss is given it to hash: token ids plus what else enters vLLM's block
hashes. One definition shared by `kvmiss hash`, `kvmiss compare` and the opt-in
``kvmiss.extra_keys`` span attribute (whose JSON is an `ExtraKeysSpec`).

``mm`` items are multimodal placeholder spans: ``offset`` is the prompt index of the first
placeholder token, ``length`` the number of tokens; sorted by offset, not overlapping.
``prompt_embeds_block_digests`` holds one hex digest per full block. These values are
prompt material: they are hashed, compared or digested, never printed.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(gt=0)]
HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]


class LoraSpec(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    path: str | None = None  # hashed by vLLM >= 0.31 (tagged extra keys)


class MMSpec(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    offset: NonNegative
    length: Positive


class ExtraKeysSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    lora: LoraSpec | None = None
    cache_salt: str | None = None
    mm: list[MMSpec] = []
    prompt_embeds_block_digests: list[str] | None = None

    def kinds(self) -> tuple[str, ...]:
        """The extra-key kinds present, in vLLM's order (names only: safe to export)."""
        present = (("lora", self.lora), ("mm", self.mm), ("cache_salt", self.cache_salt),
                   ("prompt_embeds", self.prompt_embeds_block_digests))
        return tuple(kind for kind, value in present if value)


class HashRequest(ExtraKeysSpec, forbid_unknown_fields=True, kw_only=True):
    """One request to hash like a vLLM engine configured with ``algo``/``seed``/``block_size``."""

    algo: HashAlgo
    block_size: Positive
    token_ids: list[NonNegative]
    seed: str | None = None
    extra_keys_format: Literal["tagged", "untagged"] = "tagged"
    lookahead_tokens: NonNegative = 0
