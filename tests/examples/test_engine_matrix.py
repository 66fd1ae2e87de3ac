"""The README's engine matrix names exactly the engines kvmiss has adapters for, and what each
row says is what the adapter does: its media spellings, whether ``kvmiss.token_ids`` are hashed
for it, the test files it names exist and exercise that engine, and docs/ENGINES.md has its
section."""

from __future__ import annotations

import re
from pathlib import Path

from kvmiss.collectors.engines import ADAPTERS

ROOT = Path(__file__).resolve().parents[2]
CODE = re.compile(r"`([^`]+)`")


def matrix() -> dict[str, dict[str, str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Engines\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True))
        rows[CODE.fullmatch(cells["engine"]).group(1)] = cells
    return rows


def test_the_readme_matrix_names_exactly_the_registered_engines_in_their_order():
    assert list(matrix()) == list(ADAPTERS)


def test_each_rows_media_are_the_adapters_spellings():
    for engine, row in matrix().items():
        assert set(CODE.findall(row["media spellings"])) == {m for m in ADAPTERS[engine].media if m is not None}


def test_each_row_says_whether_token_ids_are_hashed_as_the_adapter_decides():
    for engine, row in matrix().items():
        refused = row["chain from `kvmiss.token_ids`"].startswith("no")
        assert refused == (ADAPTERS[engine].token_hashing is not None), engine


def test_each_rows_tests_exist_and_configure_or_decode_that_engine():
    for engine, row in matrix().items():
        files = CODE.findall(row["tested by"])
        assert files and row["versions read"], engine
        texts = [(ROOT / f).read_text() for f in files]
        assert any(f'"{engine}"' in t or f"{type(ADAPTERS[engine]).__name__}" in t for t in texts), engine


def test_docs_engines_has_a_section_per_engine():
    headings = re.findall(r'^## .*\(`engine = "([^"]+)"`\)$', (ROOT / "docs" / "ENGINES.md").read_text(), re.M)
    assert headings == list(ADAPTERS)
