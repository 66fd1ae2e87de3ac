"""Imports flow one way: a lower layer never imports a higher one (docs/ARCHITECTURE.md).

    schemas -> collectors -> core (estimates beside it) -> otlp -> service -> cli, demo, report

A module's layer is its folder in enricher/ (core/, estimates/, otlp/, service/, and the front
ends cli/, demo/, report/). Estimates stand at the core's level but apart from the proofs:
nothing in core/ imports estimates/. Every module of the three packages is read with `ast`
(not imported), every `kvmiss.*` import in it -- top level or inside a function -- is placed
on its layer, and an import of a higher layer fails the test naming both modules. A module
not placed on any layer fails too, so a new module has to go into a layer's folder.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"schemas": "kvmiss.schemas", "collectors": "kvmiss.collectors", "enricher": "kvmiss.enricher"}

FOLDERS = {"core": 2, "estimates": 2, "otlp": 3, "service": 4, "cli": 5, "demo": 5, "report": 5}
APART = {("core", "estimates")}  # (importer's folder, imported folder): the same layer, still never
# Modules directly in enricher/ (its __init__ only: the version).
TOP_LEVEL: dict[str, str] = {}


def folder_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] in (["kvmiss", "schemas"], ["kvmiss", "collectors"]):
        return parts[1]
    if parts[:2] != ["kvmiss", "enricher"] or len(parts) < 3:
        return None
    if parts[2] in FOLDERS:
        return parts[2]
    return TOP_LEVEL.get(parts[2]) if len(parts) == 3 else None


def layer_of(module: str) -> int | None:
    folder = folder_of(module)
    return {"schemas": 0, "collectors": 1}.get(folder, FOLDERS.get(folder))


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


def violations(module: str, imported: set[str]) -> list[str]:
    mine, folder = layer_of(module), folder_of(module)
    return sorted(f"{name} ({folder_of(name)})" for name in imported if layer_of(name) is not None
                  and (layer_of(name) > mine or (folder, folder_of(name)) in APART))


MODULES = modules()


def test_every_module_has_a_layer():
    unplaced = [m for m, _ in MODULES if layer_of(m) is None and m not in PACKAGES.values()]
    assert not unplaced, f"place these modules on a layer (tests/test_layers.py, docs/ARCHITECTURE.md): {unplaced}"


@pytest.mark.parametrize("module,path", MODULES, ids=[m for m, _ in MODULES])
def test_no_module_imports_a_higher_layer(module, path):
    if layer_of(module) is None:
        return
    wrong = violations(module, imports(module, path))
    assert not wrong, f"{module} ({folder_of(module)}) imports a higher layer or one kept apart: {wrong}"


def test_the_check_sees_an_upward_import(tmp_path):
    """The check itself can fail: a core module importing the pipeline, the CLI or an estimate is caught."""
    bad = tmp_path / "verdict.py"
    bad.write_text("from kvmiss.enricher.service.pipeline import Pipeline\n\ndef f():\n    import kvmiss.enricher.cli\n"
                   "    from kvmiss.enricher.estimates import pool\n")
    found = violations("kvmiss.enricher.core.verdict", imports("kvmiss.enricher.core.verdict", bad))
    assert found == ["kvmiss.enricher.cli (cli)", "kvmiss.enricher.estimates (estimates)",
                     "kvmiss.enricher.service.pipeline (service)"]
