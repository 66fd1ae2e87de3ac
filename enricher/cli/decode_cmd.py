"""`kvmiss decode`: captured multipart messages (base64 frames, JSON lines) -> normalised JSON.

Input, one JSON object per line: ``{"frames": ["<base64>", ...], "socket": "sub"|"dealer"}``
(``socket`` optional; see `parse_any` for how it is guessed). Output, one line per input
line, in order: a ``live`` / ``replay`` / ``replay_end`` message or ``{"kind": "error",
"error": "..."}``. A bad line never stops the run; the exit status is 1 if any line failed.

``--recording FILE`` reads a recording instead (`kvmiss collect --record`, `kvmiss demo`'s
events.rec; collectors/recording.py): one line per recorded message, with the time kvmiss
received it, the worker, the socket's role, and the decoded batch.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import sys
from typing import IO, Any

import msgspec

from kvmiss.collectors.frames import BatchMessage, FrameError, ReplayEnd, parse_any
from kvmiss.collectors.recording import MAGIC, ReadStats, RecordingError, read_recording
from kvmiss.schemas.events import WireError, event_to_builtins


class _InputLine(msgspec.Struct, forbid_unknown_fields=False):
    frames: list[str]
    socket: str | None = None


_line_decoder = msgspec.json.Decoder(_InputLine)
_encoder = msgspec.json.Encoder()


# Shown under `kvmiss decode --help`: what it reads, in one schema line, and one example.
HELP_INPUT = """\
input:    stdin, one JSON object per line: {"frames": ["<base64 frame>", ...], "socket": "sub"|"dealer"}
          ("socket" optional): ZeroMQ messages you captured yourself, as tests/data/engines/*.jsonl hold
          them (live: topic, 8-byte seq, msgpack batch; the example is one BlockRemoved at seq 7);
          or --recording FILE: a kvmiss recording (`kvmiss collect --record`, kvmiss demo's events.rec),
          one JSON line out per message: time, worker, role, kind, seq, events
example:  echo '{"frames": ["", "AAAAAAAAAAc=", "k8tB2kyPKAAAAJGTrEJsb2NrUmVtb3ZlZJHOB1vNFaNHUFXA"]}' | kvmiss decode
          kvmiss decode --recording kvmiss-demo-out/events.rec | head
"""

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recording", metavar="FILE",
                        help="read a kvmiss recording (kvmiss collect --record) instead of JSON lines on stdin")
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
    return decode_frames(frames, item.socket, include_raw=include_raw)


def decode_frames(frames: list[bytes], socket: str | None, *, include_raw: bool = False) -> dict[str, Any]:
    """One multipart message as the output object (never raises on bad input)."""
    message = parse_any(frames, socket)
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


def decode_recorded(message, *, include_raw: bool = False) -> dict[str, Any]:
    """One recorded message as a JSON object: when kvmiss received it, from which worker and
    socket, and what it said. Token ids and extra keys stay out unless ``include_raw``."""
    head = {"time": message.recv_ts, "worker": message.worker, "role": message.socket}
    if message.request_id is not None:
        head["request_id"] = message.request_id  # the replay request a dealer reply answers
    if message.socket in ("sub", "dealer"):
        return {**head, **decode_frames(message.frames, message.socket, include_raw=include_raw)}
    # "monitor" (a connection fact) and "tick" (a timer came due) carry one short ASCII word.
    words = [f.decode("ascii", "replace") for f in message.frames]
    return {**head, "kind": message.socket, "note": " ".join(words)}


def run_recording(path: str, stdout: IO[bytes], *, include_raw: bool) -> int:
    stats = ReadStats()
    failed = 0
    try:
        for message in read_recording(path, stats):
            out = decode_recorded(message, include_raw=include_raw)
            failed += out["kind"] == "error"
            stdout.write(_encoder.encode(out) + b"\n")
    except (RecordingError, OSError) as exc:
        sys.stderr.write(f"kvmiss decode: --recording: {exc}\n")
        return 2
    stdout.flush()
    if stats.torn_tail:
        sys.stderr.write(f"kvmiss decode: {path}: torn last record at byte {stats.torn_offset} skipped "
                         f"({stats.records} records read)\n")
    return 1 if failed else 0


def run(args: argparse.Namespace, stdin: IO[bytes] | None = None, stdout: IO[bytes] | None = None) -> int:
    stdout = stdout or sys.stdout.buffer
    if getattr(args, "recording", None):
        return run_recording(args.recording, stdout, include_raw=args.raw)
    stdin = stdin or sys.stdin.buffer
    failed = read = 0
    for line in stdin:
        if not line.strip():
            continue
        if read == 0 and line == MAGIC:  # a whole recording piped in: say what reads it
            sys.stderr.write("kvmiss decode: stdin is a kvmiss recording: use kvmiss decode --recording FILE\n")
            return 2
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
