"""vLLM (0.10-0.33), and engines that publish vLLM's wire (shared/reference/WIRE.md).

Events are tagged maps from 0.24 and positional arrays before (`decode_batch` tells them
apart per event); a replay reply has a topic frame from 0.26 (`ZMQ_FRAMES`). Hashes are
uint64 by default, the raw digest with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``: both
canonicalised by `decode_batch`. Signed ones are accepted too, so that an SGLang worker
configured before ``engine`` existed (the default is vllm) keeps working.
"""

from __future__ import annotations

from kvmiss.collectors.engines.base import CPU, GPU, STORAGE, EngineAdapter
from kvmiss.collectors.frames import scan_batch
from kvmiss.schemas.events import EventBatch, decode_batch


class VLLMAdapter(EngineAdapter):
    """vLLM's KV-event wire, every release kvmiss reads."""

    first_seq = 0  # `ZmqEventPublisher`'s counter starts at 0 in every process
    # GPU, the offload connectors' CPU and STORAGE; one connector writes "cpu" (upper-cased
    # by `canonical_medium`).
    media = {None: GPU, "GPU": GPU, "CPU": CPU, "STORAGE": STORAGE}
    scan = scan_batch  # reads the >= 0.24 map form; the array form and digests go to decode

    def decode(self, payload: bytes) -> EventBatch:
        return decode_batch(payload)
