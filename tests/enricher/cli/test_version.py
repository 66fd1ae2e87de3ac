"""`kvmiss --version`: the one version, written in enricher/__init__.py, read by pyproject.toml
(setuptools dynamic version) and by the running CLI; the installed metadata agrees."""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import kvmiss.enricher

ROOT = Path(__file__).resolve().parents[3]


def source_version() -> str:
    """``__version__`` as written in the checkout's enricher/__init__.py (read, not imported)."""
    tree = ast.parse((ROOT / "enricher" / "__init__.py").read_text())
    (value,) = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
                and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["__version__"]]
    return value


def test_pyproject_takes_the_version_from_the_package_attribute():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "kvmiss.enricher.__version__"}
    assert project["tool"]["setuptools"]["package-dir"]["kvmiss.enricher"] == "enricher"


def test_version_prints_the_source_version_which_the_install_metadata_matches():
    proc = subprocess.run([sys.executable, "-m", "kvmiss.enricher.cli", "--version"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    version = source_version()
    assert proc.stdout.startswith(f"kvmiss {version} (")
    assert kvmiss.enricher.__version__ == version
    assert importlib.metadata.version("kvmiss") == version, "reinstall: the installed metadata is stale"
    for part in ("residency table", "OTLP wire path", "KV-event reader"):
        assert part in proc.stdout
