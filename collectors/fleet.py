"""A fleet of worker streams: routes received messages to each worker's state machine and
hands the resulting actions to a sink. No sockets here: `collectors.subscriber` feeds it
from ZeroMQ, `play_recording` feeds it from a recording file, deterministically.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Iterable

import msgspec

from kvmiss.collectors.continuity import MAX_TAIL_PROBES, RequestReplay, StreamAction, StreamConfig, StreamState
from kvmiss.collectors.engines import adapter_for
from kvmiss.collectors.recording import ReadStats, RecordedMessage, read_recording
from kvmiss.collectors.stream import WorkerStream
from kvmiss.schemas.config import WorkerSpec

log = logging.getLogger("kvmiss.collectors")

SUB, DEALER, MONITOR = "sub", "dealer", "monitor"
TICK = "tick"  # a timer that came due: recorded so playback runs it at the same point
UNREAD = b"unread"  # a tick record's frame: the worker's SUB had messages not yet read
CONNECTED = b"connected"  # the first connection of a SUB socket
RECONNECTED = b"reconnected"  # a later one: the publisher may be a new process


Sink = Callable[[str, StreamAction], None]


class Fleet:
    """Every member worker's `WorkerStream`, and where their actions go.

    ``sink(worker_id, action)`` receives every action except `RequestReplay`, which is
    returned to the caller (only the I/O layer can carry it out). Not thread-safe: one
    owner calls everything, `add` and `remove` included. ``specs`` and ``streams`` are
    replaced, never changed in place, by `add` / `remove`: another thread may read (iterate)
    the mapping it took, as the metrics and /readyz do.
    """

    def __init__(self, specs: Iterable[WorkerSpec], sink: Sink, *,
                 config: StreamConfig = StreamConfig(), max_tail_probes: int = MAX_TAIL_PROBES):
        self.specs: dict[str, WorkerSpec] = {spec.id: spec for spec in specs}
        self.sink = sink
        self.config = config
        self.max_tail_probes = max_tail_probes
        # The epoch a stream added from now on starts at: above every epoch a removed stream
        # reached, so a worker that leaves and comes back under its id is a new epoch to the
        # index, never a continuation of its old view. One number, whatever the churn.
        self._epoch_floor = 0
        self.streams: dict[str, WorkerStream] = {spec.id: self._stream(spec) for spec in self.specs.values()}

    def _stream(self, spec: WorkerSpec) -> WorkerStream:
        """The worker's stream, reading its engine's wire (``spec.engine``'s adapter)."""
        adapter = adapter_for(spec.engine)
        config = self.config
        if config.first_seq != adapter.first_seq:
            config = msgspec.structs.replace(config, first_seq=adapter.first_seq)
        return WorkerStream(spec.id, replay=spec.replay_endpoint is not None,
                            topic_template=spec.topic_template, config=config,
                            state=StreamState(epoch=self._epoch_floor), adapter=adapter)

    def add(self, spec: WorkerSpec) -> WorkerStream:
        """A worker that joined: a new stream, from a new epoch (nothing carried over)."""
        if spec.id in self.streams:
            raise ValueError(f"worker {spec.id!r} is already a member")
        stream = self._stream(spec)
        self.specs = {**self.specs, spec.id: spec}
        self.streams = {**self.streams, spec.id: stream}
        return stream

    def remove(self, worker: str) -> WorkerStream | None:
        """A worker that departed: its stream is dropped with whatever it held back or was
        waiting for (a replay, a tail probe); nothing more of it reaches the sink. The I/O
        layer closes its sockets. None if it was not a member."""
        stream = self.streams.get(worker)
        if stream is None:
            return None
        self._epoch_floor = max(self._epoch_floor, stream.state.epoch + 1)
        self.specs = {k: v for k, v in self.specs.items() if k != worker}
        self.streams = {k: v for k, v in self.streams.items() if k != worker}
        return stream

    def on_message(self, worker: str, socket: str, frames: list[bytes], now: float,
                   request_id: int | None = None) -> list[RequestReplay]:
        stream = self.streams[worker]
        if socket == SUB:
            actions = stream.on_live(stream.adapter.frames.live(frames), now)
        elif socket == DEALER:
            actions = stream.on_replay(stream.adapter.frames.replay(frames), request_id or 0, now)
        elif socket == MONITOR and frames == [RECONNECTED]:
            actions = stream.on_reconnect(now)
        elif socket == MONITOR and frames == [CONNECTED]:
            actions = stream.on_connect(now)
        elif socket == TICK:
            actions = stream.on_tick(now, frames != [UNREAD] and self._probes_in_flight() < self.max_tail_probes)
        else:
            return []
        return self._dispatch(worker, actions)

    def on_tick(self, now: float, unread: Container[str] = ()) -> list[tuple[str, RequestReplay]]:
        """Run every due timer (replay time-outs and retries, tail probes). Every stream is
        told the time, due or not, so time-based health (seconds quarantined) keeps up with
        a worker that has gone quiet; a stream with nothing due does nothing else.

        A tail probe asks whether anything follows the last batch *received*; it waits (tries
        again `TAIL_PROBE_DEFER_S` later) while the worker is in ``unread`` -- its socket holds
        messages not yet read: silence that is ours, not the engine's (a ring that moved on
        meanwhile would be written off as a hole) -- and while ``max_tail_probes`` probes are
        in flight fleet-wide."""
        out = []
        in_flight = self._probes_in_flight()
        for worker, stream in self.streams.items():
            was_probing = stream.probing
            may_probe = in_flight < self.max_tail_probes and worker not in unread
            out += [(worker, r) for r in self._dispatch(worker, stream.on_tick(now, may_probe))]
            in_flight += stream.probing - was_probing
        return out

    def _probes_in_flight(self) -> int:
        return sum(stream.probing for stream in self.streams.values())

    def next_deadline(self) -> float | None:
        deadlines = [d for s in self.streams.values() if (d := s.next_deadline) is not None]
        return min(deadlines, default=None)

    def _dispatch(self, worker: str, actions: list[StreamAction]) -> list[RequestReplay]:
        replays = []
        for action in actions:
            if isinstance(action, RequestReplay):
                replays.append(action)
            else:
                self.sink(worker, action)
        return replays


def play_recording(path: str, fleet: Fleet, stats: ReadStats | None = None,
                   on_message: Callable[[RecordedMessage], None] | None = None) -> int:
    """Feed a recording through ``fleet`` in file order; returns messages played.

    Replies are given to the replay request the stream is waiting on (the recording holds
    what came back; nothing is sent). Timers: a recording made by `Subscriber` holds a
    ``tick`` record wherever a timer came due, between the same two messages as live, and
    only those run, so playback takes every time-out decision the live run took. A recording
    without tick records (hand-made, or older) runs each due timer before the first message
    received after it, with tail probes turned off in ``fleet``'s streams (no probe was sent
    live at those points). Either way the same file always yields the same applied batches.
    ``on_message`` sees each message just before it is played (so a sink can date what follows).
    """
    recorded_ticks = any(m.socket == TICK for m in read_recording(path))
    if not recorded_ticks:
        # Without tick records, timers run before each message; a tail probe run that way
        # never happened live, and a stale reply in the file would be handed to it.
        for stream in fleet.streams.values():
            stream.config = msgspec.structs.replace(stream.config, tail_probe_interval_s=None)
    played = 0
    for message in read_recording(path, stats):
        if on_message is not None:
            on_message(message)
        _play_one(fleet, message, recorded_ticks)
        played += 1
    return played


def _play_one(fleet: Fleet, message: RecordedMessage, recorded_ticks: bool) -> None:
    stream = fleet.streams.get(message.worker)
    if stream is None:
        return
    if not recorded_ticks:
        fleet.on_tick(message.recv_ts)
    request_id = None
    if message.socket == DEALER:
        recovery = stream.state.recovery
        request_id = recovery.request_id if recovery is not None else -1
    fleet.on_message(message.worker, message.socket, message.frames, message.recv_ts, request_id)
