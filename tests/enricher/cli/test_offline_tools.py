"""The offline commands on a user's own files: `decode --recording` dumps a recording without
prompt material, `report --recording` draws stream-health lanes from it and speaks of no
injected faults, `compare -` reads stdin, and `attribute` without --config says what it assumed."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest

from kvmiss.collectors.recording import RecordedMessage, RecordingWriter
from kvmiss.enricher.report.streams import context_from_recording
from kvmiss.schemas.attribution import RequestFacts
from kvmiss.schemas.events import BlockStored, EventBatch

TOKENS = [901, 902, 903, 904] * 4  # one block of token ids, which must never be printed by default
T0 = 1_700_000_000.0


def live(worker: str, seq: int, ts: float, *events) -> RecordedMessage:
    payload = msgspec.msgpack.encode(EventBatch(ts=ts, events=list(events), dp_rank=0))
    return RecordedMessage(ts + 0.01, worker, "sub", [b"kv", seq.to_bytes(8, "big"), payload])


@pytest.fixture
def recording(tmp_path):
    """Two workers without replay: A continuous, B with seqs 10-11 never delivered (a hole)."""
    path = tmp_path / "events.rec"
    stored = BlockStored(block_hashes=[11], block_size=16, token_ids=msgspec.Raw(msgspec.msgpack.encode(TOKENS)))
    with RecordingWriter(path) as w:
        w.write(RecordedMessage(T0, "A", "monitor", [b"connected"]))
        w.write(RecordedMessage(T0, "B", "monitor", [b"connected"]))
        for seq in range(20):
            w.write(live("A", seq, T0 + seq, *([stored] if seq == 3 else [])))
            if seq not in (10, 11):
                w.write(live("B", seq, T0 + seq + 0.5))
        w.write(RecordedMessage(T0 + 30, "A", "tick", []))
    return path


def kvmiss(*args: str, stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmiss.enricher.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=120, env=env)


# --- decode --recording ----------------------------------------------------------------------

def test_decode_recording_prints_one_line_per_message_without_token_ids(recording):
    proc = kvmiss("decode", "--recording", str(recording))
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(lines) == 2 + 20 + 18 + 1
    assert {(d["role"], d["kind"]) for d in lines} == {("monitor", "monitor"), ("sub", "live"), ("tick", "tick")}
    a3 = next(d for d in lines if d["worker"] == "A" and d.get("seq") == 3)
    assert a3["time"] == pytest.approx(T0 + 3.01) and a3["ts"] == pytest.approx(T0 + 3)
    assert a3["events"][0]["type"] == "BlockStored" and a3["events"][0]["block_hashes"] == [11]
    assert "token_ids" not in proc.stdout and "901" not in proc.stdout
    assert [d["seq"] for d in lines if d["worker"] == "B" and "seq" in d] == [s for s in range(20) if s not in (10, 11)]
    raw = kvmiss("decode", "--recording", str(recording), "--raw")
    assert "token_ids" in raw.stdout  # the opt-in still works


def test_decode_says_what_reads_a_recording_and_refuses_other_files(recording, tmp_path):
    piped = subprocess.run([sys.executable, "-m", "kvmiss.enricher.cli", "decode"], input=recording.read_bytes(),
                           capture_output=True, timeout=60)
    assert piped.returncode == 2 and b"--recording" in piped.stderr and piped.stdout == b""
    other = tmp_path / "other.jsonl"
    other.write_text('{"frames": []}\n')
    proc = kvmiss("decode", "--recording", str(other))
    assert proc.returncode == 2 and "not a kvmiss recording" in proc.stderr
    torn = tmp_path / "torn.rec"
    torn.write_bytes(recording.read_bytes()[:-5])
    proc = kvmiss("decode", "--recording", str(torn))
    assert proc.returncode == 0 and "torn last record" in proc.stderr and len(proc.stdout.splitlines()) == 40
    help_text = kvmiss("decode", "--help").stdout
    assert "--recording" in help_text and "as `kvmiss collect --record` files" not in help_text


# --- report --recording ----------------------------------------------------------------------

def spans_file(tmp_path) -> str:
    """Enriched spans as [export] file writes them: one request per worker, each judged."""
    spans = []
    for i, (worker, label) in enumerate((("A", "hit"), ("B", "unknown_history"))):
        attributes = [{"key": "kvmiss.label", "value": {"stringValue": label}},
                      {"key": "kvmiss.route.worker", "value": {"stringValue": worker}},
                      {"key": "gen_ai.request.id", "value": {"stringValue": f"r{i}"}},
                      {"key": "kvmiss.lookup_time_unix_nano", "value": {"intValue": str(int((T0 + 12 + i) * 1e9))}}]
        spans.append({"traceId": f"{i:032x}", "spanId": f"{i + 1:016x}", "name": "route",
                      "startTimeUnixNano": str(int((T0 + 12) * 1e9)), "attributes": attributes})
    path = tmp_path / "enriched.otlp.jsonl"
    path.write_text(json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}) + "\n")
    return str(path)


def test_a_recording_gives_the_stream_lanes_dated_when_kvmiss_received_them(recording):
    context = context_from_recording(str(recording))
    assert set(context["timeline"]) == set(context["streams"]) == {"A", "B"}
    assert len(context["timeline"]["A"]["applied"]) == 20 and context["timeline"]["A"]["facts"] == []
    assert context["streams"]["B"]["gaps_detected"] == 1 and context["streams"]["B"]["unrecoverable_gaps"] == 1
    (hole,) = [f for f in context["timeline"]["B"]["facts"] if f[1] == "hole"]
    assert hole[0] == pytest.approx(T0 + 12.51) and "10..11" in hole[2]  # seq 12's receipt showed it


def test_report_with_a_recording_draws_stream_lanes_and_mentions_no_injected_faults(recording, tmp_path):
    spans = spans_file(tmp_path)
    proc = kvmiss("report", "--spans", spans, "--recording", str(recording), "--out", str(tmp_path / "with"))
    assert proc.returncode == 0, proc.stderr
    html = (tmp_path / "with" / "report.html").read_text()
    assert "Stream health per worker" in html and "unrecoverable" in html
    without = kvmiss("report", "--spans", spans, "--out", str(tmp_path / "without"))
    plain = (tmp_path / "without" / "report.html").read_text()
    assert "Verdicts per worker over time" in plain and "kvmiss report --recording" in plain
    for text in (html, plain):
        assert "inject" not in text.lower() and "simulator" not in text.lower()
    assert without.returncode == 0
    bad = kvmiss("report", "--spans", spans, "--recording", spans, "--out", str(tmp_path / "bad"))
    assert bad.returncode == 2 and "not a kvmiss recording" in bad.stderr


# --- compare - -------------------------------------------------------------------------------

def test_compare_reads_either_prompt_from_stdin(tmp_path):
    ref = {"algo": "sha256_cbor", "seed": "0", "block_size": 16, "token_ids": list(range(64))}
    cand = {**ref, "token_ids": list(range(40)) + [7] * 24}
    (tmp_path / "ref.json").write_text(json.dumps(ref))
    (tmp_path / "cand.json").write_text(json.dumps(cand))
    files = kvmiss("compare", str(tmp_path / "ref.json"), str(tmp_path / "cand.json"))
    from_stdin = kvmiss("compare", "-", str(tmp_path / "cand.json"), stdin=json.dumps(ref))
    other_side = kvmiss("compare", str(tmp_path / "ref.json"), "-", stdin=json.dumps(cand))
    assert files.returncode == from_stdin.returncode == other_side.returncode == 0, from_stdin.stderr
    expected = {k: v for k, v in json.loads(files.stdout).items() if "digest" not in k}
    for proc in (from_stdin, other_side):
        assert {k: v for k, v in json.loads(proc.stdout).items() if "digest" not in k} == expected
    assert expected["result"] == "diverged" and expected["shared_tokens"] == 32
    both = kvmiss("compare", "-", "-", stdin=json.dumps(ref))
    assert both.returncode == 2 and "stdin" in both.stderr
    empty = kvmiss("compare", "-", str(tmp_path / "cand.json"), stdin="")
    assert empty.returncode == 2 and "empty" in empty.stderr


# --- attribute without --config -----------------------------------------------------------

def requests_text() -> str:
    facts = [RequestFacts(request_id=f"r{i}", prompt_tokens=32, cached_tokens=0, block_size=16, worker=worker,
                          lookup_time=T0 + 15 + i, block_hashes=[11, 12]) for i, worker in enumerate("AB")]
    return "".join(msgspec.json.encode(f).decode() + "\n" for f in facts)


def test_attribute_without_config_says_what_it_assumed_and_with_one_says_nothing(recording, tmp_path):
    proc = kvmiss("attribute", "--events", str(recording), "--requests", "-", stdin=requests_text())
    assert proc.returncode == 0, proc.stderr
    assumed = proc.stderr.split("label ", 1)[0]
    for text in ("no --config", "the 2 in the recording (A, B)", "kv_cache_report_mode = 'any'",
                 "aged_out_as_recent_match = false", "no first-miss digest"):
        assert text in assumed, text
    assert len(proc.stdout.splitlines()) == 2

    config = tmp_path / "kvmiss.toml"
    config.write_text('[history]\nkv_cache_report_mode = "incremental"\n'
                      '[[workers]]\nid = "A"\nendpoint = "tcp://127.0.0.1:5557"\n'
                      '[[workers]]\nid = "B"\nendpoint = "tcp://127.0.0.1:5559"\n')
    with_config = kvmiss("attribute", "--events", str(recording), "--requests", "-", "--config", str(config),
                         stdin=requests_text())
    assert with_config.returncode == 0 and "assumed" not in with_config.stderr
    flag = kvmiss("attribute", "--events", str(recording), "--requests", "-", "--kv-cache-report-mode",
                  "incremental", stdin=requests_text())
    assert "kv_cache_report_mode = 'incremental'" in flag.stderr
    assert [json.loads(x)["verdict"]["label"] for x in flag.stdout.splitlines()] == \
        [json.loads(x)["verdict"]["label"] for x in with_config.stdout.splitlines()]
