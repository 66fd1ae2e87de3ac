"""`kvmiss collect` as a real process against the real SGLang publisher (through the lossy
proxy, which also tells the test when the collector has subscribed)."""

from __future__ import annotations

import atexit
import json
import signal
import subprocess
import sys

import pytest
from lossy_proxy import LossyProxy
from sglang_publisher import batch, publisher
from zmq_ports import free_tcp

from kvmiss.collectors.continuity import Apply
from kvmiss.collectors.fleet import Fleet, play_recording
from kvmiss.collectors.recording import ReadStats
from kvmiss.enricher.cli import main
from kvmiss.schemas.config import load_config

FACT_KEYS = {  # every key a stderr line may carry: seqs, epochs, reasons, never payloads
    "event", "worker", "epoch", "cause", "instance", "certain", "from_seq", "to_seq", "reason",
    "detail", "seq", "workers", "recording", "by", "elapsed_s",
    "at",  # tail_confirmed: the probe's send time
}


@pytest.fixture
def peer():
    pub_ep, replay_ep = free_tcp(), free_tcp()
    pub = publisher(endpoint=pub_ep, replay_endpoint=replay_ep)
    proxy = LossyProxy(pub_ep, replay_upstream=replay_ep).start()
    yield pub, proxy
    proxy.stop()
    pub.shutdown()
    atexit.unregister(pub.shutdown)  # SGLang's atexit hook would wait 1 s on a closed queue


def write_config(tmp_path, proxy: LossyProxy) -> str:
    path = tmp_path / "kvmiss.toml"
    path.write_text(
        "[[workers]]\n"
        'id = "w0"\n'
        f'endpoint = "{proxy.endpoint}"\n'
        f'replay_endpoint = "{proxy.replay_endpoint}"\n'
    )
    return str(path)


def collect(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kvmiss.enricher.cli", "collect", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def fact_lines(stderr: str) -> list[dict]:
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    for line in lines:
        assert set(line) <= FACT_KEYS, line
    return lines


def publish(pub, n: int) -> None:
    for seq in range(n):
        pub.publish(batch(1000.0 + seq, stored=[([7_000 + seq], None)]))


def test_collect_records_a_faulty_stream_that_plays_back_to_the_published_batches(tmp_path, peer):
    pub, proxy = peer
    config, record = write_config(tmp_path, proxy), tmp_path / "events.kvrec"
    proc = collect("--config", config, "--record", str(record), "--duration", "2")
    try:
        assert proxy.wait_ready(timeout=15), "kvmiss collect never subscribed"
        proxy.drop(2)  # recovered through replay
        proxy.replace_payload(6, b"\xc1")  # malformed: a hole and a quarantine, logged
        publish(pub, 10)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err

    facts = fact_lines(err)
    events = [f["event"] for f in facts]
    assert events[0] == "collect_started" and events[-1] == "collect_stopped"
    assert facts[-1]["by"] == "duration"
    hole = next(f for f in facts if f["event"] == "hole")
    assert (hole["worker"], hole["from_seq"], hole["to_seq"], hole["reason"]) == (
        "w0", 6, 6, "malformed")
    assert {"event": "quarantine", "worker": "w0", "epoch": 0, "from_seq": 6,
            "reason": "malformed"} in facts

    summary = json.loads(out)
    w0 = summary["workers"]["w0"]
    assert (w0["epoch"], w0["applied_seq"], w0["quarantined"]) == (0, 9, True)
    assert w0["quarantine"] == {"epoch": 0, "from_seq": 6, "reason": "malformed"}
    health = w0["health"]
    # seq 2 came by replay; a reply may also carry batches the live socket had not delivered
    # yet (a loaded box), which are then applied from it: at least one, never more applied
    assert health["batches_applied"] == 9 and 1 <= health["batches_replayed"] <= 9
    assert health["unrecoverable_gaps"] == {"malformed": 1}
    assert summary["recording"]["path"] == str(record)

    applied = []
    stats = ReadStats()
    workers = load_config(config).workers
    played = play_recording(str(record), Fleet(workers, lambda w, a: applied.append(a)), stats)
    assert not stats.torn_tail and played == summary["recording"]["records"]
    batches = [a.batch for a in applied if isinstance(a, Apply)]
    assert [b.seq for b in batches] == [s for s in range(10) if s != 6]
    assert [b.events[0].block_hashes for b in batches] == [
        [7_000 + s] for s in range(10) if s != 6]
    assert [b.seq for b in batches if b.replayed] == [2]


def test_collect_stops_on_sigterm_flushes_the_recording_and_reports(tmp_path, peer):
    pub, proxy = peer
    config, record = write_config(tmp_path, proxy), tmp_path / "events.kvrec"
    proc = collect("--config", config, "--record", str(record))
    try:
        assert proxy.wait_ready(timeout=15), "kvmiss collect never subscribed"
        publish(pub, 3)
        assert proxy.wait_forwarded(2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert fact_lines(err)[-1]["by"] == "SIGTERM"
    summary = json.loads(out)
    assert summary["workers"]["w0"]["quarantined"] is False
    applied = []
    stats = ReadStats()
    play_recording(str(record), Fleet(load_config(config).workers, lambda w, a: applied.append(a)),
                   stats)
    seqs = [a.batch.seq for a in applied if isinstance(a, Apply)]
    assert not stats.torn_tail
    assert seqs == list(range(len(seqs)))  # what arrived before the signal, in order
    assert len(seqs) == summary["workers"]["w0"]["health"]["batches_applied"]


@pytest.mark.parametrize("worker_lines, names", [
    ('id = "w0"\nendpoint = "tcp://127.0.0.1:5557"\ndp_rank = "one"\n', "workers[0].dp_rank"),
    ('id = "w0"\nendpiont = "tcp://127.0.0.1:5557"\n', "endpiont"),
    ('id = "w0"\nendpoint = "tcp://127.0.0.1"\n', "workers"),  # no port: sockets cannot open
])
def test_a_bad_config_exits_2_naming_the_key(tmp_path, capsys, worker_lines, names):
    path = tmp_path / "bad.toml"
    path.write_text("[[workers]]\n" + worker_lines)
    assert main(["collect", "--config", str(path), "--duration", "1"]) == 2
    captured = capsys.readouterr()
    assert names in captured.err and captured.out == ""


def test_a_missing_config_file_exits_2(tmp_path, capsys):
    assert main(["collect", "--config", str(tmp_path / "nope.toml")]) == 2
    assert "nope.toml" in capsys.readouterr().err


def test_a_worker_that_never_delivered_exits_1_naming_it(tmp_path, capsys):
    """Nothing listens on the worker's port: the summary says it never connected and the exit
    status is not 0 (a script running collect must not take an empty recording for a quiet one)."""
    from zmq_ports import quiet_port

    port = quiet_port()
    path = tmp_path / "unreachable.toml"
    path.write_text(f'[[workers]]\nid = "w0"\nendpoint = "tcp://127.0.0.1:{port}"\n')
    assert main(["collect", "--config", str(path), "--duration", "1"]) == 1
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["workers"]["w0"]["connection"] == "never"
    assert summary["workers"]["w0"]["delivered"] is False
    assert f"worker w0 (tcp://127.0.0.1:{port}): delivered nothing" in captured.err
    assert "never connected" in captured.err
