"""Each example config starts the way its own header says: the "Start with:" line, run as
written (in a shell, from the project root, with no digest secret in the environment) plus
``--check``, exits 0. A new user copies that line first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# kvmiss configs (not the fleet files a [fleet] file key points at, which hold [[workers]] only)
CONFIGS = sorted(p.relative_to(ROOT) for p in (ROOT / "examples").rglob("*.toml")
                 if "\n[engine]" in p.read_text())
MARK = "# Start with:"


def start_line(path: Path) -> str:
    lines = [line for line in (ROOT / path).read_text().splitlines() if line.startswith(MARK)]
    assert len(lines) == 1, f"{path}: one '{MARK}' line expected, found {len(lines)}"
    return lines[0][len(MARK):].split("  (")[0].strip()


@pytest.mark.parametrize("path", CONFIGS, ids=str)
def test_the_start_line_of_each_example_passes_check_as_written(path):
    command = start_line(path)
    assert f"--config {path}" in command
    env = {k: v for k, v in os.environ.items() if k != "KVMISS_DIGEST_KEY"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(["bash", "-c", f"{command} --check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "seed None" not in proc.stdout
