"""[fleet.dns] against a real DNS server (dnsmasq on loopback, tests/peers/dnsmasq_server.py):
engines join and leave as the name's answers change; a failed resolution departs no one; an
empty answer departs the members only after its grace; resolution never blocks the loop.
The answer policy alone (no server) is tested at the end."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from dnsmasq_server import ZONE, Dnsmasq

from kvmiss.collectors.membership_dns import DnsAnswer, DnsMembership, Outcome
from kvmiss.schemas.config import ConfigError, FleetDnsConfig, check_fleet_dns

NAME = f"engines.{ZONE}"


@pytest.fixture
def server(tmp_path):
    d = Dnsmasq(tmp_path)
    yield d
    d.close()


def dns_config(server: Dnsmasq, **over) -> FleetDnsConfig:
    base = dict(name=NAME, nameserver=server.nameserver, interval_s=1.0, timeout_s=0.5,
                endpoint="tcp://{host}:5557", replay_endpoint="tcp://{host}:5558", id="vllm-{ip}")
    base.update(over)
    config = FleetDnsConfig(**base)
    check_fleet_dns(config, "test")
    return config


def poll(membership: DnsMembership, now: float) -> set[str] | None:
    """One resolution against the server, applied at ``now``: the new member ids, or None."""
    specs = membership.update(asyncio.run(membership.resolve()), now)
    return None if specs is None else {s.id for s in specs}


def test_engines_join_and_leave_as_the_names_answers_change(server):
    server.set(NAME, ["127.0.0.2", "127.0.0.3"])
    m = DnsMembership(dns_config(server))
    assert poll(m, 100.0) == {"vllm-127.0.0.2", "vllm-127.0.0.3"}
    assert {(s.id, s.endpoint, s.replay_endpoint) for s in m.members.values()} == {
        ("vllm-127.0.0.2", "tcp://127.0.0.2:5557", "tcp://127.0.0.2:5558"),
        ("vllm-127.0.0.3", "tcp://127.0.0.3:5557", "tcp://127.0.0.3:5558")}
    assert poll(m, 101.0) is None  # the same answer: nothing changed

    server.set(NAME, ["127.0.0.3", "127.0.0.4", "127.0.0.5"])  # .2 leaves, .4 and .5 join
    assert poll(m, 102.0) == {"vllm-127.0.0.3", "vllm-127.0.0.4", "vllm-127.0.0.5"}
    assert m.outcomes[Outcome.ADDRESSES] == 3


def test_a_resolution_that_times_out_departs_no_one_and_never_blocks_the_loop(server):
    server.set(NAME, ["127.0.0.2", "127.0.0.3"])
    m = DnsMembership(dns_config(server, timeout_s=0.6))

    async def scenario():
        first = m.update(await m.resolve(), 1.0)
        server.pause()  # the server is there but answers nothing: every query times out
        lags = []

        async def ticker():  # the event loop's lag while the resolution waits
            while True:
                t = time.perf_counter()
                await asyncio.sleep(0.005)
                lags.append(time.perf_counter() - t - 0.005)

        task = asyncio.create_task(ticker())
        t0 = time.perf_counter()
        during = m.update(await m.resolve(), 2.0)
        waited = time.perf_counter() - t0
        task.cancel()
        server.resume()
        return first, during, waited, lags

    first, during, waited, lags = asyncio.run(scenario())
    assert len(first) == 2
    assert during is None and len(m.members) == 2  # the last good fleet stays
    assert m.outcomes[Outcome.FAILED] == 1
    assert 0.5 <= waited < 3.0  # it did wait out the time-out...
    assert len(lags) > 20 and max(lags) < 0.1  # ...while the loop ran on

    server.set(NAME, ["127.0.0.3"])  # answering again: the change it missed comes through
    assert poll(m, 3.0) == {"vllm-127.0.0.3"}


def test_nxdomain_departs_the_members_only_once_it_has_lasted_the_grace(server):
    server.set(NAME, ["127.0.0.2"])
    m = DnsMembership(dns_config(server, empty_grace_s=10.0))
    assert poll(m, 0.0) == {"vllm-127.0.0.2"}
    server.set(NAME, [])  # the name is gone: dnsmasq answers NXDOMAIN for it in its zone
    assert poll(m, 1.0) is None and poll(m, 10.5) is None  # within the grace: kept
    assert m.outcomes[Outcome.EMPTY] == 2
    server.set(NAME, ["127.0.0.2"])  # back before the grace ran out: the wait starts over
    assert poll(m, 11.0) is None
    server.set(NAME, [])
    assert poll(m, 12.0) is None and poll(m, 21.0) is None
    assert poll(m, 22.0) == set() and m.members == {}  # empty for 10 s of answers: now they depart


def test_a_name_with_no_records_of_the_type_is_empty_not_a_failure(server):
    server.set(NAME, ["127.0.0.2"])
    m = DnsMembership(dns_config(server, record="AAAA", id="vllm-{ip}", empty_grace_s=0.0))
    assert poll(m, 0.0) is None  # NODATA: an answer that there are none
    assert m.outcomes == {Outcome.EMPTY: 1}


def test_data_parallel_ranks_are_one_worker_each_with_the_engines_port_rule():
    m = DnsMembership(FleetDnsConfig(name="e.ns.svc", dp_size=2, id="{ip}-dp{dp_rank}",
                                     replay_endpoint="tcp://{host}:5558"))
    specs = m.specs_for(("10.0.0.7", "fd00::7"))
    assert sorted(specs) == ["10.0.0.7-dp0", "10.0.0.7-dp1", "fd00::7-dp0", "fd00::7-dp1"]
    assert specs["10.0.0.7-dp1"].sub_endpoint() == "tcp://10.0.0.7:5558"
    assert specs["10.0.0.7-dp1"].replay_address() == "tcp://10.0.0.7:5559"
    assert specs["fd00::7-dp0"].sub_endpoint() == "tcp://[fd00::7]:5557"


def test_the_answer_policy_without_a_server():
    m = DnsMembership(FleetDnsConfig(name="e.ns", empty_grace_s=5.0), resolver=object())
    assert len(m.update(DnsAnswer(Outcome.ADDRESSES, ("10.0.0.1", "10.0.0.2")), 0.0)) == 2
    for t in range(10):  # failures, however many and long, change nothing
        assert m.update(DnsAnswer(Outcome.FAILED, reason="timeout"), 1.0 + t * 100) is None
    assert len(m.members) == 2
    assert m.update(DnsAnswer(Outcome.EMPTY), 1000.0) is None
    assert m.update(DnsAnswer(Outcome.FAILED), 1004.0) is None  # a failure neither ends nor extends the wait
    assert m.update(DnsAnswer(Outcome.EMPTY), 1005.0) == () and m.members == {}
    assert m.update(DnsAnswer(Outcome.ADDRESSES, ("10.0.0.2", "10.0.0.1")), 1006.0) is not None
    assert m.update(DnsAnswer(Outcome.ADDRESSES, ("10.0.0.1", "10.0.0.2", "10.0.0.1")), 1007.0) is None


def test_poll_starts_a_resolution_and_answers_at_a_later_poll_never_waiting_after_the_first(server):
    server.set(NAME, ["127.0.0.2"])
    m = DnsMembership(dns_config(server, interval_s=0.2, timeout_s=0.5))

    async def scenario():
        before = time.time()
        first = await m.poll()  # the first waits for its answer
        assert before <= first.at <= time.time() and first.since is None  # the first fleet: a point
        await asyncio.sleep(0.25)
        while m.known_through < before + 0.2:  # an answer that still shows the old fleet
            assert await m.poll() is None
            await asyncio.sleep(0.02)
        old_shown = m.known_through
        changed = time.time()
        server.set(NAME, ["127.0.0.2", "127.0.0.3"])
        server.pause()  # the next resolution will time out: polls meanwhile return at once
        slowest, answers, t_end = 0.0, [], time.monotonic() + 1.0
        while time.monotonic() < t_end:
            t = time.perf_counter()
            answers.append(await m.poll())
            slowest = max(slowest, time.perf_counter() - t)
            await asyncio.sleep(0.02)
        server.resume()
        t_end = time.monotonic() + 5.0
        while time.monotonic() < t_end:
            got = await m.poll()
            if got is not None:
                break
            await asyncio.sleep(0.02)
        m.close()
        # Made after the last answer that showed the old fleet began, and by the end of the
        # one that showed the new: an interval that holds the change, however late it was read.
        assert got.since == old_shown and got.since <= changed <= got.at <= time.time()
        return first, slowest, answers, got

    first, slowest, answers, got = asyncio.run(scenario())
    assert [s.id for s in first.specs] == ["vllm-127.0.0.2"]
    assert slowest < 0.05 and not any(answers)  # nothing waited on the stopped server
    assert m.outcomes[Outcome.FAILED] >= 1
    assert sorted(s.id for s in got.specs) == ["vllm-127.0.0.2", "vllm-127.0.0.3"]


@pytest.mark.parametrize("over, message", [
    ({"id": "{pod}"}, "fleet.dns.id: unknown field {pod}"),
    ({"id": "static"}, "fleet.dns.id must contain {ip} or {host}"),
    ({"endpoint": "tcp://{host:5557"}, "fleet.dns.endpoint"),
    ({"nameserver": "localhost:53"}, "fleet.dns.nameserver must be \"ip:port\""),
    ({"nameserver": "127.0.0.1"}, "fleet.dns.nameserver"),
    ({"interval_s": 0.0}, "fleet.dns.interval_s"),
    ({"empty_grace_s": float("nan")}, "fleet.dns.empty_grace_s"),
    ({"dp_size": 2}, "fleet.dns.id must contain {dp_rank}"),
])
def test_a_bad_dns_section_is_refused_naming_the_key(over, message):
    config = msgspec.structs.replace(FleetDnsConfig(name="e.ns"), **over)
    with pytest.raises(ConfigError, match=message.replace("{", r"\{").replace("}", r"\}")):
        check_fleet_dns(config, "kvmiss.toml")
