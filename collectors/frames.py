"""ZeroMQ multipart frames -> messages: live batches, replayed batches, the replay end marker.

Frame layouts (shared/reference/WIRE.md):
  live (SUB)                 [topic, seq, payload]
  replay reply (DEALER)      [b"", topic, seq, payload]      vLLM >= 0.26, SGLang
                             [b"", seq, payload]             vLLM < 0.26 (no topic frame)
  replay end marker          [b"", b"", ff*8, b""]  or  [b"", ff*8, b""]
  replay request (DEALER)    [b"", start_seq]

``seq`` is 8 bytes, big-endian, unsigned. The payload is left undecoded here: the stream
state machine decides whether a batch is applied before anyone pays for decoding it.
Errors are values (`FrameError`), never exceptions, so a consumer loop cannot be killed
by one bad message.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable

import msgspec

from kvmiss.schemas.events import AllBlocksCleared, EventBatch, KVEvent, WireError, decode_batch

try:  # the batch reader in C (collectors/_kvwire.c); decode_batch stays the rule
    if os.environ.get("KVMISS_PURE_PYTHON_INGEST") == "1":  # to rule the compiled path in or out
        raise ImportError("KVMISS_PURE_PYTHON_INGEST=1")
    from kvmiss.collectors._kvwire import EncodedEvents, scan_batch
except ImportError:
    EncodedEvents = scan_batch = None  # type: ignore[assignment,misc]
READER_COMPILED = scan_batch is not None

END_SEQ_BYTES = b"\xff" * 8


class Channel(enum.Enum):
    LIVE = "live"
    REPLAY = "replay"


class BatchMessage(msgspec.Struct, frozen=True):
    """One undecoded batch with its sequence number, as received on one channel."""

    channel: Channel
    topic: str
    seq: int
    payload: bytes

    def decode(self) -> EventBatch:
        """The batch's events; raises `WireError` naming the bad field.

        With the compiled reader, a payload of the current wire form comes back with its
        events as `EncodedEvents` (a sequence of the same Structs, decoded on first use,
        that the index applies without them); anything else goes through `decode_batch`."""
        return read_payload(self.payload, scan_batch, decode_batch)


def read_payload(payload: bytes, scan: Callable[[bytes], tuple | None] | None,
                 decode: Callable[[bytes], EventBatch]) -> EventBatch:
    """One batch payload: read by ``scan`` (the compiled reader) when given and it reads it,
    else by ``decode``. The one home of that choice (`BatchMessage.decode`, the engine adapters)."""
    if scan is not None and payload.__class__ is bytes:
        scanned = scan(payload)
        if scanned is not None:
            ts, dp_rank, events = scanned
            return EventBatch(ts=ts, events=events, dp_rank=dp_rank)
    return decode(payload)


def has_clear(events: list[KVEvent]) -> bool:
    """Whether an AllBlocksCleared is among a decoded batch's events (read without decoding
    them when the compiled reader read the batch)."""
    if events.__class__ is EncodedEvents:
        return events.has_clear  # type: ignore[attr-defined]
    return AllBlocksCleared in map(type, events)  # (C-speed scan)


class ReplayEnd(msgspec.Struct, frozen=True):
    """The publisher has sent every buffered batch at or after the requested start."""


class FrameError(msgspec.Struct, frozen=True):
    """A message that is not a valid frame set. ``seq`` is set when it could be read."""

    reason: str
    seq: int | None = None


Message = BatchMessage | ReplayEnd | FrameError


def _seq(frame: bytes, where: str) -> int | FrameError:
    if len(frame) != 8:
        return FrameError(f"{where}: sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def _topic(frame: bytes) -> str | FrameError:
    try:
        return frame.decode("utf-8")
    except UnicodeDecodeError:
        return FrameError("topic frame is not UTF-8")


def parse_live(frames: list[bytes]) -> BatchMessage | FrameError:
    """Parse a message received on a SUB socket."""
    if len(frames) != 3:
        return FrameError(f"live message must have 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq_frame, payload = frames
    if len(seq_frame) != 8:  # (`_seq` and `_topic` inline: every live batch passes here)
        return FrameError(f"live: sequence frame must be 8 bytes, got {len(seq_frame)}")
    seq = int.from_bytes(seq_frame, "big")
    try:
        text = topic.decode("utf-8")
    except UnicodeDecodeError:
        return FrameError("topic frame is not UTF-8", seq)
    return BatchMessage(Channel.LIVE, text, seq, payload)


def parse_replay(frames: list[bytes]) -> Message:
    """Parse one reply received on a DEALER replay socket (leading empty delimiter kept)."""
    if not frames or frames[0] != b"":
        return FrameError("replay reply must start with an empty delimiter frame")
    body = frames[1:]
    if len(body) == 3:
        topic, seq_frame, payload = body
    elif len(body) == 2:  # vLLM < 0.26: no topic frame
        topic, (seq_frame, payload) = b"", body
    else:
        return FrameError(
            f"replay reply must have 3 or 4 frames including the delimiter, got {len(frames)}"
        )
    if seq_frame == END_SEQ_BYTES:
        return ReplayEnd()
    seq = _seq(seq_frame, "replay")
    if isinstance(seq, FrameError):
        return seq
    text = _topic(topic)
    if isinstance(text, FrameError):
        return FrameError(text.reason, seq)
    return BatchMessage(Channel.REPLAY, text, seq, payload)


def parse_any(frames: list[bytes], socket: str | None = None) -> Message:
    """Parse a message whose socket kind may be unknown (captures, `kvmiss decode`).

    ``socket`` is ``"sub"`` or ``"dealer"`` when known. Otherwise: 4 frames starting with
    an empty frame, or an end marker, are replay; 3 frames are live. A 3-frame pre-0.26
    replay reply looks exactly like a live message with an empty topic, so pass the socket
    kind for those captures.
    """
    if socket == "sub":
        return parse_live(frames)
    if socket == "dealer":
        return parse_replay(frames)
    if socket is not None:
        return FrameError(f"unknown socket kind {socket!r}; expected 'sub' or 'dealer'")
    if frames and frames[0] == b"" and (len(frames) == 4 or END_SEQ_BYTES in frames[1:3]):
        return parse_replay(frames)
    return parse_live(frames)


def encode_replay_request(start_seq: int) -> list[bytes]:
    """The frames a DEALER sends to ask for every buffered batch with seq >= start_seq."""
    return [b"", start_seq.to_bytes(8, "big")]


__all__ = [
    "BatchMessage",
    "Channel",
    "FrameError",
    "Message",
    "ReplayEnd",
    "WireError",
    "encode_replay_request",
    "has_clear",
    "parse_any",
    "parse_live",
    "parse_replay",
]
