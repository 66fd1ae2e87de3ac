"""One worker's KV-event stream as a pure state machine: messages in, actions out.

A `WorkerStream` follows one (endpoint, dp_rank) across process lifetimes. It is fed the
parsed messages of collectors/frames.py (live batches, replay replies, the replay end
marker, frame errors), timer ticks and connection facts, and returns `StreamAction`
values (collectors/continuity.py) that the I/O layer carries out. It opens no socket,
reads no clock and starts no thread: ``now`` is always an argument (the caller's clock,
seconds, non-decreasing).

Thread contract: not thread-safe. One owner calls every method, one message at a time,
in arrival order per channel; actions are returned in the order they must be carried out.

The rules (shared/spec/ATTRIBUTION.md 1-3, shared/reference/WIRE.md):
  * seq n of an epoch is applied only after n-1. A jump holds later batches (bounded) and
    asks replay for the hole; the first replayed seq must be the one asked for, else the
    ring moved on and the difference is confirmed missing. Replay/live overlap is applied
    once (two watermarks: ``applied_seq`` and ``live_seen``).
  * An unanswered request is retried with growing waits; then the hole is written off as
    "uncertain", never as "missing". Every written-off hole marks the run AFTER_GAP and
    quarantines the worker until a known-empty point (seq 0 of a new epoch with nothing
    missed, or an applied AllBlocksCleared).
  * A live seq at or below the last live seq, or a new instance id in the topic, is a new
    process: new epoch, replay from 0. After a reconnect without instance ids, the last
    applied batch is re-read through replay and compared byte for byte before anything
    else is applied; if that cannot be done, the epoch is marked uncertain.
  * Engines publish only when a step produced events, so silence cannot tell an idle
    worker from a lagging one or from a lost last batch. A live stream with a replay
    endpoint that has heard nothing for ``tail_probe_interval_s`` sends a tail probe: it
    re-reads the last applied batch and everything after it. The same bytes back and then
    the end marker prove the same process had published nothing more when it answered
    (`TailConfirmed`, stamped with the probe's send time); batches after it are a tail lost
    live, applied like a recovered hole; other bytes at that seq are another process (a new
    uncertain epoch, as after a reconnect). A probe that gets no answer confirms nothing and
    writes nothing off. Probes are not sent during a replay cooldown, and are sent while
    quarantined (a lost tail may hold the clear that ends the quarantine). A live batch
    arriving while a probe is out supersedes it.
"""

from __future__ import annotations

from kvmiss.collectors.continuity import (
    TAIL_PROBE_DEFER_S,
    Apply,
    Cursor,
    DropReason,
    EpochCause,
    EpochUncertain,
    Hole,
    HoleReason,
    KnownEmpty,
    LagWindow,
    NewEpoch,
    Quarantine,
    Quarantined,
    Received,
    Recovery,
    RecoveryPurpose,
    Release,
    ReorderBuffer,
    RequestReplay,
    Run,
    StreamAction,
    StreamConfig,
    StreamHealth,
    StreamState,
    TailConfirmed,
    Unverified,
    bump,
    instance_from_topic,
)
from kvmiss.collectors.engines import ADAPTERS, EngineAdapter
from kvmiss.collectors.frames import BatchMessage, FrameError, Message, ReplayEnd, WireError, has_clear
from kvmiss.schemas.stream import AppliedBatch, RunStart


class WorkerStream:
    """Sequence, epoch and quarantine state of one worker; see the module docstring.

    ``replay``: the worker has a replay endpoint. ``topic_template``: e.g.
    ``kv@{instance}@{model}`` when topics carry an instance id. ``state``: start from a
    given state (tests, restore); default is a fresh INITIAL stream at epoch 0.
    ``adapter``: the engine's (collectors/engines), which decodes the payloads; the caller
    parses frames with its `EngineAdapter.frames` and passes its ``first_seq`` in ``config``.
    """

    def __init__(
        self,
        worker: str,
        *,
        replay: bool,
        topic_template: str | None = None,
        config: StreamConfig = StreamConfig(),
        state: StreamState | None = None,
        adapter: EngineAdapter = ADAPTERS["vllm"],
    ) -> None:
        if topic_template is not None:
            instance_from_topic(topic_template, "")  # fail now on a bad template
        self.worker = worker
        self.replay = replay
        self.topic_template = topic_template
        self.config = config
        self.state = state if state is not None else StreamState()
        self.health = StreamHealth()
        self._held = ReorderBuffer(config.buffer_limit)
        self._out: list[StreamAction] = []
        self._now: float | None = None
        self._rate_second: float | None = None
        self._rate_count = 0
        self._lags = LagWindow(config.clock_window_s)  # kept across epochs: a host's clock
        self._live_topic: str | None = None  # of the last live batch: `on_live`'s common case
        self.fast_path = True  # False: every message takes the general path (tests compare)
        self.adapter = adapter
        self._scan = adapter.scan  # (read per live batch: kept off the adapter's attribute lookup)

    # --- what the owner reads ---------------------------------------------------------------

    @property
    def cursor(self) -> Cursor:
        recovery = self.state.recovery
        if recovery is not None and recovery.purpose is not RecoveryPurpose.TAIL_PROBE:
            verifying = recovery.purpose is RecoveryPurpose.VERIFY
            return Cursor.VERIFYING if verifying else Cursor.RECOVERING
        return Cursor.INITIAL if self.state.applied_seq is None else Cursor.LIVE

    @property
    def quarantined(self) -> bool:
        return self.state.quarantine is not None

    @property
    def next_deadline(self) -> float | None:
        """When `on_tick` has work to do (caller's clock, seconds); None: nothing pending."""
        recovery = self.state.recovery
        return recovery.deadline if recovery is not None else self._probe_due()

    @property
    def held(self) -> int:
        """Batches held back while a hole is being recovered."""
        return len(self._held)

    # --- what the owner feeds ----------------------------------------------------------------

    def on_live(self, message: BatchMessage | FrameError, now: float) -> list[StreamAction]:
        """A message from the SUB socket (`parse_live`)."""
        state = self.state
        if (self.fast_path and message.__class__ is BatchMessage and state.recovery is None
                and state.quarantine is None and not self._held and state.live_seen is not None
                and message.seq == state.live_seen + 1 and state.applied_seq == state.live_seen
                and message.topic == self._live_topic):
            # The common case, every batch of a healthy stream: the next seq of the same
            # publisher (same topic, so the same instance), nothing outstanding or held.
            # The general path below does exactly this for it, in more steps; a payload the
            # compiled reader does not read (`BatchMessage.decode`'s rule), or one with a
            # clear, takes `_apply` for its decoding and known-empty point.
            self._now = now
            payload, scan = message.payload, self._scan
            scanned = scan(payload) if scan is not None and payload.__class__ is bytes else None
            if scanned is None or scanned[2].has_clear or state.run is None:
                self._out = []
                state.live_seen = message.seq
                self._apply(message, now, False)
                out, self._out = self._out, []
            else:
                ts, _, events = scanned
                seq = state.live_seen = state.applied_seq = state.last_payload_seq = message.seq
                state.last_payload = payload
                run = state.run
                out = [Apply(AppliedBatch(
                    worker=self.worker, epoch=state.epoch, seq=seq, ts=ts, recv_ts=now,
                    events=events, run_start_seq=run.start_seq, run_start=run.start,
                    gap_from_seq=run.gap_from_seq, gap_to_seq=run.gap_to_seq, instance=state.instance,
                    epoch_certain=state.epoch_certain, replayed=False,
                ))]
                self._count_applied(ts, False, seq, now)
            interval = self.config.tail_probe_interval_s  # (`_heard`, inline)
            state.probe_due = None if interval is None else now + interval
            return out
        self._begin(now)
        if message.seq is None:
            bump(self.health.dropped, DropReason.FRAME_ERROR)
            return self._end()
        self._supersede_probe()
        state, seq = self.state, message.seq
        instance = None
        if self.topic_template is not None and isinstance(message, BatchMessage):
            instance = instance_from_topic(self.topic_template, message.topic)
        if instance is not None and state.instance is not None and instance != state.instance:
            self._new_epoch(EpochCause.INSTANCE_CHANGED, instance)
        elif state.live_seen is not None and seq <= state.live_seen:
            self._new_epoch(EpochCause.SEQ_RESET, instance or state.instance)
        state = self.state  # a new epoch is a new state
        if instance is not None:
            state.instance = instance
        state.live_seen = seq
        self._offer(Received(message, now, replayed=False))
        self._heard(now)
        self._live_topic = message.topic if message.__class__ is BatchMessage else None
        return self._end()

    def on_replay(self, message: Message, request_id: int, now: float) -> list[StreamAction]:
        """A message from the DEALER opened for `RequestReplay` ``request_id`` (`parse_replay`)."""
        self._begin(now)
        recovery = self.state.recovery
        if recovery is None or recovery.request_id != request_id:
            bump(self.health.dropped, DropReason.STALE_REPLY)
            return self._end()
        if isinstance(message, ReplayEnd):
            self._replay_ended(recovery)
            self._heard(now)
            return self._end()
        recovery.answered = True
        recovery.deadline = now + self._wait(recovery.attempt)  # an idle timeout, not a total one
        self._heard(now)
        if message.seq is None:
            bump(self.health.dropped, DropReason.FRAME_ERROR)
            return self._end()
        item = Received(message, now, replayed=True)
        if recovery.first_seq is None and item.seq >= recovery.start:
            recovery.first_seq = item.seq
            if recovery.purpose is not RecoveryPurpose.TAIL_PROBE:  # a probe starts at the newest
                self.health.oldest_replayable_seq = item.seq
            if recovery.purpose in (RecoveryPurpose.VERIFY, RecoveryPurpose.TAIL_PROBE):
                self._verify_identity(recovery, item)
                return self._end()
            if item.seq > recovery.start:
                self._ring_moved_on(item.seq)
        self._offer(item)
        return self._end()

    @property
    def probing(self) -> bool:
        """A tail probe is in flight (its DEALER open)."""
        recovery = self.state.recovery
        return recovery is not None and recovery.purpose is RecoveryPurpose.TAIL_PROBE

    def on_tick(self, now: float, may_probe: bool = True) -> list[StreamAction]:
        """Time passed; call at `next_deadline` (earlier or later is harmless). With
        ``may_probe`` false a tail probe that is due waits `TAIL_PROBE_DEFER_S` instead (the
        fleet's bound on probes in flight, or messages of this worker not read yet: see
        `Fleet.on_tick`); a recovery's timers run regardless."""
        self._begin(now)
        recovery = self.state.recovery
        if recovery is not None:
            if now >= recovery.deadline:
                self._replay_timed_out(recovery)
        elif (due := self._probe_due()) is not None and now >= due:
            if not may_probe:
                self.state.probe_due = now + TAIL_PROBE_DEFER_S
                self.health.tail_probes_deferred += 1
                return self._end()
            last, applied = self.state.last_payload_seq, self.state.applied_seq
            assert last is not None and applied is not None, "a probe needs a readable tail"
            self._request(RecoveryPurpose.TAIL_PROBE, last, applied)
        return self._end()

    def on_connect(self, now: float) -> list[StreamAction]:
        """The SUB socket connected for the first time: with a replay endpoint, ask for the
        whole ring now (see `StreamConfig.replay_on_connect`)."""
        self._begin(now)
        state = self.state
        if (self.config.replay_on_connect and self._replay_usable() and state.applied_seq is None
                and state.recovery is None and state.live_seen is None):
            self._request(RecoveryPurpose.FROM_ZERO, self.config.first_seq, -1)
        return self._end()

    def on_reconnect(self, now: float) -> list[StreamAction]:
        """The SUB socket (re)connected: call before its first message (a first connect is fine)."""
        self._begin(now)
        self._supersede_probe()  # the reconnect check (or nothing) replaces it
        state, recovery = self.state, self.state.recovery
        topic_says_who = self.topic_template is not None and state.instance is not None
        if state.applied_seq is None or topic_says_who:
            # Nothing to re-identify, or the topic will say who it is: re-send what was lost.
            if recovery is not None:
                self._request(
                    recovery.purpose, recovery.start, recovery.proven_to, recovery.attempt)
            return self._end()
        # Held batches may be another process's; replay from the check point re-sends them.
        bump(self.health.dropped, DropReason.RECONNECT, self._held.clear())
        state.recovery = None
        if not self._replay_usable():
            self._unverified(Unverified.NO_ANSWER if self.replay else Unverified.NO_REPLAY_ENDPOINT)
        elif state.last_payload_seq is None:
            self._unverified(Unverified.NOTHING_TO_COMPARE)
        else:
            proven_to = max(state.applied_seq, -1 if state.live_seen is None else state.live_seen)
            self._request(RecoveryPurpose.VERIFY, state.last_payload_seq, proven_to)
        return self._end()

    # --- transitions, named for their cause ----------------------------------------------------

    def _offer(self, item: Received) -> None:
        expected = self._next_seq()
        if item.seq < expected:
            self.health.duplicates += 1
        elif item.seq == expected and not self._holding():
            self._apply(item.message, item.recv_ts, item.replayed)
            self._settle()
        else:
            bump(self.health.dropped, DropReason.BUFFER_FULL, self._held.put(item))
            self._settle()

    def _settle(self) -> None:
        """Apply what has become contiguous; ask for (or write off) the next hole."""
        while not self._holding():
            first_held, expected = self._held.first(), self._next_seq()
            if first_held is not None and first_held < expected:  # overtaken by a write-off
                self._held.pop(first_held)
                self.health.duplicates += 1
                continue
            item = self._held.pop(expected)
            if item is not None:
                self._apply(item.message, item.recv_ts, item.replayed)
            elif self._held and self.state.recovery is None:
                self._hole_noticed()
            else:
                return

    def _hole_noticed(self) -> None:
        state, first_held = self.state, self._held.first()
        assert first_held is not None, "a hole is only noticed below a held batch"
        purpose = self._purpose()
        if purpose is RecoveryPurpose.GAP:
            self.health.gaps_detected += 1
        if not self.replay:
            self._write_off(first_held - 1, HoleReason.NO_REPLAY_ENDPOINT)
        elif not self._replay_usable():
            self._write_off(first_held - 1, HoleReason.UNCERTAIN, "replay endpoint cooling down")
        else:
            proven_to = max(first_held, state.live_seen if state.live_seen is not None else -1)
            self._request(purpose, self._next_seq(), proven_to)

    def _ring_moved_on(self, first_replayed: int) -> None:
        """The reply starts after the seq asked for: what lies below it and is not held is gone."""
        while self._next_seq() < first_replayed:
            first_held = self._held.first()
            below = first_replayed if first_held is None else min(first_held, first_replayed)
            self._write_off(below - 1, HoleReason.MISSING, "replay ring no longer holds it")
            while (item := self._held.pop(self._next_seq())) is not None:
                self._apply(item.message, item.recv_ts, item.replayed)

    def _replay_ended(self, recovery: Recovery) -> None:
        if recovery.purpose is RecoveryPurpose.TAIL_PROBE:
            self._probe_ended(recovery)
            return
        if recovery.purpose is RecoveryPurpose.VERIFY:  # the ring held nothing to compare
            self._unverified(Unverified.NOT_IN_RING)
        if self._next_seq() <= recovery.proven_to:  # published before we asked, yet not sent
            upto = min(self._below_held(recovery.proven_to), recovery.proven_to)
            self._write_off(upto, HoleReason.MISSING, "replay ended before the hole was filled")
        self.state.recovery = None
        if recovery.lost:
            self.health.replays_failed += 1
        else:
            self.health.replays_recovered += 1
        self._settle()  # batches published after we asked and dropped from the buffer: ask again

    def _probe_ended(self, recovery: Recovery) -> None:
        """The end marker of a tail probe's answer (or its last time-out, ``answered``)."""
        state = self.state
        state.recovery = None
        if state.applied_seq is not None and state.applied_seq > recovery.proven_to:
            self.health.tail_recoveries += 1  # batches lost live, now applied
        if recovery.first_seq is None:
            # Not even our last batch came back: this publisher's newest batch is older than
            # the one we applied last. A restarted process, or a ring that keeps nothing:
            # nothing is proven, and live traffic will tell (a seq reset).
            self.health.tail_unverified += 1
        elif recovery.verified and not self._held and state.applied_seq is not None:
            assert recovery.sent is not None, "every request records when it was sent"
            self.health.tail_confirmations += 1
            self._out.append(TailConfirmed(state.epoch, state.applied_seq, recovery.sent))
        self._settle()

    def _probe_timed_out(self, recovery: Recovery) -> None:
        """Silence proves nothing is missing as little as it proves nothing is there: retry,
        then give up without a confirmation and without writing anything off."""
        state, config = self.state, self.config
        if not recovery.answered and recovery.attempt < config.replay_retries:
            self._request(recovery.purpose, recovery.start, recovery.proven_to, recovery.attempt + 1)
            return
        state.recovery = None
        if recovery.answered:  # it was sending, then went quiet: the next probe asks again
            if state.applied_seq is not None and state.applied_seq > recovery.proven_to:
                self.health.tail_recoveries += 1
            self._heard(self._clock())
        else:  # nobody answers: probe again once a cooldown has passed
            self.health.tail_probes_unanswered += 1
            state.probe_due = self._clock() + config.replay_cooldown_s
        self._settle()

    def _replay_timed_out(self, recovery: Recovery) -> None:
        if recovery.purpose is RecoveryPurpose.TAIL_PROBE:
            self._probe_timed_out(recovery)
            return
        state, config = self.state, self.config
        self.health.replay_timeouts += 1
        if recovery.answered:  # it was sending, then went quiet: ask again from where we are
            state.recovery = None
            if recovery.purpose is RecoveryPurpose.VERIFY:
                self._unverified(Unverified.NO_ANSWER)
            if self._held or self._next_seq() <= recovery.proven_to:
                self._request(self._purpose(), self._next_seq(), recovery.proven_to)
            else:
                self.health.replays_recovered += 1
        elif recovery.attempt < config.replay_retries:
            attempt = recovery.attempt + 1
            self._request(recovery.purpose, recovery.start, recovery.proven_to, attempt)
            return
        else:
            self.health.replays_failed += 1
            state.cooldown_until = self._clock() + config.replay_cooldown_s
            if recovery.purpose is RecoveryPurpose.VERIFY:
                self._unverified(Unverified.NO_ANSWER)
            upto = self._below_held(recovery.proven_to)
            tries = recovery.attempt + 1
            self._write_off(upto, HoleReason.UNCERTAIN, f"no replay answer in {tries} tries")
            state.recovery = None
        self._settle()

    def _verify_identity(self, recovery: Recovery, item: Received) -> None:
        state = self.state
        same_seq = item.seq == recovery.start
        message = item.message
        same_bytes = isinstance(message, BatchMessage) and message.payload == state.last_payload
        if same_seq and same_bytes:
            if recovery.purpose is RecoveryPurpose.TAIL_PROBE:
                recovery.verified = True  # same process: what follows is a tail lost live
            else:
                recovery.purpose = RecoveryPurpose.GAP  # same process: the rest fills gaps
            self._settle()
            return
        if same_seq:  # same position, other bytes: another process answers at this endpoint
            cause = EpochCause.IDENTITY_MISMATCH
            self._new_epoch(cause, state.instance, certain=False, keep_held=True)
            self.state.live_seen = self._held.last()  # held live batches are the new process's
        else:
            if recovery.purpose is RecoveryPurpose.VERIFY:
                recovery.purpose = RecoveryPurpose.GAP
            self._unverified(Unverified.NOT_IN_RING)
            if item.seq > self._next_seq():
                self._ring_moved_on(item.seq)
        self._offer(item)

    def _new_epoch(
        self, cause: EpochCause, instance: str | None, *, certain: bool = True,
        keep_held: bool = False,
    ) -> None:
        """A new process lifetime: nothing of the old epoch carries over but the quarantine."""
        state = self.state
        self._live_topic = None
        if not keep_held:
            bump(self.health.dropped, DropReason.EPOCH_CHANGE, self._held.clear())
        self.health.epoch_changes += 1
        self.state = StreamState(
            epoch=state.epoch + 1,
            instance=instance,
            epoch_certain=certain,
            origin_seen=True,
            quarantine=state.quarantine,
            last_request_id=state.last_request_id,
            cooldown_until=state.cooldown_until,
        )
        self._out.append(NewEpoch(self.state.epoch, cause, instance, certain))

    def _write_off(self, upto: int, reason: HoleReason, detail: str = "") -> None:
        """Seqs from the next expected one through ``upto`` will never be applied."""
        state, first = self.state, self._next_seq()
        if upto < first:
            return
        state.applied_seq = upto
        joined = state.run is None and not state.origin_seen and first == self.config.first_seq
        if joined and reason is not HoleReason.MALFORMED:
            # First sight of an epoch already under way: history before it is unknown, and
            # the index holds nothing of it, so nothing stale needs fencing off.
            state.run = Run(upto + 1, RunStart.JOINED)
            self.health.joins += 1
            return
        state.run = Run(upto + 1, RunStart.AFTER_GAP, first, upto)
        if state.recovery is not None and reason is not HoleReason.MALFORMED:
            state.recovery.lost = True
        bump(self.health.unrecoverable_gaps, reason)
        bump(self.health.lost_batches, reason, upto - first + 1)
        self._out.append(Hole(state.epoch, first, upto, reason, detail))
        if state.quarantine is None:
            state.quarantine = Quarantined(state.epoch, first, reason, self._clock())
            self._out.append(Quarantine(state.epoch, first, reason))

    def _apply(self, message: BatchMessage | FrameError, recv_ts: float, replayed: bool) -> None:
        state, seq = self.state, message.seq
        try:
            if isinstance(message, FrameError):
                raise WireError(message.reason)
            batch = self.adapter.read(message.payload)
        except WireError as exc:
            self._write_off(seq, HoleReason.MALFORMED, str(exc))
            return
        known_empty = None
        if state.run is None:  # the epoch's first seq, nothing missed before it
            state.run = Run(seq, RunStart.EPOCH_START)
            known_empty = KnownEmpty.EPOCH_START
        elif has_clear(batch.events):  # every batch passes here
            known_empty = KnownEmpty.CLEARED
        if known_empty is not None:
            self._known_empty_applied(seq, known_empty)
        state.applied_seq = state.last_payload_seq = seq
        state.last_payload = message.payload
        run = state.run
        self._out.append(Apply(AppliedBatch(
            worker=self.worker, epoch=state.epoch, seq=seq, ts=batch.ts, recv_ts=recv_ts,
            events=batch.events, run_start_seq=run.start_seq, run_start=run.start,
            gap_from_seq=run.gap_from_seq, gap_to_seq=run.gap_to_seq, instance=state.instance,
            epoch_certain=state.epoch_certain, replayed=replayed,
        )))
        self._count_applied(batch.ts, replayed, seq, recv_ts)

    def _known_empty_applied(self, seq: int, cause: KnownEmpty) -> None:
        state = self.state
        state.epoch_certain = True
        if state.quarantine is not None:
            state.quarantine = None
            self._out.append(Release(state.epoch, seq, cause))

    def _unverified(self, reason: Unverified) -> None:
        if self.state.epoch_certain:
            self.state.epoch_certain = False
            self.health.identity_unverified += 1
            self._out.append(EpochUncertain(self.state.epoch, reason))

    def _request(
        self, purpose: RecoveryPurpose, start: int, proven_to: int, attempt: int = 0
    ) -> None:
        state, now = self.state, self._clock()
        state.last_request_id += 1
        state.recovery = Recovery(
            purpose=purpose, request_id=state.last_request_id, start=start, proven_to=proven_to,
            attempt=attempt, deadline=now + self._wait(attempt), sent=now,
        )
        probe = purpose is RecoveryPurpose.TAIL_PROBE
        if probe:
            self.health.tail_probes += 1
        else:
            self.health.replays_requested += 1
        self._out.append(RequestReplay(start, state.last_request_id, attempt, tail_probe=probe))

    def _supersede_probe(self) -> None:
        """A live batch (or a reconnect) makes an outstanding tail probe moot: drop it; its
        replies will be stale."""
        recovery = self.state.recovery
        if recovery is not None and recovery.purpose is RecoveryPurpose.TAIL_PROBE:
            self.state.recovery = None
            self.health.tail_probes_superseded += 1

    def _heard(self, now: float) -> None:
        """Something arrived: the next tail probe is due one interval of silence from now."""
        interval = self.config.tail_probe_interval_s
        self.state.probe_due = None if interval is None else now + interval

    def _probe_due(self) -> float | None:
        """When a tail probe may be sent: a live stream (nothing outstanding or held) with a
        replay endpoint, a readable last batch to compare, and replay not cooling down."""
        state = self.state
        if (self.config.tail_probe_interval_s is None or not self.replay
                or state.recovery is not None or state.probe_due is None
                or state.last_payload_seq is None or state.applied_seq is None or self._held):
            return None
        until = state.cooldown_until
        return state.probe_due if until is None else max(state.probe_due, until)

    # --- small helpers ----------------------------------------------------------------------

    def _next_seq(self) -> int:
        applied = self.state.applied_seq
        return self.config.first_seq if applied is None else applied + 1

    def _below_held(self, default: int) -> int:
        """The seq just below the oldest held batch; ``default`` when none is held."""
        first_held = self._held.first()
        return default if first_held is None else first_held - 1

    def _purpose(self) -> RecoveryPurpose:
        return RecoveryPurpose.FROM_ZERO if self.state.applied_seq is None else RecoveryPurpose.GAP

    def _clock(self) -> float:
        assert self._now is not None, "every entry point sets the clock first"
        return self._now

    def _holding(self) -> bool:
        recovery = self.state.recovery
        return recovery is not None and recovery.purpose is RecoveryPurpose.VERIFY

    def _replay_usable(self) -> bool:
        until = self.state.cooldown_until
        return self.replay and (until is None or self._clock() >= until)

    def _wait(self, attempt: int) -> float:
        return self.config.replay_timeout_s * self.config.replay_backoff**attempt

    def _count_applied(self, ts: float, replayed: bool, seq: int, recv_ts: float) -> None:
        health = self.health
        health.batches_applied += 1
        health.batches_replayed += replayed
        health.last_contiguous_seq = seq
        if not replayed:  # a replayed batch arrives late by design
            health.receive_lag_s = lag = recv_ts - ts
            health.receive_lag_min_s = self._lags.add(recv_ts, lag)
        second = ts // 1  # (a float: compared only)
        count = self._rate_count = self._rate_count + 1 if second == self._rate_second else 1
        self._rate_second = second
        if count > health.peak_batches_per_s:
            health.peak_batches_per_s = count

    def _begin(self, now: float) -> None:
        if self.state.quarantine is not None and self._now is not None:
            self.health.quarantine_s += max(0.0, now - self._now)
        self._now = now
        self._out = []

    def _end(self) -> list[StreamAction]:
        out, self._out = self._out, []
        return out
