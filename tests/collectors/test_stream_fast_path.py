"""`WorkerStream.on_live`'s common case (the next batch of a healthy stream, in a few steps)
against the general path it short-cuts: any script of live batches, replay answers, ticks and
reconnects gives the same actions, state and health with the fast path on and off."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings, strategies as st

from kvmiss.collectors.continuity import Apply, RequestReplay, StreamConfig
from kvmiss.collectors.frames import BatchMessage, Channel, FrameError, ReplayEnd
from kvmiss.collectors.stream import WorkerStream
from kvmiss.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

TEMPLATE = "kv@{instance}@llama"


def payload(seq: int, kind: str) -> bytes:
    if kind == "clear":
        events = [AllBlocksCleared()]
    elif kind == "bad":
        return b"\xc1not msgpack"
    else:
        events = [BlockStored(block_hashes=[seq, seq + 1], block_size=16, medium="GPU", group_idx=0),
                  BlockRemoved(block_hashes=[seq], medium="GPU", group_idx=0)]
    return msgspec.msgpack.encode(EventBatch(1000.0 + seq / 100, events, 0))


step = st.one_of(
    st.tuples(st.just("live"), st.integers(0, 12), st.sampled_from(["ok", "ok", "ok", "clear", "bad"]),
              st.sampled_from(["kv@a@llama", "kv@a@llama", "kv@b@llama"])),
    st.tuples(st.just("next"), st.just(0), st.just("ok"), st.just("")),  # the common case
    st.tuples(st.just("frame_error"), st.integers(0, 12), st.just(""), st.just("")),
    st.tuples(st.just("answer"), st.integers(0, 3), st.just(""), st.just("")),
    st.tuples(st.just("tick"), st.integers(0, 5), st.just(""), st.just("")),
    st.tuples(st.just("reconnect"), st.just(0), st.just(""), st.just("")),
)


def run(script, fast: bool, template: str | None):
    config = StreamConfig(tail_probe_interval_s=0.5, replay_timeout_s=0.2)
    stream = WorkerStream("w", replay=True, topic_template=template, config=config)
    stream.fast_path = fast
    published: dict[int, tuple[str, bytes]] = {}
    out, now, last_seq, last_topic, requests = [], 0.0, -1, "kv@a@llama", []

    def take(actions):
        for a in actions:
            if isinstance(a, Apply):
                b = a.batch
                out.append(("apply", b.epoch, b.seq, b.ts, b.recv_ts, list(b.events), b.run_start_seq,
                            b.run_start, b.gap_from_seq, b.gap_to_seq, b.instance, b.epoch_certain, b.replayed))
            else:
                out.append(a)
                if isinstance(a, RequestReplay):
                    requests.append(a)

    for kind, n, what, topic in script:
        now += 0.1
        if kind in ("live", "next"):
            seq = last_seq + 1 if kind == "next" else n
            topic = last_topic if kind == "next" else topic
            data = payload(seq, what)
            published[seq] = (topic, data)
            last_seq, last_topic = seq, topic
            take(stream.on_live(BatchMessage(Channel.LIVE, topic, seq, data), now))
        elif kind == "frame_error":
            take(stream.on_live(FrameError("bad frame", n), now))
        elif kind == "answer" and requests:
            request = requests.pop(0)
            for seq in sorted(s for s in published if s >= request.start_seq)[: n + 1]:
                t, data = published[seq]
                take(stream.on_replay(BatchMessage(Channel.REPLAY, t, seq, data), request.request_id, now))
            take(stream.on_replay(ReplayEnd(), request.request_id, now))
        elif kind == "tick":
            now += n * 0.2
            take(stream.on_tick(now))
        elif kind == "reconnect":
            take(stream.on_reconnect(now))
    return out, msgspec.structs.asdict(stream.state), stream.health


@settings(max_examples=400, deadline=None)
@given(script=st.lists(step, max_size=60), template=st.sampled_from([None, TEMPLATE]))
def test_the_fast_path_gives_exactly_what_the_general_path_gives(script, template):
    fast = run(script, True, template)
    general = run(script, False, template)
    assert fast == general


def test_a_healthy_stream_takes_the_fast_path():
    """Not a vacuous property: in steady state the short cut is actually taken."""
    stream = WorkerStream("w", replay=True)
    taken = []
    general = stream._offer

    def offer(item):
        taken.append(item.seq)
        general(item)

    stream._offer = offer
    for seq in range(5):
        stream.on_live(BatchMessage(Channel.LIVE, "kv@a@llama", seq, payload(seq, "ok")), seq * 0.01)
    assert taken == [0]  # only the first batch went the general way
    assert stream.state.applied_seq == 4


def test_a_clear_in_the_next_batch_settles_an_uncertain_epoch_on_either_path():
    """A case random scripts rarely reach: an epoch left uncertain by a reconnect nothing could
    verify, then the next batch in order carries a clear (a known-empty point)."""
    results = []
    for fast in (True, False):
        stream = WorkerStream("w", replay=False)
        stream.fast_path = fast
        stream.on_live(BatchMessage(Channel.LIVE, "kv@a@llama", 0, payload(0, "ok")), 0.1)
        facts = stream.on_reconnect(0.2)  # no replay endpoint: the publisher cannot be checked
        assert not stream.state.epoch_certain
        facts += stream.on_live(BatchMessage(Channel.LIVE, "kv@a@llama", 1, payload(1, "clear")), 0.3)
        applied = [a.batch for a in facts if isinstance(a, Apply)]
        assert stream.state.epoch_certain and applied[-1].epoch_certain
        results.append(([a for a in facts if not isinstance(a, Apply)], msgspec.structs.asdict(stream.state)))
    assert results[0] == results[1]
