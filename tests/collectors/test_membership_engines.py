"""[fleet.engines]: engines asked for ``/kv_event_sources`` on a real HTTP server, with real
ZeroMQ publishers (vLLM's wire) bound on ports the OS picked behind it, one per rank
(tests/peers/kv_event_sources.py). Engines from a static list, a DNS name (dnsmasq on
loopback) and a fleet file; a restart on new ports; an engine that stops answering; bad
answers. The answer's reading and the workers it gives are tested alone at the end."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time

import pytest
from kv_event_sources import DpEngine, EngineHttp

from kvmiss.collectors.membership import FileSource, build_sources
from kvmiss.collectors.membership_engines import (
    EngineAnswer,
    EngineSource,
    Outcome,
    Problem,
    read_answer,
    workers_for,
)
from kvmiss.schemas.config import ConfigError, FleetConfig, parse_config, parse_fleet_entries
from kvmiss.schemas.engine_sources import EngineDnsConfig, FleetEnginesConfig

DP_ID = "{host}:{port}-dp{dp_rank}"


@pytest.fixture
def engines():
    made: list[DpEngine] = []

    def make(ranks: int = 2, **kw) -> DpEngine:
        made.append(DpEngine(ranks, **kw))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def source(*urls: str, **over) -> EngineSource:
    config = dict(urls=list(urls), id=DP_ID, interval_s=0.1, timeout_s=0.5)
    config.update(over)
    return EngineSource(FleetEnginesConfig(**config))


async def until_change(src: EngineSource, seconds: float = 5.0):
    """Poll as the service does until the source hands on a new set of workers."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        desired = await src.poll()
        if desired is not None:
            return desired
        await asyncio.sleep(0.05)
    raise AssertionError("no change handed on")


async def settle(src: EngineSource, seconds: float) -> list:
    got = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        desired = await src.poll()
        if desired is not None:
            got.append(desired)
        await asyncio.sleep(0.05)
    return got


def endpoints(desired) -> dict[str, tuple[str, str | None, int]]:
    return {s.id: (s.endpoint, s.replay_endpoint, s.dp_rank) for s in desired.specs}


class TestStaticList:
    def test_every_rank_of_every_listed_engine_is_a_worker_with_its_endpoints_as_bound(self, engines):
        a, b = engines(2), engines(1)
        src = source(a.url, b.url)
        first = asyncio.run(src.poll())  # the first poll waits for the first answers
        assert endpoints(first) == {
            f"127.0.0.1:{a.http.port}-dp0": (a.pubs[0].pub_endpoint, a.pubs[0].replay_endpoint, 0),
            f"127.0.0.1:{a.http.port}-dp1": (a.pubs[1].pub_endpoint, a.pubs[1].replay_endpoint, 1),
            f"127.0.0.1:{b.http.port}-dp0": (b.pubs[0].pub_endpoint, b.pubs[0].replay_endpoint, 0)}
        assert all(not s.offset_by_rank and s.topic == "kv-events" for s in first.specs)
        assert src.outcomes == {("answered", ""): 2}

    def test_a_wildcard_host_is_the_engines_own_host(self, engines):
        a = engines(1, wildcard=True)  # "tcp://*:5557": a fixed port, answered as configured
        spec = asyncio.run(source(a.url, id="{host}:{port}").poll()).specs[0]
        assert spec.endpoint == a.pubs[0].pub_endpoint and spec.replay_endpoint == a.pubs[0].replay_endpoint

    def test_a_restart_on_new_ports_is_the_same_ids_with_new_endpoints_dated_by_the_asks(self, engines):
        a = engines(2)
        src = source(a.url)

        async def scenario():
            first = await src.poll()
            await settle(src, 0.3)  # answered the same again: nothing handed on
            restarted = time.time()
            a.restart()
            return first, await until_change(src), restarted

        first, second, restarted = asyncio.run(scenario())
        assert endpoints(first).keys() == endpoints(second).keys()
        assert all(endpoints(first)[w][0] != endpoints(second)[w][0] for w in endpoints(first))
        assert endpoints(second)[f"127.0.0.1:{a.http.port}-dp1"][0] == a.pubs[1].pub_endpoint
        # Made after the last ask that still showed the old ports, by the one that showed the new.
        assert second.since <= restarted <= second.at and second.at - second.since < 1.0

    def test_an_engine_that_stops_answering_keeps_its_workers_and_a_new_answer_replaces_them(self, engines, caplog):
        a = engines(2)
        src = source(a.url, timeout_s=0.3)
        caplog.set_level(logging.WARNING, "kvmiss.collectors")

        async def scenario():
            first = await src.poll()
            a.http.stop_answering()
            silent = await settle(src, 0.8)
            a.restart()  # back on new ports, still not answering: kvmiss cannot know yet
            silent += await settle(src, 0.3)
            a.http.start()
            return first, silent, await until_change(src)

        first, silent, back = asyncio.run(scenario())
        assert silent == []  # no departure: a silent engine may still serve
        assert src.outcomes[("failed", "")] >= 3
        assert [r.message for r in caplog.records].count(next(
            r.message for r in caplog.records if "does not answer" in r.message)) == 1  # logged once per streak
        assert {w: e[0] for w, e in endpoints(back).items()} == {
            f"127.0.0.1:{a.http.port}-dp{r}": a.pubs[r].pub_endpoint for r in (0, 1)}
        assert endpoints(first).keys() == endpoints(back).keys()

    def test_an_engine_that_never_answered_has_no_workers_and_joins_when_it_answers(self, engines):
        a = engines(1)
        a.http.stop_answering()
        src = source(a.url, id="{host}:{port}", timeout_s=0.3)

        async def scenario():
            first = await src.poll()
            assert src.engines[a.url].last.outcome is Outcome.FAILED
            a.http.start()
            return first, await until_change(src)

        first, joined = asyncio.run(scenario())
        assert first.specs == ()
        assert [s.endpoint for s in joined.specs] == [a.pubs[0].pub_endpoint]

    def test_a_slow_engine_times_out_and_never_holds_up_a_poll(self, engines):
        slow, quick = engines(1), engines(1)
        slow.http.delay_s = 2.0
        src = source(slow.url, quick.url, id="{host}:{port}", timeout_s=0.3, interval_s=0.3)

        async def scenario():
            await src.poll()
            took = []
            for _ in range(10):
                t = time.perf_counter()
                await src.poll()
                took.append(time.perf_counter() - t)
                await asyncio.sleep(0.05)
            return took

        took = asyncio.run(scenario())
        assert max(took) < 0.25  # asks run as tasks, read at a later poll (a blocking one takes 0.3 s)
        assert src.engines[slow.url].last.reason == "no answer within 0.3 s"
        assert [s.endpoint for s in src._shown.values()] == [quick.pubs[0].pub_endpoint]


class TestBadAnswers:
    CASES = [
        (b"<html>oops", 200, Problem.INVALID_JSON),
        (b"[1, 2]", 200, Problem.UNKNOWN_SHAPE),
        (b"{}", 200, Problem.NO_SOURCES),
        (b'{"dp0": {"endpoint": "tcp://127.0.0.1:5557"}}', 200, Problem.UNKNOWN_RANK),
        (b'{"0": {"replay_endpoint": "tcp://127.0.0.1:5558"}}', 200, Problem.MISSING_FIELD),
        (b'{"0": "tcp://127.0.0.1:5557"}', 200, Problem.MISSING_FIELD),
        (b'{"0": {"endpoint": 5557}}', 200, Problem.INVALID_FIELD),
        (b'{"0": {"endpoint": "inproc://kv"}}', 200, Problem.BAD_ENDPOINT),
        (b'{"0": {"endpoint": "tcp://127.0.0.1:5557", "publisher": "null"}}', 200, Problem.EVENTS_OFF),
        (b'{"detail": "Not Found"}', 404, Problem.HTTP_STATUS),
    ]

    @pytest.mark.parametrize(("body", "status", "problem"), CASES, ids=[c[2].value + str(i) for i, c in enumerate(CASES)])
    def test_a_bad_answer_is_refused_counted_and_logged_once_and_the_last_good_workers_stay(
            self, engines, caplog, body, status, problem):
        a = engines(1)
        src = source(a.url, id="{host}:{port}")
        caplog.set_level(logging.WARNING, "kvmiss.collectors")

        async def scenario():
            first = await src.poll()
            a.http.answer_with(body, status)
            return first, await settle(src, 0.5)

        first, later = asyncio.run(scenario())
        assert len(first.specs) == 1 and later == []  # kept: refused, not departed
        assert src.outcomes[("refused", problem.value)] >= 3  # every ask counted...
        refusals = [r for r in caplog.records if "answer refused" in r.message]
        assert len(refusals) == 1 and f"({problem.value})" in refusals[0].message  # ...logged once
        assert any(f"answer refused ({problem.value})" in line for line in src.check_lines())

    def test_several_ranks_under_one_id_are_refused_naming_the_fix(self, engines):
        a = engines(2)
        src = source(a.url, id="{host}:{port}")
        assert asyncio.run(src.poll()).specs == ()
        assert src.engines[a.url].last.reason == Problem.ID_NEEDS_DP_RANK.value
        assert "put {dp_rank} in the id" in src.check_lines()[0]

    def test_two_engines_given_one_id_leave_the_second_out_not_the_fleet(self, engines):
        a, b = engines(1), engines(1)
        src = source(a.url, b.url, id="{host}-{dp_rank}")  # the port left out: both are 127.0.0.1-0
        desired = asyncio.run(src.poll())
        first = min(a.url, b.url)
        assert [s.endpoint for s in desired.specs] == [(a if first == a.url else b).pubs[0].pub_endpoint]
        assert src.outcomes[("refused", "duplicate")] == 1


class TestDns:
    def test_the_names_addresses_are_engines_asked_and_one_that_leaves_departs_its_ranks(self, tmp_path, engines):
        from dnsmasq_server import ZONE, Dnsmasq

        server = Dnsmasq(tmp_path)
        try:
            name = f"vllm-http.{ZONE}"
            port = _port_free_on("127.0.0.2", "127.0.0.3")
            e2, e3 = engines(2, host="127.0.0.2", port=port), engines(2, host="127.0.0.3", port=port)
            server.set(name, ["127.0.0.2", "127.0.0.3"])
            src = EngineSource(FleetEnginesConfig(id=DP_ID, interval_s=0.1, timeout_s=0.5, dns=EngineDnsConfig(
                name=name, url=f"http://{{host}}:{port}", nameserver=server.nameserver, interval_s=0.1,
                timeout_s=0.5, empty_grace_s=0.0)))

            async def scenario():
                first = await src.poll()  # the first resolution and the first asks are awaited
                server.set(name, ["127.0.0.3"])
                return first, await until_change(src)

            first, shrunk = asyncio.run(scenario())
            assert sorted(endpoints(first)) == [f"127.0.0.{h}:{port}-dp{r}" for h in (2, 3) for r in (0, 1)]
            assert endpoints(first)[f"127.0.0.2:{port}-dp1"][0] == e2.pubs[1].pub_endpoint
            assert sorted(endpoints(shrunk)) == [f"127.0.0.3:{port}-dp0", f"127.0.0.3:{port}-dp1"]
            assert shrunk.since is not None and shrunk.since <= shrunk.at
            assert e3.http.asked >= 2
        finally:
            server.close()


class TestFleetFile:
    def test_a_fleet_files_engines_are_asked_with_their_own_ids_and_leave_with_the_file(self, tmp_path, engines):
        a, b = engines(2), engines(1)
        path = tmp_path / "fleet.toml"

        def write(text: str) -> None:
            (tmp_path / "fleet.tmp").write_text(text)
            os.rename(tmp_path / "fleet.tmp", path)

        write(f'workers = []\n[[engines]]\nurl = "{a.url}"\nid = "decode-a-dp{{dp_rank}}"\n'
              f'[[engines]]\nurl = "{b.url}"\n')
        config = FleetConfig(file=str(path), engines=FleetEnginesConfig(id="{host}:{port}", interval_s=0.1))
        file, src = build_sources(config)
        assert isinstance(file, FileSource) and isinstance(src, EngineSource)

        async def scenario():
            assert (await file.poll()).specs == ()
            first = await src.poll()
            write(f'[[engines]]\nurl = "{b.url}"\n')  # engines only: no workers key is fine
            await asyncio.sleep(0.02)
            await file.poll()
            return first, await until_change(src)

        first, later = asyncio.run(scenario())
        assert sorted(endpoints(first)) == [f"127.0.0.1:{b.http.port}", "decode-a-dp0", "decode-a-dp1"]
        assert sorted(endpoints(later)) == [f"127.0.0.1:{b.http.port}"]

    def test_the_files_engines_follow_its_rules(self):
        workers, listed = parse_fleet_entries('[[engines]]\nurl = "http://10.0.3.11:8000"\nid = "a-dp{dp_rank}"\n')
        assert workers == [] and [e.url for e in listed] == ["http://10.0.3.11:8000"]
        with pytest.raises(ConfigError, match="engines\\[0\\].id: unknown field {pod}"):
            parse_fleet_entries('[[engines]]\nurl = "http://10.0.3.11:8000"\nid = "{pod}"\n')
        with pytest.raises(ConfigError, match="listed twice"):
            parse_fleet_entries('[[engines]]\nurl = "http://a:1"\n[[engines]]\nurl = "http://a:1"\n')
        with pytest.raises(ConfigError, match="no workers key") as exc:
            parse_fleet_entries("# truncated\n")
        assert exc.value.reason == "empty"


class TestConfig:
    def test_the_section_names_its_key_when_wrong(self):
        base = '[export]\ndiscard = true\n[fleet.engines]\n'
        assert parse_config(base + 'urls = ["http://10.0.3.11:8000"]\n').fleet.engines.id == "{host}:{port}"
        for text, message in [
            ("", "lists no engines"),
            ('urls = ["tcp://10.0.3.11:5557"]\n', "urls\\[0\\]: .* must start with http"),
            ('urls = ["http://user:pw@10.0.3.11:8000"]\n', "must not carry credentials"),
            ('urls = ["http://a:8000", "http://a:8000"]\n', "listed twice"),
            ('urls = ["http://a:8000"]\nid = "engine-{dp_rank}"\n', "id must contain {host}"),
            ('urls = ["http://a:8000"]\nid = "{host}-{rank}"\n', "unknown field {rank}"),
            ('urls = ["http://a:8000"]\ntimeout_s = 0\n', "timeout_s must be"),
            ('[fleet.engines.dns]\nname = "x"\nurl = "http://engines:8000"\n', "dns.url must contain {ip} or {host}"),
        ]:
            with pytest.raises(ConfigError, match=message):
                parse_config(base + text)


# --- the answer alone ----------------------------------------------------------------------


def test_read_answer_takes_vllms_shape_and_reads_past_fields_it_does_not_need():
    body = json.dumps({"1": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://10.0.0.7:39871",
                             "replay_endpoint": "tcp://10.0.0.7:34393", "buffer_steps": 10000, "hwm": 100000,
                             "max_queue_size": 100000, "topic": "", "some_future_field": [1]},
                       "0": {"endpoint": "tcp://10.0.0.7:40000", "replay_endpoint": None}}).encode()
    answer = read_answer(200, body)
    assert answer.outcome is Outcome.ANSWERED and list(answer.ranks) == [0, 1]
    assert answer.ranks[1].replay_endpoint == "tcp://10.0.0.7:34393" and answer.ranks[0].replay_endpoint is None
    assert read_answer(503, b"").outcome is Outcome.FAILED  # a server error says nothing: kept
    assert read_answer(200, b"{" + b" " * (1 << 20) + b"}").reason == Problem.TOO_LARGE.value


def test_workers_for_names_each_rank_by_the_id_template():
    answer = read_answer(200, b'{"0": {"endpoint": "tcp://*:5557"}, "1": {"endpoint": "tcp://*:5558"}}')
    specs = workers_for("http://[fd00::7]:8000/", "pod-a-dp{dp_rank}", answer)
    assert {w: s.endpoint for w, s in specs.items()} == {"pod-a-dp0": "tcp://[fd00::7]:5557",
                                                         "pod-a-dp1": "tcp://[fd00::7]:5558"}
    one = workers_for("https://engine.ns.svc", "{host}:{port}", read_answer(200, b'{"0": {"endpoint": "tcp://e:1"}}'))
    assert list(one) == ["engine.ns.svc:443"]
    same = read_answer(200, b'{"0": {"endpoint": "tcp://e:1"}, "1": {"endpoint": "tcp://e:1"}}')
    assert isinstance(r := workers_for("http://e", DP_ID, same), EngineAnswer) and r.reason == "duplicate"


def test_an_unreachable_url_fails_without_raising():
    closed = EngineHttp()
    closed.stop_answering()
    src = source(closed.url, id="{host}:{port}", timeout_s=0.3)
    assert asyncio.run(src.poll()).specs == ()
    said = src.engines[closed.url].last
    assert said.outcome is Outcome.FAILED and said.reason.startswith("cannot connect")


def _port_free_on(*hosts: str) -> int:
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        try:
            for host in hosts:
                with socket.socket() as s:
                    s.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on every host")


# --- through the service and the CLI ---------------------------------------------------------


def test_serve_check_prints_what_each_engine_answered(tmp_path, engines):
    import subprocess
    import sys

    good, bad, silent = engines(2), engines(1), engines(1)
    bad.http.answer_with(b'{"0": {"replay_endpoint": "tcp://127.0.0.1:1"}}')
    silent.http.stop_answering()
    config = tmp_path / "k.toml"
    config.write_text('[otlp]\ngrpc = "127.0.0.1:0"\nhttp = "127.0.0.1:0"\n[metrics]\nlisten = "127.0.0.1:0"\n'
                      '[export]\ndiscard = true\n[fleet.engines]\n'
                      f'urls = ["{good.url}", "{bad.url}", "{silent.url}"]\nid = "{DP_ID}"\ntimeout_s = 0.5\n')
    done = subprocess.run([sys.executable, "-m", "kvmiss.enricher.cli", "serve", "--config", str(config), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "fleet engines (3 URLs, each asked every 2 s): 3 listed, 2 workers" in out
    assert f"  {good.url}: 2 ranks" in out
    assert (f"    127.0.0.1:{good.http.port}-dp1 (rank 1): {good.pubs[1].pub_endpoint} "
            f"(replay {good.pubs[1].replay_endpoint})") in out
    assert f"  {bad.url}: answer refused (missing_field): " in out and "`$.0`" in out
    assert f"  {silent.url}: no answer (cannot connect" in out


def test_a_running_service_follows_every_rank_and_a_restarted_engine_on_its_new_ports(engines):
    """A real `Service`: the ranks' streams are opened on the answered endpoints and their
    batches applied; a restart on new ports replaces both streams (new epochs), and the new
    processes' batches are applied; the answers are on /metrics."""
    from prometheus_client import generate_latest

    from kvmiss.enricher.service.serve import Service
    from kvmiss.schemas.fleet import MemberState

    a = engines(2)
    config = parse_config(f"""
[otlp]
grpc = ""
http = "127.0.0.1:0"
[privacy]
digest_key = "engines-test-secret-0001"
[metrics]
listen = ""
[export]
discard = true
[fleet]
poll_interval_s = 0.1
[fleet.engines]
urls = ["{a.url}"]
id = "{DP_ID}"
interval_s = 0.2
""")
    ids = [f"127.0.0.1:{a.http.port}-dp{r}" for r in (0, 1)]

    async def until(condition, what: str) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            a.publish()
            await asyncio.sleep(0.05)

    async def main():
        service = Service(config)
        await service.start()
        try:
            await until(lambda: sorted(service.fleet.specs) == ids, "both ranks joined")
            await until(lambda: service.member_states()[MemberState.FOLLOWING] == 2, "both ranks following")
            await until(lambda: service.fleet_stats.first_batch.total == 2, "a batch of each rank applied")
            epochs = {w: s.state.epoch for w, s in service.fleet.streams.items()}
            a.restart()
            await until(lambda: all(service.fleet.specs[w].endpoint == a.pubs[r].pub_endpoint
                                    for r, w in enumerate(ids)), "the new endpoints")
            await until(lambda: service.fleet_stats.first_batch.total == 4, "the new processes' batches")
            assert all(service.fleet.streams[w].state.epoch > epochs[w] for w in ids)
            assert service.fleet_stats.joins == 4 and service.fleet_stats.departures == 2
            text = generate_latest(service.registry).decode()
            assert 'kvmiss_fleet_engine_answers_total{outcome="answered",reason=""}' in text
        finally:
            await service.shutdown()

    asyncio.run(main())
