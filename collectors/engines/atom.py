"""AMD's ATOM (native engine, ``atom/distributed/kv_events.py``; docs/ENGINES.md).

vLLM's frames from ATOM #1316/#2203 on: ``[topic, seq, payload]`` with a counter from 0, a
replay reply without a topic frame and an end marker whose payload is the buffered window
(`parse_replay` reads both). Earlier ATOM sent one frame, or ``[topic, payload]``, with no
sequence number: refused by name, since a gap could not be seen. Events are positional arrays
(msgspec ``array_like``, every field written), laid out as vLLM's up to
``kv_cache_spec_sliding_window``, then ATOM's ``token_offset``. Hashes are chained xxh64
digests (uint64). Under decode context parallelism one hash covers ``block_size`` times the
DCP size tokens, so a store's block size is read from its token count.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from kvmiss.collectors.engines.base import CPU, EXTERNAL, GPU, STORAGE, EngineAdapter, FrameLayout
from kvmiss.collectors.frames import BatchMessage, FrameError, parse_live, parse_replay
from kvmiss.schemas.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    WireError,
    canonical_hash,
    decode_batch,
)

_EMPTY_TOKENS = msgspec.Raw(b"\x90")


class _Stored(msgspec.Struct, tag="BlockStored", array_like=True):
    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: msgspec.Raw = _EMPTY_TOKENS
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    token_offset: int | None = None  # ATOM's own, trailing (#1316); later fields are ignored


class _Removed(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    medium: str | None = None  # set: one medium cleared, which kvmiss's clear cannot say


class _Transferred(msgspec.Struct, tag="BlockTransferred", array_like=True):
    block_hashes: list[int]
    from_medium: str | None = None
    to_medium: str | None = None


_event = msgspec.msgpack.Decoder(Union[_Stored, _Removed, _Cleared, _Transferred])
_tokens = msgspec.msgpack.Decoder(list[int])


class _RawBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_batch = msgspec.msgpack.Decoder(_RawBatch)


def _live(frames: list[bytes]) -> BatchMessage | FrameError:
    """vLLM's live layout; ATOM before #1316/#2203 named, since it had no sequence frame."""
    if len(frames) in (1, 2):
        return FrameError(f"live message has {len(frames)} frame(s) and no sequence number: ATOM "
                          "before #2203 (one frame, or [topic, payload]); kvmiss needs [topic, seq, payload]")
    return parse_live(frames)


class ATOMAdapter(EngineAdapter):
    """ATOM's KV-event wire (``engine = "atom"``)."""

    frames = FrameLayout(_live, parse_replay)
    first_seq = 0  # `itertools.count()`, wrapping below 2^64 - 1 (kept for the end marker)
    # Its media: GPU (the default of every event), CPU and DISK tiers, REMOTE for blocks a
    # disaggregated decode side received (read as EXTERNAL, like SGLang's).
    media = {None: GPU, "GPU": GPU, "CPU": CPU, "DISK": STORAGE, "REMOTE": EXTERNAL}
    scan = None  # the compiled reader reads maps; ATOM sends arrays
    token_hashing = ("ATOM hashes blocks with chained xxh64, not the [engine] algorithm; "
                     "the router must put the engine's wire hashes in kvmiss.block_hashes")

    def decode(self, payload: bytes) -> EventBatch:
        try:
            raw = _batch.decode(payload)
        except msgspec.ValidationError as exc:  # (a DecodeError: tested first)
            raise WireError(f"batch must be [ts, events, data_parallel_rank]: {exc}") from None
        except msgspec.DecodeError as exc:
            raise WireError(f"payload is not msgpack: {exc}") from None
        except RecursionError:
            raise WireError("payload is nested too deeply") from None
        if raw.events and not all(_is_array(e) for e in raw.events):
            return decode_batch(payload, arrays=False)  # a map-form batch, as vLLM >= 0.24 sends
        events = [_converted(e, index) for index, e in enumerate(raw.events)]
        return EventBatch(ts=raw.ts, events=events, dp_rank=raw.data_parallel_rank)


def _is_array(raw: msgspec.Raw) -> bool:
    first = memoryview(raw)[0] if len(raw) else 0
    return 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)


def _converted(raw: msgspec.Raw, index: int) -> KVEvent:
    """One ATOM event as kvmiss's model; WireError naming the event and field otherwise."""
    try:
        event = _event.decode(raw)
        if isinstance(event, _Stored):
            tokens = _tokens.decode(event.token_ids)
            return BlockStored(
                block_hashes=[canonical_hash(h) for h in event.block_hashes],
                parent_block_hash=None if event.parent_block_hash is None else canonical_hash(event.parent_block_hash),
                token_ids=event.token_ids, block_size=_hash_block_size(event, len(tokens)),
                lora_id=event.lora_id, medium=event.medium, lora_name=event.lora_name,
                extra_keys=event.extra_keys, group_idx=event.group_idx,
                kv_cache_spec_kind=event.kv_cache_spec_kind,
                kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window)
        if isinstance(event, _Removed):
            return BlockRemoved(block_hashes=[canonical_hash(h) for h in event.block_hashes],
                                medium=event.medium, group_idx=event.group_idx)
        if isinstance(event, _Cleared):
            if event.medium is not None:
                raise WireError(f"AllBlocksCleared.medium is {event.medium!r}: a clear of one medium, "
                                "which kvmiss cannot apply without clearing every medium")
            return AllBlocksCleared()
        raise WireError(f"BlockTransferred ({event.from_medium} -> {event.to_medium}): ATOM's tier "
                        "move, whose effect on the source tier kvmiss does not guess")
    except (msgspec.ValidationError, msgspec.DecodeError, WireError) as exc:
        raise WireError(f"event {index}: {exc}") from None
    except RecursionError:
        raise WireError(f"event {index}: nested too deeply") from None


def _hash_block_size(event: _Stored, num_tokens: int) -> int:
    """Tokens per hash: the wire's block size, or its multiple the token count shows (DCP)."""
    hashes = len(event.block_hashes)
    if hashes and num_tokens and num_tokens % hashes == 0:
        per_hash = num_tokens // hashes
        if event.block_size > 0 and per_hash != event.block_size and per_hash % event.block_size == 0:
            return per_hash
    return event.block_size
