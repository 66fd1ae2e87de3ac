"""The configuration file: every key validated at start-up, errors naming the key."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from kvmiss.schemas.config import ConfigError, OtlpConfig, WorkerSpec, load_config, offset_endpoint, parse_config
from shared_data import load_json

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kvmiss.toml"


def test_the_commented_example_loads():
    config = load_config(EXAMPLE)
    assert config.otlp.grpc == "127.0.0.1:4317" and config.otlp.http == "127.0.0.1:4318"
    assert config.export.endpoint == "http://127.0.0.1:4319"
    assert (config.engine.hash_algo, config.engine.hash_seed, config.engine.block_size) == ("sha256_cbor", "0", 16)
    (worker,) = config.workers
    assert (worker.id, worker.endpoint, worker.replay_endpoint, worker.dp_rank) == (
        "w0", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", 0)
    assert config.metrics.listen == "127.0.0.1:9464"
    assert config.privacy.digest_key_env == "KVMISS_DIGEST_KEY"


@pytest.mark.parametrize("text, fragment", [
    ("[otlp]\ngrcp = '1'\n", "unknown field `grcp`"),
    ("[[workers]]\nid='a'\nendpoint='tcp://h:1'\ndp_rank='1'\n", "workers[0].dp_rank"),
    ("[engine]\nhash_algo='md5'\n", "engine.hash_algo"),
    ("[bogus]\n", "unknown field `bogus`"),
    ("[[workers]]\nid='a'\nendpoint='tcp://h:1'\n[[workers]]\nid='a'\nendpoint='tcp://h:2'\n",
     "duplicate id 'a'"),
    ("[engine]\nblock_size = 0\n", "engine.block_size"),
    ("not toml = = 1", "not valid TOML"),
    ("[attributes]\nworkr = ['x']\n", "unknown field `workr`"),
])
def test_a_bad_key_is_named(text, fragment):
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="k.toml")
    assert fragment in str(info.value) and str(info.value).startswith("k.toml")


@pytest.mark.parametrize("setting, fragment", [
    ("max_spans_per_s_per_client = -1", "otlp.max_spans_per_s_per_client must be a finite number >= 0"),
    ("max_spans_per_s_per_client = nan", "otlp.max_spans_per_s_per_client must be a finite number >= 0"),
    ("max_spans_per_s = inf", "otlp.max_spans_per_s must be a finite number >= 0"),
    ("max_connections = -1", "otlp.max_connections must be between 0 (no cap) and 1000000, got -1"),
    ("max_connections = 2000000", "otlp.max_connections must be between 0 (no cap) and 1000000"),
    ("max_connections = 1.5", "otlp.max_connections"),
    ("max_connections = '10'", "otlp.max_connections"),
])
def test_intake_limits_are_validated_naming_the_key(setting, fragment):
    with pytest.raises(ConfigError) as info:
        parse_config(f"[otlp]\n{setting}\n", source="k.toml")
    assert fragment in str(info.value) and str(info.value).startswith("k.toml")


def test_intake_limit_defaults():
    otlp = parse_config("").otlp
    assert (otlp.max_connections, otlp.max_spans_per_s_per_client, otlp.max_spans_per_s) == (256, 0, 0)
    assert parse_config("[otlp]\nmax_connections = 0\nmax_spans_per_s_per_client = 12.5\n").otlp.max_connections == 0


def test_every_otlp_key_is_in_the_example_with_a_comment():
    """[otlp] holds the listeners and every intake limit: each key is in the example (set, or
    commented out), with a comment on its line saying what it does."""
    section = EXAMPLE.read_text().split("[otlp]\n", 1)[1].split("\n[", 1)[0]
    for field in msgspec.structs.fields(OtlpConfig):
        line = next((l for l in section.splitlines() if re.match(rf"#?\s*{field.name}\s*=", l)), None)
        assert line is not None, f"otlp.{field.name} is missing from examples/kvmiss.toml"
        assert "#" in line.lstrip("# ").split("=", 1)[1], f"otlp.{field.name} has no comment in the example"


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "'30'"])
def test_body_timeout_must_be_a_positive_finite_number_of_seconds(value):
    with pytest.raises(ConfigError) as info:
        parse_config(f"[otlp]\nbody_timeout_s = {value}\n", source="k.toml")
    assert str(info.value).startswith("k.toml: ") and "otlp.body_timeout_s" in str(info.value)


def test_body_timeout_default_and_integers():
    assert parse_config("").otlp.body_timeout_s == 30.0
    assert parse_config("[otlp]\nbody_timeout_s = 5\n").otlp.body_timeout_s == 5.0


def test_a_secret_never_shows_in_errors_or_reprs():
    text = "[privacy]\ndigest_key = 'hunter2-hunter2-hunter2'\ndigest_key_env = 'X'\n"
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert "hunter2" not in str(info.value)
    config = parse_config("[privacy]\ndigest_key = 'hunter2-hunter2-hunter2'\n")
    assert "hunter2" not in repr(config)


def test_ports_are_offset_by_rank_like_the_engines_do():
    for case in load_json("vllm-0.33.0-event-frames.json")["offset_endpoint_port_examples"]:
        if case["endpoint"] is not None:
            assert offset_endpoint(case["endpoint"], case["data_parallel_rank"]) == case["result"]
    spec = WorkerSpec(id="a", endpoint="tcp://h:5557", replay_endpoint="tcp://h:6000", dp_rank=2)
    assert (spec.sub_endpoint(), spec.replay_address()) == ("tcp://h:5559", "tcp://h:6002")
    assert WorkerSpec(id="a", endpoint="tcp://h:5557", dp_rank=2, offset_by_rank=False).sub_endpoint() == "tcp://h:5557"
