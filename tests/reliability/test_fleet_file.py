"""A fleet that grows and shrinks under a running ``kvmiss serve``, told through its watched
``[fleet] file`` (replaced by rename, as a ConfigMap or a sidecar rendering EndpointSlices
writes it), while traffic flows.

Real parts only: kvmiss's demo publishers (vLLM's wire protocol over ZeroMQ PUB + replay),
each behind a lossy proxy that drops live batches now and then (recovered through replay); a
real ``kvmiss serve`` process; real OTLP/HTTP posts; a real sink. New engines start when they
join (empty, as a scaled-up pod does); departed ones get no more requests and drain. The test's router, like
a real one, routes only to the members of the fleet at each lookup, and the truth is taken
over those members: a block held only by an engine that has left is not a routing miss.

Pass: no wrong verdict, every acknowledged span out exactly once, and at most 2 % of the
misses looked up after the first change unknown.
"""

from __future__ import annotations

import os
import random
import time

from lossy_proxy import LossyProxy
from reliability_rig import (
    BLOCK,
    PARENT,
    PROMPT_TOKENS,
    TAIL,
    UNKNOWN,
    Engines,
    Kvmiss,
    Sender,
    Truth,
    assert_exactly_once,
    attributes,
    kvmiss_config,
    quiet_port,
    wait_applied,
    wait_until,
)
from test_replicas import trace_request

UNKNOWN_BUDGET = 0.02
# One host, one clock: a change is stamped with the file's ctime (when the rename made it
# visible), which is when the test's router switches, and a request is judged only once a
# poll begun a band after its lookup has run -- so the band covers only the file system's
# coarse timestamps and the test's own steps, not kvmiss's poll or a loaded event loop.
# Lookups within it of a change are honest unknowns when a worker in that change held the block.
POLL_S = 0.05
BAND_S = 0.1


class FleetRig:
    """Engines that come and go, each behind a lossy proxy, and the fleet file naming them."""

    def __init__(self, rig, path: str, truth: Truth):
        self.rig, self.path, self.truth = rig, path, truth
        self.engines: dict[str, Engines] = {}
        self.proxies: dict[str, LossyProxy] = {}
        self.members: list[str] = []
        self.history: list[tuple[float, tuple[str, ...]]] = []  # (written at, members from then)
        self.seqs: dict[str, int] = {}
        self.resident: dict[str, set[int]] = {}

    def start_engine(self, worker: str) -> None:
        engines = self.engines[worker] = self.rig.engines([worker], truth=self.truth)
        pub, replay = engines.endpoints(worker)
        proxy = self.proxies[worker] = LossyProxy(pub, replay_upstream=replay).start()
        self.rig.on_close(proxy.stop)

    def write(self, members: list[str], text: str | None = None) -> float:
        """Replace the fleet file by rename; returns when (wall clock) it was replaced."""
        if text is None:
            text = "".join(f'[[workers]]\nid = "{w}"\nendpoint = "{self.proxies[w].endpoint}"\n'
                           f'replay_endpoint = "{self.proxies[w].replay_endpoint}"\n' for w in members)
        with open(f"{self.path}.tmp", "w") as f:
            f.write(text or "workers = []\n")
        os.rename(f"{self.path}.tmp", self.path)
        at = time.time()
        if text is not None and members != self.members:
            self.members = list(members)
            self.history.append((at, tuple(members)))
        return at

    def members_at(self, t: float) -> tuple[str, ...]:
        return next(m for at, m in reversed(self.history) if at <= t)

    def step(self, rng: random.Random, universe: list[int], drop: float) -> None:
        """One engine step on every member: blocks stored and evicted as a block pool does (a
        block is stored when not resident, evicted when it is), some batches lost live."""
        for worker in self.members:
            seq = self.seqs.get(worker, -1) + 1
            if rng.random() < drop:
                self.proxies[worker].drop(seq)
            resident = self.resident.setdefault(worker, set())
            removed = rng.sample(sorted(resident), 4 if len(resident) >= 16 else min(1, len(resident)))
            stored = rng.sample(sorted(set(universe) - resident - set(removed)), 4)
            resident.difference_update(removed)
            resident.update(stored)
            self.seqs[worker], _ = self.engines[worker].publish(worker, stored=stored, removed=removed)

    def mark(self) -> float:
        """A lookup time between two steps; every engine then publishes an empty step, the
        departed ones included: they drain (no new requests) until the pod is gone."""
        time.sleep(0.004)
        t = time.time()
        time.sleep(0.004)
        for worker, engines in self.engines.items():
            self.seqs[worker], _ = engines.publish(worker)
        return t

    def label(self, worker: str, block: int, t: float) -> str:
        """The truth at ``t`` over the fleet's members then (the router's choices)."""
        return self.truth.label(worker, block, t, members=self.members_at(t))


def start_kvmiss(rig, path: str, sink_port: int) -> Kvmiss:
    http, grpc, metrics = quiet_port(), quiet_port(), quiet_port()
    text = kvmiss_config(http_port=http, grpc_port=grpc, metrics_port=metrics, sink_port=sink_port,
                         workers={}, wait_s=3.0, assemble_wait_s=2.0)
    text += f'[fleet]\nfile = "{path}"\npoll_interval_s = {POLL_S}\nmembership_uncertainty_s = {BAND_S}\n'
    kvmiss = Kvmiss(text, rig.tmp_path, http_port=http, metrics_port=metrics, grpc_port=grpc)
    rig.on_close(kvmiss.kill)
    rig.kvmiss = kvmiss
    return kvmiss


def run_traffic(fleet: FleetRig, kvmiss: Kvmiss, sender: Sender, rng: random.Random, universe: list[int],
                rounds: int, expected: dict, lookups: dict, per_round: int = 8) -> int:
    """``rounds`` of: a step on every member, a lookup time, requests routed to members."""
    sent = 0
    for _ in range(rounds):
        fleet.step(rng, universe, drop=0.15)
        t = fleet.mark()
        wait_applied(kvmiss, {w: fleet.seqs[w] for w in fleet.members})
        for _ in range(per_round):
            sent += send_routed_request(fleet, sender, rng, universe, t, expected, lookups)
    return sent


def send_routed_request(fleet: FleetRig, sender: Sender, rng: random.Random, universe: list[int], t: float,
                        expected: dict, lookups: dict) -> int:
    """One request looked up at ``t``, routed to a member: its truth noted, the router's span
    and the engine's sent apart (as their exporters do); returns the spans sent."""
    worker, block = rng.choice(fleet.members), rng.choice(universe)
    rid = f"r{len(expected)}"
    expected[rid], lookups[rid] = fleet.label(worker, block, t), t
    router = {"gen_ai.request.id": rid, "kvmiss.route.worker": worker,
              "gen_ai.usage.cache_read.input_tokens": BLOCK, "gen_ai.usage.input_tokens": PROMPT_TOKENS,
              "kvmiss.block_hashes": [PARENT, block, TAIL], "kvmiss.lookup_time_unix_nano": int(t * 1e9)}
    engine = {"gen_ai.request.id": rid, "gen_ai.usage.prompt_tokens": PROMPT_TOKENS}
    trace_id = rng.randbytes(16)
    for spans in ([("route", router)], [("llm_request", engine)]):
        assert sender.send(trace_request(trace_id, spans, rng)) == 200
    return 2


def judge(expected: dict[str, str], lookups: dict[str, float], labels: dict[str, list[str]],
          since: float, reasons: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
    """No wrong verdict, one per request; the requests looked up after ``since`` and those of
    them unknown."""
    assert all(len(v) == 1 for v in labels.values()) and set(labels) == set(expected)
    wrong = {rid: (labels[rid][0], want, round(lookups[rid] - since, 3), (reasons or {}).get(rid))
             for rid, want in expected.items() if labels[rid][0] not in (want, *UNKNOWN)}
    assert not wrong, wrong
    after = [rid for rid in expected if lookups[rid] > since]
    unknown = [rid for rid in after if labels[rid][0] in UNKNOWN]
    assert len(unknown) <= UNKNOWN_BUDGET * len(after), f"{len(unknown)} of {len(after)} unknown:\n" + "\n".join(
        f"{rid} {lookups[rid] - since:+.3f} s truth {expected[rid]}: {(reasons or {}).get(rid)}" for rid in unknown)
    return after, unknown


def verdicts(sink) -> dict[str, list[str]]:
    labels: dict[str, list[str]] = {}
    for span in sink.spans():
        a = attributes(span)
        if "kvmiss.label" in a:
            labels.setdefault(a["gen_ai.request.id"], []).append(a["kvmiss.label"])
    return labels


def test_scaling_4_to_8_to_3_engines_through_the_watched_file_while_traffic_flows(rig):
    rng = random.Random(24)
    truth = Truth()
    path = str(rig.tmp_path / "fleet.toml")
    fleet = FleetRig(rig, path, truth)
    for worker in ("w0", "w1", "w2", "w3"):
        fleet.start_engine(worker)
    fleet.write(["w0", "w1", "w2", "w3"])
    sink = rig.sink()
    kvmiss = start_kvmiss(rig, path, sink.port)
    sender = Sender(kvmiss.http_port)
    wait_until(lambda: (fleet.mark(), kvmiss.ready())[1], "kvmiss /readyz", interval=0.1)
    universe = list(range(5000, 5048))
    expected: dict[str, str] = {}
    lookups: dict[str, float] = {}

    sent = run_traffic(fleet, kvmiss, sender, rng, universe, 10, expected, lookups)
    for worker in ("w4", "w5", "w6", "w7"):  # scale up: four new, empty engines
        fleet.start_engine(worker)
    first_change = fleet.write(["w0", "w1", "w2", "w3", "w4", "w5", "w6", "w7"])
    sent += run_traffic(fleet, kvmiss, sender, rng, universe, 30, expected, lookups)
    fleet.write(["w0", "w5", "w6"])  # scale down: five leave (and drain)
    sent += run_traffic(fleet, kvmiss, sender, rng, universe, 70, expected, lookups)

    assert len(sender.acked) == sent
    sink.wait_for(sent, timeout=30)
    time.sleep(0.5)
    assert_exactly_once(sender.acked, sink)
    reasons = {attributes(s)["gen_ai.request.id"]: attributes(s).get("kvmiss.reason") for s in sink.spans()
               if "kvmiss.label" in attributes(s)}
    after, unknown = judge(expected, lookups, verdicts(sink), first_change, reasons)
    truths = {expected[rid] for rid in after}
    assert {"routing_miss", "no_match", "resident_miss"} <= truths, truths

    m = kvmiss.scrape()
    assert m.get("kvmiss_fleet_joins") == 8 and m.get("kvmiss_fleet_departures") == 5
    assert m.get("kvmiss_fleet_workers", state="following") == 3
    assert m.get("kvmiss_fleet_workers", state="departed") == 5
    assert m.get("kvmiss_fleet_first_batch_seconds_count") == 8
    assert m.get("kvmiss_fleet_updates_refused") == 0
    assert m.get("kvmiss_stream_replays_recovered") >= 1  # live drops happened, and were filled
    first_batch = m.get("kvmiss_fleet_first_batch_seconds_sum") / 8
    print(f"{len(expected)} requests, {len(after)} after the first change, {len(unknown)} unknown; "
          f"a join's first batch {first_batch * 1000:.0f} ms after it was seen (mean)")


def test_a_bad_fleet_file_during_traffic_is_refused_and_changes_nothing(rig):
    rng = random.Random(25)
    truth = Truth()
    path = str(rig.tmp_path / "fleet.toml")
    fleet = FleetRig(rig, path, truth)
    for worker in ("w0", "w1", "w2"):
        fleet.start_engine(worker)
    fleet.write(["w0", "w1", "w2"])
    sink = rig.sink()
    kvmiss = start_kvmiss(rig, path, sink.port)
    sender = Sender(kvmiss.http_port)
    wait_until(lambda: (fleet.mark(), kvmiss.ready())[1], "kvmiss /readyz", interval=0.1)
    universe = list(range(7000, 7040))
    expected: dict[str, str] = {}
    lookups: dict[str, float] = {}

    sent = run_traffic(fleet, kvmiss, sender, rng, universe, 5, expected, lookups)
    # A writer's mistake: w1 listed twice (and w2 left out). Refused whole: nobody departs.
    bad = (f'[[workers]]\nid = "w0"\nendpoint = "{fleet.proxies["w0"].endpoint}"\n'
           f'[[workers]]\nid = "w1"\nendpoint = "{fleet.proxies["w1"].endpoint}"\n'
           f'[[workers]]\nid = "w1"\nendpoint = "tcp://127.0.0.1:1"\n')
    refused_at = fleet.write(fleet.members, text=bad)
    wait_until(lambda: kvmiss.scrape().get("kvmiss_fleet_updates_refused", source="file", reason="duplicate_id") == 1,
               "the refusal")
    sent += run_traffic(fleet, kvmiss, sender, rng, universe, 10, expected, lookups)

    sink.wait_for(sent, timeout=30)
    time.sleep(0.5)
    assert_exactly_once(sender.acked, sink)
    _, unknown = judge(expected, lookups, verdicts(sink), refused_at)
    assert not unknown  # nothing changed: nothing unsettled
    m = kvmiss.scrape()
    assert m.get("kvmiss_fleet_updates_refused") == 1  # once, not at every poll
    assert m.get("kvmiss_fleet_workers", state="following") == 3
    assert m.get("kvmiss_fleet_departures") == 0 and m.get("kvmiss_fleet_joins") == 3
    refusals = [line for line in kvmiss.log if "update refused" in line]
    assert len(refusals) == 1 and "duplicate id 'w1'" in refusals[0] and "last good fleet stays" in refusals[0]
