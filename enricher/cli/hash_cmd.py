"""`kvmiss hash`: one request in, its vLLM-compatible block hashes out (JSON).

Input, one JSON object on stdin::

    {"algo": "sha256_cbor",            # sha256 | sha256_cbor | xxhash | xxhash_cbor
     "seed": "0",                      # the engines' PYTHONHASHSEED, or null when unset
     "block_size": 16,                 # tokens per block
     "token_ids": [...],               # the prompt (and any generated tokens), in order
     "lora": {"name": "...", "path": "..."},           # or null; path needed when tagged
     "cache_salt": "...",              # or null
     "mm": [{"id": "...", "offset": 20, "length": 30}],
     "prompt_embeds_block_digests": ["<hex>", ...],    # or null: one per full block
     "extra_keys_format": "tagged",    # tagged (vLLM 0.31+) | untagged (0.20-0.30)
     "lookahead_tokens": 0}            # vLLM num_hash_lookahead_tokens (EAGLE/MTP)

Only ``algo``, ``block_size`` and ``token_ids`` are required. Each ``mm`` item is one
multimodal input's placeholder span: ``offset`` is the prompt index of its first placeholder
token and ``length`` its number of tokens; items are sorted by offset and do not overlap.
An item overlaps block ``[s, s + B)`` iff ``offset < s + B and offset + length > s``, and its
extra key carries ``offset - s`` (negative for a block holding the item's tail).

Output, one JSON object: ``{"none_hash_hex": ..., "block_hashes_hex": [...],
"block_hashes": [...]}``; ``block_hashes`` are the uint64 ints vLLM publishes in KV events.
Only full blocks have hashes. Unknown fields, wrong types and inputs that cannot give a
reproducible hash exit with status 2 and a message on stderr naming the field.
"""

from __future__ import annotations

import argparse
import sys
from typing import IO

import msgspec

from kvmiss.schemas.prompt import HashRequest

_decoder = msgspec.json.Decoder(HashRequest)
_encoder = msgspec.json.Encoder()


class InputError(ValueError):
    """Bad input; the message names the field."""


# Shown under `kvmiss hash --help`: what it reads, in one schema line, and one example.
HELP_INPUT = """\
input:    stdin, one JSON object: {"algo": "sha256_cbor", "block_size": 16, "token_ids": [...],
          "seed": "0", "cache_salt": ..., "lora": {"name", "path"}, "mm": [{"id", "offset", "length"}],
          "prompt_embeds_block_digests": [...], "extra_keys_format": "tagged", "lookahead_tokens": 0}
          (only algo, block_size and token_ids are required; docs/COMMANDS.md, "kvmiss hash input")
output:   {"none_hash_hex", "block_hashes_hex", "block_hashes"} (uint64, as engines publish them)
example:  echo '{"algo": "sha256_cbor", "seed": "0", "block_size": 2, "token_ids": [1, 2, 3, 4]}' | kvmiss hash
"""

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options: the whole request is read from stdin."""


def compute(raw: bytes) -> dict:
    """Decode one request and hash it; raises `InputError` naming the field at fault."""
    from kvmiss.enricher.core.hashing import BlockHasher, HashingError, external_hash, extras_from_spec

    if not raw.strip():
        raise InputError("the input is empty: expected one JSON object on stdin (kvmiss hash --help shows its fields)")
    try:
        req = _decoder.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise InputError(str(exc)) from None
    try:
        extras = extras_from_spec(req)
    except HashingError as exc:
        raise InputError(str(exc)) from None
    try:
        hasher = BlockHasher(
            req.algo,
            seed=req.seed,
            block_size=req.block_size,
            extra_keys_format=req.extra_keys_format,
            lookahead_tokens=req.lookahead_tokens,
        )
        hashes = hasher.hash_request(req.token_ids, extras)
    except HashingError as exc:  # messages name the field (seed, lora.path, prompt embeds)
        raise InputError(str(exc)) from None
    return {
        "none_hash_hex": hasher.none_hash.hex(),
        "block_hashes_hex": [h.hex() for h in hashes],
        "block_hashes": [external_hash(h) for h in hashes],
    }


def run(
    args: argparse.Namespace,
    stdin: IO[bytes] | None = None,
    stdout: IO[bytes] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout.buffer
    stderr = stderr or sys.stderr
    try:
        out = compute(stdin.read())
    except InputError as exc:
        stderr.write(f"kvmiss hash: bad input: {exc}\n")
        return 2
    stdout.write(_encoder.encode(out) + b"\n")
    stdout.flush()
    return 0
