"""What-if sizing against vLLM's own block pool (benchmarks/whatif_vllm_pool.py).

Opt-in: ``KVMISS_E2E_VLLM=1 .venv/bin/python -m pytest -m e2e_vllm tests/e2e/test_whatif_vllm_pool.py``
(needs vLLM's venv, ``KVMISS_VLLM_VENV``, default /work/vllm-venv, with this kvmiss installed
into it: ``pip install --no-deps .``). One seeded workload runs through vLLM's real
``KVCacheManager`` at N, 2N and 4N blocks; from the N run's recording and request records
alone, ``kvmiss whatif`` predicts the token hit ratio at 2N and 4N, and must land within 1
point of what was observed at N and within 2 points of the real 2N and 4N runs. A pool so
small that requests waited for admission is marked uncertain.
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
    pytest.mark.skipif(os.environ.get("KVMISS_E2E_VLLM") != "1", reason="needs vLLM's venv: KVMISS_E2E_VLLM=1"),
]

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("KVMISS_VLLM_VENV", "/work/vllm-venv"))


def harness(out: Path, *sizes: int, seed: int = 1) -> dict[int, float]:
    subprocess.run([str(VENV / "bin" / "python"), str(ROOT / "benchmarks" / "whatif_vllm_pool.py"), "--pool-blocks",
                    *map(str, sizes), "--out", str(out), "--seed", str(seed)], check=True, capture_output=True)
    return {m: json.loads((out / f"summary-{m}.json").read_text())["token_hit_ratio"] for m in sizes}


def whatif(out: Path, m: int) -> dict[float, dict]:
    done = subprocess.run([sys.executable, "-m", "kvmiss.enricher.cli", "whatif", "--events", str(out / f"events-{m}.rec"),
                           "--requests", str(out / f"requests-{m}.jsonl"), "--pool-blocks", str(m),
                           "--scales", "1,2,4", "--json"], check=True, capture_output=True, text=True)
    return {row["scale"]: row for row in map(json.loads, done.stdout.splitlines())}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_predictions_from_the_small_pool_match_vllms_pool_at_2x_and_4x(tmp_path, seed):
    actual = harness(tmp_path, 64, 128, 256, seed=seed)
    predicted = whatif(tmp_path, 64)
    assert abs(predicted[1.0]["predicted_hit_ratio"] - predicted[1.0]["observed_hit_ratio"]) <= 0.01
    assert abs(predicted[1.0]["observed_hit_ratio"] - actual[64]) < 1e-4  # the records carry vLLM's own counts
    for scale, m in ((2.0, 128), (4.0, 256)):
        assert abs(predicted[scale]["predicted_hit_ratio"] - actual[m]) <= 0.02, (scale, predicted[scale], actual[m])
        assert not predicted[scale]["uncertain"]


def test_a_pool_where_requests_waited_is_marked_uncertain(tmp_path):
    harness(tmp_path, 40)
    assert all(row["uncertain"] and "waited" in row["reason"] for row in whatif(tmp_path, 40).values())
