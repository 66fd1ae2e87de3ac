"""`kvmiss collect`: subscribe to the configured workers' KV-event streams, optionally record
everything received, and report stream health.

Runs until SIGINT/SIGTERM or ``--duration`` seconds. Stream facts (new epoch, hole,
quarantine, release, uncertain epoch) go to stderr as one JSON object per line as they
happen; they carry sequence numbers, epochs and reasons, never token ids, hashes or salts.
At the end the recording is flushed and closed, and a per-worker health summary is printed
on stdout as one JSON object. Exit status: 0; 1 when a worker delivered nothing (no batch,
no answer to a tail probe: never connected, or silent); 2 when the configuration or the
recording file cannot be used (the message names the key or the file).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from typing import IO, Any

import msgspec

# Shown under `kvmiss collect --help`: what it reads, in one schema line, and one example.
HELP_INPUT = """\
input:    --config FILE: kvmiss.toml (its [[workers]] and [fleet] say what to subscribe to)
example:  kvmiss collect --config examples/kvmiss.toml --record rec.kvrec --duration 600
"""

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, metavar="FILE",
                        help="kvmiss TOML configuration; its [[workers]] are subscribed to")
    parser.add_argument("--record", metavar="FILE",
                        help="append every received message to this recording (kvmiss format)")
    parser.add_argument("--duration", type=_positive_seconds, metavar="S",
                        help="stop after S seconds (default: run until SIGINT or SIGTERM)")


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("must be greater than 0")
    return value


_encoder = msgspec.json.Encoder()


class FactLog:
    """The fleet's sink: one JSON line per stream fact; applied batches are only counted, tail
    confirmations only in the streams' health (``tail_confirmations``)."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.applied: dict[str, int] = {}
        self._lock = threading.Lock()  # the collector thread and the main thread both log

    def __call__(self, worker: str, action: Any) -> None:
        from kvmiss.collectors.continuity import Apply, TailConfirmed

        if isinstance(action, Apply):
            self.applied[worker] = self.applied.get(worker, 0) + 1
            return
        if isinstance(action, TailConfirmed):
            return  # repeats every probe interval while a worker idles: counted in health
        self.line(_fact_name(action), worker=worker, **msgspec.to_builtins(action))

    def line(self, event: str, **fields: Any) -> None:
        text = _encoder.encode({"event": event, **fields}).decode() + "\n"
        with self._lock:
            self.out.write(text)
            self.out.flush()


def _fact_name(action: Any) -> str:
    # NewEpoch -> new_epoch, EpochUncertain -> epoch_uncertain
    name = type(action).__name__
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


def health_summary(fleet, *, elapsed_s: float, recorder=None) -> dict[str, Any]:
    """Per-worker state and counters, as JSON-ready builtins."""
    workers = {}
    for worker, stream in fleet.streams.items():
        state = stream.state
        quarantine = state.quarantine
        workers[worker] = {
            "epoch": state.epoch,
            "epoch_certain": state.epoch_certain,
            "cursor": stream.cursor.value,
            "applied_seq": state.applied_seq,
            "quarantined": quarantine is not None,
            "quarantine": None if quarantine is None else {
                "epoch": quarantine.epoch, "from_seq": quarantine.from_seq,
                "reason": quarantine.reason.value,
            },
            "health": msgspec.to_builtins(stream.health),
        }
    summary: dict[str, Any] = {"elapsed_s": round(elapsed_s, 3), "workers": workers}
    if recorder is not None:
        summary["recording"] = {"path": str(recorder.path), "records": recorder.records}
    return summary


def run(args: argparse.Namespace, stdout: IO[str] | None = None,
        stderr: IO[str] | None = None) -> int:
    from kvmiss.collectors.fleet import Fleet
    from kvmiss.collectors.recording import RecordingError, RecordingWriter
    from kvmiss.collectors.subscriber import Subscriber
    from kvmiss.schemas.config import ConfigError, load_config

    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"kvmiss collect: {exc}", file=stderr)
        return 2
    if not config.workers:
        print(f"kvmiss collect: {args.config}: workers: no worker to collect from", file=stderr)
        return 2
    recorder = None
    if args.record:
        try:
            recorder = RecordingWriter(args.record)
        except (RecordingError, OSError) as exc:
            print(f"kvmiss collect: --record: {exc}", file=stderr)
            return 2

    facts = FactLog(stderr)
    fleet = Fleet(config.workers, facts)
    subscriber = Subscriber(fleet, recorder=recorder,
                            heartbeat_interval_s=config.collector.heartbeat_interval_s,
                            heartbeat_timeout_s=config.collector.heartbeat_timeout_s)
    stop = threading.Event()
    stopped_by: list[str] = []

    def on_signal(signum, _frame) -> None:
        stopped_by.append(signal.Signals(signum).name)
        stop.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    started = time.monotonic()
    try:
        try:
            subscriber.start()
        except Exception as exc:  # a bad endpoint or a port in use: the config's fault
            print(f"kvmiss collect: {args.config}: workers: cannot open sockets: {exc}",
                  file=stderr)
            return 2
        facts.line("collect_started", workers=[w.id for w in config.workers],
                   recording=None if recorder is None else str(recorder.path))
        # Waiting in short steps keeps the main thread responsive to signals.
        deadline = None if args.duration is None else started + args.duration
        while not stop.is_set():
            left = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
            if left <= 0:
                stopped_by.append("duration")
                break
            stop.wait(left)
    finally:
        clean = subscriber.shutdown()
        if recorder is not None:
            if clean:
                recorder.close()
            else:  # the loop still owns the writer; flushing under it could tear a record
                print("kvmiss collect: collector did not stop; recording not flushed",
                      file=stderr)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    elapsed = time.monotonic() - started
    facts.line("collect_stopped", by=stopped_by[0] if stopped_by else "error",
               elapsed_s=round(elapsed, 3))
    summary = health_summary(fleet, elapsed_s=elapsed, recorder=recorder)
    silent = []
    for worker, entry in summary["workers"].items():
        entry["connection"] = subscriber.connection(worker)
        health = fleet.streams[worker].health
        entry["delivered"] = bool(health.batches_applied or health.tail_confirmations)
        if not entry["delivered"]:
            silent.append(worker)
    stdout.write(_encoder.encode(summary).decode() + "\n")
    stdout.flush()
    for worker in silent:
        entry = summary["workers"][worker]
        why = {"never": "never connected", "unopened": "its socket could not be opened",
               "disconnected": "disconnected"}.get(entry["connection"], "connected, but nothing came")
        print(f"kvmiss collect: worker {worker} ({fleet.specs[worker].sub_endpoint()}): delivered nothing in "
              f"{elapsed:.1f} s: {why}", file=stderr)
    return 1 if silent else 0
