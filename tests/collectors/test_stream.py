"""The worker stream state machine: messages and ticks in, actions out (collectors/stream.py).

Streams are built in a literal state; payloads are real msgpack made from schemas/events.py.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings, strategies as st

from kvmiss.collectors.continuity import (
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
    Release,
    RequestReplay,
    Run,
    StreamConfig,
    StreamState,
    TailConfirmed,
    Unverified,
    instance_from_topic,
    worker_id,
)
from kvmiss.collectors.frames import BatchMessage, Channel, FrameError, ReplayEnd, parse_live
from kvmiss.collectors.stream import WorkerStream
from kvmiss.schemas.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
)
from kvmiss.schemas.stream import RunStart

WORKER = worker_id("tcp://10.0.0.7:5557", 0)
TOPIC = "kv@pod-a@llama"
H = 0xF00D_0000_0000_0001


# --- builders ------------------------------------------------------------------------------------


def engine_ts(seq: int) -> float:
    return 1000.0 + seq / 100  # 100 batches per engine second


def payload(seq: int, *events, ts: float | None = None) -> bytes:
    events = list(events) or [BlockStored(block_hashes=[seq], block_size=16)]
    return msgspec.msgpack.encode(EventBatch(engine_ts(seq) if ts is None else ts, events, 0))


def live(seq: int, *events, topic: str = TOPIC, ts: float | None = None) -> BatchMessage:
    return BatchMessage(Channel.LIVE, topic, seq, payload(seq, *events, ts=ts))


def replayed(seq: int, *events, topic: str = TOPIC) -> BatchMessage:
    return BatchMessage(Channel.REPLAY, topic, seq, payload(seq, *events))


def stream_at(seq: int, *, epoch: int = 42, replay: bool = True, **kwargs) -> WorkerStream:
    """A stream of epoch ``epoch`` that has applied 0..seq with nothing missed."""
    state = StreamState(
        epoch=epoch, applied_seq=seq, live_seen=seq, run=Run(0, RunStart.EPOCH_START),
        last_payload=payload(seq), last_payload_seq=seq, instance=kwargs.pop("instance", None),
    )
    return WorkerStream(WORKER, replay=replay, state=state, **kwargs)


def feed(stream: WorkerStream, seqs, now: float = 1.0, **kw) -> list:
    return [a for s in seqs for a in stream.on_live(live(s, **kw), now)]


def answer(stream: WorkerStream, request_id: int, batches, now: float = 1.5, end: bool = True):
    """Replies to request ``request_id``: seqs or messages, then (by default) the end marker."""
    messages = [replayed(b) if isinstance(b, int) else b for b in batches]
    out = [a for m in messages for a in stream.on_replay(m, request_id, now)]
    return out + (stream.on_replay(ReplayEnd(), request_id, now) if end else [])


def applied(actions) -> list:
    return [a.batch for a in actions if isinstance(a, Apply)]


def seqs(actions) -> list[int]:
    return [b.seq for b in applied(actions)]


def facts(actions) -> list:
    return [a for a in actions if not isinstance(a, Apply)]


# --- builders are real wire data -----------------------------------------------------------------


def test_payload_builder_round_trips_through_the_wire_decoder():
    stored = BlockStored(block_hashes=[H], block_size=16)
    batch = decode_batch(payload(7, stored, AllBlocksCleared()))
    assert batch.ts == engine_ts(7) and batch.dp_rank == 0
    assert [type(e) for e in batch.events] == [BlockStored, AllBlocksCleared]
    assert parse_live([TOPIC.encode(), (7).to_bytes(8, "big"), payload(7)]) == live(7)


# --- continuity in one epoch ---------------------------------------------------------------------


def test_a_fresh_stream_starting_at_seq_zero_applies_in_order_from_epoch_start():
    stream = WorkerStream(WORKER, replay=True)
    out = feed(stream, [0, 1, 2], now=5.0)
    assert seqs(out) == [0, 1, 2] and facts(out) == []
    first = applied(out)[0]
    assert (first.run_start, first.run_start_seq, first.epoch, first.worker) == (
        RunStart.EPOCH_START, 0, 0, WORKER)
    assert (first.ts, first.recv_ts, first.replayed) == (engine_ts(0), 5.0, False)
    assert first.epoch_certain
    assert stream.cursor is Cursor.LIVE and stream.health.last_contiguous_seq == 2


def test_a_dropped_batch_is_recovered_by_replay_before_the_later_batch_is_applied():
    stream = stream_at(147)
    assert stream.on_live(live(149), now=1.0) == [RequestReplay(148, request_id=1)]
    assert stream.cursor is Cursor.RECOVERING and stream.held == 1
    out = answer(stream, 1, [replayed(148, BlockRemoved(block_hashes=[H])), 149], now=1.2)
    assert seqs(out) == [148, 149] and facts(out) == []
    removal = applied(out)[0]
    assert removal.replayed and removal.events == [BlockRemoved(block_hashes=[H])]
    assert removal.run_start is RunStart.EPOCH_START  # continuous: an eviction stays provable
    assert stream.cursor is Cursor.LIVE and not stream.quarantined
    assert (stream.health.replays_recovered, stream.health.duplicates) == (1, 1)
    assert seqs(feed(stream, [150])) == [150]


def test_replay_from_201_returning_only_205_to_207_confirms_hole_201_to_204_and_quarantines():
    stream = stream_at(200)
    assert stream.on_live(live(207), now=1.0) == [RequestReplay(201, request_id=1)]
    out = answer(stream, 1, [205, 206, 207], now=1.1)
    assert facts(out) == [Hole(42, 201, 204, HoleReason.MISSING, "replay ring no longer holds it"),
                          Quarantine(42, 201, HoleReason.MISSING)]
    assert seqs(out) == [205, 206, 207]
    after = applied(out)[0]
    assert (after.run_start, after.run_start_seq, after.gap_from_seq, after.gap_to_seq) == (
        RunStart.AFTER_GAP, 205, 201, 204)
    assert stream.quarantined and stream.health.unrecoverable_gaps == {HoleReason.MISSING: 1}
    assert stream.health.lost_batches == {HoleReason.MISSING: 4}
    assert (stream.health.replays_failed, stream.health.oldest_replayable_seq) == (1, 205)


def test_an_all_blocks_cleared_applied_after_the_hole_ends_the_quarantine():
    stream = stream_at(200)
    stream.on_live(live(207), now=1.0)
    answer(stream, 1, [205, 206, 207], now=1.1)
    out = feed(stream, [208], now=2.0) + stream.on_live(live(209, AllBlocksCleared()), now=3.0)
    assert facts(out) == [Release(42, 209, KnownEmpty.CLEARED)]
    assert applied(out)[1].run_start is RunStart.AFTER_GAP  # the index sees the clear itself
    assert not stream.quarantined and stream.health.quarantine_s == pytest.approx(3.0 - 1.1)


def test_a_replay_that_ends_before_covering_the_hole_makes_it_permanent():
    stream = stream_at(200)
    stream.on_live(live(204), now=1.0)
    out = answer(stream, 1, [201, 202], now=1.1)
    assert facts(out) == [
        Hole(42, 203, 203, HoleReason.MISSING, "replay ended before the hole was filled"),
        Quarantine(42, 203, HoleReason.MISSING),
    ]
    assert seqs(out) == [201, 202, 204]


def test_replay_and_live_overlap_is_applied_once():
    stream = stream_at(200)
    out = feed(stream, [203])
    out += answer(stream, 1, [201, 202, 203, 204, 205], end=False)  # replay gets ahead of live
    out += feed(stream, [204, 205, 206])
    out += stream.on_replay(ReplayEnd(), 1, now=2.0)
    assert seqs(out) == [201, 202, 203, 204, 205, 206]
    assert [b.replayed for b in applied(out)] == [True, True, False, True, True, False]
    assert stream.health.duplicates == 3 and stream.health.epoch_changes == 0


def test_a_malformed_payload_in_the_middle_is_a_counted_hole_and_the_rest_flows():
    stream = stream_at(200)
    bad = BatchMessage(Channel.LIVE, TOPIC, 201, b"\xc1 not msgpack")
    out = stream.on_live(bad, now=1.0) + feed(stream, [202, 203])
    hole = facts(out)[0]
    assert (hole.from_seq, hole.to_seq, hole.reason) == (201, 201, HoleReason.MALFORMED)
    assert "not msgpack" in hole.detail
    assert facts(out)[1:] == [Quarantine(42, 201, HoleReason.MALFORMED)]
    assert seqs(out) == [202, 203] and applied(out)[0].gap_from_seq == 201
    assert stream.health.unrecoverable_gaps == {HoleReason.MALFORMED: 1}
    assert stream.health.replays_requested == 0


def test_a_frame_without_a_readable_seq_is_counted_and_the_gap_it_leaves_is_asked_for():
    stream = stream_at(200)
    assert stream.on_live(FrameError("live: sequence frame must be 8 bytes, got 3"), now=1.0) == []
    assert stream.health.dropped == {DropReason.FRAME_ERROR: 1}
    assert stream.on_live(live(202), now=1.1) == [RequestReplay(201, request_id=1)]


# --- time-outs -----------------------------------------------------------------------------------


def test_a_replay_that_never_answers_is_retried_with_growing_waits_then_written_off_as_uncertain():
    stream = stream_at(200)
    assert stream.on_live(live(202), now=0.0) == [RequestReplay(201, request_id=1)]
    assert stream.on_tick(1.9) == []
    assert stream.on_tick(2.0) == [RequestReplay(201, request_id=2, attempt=1)]
    assert stream.next_deadline == 6.0
    assert stream.on_tick(6.0) == [RequestReplay(201, request_id=3, attempt=2)]
    assert stream.on_tick(14.0) == [RequestReplay(201, request_id=4, attempt=3)]
    out = stream.on_tick(30.0)
    assert facts(out) == [Hole(42, 201, 201, HoleReason.UNCERTAIN, "no replay answer in 4 tries"),
                          Quarantine(42, 201, HoleReason.UNCERTAIN)]
    assert seqs(out) == [202] and stream.next_deadline == 60.0  # a tail probe, after the cooldown
    assert stream.health.unrecoverable_gaps == {HoleReason.UNCERTAIN: 1}  # never "missing"
    assert (stream.health.replay_timeouts, stream.health.replays_failed) == (4, 1)


def test_after_an_unanswered_replay_new_holes_are_not_asked_for_until_the_cooldown_ends():
    stream = stream_at(200, config=StreamConfig(replay_retries=0, replay_cooldown_s=30.0))
    stream.on_live(live(202), now=0.0)
    stream.on_tick(2.0)
    assert facts(stream.on_live(live(204), now=10.0))[0].reason is HoleReason.UNCERTAIN
    assert stream.on_live(live(206), now=40.0) == [RequestReplay(205, request_id=2)]


def test_a_reply_to_an_abandoned_request_is_ignored():
    stream = stream_at(200)
    stream.on_live(live(202), now=0.0)
    stream.on_tick(2.0)  # request 1 abandoned, request 2 sent
    assert answer(stream, 1, [150, 151]) == []
    assert stream.health.dropped == {DropReason.STALE_REPLY: 3}
    assert seqs(answer(stream, 2, [201, 202])) == [201, 202]


# --- the recovery buffer -------------------------------------------------------------------------


def test_a_full_recovery_buffer_drops_its_oldest_batch_and_replay_refills_it():
    stream = stream_at(200, config=StreamConfig(buffer_limit=3))
    out = feed(stream, [202, 203, 204, 205, 206])
    assert stream.held == 3 and stream.health.dropped == {DropReason.BUFFER_FULL: 2}
    out += answer(stream, 1, [201, 202, 203, 204, 205, 206])
    assert seqs(out) == [201, 202, 203, 204, 205, 206] and facts(out)[1:] == []


def test_batches_dropped_from_a_full_buffer_join_the_hole_when_replay_cannot_give_them():
    stream = stream_at(200, config=StreamConfig(buffer_limit=3, replay_retries=0))
    feed(stream, [202, 203, 204, 205, 206], now=0.0)
    out = stream.on_tick(2.0)
    assert facts(out)[0] == Hole(42, 201, 203, HoleReason.UNCERTAIN, "no replay answer in 1 tries")
    assert seqs(out) == [204, 205, 206]
    assert stream.health.lost_batches == {HoleReason.UNCERTAIN: 3}


# --- joining and epochs --------------------------------------------------------------------------


def test_a_mid_epoch_join_asks_for_everything_and_starts_joined_when_the_ring_moved_on():
    stream = WorkerStream(WORKER, replay=True)
    assert stream.on_live(live(5000), now=1.0) == [RequestReplay(0, request_id=1)]
    out = answer(stream, 1, range(4990, 5001))
    assert facts(out) == [] and seqs(out) == list(range(4990, 5001))
    assert {(b.run_start, b.run_start_seq) for b in applied(out)} == {(RunStart.JOINED, 4990)}
    assert not stream.quarantined and stream.health.joins == 1


def test_a_mid_epoch_join_that_replay_covers_from_zero_starts_at_epoch_start():
    stream = WorkerStream(WORKER, replay=True)
    stream.on_live(live(3), now=1.0)
    out = answer(stream, 1, [0, 1, 2, 3])
    assert seqs(out) == [0, 1, 2, 3] and applied(out)[3].run_start is RunStart.EPOCH_START


def test_a_mid_epoch_join_whose_replay_never_answers_starts_joined_and_is_counted_as_failed():
    stream = WorkerStream(WORKER, replay=True, config=StreamConfig(replay_retries=0))
    stream.on_live(live(800), now=0.0)
    out = stream.on_tick(2.0)
    assert facts(out) == [] and applied(out)[0].run_start is RunStart.JOINED
    assert (stream.health.joins, stream.health.replays_failed) == (1, 1)


def test_without_a_replay_endpoint_nothing_is_asked_a_join_is_joined_and_a_gap_is_immediate():
    stream = WorkerStream(WORKER, replay=False)
    out = feed(stream, [70, 71, 74])
    assert applied(out)[0].run_start is RunStart.JOINED
    assert facts(out) == [Hole(0, 72, 73, HoleReason.NO_REPLAY_ENDPOINT),
                          Quarantine(0, 72, HoleReason.NO_REPLAY_ENDPOINT)]
    assert seqs(out) == [70, 71, 74] and stream.health.replays_requested == 0


def test_a_publisher_restart_is_a_new_epoch_replayed_from_zero_not_duplicates():
    stream = stream_at(50)
    out = stream.on_live(live(1), now=1.0)  # the new process's seq 0 was lost on reconnect
    assert out == [NewEpoch(43, EpochCause.SEQ_RESET), RequestReplay(0, request_id=1)]
    out = answer(stream, 1, [0, 1]) + feed(stream, [2])
    assert seqs(out) == [0, 1, 2] and {b.epoch for b in applied(out)} == {43}
    assert {(b.run_start, b.run_start_seq) for b in applied(out)} == {(RunStart.EPOCH_START, 0)}
    assert stream.health.duplicates == 1 and stream.health.epoch_changes == 1


def test_a_new_epoch_whose_seq_zero_is_gone_starts_after_a_gap_and_is_quarantined():
    stream = stream_at(50)
    stream.on_live(live(9), now=1.0)
    out = answer(stream, 1, [4, 5, 6, 7, 8, 9])
    assert facts(out)[0] == Hole(43, 0, 3, HoleReason.MISSING, "replay ring no longer holds it")
    assert applied(out)[0].run_start is RunStart.AFTER_GAP and stream.quarantined


def test_a_new_epoch_from_seq_zero_ends_an_earlier_quarantine():
    stream = stream_at(200)
    stream.on_live(BatchMessage(Channel.LIVE, TOPIC, 201, b"\xc1"), now=1.0)
    out = stream.on_live(live(0), now=2.0)
    assert facts(out) == [NewEpoch(43, EpochCause.SEQ_RESET),
                          Release(43, 0, KnownEmpty.EPOCH_START)]
    assert not stream.quarantined


def test_an_instance_change_in_the_topic_is_a_new_epoch_even_while_seq_goes_up():
    template = "kv@{instance}@{model}"
    stream = stream_at(200, topic_template=template, instance="pod-a")
    out = stream.on_live(live(900, topic="kv@pod-b@llama"), now=1.0)
    assert out == [NewEpoch(43, EpochCause.INSTANCE_CHANGED, "pod-b"),
                   RequestReplay(0, request_id=1)]
    assert seqs(feed(stream, [901], topic="kv@pod-b@llama")) == []  # held behind the replay


def test_topic_templates_yield_the_instance_id_or_none():
    assert instance_from_topic("kv@{instance}@model", "kv@pod-7@model") == "pod-7"
    llm_d = "kv@10.0.0.1:5557@meta/llama@v2"
    assert instance_from_topic("kv@{instance}@{model}", llm_d) == "10.0.0.1:5557"
    assert instance_from_topic("kv@{instance}@model", "other@pod-7@model") is None
    with pytest.raises(ValueError):
        instance_from_topic("kv@{model}", "kv@x")


# --- reconnects ----------------------------------------------------------------------------------


def test_a_reconnect_re_reads_the_last_batch_and_continues_when_the_bytes_match():
    stream = stream_at(200)
    assert stream.on_reconnect(now=1.0) == [RequestReplay(200, request_id=1)]
    assert stream.on_live(live(201), now=1.1) == [] and stream.cursor is Cursor.VERIFYING
    out = answer(stream, 1, [200, 201, 202], now=1.2)
    assert seqs(out) == [201, 202] and facts(out) == []
    assert applied(out)[0].epoch == 42 and applied(out)[0].epoch_certain


def test_a_reconnect_with_instance_ids_trusts_the_topic_and_re_sends_an_outstanding_request():
    stream = stream_at(200, topic_template="kv@{instance}@{model}", instance="pod-a")
    stream.on_live(live(202), now=1.0)
    assert stream.on_reconnect(now=2.0) == [RequestReplay(201, request_id=2)]
    assert seqs(answer(stream, 2, [201, 202])) == [201, 202] and stream.state.epoch_certain


def test_a_reconnect_to_other_bytes_at_the_last_seq_is_a_new_uncertain_epoch_until_seq_zero():
    stream = stream_at(200)
    stream.on_reconnect(now=1.0)
    other = BatchMessage(Channel.REPLAY, TOPIC, 200, payload(200, ts=5.0))
    assert stream.on_replay(other, 1, now=1.1) == [
        NewEpoch(43, EpochCause.IDENTITY_MISMATCH, certain=False), RequestReplay(0, request_id=2)]
    out = answer(stream, 2, range(0, 201))
    assert seqs(out) == list(range(0, 201)) and all(b.epoch_certain for b in applied(out))


def test_a_reconnect_without_a_replay_endpoint_leaves_the_epoch_uncertain_until_a_clear():
    stream = stream_at(200, replay=False)
    assert stream.on_reconnect(now=1.0) == [EpochUncertain(42, Unverified.NO_REPLAY_ENDPOINT)]
    out = feed(stream, [201]) + stream.on_live(live(202, AllBlocksCleared()), 1.0)
    out += feed(stream, [203])
    assert [b.epoch_certain for b in applied(out)] == [False, True, True]


def test_a_reconnect_check_that_gets_no_answer_applies_held_batches_as_uncertain():
    stream = stream_at(200, config=StreamConfig(replay_retries=1))
    stream.on_reconnect(now=0.0)
    feed(stream, [201], now=0.5)
    stream.on_tick(2.0)
    out = stream.on_tick(6.0)
    assert facts(out) == [EpochUncertain(42, Unverified.NO_ANSWER)]
    assert seqs(out) == [201] and not applied(out)[0].epoch_certain


def test_a_reconnect_check_answered_by_an_empty_ring_is_uncertain_and_loses_the_open_hole():
    stream = stream_at(200)
    stream.on_live(live(203), now=1.0)  # 201..202 being asked for when the connection drops
    assert stream.on_reconnect(now=2.0) == [RequestReplay(200, request_id=2)]
    assert stream.on_replay(ReplayEnd(), 2, now=2.1) == [
        EpochUncertain(42, Unverified.NOT_IN_RING),
        Hole(42, 201, 203, HoleReason.MISSING, "replay ended before the hole was filled"),
        Quarantine(42, 201, HoleReason.MISSING),
    ]
    assert stream.health.dropped == {DropReason.RECONNECT: 1}
    assert seqs(feed(stream, [204])) == [204]


def test_a_consumer_down_longer_than_the_replay_window_is_quarantined_not_resumed():
    stream = stream_at(200)
    stream.on_reconnect(now=100.0)
    feed(stream, [12500], now=100.1)
    out = answer(stream, 1, range(12000, 12501), now=100.2)
    assert facts(out) == [
        EpochUncertain(42, Unverified.NOT_IN_RING),
        Hole(42, 201, 11999, HoleReason.MISSING, "replay ring no longer holds it"),
        Quarantine(42, 201, HoleReason.MISSING),
    ]
    assert seqs(out) == list(range(12000, 12501)) and stream.quarantined


# --- health --------------------------------------------------------------------------------------


def test_peak_batch_rate_is_counted_over_whole_seconds_of_engine_time():
    stream = WorkerStream(WORKER, replay=True)
    for seq, ts in enumerate([10.1, 10.5, 10.9, 11.0, 12.2, 12.3]):
        stream.on_live(live(seq, ts=ts), now=1.0)
    assert stream.health.peak_batches_per_s == 3


# --- against a publisher with a bounded ring -----------------------------------------------------


@given(lost=st.sets(st.integers(0, 58)), every=st.integers(1, 7), ring=st.integers(1, 60))
def test_every_seq_is_applied_once_in_order_or_inside_exactly_one_confirmed_hole(lost, every, ring):
    """Live loses any batches but the last; the ring (last ``ring`` batches) answers on every
    ``every``-th step. A ring that holds everything gives everything back."""
    stream, published, out, requests = WorkerStream(WORKER, replay=True), [], [], []

    def act(actions):
        out.extend(actions)
        requests.extend(a for a in actions if isinstance(a, RequestReplay))

    def serve(request):
        in_ring = [s for s in published[-ring:] if s >= request.start_seq]
        act(answer(stream, request.request_id, in_ring))

    for seq in range(60):
        published.append(seq)
        if seq not in lost:
            act(stream.on_live(live(seq), now=float(seq)))
        if requests and seq % every == 0:
            serve(requests.pop(0))
    while requests:
        serve(requests.pop(0))
    accounted = [a.batch.seq if isinstance(a, Apply) else range(a.from_seq, a.to_seq + 1)
                 for a in out if isinstance(a, (Apply, Hole))]
    flat = [s for item in accounted for s in (item if isinstance(item, range) else [item])]
    holes = [a for a in out if isinstance(a, Hole)]
    assert flat == list(range(flat[0], 60))  # in order, once, nothing unaccounted after the start
    assert flat[0] == 0 or applied(out)[0].run_start is RunStart.JOINED  # seq 0 gone from the ring
    assert all(h.reason is HoleReason.MISSING for h in holes) and stream.quarantined == bool(holes)
    if ring == 60:
        assert flat == list(range(60)) and not holes


# --- tail probes: proof of an idle worker ---------------------------------------------------------

PROBE = RequestReplay  # a tail probe is a RequestReplay with tail_probe=True


def quiet_stream(last: int = 2, *, now: float = 1.0, **kwargs) -> WorkerStream:
    """A fresh stream that applied 0..last live at ``now`` and then heard nothing."""
    stream = WorkerStream(WORKER, replay=kwargs.pop("replay", True), **kwargs)
    feed(stream, range(last + 1), now=now)
    return stream


def test_a_quiet_live_stream_sends_a_tail_probe_from_its_last_batch_after_the_interval():
    stream = quiet_stream()
    assert stream.next_deadline == 1.5  # StreamConfig default: 0.5 s of silence
    assert stream.on_tick(1.49) == []
    assert stream.on_tick(1.5) == [PROBE(2, request_id=1, tail_probe=True)]
    assert stream.cursor is Cursor.LIVE  # a probe is not a recovery: nothing is held back
    assert stream.next_deadline == 1.5 + 2.0  # the probe's answer time-out
    h = stream.health
    assert (h.tail_probes, h.replays_requested, h.gaps_detected) == (1, 0, 0)


def test_our_last_batch_back_then_the_end_marker_confirms_the_tail_at_the_send_time():
    stream = quiet_stream()
    stream.on_tick(1.5)
    out = answer(stream, 1, [2], now=1.62)  # SGLang answers between queue polls (~100 ms)
    assert out == [TailConfirmed(0, 2, at=1.5)]  # the send time: conservative
    h = stream.health
    assert (h.tail_confirmations, h.duplicates, h.batches_applied) == (1, 0, 3)
    assert h.oldest_replayable_seq is None  # a probe's reply starts at the newest batch
    assert stream.next_deadline == pytest.approx(1.62 + 0.5)  # still idle: probe again
    stream.on_tick(2.12)
    assert facts(answer(stream, 2, [2], now=2.2)) == [TailConfirmed(0, 2, at=2.12)]


def test_a_probe_answered_with_batches_after_the_tail_applies_them_as_a_recovered_tail():
    stream = quiet_stream()
    stream.on_tick(1.5)
    removal = replayed(3, BlockRemoved(block_hashes=[H]))
    out = answer(stream, 1, [2, removal, 4], now=1.6)  # 3 and 4 were lost live
    assert seqs(out) == [3, 4] and all(b.replayed for b in applied(out))
    assert {(b.run_start, b.run_start_seq, b.gap_from_seq) for b in applied(out)} == {
        (RunStart.EPOCH_START, 0, None)}  # continuous: the removal stays provable
    assert facts(out) == [TailConfirmed(0, 4, at=1.5)]  # the answer ended after 4
    h = stream.health
    assert (h.tail_recoveries, h.batches_replayed, h.replays_recovered) == (1, 2, 0)
    assert not stream.quarantined and stream.health.unrecoverable_gaps == {}


def test_a_probe_whose_ring_moved_on_past_the_tail_writes_off_the_missing_batches():
    stream = quiet_stream()
    stream.on_tick(1.5)
    out = answer(stream, 1, [7, 8], now=1.6)  # 3..6 published and lost, gone from the ring
    assert facts(out) == [
        EpochUncertain(0, Unverified.NOT_IN_RING),  # our last batch cannot be re-read
        Hole(0, 3, 6, HoleReason.MISSING, "replay ring no longer holds it"),
        Quarantine(0, 3, HoleReason.MISSING),
    ]
    assert seqs(out) == [7, 8] and stream.quarantined  # nothing confirmed


def test_a_silent_probe_is_retried_then_given_up_without_a_hole_or_a_confirmation():
    stream = quiet_stream(config=StreamConfig(replay_retries=1))
    assert stream.on_tick(1.5) == [PROBE(2, request_id=1, tail_probe=True)]
    assert stream.on_tick(3.5) == [PROBE(2, request_id=2, attempt=1, tail_probe=True)]
    assert stream.on_tick(7.5) == []  # given up: nothing is known missing, nothing proven
    assert not stream.quarantined and stream.cursor is Cursor.LIVE
    h = stream.health
    assert (h.tail_probes, h.tail_probes_unanswered, h.tail_confirmations) == (2, 1, 0)
    assert (h.replay_timeouts, h.replays_failed, h.unrecoverable_gaps) == (0, 0, {})
    assert stream.state.cooldown_until is None  # ordinary recovery may still ask at once
    assert stream.next_deadline == 7.5 + 30.0  # the next probe waits out a cooldown
    assert stream.on_live(live(4), now=8.0) == [RequestReplay(3, request_id=3)]


def test_a_live_batch_during_a_probe_supersedes_it_and_its_late_answer_is_stale():
    stream = quiet_stream()
    stream.on_tick(1.5)
    assert seqs(feed(stream, [3], now=1.55)) == [3]
    assert stream.next_deadline == pytest.approx(2.05)  # silence counts from the live batch
    assert answer(stream, 1, [2, 3], now=1.6) == []  # confirms nothing about 3's tail
    h = stream.health
    assert (h.tail_probes_superseded, h.tail_confirmations) == (1, 0)
    assert h.dropped == {DropReason.STALE_REPLY: 3}


def test_a_hole_revealed_during_a_probe_gets_an_ordinary_replay():
    stream = quiet_stream()
    stream.on_tick(1.5)
    assert stream.on_live(live(4), now=1.55) == [RequestReplay(3, request_id=2)]
    assert stream.cursor is Cursor.RECOVERING
    assert seqs(answer(stream, 2, [3, 4], now=1.6)) == [3, 4]
    assert (stream.health.replays_recovered, stream.health.tail_probes_superseded) == (1, 1)


def test_other_bytes_at_the_last_seq_mean_another_process_answers_a_new_uncertain_epoch():
    stream = quiet_stream()
    stream.on_tick(1.5)
    other = BatchMessage(Channel.REPLAY, TOPIC, 2, payload(2, ts=5.0))
    assert stream.on_replay(other, 1, now=1.6) == [
        NewEpoch(1, EpochCause.IDENTITY_MISMATCH, certain=False), RequestReplay(0, request_id=2)]
    assert stream.health.tail_confirmations == 0


def test_an_answer_without_our_last_batch_confirms_nothing():
    stream = quiet_stream()
    stream.on_tick(1.5)
    # A restarted process that has published fewer batches (or none): its newest is older.
    assert answer(stream, 1, [], now=1.6) == []
    assert stream.health.tail_unverified == 1 and stream.state.epoch_certain
    assert stream.next_deadline == pytest.approx(2.1)


def test_a_reconnect_supersedes_a_probe_with_its_own_identity_check():
    stream = quiet_stream()
    stream.on_tick(1.5)
    assert stream.on_reconnect(now=1.55) == [RequestReplay(2, request_id=2)]
    assert stream.cursor is Cursor.VERIFYING and stream.health.tail_probes_superseded == 1


@pytest.mark.parametrize("why, kwargs", [
    ("disabled", dict(config=StreamConfig(tail_probe_interval_s=None))),
    ("no replay endpoint", dict(replay=False)),
])
def test_no_probe_when_disabled_or_without_a_replay_endpoint(why, kwargs):
    stream = quiet_stream(**kwargs)
    assert stream.next_deadline is None and stream.on_tick(100.0) == [], why


def test_no_probe_while_a_hole_is_recovered_or_replay_cools_down():
    stream = quiet_stream(config=StreamConfig(replay_retries=0, replay_cooldown_s=30.0))
    assert stream.on_live(live(4), now=1.0) == [RequestReplay(3, request_id=1)]
    assert stream.next_deadline == 3.0  # the recovery's time-out, not a probe
    stream.on_tick(3.0)  # unanswered: written off, replay cools down until 33
    assert stream.next_deadline == 33.0
    assert stream.on_tick(10.0) == []
    assert stream.on_tick(33.0) == [PROBE(4, request_id=2, tail_probe=True)]


def test_a_quarantined_stream_probes_too_and_a_lost_clear_in_its_tail_releases_it():
    stream = quiet_stream()
    out = stream.on_live(BatchMessage(Channel.LIVE, TOPIC, 3, b"\xc1"), now=1.1) + feed(stream, [4], now=1.2)
    assert facts(out)[1] == Quarantine(0, 3, HoleReason.MALFORMED) and stream.quarantined
    assert stream.on_tick(1.7) == [PROBE(4, request_id=1, tail_probe=True)]
    out = answer(stream, 1, [4, replayed(5, AllBlocksCleared())], now=1.8)
    assert seqs(out) == [5]
    assert facts(out) == [Release(0, 5, KnownEmpty.CLEARED), TailConfirmed(0, 5, at=1.7)]
    assert not stream.quarantined


def test_seconds_quarantined_keep_growing_on_ticks_after_the_last_batch():
    stream = WorkerStream(WORKER, replay=False)
    feed(stream, [0], now=1.0)
    stream.on_live(BatchMessage(Channel.LIVE, TOPIC, 1, b"\xc1"), now=2.0)
    assert stream.quarantined and stream.next_deadline is None  # nothing is ever due
    stream.on_tick(12.0)
    assert stream.health.quarantine_s == pytest.approx(10.0)


def test_the_fleet_tells_every_stream_the_time_so_quarantine_seconds_keep_up():
    from kvmiss.collectors.fleet import SUB, Fleet
    from kvmiss.schemas.config import WorkerSpec

    fleet = Fleet([WorkerSpec(id="w0", endpoint="tcp://127.0.0.1:1")], lambda w, a: None)
    fleet.on_message("w0", SUB, [TOPIC.encode(), (0).to_bytes(8, "big"), payload(0)], 1.0)
    fleet.on_message("w0", SUB, [TOPIC.encode(), (1).to_bytes(8, "big"), b"\xc1"], 2.0)
    assert fleet.next_deadline() is None
    assert fleet.on_tick(32.0) == []
    assert fleet.streams["w0"].health.quarantine_s == pytest.approx(30.0)


class TestTailProbesWaitTheirTurn:
    """A fleet that went quiet together must not open a probe DEALER per worker at once
    (`Fleet.max_tail_probes`); and a worker whose socket holds messages kvmiss has not read
    yet is not quiet at all. The probes refused wait their turn; each proof still comes."""

    @staticmethod
    def quiet_fleet(workers: int, bound: int):
        from kvmiss.collectors.fleet import DEALER, SUB, Fleet
        from kvmiss.schemas.config import WorkerSpec

        specs = [WorkerSpec(id=f"w{i}", endpoint=f"tcp://127.0.0.1:{7000 + i}",
                            replay_endpoint=f"tcp://127.0.0.1:{8000 + i}") for i in range(workers)]
        facts_seen: list[tuple[str, object]] = []
        fleet = Fleet(specs, lambda w, a: facts_seen.append((w, a)), max_tail_probes=bound)
        for spec in specs:  # one live batch each at t=1.0, then silence
            fleet.on_message(spec.id, SUB, [TOPIC.encode(), (0).to_bytes(8, "big"), payload(0)], 1.0)
        return fleet, facts_seen, SUB, DEALER

    @staticmethod
    def answer_probe(fleet, worker: str, request_id: int, now: float, dealer: str) -> None:
        from kvmiss.collectors.frames import END_SEQ_BYTES

        reply = [b"", TOPIC.encode(), (0).to_bytes(8, "big"), payload(0)]  # our last batch, then the end
        fleet.on_message(worker, dealer, reply, now, request_id)
        fleet.on_message(worker, dealer, [b"", b"", END_SEQ_BYTES, b""], now, request_id)

    def test_no_more_than_the_bound_are_in_flight_and_the_rest_are_deferred_and_counted(self):
        fleet, _, _, _ = self.quiet_fleet(10, bound=3)
        probes = fleet.on_tick(1.5)
        assert len(probes) == 3 and all(r.tail_probe for _, r in probes)
        assert sum(s.probing for s in fleet.streams.values()) == 3
        deferred = {w for w, s in fleet.streams.items() if s.health.tail_probes_deferred == 1}
        assert len(deferred) == 7 and deferred.isdisjoint(w for w, _ in probes)
        assert fleet.next_deadline() == pytest.approx(1.55)  # a deferred probe asks again soon
        assert fleet.on_tick(1.55) == []  # still 3 out: refused again, nothing sent
        assert sum(s.health.tail_probes_deferred for s in fleet.streams.values()) == 14

    def test_answered_probes_free_their_places_and_every_worker_is_confirmed_in_turn(self):
        fleet, facts_seen, _, dealer = self.quiet_fleet(10, bound=3)
        now, confirmed, most_in_flight = 1.5, set(), 0
        while len(confirmed) < 10 and now < 5.0:
            for worker, request in fleet.on_tick(now):
                most_in_flight = max(most_in_flight, sum(s.probing for s in fleet.streams.values()))
                self.answer_probe(fleet, worker, request.request_id, now + 0.001, dealer)
            confirmed = {w for w, a in facts_seen if isinstance(a, TailConfirmed)}
            now = round(now + 0.05, 3)
        assert confirmed == set(fleet.streams) and most_in_flight == 3
        assert now < 2.0  # ten workers, three at a time, one round each: four rounds
        assert all(s.health.tail_probes == 1 for s in fleet.streams.values())

    def test_a_worker_with_unread_messages_does_not_probe_until_they_are_read(self):
        fleet, _, _, _ = self.quiet_fleet(3, bound=64)
        probes = fleet.on_tick(1.5, unread={"w1"})
        assert [w for w, _ in probes] == ["w0", "w2"]
        assert not fleet.streams["w1"].probing and fleet.streams["w1"].health.tail_probes_deferred == 1
        assert [w for w, _ in fleet.on_tick(1.55)] == ["w1"]  # read since, still silent: now it asks

    def test_recorded_ticks_replay_the_same_deferrals(self):
        from kvmiss.collectors.fleet import TICK, UNREAD

        live_fleet, _, _, _ = self.quiet_fleet(6, bound=2)
        played, _, _, _ = self.quiet_fleet(6, bound=2)
        due = [w for w, s in live_fleet.streams.items() if (d := s.next_deadline) and d <= 1.5]
        sent = [w for w, _ in live_fleet.on_tick(1.5, unread={"w0"})]
        assert "w0" not in sent and len(sent) == 2
        for worker in due:  # playback: one tick record per due stream, in the fleet's order
            played.on_message(worker, TICK, [UNREAD] if worker == "w0" else [], 1.5)
        assert [w for w, s in played.streams.items() if s.probing] == sent
        assert ({w: s.health.tail_probes_deferred for w, s in played.streams.items()}
                == {w: s.health.tail_probes_deferred for w, s in live_fleet.streams.items()})


    def test_a_recording_with_an_unread_tick_plays_back_the_same_deferral(self, tmp_path):
        from kvmiss.collectors.fleet import SUB, TICK, UNREAD, Fleet, play_recording
        from kvmiss.collectors.recording import RecordedMessage, RecordingWriter

        live_fleet, _, _, _ = self.quiet_fleet(3, bound=64)
        played = Fleet(live_fleet.specs.values(), lambda w, a: None, max_tail_probes=64)
        writer = RecordingWriter(str(tmp_path / "events.rec"))
        for spec in live_fleet.specs.values():  # what the live fleet received, as recorded
            writer.write(RecordedMessage(1.0, spec.id, SUB, [TOPIC.encode(), (0).to_bytes(8, "big"), payload(0)]))
        unread = {"w1"}
        for worker, stream in live_fleet.streams.items():  # as `Subscriber._poll_once` records
            if (due := stream.next_deadline) is not None and due <= 1.5:
                writer.write(RecordedMessage(1.5, worker, TICK, [UNREAD] if worker in unread else []))
        sent = [w for w, _ in live_fleet.on_tick(1.5, unread)]
        writer.close()
        play_recording(str(tmp_path / "events.rec"), played)
        assert sent == ["w0", "w2"]
        assert [w for w, s in played.streams.items() if s.probing] == sent
        assert played.streams["w1"].health.tail_probes_deferred == 1


class TestReplayOnFirstConnect:
    """A publisher that went quiet right after a burst (or before we connected) must not leave
    the stream INITIAL: the first connection asks for the whole ring (found in the real vLLM
    run, where kvmiss's subscriber sometimes connected after the engine's only burst)."""

    def test_the_first_connection_asks_for_everything_from_seq_0(self):
        stream = WorkerStream("w0", replay=True)
        (request,) = [a for a in stream.on_connect(1.0) if isinstance(a, RequestReplay)]
        assert request.start_seq == 0

    def test_the_burst_comes_back_through_replay_as_an_epoch_start(self):
        stream = WorkerStream("w0", replay=True)
        (request,) = stream.on_connect(1.0)
        applied = []
        for seq in range(3):
            applied += [a.batch for a in stream.on_replay(replayed(seq), request.request_id, 1.1)
                        if isinstance(a, Apply)]
        stream.on_replay(ReplayEnd(), request.request_id, 1.2)
        assert [b.seq for b in applied] == [0, 1, 2]
        assert applied[0].run_start is RunStart.EPOCH_START and stream.state.recovery is None

    def test_an_empty_ring_leaves_nothing_owed(self):
        stream = WorkerStream("w0", replay=True)
        (request,) = stream.on_connect(1.0)
        assert stream.on_replay(ReplayEnd(), request.request_id, 1.1) == []
        assert stream.state.recovery is None and not stream.quarantined

    def test_not_without_a_replay_endpoint_or_when_turned_off(self):
        assert WorkerStream("w0", replay=False).on_connect(1.0) == []
        off = WorkerStream("w0", replay=True, config=StreamConfig(replay_on_connect=False))
        assert off.on_connect(1.0) == []


def test_the_receive_lag_of_live_batches_shows_delivery_delay_plus_clock_skew():
    stream = WorkerStream("w0", replay=True)
    stream.on_live(live(0, ts=1000.0), now=1000.25)
    assert stream.health.receive_lag_s == 0.25
    stream.on_live(live(1, ts=1001.0), now=1000.75)  # the engine's clock runs ahead of ours
    assert stream.health.receive_lag_s == -0.25


class TestClockWindow:
    """The clock estimate the service checks against ``[history] clock_skew_s``: the sliding
    minimum of live batches' receive lags (lag = offset + delivery delay, delay >= 0)."""

    def test_the_minimum_lag_of_live_batches_estimates_the_offset_and_ignores_one_late_batch(self):
        stream = WorkerStream("w0", replay=True, config=StreamConfig(clock_window_s=10.0))
        for seq in range(5):
            stream.on_live(live(seq, ts=1000.0 + seq), now=1000.05 + seq)
        assert stream.health.receive_lag_min_s == pytest.approx(0.05)
        stream.on_live(live(5, ts=1005.0), now=1009.0)  # a 4 s stall on the way
        assert stream.health.receive_lag_s == pytest.approx(4.0)  # the last batch's lag moves
        assert stream.health.receive_lag_min_s == pytest.approx(0.05)  # the estimate does not

    def test_replayed_batches_are_not_measured(self):
        stream = stream_at(4)
        (request,) = [a for a in stream.on_live(live(7, ts=1007.0), now=1007.1)
                      if isinstance(a, RequestReplay)]
        answer(stream, request.request_id, [5, 6], now=1100.0)  # 90 s late, by design
        assert stream.health.batches_replayed == 2
        assert stream.health.receive_lag_min_s == pytest.approx(0.1)

    def test_an_engine_clock_that_jumps_ahead_shows_at_once(self):
        window = LagWindow(10.0)
        for i in range(20):
            window.add(100.0 + i, 0.02)
        assert window.add(120.0, -3.0) == -3.0  # no delivery takes negative time: proof

    def test_an_engine_clock_that_falls_behind_shows_once_the_older_samples_left_the_window(self):
        window = LagWindow(10.0, min_samples=4, slots=5)
        for i in range(20):
            window.add(100.0 + i * 0.5, 0.02)  # 100.0 .. 109.5
        lags = [window.add(110.0 + i * 0.5, 3.0) for i in range(30)]  # 110.0 .. 124.5
        assert lags[0] == 0.02  # the earlier, quicker deliveries still bound the offset
        first_behind = next(i for i, lag in enumerate(lags) if lag == 3.0)
        # not before the last quick sample is a window old, and at most one slot after
        assert 109.5 + 10.0 <= 110.0 + first_behind * 0.5 <= 109.5 + 10.0 + 10.0 / 5

    def test_after_an_idle_spell_the_first_batches_back_do_not_decide_alone(self):
        window = LagWindow(1.0, min_samples=16)
        for i in range(16):
            window.add(100.0 + i * 0.01, 0.02)
        assert window.add(500.0, 7.0) == 0.02  # one lagging batch after 400 s idle
        for i in range(14):
            window.add(500.1 + i * 0.01, 7.0)
        assert window.minimum == 0.02
        assert window.add(500.3, 7.0) == 7.0  # 16 newer samples, all of them late: it shows
        assert len(window) == 16

    def test_memory_is_bounded_whatever_the_batch_rate(self):
        window = LagWindow(2.0, min_samples=16, slots=8)
        for i in range(100_000):
            window.add(i * 0.001, (i % 97) / 1000)  # 1000 batches/s for 100 s
        assert len(window._slots) <= 8 + 16 + 1
        assert window.minimum == 0.0

    @settings(max_examples=300, deadline=None)
    @given(window_s=st.sampled_from([0.0, 0.05, 1.0, 2.0, 10.0]), min_samples=st.integers(1, 20),
           slots=st.integers(1, 10),
           steps=st.lists(st.tuples(st.floats(-0.5, 3.0), st.floats(-5.0, 5.0)), max_size=300))
    def test_the_window_answers_as_the_plain_rule_does_after_every_sample(self, window_s, min_samples,
                                                                         slots, steps):
        """The common case skips the eviction check while no slot can leave; the plain rule
        (evict, then the minimum of what is left) after each sample is the reference."""
        window = LagWindow(window_s, min_samples=min_samples, slots=slots)
        width = window_s / max(1, slots)
        ref: list[list[float]] = []  # [start, min lag, count]
        now = 100.0
        for dt, lag in steps:
            now += dt
            if ref and now < ref[-1][0] + width:
                ref[-1][1] = min(ref[-1][1], lag)
                ref[-1][2] += 1
            else:
                ref.append([now, lag, 1])
            while (len(ref) > 1 and ref[0][0] + width <= now - window_s
                   and sum(r[2] for r in ref) - ref[0][2] >= max(1, min_samples)):
                ref.pop(0)
            assert window.add(now, lag) == min(r[1] for r in ref)
            assert len(window) == sum(r[2] for r in ref)

    def test_a_receive_clock_stepping_back_joins_the_newest_slot(self):
        window = LagWindow(10.0)
        window.add(100.0, 0.5)
        window.add(90.0, 0.4)
        assert window.minimum == 0.4 and len(window._slots) == 1

    def test_the_window_survives_an_epoch_change(self):
        """The clock is the host's: a restarted process on it keeps the same offset."""
        stream = stream_at(9)
        stream.on_live(live(10, ts=1000.0), now=1000.1)
        stream.on_live(live(0, ts=1001.0), now=1004.0)  # seq reset: a new process, 3 s late
        assert stream.state.epoch == 43
        assert stream.health.receive_lag_min_s == pytest.approx(0.1)
