"""The label table (schemas/labels.py) is complete, its derived views agree with it, and no
other module keeps facts about labels of its own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kvmiss.schemas import attribution
from kvmiss.schemas.labels import (
    LABEL_OWNER,
    LABELS,
    MISS_LABELS,
    NOT_MISSES,
    SETTLED_AT_ANY_TIME,
    UNKNOWN_LABELS,
    Label,
    LabelInfo,
    Owner,
    info,
    owner_of,
)

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "schemas" / "labels.py"
VALUES = {label.value for label in Label}


def test_every_label_has_one_entry_in_precedence_order():
    assert list(LABELS) == list(Label)
    assert all(isinstance(entry, LabelInfo) for entry in LABELS.values())


def test_derived_views_agree_with_the_table():
    assert LABEL_OWNER == {label: LABELS[label].owner for label in Label}
    assert MISS_LABELS == {label for label in Label if LABELS[label].is_miss}
    assert NOT_MISSES == set(Label) - MISS_LABELS
    assert UNKNOWN_LABELS == {label for label in Label if LABELS[label].is_unknown}
    assert SETTLED_AT_ANY_TIME == {label for label in Label if LABELS[label].settled_at_any_time}
    for label in Label:
        assert info(label) is info(label.value) is LABELS[label]
        assert owner_of(label.value) is LABELS[label].owner


def test_attribution_types_name_the_same_objects():
    assert attribution.Label is Label and attribution.Owner is Owner
    assert attribution.LABEL_OWNER is LABEL_OWNER


@pytest.mark.parametrize("label", list(Label), ids=lambda label: label.value)
def test_entry_is_consistent(label: Label):
    entry = LABELS[label]
    if entry.is_unknown:  # an unknown is a miss kvmiss could not explain: telemetry's to fix
        assert entry.is_miss and entry.owner is Owner.TELEMETRY and entry.settled_at_any_time
    if not entry.is_miss:
        assert entry.owner is Owner.NONE
    assert re.fullmatch(r"#[0-9a-f]{6}", entry.colour)
    assert entry.advice.strip() and entry.advice.endswith(".")


def test_colours_tell_labels_apart():
    assert len({entry.colour for entry in LABELS.values()}) == len(LABELS)


def test_the_hit_and_the_unknowns():
    assert NOT_MISSES == {Label.HIT, Label.LOOKUP_LIMIT}
    assert UNKNOWN_LABELS == {Label.UNKNOWN_HISTORY, Label.UNKNOWN_EPOCH}


# --- no second copy ------------------------------------------------------------------------


def _names_label(node: ast.AST) -> str | None:
    """The label a node names: ``Label.X`` (X a member) or a string constant equal to a
    label's value (``Label.X.value`` too); None for anything else."""
    if isinstance(node, ast.Attribute) and node.attr == "value":
        node = node.value
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "Label" and node.attr in Label.__members__):
        return Label[node.attr].value
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in VALUES:
        return node.value
    return None


def per_label_literals(tree: ast.AST) -> list[tuple[int, list[str]]]:
    """Literals that name two or more labels: a dict keyed by them, or a set, frozenset,
    tuple or list of them. Those are facts about labels; a comprehension over `Label` or the
    table is a view of it and is not reported."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        elif isinstance(node, (ast.Set, ast.Tuple, ast.List)):
            items = node.elts
        else:
            continue
        named = sorted({name for item in items if (name := _names_label(item))})
        if len(named) >= 2:
            found.append((node.lineno, named))
    return found


def _modules() -> list[Path]:
    return sorted(p for folder in ("schemas", "collectors", "enricher")
                  for p in (ROOT / folder).rglob("*.py") if p != TABLE)


def test_the_scan_finds_a_copy():
    source = "\n".join([
        'X = {"hit": "#000", "evicted": "#111"}',
        "Y = frozenset({Label.UNKNOWN_HISTORY, Label.UNKNOWN_EPOCH})",
        "V = (Label.HIT.value, Label.LOOKUP_LIMIT.value)",
        "Z = {label.value: 1 for label in Label}",  # a view of Label: not a copy
        'W = ("evicted", "resident")',  # one label, one presence
    ])
    assert sorted(per_label_literals(ast.parse(source))) == [
        (1, ["evicted", "hit"]), (2, ["unknown_epoch", "unknown_history"]), (3, ["hit", "lookup_limit"])]


def test_no_module_keeps_its_own_label_facts():
    copies = [f"{path.relative_to(ROOT)}:{line} names {', '.join(names)}"
              for path in _modules()
              for line, names in per_label_literals(ast.parse(path.read_text(), str(path)))]
    assert not copies, "label facts belong in schemas/labels.py:\n" + "\n".join(copies)
