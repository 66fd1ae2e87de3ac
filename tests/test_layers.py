"""Imports flow one way: a lower layer never imports a higher one (docs/ARCHITECTURE.md).

    schemas -> collectors -> attribution core -> OTLP edge -> service -> front ends

Every module of the three packages is read with `ast` (not imported), every `kvmiss.*`
import in it -- top level or inside a function -- is placed on its layer, and an import of a
higher layer fails the test naming both modules. A module not placed on any layer fails too,
so a new module has to be given one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"schemas": "kvmiss.schemas", "collectors": "kvmiss.collectors", "enricher": "kvmiss.enricher"}

CORE = ("hashing", "index", "residency_table", "evidence", "verdict", "attribution", "divergence", "privacy",
        "speculative", "compare", "whatif")
EDGE = ("receiver", "listener", "otlp", "spans", "assembly", "exporter", "journal")
SERVICE = ("pipeline", "service", "metrics", "handoff", "inprocess", "offline", "vllm_plugin")
FRONT = ("cli", "demo", "report")
LAYERS = ["schemas", "collectors", "attribution core", "OTLP edge", "service", "front ends"]


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] == ["kvmiss", "schemas"]:
        return 0
    if parts[:2] == ["kvmiss", "collectors"]:
        return 1
    if parts[:2] != ["kvmiss", "enricher"] or len(parts) < 3:
        return None
    name = parts[2].lstrip("_")
    name = {"blocktable": "residency_table", "otlpwire": "spans"}.get(name, name)  # the compiled twins
    for index, names in ((2, CORE), (3, EDGE), (4, SERVICE), (5, FRONT)):
        if name in names:
            return index
    return None


def modules() -> list[tuple[str, Path]]:
    found = []
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found.append((".".join([package, *parts]), path))
    return found


def imports(module: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name.startswith("kvmiss."))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.startswith("kvmiss."):
                out.add(name)
                out.update(f"{name}.{alias.name}" for alias in node.names if layer_of(f"{name}.{alias.name}") is not None
                           and name == "kvmiss.enricher")
    return out


MODULES = modules()


def test_every_module_has_a_layer():
    unplaced = [m for m, _ in MODULES if layer_of(m) is None and m not in PACKAGES.values()]
    assert not unplaced, f"place these modules on a layer (tests/test_layers.py, docs/ARCHITECTURE.md): {unplaced}"


@pytest.mark.parametrize("module,path", MODULES, ids=[m for m, _ in MODULES])
def test_no_module_imports_a_higher_layer(module, path):
    mine = layer_of(module)
    if mine is None:
        return
    upward = sorted(f"{name} ({LAYERS[layer_of(name)]})" for name in imports(module, path)
                    if layer_of(name) is not None and layer_of(name) > mine)
    assert not upward, f"{module} ({LAYERS[mine]}) imports a higher layer: {upward}"


def test_the_check_sees_an_upward_import(tmp_path):
    """The check itself can fail: a core module importing the pipeline is caught."""
    bad = tmp_path / "verdict.py"
    bad.write_text("from kvmiss.enricher.pipeline import Pipeline\n\ndef f():\n    import kvmiss.enricher.cli\n")
    found = imports("kvmiss.enricher.verdict", bad)
    assert {layer_of(n) for n in found} == {4, 5}
