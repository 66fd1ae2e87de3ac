"""Per-client rate limits and connection caps on the OTLP receivers: one noisy or hostile
client cannot starve the others, nor use up the process's connections.

Rate limits are checked twice: deterministically, with an injected clock, and over real
sockets with two clients at two loopback addresses (Linux routes all of 127/8 to lo), one
of them the OTel SDK's own exporter. Bounds on real traffic are derived from the measured
elapsed time, never from a guess about how fast this box is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import ssl
import time

import aiohttp
import grpc
import pytest
import requests
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace.export import SpanExportResult
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from raw_clients import read_until_closed, trickle, until
from test_receiver import EXPORT, RecordingConsumer, sdk_spans, serving
from test_tls import pki  # noqa: F401  (a fixture: the TLS tests' certificates)

from kvmiss.enricher.otlp import receiver as receiver_module
from kvmiss.enricher.otlp.interfaces import Outcome
from kvmiss.enricher.otlp.receiver import ClientRates, Receivers, client_key, grpc_peer_host
from kvmiss.enricher.service.metrics import KvmissCollector
from kvmiss.enricher.service.pipeline import PipelineStats
from kvmiss.schemas.config import OtlpConfig

PROTOBUF = "application/x-protobuf"
FLOOD_ADDRESS = "127.0.0.1"  # the default source address of loopback clients
QUIET_ADDRESS = "127.0.0.2"


def batch(client: str, spans: int, start: int = 0) -> ExportTraceServiceRequest:
    """``spans`` valid spans under a resource naming ``client``; span names are unique per
    client (``<client>-<i>``) so that losses and duplicates show."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.add(key="client").value.string_value = client
    scope_spans = resource_spans.scope_spans.add()
    for i in range(start, start + spans):
        scope_spans.spans.add(name=f"{client}-{i}", trace_id=(i + 1).to_bytes(16, "big"),
                              span_id=(i + 1).to_bytes(8, "big"))
    return request


def names_by_client(consumer: RecordingConsumer) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for request in consumer.requests:
        for resource_spans in request.resource_spans:
            attrs = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
            client = attrs.get("client") or attrs.get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                out.setdefault(client, []).extend(s.name for s in scope_spans.spans)
    return out


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def limited(clock: Clock | None = None, *, max_clients: int = 4096, **config) -> tuple[Receivers, RecordingConsumer]:
    consumer = RecordingConsumer()
    otlp = OtlpConfig(grpc=None, http=None, **config)
    return Receivers(otlp, consumer, clock=clock or Clock(), max_clients=max_clients), consumer




# --- the limits themselves, on an injected clock --------------------------------------------


class TestPerClientRate:
    def test_a_flooding_client_is_refused_while_a_quiet_one_gets_everything_through(self):
        clock = Clock()
        receivers, consumer = limited(clock, max_spans_per_s_per_client=100)

        async def scenario():
            flood = [await receivers._deliver(batch("flood", 50, 50 * i), "10.0.0.1") for i in range(10)]
            quiet = [await receivers._deliver(batch("quiet", 10, 10 * i), "10.0.0.2") for i in range(5)]
            clock.now += 1.0  # one second later the flooder has its share again, no more
            later = [await receivers._deliver(batch("flood", 50, 500 + 50 * i), "10.0.0.1") for i in range(3)]
            return flood, quiet, later

        flood, quiet, later = asyncio.run(scenario())
        assert [r.outcome for r in flood] == [Outcome.ACCEPTED] * 2 + [Outcome.RETRYABLE] * 8
        assert all(r.retry_after_s >= 1.0 and "per-client" in r.message for r in flood[2:])
        assert [r.outcome for r in quiet] == [Outcome.ACCEPTED] * 5
        assert [r.outcome for r in later] == [Outcome.ACCEPTED] * 2 + [Outcome.RETRYABLE]
        got = names_by_client(consumer)
        assert got["quiet"] == [f"quiet-{i}" for i in range(50)]
        assert len(got["flood"]) == 200 == len(set(got["flood"]))
        assert receivers.stats["requests_client_rate_limited"] == 9
        assert receivers.stats["spans_refused_client_rate_limit"] == 450

    def test_without_it_the_global_limit_lets_a_flooder_starve_the_quiet_client(self):
        """The same traffic under the global limit alone, then with both: what the per-client
        limit is for."""

        async def scenario(**config):
            receivers, _ = limited(**config)
            for i in range(10):
                await receivers._deliver(batch("flood", 50, 50 * i), "10.0.0.1")
            return (await receivers._deliver(batch("quiet", 10), "10.0.0.2")).outcome

        assert asyncio.run(scenario(max_spans_per_s=150)) is Outcome.RETRYABLE
        assert asyncio.run(scenario(max_spans_per_s=150, max_spans_per_s_per_client=100)) is Outcome.ACCEPTED

    def test_a_request_refused_by_the_global_limit_costs_the_client_nothing(self):
        receivers, _ = limited(max_spans_per_s=100, max_spans_per_s_per_client=100)

        async def scenario():
            first = await receivers._deliver(batch("a", 100), "10.0.0.1")
            second = await receivers._deliver(batch("b", 60), "10.0.0.2")
            return first, second

        first, second = asyncio.run(scenario())
        assert first.outcome is Outcome.ACCEPTED and second.outcome is Outcome.RETRYABLE
        assert "per-client" not in second.message and receivers.stats["requests_rate_limited"] == 1
        assert receivers.clients.rate("10.0.0.2").tokens == 100  # given back

    def test_off_by_default(self):
        receivers, consumer = limited()
        assert receivers.clients is None

        async def scenario():
            return [await receivers._deliver(batch("x", 1000, 1000 * i), "10.0.0.1") for i in range(5)]

        assert all(r.outcome is Outcome.ACCEPTED for r in asyncio.run(scenario()))
        assert receivers.gauges()["clients_tracked"] == 0

    def test_a_limited_client_is_logged_once_and_never_becomes_a_metric_label(self, caplog):
        receivers, _ = limited(max_spans_per_s_per_client=10)

        async def scenario():
            for i in range(6):
                await receivers._deliver(batch("flood", 50, 50 * i), "10.9.8.7")

        with caplog.at_level(logging.WARNING, logger="kvmiss.enricher.otlp.receiver"):
            asyncio.run(scenario())
        lines = [r.getMessage() for r in caplog.records if "10.9.8.7" in r.getMessage()]
        assert len(lines) == 1 and "max_spans_per_s_per_client" in lines[0]
        registry = CollectorRegistry()
        registry.register(KvmissCollector(PipelineStats(), dict,
                                          intake=lambda: {**receivers.stats, **receivers.gauges()}))
        text = generate_latest(registry).decode()
        assert 'kvmiss_spans_refused_total{reason="client_rate_limit"} 250.0' in text
        assert 'kvmiss_spans_refused_total{reason="pending_full"} 0.0' in text
        assert "kvmiss_otlp_clients_tracked 1.0" in text
        assert "10.9.8.7" not in text


class TestClientTable:
    def test_the_least_recently_seen_client_is_forgotten_and_a_sending_flooder_never_is(self):
        rates = ClientRates(100, max_clients=3)
        assert rates.rate("flood").take(100, 0.0)
        rates.rate("b"), rates.rate("c")
        assert not rates.rate("flood").take(10, 0.0)  # drained, and now the most recent
        rates.rate("d")  # the table is full: "b" goes
        assert "b" not in rates and "flood" in rates and len(rates) == 3
        assert not rates.rate("flood").take(10, 0.0)  # still drained: churn did not reset it
        assert rates.rate("b").take(100, 0.0)  # a forgotten client comes back with a full bucket

    def test_the_table_never_grows_past_its_bound(self):
        rates = ClientRates(100, max_clients=50)
        for i in range(10_000):
            rates.rate(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}").take(1, float(i))
        assert len(rates) == 50 and rates.forgotten == 10_000 - 50

    @pytest.mark.parametrize("peer, key", [
        ("ipv4:10.0.0.7:53422", "10.0.0.7"),
        ("ipv6:%5B::1%5D:53422", "::1"),
        ("ipv6:[2001:DB8::5]:4317", "2001:db8::5"),
        ("ipv6:%5B::ffff:127.0.0.1%5D:9", "127.0.0.1"),
        ("unix:/run/kvmiss.sock", "unix"),
        ("", "unknown"),
        ("garbage", "unknown"),
    ])
    def test_grpc_peers_are_keyed_by_address_without_port(self, peer, key):
        assert grpc_peer_host(peer) == key

    def test_http_peers_map_ipv4_in_ipv6_to_ipv4(self):
        assert client_key("::ffff:10.1.2.3") == "10.1.2.3" == client_key("10.1.2.3")
        assert client_key(None) == "unknown"


# --- real sockets: two clients, one flooding --------------------------------------------------


def quiet_session() -> requests.Session:
    """A requests session whose connections leave from QUIET_ADDRESS (for the SDK exporter)."""

    class FromQuietAddress(requests.adapters.HTTPAdapter):
        def init_poolmanager(self, *args, **kwargs):
            kwargs["source_address"] = (QUIET_ADDRESS, 0)
            super().init_poolmanager(*args, **kwargs)

    session = requests.Session()
    session.mount("http://", FromQuietAddress())
    return session


def export_quietly(port: int, batches: int, spans: int) -> list[SpanExportResult]:
    """The OTel SDK's OTLP/HTTP exporter from QUIET_ADDRESS, ``batches`` x ``spans`` spans."""
    exporter = HttpSpanExporter(endpoint=f"http://127.0.0.1:{port}/v1/traces", session=quiet_session(), timeout=30)
    try:
        return [exporter.export(sdk_spans(spans)) for _ in range(batches)]
    finally:
        exporter.shutdown()


async def flood_http(port: int, requests_: int, spans: int):
    """Posts as fast as answers come back; returns [(status, Retry-After, Status code)]."""
    answers = []
    async with aiohttp.ClientSession() as session:
        for i in range(requests_):
            body = batch("flood", spans, spans * i).SerializeToString()
            async with session.post(f"http://127.0.0.1:{port}/v1/traces", data=body,
                                    headers={"Content-Type": PROTOBUF}) as response:
                raw = await response.read()
                code = status_pb2.Status.FromString(raw).code if response.status != 200 else None
                answers.append((response.status, response.headers.get("Retry-After"), code))
    return answers


class TestTwoClientsOverRealSockets:
    def test_http_flooder_gets_429_while_the_sdk_exporters_spans_all_go_through(self):
        per_client, flood_spans = 100, 100
        consumer = RecordingConsumer()

        async def scenario():
            async with serving(consumer, grpc=None, max_spans_per_s_per_client=per_client) as receivers:
                started = time.monotonic()
                flood = asyncio.ensure_future(flood_http(receivers.http_port, 40, flood_spans))
                quiet = await asyncio.to_thread(export_quietly, receivers.http_port, 3, 20)
                answers = await flood
                elapsed = time.monotonic() - started
                return quiet, answers, elapsed, receivers.stats.copy(), set(receivers.clients._rates)

        quiet, answers, elapsed, stats, clients = asyncio.run(scenario())
        assert quiet == [SpanExportResult.SUCCESS] * 3
        got = names_by_client(consumer)
        assert len(got["router"]) == 60  # the SDK's spans (service.name "router"), each once
        accepted = [a for a in answers if a[0] == 200]
        refused = [a for a in answers if a[0] != 200]
        assert refused and all(status == 429 and int(retry) >= 1 and code == code_pb2.RESOURCE_EXHAUSTED
                               for status, retry, code in refused)
        # every refusal went to the flooder (the quiet client was never refused) ...
        assert stats["requests_client_rate_limited"] == len(refused)
        # ... and every flood span was either delivered once or refused: none lost
        expected = [f"flood-{n}" for k, (status, _, _) in enumerate(answers) if status == 200
                    for n in range(k * flood_spans, (k + 1) * flood_spans)]
        assert sorted(got["flood"]) == sorted(expected)
        assert len(accepted) * flood_spans <= per_client + per_client * elapsed + flood_spans
        assert clients == {FLOOD_ADDRESS, QUIET_ADDRESS}

    def test_grpc_flooder_gets_unavailable_with_retry_info_and_shares_its_bucket_with_http(self):
        consumer = RecordingConsumer()
        per_client, flood_spans = 50, 200  # one flood request leaves the bucket 4 s in debt

        async def scenario():
            async with serving(consumer, max_spans_per_s_per_client=per_client) as receivers:
                errors, delivered = [], 0
                async with grpc.aio.insecure_channel(f"127.0.0.1:{receivers.grpc_port}") as channel:
                    call = channel.unary_unary(EXPORT, response_deserializer=ExportTraceServiceResponse.FromString)
                    for i in range(10):
                        try:
                            await call(batch("flood", flood_spans, flood_spans * i).SerializeToString(), timeout=10)
                            delivered += 1
                        except grpc.aio.AioRpcError as exc:
                            errors.append(exc)
                # the same client over HTTP draws on the same (empty) bucket
                async with aiohttp.ClientSession() as session:
                    async with session.post(f"http://127.0.0.1:{receivers.http_port}/v1/traces",
                                            data=batch("flood-http", flood_spans).SerializeToString(),
                                            headers={"Content-Type": PROTOBUF}) as response:
                        http_status = response.status
                quiet = await asyncio.to_thread(export_quietly, receivers.http_port, 2, 20)
                return errors, delivered, http_status, quiet

        errors, delivered, http_status, quiet = asyncio.run(scenario())
        assert delivered >= 1 and errors
        for error in errors:
            assert error.code() is grpc.StatusCode.UNAVAILABLE and "per-client" in error.details()
            status = status_pb2.Status.FromString(dict(error.trailing_metadata())["grpc-status-details-bin"])
            info = error_details_pb2.RetryInfo()
            assert status.code == code_pb2.UNAVAILABLE and status.details[0].Unpack(info)
            assert info.retry_delay.seconds >= 1
        assert http_status == 429
        assert quiet == [SpanExportResult.SUCCESS] * 2
        got = names_by_client(consumer)
        assert len(got["flood"]) == delivered * flood_spans and "flood-http" not in got
        assert len(got["router"]) == 40

    def test_the_client_table_stays_bounded_over_real_connections(self):
        consumer = RecordingConsumer()

        async def scenario():
            otlp = OtlpConfig(grpc=None, http="127.0.0.1:0", max_spans_per_s_per_client=1000)
            receivers = Receivers(otlp, consumer, max_clients=4)
            await receivers.start()
            try:
                statuses = []
                for i in range(12):
                    connector = aiohttp.TCPConnector(local_addr=(f"127.0.0.{10 + i}", 0))
                    async with aiohttp.ClientSession(connector=connector) as session:
                        async with session.post(f"http://127.0.0.1:{receivers.http_port}/v1/traces",
                                                data=batch(f"c{i}", 5).SerializeToString(),
                                                headers={"Content-Type": PROTOBUF}) as response:
                            statuses.append(response.status)
                return statuses, set(receivers.clients._rates), receivers.clients.forgotten, receivers.gauges()
            finally:
                await receivers.shutdown(1.0)

        statuses, tracked, forgotten, gauges = asyncio.run(scenario())
        assert statuses == [200] * 12 and len(consumer.requests) == 12
        assert tracked == {f"127.0.0.{i}" for i in (18, 19, 20, 21)}  # the four most recent
        assert forgotten == 8 and gauges["clients_tracked"] == 4


# --- connection caps --------------------------------------------------------------------------


async def closed_by_server(reader: asyncio.StreamReader, timeout: float = 10.0) -> bool:
    """True when the server closes the connection (EOF or reset) without a byte of answer."""
    try:
        return await asyncio.wait_for(reader.read(1024), timeout) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def raw_post(body: bytes) -> bytes:
    head = (f"POST /v1/traces HTTP/1.1\r\nHost: kvmiss\r\nContent-Type: {PROTOBUF}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


class TestConnectionCap:
    def test_http_closes_the_connection_past_the_cap_and_keeps_serving(self):
        consumer = RecordingConsumer()
        body = batch("held", 3).SerializeToString()

        async def scenario():
            async with serving(consumer, grpc=None, max_connections=2) as receivers:
                port = receivers.http_port
                held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
                assert await until(lambda: receivers.http_connections == 2)
                extra_reader, extra_writer = await asyncio.open_connection("127.0.0.1", port)
                extra_closed = await closed_by_server(extra_reader)
                extra_writer.close()
                refused = receivers.stats["http_connections_refused"]
                reader, writer = held[0]  # a connection inside the cap is served meanwhile
                writer.write(raw_post(body))
                status_line = await asyncio.wait_for(reader.readline(), 10)
                for _, w in held:
                    w.close()
                assert await until(lambda: receivers.http_connections == 0)
                async with aiohttp.ClientSession() as session:  # and new clients once they close
                    async with session.post(f"http://127.0.0.1:{port}/v1/traces",
                                            data=batch("after", 2).SerializeToString(),
                                            headers={"Content-Type": PROTOBUF}) as response:
                        after = response.status
                return extra_closed, refused, status_line, after

        extra_closed, refused, status_line, after = asyncio.run(scenario())
        assert extra_closed and refused == 1
        assert status_line.startswith(b"HTTP/1.1 200") and after == 200
        assert names_by_client(consumer) == {"held": ["held-0", "held-1", "held-2"], "after": ["after-0", "after-1"]}

    def test_the_sdk_exporter_refused_at_the_cap_retries_and_loses_nothing(self):
        consumer = RecordingConsumer()
        spans = sdk_spans(5)

        async def scenario():
            async with serving(consumer, grpc=None, max_connections=1) as receivers:
                port = receivers.http_port
                _, holder = await asyncio.open_connection("127.0.0.1", port)
                assert await until(lambda: receivers.http_connections == 1)
                exporter = HttpSpanExporter(endpoint=f"http://127.0.0.1:{port}/v1/traces", timeout=30)
                try:
                    export = asyncio.ensure_future(asyncio.to_thread(exporter.export, spans))
                    refused = await until(lambda: receivers.stats["http_connections_refused"] >= 1)
                    holder.close()  # a slot frees up; the exporter's retry takes it
                    return refused, await export
                finally:
                    exporter.shutdown()

        refused, result = asyncio.run(scenario())
        assert refused and result is SpanExportResult.SUCCESS
        assert sorted(names_by_client(consumer)["router"]) == sorted(s.name for s in spans)

    def test_grpc_refuses_the_connection_past_the_cap_and_keeps_serving(self):
        consumer = RecordingConsumer()
        own_connection = [("grpc.use_local_subchannel_pool", 1)]  # else channels share one

        async def scenario():
            async with serving(consumer, http=None, max_connections=1) as receivers:
                target = f"127.0.0.1:{receivers.grpc_port}"
                first = grpc.aio.insecure_channel(target, options=own_connection)
                second = grpc.aio.insecure_channel(target, options=own_connection)
                try:
                    call_first = first.unary_unary(EXPORT, response_deserializer=ExportTraceServiceResponse.FromString)
                    call_second = second.unary_unary(EXPORT, response_deserializer=ExportTraceServiceResponse.FromString)
                    await call_first(batch("first", 2).SerializeToString(), timeout=10)
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await call_second(batch("second", 2).SerializeToString(), timeout=10)
                    await call_first(batch("first", 2, 2).SerializeToString(), timeout=10)  # still served
                    await first.close()
                    deadline = time.monotonic() + 30  # the second channel reconnects with backoff
                    while True:
                        try:
                            await call_second(batch("second", 2).SerializeToString(), timeout=10)
                            break
                        except grpc.aio.AioRpcError:
                            if time.monotonic() > deadline:
                                raise
                            await asyncio.sleep(0.2)
                    return refused.value.code()
                finally:
                    await first.close()
                    await second.close()

        code = asyncio.run(scenario())
        assert code is grpc.StatusCode.UNAVAILABLE  # retryable for every OTLP client
        got = names_by_client(consumer)
        assert got == {"first": ["first-0", "first-1", "first-2", "first-3"], "second": ["second-0", "second-1"]}

    def test_a_tls_handshake_that_never_finishes_gives_its_slot_back(self, pki, monkeypatch):  # noqa: F811
        monkeypatch.setattr(receiver_module, "TLS_HANDSHAKE_TIMEOUT_S", 2.0)
        consumer = RecordingConsumer()

        async def scenario():
            async with serving(consumer, grpc=None, max_connections=1,
                               tls_cert=str(pki.cert), tls_key=str(pki.key)) as receivers:
                port = receivers.http_port
                _, silent = await asyncio.open_connection("127.0.0.1", port)  # never says hello
                assert await until(lambda: receivers.http_connections == 1)
                extra_reader, _ = await asyncio.open_connection("127.0.0.1", port)
                extra_closed = await closed_by_server(extra_reader)
                freed = await until(lambda: receivers.http_connections == 0)
                tls = ssl.create_default_context(cafile=str(pki.ca))
                async with aiohttp.ClientSession() as session:
                    async with session.post(f"https://127.0.0.1:{port}/v1/traces", ssl=tls,
                                            data=batch("tls", 1).SerializeToString(),
                                            headers={"Content-Type": PROTOBUF}) as response:
                        status = response.status
                silent.close()
                return extra_closed, freed, status, receivers.stats.copy()

        extra_closed, freed, status, stats = asyncio.run(scenario())
        assert extra_closed and freed and status == 200
        assert stats["http_connections_refused"] == 1 and stats["http_handshakes_failed"] >= 1
        assert names_by_client(consumer) == {"tls": ["tls-0"]}

    def test_shutdown_is_prompt_with_connections_held_open(self):
        async def scenario():
            async with contextlib.AsyncExitStack() as stack:
                receivers = await stack.enter_async_context(serving(RecordingConsumer(), grpc=None, max_connections=4))
                held = [await asyncio.open_connection("127.0.0.1", receivers.http_port) for _ in range(4)]
                assert await until(lambda: receivers.http_connections == 4)
                started = time.monotonic()
                await receivers.shutdown(0.5)
                took = time.monotonic() - started
                closed = [await closed_by_server(r) for r, _ in held]
                return took, closed, receivers.http_connections

        took, closed, still_open = asyncio.run(scenario())
        assert took < 5 and all(closed) and still_open == 0


def test_service_metrics_count_client_refusals_without_naming_the_client():
    from kvmiss.enricher.service.serve import Service
    from kvmiss.schemas.config import parse_config

    config = parse_config("""
[otlp]
grpc = ""
http = ":0"
max_spans_per_s_per_client = 10
[privacy]
digest_key = "intake-limits-test-key-0123456789"
[metrics]
listen = ":0"
""")

    async def main():
        service = Service(config)
        await service.start()
        try:
            answers = await flood_http(service.receivers.http_port, 5, 50)
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{service.metrics_port}/metrics") as response:
                    return answers, await response.text()
        finally:
            await service.shutdown(timeout=2)

    answers, text = asyncio.run(main())
    refused = sum(50 for status, _, _ in answers if status == 429)
    assert refused >= 200
    match = re.search(r'^kvmiss_spans_refused_total\{reason="client_rate_limit"\} (\S+)$', text, re.M)
    assert match and float(match[1]) == refused
    assert re.search(r"^kvmiss_otlp_http_connections ", text, re.M)
    label_values = re.findall(r'="([^"]*)"', "\n".join(l for l in text.splitlines() if not l.startswith("#")))
    assert not any("127.0.0" in v for v in label_values)


def test_the_config_keys_reach_the_receivers():
    from kvmiss.enricher.service.serve import Service
    from kvmiss.schemas.config import parse_config

    config = parse_config("[otlp]\ngrpc = ''\nhttp = ''\nmax_connections = 7\nmax_spans_per_s_per_client = 5\n"
                          "body_timeout_s = 2.5\n[metrics]\nlisten = ''\n")
    receivers = Service(config).receivers
    assert receivers._max_connections == 7 and receivers.clients.per_s == 5
    assert receivers._body_timeout_s == 2.5


# --- slow clients -----------------------------------------------------------------------------






class TestSlowClients:
    def test_a_trickled_body_is_answered_retryable_and_its_slot_serves_the_next_client(self):
        """One connection allowed: a client that sends its headers and then a byte now and
        then would hold it for ever; past body_timeout_s it gets 503 + Retry-After (OTLP clients
        retry that, not 408: its spans are sent again, not lost) and is closed, and the
        SDK exporter waiting behind it gets its spans through."""
        consumer = RecordingConsumer()
        body = batch("slow", 40).SerializeToString()

        async def scenario():
            async with serving(consumer, grpc=None, max_connections=1, body_timeout_s=0.5) as receivers:
                reader, writer = await asyncio.open_connection("127.0.0.1", receivers.http_port)
                writer.write(raw_post(body)[:-len(body)])  # the headers announce the whole body
                sending = asyncio.ensure_future(trickle(writer, body))
                answer = await read_until_closed(reader)
                sent = await sending
                writer.close()
                freed = await until(lambda: receivers.http_connections == 0)
                after = await asyncio.to_thread(export_quietly, receivers.http_port, 1, 5)
                return answer, sent, freed, after, receivers.stats.copy()

        answer, sent, freed, after, stats = asyncio.run(scenario())
        assert answer is not None and answer.startswith(b"HTTP/1.1 503 ")
        head, _, status_body = answer.partition(b"\r\n\r\n")
        assert b"Connection: close" in head and f"Content-Type: {PROTOBUF}".encode() in head
        assert b"Retry-After: 1" in head
        status = status_pb2.Status.FromString(status_body)
        assert status.code == code_pb2.UNAVAILABLE and "0.5 s" in status.message
        assert sent < len(body)  # cut off while still sending
        assert freed and after == [SpanExportResult.SUCCESS]
        assert names_by_client(consumer) == {"router": [f"llm_request {i}" for i in range(5)]}  # no "slow"
        assert stats["requests_body_timeout"] == 1 and stats["requests"] == 1
        registry = CollectorRegistry()
        registry.register(KvmissCollector(PipelineStats(), dict, intake=lambda: stats))
        text = generate_latest(registry).decode()
        assert 'kvmiss_otlp_requests_refused_total{reason="body_timeout"} 1.0' in text
        assert 'kvmiss_otlp_requests_refused_total{reason="too_large"} 0.0' in text
        assert "127.0.0" not in text  # counted, never named

    def test_a_body_sent_in_pieces_within_body_timeout_s_is_accepted(self):
        consumer = RecordingConsumer()
        body = batch("pieces", 30).SerializeToString()

        async def scenario():
            async with serving(consumer, grpc=None, body_timeout_s=30) as receivers:
                reader, writer = await asyncio.open_connection("127.0.0.1", receivers.http_port)
                request = raw_post(body)
                for i in range(0, len(request), len(request) // 4 + 1):
                    writer.write(request[i:i + len(request) // 4 + 1])
                    await writer.drain()
                    await asyncio.sleep(0.1)
                status_line = await asyncio.wait_for(reader.readline(), 15)
                writer.close()
                return status_line, receivers.stats.copy()

        status_line, stats = asyncio.run(scenario())
        assert status_line.startswith(b"HTTP/1.1 200")
        assert names_by_client(consumer) == {"pieces": [f"pieces-{i}" for i in range(30)]}
        assert stats["requests_body_timeout"] == 0

    def test_headers_trickled_for_ever_are_cut_off_by_the_idle_timeout(self, monkeypatch):
        """aiohttp's keep-alive timer runs from the connection's start (or its last answer) and
        bytes received do not push it back: it bounds the headers too."""
        monkeypatch.setattr(receiver_module, "IDLE_CONNECTION_S", 1.0)
        consumer = RecordingConsumer()

        async def scenario():
            async with serving(consumer, grpc=None, max_connections=1) as receivers:
                reader, writer = await asyncio.open_connection("127.0.0.1", receivers.http_port)
                endless = f"POST /v1/traces HTTP/1.1\r\nContent-Type: {PROTOBUF}\r\nX-Slow: ".encode() + b"a" * 4000
                sending = asyncio.ensure_future(trickle(writer, endless))
                answer = await read_until_closed(reader)
                sent = await sending
                writer.close()
                freed = await until(lambda: receivers.http_connections == 0)
                return answer, sent, freed, receivers.stats.copy()

        answer, sent, freed, stats = asyncio.run(scenario())
        assert answer == b"" and sent < 4000 and freed
        assert stats["requests"] == 0 and not consumer.requests
