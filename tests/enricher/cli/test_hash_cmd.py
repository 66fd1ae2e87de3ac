"""`kvmiss hash`: a request as JSON on stdin gives vLLM's block hashes as JSON on stdout."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from shared_data import load_json

from kvmiss.enricher.cli import main

VECTORS = "vllm-0.33.0-hash-vectors.json"


def vector_case(case_id: str) -> dict:
    (case,) = [c for c in load_json(VECTORS)["cases"] if c["id"] == case_id]
    return case


def request_of(case: dict, result: dict) -> dict:
    """The CLI input for one vector case under one result's algorithm and seed."""
    lora, digests = case["lora_request"], case["prompt_embeds_block_digests"]
    return {
        "algo": result["hash_fn"],
        "seed": result["PYTHONHASHSEED"],
        "block_size": case["block_size"],
        "token_ids": case["token_ids"],
        "lora": {"name": lora["lora_name"], "path": lora["lora_path"]} if lora else None,
        "cache_salt": case["cache_salt"],
        "mm": [{"id": m["identifier"], "offset": m["offset"], "length": m["length"]}
               for m in case["mm_features"]],
        "prompt_embeds_block_digests": [d["sha256_hex"] for d in digests] if digests else None,
        "extra_keys_format": "tagged",
    }


def run_hash(monkeypatch, capsysbinary, stdin: bytes) -> tuple[int, bytes, bytes]:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    status = main(["hash"])
    out, err = capsysbinary.readouterr()
    return status, out, err


@pytest.mark.parametrize("case_id", ["bs16_len100_lora_salt_mm", "bs4_len10_prompt_embeds"])
def test_every_reproducible_vector_result_comes_out_exactly(monkeypatch, capsysbinary, case_id):
    case = vector_case(case_id)
    for result in case["results"]:
        if "skipped" in result:
            continue
        status, out, err = run_hash(monkeypatch, capsysbinary, json.dumps(request_of(case, result)).encode())
        assert (status, err) == (0, b"")
        assert json.loads(out) == {
            "none_hash_hex": result["none_hash_hex"],
            "block_hashes_hex": result["block_hashes_hex"],
            "block_hashes": result["block_hashes_external_int"],
        }


def test_lookahead_tokens_are_honoured(monkeypatch, capsysbinary):
    case = vector_case("bs16_len33_lookahead1")
    result = case["results"][1]
    request = {**request_of(case, result), "lookahead_tokens": 1}
    status, out, _ = run_hash(monkeypatch, capsysbinary, json.dumps(request).encode())
    assert status == 0 and json.loads(out)["block_hashes_hex"] == result["block_hashes_hex"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"token_ids": [1, "2"]}, "$.token_ids[1]"),
        ({"tokens": [1]}, "tokens"),
        ({"mm": [{"id": "a", "offset": 0, "lenght": 3}]}, "lenght"),
        ({"algo": "md5"}, "$.algo"),
        ({"algo": "xxhash", "seed": None}, "PYTHONHASHSEED"),
        ({"lora": {"name": "l"}}, "lora.path"),
        ({"prompt_embeds_block_digests": ["zz"]}, "$.prompt_embeds_block_digests[0]"),
        ({"mm": [{"id": "a", "offset": 8, "length": 2}, {"id": "b", "offset": 0, "length": 2}]}, "$.mm"),
    ],
)
def test_bad_input_exits_2_naming_the_field(monkeypatch, capsysbinary, change, field):
    request = {"algo": "sha256_cbor", "seed": "0", "block_size": 4, "token_ids": [1, 2, 3, 4], **change}
    status, out, err = run_hash(monkeypatch, capsysbinary, json.dumps(request).encode())
    assert status == 2 and out == b""
    assert err.startswith(b"kvmiss hash: bad input: ") and field.encode() in err


def test_runs_as_a_module_in_a_fresh_process():
    case = vector_case("bs16_len100_lora_salt_mm")
    result = case["results"][1]
    proc = subprocess.run(
        [sys.executable, "-m", "kvmiss.enricher.cli", "hash"],
        input=json.dumps(request_of(case, result)).encode(),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["block_hashes"] == result["block_hashes_external_int"]
    bad = subprocess.run(
        [sys.executable, "-m", "kvmiss.enricher.cli", "hash"],
        input=b"{}",
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2 and b"algo" in bad.stderr
