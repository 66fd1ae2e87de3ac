"""Fleets that change the hard ways, under real ``kvmiss serve`` processes while traffic flows:
every engine replaced by a new one (new ids, new ports); an engine that leaves while requests
it served are still on their way; two replicas following the same file and judging the same
requests; a fleet found by DNS (a real dnsmasq on loopback) that grows and shrinks.

The parts and the router are those of test_fleet_file.py: kvmiss's demo publishers (vLLM's
wire protocol over ZeroMQ PUB + replay), each behind a lossy proxy that drops live batches
(recovered through replay); real OTLP/HTTP posts; real sinks. The router routes only to the
members of the fleet at each lookup, and the truth is taken over those members.

Pass: no wrong verdict, every acknowledged span out exactly once, and at most 2 % of the
misses looked up after the first change unknown.
"""

from __future__ import annotations

import random
import time

from dnsmasq_server import ZONE, Dnsmasq
from lossy_proxy import LossyProxy
from reliability_rig import (
    BLOCK,
    PARENT,
    PROMPT_TOKENS,
    TAIL,
    UNKNOWN,
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
from test_fleet_file import BAND_S, POLL_S, FleetRig, judge, run_traffic, start_kvmiss, verdicts
from test_replicas import trace_request

REPLICA_BAND_S = 0.15
DNS_BAND_S = 0.1


def reasons(sink) -> dict[str, str]:
    return {attributes(s)["gen_ai.request.id"]: attributes(s).get("kvmiss.reason") for s in sink.spans()
            if "kvmiss.label" in attributes(s)}


def settle(sender, sink, sent: int) -> None:
    assert len(sender.acked) == sent
    sink.wait_for(sent, timeout=30)
    time.sleep(0.5)
    assert_exactly_once(sender.acked, sink)


def test_a_rolling_replacement_of_every_engine_with_new_ids_and_ports(rig):
    rng = random.Random(241)
    fleet = FleetRig(rig, str(rig.tmp_path / "fleet.toml"), Truth())
    old = ["w0", "w1", "w2", "w3"]
    for worker in old:
        fleet.start_engine(worker)
    fleet.write(old)
    sink = rig.sink()
    kvmiss = start_kvmiss(rig, fleet.path, sink.port)
    sender = Sender(kvmiss.http_port)
    wait_until(lambda: (fleet.mark(), kvmiss.ready())[1], "kvmiss /readyz", interval=0.1)
    universe = list(range(8000, 8096))
    expected: dict[str, str] = {}
    lookups: dict[str, float] = {}
    sent = run_traffic(fleet, kvmiss, sender, rng, universe, 8, expected, lookups)
    first_change = None
    members = list(old)
    for i, leaving in enumerate(old):  # one pod at a time: the new one up, then the old one gone
        fleet.start_engine(f"r{i}")
        members = [w for w in members if w != leaving] + [f"r{i}"]
        at = fleet.write(members)
        first_change = first_change or at
        # (a pod's replacement takes a while: most lookups fall clear of the changes' bands)
        sent += run_traffic(fleet, kvmiss, sender, rng, universe, 25, expected, lookups)
        fleet.engines[leaving].close()  # the old pod is gone once it drained
        fleet.engines.pop(leaving)
    sent += run_traffic(fleet, kvmiss, sender, rng, universe, 20, expected, lookups)

    settle(sender, sink, sent)
    after, unknown = judge(expected, lookups, verdicts(sink), first_change, reasons(sink))
    truths = {expected[rid] for rid in after}
    assert {"routing_miss", "no_match", "resident_miss"} <= truths, truths
    m = kvmiss.scrape()
    assert m.get("kvmiss_fleet_joins") == 8 and m.get("kvmiss_fleet_departures") == 4
    assert m.get("kvmiss_fleet_workers", state="following") == 4
    assert m.get("kvmiss_fleet_updates_refused") == 0
    print(f"{len(expected)} requests, {len(after)} after the first change, {len(unknown)} unknown")


def test_an_engine_that_departs_while_its_requests_are_still_draining(rig):
    """w3 leaves the file at D. Requests it served before D (their lookups well before D)
    reach kvmiss only after D: they are judged against w3's own history, and a block w3 held
    then still makes another worker's miss a routing miss. After D, w3 is no candidate."""
    rng = random.Random(242)
    fleet = FleetRig(rig, str(rig.tmp_path / "fleet.toml"), Truth())
    workers = ["w0", "w1", "w2", "w3"]
    for worker in workers:
        fleet.start_engine(worker)
    fleet.write(workers)
    sink = rig.sink()
    kvmiss = start_kvmiss(rig, fleet.path, sink.port)
    sender = Sender(kvmiss.http_port)
    wait_until(lambda: (fleet.mark(), kvmiss.ready())[1], "kvmiss /readyz", interval=0.1)
    universe = list(range(9000, 9040))
    expected: dict[str, str] = {}
    lookups: dict[str, float] = {}
    sent = run_traffic(fleet, kvmiss, sender, rng, universe, 8, expected, lookups)

    held = []  # requests looked up before D whose spans come after it
    for _ in range(4):
        fleet.step(rng, universe, drop=0.15)
        t = fleet.mark()
        wait_applied(kvmiss, {w: fleet.seqs[w] for w in fleet.members})
        for j in range(10):
            worker = "w3" if j % 2 == 0 else rng.choice(["w0", "w1", "w2"])
            block = rng.choice(sorted(fleet.resident["w3"])) if j % 3 == 0 else rng.choice(universe)
            rid = f"d{len(expected)}"
            expected[rid], lookups[rid] = fleet.label(worker, block, t), t
            held.append((rid, worker, block, t))
    time.sleep(BAND_S + 0.1)  # the held lookups are clear of the departure's band
    departed_at = fleet.write(["w0", "w1", "w2"])
    wait_until(lambda: kvmiss.scrape().get("kvmiss_fleet_departures") == 1, "the departure applied")
    for rid, worker, block, t in held:  # the drained requests' spans arrive now
        router = {"gen_ai.request.id": rid, "kvmiss.route.worker": worker,
                  "gen_ai.usage.cache_read.input_tokens": BLOCK, "gen_ai.usage.input_tokens": PROMPT_TOKENS,
                  "kvmiss.block_hashes": [PARENT, block, TAIL], "kvmiss.lookup_time_unix_nano": int(t * 1e9)}
        engine = {"gen_ai.request.id": rid, "gen_ai.usage.prompt_tokens": PROMPT_TOKENS}
        trace_id = rng.randbytes(16)
        for spans in ([("route", router)], [("llm_request", engine)]):
            assert sender.send(trace_request(trace_id, spans, rng)) == 200
            sent += len(spans)
    sent += run_traffic(fleet, kvmiss, sender, rng, universe, 20, expected, lookups)

    settle(sender, sink, sent)
    labels = verdicts(sink)
    judge(expected, lookups, labels, departed_at)
    drained = [rid for rid, *_ in held]
    assert not [rid for rid in drained if labels[rid][0] in UNKNOWN], [(rid, labels[rid]) for rid in drained]
    assert {expected[rid] for rid in drained} >= {"routing_miss", "resident_miss"}  # w3 as holder and as chosen
    after = [rid for rid in expected if lookups[rid] > departed_at + BAND_S]
    # Blocks only w3 held stop being routing misses once it is gone: the truth says so, and kvmiss agrees.
    assert all(labels[rid][0] == expected[rid] or labels[rid][0] in UNKNOWN for rid in after)
    m = kvmiss.scrape()
    assert m.get("kvmiss_fleet_workers", state="departed") == 1 and m.get("kvmiss_fleet_workers", state="following") == 3


class BothReplicas:
    """A sender that posts every request to each replica (each exports to its own sink), so
    their verdicts on the very same requests can be compared."""

    def __init__(self, senders: list[Sender]):
        self.senders = senders

    def send(self, request) -> int:
        codes = {sender.send(request) for sender in self.senders}
        return codes.pop() if len(codes) == 1 else 0

    @property
    def acked(self) -> list[bytes]:
        return self.senders[0].acked


def test_two_replicas_following_the_same_file_agree_beyond_honest_unknowns(rig):
    """Two ``kvmiss serve`` processes poll the file on their own schedules (0.05 s and 0.15 s:
    they read each change up to 0.15 s apart) and judge the same requests through scale-up,
    scale-down and a replacement. Both stamp a change with the file's ctime, and judge a
    request only once a poll begun a band after its lookup has run, so the band needs to
    cover no more than the slower poll (0.15 s, the least the config allows). Before those
    two rules, with a band 0.05 s above a 0.2 s poll, one replica at a load average above 20
    once called a miss a routing miss on a worker the router had already stopped choosing
    (docs/FLEET.md, "Sizing the band")."""
    rng = random.Random(243)
    fleet = FleetRig(rig, str(rig.tmp_path / "fleet.toml"), Truth())
    for worker in ("w0", "w1", "w2"):
        fleet.start_engine(worker)
    fleet.write(["w0", "w1", "w2"])
    sinks = [rig.sink(), rig.sink()]
    replicas = []
    for sink, poll in zip(sinks, (POLL_S, 0.15)):
        http, grpc, metrics = quiet_port(), quiet_port(), quiet_port()
        text = kvmiss_config(http_port=http, grpc_port=grpc, metrics_port=metrics, sink_port=sink.port,
                             workers={}, wait_s=3.0, assemble_wait_s=2.0)
        text += f'[fleet]\nfile = "{fleet.path}"\npoll_interval_s = {poll}\nmembership_uncertainty_s = {REPLICA_BAND_S}\n'
        replica = Kvmiss(text, rig.tmp_path, http_port=http, metrics_port=metrics, grpc_port=grpc)
        rig.on_close(replica.kill)
        replicas.append(replica)
    senders = [Sender(r.http_port) for r in replicas]
    both = BothReplicas(senders)
    for replica in replicas:
        wait_until(lambda: (fleet.mark(), replica.ready())[1], "kvmiss /readyz", interval=0.1)
    universe = list(range(10000, 10080))
    expected: dict[str, str] = {}
    lookups: dict[str, float] = {}
    sent = run_traffic(fleet, replicas[1], both, rng, universe, 6, expected, lookups)
    fleet.start_engine("w3")
    fleet.start_engine("w4")
    first_change = fleet.write(["w0", "w1", "w2", "w3", "w4"])
    sent += run_traffic(fleet, replicas[1], both, rng, universe, 30, expected, lookups)
    fleet.write(["w1", "w3", "w4"])
    sent += run_traffic(fleet, replicas[1], both, rng, universe, 30, expected, lookups)
    fleet.start_engine("w5")
    fleet.write(["w3", "w4", "w5"])
    sent += run_traffic(fleet, replicas[1], both, rng, universe, 50, expected, lookups)

    all_labels = []
    for sender, sink in zip(senders, sinks):
        settle(sender, sink, sent)
        labels = verdicts(sink)
        judge(expected, lookups, labels, first_change, reasons(sink))
        all_labels.append({rid: v[0] for rid, v in labels.items()})
    disagree = {rid: (all_labels[0][rid], all_labels[1][rid]) for rid in expected
                if all_labels[0][rid] != all_labels[1][rid]
                and all_labels[0][rid] not in UNKNOWN and all_labels[1][rid] not in UNKNOWN}
    assert not disagree, disagree
    for replica in replicas:
        m = replica.scrape()
        assert m.get("kvmiss_fleet_joins") == 6 and m.get("kvmiss_fleet_departures") == 3


class DnsFleet(FleetRig):
    """Engines found by DNS: each behind a lossy proxy bound on an address of its own
    (127.0.0.x) and the same ports, as pods behind a headless Service; joining and leaving is
    the name's answer changing on a real dnsmasq."""

    def __init__(self, rig, truth: Truth, server: Dnsmasq, name: str, ports: tuple[int, int]):
        super().__init__(rig, "", truth)
        self.server, self.name, self.ports = server, name, ports

    def start_engine(self, worker: str) -> None:  # worker: the engine's address
        engines = self.engines[worker] = self.rig.engines([worker], truth=self.truth)
        pub, replay = engines.endpoints(worker)
        proxy = self.proxies[worker] = LossyProxy(pub, replay_upstream=replay, host=worker,
                                                  port=self.ports[0], replay_port=self.ports[1]).start()
        self.rig.on_close(proxy.stop)

    def write(self, members: list[str], text: str | None = None) -> float:
        self.server.set(self.name, members)
        at = time.time()
        self.members = list(members)
        self.history.append((at, tuple(members)))
        return at


def test_a_fleet_found_by_dns_grows_and_shrinks_with_the_names_answers(rig):
    rng = random.Random(244)
    server = Dnsmasq(rig.tmp_path)
    rig.on_close(server.close)
    name = f"engines.{ZONE}"
    ports = (quiet_port(), quiet_port())
    fleet = DnsFleet(rig, Truth(), server, name, ports)
    first = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    for worker in first:
        fleet.start_engine(worker)
    fleet.write(first)
    sink = rig.sink()
    http, grpc, metrics = quiet_port(), quiet_port(), quiet_port()
    interval = 0.1
    text = kvmiss_config(http_port=http, grpc_port=grpc, metrics_port=metrics, sink_port=sink.port,
                         workers={}, wait_s=3.0, assemble_wait_s=2.0)
    # A change is dated between the last answer that did not show it and the one that did,
    # however late a loaded machine reads it: the band covers only the test router's switch.
    text += (f"[fleet]\npoll_interval_s = {POLL_S}\nmembership_uncertainty_s = {DNS_BAND_S}\n"
             f'[fleet.dns]\nname = "{name}"\nnameserver = "{server.nameserver}"\ninterval_s = {interval}\n'
             f'timeout_s = 0.5\nendpoint = "tcp://{{host}}:{ports[0]}"\n'
             f'replay_endpoint = "tcp://{{host}}:{ports[1]}"\nid = "{{ip}}"\n')
    kvmiss = Kvmiss(text, rig.tmp_path, http_port=http, metrics_port=metrics, grpc_port=grpc)
    rig.on_close(kvmiss.kill)
    rig.kvmiss = kvmiss
    sender = Sender(kvmiss.http_port)
    wait_until(lambda: (fleet.mark(), kvmiss.ready())[1], "kvmiss /readyz", interval=0.1)
    universe = list(range(11000, 11096))
    expected: dict[str, str] = {}
    lookups: dict[str, float] = {}
    sent = run_traffic(fleet, kvmiss, sender, rng, universe, 6, expected, lookups)
    grown = first + ["127.0.0.5", "127.0.0.6"]
    for worker in grown[3:]:
        fleet.start_engine(worker)
    first_change = fleet.write(grown)
    wait_until(lambda: kvmiss.scrape().get("kvmiss_fleet_joins") == 5, "the DNS joins applied")
    sent += run_traffic(fleet, kvmiss, sender, rng, universe, 50, expected, lookups)
    fleet.write(["127.0.0.3", "127.0.0.6"])
    wait_until(lambda: kvmiss.scrape().get("kvmiss_fleet_departures") == 3, "the DNS departures applied")
    sent += run_traffic(fleet, kvmiss, sender, rng, universe, 80, expected, lookups)
    server.pause()  # the server stops answering: nobody departs, traffic goes on
    sent += run_traffic(fleet, kvmiss, sender, rng, universe, 20, expected, lookups)
    server.resume()

    settle(sender, sink, sent)
    after, unknown = judge(expected, lookups, verdicts(sink), first_change, reasons(sink))
    m = kvmiss.scrape()
    assert m.get("kvmiss_fleet_joins") == 5 and m.get("kvmiss_fleet_departures") == 3
    assert m.get("kvmiss_fleet_workers", state="following") == 2
    assert m.get("kvmiss_fleet_dns_resolutions", outcome="failed") >= 1
    print(f"{len(expected)} requests, {len(after)} after the first change, {len(unknown)} unknown")
