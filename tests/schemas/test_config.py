"""The configuration file: every key validated at start-up, errors naming the key."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import msgspec
import pytest
from shared_data import load_json

from kvmiss.schemas.config import Config, ConfigError, WorkerSpec, load_config, offset_endpoint, parse_config

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
    ("[history]\nkv_cache_report_mode = 'full'\n", "history.kv_cache_report_mode"),
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
    ("max_connections_per_client = -3", "otlp.max_connections_per_client must be between 0 (no cap) and 1000000, got -3"),
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


def config_sections() -> dict[str, type[msgspec.Struct]]:
    """Every section of the config file and the Struct holding its keys, from the schema: a
    Struct field is a ``[table]``, a list of Structs an ``[[array of tables]]``."""
    sections = {}
    for field in msgspec.structs.fields(Config):
        kind = typing.get_args(field.type)[0] if typing.get_origin(field.type) is list else field.type
        assert isinstance(kind, type) and issubclass(kind, msgspec.Struct), field
        sections[field.name] = kind
        tables = [(f"{field.name}.{sub}", sub_kind) for sub, sub_kind in _subsections(kind)]
        while tables:  # e.g. [fleet.dns], [fleet.engines.dns]: tables inside tables
            name, sub_kind = tables.pop()
            sections[name] = sub_kind
            tables += [(f"{name}.{sub}", k) for sub, k in _subsections(sub_kind)]
    return sections


def _subsections(kind: type[msgspec.Struct]) -> list[tuple[str, type[msgspec.Struct]]]:
    out = []
    for field in msgspec.structs.fields(kind):
        for arg in (field.type, *typing.get_args(field.type)):
            if isinstance(arg, type) and issubclass(arg, msgspec.Struct):
                out.append((field.name, arg))
    return out


def section_keys(kind: type[msgspec.Struct]) -> list[str]:
    """A section's own keys (its sub-tables are sections of their own)."""
    subs = {name for name, _ in _subsections(kind)}
    return [field.name for field in msgspec.structs.fields(kind) if field.name not in subs]


def example_lines() -> dict[str, list[str]]:
    """The example's lines by section (a ``[name]`` or ``[[name]]`` header starts one)."""
    sections: dict[str, list[str]] = {}
    current: list[str] = []
    for line in EXAMPLE.read_text().splitlines():
        # A table inside a table ([fleet.dns]) may be shown commented out, as optional ones are.
        header = re.fullmatch(r"\[\[?(\w+)\]\]?\s*(#.*)?", line) or re.fullmatch(r"#\s?\[(\w+(?:\.\w+)+)\]\s*(#.*)?", line)
        if header:
            current = sections.setdefault(header[1], [])
        else:
            current.append(line)
    return sections


def key_line(lines: list[str], key: str) -> str | None:
    """The line setting ``key`` (or showing it commented out)."""
    return next((line for line in lines if re.match(rf"#?\s*{key}\s*=", line)), None)


SCHEMA_KEYS = [(section, key) for section, kind in config_sections().items() for key in section_keys(kind)]


@pytest.mark.parametrize("section, key", SCHEMA_KEYS, ids=[f"{s}.{k}" for s, k in SCHEMA_KEYS])
def test_every_config_key_is_in_the_example_with_a_comment(section, key):
    """Every key of every section, taken from the schema itself (a new key without docs fails
    here): in examples/kvmiss.toml, set or commented out, with a comment on its line saying
    what it does."""
    lines = example_lines()
    assert section in lines, f"section [{section}] is missing from examples/kvmiss.toml"
    line = key_line(lines[section], key)
    assert line is not None, f"{section}.{key} is missing from examples/kvmiss.toml"
    assert "#" in line.lstrip("# ").split("=", 1)[1], f"{section}.{key} has no comment in the example"


def test_the_example_documents_no_key_the_schema_lacks():
    """The other way round: a key shown in the example (even commented out, where a typo would
    otherwise go unnoticed) is a key of its section."""
    sections = config_sections()
    shown = {(section, match[1]) for section, lines in example_lines().items() for line in lines
             if (match := re.match(r"#?\s*(\w+)\s*=", line))}
    assert shown - set(SCHEMA_KEYS) == set()
    assert set(example_lines()) == set(sections)


def test_the_configuration_reference_lists_every_config_section():
    reference = (EXAMPLE.parents[1] / "docs" / "CONFIGURATION.md").read_text()
    table = reference.split("## Sections and keys", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `\[\[?([\w.]+)\]\]?` \|", table, re.M))
    assert listed == set(config_sections())


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


@pytest.mark.parametrize("setting, fragment", [
    ("heartbeat_interval_s = -1", "collector.heartbeat_interval_s must be between 0 (off) and 3600"),
    ("heartbeat_interval_s = nan", "collector.heartbeat_interval_s must be between 0 (off) and 3600"),
    ("heartbeat_interval_s = 2.0\nheartbeat_timeout_s = 2.0",
     "collector.heartbeat_timeout_s must be longer than heartbeat_interval_s and at most 6553 seconds, got 2.0"),
    ("heartbeat_timeout_s = 7000", "collector.heartbeat_timeout_s must be longer than heartbeat_interval_s"),
    ("heartbeat_timeout_s = inf", "collector.heartbeat_timeout_s must be longer than heartbeat_interval_s"),
    ("heartbeat_timeout_s = '4'", "collector.heartbeat_timeout_s"),
])
def test_collector_heartbeats_are_validated_naming_the_key(setting, fragment):
    with pytest.raises(ConfigError) as info:
        parse_config(f"[collector]\n{setting}\n", source="k.toml")
    assert fragment in str(info.value) and str(info.value).startswith("k.toml")


def test_collector_heartbeat_defaults_and_off():
    collector = parse_config("").collector
    assert (collector.heartbeat_interval_s, collector.heartbeat_timeout_s) == (1.0, 4.0)
    # 0 turns them off; the timeout is then not looked at
    assert parse_config("[collector]\nheartbeat_interval_s = 0\nheartbeat_timeout_s = 0\n").collector.heartbeat_interval_s == 0


def test_the_report_mode_promise_reaches_the_index():
    from kvmiss.enricher.core.index import ResidencyIndex
    assert parse_config("").history.kv_cache_report_mode == "any"
    assert parse_config("[history]\nkv_cache_report_mode = 'incremental'\n").history.kv_cache_report_mode == "incremental"
    assert ResidencyIndex().re_announcements and not ResidencyIndex(re_announcements=False).re_announcements
