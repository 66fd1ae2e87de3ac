"""`kvmiss decode`: captured multipart messages (base64 frames, JSON lines) -> normalised JSON.

Input, one JSON object per line: ``{"frames": ["<base64>", ...], "socket": "sub"|"dealer"}``
(``socket`` optional; see `parse_any` for how it is guessed). Output, one line per input
line, in order: a ``live`` / ``replay`` / ``replay_end`` message or ``{"kind": "error",
"error": "..."}``. A bad line never stops the run; the exit status is 1 if any line failed.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import sys
from typing import IO, Any

import msgspec

from kvmiss.collectors.frames import BatchMessage, FrameError, ReplayEnd, parse_any
from kvmiss.schemas.events import WireError, event_to_builtins


class _InputLine(msgspec.Struct, forbid_unknown_fields=False):
    frames: list[str]
    socket: str | None = None


_line_decoder = msgspec.json.Decoder(_InputLine)
_encoder = msgspec.json.Encoder()


# Shown under `kvmiss decode --help`: what it reads, in one schema line, and one example.
HELP_INPUT = """\
input:    stdin, one JSON object per line: {"frames": ["<base64 frame>", ...], "socket": "sub"|"dealer"}
          ("socket" optional), as `kvmiss collect --record` files and tests/data/engines/*.jsonl hold them
          (live: topic, 8-byte seq, msgpack batch; the example is one BlockRemoved at seq 7)
example:  echo '{"frames": ["", "AAAAAAAAAAc=", "k8tB2kyPKAAAAJGTrEJsb2NrUmVtb3ZlZJHOB1vNFaNHUFXA"]}' | kvmiss decode
"""

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--raw",
        action="store_true",
        help="include token ids, cache salts and extra keys (prompt material; off by default)",
    )


def decode_line(line: bytes, *, include_raw: bool = False) -> dict[str, Any]:
    """Decode one input line into the output object (never raises on bad input)."""
    try:
        item = _line_decoder.decode(line)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return {"kind": "error", "error": f"input line is not {{\"frames\": [...]}}: {exc}"}
    except RecursionError:  # unknown fields are skipped, but not when nested past the limit
        return {"kind": "error", "error": "input line is nested too deeply"}
    try:
        frames = [base64.b64decode(f, validate=True) for f in item.frames]
    except (binascii.Error, ValueError):
        return {"kind": "error", "error": "a frame is not valid base64"}
    message = parse_any(frames, item.socket)
    if isinstance(message, ReplayEnd):
        return {"kind": "replay_end"}
    if isinstance(message, FrameError):
        return {"kind": "error", "error": message.reason, "seq": message.seq}
    assert isinstance(message, BatchMessage)
    try:
        batch = message.decode()
        events = [event_to_builtins(e, include_raw=include_raw) for e in batch.events]
    except WireError as exc:
        return {"kind": "error", "error": str(exc), "seq": message.seq}
    return {
        "kind": message.channel.value,
        "topic": message.topic,
        "seq": message.seq,
        "ts": batch.ts,
        "dp_rank": batch.dp_rank,
        "events": events,
    }


def run(args: argparse.Namespace, stdin: IO[bytes] | None = None, stdout: IO[bytes] | None = None) -> int:
    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout.buffer
    failed = read = 0
    for line in stdin:
        if not line.strip():
            continue
        read += 1
        out = decode_line(line, include_raw=args.raw)
        failed += out["kind"] == "error"
        stdout.write(_encoder.encode(out) + b"\n")
        stdout.flush()
    if not read:
        sys.stderr.write("kvmiss decode: the input is empty: expected JSON lines of base64 frames on stdin "
                         "(kvmiss decode --help shows the form)\n")
        return 2
    return 1 if failed else 0
