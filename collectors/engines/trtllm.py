"""TensorRT-LLM (KV cache manager V2, streaming publisher; docs/ENGINES.md).

vLLM's frames and replay (a replay reply carries its topic, as vLLM >= 0.26), a fresh
counter from 0 per rank's publisher, the batch ``[ts, events, data_parallel_rank]``. Events
are tagged maps only. A block hash is the first 8 bytes of the block's SHA-256 radix key read
as a *signed* int64 (often negative); its canonical form is the same 8 bytes as a uint64.
Consecutive stores of one chain arrive as one ``BlockStored``, and the removals of one step
as one ``BlockRemoved`` with many hashes. kvmiss cannot compute these hashes from token ids.
"""

from __future__ import annotations

import msgspec

from kvmiss.collectors.engines.base import GPU, EngineAdapter
from kvmiss.schemas.events import BlockStored, EventBatch, WireError, decode_batch

_EMPTY_TOKENS = msgspec.Raw(b"\x90")
_int_tokens = msgspec.msgpack.Decoder(list[int])
_any_tokens = msgspec.msgpack.Decoder(list[int | str])


class TensorRTLLMAdapter(EngineAdapter):
    """TensorRT-LLM's KV-event wire (``engine = "trtllm"``)."""

    first_seq = 0  # `ZmqEventPublisher` counts from 0 in every rank's process
    media = {None: GPU, "GPU": GPU}  # it publishes the GPU radix tree only
    # The compiled reader would pass string token ids (multimodal placeholders) through
    # unchecked, and most batches carry a negative hash anyway: `decode` reads them all.
    scan = None
    token_hashing = ("TensorRT-LLM hashes blocks with SHA-256 radix keys kvmiss does not compute; "
                     "the router must put the engine's wire hashes in kvmiss.block_hashes")

    def decode(self, payload: bytes) -> EventBatch:
        batch = decode_batch(payload, arrays=False)  # maps, never vLLM < 0.24's arrays
        for index, event in enumerate(batch.events):
            if isinstance(event, BlockStored):
                event.token_ids = _text_tokens(event.token_ids, index)
        return batch


def _text_tokens(raw: msgspec.Raw, index: int) -> msgspec.Raw:
    """The event's token ids when all are ints; none when some are strings (its wire type is
    ``list[int | str]``), since the index reads them as ints and cannot hash either way."""
    try:
        _int_tokens.decode(raw)
        return raw
    except msgspec.ValidationError:
        pass
    except msgspec.DecodeError as exc:
        raise WireError(f"event {index}: BlockStored.token_ids: {exc}") from None
    try:
        _any_tokens.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise WireError(f"event {index}: BlockStored.token_ids: {exc}") from None
    return _EMPTY_TOKENS
