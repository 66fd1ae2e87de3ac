"""A fleet that changes under a running `Service` ([fleet] file): real SGLang publishers
over ZeroMQ, the watched file replaced by rename while the service runs. Joins and
departures reach the collector within about a second and show in the metrics; a bad file
is refused once, counted, and changes nothing; a departure does not fail /readyz."""

from __future__ import annotations

import asyncio
import os
import time

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sglang_publisher import batch, close, publisher
from zmq_ports import free_tcp

from kvmiss.enricher.service.serve import Service
from kvmiss.schemas.config import parse_config
from kvmiss.schemas.fleet import MemberState

WAIT_S = 10.0


def config_text(static: dict[str, tuple[str, str]], fleet_file: str) -> str:
    workers = "".join(f'[[workers]]\nid = "{w}"\nendpoint = "{ep}"\nreplay_endpoint = "{rep}"\n'
                      for w, (ep, rep) in static.items())
    return f"""
[otlp]
grpc = ""
http = "127.0.0.1:0"
[privacy]
digest_key = "fleet-test-secret-00001"
[metrics]
listen = ""
[fleet]
file = "{fleet_file}"
poll_interval_s = 0.1
{workers}"""


def write_fleet(path: str, workers: dict[str, tuple[str, str]] | str) -> None:
    text = workers if isinstance(workers, str) else "workers = []\n" if not workers else "".join(
        f'[[workers]]\nid = "{w}"\nendpoint = "{ep}"\nreplay_endpoint = "{rep}"\n' for w, (ep, rep) in workers.items())
    with open(f"{path}.tmp", "w") as f:
        f.write(text)
    os.rename(f"{path}.tmp", path)


def samples(service: Service) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(service.registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def until(condition, what: str, publish=None) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        if publish is not None:
            publish()
        await asyncio.sleep(0.05)


def test_a_watched_file_grows_and_shrinks_the_fleet_and_a_bad_one_changes_nothing(tmp_path):
    eps = {w: (free_tcp(), free_tcp()) for w in ("s0", "f1", "f2")}
    pubs = {w: publisher(endpoint=ep, replay_endpoint=rep, topic=f"kv@{w}@m") for w, (ep, rep) in eps.items()}
    seqs = dict.fromkeys(eps, 0)

    def publish(*workers):
        def go():
            for w in workers:
                pubs[w].publish(batch(time.time(), stored=[([seqs[w] + 1], None)]))
                seqs[w] += 1
        return go

    path = str(tmp_path / "fleet.toml")
    write_fleet(path, {"f1": eps["f1"]})

    async def main():
        service = Service(parse_config(config_text({"s0": eps["s0"]}, path)))
        await service.start()
        try:
            # Start-up: the file's worker is a member from the first socket on.
            assert sorted(service.fleet.specs) == ["f1", "s0"]
            await until(lambda: service.member_states()[MemberState.FOLLOWING] == 2, "s0 and f1 following",
                        publish("s0", "f1"))
            assert service.fleet_stats.joins == 1

            # A join while running, applied within about a second of the rename.
            write_fleet(path, {"f1": eps["f1"], "f2": eps["f2"]})
            changed = time.monotonic()
            await until(lambda: "f2" in service.fleet.streams, "f2 joined")
            assert time.monotonic() - changed < 5.0  # (0.1 s polls; loose for a loaded machine)
            await until(lambda: service.fleet_stats.first_batch.total == 2, "f2's first batch", publish("f2"))
            m = samples(service)
            assert m[("kvmiss_fleet_joins_total", ())] == 2
            assert m[("kvmiss_fleet_first_batch_seconds_count", ())] == 2

            # A bad file: refused once, counted, logged; the last good fleet stays.
            write_fleet(path, '[[workers]]\nid = "f1"\nendpoint = "tcp://127.0.0.1:1"\n'
                              '[[workers]]\nid = "f1"\nendpoint = "tcp://127.0.0.1:2"\n')
            await until(lambda: service.fleet_stats.refused, "the refusal")
            await asyncio.sleep(0.5)  # several polls: refused once, not at each
            assert dict(service.fleet_stats.refused) == {("file", "duplicate_id"): 1}
            assert sorted(service.fleet.streams) == ["f1", "f2", "s0"]
            m = samples(service)
            assert m[("kvmiss_fleet_updates_refused_total", (("reason", "duplicate_id"), ("source", "file")))] == 1

            # An id the static config lists: refused as a clash.
            write_fleet(path, {"s0": eps["f2"]})
            await until(lambda: ("file", "id_clash") in service.fleet_stats.refused, "the clash")
            assert sorted(service.fleet.streams) == ["f1", "f2", "s0"]

            # Departures: f1 and f2 leave; s0 (static) stays; /readyz stays ready.
            write_fleet(path, {})
            await until(lambda: sorted(service.fleet.streams) == ["s0"], "f1 and f2 departed")
            states = service.member_states()
            assert states[MemberState.DEPARTED] == 2 and states[MemberState.FOLLOWING] == 1
            ready, detail = service.ready()
            assert ready and sorted(detail) == ["s0"]
            assert service.fleet_stats.departures == 2
            m = samples(service)
            assert m[("kvmiss_fleet_workers", (("state", "departed"),))] == 2
            assert m[("kvmiss_fleet_departures_total", ())] == 2
        finally:
            await service.shutdown()

    try:
        asyncio.run(main())
    finally:
        for pub in pubs.values():
            close(pub)
