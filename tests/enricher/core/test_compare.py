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
    assert out["first_differing_block"] == 0 and out["first_differing_token"] is None
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


ALL_KEYS = {"result", "shared_blocks", "shared_tokens", "block_size", "reference_blocks", "candidate_blocks",
            "first_differing_block", "first_differing_token", "cause", "differing_kinds", "digests"}


@pytest.mark.parametrize("setting, value", [("block_size", 32), ("algo", "sha256"), ("seed", "1"),
                                            ("extra_keys_format", "untagged"), ("lookahead_tokens", 1)])
def test_a_candidate_described_with_other_engine_settings_is_an_error_naming_the_setting(tmp_path, setting, value):
    proc, out = run_compare(tmp_path, prompt(render()), {**prompt(render()), setting: value})
    assert proc.returncode == 2 and out is None
    assert f"{setting} differs" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_candidate_shorter_than_one_block_gets_a_result_of_its_own_with_every_key(tmp_path):
    proc, out = run_compare(tmp_path, prompt(render()), prompt(render()[:3]))
    assert proc.returncode == 0 and out["result"] == "shorter_than_one_block"
    assert set(out) == ALL_KEYS and out["candidate_blocks"] == 0 and out["shared_tokens"] == 0


def test_a_strict_prefix_on_either_side_is_named_not_called_identical(tmp_path):
    full = render()
    prefix = full[:len(full) // 2]
    proc, out = run_compare(tmp_path, prompt(full), prompt(prefix))
    assert out["result"] == "candidate_is_prefix" and out["shared_blocks"] == out["candidate_blocks"] < out["reference_blocks"]
    proc, out = run_compare(tmp_path, prompt(prefix), prompt(full))
    assert out["result"] == "reference_is_prefix" and out["shared_blocks"] == out["reference_blocks"] < out["candidate_blocks"]
    assert set(out) == ALL_KEYS


def test_every_result_carries_every_key(tmp_path):
    cases = [(render(), render()), (render(), render(preamble="X")),
             (render(), render()[:40]), (render()[:3], render())]
    for ref, cand in cases:
        _, out = run_compare(tmp_path, prompt(ref), prompt(cand))
        assert set(out) == ALL_KEYS, out["result"]


def test_a_failed_expectation_says_what_was_expected_and_what_was_shared_in_one_line(tmp_path):
    proc, out = run_compare(tmp_path, prompt(render()), prompt(render(preamble="Now: 12:00\n")),
                            "--expect-shared-tokens", "48")
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert "expected at least 48 shared tokens, shared 0" in line and "diverged" in line


def test_digests_without_a_key_are_said_to_be_for_this_run_only(tmp_path):
    proc, out = run_compare(tmp_path, prompt(render(), cache_salt="tenant-a"), prompt(render(), cache_salt="tenant-b"))
    assert out["digests"] and "stable across runs" in proc.stderr
    proc, out = run_compare(tmp_path, prompt(render(), cache_salt="tenant-a"), prompt(render(), cache_salt="tenant-b"),
                            "--digest-key-env", "CMP_KEY")
    assert out["digests"] and proc.stderr == ""
    _, again = run_compare(tmp_path, prompt(render(), cache_salt="tenant-a"), prompt(render(), cache_salt="tenant-b"),
                           "--digest-key-env", "CMP_KEY")
    assert again["digests"] == out["digests"]


def test_an_empty_file_is_said_to_be_empty(tmp_path):
    ref, cand = tmp_path / "ref.json", tmp_path / "cand.json"
    ref.write_text(json.dumps(prompt(render())))
    cand.write_text("")
    proc = subprocess.run([sys.executable, "-m", "kvmiss.enricher.cli", "compare", str(ref), str(cand)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "candidate" in proc.stderr and "empty" in proc.stderr
