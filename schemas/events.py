"""KV-cache event types: the engines' wire forms and the one normalised model.

Every engine encoding we accept decodes into the three Structs below (`BlockStored`,
`BlockRemoved`, `AllBlocksCleared`) inside an `EventBatch`; nothing downstream sees a
wire variant.

Wire variants handled here (see shared/reference/WIRE.md):
  * vLLM >= 0.24 and SGLang 0.5.23: events are tagged msgpack maps ``{"type": ...}``;
    fields that are None are omitted. These maps decode straight into the normalised
    Structs (fast path).
  * vLLM < 0.24: events are positional arrays ``["BlockStored", ...]``, fields appended
    release by release. Decoded by the ``_Array*`` Structs, then converted (slow path).
  * Batches are ``[ts, events, dp_rank]``; a 2-element batch is accepted too.
  * Hashes arrive as uint64 (vLLM default), signed int64 (SGLang, may be negative) or raw
    digest bytes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``). All are canonicalised to the
    engine's external form, an unsigned 64-bit int (the digest's last 8 bytes, big-endian);
    raw digests are kept in ``block_digests`` when the wire had them.

Unknown extra fields are ignored, missing optional ones defaulted. A payload that cannot
be decoded raises `WireError` whose message says what and where (a msgspec path such as
``$[1][0].block_size``) and never quotes token ids or salts.
"""

from __future__ import annotations

from typing import Annotated, Any, Union, cast

import msgspec

MASK64 = (1 << 64) - 1

# An empty msgpack array: the default for `token_ids` when a publisher omits it.
_EMPTY_TOKENS = msgspec.Raw(b"\x90")

_token_decoder = msgspec.msgpack.Decoder(list[int])


class WireError(ValueError):
    """A KV-event payload or frame that cannot be decoded; the message names the field."""


def canonical_hash(value: int | bytes) -> int:
    """Engine external form of one block hash: uint64 of the digest's last 8 bytes.

    Signed int64 (SGLang) maps to its two's-complement uint64; raw digests keep only their
    last 8 bytes, exactly as vLLM's ``maybe_convert_block_hash`` does.
    """
    if value.__class__ is int:
        return value & MASK64
    if isinstance(value, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(value)[-8:], "big")
    raise WireError(f"block hash must be int or bytes, got {type(value).__name__}")


Uint64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack ints never exceed uint64
_AnyHash = Union[int, bytes]


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", omit_defaults=True):
    """Blocks entered the prefix cache of one medium.

    ``block_hashes`` and ``parent_block_hash`` are canonical uint64 ints (decoding
    canonicalises every wire form; code constructing events must pass canonical values).
    ``token_ids`` stays undecoded msgpack (most consumers never need the values); call
    `tokens()` to get them.
    """

    block_hashes: list[Uint64]
    parent_block_hash: Uint64 | None = None
    token_ids: msgspec.Raw = _EMPTY_TOKENS
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    cache_salt: str | None = None
    # vLLM 0.33 with EAGLE/MTP plus prefix caching: one list per block of these blocks.
    lookahead_token_ids: list[list[int]] | None = None
    # Not on the wire: the raw digests when the publisher sent bytes instead of ints.
    block_digests: list[bytes] | None = None

    def tokens(self) -> list[int]:
        """The concatenated token ids of these blocks (decoded on demand)."""
        try:
            return _token_decoder.decode(self.token_ids)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise WireError(f"BlockStored.token_ids: {exc}") from None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", omit_defaults=True):
    """Blocks left the prefix cache of one medium (vLLM emits one event per hash)."""

    block_hashes: list[Uint64]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None
    block_digests: list[bytes] | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    """The engine reset its prefix cache (not tier-scoped)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class EventBatch(msgspec.Struct, array_like=True):
    """One published batch: every event of one engine step, stamped with one ``ts``.

    ``ts`` is the publisher's wall clock in seconds at publish time. vLLM names the third
    element ``data_parallel_rank``, SGLang ``attn_dp_rank``; both land in ``dp_rank``.
    """

    ts: float
    events: list[KVEvent]
    dp_rank: int | None = None


# --- The slow path. Anything the strict fast path refuses lands here: hashes that are
# negative (SGLang's signed int64) or raw digests, vLLM < 0.24 positional arrays (fields
# only ever appended, so trailing ones default), a batch mixing both, or bad input.


class _LenientBlockStored(BlockStored, tag="BlockStored", tag_field="type"):
    # Wider than the base's on purpose: decoded leniently, canonicalised after (`canonical_hash`).
    block_hashes: list[_AnyHash]  # type: ignore[assignment]
    parent_block_hash: _AnyHash | None = None  # type: ignore[assignment]


class _LenientBlockRemoved(BlockRemoved, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[_AnyHash]  # type: ignore[assignment]  # (as above)


class _ArrayBlockStored(_LenientBlockStored, tag="BlockStored", array_like=True):
    pass


class _ArrayBlockRemoved(_LenientBlockRemoved, tag="BlockRemoved", array_like=True):
    pass


class _ArrayAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    pass


_MapEvent = Union[_LenientBlockStored, _LenientBlockRemoved, AllBlocksCleared]
_ArrayEvent = Union[_ArrayBlockStored, _ArrayBlockRemoved, _ArrayAllBlocksCleared]


class _RawBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    dp_rank: int | None = None


_batch_decoder = msgspec.msgpack.Decoder(EventBatch)
_raw_batch_decoder = msgspec.msgpack.Decoder(_RawBatch)
_map_event_decoder = msgspec.msgpack.Decoder(_MapEvent)
_array_event_decoder = msgspec.msgpack.Decoder(_ArrayEvent)


def _normalised(event: msgspec.Struct) -> KVEvent:
    """The strict model of a lenient or array-form event: hashes canonicalised."""
    if isinstance(event, (AllBlocksCleared, _ArrayAllBlocksCleared)):
        return AllBlocksCleared()
    fields = msgspec.structs.asdict(event)
    hashes = fields["block_hashes"]
    digests = [bytes(h) for h in hashes if not isinstance(h, int)]
    fields["block_hashes"] = [canonical_hash(h) for h in hashes]
    fields["block_digests"] = digests or None
    if isinstance(event, _LenientBlockStored):
        if fields["parent_block_hash"] is not None:
            fields["parent_block_hash"] = canonical_hash(fields["parent_block_hash"])
        return BlockStored(**fields)
    return BlockRemoved(**fields)


def _is_msgpack_array(raw: msgspec.Raw) -> bool:
    view = memoryview(raw)
    first = view[0] if len(view) else 0
    return 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)


def decode_batch(payload: bytes, *, arrays: bool = True) -> EventBatch:
    """Decode one msgpack batch payload of any supported engine version.

    Raises `WireError` naming the failing field (``event 2: Expected `int`, got `str` -
    at `$.block_size```) when the payload is not a valid batch. ``arrays=False`` refuses
    positional-array events (vLLM < 0.24's form) for engines that never sent them
    (collectors/engines: which engine sends which form is its adapter's business).
    """
    # RecursionError: msgpack nested deeper than the interpreter's recursion limit (hostile
    # or corrupt input; no engine nests more than a few levels) cannot even be skipped.
    try:
        return _batch_decoder.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass  # another wire form, or genuinely bad: find out which below
    except RecursionError:
        raise WireError("payload is nested too deeply") from None
    try:
        raw = _raw_batch_decoder.decode(payload)
    except msgspec.ValidationError as exc:  # a subclass of DecodeError: test it first
        raise WireError(f"batch must be [ts, events, dp_rank]: {exc}") from None
    except msgspec.DecodeError as exc:
        raise WireError(f"payload is not msgpack: {exc}") from None
    except RecursionError:
        raise WireError("payload is nested too deeply") from None
    events: list[KVEvent] = []
    for index, raw_event in enumerate(raw.events):
        decoder = _array_event_decoder if _is_msgpack_array(raw_event) else _map_event_decoder
        if not arrays and decoder is _array_event_decoder:
            raise WireError(f"event {index}: a positional array (vLLM < 0.24's form); this engine sends maps")
        try:
            events.append(_normalised(decoder.decode(raw_event)))
        except (msgspec.ValidationError, msgspec.DecodeError, WireError) as exc:
            raise WireError(f"event {index}: {exc}") from None
        except RecursionError:
            raise WireError(f"event {index}: nested too deeply") from None
    return EventBatch(ts=raw.ts, events=events, dp_rank=raw.dp_rank)


def event_to_builtins(event: KVEvent, *, include_raw: bool = False) -> dict[str, Any]:
    """A JSON-ready dict of one normalised event.

    Token ids (lookahead ones too), cache salts and extra keys are prompt material, and a
    session id may name a user: by default only their presence and size are shown
    (``num_tokens``, ``num_lookahead_tokens``, ``has_cache_salt``, ``has_extra_keys``,
    ``has_session_id``); ``include_raw=True`` adds the values.
    Raw extra keys that JSON cannot show (map keys that are nil, bools or arrays) are
    replaced by ``extra_keys_unprintable: true``; msgpack ext values show as code and hex.
    """
    shown = event
    if isinstance(event, BlockStored) and event.extra_keys is not None and not include_raw:
        shown = msgspec.structs.replace(event, extra_keys=None)  # hidden: never rendered
    try:
        out: dict[str, Any] = msgspec.to_builtins(shown, enc_hook=_enc_hook, str_keys=True)
    except (TypeError, RecursionError):
        # Raw extra keys (untyped msgpack) that JSON cannot show: maps keyed by nil, a bool
        # or an array, or nesting at the recursion limit. Flagged instead of shown.
        out = msgspec.to_builtins(msgspec.structs.replace(event, extra_keys=None), enc_hook=_enc_hook)
        out["extra_keys_unprintable"] = True
    if isinstance(event, BlockStored):
        tokens = event.tokens()
        # Always shown: 0 is meaningful (offload connectors' placeholder stores), and the
        # struct omits it as its default.
        out["block_size"] = event.block_size
        out["num_tokens"] = len(tokens)
        out["token_ids"] = tokens if include_raw else None
        if event.cache_salt is not None:
            out["has_cache_salt"] = True
            if not include_raw:
                out["cache_salt"] = None
        if event.extra_keys is not None and not include_raw:
            out["extra_keys"] = None
            out["has_extra_keys"] = True
        if event.lookahead_token_ids is not None and not include_raw:  # token ids too
            out["lookahead_token_ids"] = None
            out["num_lookahead_tokens"] = sum(len(block) for block in event.lookahead_token_ids)
        if event.session_id is not None and not include_raw:  # may name a user's session
            out["session_id"] = None
            out["has_session_id"] = True
        out = {k: v for k, v in out.items() if v is not None}
    if "block_digests" in out:
        out["block_digests"] = [d.hex() for d in event.block_digests]  # type: ignore[union-attr]
    return out


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, msgspec.Raw):
        return None  # token_ids are rendered by event_to_builtins itself
    if isinstance(obj, msgspec.msgpack.Ext):  # inside raw extra keys: no JSON form of its own
        return {"ext_type": obj.code, "data_hex": cast(bytes, obj.data).hex()}  # (bytes when decoded)
    raise NotImplementedError(type(obj))
