"""Stream health for the report: per-worker lanes (every batch applied, holes, quarantine,
restarts) and health counters, from a KV-event recording (`kvmiss collect --record`, or
`kvmiss demo`'s events.rec) played through the same per-worker state machines as live.

`kvmiss demo` notes the same facts as they happen (enricher/demo/timeline.py) with the
`describe`, `KINDS` and `stream_health` here, so both make one context shape:
``{"timeline": {worker: {"applied": [[ts, recv_ts, replayed]...], "facts": [[t, kind, text]...]}},
"streams": {worker: {counter: value}}}``.
"""

from __future__ import annotations

from typing import Any

from kvmiss.collectors.continuity import Apply, EpochUncertain, Hole, NewEpoch, Quarantine, Release
from kvmiss.collectors.fleet import Fleet, play_recording
from kvmiss.collectors.recording import ReadStats
from kvmiss.collectors.stream import WorkerStream
from kvmiss.enricher.service.offline import workers_in_recording

KINDS = {Hole: "hole", Quarantine: "quarantine", Release: "release", NewEpoch: "new_epoch",
         EpochUncertain: "epoch_uncertain"}


def describe(action) -> str:
    if isinstance(action, Hole):
        detail = f": {action.detail}" if action.detail else ""
        return f"hole seq {action.from_seq}..{action.to_seq} ({action.reason.value}{detail})"
    if isinstance(action, Quarantine):
        return f"quarantined from seq {action.from_seq}"
    if isinstance(action, Release):
        return f"released at seq {action.seq} ({action.cause.value})"
    if isinstance(action, NewEpoch):
        return f"new epoch {action.epoch} ({action.cause.value})"
    if isinstance(action, EpochUncertain):
        return f"epoch {action.epoch} uncertain ({action.reason.value})"
    return type(action).__name__


def stream_health(stream: WorkerStream) -> dict[str, Any]:
    h = stream.health
    return {
        "batches_applied": h.batches_applied,
        "batches_replayed": h.batches_replayed,
        "gaps_detected": h.gaps_detected,
        "replays_requested": h.replays_requested,
        "replays_recovered": h.replays_recovered,
        "replays_failed": h.replays_failed,
        "unrecoverable_gaps": sum(h.unrecoverable_gaps.values()),
        "lost_batches": sum(h.lost_batches.values()),
        "epoch_changes": h.epoch_changes,
        "identity_unverified": h.identity_unverified,
        "quarantine_s": round(h.quarantine_s, 3),
        "quarantined": stream.quarantined,
    }


def context_from_recording(path: str, stats: ReadStats | None = None) -> dict[str, Any]:
    """The report context's ``timeline`` and ``streams`` from a recording. A fact is dated by
    when kvmiss received the message that caused it (as the demo dates them live); a batch by
    its engine time and its receipt."""
    timeline: dict[str, dict[str, list]] = {}
    received = [0.0]

    def sink(worker: str, action) -> None:
        lane = timeline.setdefault(worker, {"applied": [], "facts": []})
        if isinstance(action, Apply):
            b = action.batch
            lane["applied"].append([round(b.ts, 6), round(b.recv_ts, 6), b.replayed])
        elif type(action) in KINDS:
            lane["facts"].append([round(received[0], 6), KINDS[type(action)], describe(action)])

    def at(message) -> None:
        received[0] = message.recv_ts

    fleet = Fleet(workers_in_recording(path), sink)
    play_recording(path, fleet, stats, on_message=at)
    return {"timeline": dict(sorted(timeline.items())),
            "streams": {worker: stream_health(stream) for worker, stream in sorted(fleet.streams.items())}}
