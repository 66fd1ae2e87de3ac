"""vLLM prefix-cache block hashes, recomputed outside the engine (vLLM 0.33 semantics).

This module is the only place that knows vLLM's hashing rules. A request's prompt is cut
into full blocks of ``block_size`` tokens; block ``i`` is keyed by::

    digest_i = hash_fn((digest_{i-1} or NONE_HASH, tuple(block_token_ids), extra_keys or None))

``hash_fn`` is one of `sha256` (SHA-256 of a protocol-5 pickle: the vLLM default, Python-only),
`sha256_cbor` (SHA-256 of canonical CBOR), `xxhash` / `xxhash_cbor` (xxh3-128 of the same
preimages). ``NONE_HASH = hash_fn(seed)`` where ``seed`` is the engines' ``PYTHONHASHSEED``
string, or ``"vllm-none-hash"`` for the sha256 variants when it is unset; the xxhash variants
then use a random seed, so their chains can only be recomputed when the seed is known.
vLLM < 0.30 used random bytes for *every* algorithm when ``PYTHONHASHSEED`` was unset: for
those engines always pass the seed. Pickle memoizes repeated objects, so a pickle preimage also
depends on which equal values are one object; keys are built here as vLLM builds them (this
reproduces every vector), but e.g. one image twice in a block may pickle differently.

Extra keys, per block, in this order (``None`` when there are none):

``extra_keys_format="tagged"`` (vLLM 0.31+, checked against vLLM 0.33.0's hash vectors)
    ``("lora", name, path)`` on every block of a LoRA request; ``("mm", identifier,
    offset - block_start)`` for each multimodal item overlapping the block (the offset is
    negative for a block holding an item's tail); ``("cache_salt", salt)`` on block 0 only;
    ``("prompt_embeds", digest)`` with the block's 32-byte prompt-embeddings digest.

``extra_keys_format="untagged"`` (vLLM 0.20-0.30)
    The same entries without tags and without the LoRA path: ``name``, ``(identifier,
    offset - block_start)``, ``salt``, ``digest``. This is also the shape vLLM 0.33 publishes
    in ``BlockStored.extra_keys`` (``to_event_extra_keys``). How this was established:
    docs/HISTORY.md, "Extra keys before 0.31".
    Earlier releases (bare mm identifiers, LoRA int ids) are not supported.

Lookahead (EAGLE/MTP, ``lookahead_tokens = L > 0``): a block is hashed only once the ``L``
tokens after it exist, and its extra keys become ``(E, *token_ids[end:end + L])`` with ``E``
the keys above (possibly None).

Thread contract: a `BlockHasher` is immutable after construction and safe to share between
threads; nothing here keeps module-level state.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from typing import Annotated, Any, Literal, NewType, Optional, get_args

import cbor2
import msgspec
from xxhash import xxh3_128, xxh3_128_digest

from kvmiss.schemas.events import canonical_hash
from kvmiss.schemas.prompt import ExtraKeysSpec

BlockHash = NewType("BlockHash", bytes)
"""A raw block digest: 32 bytes for the sha256 variants, 16 for the xxhash ones."""

HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
ExtraKeysFormat = Literal["tagged", "untagged"]
ExtraKeys = Optional[tuple[Any, ...]]

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL  # 5 on every supported Python, as in vLLM


class HashingError(ValueError):
    """Inputs that cannot give a vLLM-compatible hash; the message names the culprit."""


def sha256(obj: Any) -> bytes:
    """SHA-256 of ``pickle.dumps(obj, protocol=HIGHEST_PROTOCOL)`` (vLLM's default)."""
    return hashlib.sha256(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """SHA-256 of ``cbor2.dumps(obj, canonical=True)``: portable across languages."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def xxhash(obj: Any) -> bytes:
    """xxh3-128 digest (16 bytes) of the protocol-5 pickle of ``obj``."""
    return xxh3_128_digest(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL))


def xxhash_cbor(obj: Any) -> bytes:
    """xxh3-128 digest (16 bytes) of ``cbor2.dumps(obj, canonical=True)``."""
    return xxh3_128_digest(cbor2.dumps(obj, canonical=True))


HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": sha256,
    "sha256_cbor": sha256_cbor,
    "xxhash": xxhash,
    "xxhash_cbor": xxhash_cbor,
}


def external_hash(digest: bytes) -> int:
    """The uint64 form vLLM publishes in KV events: the digest's last 8 bytes, big-endian."""
    return canonical_hash(digest)


@dataclass(frozen=True, slots=True)
class LoraRef:
    """The LoRA adapter of a request. ``path`` is hashed only by tagged (0.31+) keys."""

    name: str
    path: str | None = None


@dataclass(frozen=True, slots=True)
class MMItem:
    """One multimodal item's placeholder span in the prompt, in tokens.

    ``offset`` is the index of its first placeholder token in the prompt, ``length`` the
    number of placeholder tokens. The item overlaps block ``[s, s + B)`` iff
    ``offset < s + B and offset + length > s``; its key carries ``offset - s``.
    """

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class RequestExtras:
    """What besides token ids enters a request's block hashes.

    ``mm_items`` must be sorted by offset and must not overlap (as vLLM assumes).
    ``prompt_embeds_digests[i]`` is block ``i``'s digest of its prompt embeddings; there must
    be one for every hashed block (more are ignored). An empty ``cache_salt`` is no salt,
    as in vLLM.
    """

    lora: LoraRef | None = None
    mm_items: tuple[MMItem, ...] = ()
    cache_salt: str | None = None
    prompt_embeds_digests: tuple[bytes, ...] | None = None

    def __post_init__(self) -> None:
        end = 0
        for i, item in enumerate(self.mm_items):
            if item.offset < 0 or item.length <= 0:
                raise HashingError(f"mm_items[{i}]: offset must be >= 0 and length > 0")
            if item.offset < end:
                raise HashingError(f"mm_items[{i}]: items must be sorted by offset and not overlap")
            end = item.offset + item.length
        for i, digest in enumerate(self.prompt_embeds_digests or ()):
            if not isinstance(digest, bytes):
                raise HashingError(f"prompt_embeds_digests[{i}] must be bytes")


_NO_EXTRAS = RequestExtras()


def extras_from_spec(spec: ExtraKeysSpec) -> RequestExtras:
    """The hashing inputs of a prompt spec (schemas/prompt.py); raises `HashingError`
    naming the field when a value cannot be hashed."""
    digests: tuple[bytes, ...] | None = None
    if spec.prompt_embeds_block_digests is not None:
        found: list[bytes] = []
        for i, text in enumerate(spec.prompt_embeds_block_digests):
            try:
                found.append(bytes.fromhex(text))
            except ValueError:
                raise HashingError(f"not hex - at `$.prompt_embeds_block_digests[{i}]`") from None
        digests = tuple(found)
    try:
        return _extras(spec, digests)
    except HashingError as exc:  # only the mm spans can be wrong here
        raise HashingError(f"{exc} - at `$.mm`") from None


def _extras(spec: ExtraKeysSpec, digests: tuple[bytes, ...] | None) -> RequestExtras:
    return RequestExtras(
        lora=None if spec.lora is None else LoraRef(spec.lora.name, spec.lora.path),
        mm_items=tuple(MMItem(m.id, m.offset, m.length) for m in spec.mm),
        cache_salt=spec.cache_salt,
        prompt_embeds_digests=digests,
    )


# --- CBOR preimages, assembled from parts ---------------------------------------------------
# A block's preimage is a CBOR array of 3: the parent digest (byte string), the token ids (array
# of uints) and the extra keys (null or array). Canonical CBOR of an array is its head followed
# by each item's canonical encoding, so the preimage is joined from: a fixed head, the parent,
# the token-array head (fixed by the block size), the token items, and the extra keys (null,
# or cbor2's encoding). The token items of all blocks come from ONE cbor2 call over the whole
# request with a sentinel byte string before each block; splitting on the sentinel's encoding
# cuts the output into blocks. Its five 0xff bytes cannot occur inside the encoding of uints
# below 2**32 (no head byte is 0xff and at most four payload bytes follow one), so the split is
# exact; larger ids show up as extra parts and the request is then encoded block by block.

_SENTINEL = b"\xff" * 5
_SENTINEL_CBOR = cbor2.dumps(_SENTINEL)
_CBOR_NULL = b"\xf6"


def _cbor_head(major: int, n: int) -> bytes:
    """CBOR initial byte(s) for major type ``major`` with argument ``n`` (shortest form)."""
    if n < 24:
        return bytes((major << 5 | n,))
    for info, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * width):
            return bytes((major << 5 | info,)) + n.to_bytes(width, "big")
    raise HashingError(f"{n} does not fit a CBOR argument (64 bits)")


_TOKEN_IDS = list[Annotated[int, msgspec.Meta(ge=0)]]


def _as_tokens(token_ids: Sequence[int]) -> list[int]:
    """Token ids as a list of ints (C-speed check: no bools, floats, strings or negatives)."""
    if not isinstance(token_ids, (list, tuple)):
        token_ids = list(token_ids)
    try:
        return msgspec.convert(token_ids, _TOKEN_IDS)
    except msgspec.ValidationError as exc:
        raise HashingError(f"token_ids must be non-negative ints: {exc}") from None


class BlockHasher:
    """Computes one engine configuration's block-hash chains; build once, reuse.

    ``algo`` and ``seed`` are the engines' ``--prefix-caching-hash-algo`` and
    ``PYTHONHASHSEED`` (None when unset); ``block_size`` is in tokens; ``lookahead_tokens``
    is vLLM's ``num_hash_lookahead_tokens`` (0 unless speculative decoding needs it).
    Raises `HashingError` for a configuration whose hashes cannot be reproduced.
    """

    __slots__ = ("algo", "seed", "block_size", "extra_keys_format", "lookahead_tokens",
                 "none_hash", "_new", "_cbor", "_parent_head", "_tokens_head")

    def __init__(
        self,
        algo: HashAlgo,
        *,
        seed: str | None,
        block_size: int,
        extra_keys_format: ExtraKeysFormat = "tagged",
        lookahead_tokens: int = 0,
    ) -> None:
        if algo not in HASH_FUNCTIONS:
            raise HashingError(f"unknown hash algorithm {algo!r}; one of {sorted(HASH_FUNCTIONS)}")
        if seed is None and algo.startswith("xxhash"):
            raise HashingError(
                f"{algo}: without PYTHONHASHSEED vLLM seeds NONE_HASH randomly, so its hashes "
                "cannot be recomputed; pass the engines' PYTHONHASHSEED as seed"
            )
        if seed is not None and not isinstance(seed, str):
            raise HashingError("seed must be the PYTHONHASHSEED string (or None)")
        if not isinstance(block_size, int) or block_size <= 0:
            raise HashingError(f"block_size must be a positive int, got {block_size!r}")
        if extra_keys_format not in get_args(ExtraKeysFormat):
            raise HashingError(
                f"extra_keys_format must be 'tagged' or 'untagged', got {extra_keys_format!r}"
            )
        if not isinstance(lookahead_tokens, int) or lookahead_tokens < 0:
            raise HashingError(f"lookahead_tokens must be an int >= 0, got {lookahead_tokens!r}")
        self.algo = algo
        self.seed = seed
        self.block_size = block_size
        self.extra_keys_format = extra_keys_format
        self.lookahead_tokens = lookahead_tokens
        self._cbor = algo.endswith("_cbor")
        # A hash-object constructor (then .digest()): the one hash call per block.
        self._new: Callable[[bytes], Any] = (
            xxh3_128 if algo.startswith("xxhash") else hashlib.sha256
        )
        seed_string = DEFAULT_NONE_HASH_SEED if seed is None else seed
        self.none_hash = BlockHash(HASH_FUNCTIONS[algo](seed_string))
        # Every parent in a chain is a digest of this length: its header never changes.
        self._parent_head = b"\x83" + _cbor_head(2, len(self.none_hash))
        self._tokens_head = _cbor_head(4, block_size)

    def __repr__(self) -> str:
        return (
            f"BlockHasher({self.algo!r}, seed={self.seed!r}, block_size={self.block_size}, "
            f"extra_keys_format={self.extra_keys_format!r}, "
            f"lookahead_tokens={self.lookahead_tokens})"
        )

    def num_hashed_blocks(self, num_tokens: int) -> int:
        """Blocks of a ``num_tokens`` sequence that have a hash (full, lookahead available)."""
        return max(0, (num_tokens - self.lookahead_tokens) // self.block_size)

    def block_extra_keys(
        self, token_ids: Sequence[int], extras: RequestExtras | None = None
    ) -> list[ExtraKeys]:
        """The extra keys hashed into each hashed block, in the configured format."""
        extras = extras or _NO_EXTRAS
        tagged = self.extra_keys_format == "tagged"
        size = self.block_size
        num_blocks = self.num_hashed_blocks(len(token_ids))
        lora = extras.lora
        if lora is not None and tagged and lora.path is None:
            raise HashingError("lora.path is required: tagged keys (vLLM 0.31+) hash the LoRA path")
        lora_key = None if lora is None else ("lora", lora.name, lora.path) if tagged else lora.name
        digests = extras.prompt_embeds_digests
        if digests is not None and len(digests) < num_blocks:
            raise HashingError(
                f"prompt_embeds_digests has {len(digests)} entries for {num_blocks} hashed blocks"
            )
        items = extras.mm_items
        first = 0  # first mm item not wholly before the current block (items are sorted)
        keys: list[ExtraKeys] = []
        for index in range(num_blocks):
            start, end = index * size, (index + 1) * size
            block: list[Any] = [] if lora_key is None else [lora_key]
            while first < len(items) and items[first].offset + items[first].length <= start:
                first += 1
            for item in items[first:]:
                if item.offset >= end:
                    break
                rel = item.offset - start
                block.append(("mm", item.identifier, rel) if tagged else (item.identifier, rel))
            if index == 0 and extras.cache_salt:
                block.append(("cache_salt", extras.cache_salt) if tagged else extras.cache_salt)
            if digests is not None:
                block.append(("prompt_embeds", digests[index]) if tagged else digests[index])
            base = tuple(block) or None
            if self.lookahead_tokens:
                keys.append((base, *token_ids[end:end + self.lookahead_tokens]))
            else:
                keys.append(base)
        return keys

    def preimage(
        self, parent: bytes | None, block_token_ids: Sequence[int], extra_keys: ExtraKeys
    ) -> bytes:
        """The exact bytes hashed for one block (``parent`` None or empty means NONE_HASH)."""
        parent = bytes(parent) if parent else self.none_hash
        obj = (parent, tuple(_as_tokens(block_token_ids)), extra_keys)
        if self._cbor:
            return cbor2.dumps(obj, canonical=True)
        return pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)

    def hash_block(
        self, parent: bytes | None, block_token_ids: Sequence[int], extra_keys: ExtraKeys
    ) -> BlockHash:
        """One block's digest; ``parent`` is the previous block's digest (None for block 0)."""
        return BlockHash(self._new(self.preimage(parent, block_token_ids, extra_keys)).digest())

    def hash_request(
        self, token_ids: Sequence[int], extras: RequestExtras | None = None
    ) -> list[BlockHash]:
        """Digests of every hashed block of a request, in order (partial blocks have none)."""
        return self._chain(token_ids, extras, None)

    def request_preimages(
        self, token_ids: Sequence[int], extras: RequestExtras | None = None
    ) -> list[bytes]:
        """The bytes `hash_request` hashes for each block: to explain a hash that differs."""
        preimages: list[bytes] = []
        self._chain(token_ids, extras, preimages)
        return preimages

    def _chain(
        self, token_ids: Sequence[int], extras: RequestExtras | None, sink: list[bytes] | None
    ) -> list[BlockHash]:
        """The hot path: per block, one join and one hash call; ``sink`` gets the preimages."""
        tokens = _as_tokens(token_ids)
        num_blocks = self.num_hashed_blocks(len(tokens))
        if extras is None and not self.lookahead_tokens:
            keys: Sequence[ExtraKeys] = (None,) * num_blocks
        else:
            keys = self.block_extra_keys(tokens, extras)
        new, parent, join = self._new, self.none_hash, b"".join
        out: list[BlockHash] = []
        if self._cbor:
            head, array_head = self._parent_head, self._tokens_head
            tails = [_CBOR_NULL if k is None else cbor2.dumps(k, canonical=True) for k in keys]
            for items, tail in zip(self._cbor_token_items(tokens, num_blocks), tails):
                preimage = join((head, parent, array_head, items, tail))
                parent = new(preimage).digest()
                out.append(parent)
                if sink is not None:
                    sink.append(preimage)
            return out
        size = self.block_size
        for index, extra in enumerate(keys):
            block = tuple(tokens[index * size:(index + 1) * size])
            preimage = pickle.dumps((parent, block, extra), _PICKLE_PROTOCOL)
            parent = new(preimage).digest()
            out.append(parent)
            if sink is not None:
                sink.append(preimage)
        return out

    def _cbor_token_items(self, tokens: list[int], count: int) -> list[bytes]:
        """The CBOR items (no array header) of the first ``count`` blocks' token ids."""
        size = self.block_size
        if count == 0:  # else `[iter(tokens)] * size` costs memory in the block size (2**31: OOM)
            return []
        # (sentinel, t0 .. t[size-1]) per block, flattened; zip over one iterator cuts blocks.
        flat = list(chain.from_iterable(zip(repeat(_SENTINEL, count), *[iter(tokens)] * size)))
        parts = cbor2.dumps(flat).split(_SENTINEL_CBOR)[1:]  # [0] is the outer array header
        if len(parts) == count:
            return parts
        # An id >= 2**32 held the sentinel's bytes: encode block by block, dropping the header.
        skip = len(self._tokens_head)
        return [cbor2.dumps(tokens[i * size:(i + 1) * size])[skip:] for i in range(count)]
