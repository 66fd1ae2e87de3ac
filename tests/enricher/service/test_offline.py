"""Offline attribution: a recording and request records in, attribution records out."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgspec

from kvmiss.collectors.recording import RecordedMessage, RecordingWriter
from kvmiss.schemas.attribution import RequestFacts
from kvmiss.schemas.events import BlockRemoved, BlockStored, EventBatch

H = 2**64 - 77  # >= 2^63: exercises the uint64 path end to end


def live(worker: str, seq: int, ts: float, *events) -> RecordedMessage:
    payload = msgspec.msgpack.encode(EventBatch(ts=ts, events=list(events), dp_rank=0))
    return RecordedMessage(ts + 0.001, worker, "sub", [b"kv", seq.to_bytes(8, "big"), payload])


def write_recording(path) -> None:
    with RecordingWriter(path) as w:
        for seq in range(0, 30):
            events = []
            if seq == 5:
                events = [BlockStored(block_hashes=[H], block_size=16)]
            if seq == 12:
                events = [BlockRemoved(block_hashes=[H])]
            w.write(live("A", seq, 100.0 + seq, *events))
            w.write(live("B", seq, 100.2 + seq,
                         *([BlockStored(block_hashes=[H + 1], block_size=16)] if seq == 3 else [])))


def facts(request_id: str, worker: str, t: float, first_miss: int, **kw) -> bytes:
    return msgspec.json.encode(RequestFacts(
        request_id=request_id, prompt_tokens=40, cached_tokens=16, block_size=16, worker=worker,
        lookup_time=t, block_hashes=[1, first_miss], **kw))


def run_attribute(tmp_path, request_lines: list[bytes], env_extra=None):
    rec, req = tmp_path / "events.kvrec", tmp_path / "requests.jsonl"
    write_recording(rec)
    req.write_bytes(b"\n".join(request_lines) + b"\n")
    env = {"KVMISS_TEST_DIGEST": "offline-test-secret-1234", **(env_extra or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "kvmiss.enricher.cli", "attribute", "--events", str(rec),
         "--requests", str(req), "--digest-key-env", "KVMISS_TEST_DIGEST"],
        capture_output=True, timeout=60, env={**os.environ, **env})
    return proc, [json.loads(x) for x in proc.stdout.splitlines()]


def test_recorded_history_gives_each_request_its_proven_label(tmp_path):
    proc, records = run_attribute(tmp_path, [
        facts("evicted", "A", 120.5, H),
        facts("routing", "A", 120.5, H + 1),
        facts("never", "A", 120.5, H + 2),
        facts("lagging", "A", 500.0, H),
        facts("untracked", "Z", 120.5, H),
        b'{"prompt_tokens": "many"}',
    ])
    assert proc.returncode == 0, proc.stderr
    labels = {r["request_id"]: r["verdict"]["label"] for r in records}
    assert labels == {"evicted": "evicted", "routing": "routing_miss", "never": "no_match",
                      "lagging": "unknown_history", "untracked": "unknown_history"}
    evicted = records[0]["verdict"]
    assert (evicted["stored_seq"], evicted["removed_seq"]) == (5, 12)
    assert evicted["first_miss_digest"].count(":") == 1
    stderr = proc.stderr.decode()
    assert "request line 6" in stderr and "prompt_tokens" in stderr
    assert "evicted" in stderr and "unknown share" in stderr


def test_no_hash_or_secret_leaves_in_records_or_the_summary(tmp_path):
    proc, records = run_attribute(tmp_path, [facts("r", "A", 120.5, H)])
    text = proc.stdout.decode() + proc.stderr.decode()
    for forbidden in (str(H), f"{H:x}", str(H - 2**64), "offline-test-secret-1234"):
        assert forbidden not in text
