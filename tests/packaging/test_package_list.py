"""Every Python package of the source tree is in pyproject.toml's package list, mapped to its
folder: the editable install finds a new subpackage by its folder, the wheel (and so the
container image) only when it is listed -- a subpackage left out works in the checkout and is
missing from every install."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = {"schemas": "kvmiss.schemas", "collectors": "kvmiss.collectors", "enricher": "kvmiss.enricher"}


def test_every_package_folder_is_listed_and_mapped():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, folders = set(setuptools["packages"]), setuptools["package-dir"]
    found = {}
    for top, package in TOP.items():
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT)
            found[".".join([package, *rel.parts[1:]])] = rel.as_posix()
    missing = sorted(set(found) - listed)
    assert not missing, f"packages not in pyproject.toml [tool.setuptools] packages: {missing}"
    wrong = {name: folder for name, folder in found.items() if folders.get(name) != folder}
    assert not wrong, f"packages whose package-dir is not their folder: {wrong}"
