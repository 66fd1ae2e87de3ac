"""The attribution labels and everything known about each, in one table.

`LABELS` is the one place a label's owner, whether it counts as a miss, whether it is an
honest unknown, whether a lookup time can change it, the report's advice and its colour are
written; metrics, the offline summary, the report and the demo read them from here. The
labels' precedence is `Label`'s order (shared/spec/ATTRIBUTION.md), and the table keeps it.
Adding a label: docs/ARCHITECTURE.md, "Adding a label".
"""

from __future__ import annotations

import enum

import msgspec


class Label(str, enum.Enum):
    """The ten answers. `unknown_*` are first-class: counted and budgeted like the rest."""

    HIT = "hit"
    LOOKUP_LIMIT = "lookup_limit"
    TRANSFER_FAILURE = "transfer_failure"
    WINDOW_LIMIT = "window_limit"
    ROUTING_MISS = "routing_miss"
    RESIDENT_MISS = "resident_miss"
    EVICTED = "evicted"
    NO_MATCH = "no_match"
    UNKNOWN_HISTORY = "unknown_history"
    UNKNOWN_EPOCH = "unknown_epoch"


class Owner(str, enum.Enum):
    NONE = "none"
    APPLICATION = "application"
    PLATFORM = "platform"
    ROUTING = "routing"
    TELEMETRY = "telemetry"


class LabelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What every consumer needs to know about one label."""

    owner: Owner  # who can act on it (the verdict's and the metrics' `owner`)
    is_miss: bool  # counted as a miss: the denominator of the unknown share
    is_unknown: bool  # an honest "cannot prove a cause": counted against the unknown budget
    # A lookup time cannot change it (the request's own facts prove it, or nothing is known):
    # a request whose spans only bound its lookup time keeps it without judging every step.
    settled_at_any_time: bool
    advice: str  # the report's "What to do about each miss"
    # The report's colour for the label. Presentation, but kept here so that a new label
    # cannot reach the charts without one.
    colour: str


LABELS: dict[Label, LabelInfo] = {
    Label.HIT: LabelInfo(
        owner=Owner.NONE, is_miss=False, is_unknown=False, settled_at_any_time=True,
        colour="#43a047",
        advice="Nothing: everything reusable was reused."),
    Label.LOOKUP_LIMIT: LabelInfo(
        owner=Owner.NONE, is_miss=False, is_unknown=False, settled_at_any_time=True,
        colour="#a5d6a7",
        advice="Nothing: the engine always recomputes the last prompt token "
               "(the prompt length is a multiple of the block size)."),
    Label.TRANSFER_FAILURE: LabelInfo(
        owner=Owner.PLATFORM, is_miss=True, is_unknown=False, settled_at_any_time=True,
        colour="#8d4a00",
        advice="Repair the KV connector or offload-tier path; a silent recompute hides it."),
    Label.WINDOW_LIMIT: LabelInfo(
        owner=Owner.NONE, is_miss=True, is_unknown=False, settled_at_any_time=False,
        colour="#c5e1a5",
        advice="Nothing in the prompt or router: the model's sliding-window or linear-attention layers "
               "kept no state at that position (vLLM keeps it at prompt ends and at the shared-prefix "
               "junction it detected, so later requests can hit); a cost to weigh in the choice of model "
               "or cache settings."),
    Label.ROUTING_MISS: LabelInfo(
        owner=Owner.ROUTING, is_miss=True, is_unknown=False, settled_at_any_time=False,
        colour="#7e57c2",
        advice="Another worker held the prefix: weigh locality against queue depth in the router."),
    Label.RESIDENT_MISS: LabelInfo(
        owner=Owner.PLATFORM, is_miss=True, is_unknown=False, settled_at_any_time=False,
        colour="#d32f2f",
        advice="The block was resident and still missed: look for lookup, ownership or "
               "event-sync faults (or requests that bypass the cache)."),
    Label.EVICTED: LabelInfo(
        owner=Owner.PLATFORM, is_miss=True, is_unknown=False, settled_at_any_time=False,
        colour="#fb8c00",
        advice="Size the cache from a trace, keep one-hit prompts from crowding it, add a tier, "
               "or route toward existing state."),
    Label.NO_MATCH: LabelInfo(
        owner=Owner.APPLICATION, is_miss=True, is_unknown=False, settled_at_any_time=False,
        colour="#1e88e5",
        advice="Stabilise the prompt: reusable system text and tool schemas first, volatile "
               "values later; share salts and adapters only where isolation allows."),
    Label.UNKNOWN_HISTORY: LabelInfo(
        owner=Owner.TELEMETRY, is_miss=True, is_unknown=True, settled_at_any_time=True,
        colour="#9e9e9e",
        advice="Improve the evidence: replay window, consumer uptime, wait for lagging streams."),
    Label.UNKNOWN_EPOCH: LabelInfo(
        owner=Owner.TELEMETRY, is_miss=True, is_unknown=True, settled_at_any_time=True,
        colour="#546e7a",
        advice="Give engines an instance id (topic template or service.instance.id)."),
}


def info(label: Label | str) -> LabelInfo:
    """The table's entry for a label, or for its string value as spans and rows carry it."""
    return LABELS[Label(label)]


def owner_of(label: Label | str) -> Owner:
    return info(label).owner


# Views of the table, for membership tests in counting loops.
LABEL_OWNER: dict[Label, Owner] = {label: entry.owner for label, entry in LABELS.items()}
MISS_LABELS = frozenset(label for label, entry in LABELS.items() if entry.is_miss)
NOT_MISSES = frozenset(LABELS) - MISS_LABELS
UNKNOWN_LABELS = frozenset(label for label, entry in LABELS.items() if entry.is_unknown)
SETTLED_AT_ANY_TIME = frozenset(label for label, entry in LABELS.items() if entry.settled_at_any_time)
