"""Faults injected into real traffic: the real SGLang 0.5.23 publisher on loopback, the lossy
proxy (tests/peers/lossy_proxy.py) between it and a real `Subscriber(Fleet(...))`.

Each case asserts the collector's facts (applied seqs, runs, holes, epochs, quarantine and
health counters), not only that nothing crashed. Nothing sleeps and hopes: every step waits
for a condition with a deadline.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import pytest
from lossy_proxy import LossyProxy
from sglang_publisher import batch, close, publisher
from zmq_ports import free_tcp

from kvmiss.collectors.continuity import (
    Apply,
    DropReason,
    EpochCause,
    EpochUncertain,
    Hole,
    HoleReason,
    KnownEmpty,
    NewEpoch,
    Quarantine,
    Release,
    StreamConfig,
    TailConfirmed,
    Unverified,
)
from kvmiss.collectors.fleet import TICK, Fleet, play_recording
from kvmiss.collectors.recording import RecordingWriter, read_recording
from kvmiss.collectors.subscriber import Subscriber
from kvmiss.schemas.config import WorkerSpec
from kvmiss.schemas.events import AllBlocksCleared
from kvmiss.schemas.stream import RunStart

WAIT_S = 5.0  # deadline for any one condition; a healthy run meets each in milliseconds
# The cases below assert every replay request and fact, so tail probes (timer-driven, sent
# whenever a worker is quiet for a moment) and the replay on first connect are off unless a
# case is about them.
# The cases also count replay requests exactly: a replay through the proxy answers in
# milliseconds, and the 2 s default time-out, firing on a loaded box before the answer was
# read, sent a second request once in CI; no case here is about that time-out (QUICK is).
NO_PROBES = StreamConfig(tail_probe_interval_s=None, replay_on_connect=False, replay_timeout_s=WAIT_S)


def block_hash(generation: int, seq: int) -> int:
    """The one block a test batch stores: which publisher process (generation) and seq."""
    return generation * 1_000_000 + seq


class Collected:
    """The fleet's sink: every (worker, action) in order, and waiting on conditions."""

    def __init__(self) -> None:
        self.actions: list = []
        self._cond = threading.Condition()

    def __call__(self, worker: str, action) -> None:
        with self._cond:
            self.actions.append((worker, action))
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[Collected], bool], timeout: float = WAIT_S) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self), timeout)

    def of(self, kind) -> list:
        with self._cond:
            return [a for _, a in self.actions if isinstance(a, kind)]

    def facts(self) -> list:
        """Every action but Apply, in order."""
        with self._cond:
            return [a for _, a in self.actions if not isinstance(a, Apply)]

    def applied(self, epoch: int | None = None) -> list:
        return [a.batch for a in self.of(Apply) if epoch is None or a.batch.epoch == epoch]

    def seqs(self, epoch: int | None = None) -> list[int]:
        return [b.seq for b in self.applied(epoch)]

    def has_applied(self, seq: int, epoch: int = 0) -> bool:
        return any(b.seq == seq and b.epoch == epoch for b in self.applied())

    def wait_applied(self, seq: int, epoch: int = 0, timeout: float = WAIT_S) -> None:
        assert self.wait_for(lambda c: c.has_applied(seq, epoch), timeout), (
            f"seq {seq} of epoch {epoch} not applied in {timeout} s; facts: {self.facts()}, "
            f"applied: {[(b.epoch, b.seq) for b in self.applied()]}")

    def wait_fact(self, kind, timeout: float = WAIT_S):
        assert self.wait_for(lambda c: bool(c.of(kind)), timeout), (
            f"no {kind.__name__} in {timeout} s; facts: {self.facts()}, "
            f"applied: {[(b.epoch, b.seq) for b in self.applied()]}")
        return self.of(kind)[0]


def _port_free(endpoint: str) -> bool:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ listeners do
        try:
            s.bind((host, int(port)))
        except OSError:
            return False
    return True


def _wait(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class Rig:
    """publisher (real SGLang) -> LossyProxy -> Subscriber(Fleet([w0], sink)).

    ``via_proxy=False`` connects the collector straight to the publisher (its own socket
    sees the disconnect and reconnect). ``replay``: "proxy" (forwarded, can be silenced),
    "silent" (a bound ROUTER that never answers).
    """

    def __init__(self, *, buffer_steps: int = 1_000, config: StreamConfig = NO_PROBES,
                 replay: str = "proxy", via_proxy: bool = True,
                 recorder: RecordingWriter | None = None) -> None:
        self.pub_ep, self.replay_ep = free_tcp(), free_tcp()
        self.buffer_steps = buffer_steps
        self.generation = 0  # publisher processes started so far, minus one
        self.next_seq = 0  # the current publisher's next sequence number
        self.pub = self._new_publisher()
        self.proxy = LossyProxy(self.pub_ep, replay_upstream=self.replay_ep,
                                answer_replay=replay != "silent").start()
        assert self.proxy.wait_for(lambda p: p.upstream_connects >= 1), "proxy not connected"
        self.via_proxy = via_proxy
        self.spec = WorkerSpec(
            id="w0",
            endpoint=self.proxy.endpoint if via_proxy else self.pub_ep,
            replay_endpoint=self.proxy.replay_endpoint if via_proxy else self.replay_ep,
        )
        self.sink = Collected()
        self.config = config
        self.fleet = Fleet([self.spec], self.sink, config=config)
        self.sub = Subscriber(self.fleet, recorder=recorder)
        self.started = False

    def _new_publisher(self):
        return publisher(endpoint=self.pub_ep, replay_endpoint=self.replay_ep,
                         buffer_steps=self.buffer_steps)

    @property
    def stream(self):
        return self.fleet.streams["w0"]

    def start_collector(self) -> None:
        """Start the collector and wait until its subscription reached the proxy."""
        self.sub.start()
        self.started = True
        if self.via_proxy:
            assert self.proxy.wait_ready(), "the collector never subscribed through the proxy"

    def publish(self, n: int = 1, *, cleared: bool = False) -> list[int]:
        """Publish ``n`` real batches (each stores one block); returns their seqs."""
        seqs = []
        for _ in range(n):
            seq = self.next_seq
            stored = [([block_hash(self.generation, seq)], None)]
            self.pub.publish(batch(1000.0 + seq, stored=stored, cleared=cleared))
            seqs.append(seq)
            self.next_seq += 1
        return seqs

    def publish_until(self, condition: Callable[[], bool], what: str, tries: int = 20) -> None:
        """Publish one batch at a time until ``condition()`` holds. A subscriber that has
        just (re)connected loses what is sent before its subscription reaches the PUB, and
        nothing says when that happened: the first batch seen is the signal."""
        for _ in range(tries):
            self.publish(1)
            deadline = time.monotonic() + 0.25
            while time.monotonic() < deadline:
                if condition():
                    return
                time.sleep(0.005)
        raise AssertionError(f"{what}: not seen after {tries} batches")

    def restart_publisher(self) -> None:
        """Shut the publisher down and start a new process on the same endpoints and rank."""
        close(self.pub)
        _wait(lambda: _port_free(self.pub_ep) and _port_free(self.replay_ep),
              "the old publisher's ports to be released")
        self.generation += 1
        self.next_seq = 0
        self.pub = self._new_publisher()

    def close(self) -> None:
        """Stop everything (idempotent: tests close before asserting, the fixture after)."""
        if self.pub is None:
            return
        self.sub.shutdown()
        self.proxy.stop()
        close(self.pub)
        self.pub = None


@pytest.fixture
def rig():
    rigs: list[Rig] = []

    def make(**kwargs) -> Rig:
        rigs.append(Rig(**kwargs))
        return rigs[-1]

    yield make
    for r in rigs:
        r.close()


def hashes(batches) -> list[list[int]]:
    return [b.events[0].block_hashes for b in batches]


# --- 1. a dropped batch that replay recovers -----------------------------------------------------


def test_a_dropped_batch_is_recovered_by_replay_applied_once_in_order(rig):
    r = rig()
    r.start_collector()
    r.publish(5)
    r.sink.wait_applied(4)
    r.proxy.drop(5)
    r.publish(2)  # 5 is dropped on the wire, 6 reveals the hole
    r.sink.wait_applied(6)
    r.publish(3)
    r.sink.wait_applied(9)
    r.close()

    applied = r.sink.applied()
    assert [b.seq for b in applied] == list(range(10))
    assert hashes(applied) == [[block_hash(0, s)] for s in range(10)]
    assert [b.seq for b in applied if b.replayed] == [5]
    assert {(b.epoch, b.run_start, b.run_start_seq, b.gap_from_seq) for b in applied} == {
        (0, RunStart.EPOCH_START, 0, None)}
    assert r.sink.facts() == []  # no hole, no quarantine, no new epoch
    assert r.proxy.dropped == [5]
    assert r.proxy.replay_requests == [5]
    h = r.stream.health
    assert (h.batches_applied, h.batches_replayed, h.gaps_detected) == (10, 1, 1)
    assert (h.replays_requested, h.replays_recovered, h.replays_failed) == (1, 1, 0)
    assert h.duplicates == 1  # the replay re-sent 6, which had arrived live
    assert h.unrecoverable_gaps == {} and h.lost_batches == {}
    assert h.last_contiguous_seq == 9 and h.oldest_replayable_seq == 5
    assert not r.stream.quarantined


def test_a_live_batch_overtaken_on_the_wire_is_taken_for_a_restart_and_rebuilt_from_zero(rig):
    # One ZeroMQ connection never reorders, so a live seq going backwards can only be a new
    # process (rule 2): the stream starts a new epoch and rebuilds it from replay seq 0
    # rather than guess that 2 is a late copy. Nothing is applied twice within an epoch.
    r = rig()
    r.start_collector()
    r.proxy.reorder(2, after=3)  # 3 overtakes 2 on the wire
    r.publish(5)
    r.sink.wait_applied(4, epoch=1)
    r.close()

    assert r.proxy.forwarded == [0, 1, 3, 2, 4]
    assert r.sink.facts() == [NewEpoch(1, EpochCause.SEQ_RESET, None, True)]
    old, new = r.sink.seqs(epoch=0), r.sink.applied(epoch=1)
    assert old == list(range(len(old))) and len(old) <= 3
    assert [b.seq for b in new] == [0, 1, 2, 3, 4]
    assert {(b.run_start, b.run_start_seq) for b in new} == {(RunStart.EPOCH_START, 0)}
    assert not r.stream.quarantined and r.stream.health.lost_batches == {}


# --- 2. a hole older than the ring ---------------------------------------------------------------


def test_a_hole_older_than_the_ring_is_confirmed_missing_and_quarantines(rig):
    r = rig(buffer_steps=3)
    r.start_collector()
    r.publish(3)
    r.sink.wait_applied(2)
    r.proxy.drop(3, 4, 5, 6, 7)  # by the time 8 asks for 3, the ring holds only 6, 7, 8
    r.publish(6)
    r.sink.wait_applied(8)
    r.publish(1)
    r.sink.wait_applied(9)
    r.close()

    assert r.sink.facts() == [
        Hole(0, 3, 5, HoleReason.MISSING, "replay ring no longer holds it"),
        Quarantine(0, 3, HoleReason.MISSING),
    ]
    applied = r.sink.applied()
    assert [b.seq for b in applied] == [0, 1, 2, 6, 7, 8, 9]
    assert [b.run_start for b in applied[:3]] == [RunStart.EPOCH_START] * 3
    for b in applied[3:]:
        assert (b.run_start, b.run_start_seq, b.gap_from_seq, b.gap_to_seq) == (
            RunStart.AFTER_GAP, 6, 3, 5)
    assert [b.seq for b in applied[3:5] if b.replayed] == [6, 7]  # 8 had arrived live
    assert r.proxy.replay_requests == [3]
    assert r.stream.quarantined
    assert r.stream.state.quarantine.from_seq == 3
    h = r.stream.health
    assert h.unrecoverable_gaps == {HoleReason.MISSING: 1}
    assert h.lost_batches == {HoleReason.MISSING: 3}
    assert (h.replays_failed, h.oldest_replayable_seq) == (1, 6)


# --- 3. a consumer outage longer than the ring ---------------------------------------------------


def test_an_outage_longer_than_the_ring_quarantines_until_a_clear_is_applied(rig):
    r = rig(buffer_steps=4)
    r.start_collector()
    r.publish(3)
    r.sink.wait_applied(2)
    r.proxy.pause()
    r.publish(8)  # 3..10: twice the ring, all discarded while "down"
    assert r.proxy.wait_for(lambda p: len(p.discarded) == 8)
    r.proxy.resume()
    r.publish(1)  # 11: ring is 8..11
    quarantine = r.sink.wait_fact(Quarantine)
    r.sink.wait_applied(11)
    assert r.stream.quarantined

    r.publish(1, cleared=True)  # 12: an observed clear is a known-empty point
    release = r.sink.wait_fact(Release)
    r.close()

    assert quarantine == Quarantine(0, 3, HoleReason.MISSING)
    assert release == Release(0, 12, KnownEmpty.CLEARED)
    assert r.sink.of(Hole) == [Hole(0, 3, 7, HoleReason.MISSING, "replay ring no longer holds it")]
    applied = r.sink.applied()
    assert [b.seq for b in applied] == [0, 1, 2, 8, 9, 10, 11, 12]
    assert {(b.run_start, b.gap_from_seq, b.gap_to_seq) for b in applied[3:]} == {
        (RunStart.AFTER_GAP, 3, 7)}
    assert any(isinstance(e, AllBlocksCleared) for e in applied[-1].events)
    assert r.proxy.discarded == list(range(3, 11))
    assert not r.stream.quarantined
    h = r.stream.health
    assert h.lost_batches == {HoleReason.MISSING: 5} and h.quarantine_s > 0


# --- 4. a publisher restart on the same port and rank --------------------------------------------


def test_a_publisher_restart_is_a_new_epoch_replayed_from_zero(rig):
    r = rig()
    r.start_collector()
    r.publish(5)
    r.sink.wait_applied(4)
    r.proxy.drop(0)  # the new process's first batch is lost on the way
    r.restart_publisher()
    assert r.proxy.wait_for(lambda p: p.upstream_connects >= 2), "proxy never reconnected"
    before = len(r.proxy.received)
    r.publish_until(lambda: len(r.proxy.received) > before, "the new process's first batch")
    r.publish(2)  # seq 0, 1, 2 ... again, from another process
    r.sink.wait_applied(r.next_seq - 1, epoch=1)
    r.close()

    assert r.sink.facts() == [NewEpoch(1, EpochCause.SEQ_RESET, None, True)]
    old, new = r.sink.applied(epoch=0), r.sink.applied(epoch=1)
    assert [b.seq for b in old] == [0, 1, 2, 3, 4]
    assert [b.seq for b in new] == list(range(r.next_seq))
    assert hashes(new) == [[block_hash(1, s)] for s in range(r.next_seq)]  # none of the old
    assert new[0].replayed and not new[-1].replayed
    assert {(b.run_start, b.run_start_seq, b.gap_from_seq) for b in new} == {
        (RunStart.EPOCH_START, 0, None)}
    assert 0 in r.proxy.replay_requests  # the new epoch was asked for from its start
    h = r.stream.health
    assert h.epoch_changes == 1 and h.lost_batches == {}
    assert not r.stream.quarantined and r.stream.state.epoch == 1


def test_a_restart_seen_by_the_collectors_own_connection_is_checked_then_a_new_epoch(rig):
    r = rig(via_proxy=False)
    r.start_collector()
    # No proxy in between to say when the collector subscribed: its first batch says so.
    r.publish_until(lambda: bool(r.sink.applied()), "the collector's first batch")
    last = r.next_seq - 1
    r.sink.wait_applied(last)
    r.restart_publisher()
    # The collector reconnects by itself; before trusting the stream it re-reads its last
    # batch from the new replay ring, which does not hold it: the epoch becomes uncertain.
    uncertain = r.sink.wait_fact(EpochUncertain)
    r.publish_until(lambda: bool(r.sink.of(NewEpoch)), "the new process's first batch")
    r.publish(2)
    r.sink.wait_applied(r.next_seq - 1, epoch=1)
    r.close()

    assert uncertain == EpochUncertain(0, Unverified.NOT_IN_RING)
    assert r.sink.facts() == [uncertain, NewEpoch(1, EpochCause.SEQ_RESET, None, True)]
    assert r.sink.seqs(epoch=0) == list(range(last + 1))
    new = r.sink.applied(epoch=1)
    assert [b.seq for b in new] == list(range(r.next_seq))
    assert hashes(new) == [[block_hash(1, s)] for s in range(r.next_seq)]
    assert {(b.run_start, b.epoch_certain) for b in new} == {(RunStart.EPOCH_START, True)}
    h = r.stream.health
    assert (h.epoch_changes, h.identity_unverified) == (1, 1) and h.lost_batches == {}
    assert not r.stream.quarantined


# --- 5. a mid-stream join ------------------------------------------------------------------------


def test_a_mid_stream_join_is_replayed_from_zero_and_starts_at_epoch_start(rig):
    r = rig()
    r.publish(6)  # 0..5 before the collector exists
    assert r.proxy.wait_for(lambda p: 5 in p.received)  # published (and gone nowhere)
    r.start_collector()
    r.publish(1)  # 6
    r.sink.wait_applied(6)
    r.publish(1)
    r.sink.wait_applied(7)
    r.close()

    applied = r.sink.applied()
    assert [b.seq for b in applied] == list(range(8))
    assert hashes(applied) == [[block_hash(0, s)] for s in range(8)]
    assert all(b.replayed for b in applied[:6]) and not applied[7].replayed
    assert {(b.run_start, b.run_start_seq) for b in applied} == {(RunStart.EPOCH_START, 0)}
    assert r.proxy.replay_requests == [0]
    assert r.sink.facts() == []
    assert r.stream.health.joins == 0 and not r.stream.quarantined


def test_a_mid_stream_join_past_the_ring_is_a_joined_run_not_a_quarantine(rig):
    r = rig(buffer_steps=3)
    r.publish(10)  # 0..9 before the collector exists; the ring keeps 7..9
    assert r.proxy.wait_for(lambda p: 9 in p.received)
    r.start_collector()
    r.publish(1)  # 10: the collector asks for 0, gets 8..10
    r.sink.wait_applied(10)
    r.publish(1)
    r.sink.wait_applied(11)
    r.close()

    applied = r.sink.applied()
    assert [b.seq for b in applied] == [8, 9, 10, 11]
    assert {(b.run_start, b.run_start_seq, b.gap_from_seq) for b in applied} == {
        (RunStart.JOINED, 8, None)}
    assert r.sink.facts() == []  # history before 8 is unknown, but nothing stale was applied
    h = r.stream.health
    assert h.joins == 1 and h.unrecoverable_gaps == {} and not r.stream.quarantined
    assert r.proxy.replay_requests == [0]


# --- 6. a replay endpoint that never answers -----------------------------------------------------

QUICK = StreamConfig(replay_timeout_s=0.15, replay_retries=2, replay_backoff=1.0,
                     replay_cooldown_s=30.0, tail_probe_interval_s=None, replay_on_connect=False)


def test_a_replay_that_never_answers_is_retried_then_written_off_as_uncertain(rig):
    r = rig(replay="silent", config=QUICK)
    r.start_collector()
    r.publish(3)
    r.sink.wait_applied(2)
    r.proxy.drop(3)
    started = time.monotonic()
    r.publish(2)  # 3 is dropped; 4 reveals the hole, asked for, never answered
    hole = r.sink.wait_fact(Hole)
    waited = time.monotonic() - started
    r.sink.wait_applied(4)
    # Within the cooldown a new hole is written off at once, without asking again.
    r.proxy.drop(6)
    r.publish(3)
    r.sink.wait_applied(7)
    r.close()

    assert hole == Hole(0, 3, 3, HoleReason.UNCERTAIN, "no replay answer in 3 tries")
    assert waited >= 3 * QUICK.replay_timeout_s
    assert r.proxy.replay_requests == [3, 3, 3]  # first ask + 2 retries, then no more
    assert r.sink.facts() == [
        hole,
        Quarantine(0, 3, HoleReason.UNCERTAIN),
        Hole(0, 6, 6, HoleReason.UNCERTAIN, "replay endpoint cooling down"),
    ]
    applied = r.sink.applied()
    assert [b.seq for b in applied] == [0, 1, 2, 4, 5, 7]
    assert (applied[3].run_start, applied[3].gap_from_seq, applied[3].gap_to_seq) == (
        RunStart.AFTER_GAP, 3, 3)
    assert (applied[5].run_start, applied[5].gap_from_seq, applied[5].gap_to_seq) == (
        RunStart.AFTER_GAP, 6, 6)
    h = r.stream.health
    assert (h.replays_requested, h.replay_timeouts, h.replays_failed) == (3, 3, 1)
    assert h.unrecoverable_gaps == {HoleReason.UNCERTAIN: 2}
    assert HoleReason.MISSING not in h.lost_batches
    assert r.stream.quarantined and r.stream.state.quarantine.reason is HoleReason.UNCERTAIN


# --- 7. a malformed frame in the middle of valid traffic -----------------------------------------


def test_a_malformed_batch_is_counted_and_the_rest_flows(rig):
    r = rig()
    r.start_collector()
    r.publish(3)
    r.sink.wait_applied(2)
    r.proxy.replace_payload(3, b"\xc1 not msgpack")  # a 3-frame message, valid seq, garbage body
    r.proxy.inject([b"kv@pod-a@demo", b"\x00\x01", b"x"])  # a seq frame of 2 bytes: unreadable
    r.publish(3)
    r.sink.wait_applied(5)
    r.close()

    assert r.sink.seqs() == [0, 1, 2, 4, 5]
    hole, quarantine = r.sink.facts()
    assert (hole.from_seq, hole.to_seq, hole.reason) == (3, 3, HoleReason.MALFORMED)
    assert quarantine == Quarantine(0, 3, HoleReason.MALFORMED)
    after = r.sink.applied()[3:]
    assert {(b.run_start, b.gap_from_seq, b.gap_to_seq) for b in after} == {
        (RunStart.AFTER_GAP, 3, 3)}
    h = r.stream.health
    assert h.unrecoverable_gaps == {HoleReason.MALFORMED: 1}
    assert h.dropped == {DropReason.FRAME_ERROR: 1}
    assert h.replays_requested == 0  # replay would send the same bytes: not asked
    assert r.proxy.replay_requests == []


# --- 8. a recording of a faulty run plays back to the same result --------------------------------


def test_a_recording_of_a_faulty_run_plays_back_to_the_same_applied_batches(rig, tmp_path):
    path = tmp_path / "faulty.kvrec"
    recorder = RecordingWriter(path)
    r = rig(config=QUICK, recorder=recorder)
    r.start_collector()
    r.publish(3)
    r.sink.wait_applied(2)
    r.proxy.drop(3)  # recovered by replay
    r.publish(2)
    r.sink.wait_applied(4)
    r.proxy.replace_payload(5, b"\xc1")  # malformed
    r.publish(2)
    r.sink.wait_applied(6)
    r.proxy.set_answer_replay(False)
    r.proxy.drop(7)  # replay never answers: retries, then an uncertain hole
    r.publish(2)
    r.sink.wait_applied(8)
    r.proxy.pause()  # an outage (the ring is large: recovered)
    r.publish(2)
    assert r.proxy.wait_for(lambda p: len(p.discarded) == 2)
    r.proxy.resume()
    r.proxy.set_answer_replay(True)
    r.publish(1)  # 11; 9, 10 are asked for while cooling down: written off at once
    r.sink.wait_applied(11)
    r.close()
    recorder.close()

    live = [(b.worker, b.epoch, b.seq) for b in r.sink.applied()]
    assert [s for _, _, s in live] == [0, 1, 2, 3, 4, 6, 8, 11]

    # The time-outs of the unanswered replay happened between messages: the recording
    # holds them as tick records, and playback runs them at the same points.
    assert any(m.socket == TICK for m in read_recording(path))
    played = Collected()
    count = play_recording(str(path), Fleet([r.spec], played, config=QUICK))
    assert count == recorder.records
    assert [(b.worker, b.epoch, b.seq) for b in played.applied()] == live
    assert [b.replayed for b in played.applied()] == [b.replayed for b in r.sink.applied()]
    assert played.facts() == r.sink.facts()


# --- 9. tail probes: an idle worker proven idle, a lost last batch found -------------------------

PROBING = StreamConfig(tail_probe_interval_s=0.2, replay_on_connect=False)


def tails(sink: Collected) -> list[TailConfirmed]:
    return sink.of(TailConfirmed)


def test_an_idle_worker_gets_its_tail_confirmed_and_the_index_then_reaches_past_its_last_batch(rig):
    from kvmiss.enricher.core.index import ResidencyIndex

    r = rig(config=PROBING)
    r.start_collector()
    r.publish(3)
    r.sink.wait_applied(2)
    last = r.sink.applied()[-1]
    # The worker is idle now: nothing more is published, and silence alone proves nothing.
    assert r.sink.wait_for(lambda c: len(tails(c)) >= 2), f"no tail confirmation: {r.sink.facts()}"
    r.close()

    first, second = tails(r.sink)[:2]
    assert (first.epoch, first.seq) == (second.epoch, second.seq) == (0, 2)
    assert last.recv_ts + PROBING.tail_probe_interval_s <= first.at < second.at
    assert set(r.proxy.replay_requests) == {2}  # each probe re-reads the last applied batch
    assert [type(f) for f in r.sink.facts()] == [TailConfirmed] * len(tails(r.sink))
    h = r.stream.health
    assert h.tail_confirmations == len(tails(r.sink)) and h.tail_probes >= h.tail_confirmations
    assert (h.replays_requested, h.tail_recoveries, h.duplicates, h.batches_applied) == (0, 0, 0, 3)
    assert not r.stream.quarantined

    # What the service does with them: the index's history now reaches past the last batch,
    # through the latest probe's send time (these test batches carry made-up engine times).
    index = ResidencyIndex(["w0"], tail_margin_s=0.25)
    for action in [a for _, a in r.sink.actions]:
        if isinstance(action, Apply):
            index.apply(action.batch)
        else:
            index.confirm_tail("w0", action.epoch, action.seq, action.at)
    view = index.current["w0"]
    latest = tails(r.sink)[-1].at
    assert view.reached_through(0.25) == latest - 0.25
    assert view.reaches(latest - 0.25, 0.25) and not index.reaches(view, latest)
    assert view.lookup_step(latest - 0.25, 0.25) == 3  # the virtual step after batch 2


def test_a_dropped_last_batch_is_found_by_a_tail_probe_and_applied_in_order(rig):
    r = rig(config=PROBING)
    r.start_collector()
    r.publish(3)
    r.sink.wait_applied(2)
    r.proxy.drop(3)
    r.publish(1)  # 3 is lost on the wire and nothing follows it to reveal the hole
    r.sink.wait_applied(3)
    assert r.sink.wait_for(lambda c: any(t.seq == 3 for t in tails(c))), r.sink.facts()
    r.close()

    applied = r.sink.applied()
    assert [b.seq for b in applied] == [0, 1, 2, 3]
    assert [b.seq for b in applied if b.replayed] == [3]
    assert hashes(applied) == [[block_hash(0, s)] for s in range(4)]
    assert {(b.run_start, b.run_start_seq, b.gap_from_seq) for b in applied} == {
        (RunStart.EPOCH_START, 0, None)}  # continuous: nothing written off
    assert r.proxy.dropped == [3] and r.proxy.replay_requests[0] == 2
    assert not r.sink.of(Hole) and not r.stream.quarantined
    h = r.stream.health
    assert (h.tail_recoveries, h.batches_replayed, h.replays_requested, h.gaps_detected) == (1, 1, 0, 0)
    assert {t.seq for t in tails(r.sink)} <= {2, 3}  # 2 only if a probe beat the publish


def test_tail_probes_do_not_disturb_ordinary_recovery_and_a_recording_plays_back_the_same(rig, tmp_path):
    path = tmp_path / "probing.kvrec"
    recorder = RecordingWriter(path)
    config = StreamConfig(tail_probe_interval_s=0.05, replay_on_connect=False)  # probing all the time
    r = rig(config=config, recorder=recorder)
    r.start_collector()
    for _ in range(4):
        r.publish(2)
        r.sink.wait_applied(r.next_seq - 1)
        stop = len(tails(r.sink)) + 1
        assert r.sink.wait_for(lambda c: len(tails(c)) >= stop), r.sink.facts()  # idle: proven
        r.proxy.drop(r.next_seq)
        r.publish(2)  # a hole, revealed by the next batch (or found by a probe first)
        r.sink.wait_applied(r.next_seq - 1)
    r.close()
    recorder.close()

    applied = r.sink.applied()
    assert [b.seq for b in applied] == list(range(16))
    assert {(b.run_start, b.gap_from_seq) for b in applied} == {(RunStart.EPOCH_START, None)}
    replayed = {b.seq for b in applied if b.replayed}
    assert {2, 6, 10, 14} <= replayed <= {2, 3, 6, 7, 10, 11, 14, 15}  # each drop, recovered
    assert all(isinstance(f, TailConfirmed) for f in r.sink.facts())
    h = r.stream.health
    assert h.gaps_detected + h.tail_recoveries >= 3 and h.lost_batches == {}
    assert not r.stream.quarantined

    played = Collected()
    play_recording(str(path), Fleet([r.spec], played, config=config))
    assert [(b.seq, b.replayed) for b in played.applied()] == [(b.seq, b.replayed) for b in applied]
    assert played.facts() == r.sink.facts()
