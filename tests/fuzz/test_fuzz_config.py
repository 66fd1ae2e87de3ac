"""The configuration file: any text gives a `Config` or a `ConfigError` (never another
exception); a valid config written back as TOML loads to the same config; the digest secret
never shows in a repr or an error."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
from fuzz_support import fuzz_settings, mutate_bytes
from hypothesis import given, strategies as st

from kvmiss.schemas.config import Config, ConfigError, parse_config

EXAMPLE = (Path(__file__).resolve().parents[2] / "examples" / "kvmiss.toml").read_text()
SECRET_MARK = "S3CRET-fuzz-"


# --- a small TOML writer for generated documents -----------------------------------------


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(type(value))


def to_toml(document: dict) -> str:
    """Scalars and inline values first, then ``[table]``s, then ``[[array.of.tables]]``."""
    lines, tables, arrays = [], [], []
    for key, value in document.items():
        if isinstance(value, dict):
            tables.append((key, value))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            arrays.append((key, value))
        else:
            lines.append(f"{json.dumps(key)} = {toml_value(value)}")
    for key, table in tables:
        lines.append(f"[{json.dumps(key)}]")
        lines.extend(f"{json.dumps(k)} = {toml_value(v)}" for k, v in table.items())
    for key, items in arrays:
        for item in items:
            lines.append(f"[[{json.dumps(key)}]]")
            lines.extend(f"{json.dumps(k)} = {toml_value(v)}" for k, v in item.items())
    return "\n".join(lines) + "\n"


def config_document(config: Config) -> dict:
    """A config as the TOML document that gives it (None: the key is left out)."""
    def drop_none(value):
        if isinstance(value, dict):
            return {k: drop_none(v) for k, v in value.items() if v is not None}
        if isinstance(value, list):
            return [drop_none(v) for v in value]
        return value
    return drop_none(msgspec.to_builtins(config))


# --- structured generation ---------------------------------------------------------------

toml_scalars = (st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats() | st.text(max_size=24)
                | st.sampled_from(["", "127.0.0.1:0", "0.0.0.0:4317", "tcp://h:5557", "tcp://h:" + "9" * 6000,
                                   "tcp://*:5557", "inproc://x", "sha256", "tagged", "\u0663"]))
def _toml_containers(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(children, max_size=3) | st.dictionaries(st.text(min_size=1, max_size=8), children, max_size=3)


toml_values = st.recursive(toml_scalars, _toml_containers, max_leaves=6)
# Replay endpoints are connected to: no "*" host, no port 0 (the config refuses both).
endpoints = st.sampled_from(["tcp://127.0.0.1:5557", "tcp://h:5558", "ipc:///tmp/x", "inproc://kv", "tcp://[::1]:6000"])
# grpc, http and metrics: never two on one port (the config refuses it); off ("") and port 0 may repeat.
listen_sets = st.permutations(["127.0.0.1:4317", "[::1]:4318", ":9464", "127.0.0.1:0", "", "127.0.0.1:0"])
secrets_ = st.text(min_size=8, max_size=24).map(lambda s: SECRET_MARK + s)


@st.composite
def valid_documents(draw) -> dict:
    ids = draw(st.lists(st.text(min_size=1, max_size=6), max_size=3, unique=True))
    workers = []
    for i, worker_id in enumerate(ids):
        worker = {"id": worker_id, "endpoint": f"tcp://127.0.0.1:{5000 + 10 * i}",
                  "dp_rank": draw(st.integers(0, 4)), "topic": draw(st.text(max_size=6)),
                  "bind": draw(st.booleans()), "offset_by_rank": draw(st.booleans())}
        if draw(st.booleans()):
            worker["replay_endpoint"] = draw(endpoints)
        if draw(st.booleans()):
            worker["topic_template"] = "kv@{instance}@{model}"
        workers.append(worker)
    privacy = draw(st.sampled_from([{}, {"digest_key": draw(secrets_)}, {"digest_key_env": "KVMISS_KEY"}]))
    grpc, http, listen = draw(listen_sets)[:3]
    return {
        "otlp": {"grpc": grpc, "http": http,
                 "max_body_bytes": draw(st.integers(1, 2**40)), "max_pending_spans": draw(st.integers(1, 10**9)),
                 "max_spans_per_s_per_client": draw(st.floats(0, 1e9)), "max_connections": draw(st.integers(0, 10**6)),
                 "body_timeout_s": draw(st.floats(0.001, 1e6))},
        "export": {"keep_block_hashes": draw(st.booleans()), "timeout_s": draw(st.floats(0.001, 1e6)),
                   **({"endpoint": "http://127.0.0.1:4319"} if draw(st.booleans()) else {})},
        "engine": {"hash_algo": draw(st.sampled_from(["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])),
                   "block_size": draw(st.integers(1, 2**20)),
                   "extra_keys_format": draw(st.sampled_from(["tagged", "untagged"])),
                   **({"hash_seed": draw(st.text(max_size=6))} if draw(st.booleans()) else {})},
        "workers": workers,
        "privacy": privacy,
        "metrics": {"listen": listen, "unknown_budget": draw(st.floats(0, 1))},
        "history": {"retention_s": draw(st.floats(0.001, 1e9)), "wait_s": draw(st.floats(0, 1e6)),
                    "assemble_wait_s": draw(st.floats(0, 1e6)),
                    "aged_out_as_recent_match": draw(st.booleans())},
        "attributes": {"worker": draw(st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=3))},
    }


def checked_parse(text: str) -> Config | None:
    try:
        config = parse_config(text, source="fuzz.toml")
    except ConfigError as err:
        assert str(err).startswith("fuzz.toml")
        assert SECRET_MARK not in str(err)
        return None
    assert isinstance(config, Config)
    assert SECRET_MARK not in repr(config) and SECRET_MARK not in str(config)
    return config


@fuzz_settings(35)
@given(valid_documents())
def test_a_valid_config_round_trips_through_toml(document):
    config = checked_parse(to_toml(document))
    assert config is not None, to_toml(document)
    assert checked_parse(to_toml(config_document(config))) == config


@st.composite
def mutated_documents(draw) -> dict:
    document = draw(valid_documents())
    for _ in range(draw(st.integers(1, 3))):
        section = draw(st.sampled_from(sorted(document) + ["bogus"]))
        target = document.setdefault(section, {})
        if isinstance(target, list):
            target = target[0] if target else document
        if not isinstance(target, dict):  # replaced by a scalar or list earlier
            target = document
        op = draw(st.sampled_from(["wrong_type", "unknown_key", "delete", "replace_section", "duplicate_worker"]))
        if op == "wrong_type" and target:
            target[draw(st.sampled_from(sorted(target)))] = draw(toml_values)
        elif op == "unknown_key":
            target[draw(st.text(min_size=1, max_size=8))] = draw(toml_values)
        elif op == "delete" and target:
            del target[draw(st.sampled_from(sorted(target)))]
        elif op == "replace_section":
            document[section] = draw(toml_values)
        elif op == "duplicate_worker" and isinstance(document.get("workers"), list) and document["workers"]:
            document["workers"].append(document["workers"][0])
    return document


@fuzz_settings(70)
@given(mutated_documents())
def test_mutated_configs_load_or_raise_config_error(document):
    try:
        text = to_toml(document)
    except TypeError:
        return
    checked_parse(text)


@fuzz_settings(70)
@given(st.data())
def test_mutated_config_text_loads_or_raises_config_error(data):
    base = data.draw(st.sampled_from([EXAMPLE, to_toml(data.draw(valid_documents()))]))
    how = data.draw(st.sampled_from(["bytes", "lines", "deep"]))
    if how == "bytes":
        text = data.draw(mutate_bytes(base.encode())).decode("utf-8", "replace")
    elif how == "lines":
        lines = base.splitlines()
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, max(0, len(lines) - 1)))
            op = data.draw(st.sampled_from(["delete", "duplicate", "insert"]))
            if op == "delete" and lines:
                del lines[i]
            elif op == "duplicate" and lines:
                lines.insert(i, lines[i])
            else:
                lines.insert(i, data.draw(st.sampled_from(["[otlp]", "[[workers]]", "x = 1", "[privacy]",
                                                            'digest_key = "' + SECRET_MARK + 'line-0001"',
                                                            "dp_rank = -1", "block_size = 0"])))
        text = "\n".join(lines)
    else:  # nested far past the recursion limit: inline arrays or tables
        depth = data.draw(st.sampled_from([10, 500, 990, 1000, 3000]) | st.integers(10, 20_000))
        nest = "[" * depth + "]" * depth if data.draw(st.booleans()) else "{a = " * depth + "1" + "}" * depth
        text = f"nested = {nest}\n" + base  # a top-level key, before any table
    checked_parse(text)


@fuzz_settings(20)
@given(st.text(max_size=200))
def test_arbitrary_text_loads_or_raises_config_error(text):
    checked_parse(text)
