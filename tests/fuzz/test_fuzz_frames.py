"""Multipart frames and the `kvmiss decode` command: any list of frames parses to a message
or a `FrameError` value (never an exception); any input line gives exactly one output line
that is a JSON object; real captures keep their meaning."""

from __future__ import annotations

import argparse
import base64
import io
import json

import msgspec
from fuzz_support import (
    captured_messages,
    captured_payloads,
    fuzz_settings,
    mutate_bytes,
    mutate_tree,
    scalars,
    seeds,
)
from hypothesis import given, strategies as st

from kvmiss.collectors.frames import (
    END_SEQ_BYTES,
    BatchMessage,
    Channel,
    FrameError,
    ReplayEnd,
    encode_replay_request,
    parse_any,
    parse_live,
    parse_replay,
)
from kvmiss.enricher.cli import decode_cmd

MESSAGE_TYPES = (BatchMessage, ReplayEnd, FrameError)

special_frames = st.sampled_from([b"", END_SEQ_BYTES, b"\x00" * 8, b"\x00" * 7, b"\x00" * 9,
                                  b"\xff\xfe", b"kv@x", "kv@\u00e9".encode("latin-1")])
frame = special_frames | st.binary(max_size=24) | st.integers(0, 2**64 - 1).map(lambda n: n.to_bytes(8, "big"))
frame_lists = st.lists(frame, max_size=7)
sockets = st.none() | st.sampled_from(["sub", "dealer"]) | st.text(max_size=6)


def check_message(message, frames: list[bytes]) -> None:
    assert isinstance(message, MESSAGE_TYPES)
    if isinstance(message, BatchMessage):
        assert 0 <= message.seq < 2**64
        assert message.payload is frames[-1]
        assert isinstance(message.topic, str)
    if isinstance(message, FrameError):
        assert message.seq is None or 0 <= message.seq < 2**64


@fuzz_settings(105)
@given(frame_lists, sockets)
def test_any_frame_list_parses_to_a_message_or_a_frame_error_value(frames, socket):
    for parse in (parse_live, parse_replay, lambda f: parse_any(f, socket)):
        check_message(parse(list(frames)), frames)


@fuzz_settings(50)
@given(st.data())
def test_mutated_captured_messages_parse_to_a_message_or_a_frame_error_value(data):
    frames, socket = data.draw(seeds(captured_messages))
    frames = list(frames)
    op = data.draw(st.sampled_from(["drop", "add", "mutate", "swap"]))
    if op == "drop" and frames:
        del frames[data.draw(st.integers(0, len(frames) - 1))]
    elif op == "add":
        frames.insert(data.draw(st.integers(0, len(frames))), data.draw(frame))
    elif op == "mutate" and frames:
        i = data.draw(st.integers(0, len(frames) - 1))
        frames[i] = data.draw(mutate_bytes(frames[i]))
    elif op == "swap" and len(frames) > 1:
        frames[0], frames[-1] = frames[-1], frames[0]
    for kind in (socket, None):
        check_message(parse_any(frames, kind), frames)


@fuzz_settings(35)
@given(st.binary(max_size=40), st.integers(0, 2**64 - 2), st.binary(max_size=64), st.booleans())
def test_well_formed_messages_round_trip(topic, seq, payload, old_replay):
    seq_frame = seq.to_bytes(8, "big")
    try:
        text = topic.decode("utf-8")
    except UnicodeDecodeError:
        assert isinstance(parse_live([topic, seq_frame, payload]), FrameError)
        return
    live = parse_live([topic, seq_frame, payload])
    assert live == BatchMessage(Channel.LIVE, text, seq, payload)
    reply = [b"", seq_frame, payload] if old_replay else [b"", topic, seq_frame, payload]
    replayed = parse_replay(reply)
    assert replayed == BatchMessage(Channel.REPLAY, "" if old_replay else text, seq, payload)
    assert parse_replay([b"", *([] if old_replay else [b""]), END_SEQ_BYTES, b""]) == ReplayEnd()
    assert int.from_bytes(encode_replay_request(seq)[1], "big") == seq


def test_every_captured_message_keeps_its_channel():
    for frames, socket in captured_messages():
        message = parse_any(list(frames), socket)
        assert isinstance(message, (BatchMessage, ReplayEnd)), (socket, message)
        if isinstance(message, BatchMessage):
            assert message.channel is (Channel.REPLAY if socket == "dealer" else Channel.LIVE)


# --- `kvmiss decode`: JSON lines in, one JSON line out per line -------------------------


def _line(frames, socket) -> dict:
    out = {"frames": [base64.b64encode(f).decode() for f in frames]}
    if socket is not None:
        out["socket"] = socket
    return out


def _json_containers(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)


json_garbage = st.recursive(
    scalars.filter(lambda v: not isinstance(v, bytes)).map(lambda v: v if v == v else None),
    _json_containers,
    max_leaves=8,
)


@st.composite
def decode_lines(draw) -> bytes:
    """One input line: a captured message (maybe with a mutated payload), mutated as JSON or
    as bytes, or garbage."""
    frames, socket = draw(seeds(captured_messages))
    frames = list(frames)
    if frames and draw(st.booleans()):
        frames[-1] = draw(mutate_bytes(frames[-1], captured_payloads()))
    doc = _line(frames, draw(st.sampled_from([socket, None, "bogus"])))
    how = draw(st.sampled_from(["as_is", "tree", "bytes", "deep", "garbage"]))
    if how == "tree":
        doc = draw(mutate_tree(doc, json_garbage))
    text = json.dumps(doc).encode()
    if how == "bytes":
        text = draw(mutate_bytes(text))
    elif how == "deep":  # unknown fields are skipped: nested far past the recursion limit
        depth = draw(st.integers(100, 100_000))
        text = text[:-1] + b', "x": ' + b"[" * depth + b"]" * depth + b"}"
    elif how == "garbage":
        text = draw(st.binary(max_size=64))
    return text.replace(b"\n", b" ")


@fuzz_settings(40)
@given(st.lists(decode_lines(), min_size=1, max_size=4), st.booleans())
def test_decode_prints_one_json_object_per_input_line_and_never_raises(lines, raw):
    stdin = b"\n".join(lines) + b"\n"
    out = io.BytesIO()
    status = decode_cmd.run(argparse.Namespace(raw=raw), stdin=io.BytesIO(stdin), stdout=out)
    printed = [json.loads(x) for x in out.getvalue().splitlines()]
    assert len(printed) == sum(1 for line in lines if line.strip())
    assert all(p["kind"] in ("live", "replay", "replay_end", "error") for p in printed)
    if not printed:  # nothing but blank lines: the input is said to be empty (exit 2)
        assert status == 2
        return
    assert status == (1 if any(p["kind"] == "error" for p in printed) else 0)
    if not raw:
        for p in printed:
            for event in p.get("events", ()):
                assert "token_ids" not in event and "cache_salt" not in event


def test_a_capture_decodes_to_its_recorded_meaning():
    """The decode output of the real SGLang frames matches what the capture says they mean."""
    from shared_data import load_json

    for message in load_json("sglang-0.5.23-event-frames.json")["frames"]:
        if message["channel"] == "replay-request" or "decoded" not in message:
            continue
        socket = "dealer" if message["channel"] == "replay" else "sub"
        out = decode_cmd.decode_line(json.dumps({"frames": message["frames_b64"], "socket": socket}).encode(),
                                     include_raw=True)
        payload = message["decoded"].get("payload")
        if out["kind"] == "replay_end" or payload is None:
            continue
        assert out["seq"] == message["decoded"]["seq"] and out["ts"] == payload[0]
        assert [e["type"] for e in out["events"]] == [e["type"] for e in payload[1]]
        tokens = [e.get("token_ids") for e in out["events"]]
        assert tokens == [e.get("token_ids") for e in payload[1]]
        assert msgspec.json.encode(out)  # printable
