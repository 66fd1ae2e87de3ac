"""The vocabulary of a worker stream: its state as a value, its bounds, its counters, and
the actions it asks the I/O layer to carry out (shared/spec/ATTRIBUTION.md, rules 1-3).

`collectors/stream.py` decides; this module names things, plus the one bounded buffer the
stream holds batches in. State, counters and actions are plain msgspec Structs and enums,
so a test can build a stream in any state literally and compare actions with ``==``.
"""

from __future__ import annotations

import collections
import enum
import functools
import heapq
import re

import msgspec

from kvmiss.collectors.frames import BatchMessage, FrameError
from kvmiss.schemas.stream import AppliedBatch, RunStart

# --- bounds (each one named, with a drop policy and a counter) ---------------------------

REPLAY_TIMEOUT_S = 2.0  # idle wait for a replay answer, first attempt (llm-d uses 2 s)
REPLAY_RETRIES = 3  # unanswered requests re-sent before the hole is written off as uncertain
REPLAY_BACKOFF = 2.0  # each retry waits this many times longer: 2, 4, 8, 16 s by default
REPLAY_COOLDOWN_S = 30.0  # after a replay went unanswered, new holes are not asked for meanwhile
RECOVERY_BUFFER_LIMIT = 10_000  # batches held while a hole is recovered; oldest dropped first
TAIL_PROBE_INTERVAL_S = 0.5  # idle this long (nothing received): ask replay what follows our tail
# Tail probes in flight at once, fleet-wide: each is a DEALER socket and a connection to a
# publisher, and a fleet that went quiet together would otherwise open one per worker at
# once. A probe refused for that is tried again this much later.
MAX_TAIL_PROBES = 64
TAIL_PROBE_DEFER_S = 0.05
# The engine clock against kvmiss's, from receive lags (`LagWindow`): live batches received
# within this long of the newest one, and never fewer than the newest CLOCK_MIN_SAMPLES;
# kept as one minimum per 1/CLOCK_SLOTS of the window (constant memory).
CLOCK_WINDOW_S = 30.0
CLOCK_MIN_SAMPLES = 16
CLOCK_SLOTS = 8


class StreamConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Recovery bounds of one worker stream. Durations in seconds, sizes in batches."""

    replay_timeout_s: float = REPLAY_TIMEOUT_S
    replay_retries: int = REPLAY_RETRIES
    replay_backoff: float = REPLAY_BACKOFF
    replay_cooldown_s: float = REPLAY_COOLDOWN_S
    buffer_limit: int = RECOVERY_BUFFER_LIMIT
    first_seq: int = 0  # the publisher's first sequence number (vLLM/SGLang 0, llm-d simulator 1)
    # A live stream with a replay endpoint that has received nothing for this long sends a
    # tail probe (see `RecoveryPurpose.TAIL_PROBE`); None disables probing.
    tail_probe_interval_s: float | None = TAIL_PROBE_INTERVAL_S
    # On the first connection, with a replay endpoint, ask for everything from `first_seq`
    # at once rather than waiting for a live batch: a publisher that went quiet right after
    # a burst (or before we connected) would otherwise leave the stream INITIAL forever.
    replay_on_connect: bool = True
    # How far back (seconds of receive time) the clock estimate looks; see `LagWindow`.
    clock_window_s: float = CLOCK_WINDOW_S


class Received(msgspec.Struct, frozen=True):
    """A batch held for ordering: the message, when it arrived, and over which channel."""

    message: BatchMessage | FrameError  # a FrameError here has a seq but no readable frames
    recv_ts: float
    replayed: bool

    @property
    def seq(self) -> int:
        return self.message.seq  # type: ignore[return-value]


class ReorderBuffer:
    """Batches that arrived ahead of a hole, by seq; at most ``limit``, oldest dropped."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._items: dict[int, Received] = {}
        self._order: list[int] = []  # min-heap of seqs; entries popped from _items are skipped

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: Received) -> int:
        """Hold ``item`` (a readable copy replaces an unreadable one); return the number dropped."""
        held = self._items.get(item.seq)
        if held is not None:
            if isinstance(held.message, FrameError) and isinstance(item.message, BatchMessage):
                self._items[item.seq] = item
            return 0
        self._items[item.seq] = item
        heapq.heappush(self._order, item.seq)
        dropped = 0
        while len(self._items) > self.limit:
            del self._items[self.first()]  # type: ignore[arg-type]
            dropped += 1
        return dropped

    def first(self) -> int | None:
        while self._order and self._order[0] not in self._items:
            heapq.heappop(self._order)
        return self._order[0] if self._order else None

    def last(self) -> int | None:
        return max(self._items, default=None)

    def pop(self, seq: int) -> Received | None:
        return self._items.pop(seq, None)

    def clear(self) -> int:
        count = len(self._items)
        self._items.clear()
        self._order.clear()
        return count


# --- why things happen ---------------------------------------------------------------------


class Cursor(enum.Enum):
    """Where the stream is in its epoch (derived from `StreamState`)."""

    INITIAL = "initial"  # nothing applied in this epoch yet, no replay outstanding
    LIVE = "live"  # every batch up to `applied_seq` is accounted for; at most a tail probe out
    RECOVERING = "recovering"  # a replay request is outstanding; later live batches are held
    VERIFYING = "verifying"  # after a reconnect: is it still the same process? nothing applied


class HoleReason(str, enum.Enum):
    """Why a range of sequence numbers will never be applied."""

    MISSING = "missing"  # the publisher answered and did not have it (confirmed)
    UNCERTAIN = "uncertain"  # the publisher never answered (timeouts): loss not confirmed
    NO_REPLAY_ENDPOINT = "no_replay_endpoint"  # the worker has no replay socket to ask
    MALFORMED = "malformed"  # the batch arrived but cannot be decoded; replay sends the same bytes


class EpochCause(str, enum.Enum):
    """Why kvmiss decided a new process lifetime began."""

    SEQ_RESET = "seq_reset"  # a live sequence number went backwards
    INSTANCE_CHANGED = "instance_changed"  # the topic's instance id changed (authoritative)
    IDENTITY_MISMATCH = "identity_mismatch"  # after a reconnect the replayed last batch differs


class KnownEmpty(str, enum.Enum):
    """A point from which the worker's cache contents are known (empty)."""

    EPOCH_START = "epoch_start"  # seq 0 of the epoch applied with nothing before it missed
    CLEARED = "cleared"  # an AllBlocksCleared applied with continuity up to it


class Unverified(str, enum.Enum):
    """Why a reconnect could not be shown to be the same process."""

    NO_REPLAY_ENDPOINT = "no_replay_endpoint"
    NO_ANSWER = "no_answer"
    NOT_IN_RING = "not_in_ring"  # the replay ring no longer holds the last applied batch
    NOTHING_TO_COMPARE = "nothing_to_compare"  # the last applied batch was never readable


class DropReason(str, enum.Enum):
    """Why a received message was discarded without being applied."""

    BUFFER_FULL = "buffer_full"  # recovery buffer at its bound: oldest dropped (replay may refill)
    RECONNECT = "reconnect"  # held batches from before a reconnect: identity unknown, re-asked
    EPOCH_CHANGE = "epoch_change"  # held batches of a process that is gone
    STALE_REPLY = "stale_reply"  # a replay reply to a request that is no longer outstanding
    FRAME_ERROR = "frame_error"  # a frame set without a readable sequence number


class RecoveryPurpose(enum.Enum):
    FROM_ZERO = "from_zero"  # nothing applied in this epoch: ask for all of it
    GAP = "gap"  # a hole after `applied_seq`
    VERIFY = "verify"  # re-read the last applied batch to check identity after a reconnect
    # Idle: re-read the last applied batch and whatever follows it. Our own batch back, byte
    # for byte, then only the end marker proves the same process had published nothing after
    # it when it answered (`TailConfirmed`); batches after it are a tail lost live, applied
    # like a recovered hole. Silence proves nothing and writes nothing off.
    TAIL_PROBE = "tail_probe"


# --- state as a value ----------------------------------------------------------------------


class Run(msgspec.Struct, frozen=True):
    """The current run (see schemas/stream.py): where it started and why."""

    start_seq: int
    start: RunStart
    gap_from_seq: int | None = None
    gap_to_seq: int | None = None


class Recovery(msgspec.Struct, kw_only=True):
    """One outstanding replay request. ``deadline`` is on the caller's clock, seconds."""

    purpose: RecoveryPurpose
    request_id: int
    start: int  # first seq asked for
    proven_to: int  # highest seq known published before asking: the ring must hold it
    attempt: int = 0  # retries so far without any answer
    deadline: float
    answered: bool = False  # at least one reply arrived for this request
    first_seq: int | None = None  # first replayed seq at or after `start`
    lost: bool = False  # this request ended with a hole written off
    sent: float | None = None  # when this request (this attempt) was handed out
    verified: bool = False  # a tail probe got our last applied batch back, same bytes


class Quarantined(msgspec.Struct, frozen=True):
    """History broken at ``from_seq`` of ``epoch``; dependent verdicts are unknown_history."""

    epoch: int
    from_seq: int
    reason: HoleReason
    since: float  # caller's clock, seconds


class StreamState(msgspec.Struct, kw_only=True):
    """Everything a `WorkerStream` knows, besides its held batches.

    ``applied_seq``: every seq of this epoch up to it was applied or written off as a hole
    (None: nothing yet). ``live_seen``: highest seq received live in this epoch; live
    delivery is ordered, so a live seq at or below it means a new process.
    """

    epoch: int = 0
    instance: str | None = None
    epoch_certain: bool = True
    origin_seen: bool = False  # the epoch began while we watched: missing its start is a hole
    applied_seq: int | None = None
    live_seen: int | None = None
    last_payload: bytes | None = None  # bytes of the last applied batch, to verify identity
    last_payload_seq: int | None = None
    run: Run | None = None
    quarantine: Quarantined | None = None
    recovery: Recovery | None = None
    last_request_id: int = 0
    cooldown_until: float | None = None
    probe_due: float | None = None  # earliest next tail probe; None: nothing heard yet


class StreamHealth(msgspec.Struct, kw_only=True):
    """Counters read at scrape time. Counts are batches unless named otherwise."""

    batches_applied: int = 0
    batches_replayed: int = 0  # of those applied, how many came through replay
    duplicates: int = 0  # replay/live overlap seen twice, applied once
    gaps_detected: int = 0
    replays_requested: int = 0  # RequestReplay actions, retries included
    replays_recovered: int = 0  # requests that ended with their range filled
    replays_failed: int = 0  # requests that ended with a hole written off
    replay_timeouts: int = 0
    unrecoverable_gaps: dict[HoleReason, int] = {}  # holes, by reason
    lost_batches: dict[HoleReason, int] = {}  # batches inside those holes, by reason
    dropped: dict[DropReason, int] = {}
    joins: int = 0  # epochs first seen mid-way with their start not replayable
    epoch_changes: int = 0
    identity_unverified: int = 0
    quarantine_s: float = 0.0  # time spent quarantined, on the caller's clock
    last_contiguous_seq: int | None = None
    oldest_replayable_seq: int | None = None  # first seq of the latest replay reply
    peak_batches_per_s: int = 0  # most batches in one whole second of engine ``ts``
    # Receive time (kvmiss clock) minus publish time (engine clock) of the last live batch:
    # delivery delay plus clock skew. One batch's view: a stall or a backlog moves it.
    receive_lag_s: float | None = None
    # The smallest receive lag of the recent live batches (`LagWindow`): the clock offset
    # (kvmiss minus engine) plus the quickest delivery, never below the offset itself. This,
    # not the last batch's lag, decides whether the worker's timing is trusted against
    # `[history] clock_skew_s` (the service's `ClockOffset`); one late batch does not move it.
    receive_lag_min_s: float | None = None
    # Tail probes (not counted in replays_* above): sent (retries included); answered with
    # proof of an idle tail; answered with batches lost live (then applied); answered without
    # our last batch (a restarted process or an empty ring: nothing proven); superseded by a
    # live batch or a reconnect before their answer; given up unanswered after every retry.
    tail_probes: int = 0
    tail_confirmations: int = 0
    tail_recoveries: int = 0
    tail_unverified: int = 0
    tail_probes_superseded: int = 0
    tail_probes_unanswered: int = 0
    tail_probes_deferred: int = 0  # due, but held back: MAX_TAIL_PROBES in flight, or messages unread


class LagWindow:
    """Sliding minimum of the receive lag of one worker's live batches.

    The rule: a live batch's receive lag (kvmiss receive time minus the engine's ``ts``) is
    the clock offset (kvmiss clock minus engine clock) plus that batch's delivery delay, and
    a delay is never negative. So the smallest lag over recent batches estimates the offset
    from above, and late batches -- a stall, a backlog drained, a slow hop -- only raise
    lags, never the minimum: one of them cannot make a worker look skewed. Replayed batches
    arrive late by design and are not measured (the caller's job). "Recent" is every live
    batch received within ``window_s`` of the newest one, and never fewer than the newest
    ``min_samples`` (after an idle spell, the first batch back does not decide alone). A
    clock that moved shows within the window: a lag below every earlier one at once, a lag
    above the old minimum once the old samples have left.

    Kept as one (start, minimum, count) slot per ``window_s / slots`` of receive time:
    memory is bounded by ``slots + min_samples + 1`` slots whatever the batch rate.
    Receive times come from one non-decreasing clock; one that steps back joins the
    newest slot.
    """

    def __init__(self, window_s: float = CLOCK_WINDOW_S, min_samples: int = CLOCK_MIN_SAMPLES,
                 slots: int = CLOCK_SLOTS) -> None:
        self.window_s = max(0.0, window_s)
        self.min_samples = max(1, min_samples)
        self._width = self.window_s / max(1, slots)
        self._slots: collections.deque[list] = collections.deque()  # [start, min lag, count]
        self._count = 0
        self._oldest_edge = float("inf")  # the oldest slot's end, while another slot follows it
        self.minimum: float | None = None

    def __len__(self) -> int:
        """Samples in the window."""
        return self._count

    def add(self, recv_ts: float, lag: float) -> float:
        """Take one live batch's lag; return the window's minimum lag."""
        slots = self._slots
        self._count += 1
        if slots and recv_ts < slots[-1][0] + self._width:
            newest = slots[-1]
            if lag < newest[1]:  # (comparisons, not min(): this runs for every live batch)
                newest[1] = lag
            newest[2] += 1
            if recv_ts - self.window_s < self._oldest_edge:  # the common case: nothing can leave yet
                if lag < self.minimum:  # (set: a slot exists)
                    self.minimum = lag
                return self.minimum
        else:
            slots.append([recv_ts, lag, 1])
        horizon = recv_ts - self.window_s
        evicted = False
        # The oldest slot goes once every sample in it is older than the window and the
        # newer slots still hold at least `min_samples`.
        while (len(slots) > 1 and slots[0][0] + self._width <= horizon
               and self._count - slots[0][2] >= self.min_samples):
            self._count -= slots.popleft()[2]
            evicted = True
        if evicted or self.minimum is None:
            self.minimum = min(slot[1] for slot in slots)
        elif lag < self.minimum:
            self.minimum = lag
        # The oldest slot cannot leave before the window's horizon passes its end.
        self._oldest_edge = slots[0][0] + self._width if len(slots) > 1 else float("inf")
        return self.minimum


def bump(counter: dict, key: enum.Enum, by: int = 1) -> None:
    if by:
        counter[key] = counter.get(key, 0) + by


# --- actions: what the I/O layer must do ----------------------------------------------------


class Apply(msgspec.Struct, frozen=True):
    """Hand this batch to the residency index, in the order given."""

    batch: AppliedBatch


class RequestReplay(msgspec.Struct, frozen=True):
    """Ask the worker's replay endpoint for every batch with seq >= ``start_seq``.

    Replies carry no request id on the wire, so the socket is the fence: use a fresh DEALER
    for each request (closing the previous one) and pass ``request_id`` back with each reply
    read from it. Replies to any other id are counted and ignored.
    """

    start_seq: int
    request_id: int
    attempt: int = 0
    tail_probe: bool = False  # an idle stream's probe, not the recovery of a known hole


class NewEpoch(msgspec.Struct, frozen=True):
    """A new process lifetime: drop the worker's residency from earlier epochs."""

    epoch: int
    cause: EpochCause
    instance: str | None = None
    certain: bool = True


class Hole(msgspec.Struct, frozen=True):
    """Batches ``from_seq..to_seq`` of ``epoch`` will never be applied (log once)."""

    epoch: int
    from_seq: int
    to_seq: int
    reason: HoleReason
    detail: str = ""


class Quarantine(msgspec.Struct, frozen=True):
    """History is broken; results depending on it are unknown_history until `Release`."""

    epoch: int
    from_seq: int
    reason: HoleReason


class Release(msgspec.Struct, frozen=True):
    """A known-empty point was applied at ``seq``: the quarantine is over."""

    epoch: int
    seq: int
    cause: KnownEmpty


class EpochUncertain(msgspec.Struct, frozen=True):
    """The process behind the stream could not be re-identified (unknown_epoch)."""

    epoch: int
    reason: Unverified


class TailConfirmed(msgspec.Struct, frozen=True):
    """Proof of an idle tail: batch ``seq`` of ``epoch`` was the last one the publisher had
    published when it answered a tail probe sent at ``at`` (caller's clock, seconds; the
    send time, so the answer came later). Every batch published before ``at`` is applied.
    Repeated while the worker stays idle; superseded by the next `Apply`."""

    epoch: int
    seq: int
    at: float


StreamAction = (
    Apply | RequestReplay | NewEpoch | Hole | Quarantine | Release | EpochUncertain | TailConfirmed
)


# --- identity -------------------------------------------------------------------------------


def worker_id(endpoint: str, dp_rank: int) -> str:
    """Stable id of one event stream: every DP rank of a pod publishes the same topic."""
    return f"{endpoint}#dp{dp_rank}"


@functools.lru_cache(maxsize=64)
def _topic_pattern(template: str) -> re.Pattern[str]:
    if template.count("{instance}") != 1:
        raise ValueError(f"topic template must contain {{instance}} once: {template!r}")
    parts = re.split(r"(\{[A-Za-z_]+\})", template)
    regex = "".join(
        "(?P<instance>.+?)" if part == "{instance}"
        else ".*?" if part.startswith("{") and part.endswith("}")
        else re.escape(part)
        for part in parts
    )
    return re.compile(regex)


def instance_from_topic(template: str, topic: str) -> str | None:
    """The instance id in ``topic`` per ``template`` (e.g. ``kv@{instance}@{model}``).

    Other ``{name}`` fields match anything. None when the topic does not fit the template.
    Raises ValueError for a template without exactly one ``{instance}``.
    """
    match = _topic_pattern(template).fullmatch(topic)
    return match["instance"] if match else None
