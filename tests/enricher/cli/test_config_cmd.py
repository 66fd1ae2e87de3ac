"""`kvmiss config example`: the example configs kvmiss ships are the repository's examples/
files, every one of them is shipped, each passes `kvmiss serve --check` read from stdin once
KVMISS_DIGEST_KEY is set (and not before), and all name their digest secret the same way."""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvmiss.enricher.cli import config_cmd
from kvmiss.enricher.cli.config_cmd import EXAMPLES, FLEET_FILES, examples_dir
from kvmiss.schemas.config import parse_config, parse_fleet_file

ROOT = Path(__file__).resolve().parents[3]
KEY = "config-example-test-secret-0001"
CONFIGS = [name for name in EXAMPLES if name not in FLEET_FILES]
# Every kvmiss config in examples/ (a [fleet] file holds [[workers]] only, no [engine]).
REPO_CONFIGS = sorted(p.relative_to(ROOT / "examples").as_posix() for p in (ROOT / "examples").rglob("*.toml")
                      if "\n[engine]" in p.read_text())


def kvmiss(*args: str, stdin: str | None = None, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmiss.enricher.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=60, env=env, cwd=cwd)


def env_with(key: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "KVMISS_DIGEST_KEY"}
    if key is not None:
        env["KVMISS_DIGEST_KEY"] = key
    return env


def shipped_patterns() -> list[str]:
    """The example files pyproject.toml puts into the wheel, as globs relative to examples/."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert project["package-dir"]["kvmiss.examples"] == "examples"
    out = []
    for package, globs in project["package-data"].items():
        assert package == "kvmiss.examples" or package.startswith("kvmiss.examples."), package
        assert package in project["packages"], f"{package} has package data but is not a package"
        sub = package.removeprefix("kvmiss.examples").lstrip(".").replace(".", "/")
        out += [f"{sub}/{g}" if sub else g for g in globs]
    return out


def test_the_examples_are_the_repository_files_and_the_default_is_single():
    assert examples_dir() == ROOT / "examples"
    for name, (path, _) in EXAMPLES.items():
        proc = kvmiss("config", "example", name)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == (ROOT / "examples" / path).read_text()
    assert kvmiss("config", "example").stdout == (ROOT / "examples" / EXAMPLES["single"][0]).read_text()


def test_every_kvmiss_config_in_examples_is_offered_and_shipped_in_the_wheel():
    offered = {path for path, _ in EXAMPLES.values()}
    assert set(REPO_CONFIGS) <= offered, f"not offered by kvmiss config example: {set(REPO_CONFIGS) - offered}"
    patterns = shipped_patterns()
    for path in offered:
        assert any(fnmatch.fnmatch(path, p) and path.count("/") == p.count("/") for p in patterns), \
            f"examples/{path} is offered but pyproject.toml's package-data leaves it out of the wheel"


def test_an_unknown_example_is_refused_and_list_names_each_once():
    proc = kvmiss("config", "example", "nope")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
    listed = kvmiss("config", "example", "--list").stdout.splitlines()
    assert [line.split()[0] for line in listed] == list(EXAMPLES)


@pytest.mark.parametrize("name", CONFIGS)
def test_each_example_passes_check_from_stdin_once_the_key_is_set(name, tmp_path):
    text = config_cmd.example_text(name)
    # The replica's journal lives on its persistent volume, which a test host does not have.
    text = text.replace('"/var/lib/kvmiss/journal"', f'"{tmp_path / "journal"}"')
    config = parse_config(text)
    assert config.export.endpoint or config.export.file, f"{name}: no export destination"
    assert config.privacy.digest_key is None and config.privacy.digest_key_env == "KVMISS_DIGEST_KEY"

    proc = kvmiss("serve", "--check", "--config", "-", stdin=text, env=env_with(KEY), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "configuration OK" in proc.stdout and KEY not in proc.stdout + proc.stderr
    without = kvmiss("serve", "--check", "--config", "-", stdin=text, env=env_with(None), cwd=tmp_path)
    assert without.returncode == 2 and "KVMISS_DIGEST_KEY" in without.stderr


def test_the_fleet_file_example_is_a_fleet_file_the_fleet_example_points_at():
    workers = parse_fleet_file(config_cmd.example_text("fleet-file"))
    assert len(workers) >= 2
    fleet = parse_config(config_cmd.example_text("fleet"))
    assert fleet.fleet.file and not fleet.workers


@pytest.mark.parametrize("path", REPO_CONFIGS)
def test_every_config_in_examples_names_its_digest_key_the_same_way(path):
    config = parse_config((ROOT / "examples" / path).read_text())
    assert config.privacy.digest_key is None, f"{path}: a key inline in the file"
    assert config.privacy.digest_key_env == "KVMISS_DIGEST_KEY", path


def test_collector_header_starts_kvmiss_with_the_key():
    lines = [line for line in (ROOT / "examples/collector/single.yaml").read_text().splitlines()
             if "kvmiss serve --config" in line]
    assert lines and all("KVMISS_DIGEST_KEY=" in line for line in lines)


def test_config_from_stdin_errors_name_stdin_and_a_group_refuses_it():
    proc = kvmiss("serve", "--check", "--config", "-", stdin="[otlp]\nmax_body_bytes = -1\n")
    assert proc.returncode == 2 and "<stdin>" in proc.stderr and "otlp.max_body_bytes" in proc.stderr
    group = kvmiss("serve", "--config", "-", "--processes", "2", stdin=config_cmd.example_text("single"),
                   env=env_with(KEY))
    assert group.returncode == 2 and "--processes" in group.stderr


def test_serve_help_points_at_config_example():
    text = kvmiss("serve", "--help").stdout
    assert "kvmiss config example" in text and "examples/kvmiss.toml" not in text
