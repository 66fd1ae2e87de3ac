"""The seam between the proofs and the index stays narrow: the evidence builder, the hybrid
group evidence, the verdict and the attributor ask the index through its queries
(`ResidencyIndex.lookup`, `fleet_view.others_at` and the index's own query methods) and read
their answers; none reads a member of the index's state (`EpochResidency`, its log and
uncounted-store parts, the tables). Checked by reading the modules with `ast`: an attribute
read whose name is a member of the index's state and of no answer type fails, naming it."""

from __future__ import annotations

import ast
from pathlib import Path

from kvmiss.enricher.core.epoch_residency import EpochResidency
from kvmiss.enricher.core.fleet_view import FleetAt
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.core.worker_lookup import BlockAt, GroupsAt, WorkerLookup
from kvmiss.schemas.attribution import Evidence, KVCacheGroup, RequestFacts, Verdict

CORE = Path(__file__).resolve().parents[3] / "enricher" / "core"
ASKING = ("evidence.py", "group_evidence.py", "verdict.py", "attribution.py")
# The index's queries the proofs may call.
QUERIES = {"lookup", "engine_would_hit", "step_stamps_between", "confirm_re_announcement", "stored_nothing_between",
           "has_uncounted_stores", "has_unconfirmed_stores", "siblings_at", "generation", "tail_margin_s"}


def state_members() -> set[str]:
    """Names of the index's state: the attributes a fresh lifetime sets and its methods."""
    view = EpochResidency("w", 0, None)
    names = set(vars(view)) | {n for n in dir(EpochResidency) if not n.startswith("__")}
    names |= set(vars(ResidencyIndex())) | {n for n in dir(ResidencyIndex) if not n.startswith("__")}
    return names


def answer_members() -> set[str]:
    names: set[str] = set()
    for kind in (WorkerLookup, BlockAt, GroupsAt, FleetAt):
        names |= {n for n in dir(kind) if not n.startswith("__")} | set(getattr(kind, "__slots__", ()))
    for struct in (Evidence, RequestFacts, Verdict, KVCacheGroup):
        names |= set(struct.__struct_fields__)
    return names


def test_the_proofs_read_no_member_of_the_index_state():
    forbidden = state_members() - answer_members() - QUERIES
    found = []
    for name in ASKING:
        tree = ast.parse((CORE / name).read_text(), name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in forbidden and isinstance(node.ctx, ast.Load):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    continue  # the attributor's own attributes
                found.append(f"{name}:{node.lineno} .{node.attr}")
    assert not found, "the proofs read the index's state directly:\n" + "\n".join(found)


def test_the_check_would_see_a_direct_read():
    """The same walk flags the reads the evidence builder made before the seam."""
    forbidden = state_members() - answer_members() - QUERIES
    old = "def gather(index, view):\n    return view.interval_as_of(1, 'GPU', 3), view.unproven, index.current\n"
    reads = {n.attr for n in ast.walk(ast.parse(old)) if isinstance(n, ast.Attribute)}
    assert {"interval_as_of", "unproven", "current"} <= reads & forbidden
