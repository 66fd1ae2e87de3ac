"""`kvmiss compare`: the first block two renderings stop sharing, and why, without the prompt."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

TOOLS = [
    {"name": "get_weather", "description": "Weather for a city", "parameters": {"city": "string", "units": "string"}},
    {"name": "search", "description": "Search the web for a query string", "parameters": {"query": "string"}},
]
SYSTEM = "You are a careful assistant. Answer briefly and cite sources when you can. " * 3


def tokens(text: str) -> list[int]:
    """Byte-level tokenisation: kvmiss works on token ids, any deterministic tokenizer does."""
    return list(text.encode())


def render(tools=TOOLS, *, preamble: str = "", question: str = "What is the weather in Oslo?") -> list[int]:
    return tokens(preamble + SYSTEM + json.dumps(tools) + "\nUser: " + question)


def prompt(token_ids, **extra) -> dict:
    return {"algo": "sha256_cbor", "seed": "0", "block_size": 16, "token_ids": token_ids, **extra}


def run_compare(tmp_path, reference: dict, candidate: dict, *args: str):
    ref, cand = tmp_path / "ref.json", tmp_path / "cand.json"
    ref.write_text(json.dumps(reference))
    cand.write_text(json.dumps(candidate))
    proc = subprocess.run([sys.executable, "-m", "kvmiss.enricher.cli", "compare", str(ref), str(cand), *args],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "CMP_KEY": "compare-test-secret-0001"})
    return proc, (json.loads(proc.stdout) if proc.stdout.strip() else None)


def test_the_same_tool_definitions_serialised_twice_give_an_identical_chain(tmp_path):
    proc, out = run_compare(tmp_path, prompt(render()), prompt(render(json.loads(json.dumps(TOOLS)))))
    assert proc.returncode == 0 and out["result"] == "identical_chain"
    assert out["shared_tokens"] == out["shared_blocks"] * 16 > 200


def test_reordering_one_field_diverges_in_tokens_at_the_reordered_field(tmp_path):
    reordered = [dict(reversed(list(TOOLS[0].items()))), TOOLS[1]]
    ref, cand = render(), render(reordered)
    first = next(i for i, (a, b) in enumerate(zip(ref, cand)) if a != b)
    proc, out = run_compare(tmp_path, prompt(ref), prompt(cand))
    assert out["result"] == "diverged" and out["cause"] == "tokens"
    assert out["first_differing_token"] == first == len(tokens(SYSTEM)) + 3
    assert out["first_differing_block"] == first // 16 == out["shared_blocks"]


def test_an_injected_timestamp_breaks_the_chain_at_block_zero(tmp_path):
    proc, out = run_compare(tmp_path, prompt(render()),
                            prompt(render(preamble="Now: 2026-11-29T17:55:02Z\n")),
                            "--expect-shared-tokens", "128")
    assert proc.returncode == 1
    assert out["first_differing_token"] == 0 and out["first_differing_block"] == 0 and out["shared_tokens"] == 0


def test_a_different_salt_differs_only_in_extra_keys_at_block_zero(tmp_path):
    proc, out = run_compare(tmp_path, prompt(render(), cache_salt="tenant-a-secret"),
                            prompt(render(), cache_salt="tenant-b-secret"), "--digest-key-env", "CMP_KEY")
    assert out["cause"] == "extra_keys" and out["differing_kinds"] == ["cache_salt"]
    assert out["first_differing_block"] == 0 and "first_differing_token" not in out
    d = out["digests"]["cache_salt"]
    assert d["reference"] != d["candidate"] and d["reference"].count(":") == 1
    assert "tenant-a-secret" not in proc.stdout and "tenant-b-secret" not in proc.stdout


def test_a_different_adapter_differs_in_the_lora_kind(tmp_path):
    proc, out = run_compare(tmp_path, prompt(render(), lora={"name": "support", "path": "/adapters/support-v1"}),
                            prompt(render(), lora={"name": "support", "path": "/adapters/support-v2"}))
    assert out["differing_kinds"] == ["lora"] and out["first_differing_block"] == 0
    assert "/adapters" not in proc.stdout


def test_the_expected_shared_prefix_passes_when_divergence_comes_after_it(tmp_path):
    proc, out = run_compare(tmp_path, prompt(render()), prompt(render(question="And in Bergen?")),
                            "--expect-shared-tokens", str(len(tokens(SYSTEM))))
    assert proc.returncode == 0 and out["result"] == "diverged"


def test_token_values_appear_only_with_show_snippet(tmp_path):
    ref, cand = render(), render(preamble="X")
    proc, out = run_compare(tmp_path, prompt(ref), prompt(cand))
    assert "snippet" not in out
    proc, out = run_compare(tmp_path, prompt(ref), prompt(cand), "--show-snippet")
    assert out["snippet"]["candidate"][0] == ord("X")


@pytest.mark.parametrize("bad", [{"algo": "md5"}, {"token_ids": ["a"]}, {"bogus": 1}])
def test_bad_input_exits_2_naming_the_problem(tmp_path, bad):
    proc, _ = run_compare(tmp_path, prompt(render()), {**prompt(render()), **bad})
    assert proc.returncode == 2 and "candidate" in proc.stderr
