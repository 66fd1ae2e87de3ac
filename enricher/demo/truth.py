"""Ground truth: why a simulated request really missed, and whether kvmiss agreed.

The simulator sees every block pool at the instant of each lookup, so it knows the facts
ATTRIBUTION.md's precedence needs without any event stream: did a transfer fail, did
another worker hold the first-miss block H, was H resident on the chosen worker, had H
been stored there earlier in this process lifetime. `truth_label` applies the same
precedence to those facts; `judge` compares kvmiss's verdict with it. kvmiss's `unknown_*`
answers are honest, never wrong; any other disagreement is a wrong verdict.
"""

from __future__ import annotations

import enum

import msgspec

from kvmiss.enricher.core.geometry import lookup_limit_tokens
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.core.residency_types import GPU
from kvmiss.schemas.attribution import Label
from kvmiss.schemas.labels import UNKNOWN_LABELS
from kvmiss.schemas.stream import RunStart


class LookupTruth(msgspec.Struct, frozen=True, kw_only=True):
    """The fleet at one lookup, about H = chain[C // B] (all False when H does not exist)."""

    transfer_failed: bool = False
    other_holders: tuple[str, ...] = ()  # other live workers whose pool held H
    resident: bool = False  # H cached on the chosen worker, yet not reused
    stored_this_epoch: bool = False  # H stored on the chosen worker since its process started


def truth_label(prompt_tokens: int, cached_tokens: int, block_size: int,
                truth: LookupTruth) -> Label:
    """ATTRIBUTION.md's precedence over what really happened (never an `unknown_*`)."""
    limit = lookup_limit_tokens(prompt_tokens, block_size)
    if cached_tokens >= limit:
        exact = prompt_tokens >= block_size and prompt_tokens % block_size == 0
        return Label.LOOKUP_LIMIT if cached_tokens == limit and exact else Label.HIT
    if truth.transfer_failed:
        return Label.TRANSFER_FAILURE
    if truth.other_holders:
        return Label.ROUTING_MISS
    if truth.resident:
        return Label.RESIDENT_MISS
    if truth.stored_this_epoch:
        return Label.EVICTED
    return Label.NO_MATCH


class Agreement(str, enum.Enum):
    AGREE = "agree"
    UNKNOWN = "unknown"  # kvmiss said it cannot prove a cause: honest, not wrong
    WRONG = "wrong"


def judge(truth: Label, verdict: Label) -> Agreement:
    if verdict in UNKNOWN_LABELS:
        return Agreement.UNKNOWN
    return Agreement.AGREE if verdict is truth else Agreement.WRONG


def holder_as_seen(index: ResidencyIndex, worker: str, block_hash: int, t: float) -> str:
    """What kvmiss's index could say about ``worker`` holding ``block_hash`` at ``t``: the
    explanation printed beside a wrong verdict whose true label is routing_miss."""
    views = index.views(worker)
    if not views:
        return f"{worker}: nothing applied"
    current = views[0]
    if current.first_ts is not None and current.first_ts > t:
        older = views[1] if len(views) > 1 else None
        through = older.applied_through_ts if older is not None else None
        if through is None or through < t:
            return (f"{worker}: restarted after t (epoch {current.epoch} began "
                    f"{current.first_ts - t:.3f} s later) and the previous epoch's history "
                    "ends before t; only the current epoch is searched for holders")
        return (f"{worker}: t lies in its previous epoch {older.epoch}, whose history reaches t; "
                "only the current epoch is searched for holders")
    step = current.step_at(t)
    if step is None:
        behind = t - current.applied_through_ts if current.applied_through_ts else float("nan")
        return f"{worker}: history not yet at t when judged ({behind:.3f} s behind)"
    run = current.run_containing(step[0])
    if run is not None and run.start is RunStart.AFTER_GAP and current.last_clear_between(
            run.start_seq, step[0] + 1) is None:
        return f"{worker}: quarantined at t (hole seq {run.gap_from_seq}..{run.gap_to_seq})"
    node = current.interval_as_of(block_hash, GPU, step[0] + 1)  # stores up to that step
    if node is None or node.stored_seq is None:
        return f"{worker}: no store of H recorded up to seq {step[0]} (the step containing t)"
    if node.stored_seq == step[0]:
        return f"{worker}: H stored in seq {step[0]}, the step straddling t (before or after t?)"
    if node.removed_seq is not None and node.removed_seq <= step[0]:
        where = "the step straddling t" if node.removed_seq == step[0] else "before t"
        return (f"{worker}: H stored seq {node.stored_seq}, removed seq {node.removed_seq} "
                f"({where})")
    return f"{worker}: H resident (stored seq {node.stored_seq}): a holder kvmiss should find"
