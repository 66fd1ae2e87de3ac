"""Records the golden harness input: tests/data/golden/harness-fleet.{events.kvrec,requests.jsonl}.gz.

Real parts on loopback, as tests/reliability/reliability_rig.py and
tests/collectors/test_fleet_changes.py use them: kvmiss's demo publishers
(enricher/demo/publisher.py, vLLM's wire protocol on real PUB + ROUTER replay sockets) and the
collector's own `Subscriber(Fleet(...))` with a `RecordingWriter`, as `kvmiss collect --record`
runs it. The run:

* w0, w1, w2 from the start; w3 joins (`change_fleet`) a third of the way in;
* w1 loses 2 live batches on the wire (kept in its ring: recovered by replay), twice;
* w2 (a ring of 4 batches) loses 7: a hole replay cannot fill;
* w0's process crashes and a new one binds the same ports, counting from seq 0 again;
* w2 departs half way through; w1 departs and joins again under its id (a new stream);
* 240 requests over shared prefixes, routed to the worker holding the longest prefix or
  elsewhere, each looked up between two engine steps, with the engine's own cached count.

The live run is timing-dependent; its recording and request records are the fixed input, and
only their offline attribution is goldened. The recording format has no record of a fleet
change: played back, every worker of the recording is a member from the start, a joined one
is silent until its first message and a departed one silent after its last; a worker that
left and came back is the one stream it was before, with a gap where it was away.

Run only to make a new input (then run regenerate.py and say why in CHANGELOG.md):

    .venv/bin/python tests/data/golden/record_harness.py
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

from kvmiss.collectors.continuity import Apply
from kvmiss.collectors.fleet import Fleet
from kvmiss.collectors.recording import RecordingWriter
from kvmiss.collectors.subscriber import Subscriber
from kvmiss.enricher.demo.publisher import BlockRemoved, BlockStored, EventBatch, Publisher
from kvmiss.schemas.config import WorkerSpec
from kvmiss.schemas.fleet import FleetChange

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from golden_cases import write_gzip  # noqa: E402

BLOCK = 16
POOL = 24  # blocks each engine holds (LRU)
REQUESTS = 240
SEED = 34


class Engine:
    def __init__(self, ctx: zmq.Context, worker: str, buffer_steps: int = 10_000):
        self.ctx, self.worker, self.buffer_steps = ctx, worker, buffer_steps
        self.pub = Publisher(ctx, topic=f"kv@{worker}@m", buffer_steps=buffer_steps)
        self.pub.start()
        self.lru: dict[int, None] = {}

    @property
    def spec(self) -> WorkerSpec:
        return WorkerSpec(id=self.worker, endpoint=self.pub.pub_endpoint, replay_endpoint=self.pub.replay_endpoint)

    def step(self, stored=(), removed=()) -> int:
        events: list = []
        if stored:
            # token ids are zeros: the golden inputs carry no token ids of any prompt
            events.append(BlockStored(block_hashes=list(stored), parent_block_hash=None,
                                      token_ids=[0] * (BLOCK * len(stored)), block_size=BLOCK,
                                      lora_id=None, medium=None, lora_name=None))
        if removed:
            events.append(BlockRemoved(block_hashes=list(removed), medium=None))
        return self.pub.publish(EventBatch(ts=time.time(), events=events, data_parallel_rank=None))

    def cached_prefix(self, chain: list[int]) -> int:
        n = 0
        for h in chain:
            if h not in self.lru:
                break
            n += 1
        return n

    def serve(self, chain: list[int]) -> None:
        """The request's blocks enter the cache (touched), the least recent leave."""
        new = [h for h in chain if h not in self.lru]
        for h in chain:
            self.lru.pop(h, None)
            self.lru[h] = None
        evicted = []
        while len(self.lru) > POOL:
            victim = next(iter(self.lru))
            if victim in chain:
                break
            del self.lru[victim]
            evicted.append(victim)
        self.step(stored=new, removed=evicted)

    def restart(self) -> None:
        """Crash (batches not on the wire die) and a new process on the same ports."""
        ports = self.pub.pub_port, self.pub.replay_port
        self.pub.shutdown(crash=True)
        self.pub = Publisher(self.ctx, topic=f"kv@{self.worker}@m", buffer_steps=self.buffer_steps,
                             pub_port=ports[0], replay_port=ports[1])
        self.pub.start()
        self.lru.clear()


class Applied:
    def __init__(self) -> None:
        self.count: dict[str, int] = {}
        self.cond = threading.Condition()

    def __call__(self, worker: str, action) -> None:
        if isinstance(action, Apply):
            with self.cond:
                self.count[worker] = self.count.get(worker, 0) + 1
                self.cond.notify_all()

    def of(self, worker: str) -> int:
        with self.cond:
            return self.count.get(worker, 0)


def seen(applied: Applied, engine: Engine) -> None:
    before = applied.of(engine.worker)
    deadline = time.monotonic() + 15
    while applied.of(engine.worker) <= before:
        assert time.monotonic() < deadline, f"{engine.worker}: nothing applied"
        engine.step()
        time.sleep(0.05)


def main() -> None:
    rng = random.Random(SEED)
    ctx = zmq.Context()
    engines = {w: Engine(ctx, w, buffer_steps=4 if w == "w2" else 10_000) for w in ("w0", "w1", "w2", "w3")}
    applied = Applied()
    fleet = Fleet([engines[w].spec for w in ("w0", "w1", "w2")], applied)
    work = Path(tempfile.mkdtemp(prefix="kvmiss-golden-"))
    recorder = RecordingWriter(work / "events.kvrec")
    sub = Subscriber(fleet, recorder=recorder)
    sub.start()
    members = ["w0", "w1", "w2"]
    for w in members:
        seen(applied, engines[w])

    prefixes = [[rng.getrandbits(63) for _ in range(rng.randint(1, 4))] for _ in range(12)]
    records = []
    for i in range(REQUESTS):
        if i == 40:
            sub.change_fleet(FleetChange(at=time.time(), source="file", joined=(engines["w3"].spec,)))
            members.append("w3")
            time.sleep(0.3)
            seen(applied, engines["w3"])
        if i in (60, 150):
            engines["w1"].pub.faults.drop = 2
        if i == 90:
            engines["w2"].pub.faults.drop = 7
        if i == 110:
            engines["w0"].restart()
        if i == 120:
            sub.change_fleet(FleetChange(at=time.time(), source="file", departed=("w2",)))
            members.remove("w2")
        if i == 170:
            sub.change_fleet(FleetChange(at=time.time(), source="file", departed=("w1",)))
            members.remove("w1")
        if i == 190:
            sub.change_fleet(FleetChange(at=time.time(), source="file", joined=(engines["w1"].spec,)))
            members.append("w1")
            time.sleep(0.3)
            seen(applied, engines["w1"])
        chain = rng.choice(prefixes) + [rng.getrandbits(63) for _ in range(rng.randint(0, 3))]
        best = max(members, key=lambda w: engines[w].cached_prefix(chain))
        worker = best if rng.random() < 0.7 else rng.choice(members)
        if i % 23 == 5:  # a request routed to a worker no longer a member (its lookup still judged)
            worker = rng.choice(["w0", "w1", "w2", "w3"])
        engine = engines[worker]
        cached = engine.cached_prefix(chain) * BLOCK
        time.sleep(0.004)
        lookup = time.time()
        time.sleep(0.004)
        for w in members:  # an empty step on every member right after the lookup
            engines[w].step()
        prompt = len(chain) * BLOCK + rng.randint(1, BLOCK - 1)
        engine.serve(chain)
        records.append({"request_id": f"h-{i:04d}", "prompt_tokens": prompt, "cached_tokens": cached,
                        "block_size": BLOCK, "worker": worker, "lookup_time": lookup, "block_hashes": chain})
        time.sleep(0.002)
    for w in members:
        engines[w].step()
    time.sleep(1.0)
    sub.shutdown()
    recorder.close()
    for engine in engines.values():
        engine.pub.shutdown()
    ctx.term()
    write_gzip(HERE / "harness-fleet.events.kvrec.gz", (work / "events.kvrec").read_bytes())
    write_gzip(HERE / "harness-fleet.requests.jsonl.gz", "".join(json.dumps(r) + "\n" for r in records).encode())
    print(f"{recorder.records} messages recorded, {len(records)} requests")


if __name__ == "__main__":
    main()
