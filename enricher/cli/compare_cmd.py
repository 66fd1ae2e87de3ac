"""`kvmiss compare REFERENCE.json CANDIDATE.json`: where two prompt renderings stop sharing
cached blocks (for application CI).

Each file (``-``: stdin, for one of the two) is a `kvmiss hash` input object (token ids plus
extra keys, and the engine settings ``algo``/``block_size``/``seed``/``extra_keys_format``/``lookahead_tokens``, which
must be the same on both sides: a difference is bad input naming the setting). Prints one
JSON object with every key present: ``identical_chain``, ``candidate_is_prefix``,
``reference_is_prefix``, ``shorter_than_one_block``, or ``diverged`` with the first differing
block and token index, or the extra-key kinds that differ with keyed digests of each side.
Token values and salts are never printed unless ``--show-snippet`` is given.

Exit status: 0; 1 when the prompts share fewer tokens than ``--expect-shared-tokens`` (one
line on stderr says what was expected and what was shared); 2 on bad input. Digests use the
key in ``--digest-key-env`` when given, else a key made for this run (then they can only be
compared within one output, and stderr says so when digests are printed).
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys

import msgspec

from kvmiss.enricher.core.compare import compare, snippet
from kvmiss.enricher.core.hashing import HashingError
from kvmiss.enricher.core.privacy import DigestKey, DigestKeyError, load_digest_key
from kvmiss.schemas.prompt import HashRequest

_decoder = msgspec.json.Decoder(HashRequest)


# Shown under `kvmiss compare --help`: what it reads, in one schema line, and one example.
HELP_INPUT = """\
input:    two files ('-': stdin for one), each one `kvmiss hash` input object (see `kvmiss hash --help`): {"algo",
          "block_size", "token_ids", "seed", "cache_salt", "lora", "mm", ...}; both must name the same
          engine settings (algo, block_size, seed, extra_keys_format, lookahead_tokens)
results:  identical_chain, candidate_is_prefix, reference_is_prefix, shorter_than_one_block, diverged
digests:  keyed with the secret in --digest-key-env (stable across runs); without it, a key made
          for this run (comparable only within one output)
example:  KEY=$(openssl rand -hex 16) kvmiss compare ref.json cand.json --digest-key-env KEY --expect-shared-tokens 256
"""

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("reference", help="reference prompt (kvmiss hash input JSON; '-': stdin)")
    parser.add_argument("candidate", help="candidate prompt (kvmiss hash input JSON; '-': stdin)")
    parser.add_argument("--expect-shared-tokens", type=int, default=None,
                        help="exit 1 if the prompts share fewer cacheable tokens than this")
    parser.add_argument("--digest-key-env", help="environment variable holding the digest secret")
    parser.add_argument("--show-snippet", action="store_true",
                        help="also print token ids around the divergence (prompt material!)")


def _load(path: str, role: str) -> HashRequest:
    try:
        if path == "-":
            raw = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as f:
                raw = f.read()
        if not raw.strip():
            raise ValueError(f"{role} {path}: the file is empty: expected one `kvmiss hash` input object")
        return _decoder.decode(raw)
    except OSError as exc:
        raise ValueError(f"{role} {path}: {exc.strerror}") from None
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"{role} {path}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    try:
        if args.reference == args.candidate == "-":
            raise ValueError("only one of the two prompts can come from stdin ('-')")
        reference = _load(args.reference, "reference")
        candidate = _load(args.candidate, "candidate")
        key = (load_digest_key(None, args.digest_key_env) if args.digest_key_env
               else DigestKey(secrets.token_bytes(32)))
        result = compare(reference, candidate, digest=lambda text: key.digest_text(text))
    except (ValueError, HashingError, DigestKeyError) as exc:
        # One line, even when the input put a newline into the message (an unknown key).
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(exc))
        print(f"kvmiss compare: {text}", file=sys.stderr)
        return 2
    out = msgspec.to_builtins(result)
    if args.show_snippet and result.first_differing_token is not None:
        out["snippet"] = snippet(reference, candidate, result.first_differing_token)
    print(json.dumps(out))
    if result.digests and not args.digest_key_env:
        print("kvmiss compare: digests use a key made for this run; pass --digest-key-env NAME "
              "(a variable holding a secret) for digests stable across runs", file=sys.stderr)
    if args.expect_shared_tokens is not None and result.shared_tokens < args.expect_shared_tokens:
        where = (f", first differing block {result.first_differing_block}"
                 if result.first_differing_block is not None else "")
        print(f"kvmiss compare: expected at least {args.expect_shared_tokens} shared tokens, "
              f"shared {result.shared_tokens} ({result.result.value}{where})", file=sys.stderr)
        return 1
    return 0
