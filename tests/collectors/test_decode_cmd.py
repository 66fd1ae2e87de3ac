"""`kvmiss decode`: JSON lines of base64 frames in, one normalised JSON line out per message."""

from __future__ import annotations

import argparse
import base64
import io
import json
import subprocess
import sys

import msgspec
from shared_data import load_json

from kvmiss.enricher.cli import decode_cmd, main


def _line(frames: list[bytes], **extra) -> bytes:
    obj = {"frames": [base64.b64encode(f).decode() for f in frames], **extra}
    return json.dumps(obj).encode() + b"\n"


def run_decode(stdin: bytes, *args: str) -> tuple[int, list[dict]]:
    out = io.BytesIO()
    status = decode_cmd.run(argparse.Namespace(raw="--raw" in args), stdin=io.BytesIO(stdin), stdout=out)
    return status, [json.loads(x) for x in out.getvalue().splitlines()]


SEQ = (5).to_bytes(8, "big")
STORED = msgspec.msgpack.encode(
    [9.5, [{"type": "BlockStored", "block_hashes": [-1], "token_ids": [3, 4], "block_size": 2,
            "cache_salt": "tenant-secret", "session_id": "user-session-77"}], 0]
)


def test_a_live_message_prints_kind_topic_seq_ts_rank_and_events():
    status, (out,) = run_decode(_line([b"kv@x", SEQ, STORED]))
    assert status == 0
    assert out["kind"] == "live" and out["topic"] == "kv@x" and out["seq"] == 5
    assert out["ts"] == 9.5 and out["dp_rank"] == 0
    (event,) = out["events"]
    assert event["type"] == "BlockStored"
    assert event["block_hashes"] == [2**64 - 1]
    assert event["num_tokens"] == 2 and event["has_cache_salt"] is True


def test_prompt_material_is_hidden_unless_raw_is_asked_for():
    _, (hidden,) = run_decode(_line([b"kv@x", SEQ, STORED]))
    assert "tenant-secret" not in json.dumps(hidden) and "token_ids" not in hidden["events"][0]
    assert "user-session-77" not in json.dumps(hidden) and hidden["events"][0]["has_session_id"]
    _, (shown,) = run_decode(_line([b"kv@x", SEQ, STORED]), "--raw")
    assert shown["events"][0]["token_ids"] == [3, 4]
    assert shown["events"][0]["cache_salt"] == "tenant-secret"


def test_bad_lines_are_reported_and_the_rest_still_flows():
    stdin = b"".join([
        b"not json\n",
        _line([b"kv", b"\x00\x01", STORED]),
        json.dumps({"frames": ["***"]}).encode() + b"\n",
        _line([b"kv", SEQ, b"\xc1"]),
        _line([b"", b"", b"\xff" * 8, b""]),
        _line([b"kv", SEQ, STORED]),
    ])
    status, out = run_decode(stdin)
    assert status == 1
    assert [o["kind"] for o in out] == ["error", "error", "error", "error", "replay_end", "live"]
    assert "8 bytes" in out[1]["error"]
    assert "base64" in out[2]["error"]
    assert out[3]["seq"] == 5 and "msgpack" in out[3]["error"]


def test_every_captured_sglang_frame_decodes_through_the_installed_command():
    data = load_json("sglang-0.5.23-event-frames.json")
    lines = [
        json.dumps({"frames": f["frames_b64"],
                    "socket": "dealer" if f["channel"] == "replay" else "sub"})
        for f in data["frames"] if f["channel"] != "replay-request"
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "kvmiss.enricher.cli", "decode"],
        input="\n".join(lines).encode(), capture_output=True, check=True, timeout=60,
    )
    out = [json.loads(x) for x in proc.stdout.splitlines()]
    assert len(out) == len(lines)
    assert {o["kind"] for o in out} == {"live", "replay", "replay_end"}


def test_main_dispatches_the_decode_subcommand(monkeypatch, capsysbinary):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(_line([b"kv", SEQ, STORED]))))
    assert main(["decode"]) == 0
    assert json.loads(capsysbinary.readouterr().out)["seq"] == 5


# vLLM 0.33 with EAGLE/MTP plus prefix caching: ``lookahead_token_ids`` is one list per block.
SPEC_DECODE = msgspec.msgpack.encode(
    [9.5, [{"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
            "token_ids": [3, 4, 5, 6], "block_size": 2, "lora_id": None, "medium": "GPU",
            "lora_name": None, "lookahead_token_ids": [[7], [8]]},
           # an offload connector's placeholder store: no tokens, block_size 0
           {"type": "BlockStored", "block_hashes": [13], "parent_block_hash": None, "token_ids": [],
            "block_size": 0, "lora_id": None, "medium": "CPU", "lora_name": None}], 0]
)


def test_spec_decode_lookahead_lists_and_zero_block_size_placeholders_are_decoded_and_shown():
    status, (out,) = run_decode(_line([b"kv", SEQ, SPEC_DECODE]))
    assert status == 0
    spec, placeholder = out["events"]
    assert spec["num_lookahead_tokens"] == 2 and "lookahead_token_ids" not in spec  # hidden by default
    assert placeholder["block_size"] == 0 and placeholder["num_tokens"] == 0  # shown, not dropped
    status, (raw,) = run_decode(_line([b"kv", SEQ, SPEC_DECODE]), "--raw")
    assert raw["events"][0]["lookahead_token_ids"] == [[7], [8]]
