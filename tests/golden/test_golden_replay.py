"""Golden replay: offline attribution (`kvmiss attribute`) of fixed inputs must write, byte
for byte, the attribution records stored beside them (tests/data/golden/).

The inputs: every real-engine capture with requests (tests/data/engines), three `kvmiss demo`
runs with every fault on, and a recording of real publishers and the collector's subscriber
through worker joins, departures, a crash-restart and lost batches (record_harness.py); each
under the settings that change labels (kv_cache_report_mode any / incremental,
aged_out_as_recent_match). A refactor that means to change nothing must leave every record
as it was. A deliberate change: tests/data/golden/regenerate.py, and CHANGELOG.md says why.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"
sys.path.insert(0, str(GOLDEN))
from golden_cases import cases, expected_path, inputs, run_pinned  # noqa: E402

MAX_SHOWN = 10


@pytest.fixture(scope="module", params=["0", "1729"], ids=["hashseed0", "hashseed1729"])
def produced(tmp_path_factory, request) -> Path:
    """Every case attributed once per string-hash seed (one child process each): no verdict
    may depend on the order of a set."""
    out = tmp_path_factory.mktemp("golden")
    run_pinned(out, seed=request.param)
    return out


def _flat(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out.update(_flat(item, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


def _who(name: str, number: int, record: dict | None) -> str:
    """The request of line ``number``: its id and, where its request record has one, trace id."""
    with gzip.open(GOLDEN / f"{name}.requests.jsonl.gz", "rt") as requests:
        lines = [line for line in requests if line.strip()]
    request = json.loads(lines[number - 1]) if number <= len(lines) else {}
    rid = (record or {}).get("request_id") or request.get("request_id")
    trace = request.get("trace_id")
    return f"line {number}, request_id {rid}" + (f", trace_id {trace}" if trace else "")


def differences(name: str, expected: list[bytes], got: list[bytes]) -> list[str]:
    out = []
    for number, (want, have) in enumerate(zip(expected, got), 1):
        if want == have:
            continue
        a, b = _flat(json.loads(want)), _flat(json.loads(have))
        fields = {k: (a.get(k, "<absent>"), b.get(k, "<absent>")) for k in sorted(a.keys() | b.keys())
                  if a.get(k, "<absent>") != b.get(k, "<absent>")}
        shown = "; ".join(f"{k}: {w!r} -> {h!r}" for k, (w, h) in fields.items()) or "same fields, other bytes"
        out.append(f"  {_who(name, number, json.loads(want))}: {shown}")
    if len(expected) != len(got):
        out.append(f"  {len(expected)} records expected, {len(got)} written")
    return out


def test_every_input_has_its_expected_records():
    assert len(inputs()) >= 9, inputs()
    missing = [expected_path(n, v).name for n, v in cases() if not expected_path(n, v).exists()]
    assert not missing, f"no expected records (run tests/data/golden/regenerate.py?): {missing}"


@pytest.mark.parametrize(("name", "variant"), cases(), ids=[f"{n}[{v}]" for n, v in cases()])
def test_offline_attribution_writes_the_golden_records(produced, name, variant):
    errors = produced / f"{name}.{variant}.errors"
    assert not errors.exists(), f"{name} [{variant}]: attribute reported: {errors.read_text()}"
    got = (produced / f"{name}.{variant}.jsonl").read_bytes().splitlines()
    with gzip.open(expected_path(name, variant), "rb") as stored:
        expected = stored.read().splitlines()
    if got != expected:
        found = differences(name, expected, got)
        shown = "\n".join(found[:MAX_SHOWN]) + (f"\n  ... and {len(found) - MAX_SHOWN} more" if len(found) > MAX_SHOWN else "")
        pytest.fail(f"golden replay {name} [{variant}]: {len(found)} of {len(expected)} attribution records "
                    f"differ from {expected_path(name, variant).name} (expected -> now):\n{shown}\n"
                    "A deliberate change: tests/data/golden/regenerate.py, and say why in CHANGELOG.md.",
                    pytrace=False)
