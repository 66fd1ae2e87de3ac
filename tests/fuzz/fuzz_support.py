"""Shared pieces of the fuzz suite: the example budget, the seed corpus (the frames and hash
vectors captured from the real engines in shared/reference/data), and the mutators.

Budget: every property runs a small fixed number of examples by default so the whole suite
stays within ~20 s in CI; ``KVMISS_FUZZ_EXAMPLES=N`` runs N examples per property instead
(the documented long run, see benchmarks/fuzz_long.sh). Hypothesis keeps failing examples
in its database and replays them first on the next run.

The seed corpus is read lazily (inside a test), so a missing shared/ skips the tests that
need it instead of breaking collection (tests/shared_data.py).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import logging
import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import msgspec
from hypothesis import HealthCheck, settings, strategies as st
from shared_data import load_json

VLLM_FRAMES = "vllm-0.33.0-event-frames.json"
SGLANG_FRAMES = "sglang-0.5.23-event-frames.json"
VECTORS = "vllm-0.33.0-hash-vectors.json"

# A parser that runs longer than this on one input counts as hanging.
PER_INPUT_DEADLINE = timedelta(seconds=5)


def examples(default: int) -> int:
    """``KVMISS_FUZZ_EXAMPLES`` when set (long runs), else the CI default."""
    raw = os.environ.get("KVMISS_FUZZ_EXAMPLES", "").strip()
    return int(raw) if raw else default


def fuzz_settings(default: int) -> settings:
    return settings(
        max_examples=examples(default),
        deadline=PER_INPUT_DEADLINE,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.filter_too_much, HealthCheck.large_base_example],
    )


# --- seed corpus -------------------------------------------------------------------------


def _b64(frames: list[str]) -> list[bytes]:
    return [base64.b64decode(f) for f in frames]


@functools.cache
def captured_messages() -> tuple[tuple[tuple[bytes, ...], str], ...]:
    """Every multipart message the real publishers sent, with the socket it arrived on."""
    out: list[tuple[tuple[bytes, ...], str]] = []
    for pub in load_json(VLLM_FRAMES)["publishers"]:
        for message in pub["live"]:
            out.append((tuple(_b64(message["frames_b64"])), "sub"))
        for replay in pub["replay"]:
            for reply in replay["replies"]:
                frames = _b64(reply["frames_b64"])
                # A REQ client sees the reply with its delimiter stripped: 3 frames.
                out.append((tuple(frames), "dealer" if frames and frames[0] == b"" else "sub"))
    for message in load_json(SGLANG_FRAMES)["frames"]:
        if message["channel"] == "replay-request":
            continue
        out.append((tuple(_b64(message["frames_b64"])), "dealer" if message["channel"] == "replay" else "sub"))
    return tuple(out)


@functools.cache
def captured_payloads() -> tuple[bytes, ...]:
    """Every msgpack batch payload in the captures (the last frame of each batch message)."""
    payloads = {frames[-1] for frames, _ in captured_messages() if frames and frames[-1]}
    return tuple(sorted(payloads))


@functools.cache
def hash_requests() -> tuple[dict, ...]:
    """`kvmiss hash` / `kvmiss compare` inputs built from the vLLM hash-vector cases."""
    out = []
    for case in load_json(VECTORS)["cases"]:
        lora, digests = case["lora_request"], case["prompt_embeds_block_digests"]
        for result in case["results"][:4]:
            out.append({
                "algo": result["hash_fn"],
                "seed": result["PYTHONHASHSEED"] if result["PYTHONHASHSEED"] is not None else "0",
                "block_size": case["block_size"],
                "token_ids": case["token_ids"],
                "lora": {"name": lora["lora_name"], "path": lora["lora_path"]} if lora else None,
                "cache_salt": case["cache_salt"],
                "mm": [{"id": m["identifier"], "offset": m["offset"], "length": m["length"]}
                       for m in case["mm_features"]],
                "prompt_embeds_block_digests": [d["sha256_hex"] for d in digests] if digests else None,
                "extra_keys_format": "tagged",
                "lookahead_tokens": case["num_hash_lookahead_tokens"],
            })
    return tuple(out)


def seeds(load: Callable[[], tuple]) -> st.SearchStrategy:
    """One item of a lazily loaded corpus (loaded at draw time, inside the test)."""
    return st.deferred(lambda: st.sampled_from(load()))


# --- garbage and mutations ---------------------------------------------------------------

INT_EDGES = [0, 1, -1, 2**31 - 1, -2**31, 2**32, 2**53 + 1, 2**63 - 1, -2**63, 2**63, 2**64 - 1]
FLOAT_EDGES = [0.0, -0.0, 1e308, -1e308, 5e-324, float("inf"), float("-inf"), float("nan")]

scalars = (
    st.none() | st.booleans()
    | st.sampled_from(INT_EDGES) | st.integers(-2**63, 2**64 - 1)
    | st.sampled_from(FLOAT_EDGES) | st.floats()
    | st.text(max_size=24) | st.binary(max_size=40)
)


def nested(depth: int, kind: str = "array") -> msgspec.Raw:
    """msgpack nested ``depth`` deep, as raw bytes (the encoder itself would recurse)."""
    head = b"\x91" if kind == "array" else b"\x81\xa1k"
    return msgspec.Raw(head * depth + b"\xc0")


def _containers(children: st.SearchStrategy) -> st.SearchStrategy:
    keys = st.text(max_size=8) | st.integers(-5, 5) | st.none() | st.booleans() | st.floats()
    return st.lists(children, max_size=4) | st.dictionaries(keys, children, max_size=4)


# Application ext types; -1 is msgpack's timestamp, valid only with 4, 8 or 12 data bytes.
ext_values = st.builds(msgspec.msgpack.Ext, st.integers(-128, 127).filter(lambda c: c != -1),
                       st.binary(max_size=12))
any_ext = st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=12))

# Any valid msgpack value a publisher could send, nested a few levels.
msgpack_values = st.recursive(scalars | ext_values, _containers, max_leaves=12)

# ... and hostile ones: bad timestamps, nesting thousands deep (past any recursion limit).
msgpack_garbage = st.recursive(
    scalars | any_ext
    | st.integers(1, 5000).map(nested)
    | st.integers(1, 5000).map(lambda n: nested(n, "map")),
    _containers,
    max_leaves=12,
)


def _paths(obj: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(obj, list):
        for i, value in enumerate(obj):
            out.extend(_paths(value, (*path, i)))
    elif isinstance(obj, dict):
        for key, value in list(obj.items()):
            out.extend(_paths(value, (*path, key)))
    return out


def _get(obj: Any, path: tuple) -> Any:
    for step in path:
        obj = obj[step]
    return obj


@st.composite
def mutate_tree(draw, tree: Any, garbage: st.SearchStrategy) -> Any:
    """Structural mutations of a decoded document (edited in place; pass a fresh copy):
    replace a node with garbage, delete it, add a sibling, truncate or duplicate a list."""
    for _ in range(draw(st.integers(1, 4))):
        paths = _paths(tree)
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["replace", "delete", "insert", "truncate", "duplicate"]))
        if not path or op == "replace":
            if not path:
                tree = draw(garbage)
                continue
            _get(tree, path[:-1])[path[-1]] = draw(garbage)
            continue
        parent, key = _get(tree, path[:-1]), path[-1]
        if op == "delete":
            del parent[key]
        elif op == "insert":
            if isinstance(parent, list):
                parent.insert(draw(st.integers(0, len(parent))), draw(garbage))
            else:
                parent[draw(st.text(max_size=12))] = draw(garbage)
        elif op == "truncate" and isinstance(parent, list):
            del parent[draw(st.integers(0, len(parent))):]
        elif op == "duplicate" and isinstance(parent, list):
            parent.extend(parent[: draw(st.integers(0, 3))])
    return tree


@st.composite
def mutate_bytes(draw, data: bytes, pool: tuple[bytes, ...] = ()) -> bytes:
    """Byte-level mutations: truncate, flip bits, set/insert/delete bytes, splice with
    another corpus item, repeat a slice."""
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 5))):
        op = draw(st.sampled_from(["truncate", "flip", "set", "insert", "delete", "splice", "repeat"]))
        n = len(buf)
        if op == "truncate":
            del buf[draw(st.integers(0, n)):]
        elif op == "flip" and n:
            i = draw(st.integers(0, n - 1))
            buf[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and n:
            buf[draw(st.integers(0, n - 1))] = draw(st.sampled_from([0x00, 0xFF, 0x7F, 0x80, 0xC1, 0xDC, 0xDD, 0xDE, 0xDF, 0xC4, 0xD9]))
        elif op == "insert":
            i = draw(st.integers(0, n))
            buf[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and n:
            i = draw(st.integers(0, n - 1))
            del buf[i:i + draw(st.integers(1, 8))]
        elif op == "splice" and pool:
            other = draw(st.sampled_from(pool))
            buf = buf[: draw(st.integers(0, n))] + other[draw(st.integers(0, len(other))):]
        elif op == "repeat" and n:
            i = draw(st.integers(0, n - 1))
            buf[i:i] = buf[i:i + draw(st.integers(1, 16))] * draw(st.integers(1, 4))
    return bytes(buf)


# --- log capture (the privacy tests) ------------------------------------------------------


class CapturedLogs(logging.Handler):
    """Every record of every logger, rendered in full (message, args, exception, stack)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.texts: list[str] = []
        self._format = logging.Formatter("%(name)s %(levelname)s %(message)s")

    def emit(self, record: logging.LogRecord) -> None:
        text = self._format.format(record)
        if record.exc_info and record.exc_info[1] is not None:
            text += "".join(traceback.format_exception(record.exc_info[1]))
        self.texts.append(f"{text} {record.args!r}")


@contextlib.contextmanager
def all_logs_at_debug():
    """Capture every log record of every logger (kvmiss's and third parties'), levels and
    `logging.disable` lifted for the duration, restored afterwards."""
    handler = CapturedLogs()
    root = logging.getLogger()
    saved = root.level, logging.root.manager.disable
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)]
    levels = [(lg, lg.level, lg.disabled) for lg in loggers if isinstance(lg, logging.Logger)]
    logging.disable(logging.NOTSET)
    root.setLevel(logging.DEBUG)
    for lg, _, _ in levels:
        lg.setLevel(logging.NOTSET)
        lg.disabled = False
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(saved[0])
        logging.disable(saved[1])
        for lg, level, disabled in levels:
            lg.setLevel(level)
            lg.disabled = disabled
