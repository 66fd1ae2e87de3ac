"""One simulated engine's KV-event publisher in its own process, so a test can SIGKILL it.

kvmiss's demo publisher (enricher/demo/publisher.py: vLLM 0.33's wire protocol on a real
ZeroMQ PUB socket and ROUTER replay socket) driven by JSON lines on stdin; each batch
handed to the publisher is reported on stdout as ``{"seq", "ts", "stored"}`` *after* the
hand-over, i.e. what the engine has done, whether or not it reached the wire, as
``{"seq", "ts", "stored", "removed"}``.

    {"op": "publish", "stored": [...], "removed": [...], "cleared": false}
    {"op": "stream", "count": N, "interval_s": 0.001, "first_block": B}   one block per batch
        with "window": W, batch i also removes block B + i - W: W blocks stay resident
    {"op": "exit"}

Usage: python publisher_proc.py --pub-port P --replay-port R [--host H] [--buffer-steps N] [--skew-s S]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import zmq

from kvmiss.enricher.demo.publisher import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Publisher,
)

BLOCK = 16


def batch(ts: float, stored=(), removed=(), cleared=False) -> EventBatch:
    events: list = []
    if cleared:
        events.append(AllBlocksCleared())
    if stored:
        events.append(BlockStored(block_hashes=list(stored), parent_block_hash=None,
                                  token_ids=list(range(BLOCK * len(stored))), block_size=BLOCK,
                                  lora_id=None, medium=None, lora_name=None))
    if removed:
        events.append(BlockRemoved(block_hashes=list(removed), medium=None))
    return EventBatch(ts=ts, events=events, data_parallel_rank=None)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pub-port", type=int, required=True)
    parser.add_argument("--replay-port", type=int, required=True)
    parser.add_argument("--buffer-steps", type=int, default=10_000)
    parser.add_argument("--skew-s", type=float, default=0.0)
    parser.add_argument("--host", default="127.0.0.1", help="the address both sockets bind")
    args = parser.parse_args()
    ctx = zmq.Context()
    pub = Publisher(ctx, topic="kv@w0@m", buffer_steps=args.buffer_steps,
                    pub_port=args.pub_port, replay_port=args.replay_port, host=args.host)
    pub.start()
    out = sys.stdout

    def report(seq: int, ts: float, stored, removed=()) -> None:
        out.write(json.dumps({"seq": seq, "ts": ts, "stored": list(stored), "removed": list(removed)}) + "\n")
        out.flush()

    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "exit":
            break
        if op == "publish":
            ts = time.time() + args.skew_s
            stored = command.get("stored", [])
            removed = command.get("removed", [])
            seq = pub.publish(batch(ts, stored, removed, command.get("cleared", False)))
            report(seq, ts, stored, removed)
        elif op == "stream":
            first, interval, window = command["first_block"], command["interval_s"], command.get("window")
            for i in range(command["count"]):  # bounded; the test usually kills us first
                ts = time.time() + args.skew_s
                removed = [first + i - window] if window and i >= window else []
                seq = pub.publish(batch(ts, [first + i], removed))
                report(seq, ts, [first + i], removed)
                time.sleep(interval)
    pub.shutdown()
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
