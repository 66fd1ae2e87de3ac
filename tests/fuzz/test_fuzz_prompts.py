"""`kvmiss hash` and `kvmiss compare` inputs (prompt JSON): `compute` raises only
`InputError`; `compare` exits 0/1/2 with one JSON object or one stderr line, never a traceback,
and never prints a token id, salt or adapter path unless --show-snippet asks for tokens."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import tempfile

from fuzz_support import fuzz_settings, hash_requests, mutate_bytes, mutate_tree, seeds
from hypothesis import given, strategies as st

from kvmiss.enricher.cli import compare_cmd
from kvmiss.enricher.cli.hash_cmd import InputError, compute

_DIR = tempfile.mkdtemp(prefix="kvmiss-fuzz-compare-")
MARK = "PRIV-"  # salts and adapter paths below carry it; output must not

def _json_containers(children: st.SearchStrategy) -> st.SearchStrategy:
    keys = st.sampled_from(["name", "path", "id", "offset", "length"]) | st.text(max_size=5)
    return st.lists(children, max_size=3) | st.dictionaries(keys, children, max_size=3)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=10) | st.sampled_from(["sha256", "xxhash", "tagged", "zz", "00" * 32]),
    _json_containers,
    max_leaves=8,
)


@st.composite
def prompt_documents(draw) -> dict:
    """A vector case (real tokens, LoRA, salt, mm, prompt embeds) as compare/hash input,
    edited: tokens changed, extra keys changed, fields of the wrong type, unknown fields."""
    doc = json.loads(json.dumps(draw(seeds(hash_requests))))
    if doc.get("lora"):
        doc["lora"]["path"] = MARK + draw(st.text(max_size=8))
    if doc.get("cache_salt") or draw(st.booleans()):
        doc["cache_salt"] = MARK + draw(st.text(max_size=8))
    edit = draw(st.sampled_from(["none", "tokens", "tail", "block_size", "tree"]))
    if edit == "tokens" and doc["token_ids"]:
        i = draw(st.integers(0, len(doc["token_ids"]) - 1))
        doc["token_ids"][i] = draw(st.integers(0, 2**64 + 5))
    elif edit == "tail":
        doc["token_ids"] = doc["token_ids"][: draw(st.integers(0, len(doc["token_ids"])))]
    elif edit == "block_size":
        doc["block_size"] = draw(st.sampled_from([1, 2, 3, 2**31, 2**63, 0, -1]))
        doc["lookahead_tokens"] = draw(st.sampled_from([0, 1, 5, 2**40]))
    elif edit == "tree":
        doc = draw(mutate_tree(doc, json_values))
    return doc


def _bytes(doc) -> bytes:
    return json.dumps(doc).encode()


@fuzz_settings(40)
@given(prompt_documents(), st.data())
def test_hash_input_hashes_or_raises_input_error(doc, data):
    raw = _bytes(doc)
    if data.draw(st.booleans()):
        raw = data.draw(mutate_bytes(raw))
    try:
        out = compute(raw)
    except InputError as err:
        assert MARK not in str(err)
        return
    assert len(out["block_hashes"]) == len(out["block_hashes_hex"])
    assert all(0 <= h < 2**64 for h in out["block_hashes"])


def run_compare(reference: bytes, candidate: bytes, **flags) -> tuple[int, str, str]:
    paths = []
    for name, body in (("ref.json", reference), ("cand.json", candidate)):
        path = os.path.join(_DIR, name)
        with open(path, "wb") as f:
            f.write(body)
        paths.append(path)
    args = argparse.Namespace(reference=paths[0], candidate=paths[1], expect_shared_tokens=flags.get("expect"),
                              digest_key_env=None, show_snippet=flags.get("snippet", False))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = compare_cmd.run(args)
    return status, out.getvalue(), err.getvalue()


@fuzz_settings(40)
@given(prompt_documents(), prompt_documents(), st.data())
def test_compare_exits_0_1_or_2_with_one_json_object_or_one_error_line(ref, cand, data):
    ref_bytes, cand_bytes = _bytes(ref), _bytes(cand)
    if data.draw(st.booleans()):
        cand_bytes = data.draw(mutate_bytes(cand_bytes))
    expect = data.draw(st.none() | st.integers(0, 200))
    snippet = data.draw(st.booleans())
    status, out, err = run_compare(ref_bytes, cand_bytes, expect=expect, snippet=snippet)
    assert MARK not in out and MARK not in err  # salts and adapter paths never shown
    if status == 2:
        assert out == "" and err.startswith("kvmiss compare: ") and err.count("\n") == 1
        return
    assert status in (0, 1)
    result = json.loads(out)
    assert result["result"] in ("identical_chain", "candidate_is_prefix", "reference_is_prefix",
                                "shorter_than_one_block", "diverged")
    assert status == (1 if expect is not None and result["shared_tokens"] < expect else 0)
    notes = err.splitlines()
    assert all(line.startswith("kvmiss compare: ") for line in notes)
    assert len(notes) == (status == 1) + bool(result["digests"])  # the failed expectation, the run-only key
    if not snippet:
        assert "snippet" not in result


@fuzz_settings(20)
@given(seeds(hash_requests))
def test_a_prompt_compared_with_itself_is_one_identical_chain(doc):
    body = _bytes(doc)
    status, out, err = run_compare(body, body)
    assert (status, err) == (0, "")
    result = json.loads(out)
    assert result["result"] == ("identical_chain" if result["reference_blocks"] else "shorter_than_one_block")
    assert result["reference_blocks"] == result["candidate_blocks"] == result["shared_blocks"]
