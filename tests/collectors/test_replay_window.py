"""Replay window sizing: the worked example, the rate measurement and the command."""

from __future__ import annotations

import json

import pytest

from kvmiss.collectors.recording import RecordedMessage, RecordingWriter
from kvmiss.collectors.replay_window import min_replay_window, peak_rate, window_lasts_s
from kvmiss.enricher.cli import main


def test_the_worked_example_needs_24000_batches_and_the_default_lasts_12_5_s():
    assert min_replay_window(800, 12, 3, 2) == 24_000
    assert min_replay_window(800, 12, 3, 1) == 12_000
    assert window_lasts_s(10_000, 800) == 12.5


def test_invalid_inputs_are_named():
    with pytest.raises(ValueError, match="outage_s"):
        min_replay_window(800, -1, 3, 2)


def test_peak_rate_is_the_busiest_one_second_window():
    burst = [10 + i / 100 for i in range(50)]  # 50 batches within 0.5 s
    assert peak_rate([0, 1, 2, *burst, 20]) == 50
    assert peak_rate([]) == 0


def test_the_command_from_flags(capsys):
    assert main(["replay-size", "--peak-batches-per-s", "800", "--outage-s", "12",
                 "--catchup-s", "3", "--safety-factor", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["min_replay_window_batches"] == 24_000
    assert out["buffer_lasts_s"] == 12.5 and out["buffer_sufficient"] is False


def test_the_command_from_a_recording_uses_the_busiest_workers_live_rate(tmp_path, capsys):
    path = tmp_path / "r.kvrec"
    with RecordingWriter(path) as w:
        for i in range(30):  # w1: 30 batches in 0.3 s; w0: 1 per second; replies do not count
            w.write(RecordedMessage(5 + i / 100, "w1", "sub", [b"", b"", b""]))
            w.write(RecordedMessage(float(i), "w0", "sub", [b"", b"", b""]))
            w.write(RecordedMessage(5 + i / 1000, "w0", "dealer", [b""]))
    assert main(["replay-size", "--recording", str(path), "--outage-s", "10"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["busiest_worker"] == "w1" and out["peak_batches_per_s"] == 30
    assert out["min_replay_window_batches"] == 30 * 13 * 2
