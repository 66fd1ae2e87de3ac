"""The engine adapter interface; collectors/engines/__init__.py has the registry."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

from kvmiss.collectors.frames import BatchMessage, FrameError, Message, parse_live, parse_replay, read_payload
from kvmiss.schemas.events import EventBatch

GPU, CPU, STORAGE, EXTERNAL = "GPU", "CPU", "STORAGE", "EXTERNAL"  # kvmiss's media


class FrameLayout(NamedTuple):
    """How an engine frames its messages: the parser of each socket's messages."""

    live: Callable[[list[bytes]], BatchMessage | FrameError]  # a SUB's [topic, seq, payload]
    replay: Callable[[list[bytes]], Message]  # a replay DEALER's replies and end marker


# vLLM's layout (collectors/frames.py; a replay reply has a topic frame from vLLM 0.26),
# which SGLang and the engines publishing vLLM's wire copy.
ZMQ_FRAMES = FrameLayout(parse_live, parse_replay)


class EngineAdapter:
    """One engine's KV-event wire: frames, payloads and hashes, sequence numbers, media.

    Stateless: one instance per engine (`ADAPTERS`), shared by every worker configured with it."""

    frames: FrameLayout = ZMQ_FRAMES
    """The parsers of the engine's live messages and replay replies."""

    first_seq: int = 0
    """The sequence number of a fresh publisher's first batch (it counts up from there)."""

    media: Mapping[str | None, str] = {None: GPU, GPU: GPU}
    """The engine's spellings of each medium -> kvmiss's (GPU, CPU, STORAGE, EXTERNAL);
    None: an event naming none."""

    scan: Callable[[bytes], tuple | None] | None = None
    """The compiled reader (collectors/_kvwire.c `scan_batch`) when it reads this engine's
    payloads exactly as `decode` does (and answers None for the rest), else None."""

    token_hashing: str | None = None
    """None: kvmiss hashes a request's ``kvmiss.token_ids`` as this engine does (``[engine]``).
    Otherwise why it cannot, said on the span of a request to this engine that carries token
    ids and no ``kvmiss.block_hashes``, instead of a chain hashed the wrong way."""

    def decode(self, payload: bytes) -> EventBatch:
        """One batch payload as the event model, block hashes canonical (uint64).

        Raises `WireError` naming the bad field; never another exception."""
        raise NotImplementedError

    def read(self, payload: bytes) -> EventBatch:
        """The batch: the compiled reader's events where it applies and reads it, else `decode`."""
        return read_payload(payload, self.scan, self.decode)
