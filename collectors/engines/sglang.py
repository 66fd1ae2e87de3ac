"""SGLang (0.5.23; shared/reference/WIRE.md): vLLM's frames and batch, tagged-map events only.

Hashes are signed int64 (negative ones map to their two's-complement uint64); the third batch
element is ``attn_dp_rank``; media are GPU, CPU_PINNED, DISK and EXTERNAL.
"""

from __future__ import annotations

from kvmiss.collectors.engines.base import CPU, EXTERNAL, GPU, STORAGE, EngineAdapter
from kvmiss.collectors.frames import scan_batch
from kvmiss.schemas.events import EventBatch, decode_batch


class SGLangAdapter(EngineAdapter):
    """SGLang's KV-event wire."""

    first_seq = 0  # its publisher's counter starts at 0 in every process, as vLLM's does
    media = {None: GPU, "GPU": GPU, "CPU_PINNED": CPU, "DISK": STORAGE, "EXTERNAL": EXTERNAL}
    # The compiled reader reads SGLang's maps; a batch with a negative hash (about half of
    # them) it leaves to `decode`.
    scan = scan_batch

    def decode(self, payload: bytes) -> EventBatch:
        return decode_batch(payload, arrays=False)  # SGLang never sent positional arrays
