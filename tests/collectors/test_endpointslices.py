"""EndpointSlices -> [fleet] file (collectors/endpointslices.py, `kvmiss fleet-sync`).

The rendering is checked on discovery.k8s.io/v1 slices as the API server serves them (several
slices per Service, both address families, not-ready / serving / terminating endpoints, ports
by name in any order, several ports); every rendered file is read back with
parse_fleet_file. The list + watch loop runs against an HTTPS server started here that serves
the API server's two paths (a list, then a chunked watch stream) -- a fake of the API server,
with a CA made by openssl -- and the real one when KVMISS_K8S_APISERVER=1 (tests/deploy).
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import shutil
import ssl
import subprocess
import threading
import urllib.parse

import pytest
from aiohttp import web

from kvmiss.collectors.endpointslices import (
    KubeApi,
    SliceRendering,
    SliceWatch,
    WatchSettings,
    is_member,
    render_fleet,
    slices_of,
    toml_string,
    write_fleet,
)
from kvmiss.enricher.cli import main as kvmiss_main
from kvmiss.schemas.config import ConfigError, WorkerSpec, parse_fleet_file

PORTS = [{"name": "kv-replay", "port": 5558, "protocol": "TCP"},
         {"name": "metrics", "port": 8000, "protocol": "TCP"},
         {"name": "kv-events", "port": 5557, "protocol": "TCP"}]


def endpoint(ip, pod, **conditions):
    return {"addresses": [ip], "conditions": conditions, "nodeName": "node-a", "zone": "z1",
            "targetRef": {"kind": "Pod", "namespace": "serving", "name": pod}}


def eslice(name, endpoints, *, address_type="IPv4", ports=PORTS, rv="1"):
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": address_type,
            "metadata": {"name": name, "namespace": "serving", "resourceVersion": rv,
                         "labels": {"kubernetes.io/service-name": "vllm-engines"}},
            "ports": ports, "endpoints": endpoints}


def fleet(slices, **options) -> list[WorkerSpec]:
    rendered = render_fleet(slices, SliceRendering(**options), service="vllm-engines")
    workers = parse_fleet_file(rendered.text)
    assert len(workers) == rendered.workers
    return workers


def table(workers):
    return [(w.id, w.endpoint, w.replay_endpoint, w.dp_rank) for w in workers]


# A Service with two IPv4 slices (the controller splits at 100 endpoints, or on updates) and
# the IPv6 slice of the same pods (dual stack).
SLICES = [
    eslice("vllm-engines-abcde", [
        endpoint("10.0.3.11", "vllm-0", ready=True, serving=True, terminating=False),
        endpoint("10.0.3.12", "vllm-1", ready=False, serving=False, terminating=False),   # readiness failed
        endpoint("10.0.3.13", "vllm-2", ready=False, serving=True, terminating=True),     # draining
    ]),
    eslice("vllm-engines-fghij", [
        endpoint("10.0.4.21", "vllm-3", ready=True, serving=True, terminating=False),
        endpoint("10.0.4.22", "vllm-4"),                                                   # no conditions: nil = ready
        endpoint("10.0.4.23", "vllm-5", ready=False, serving=False, terminating=True),    # gone
    ], ports=list(reversed(PORTS))),
    eslice("vllm-engines-v6xyz", [
        endpoint("fd00::11", "vllm-0", ready=True, serving=True, terminating=False),
        endpoint("fd00::13", "vllm-2", ready=False, serving=True, terminating=True),
    ], address_type="IPv6"),
]


def test_ready_endpoints_of_every_slice_of_one_family_are_the_fleet():
    assert table(fleet(SLICES)) == [
        ("vllm-0", "tcp://10.0.3.11:5557", "tcp://10.0.3.11:5558", 0),
        ("vllm-3", "tcp://10.0.4.21:5557", "tcp://10.0.4.21:5558", 0),
        ("vllm-4", "tcp://10.0.4.22:5557", "tcp://10.0.4.22:5558", 0),
    ]


def test_serving_members_keep_draining_endpoints_but_not_stopped_ones():
    assert [w.id for w in fleet(SLICES, members="serving")] == ["vllm-0", "vllm-2", "vllm-3", "vllm-4"]


def test_ipv6_slices_give_bracketed_endpoints():
    assert table(fleet(SLICES, address_type="IPv6")) == [
        ("vllm-0", "tcp://[fd00::11]:5557", "tcp://[fd00::11]:5558", 0)]
    assert [w.endpoint for w in fleet(SLICES, address_type="IPv6", members="serving")] == [
        "tcp://[fd00::11]:5557", "tcp://[fd00::13]:5557"]


def test_conditions_follow_the_api_defaults():
    assert is_member({}, "ready") and is_member(None, "serving")  # nil ready / serving: true
    assert not is_member({"ready": False, "serving": True}, "ready")
    assert is_member({"ready": True, "terminating": True}, "ready")  # publishNotReadyAddresses
    assert not is_member({"ready": False, "serving": False, "terminating": True}, "serving")


def test_ports_by_name_or_number_and_slices_without_the_port_are_reported():
    workers = fleet(SLICES, port="kv-replay", replay_port="kv-events")
    assert workers[0].endpoint == "tcp://10.0.3.11:5558" and workers[0].replay_endpoint == "tcp://10.0.3.11:5557"
    assert [w.endpoint for w in fleet(SLICES, port="6000", replay_port=None)][:1] == ["tcp://10.0.3.11:6000"]
    assert all(w.replay_endpoint is None for w in fleet(SLICES, replay_port=None))
    only_events = [eslice("other", [endpoint("10.0.9.1", "x", ready=True)], ports=[PORTS[2]])]
    rendered = render_fleet(SLICES[:1] + only_events, SliceRendering(), service="s")
    assert [w.id for w in parse_fleet_file(rendered.text)] == ["vllm-0"]
    assert rendered.skipped == ["slice other: no port 'kv-replay' (1 endpoints left out)"]


def test_order_is_deterministic_and_an_endpoint_in_two_slices_is_one_worker():
    moved = eslice("vllm-engines-klmno", [copy.deepcopy(SLICES[0]["endpoints"][0])])  # mid-move
    texts = set()
    for seed in range(6):
        slices = copy.deepcopy(SLICES + [moved])
        random.Random(seed).shuffle(slices)
        for item in slices:
            random.Random(seed).shuffle(item["endpoints"])
        texts.add(render_fleet(slices, SliceRendering(), service="vllm-engines").text)
    assert len(texts) == 1
    assert [w.id for w in parse_fleet_file(texts.pop())] == ["vllm-0", "vllm-3", "vllm-4"]


def test_two_endpoints_under_one_id_keep_one_and_say_so():
    slices = [eslice("a", [endpoint("10.0.0.2", "p", ready=True), endpoint("10.0.0.1", "p", ready=True)])]
    rendered = render_fleet(slices, SliceRendering(), service="s")
    assert table(parse_fleet_file(rendered.text)) == [("p", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558", 0)]
    assert rendered.skipped == ["id 'p': also at tcp://10.0.0.2:5557, kept tcp://10.0.0.1:5557"]


def test_data_parallel_ranks_are_one_worker_each():
    workers = fleet(SLICES[:1], dp_size=2, id="{pod}-dp{dp_rank}")
    assert table(workers) == [("vllm-0-dp0", "tcp://10.0.3.11:5557", "tcp://10.0.3.11:5558", 0),
                              ("vllm-0-dp1", "tcp://10.0.3.11:5557", "tcp://10.0.3.11:5558", 1)]
    assert workers[1].sub_endpoint() == "tcp://10.0.3.11:5558"  # the engine offsets by rank


def test_templates_over_the_endpoint_fields():
    workers = fleet(SLICES[:1], id="{namespace}/{pod}@{node}.{zone}", endpoint="tcp://{ip}:{port}")
    assert workers[0].id == "serving/vllm-0@node-a.z1"


def test_an_empty_service_is_an_empty_fleet_not_a_missing_key():
    rendered = render_fleet([eslice("e", [])], SliceRendering(), service="s")
    assert parse_fleet_file(rendered.text) == [] and "workers = []" in rendered.text
    assert parse_fleet_file(render_fleet([], SliceRendering()).text) == []


@pytest.mark.parametrize("options, message", [
    ({"dp_size": 2}, "must use {dp_rank}"),
    ({"id": "engine"}, "names no field"),
    ({"id": "{pod_name}"}, "unknown field {pod_name}"),
    ({"endpoint": "tcp://{host}:{replay_port}"}, "unknown field {replay_port}"),
    ({"members": "all"}, "members"),
])
def test_a_rendering_that_cannot_give_a_valid_fleet_is_refused(options, message):
    with pytest.raises(ConfigError, match=message.replace("{", r"\{").replace("}", r"\}")):
        SliceRendering(**options).check()


def test_strings_are_escaped_for_toml():
    nasty = 'a"b\\c\x01\x7fé'
    assert parse_fleet_file(f"[[workers]]\nid = {toml_string(nasty)}\nendpoint = \"tcp://a:1\"\n")[0].id == nasty


def test_write_replaces_by_rename_and_leaves_an_unchanged_file_alone(tmp_path):
    path = tmp_path / "fleet.toml"
    first = render_fleet(SLICES, SliceRendering()).text
    assert write_fleet(path, first)
    inode = path.stat().st_ino
    assert not write_fleet(path, first) and path.stat().st_ino == inode  # unchanged: not rewritten
    second = render_fleet(SLICES[:1], SliceRendering()).text
    assert write_fleet(path, second)
    assert path.stat().st_ino != inode and path.read_text() == second  # a new file renamed over
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.toml"]


def test_cli_renders_kubectl_json_once(tmp_path, capsys):
    source = tmp_path / "slices.json"
    source.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": SLICES}))
    output = tmp_path / "fleet.toml"
    assert kvmiss_main(["fleet-sync", "--service", "vllm-engines", "--from-json", str(source),
                        "--output", str(output), "--members", "serving"]) == 0
    assert [w.id for w in parse_fleet_file(output.read_text())] == ["vllm-0", "vllm-2", "vllm-3", "vllm-4"]
    assert "4 workers" in capsys.readouterr().out
    assert kvmiss_main(["fleet-sync", "--service", "s", "--from-json", str(source), "--output", str(output),
                        "--dp-size", "2"]) == 2  # {pod} alone would give two ranks one id
    assert slices_of(SLICES[0]) == [SLICES[0]] and slices_of(SLICES) == SLICES


# --- the list + watch loop, against an HTTPS server serving the API server's paths ----------


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test CA")
    d = tmp_path_factory.mktemp("tls")
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True, cwd=d)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=kvmiss-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=api")
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "2", "-extfile", "ext")
    return d


class FakeApiServer:
    """The two requests fleet-sync makes, as the API server answers them: a list (items +
    resourceVersion) and a watch (one JSON event per line, chunked, until the server ends
    it). Records each request; ``script`` decides what each watch streams."""

    def __init__(self, token: str):
        self.token = token
        self.slices = {s["metadata"]["name"]: copy.deepcopy(s) for s in SLICES[:2]}
        self.rv = 10
        self.requests: list[dict] = []
        self.watch_queue: asyncio.Queue | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append({"path": request.path, **request.query,
                              "auth": request.headers.get("Authorization")})
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"kind": "Status", "code": 401}, status=401)
        if request.query.get("labelSelector") != "kubernetes.io/service-name=vllm-engines":
            return web.json_response({"kind": "Status", "code": 400}, status=400)
        if request.query.get("watch") != "1":
            return web.json_response({"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                                      "metadata": {"resourceVersion": str(self.rv)},
                                      "items": list(self.slices.values())})
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        while True:
            event = await self.watch_queue.get()
            if event is None:
                break  # the server ends this watch (timeoutSeconds)
            await response.write(json.dumps(event).encode() + b"\n")
        await response.write_eof()
        return response

    def event(self, kind, obj):
        self.rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        if kind == "DELETED":
            self.slices.pop(obj["metadata"]["name"], None)
        elif kind in ("ADDED", "MODIFIED"):
            self.slices[obj["metadata"]["name"]] = obj
        self.watch_queue.put_nowait({"type": kind, "object": obj})


async def until(predicate, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_watch_keeps_the_file_equal_to_the_api_servers_slices(tmp_path, tls):
    import aiohttp

    token_file = tmp_path / "token"
    token_file.write_text("first-token\n")
    output = tmp_path / "fleet" / "fleet.toml"
    output.parent.mkdir()

    async def scenario():
        api_server = FakeApiServer("first-token")
        api_server.watch_queue = asyncio.Queue()
        app = web.Application()
        app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/serving/endpointslices", api_server.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(tls / "server.crt", tls / "server.key")
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        api = KubeApi(server=f"https://127.0.0.1:{port}", namespace="serving", token_file=token_file,
                      ca_file=tls / "ca.crt")
        state = SliceWatch(api, "vllm-engines", SliceRendering(), output, WatchSettings(settle_s=0.05))
        stop = asyncio.Event()
        ids = lambda: [w.id for w in parse_fleet_file(output.read_text())] if output.exists() else None  # noqa: E731
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(state.run(session, stop=stop))
            try:
                await until(lambda: ids() == ["vllm-0", "vllm-3", "vllm-4"])
                await until(lambda: any(r.get("watch") == "1" for r in api_server.requests))
                watch = [r for r in api_server.requests if r.get("watch") == "1"][0]
                assert watch["resourceVersion"] == "10" and watch["allowWatchBookmarks"] == "true"

                # vllm-1 becomes ready, vllm-0 starts draining: one burst, one write.
                writes = state.writes
                changed = copy.deepcopy(api_server.slices["vllm-engines-abcde"])
                changed["endpoints"][1]["conditions"] = {"ready": True, "serving": True, "terminating": False}
                api_server.event("MODIFIED", changed)
                changed = copy.deepcopy(changed)
                changed["endpoints"][0]["conditions"] = {"ready": False, "serving": True, "terminating": True}
                api_server.event("MODIFIED", changed)
                await until(lambda: ids() == ["vllm-1", "vllm-3", "vllm-4"])
                await asyncio.sleep(0.2)
                assert state.writes == writes + 1

                # A bookmark changes nothing; a deleted slice departs its endpoints.
                api_server.event("BOOKMARK", {"kind": "EndpointSlice", "metadata": {}})
                api_server.event("DELETED", api_server.slices["vllm-engines-fghij"])
                await until(lambda: ids() == ["vllm-1"])

                # The watch ends (timeoutSeconds): it resumes from the last version seen, no re-list.
                lists = state.lists
                api_server.watch_queue.put_nowait(None)
                await until(lambda: len([r for r in api_server.requests if r.get("watch") == "1"]) == 2)
                assert [r for r in api_server.requests if r.get("watch") == "1"][1]["resourceVersion"] == str(api_server.rv)
                assert state.lists == lists

                # An expired version (410 Gone in an ERROR event) lists again; the token is read anew.
                token_file.write_text("rotated-token\n")
                api_server.token = "rotated-token"
                api_server.slices["vllm-engines-fghij"] = copy.deepcopy(SLICES[1])
                api_server.watch_queue.put_nowait({"type": "ERROR", "object": {
                    "kind": "Status", "status": "Failure", "reason": "Expired", "code": 410,
                    "message": "too old resource version"}})
                await until(lambda: ids() == ["vllm-1", "vllm-3", "vllm-4"])
                assert state.lists == lists + 1
                assert api_server.requests[-1]["auth"] == "Bearer rotated-token"

                # A refused request (401) leaves the last file as it is.
                before = output.read_text()
                api_server.token = "someone-else"
                api_server.watch_queue.put_nowait(None)
                await until(lambda: api_server.requests[-1]["auth"] == "Bearer rotated-token"
                            and len(api_server.requests) > 8)
                await asyncio.sleep(0.3)
                assert output.read_text() == before

                # Answers again: listed, then a watch left open and silent for the stop below.
                api_server.token = "rotated-token"
                failed = len(api_server.requests)
                await until(lambda: len(api_server.requests) >= failed + 2
                            and api_server.requests[-1].get("watch") == "1", timeout=20)
            finally:
                # The watch is open and silent: a stop must end it without the server's help.
                stop.set()
                await asyncio.wait_for(task, 2)
                api_server.watch_queue.put_nowait(None)  # then let the server's handler end
                await runner.cleanup()

    asyncio.run(scenario())


def test_the_api_servers_ca_is_checked(tmp_path, tls):
    """A server whose certificate the configured CA did not sign is refused: nothing is written."""
    other = tmp_path / "other-ca.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", tmp_path / "k",
                    "-out", other, "-days", "1", "-subj", "/CN=other"], check=True, capture_output=True)
    output = tmp_path / "fleet.toml"

    def serve(ready: threading.Event, port: list, done: threading.Event):
        async def main():
            async def empty(request):
                return web.json_response({"items": []})

            app = web.Application()
            app.router.add_get("/{tail:.*}", empty)
            runner = web.AppRunner(app)
            await runner.setup()
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(tls / "server.crt", tls / "server.key")
            site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
            await site.start()
            port.append(site._server.sockets[0].getsockname()[1])
            ready.set()
            while not done.is_set():
                await asyncio.sleep(0.02)
            await runner.cleanup()
        asyncio.run(main())

    ready, done, port = threading.Event(), threading.Event(), []
    thread = threading.Thread(target=serve, args=(ready, port, done))
    thread.start()
    try:
        ready.wait(10)
        token = tmp_path / "token"
        token.write_text("t")

        async def attempt(ca):
            import aiohttp
            api = KubeApi(server=f"https://127.0.0.1:{port[0]}", namespace="serving", token_file=token, ca_file=ca)
            state = SliceWatch(api, "vllm-engines", SliceRendering(), output, WatchSettings(settle_s=0.05))
            stop = asyncio.Event()
            async with aiohttp.ClientSession() as session:
                task = asyncio.create_task(state.run(session, stop=stop))
                await asyncio.sleep(0.5)
                stop.set()
                await asyncio.wait_for(task, 10)
            return state

        assert asyncio.run(attempt(other)).lists == 0 and not output.exists()
        assert asyncio.run(attempt(tls / "ca.crt")).lists >= 1 and parse_fleet_file(output.read_text()) == []
    finally:
        done.set()
        thread.join(10)



def test_the_sidecar_command_lists_writes_and_stops_on_sigterm(tmp_path):
    """`kvmiss fleet-sync` as the chart runs it, against a plain-HTTP server whose watches end at
    once (a proxy that closes them): the file is written, the watch is not retried in a tight
    loop, and SIGTERM ends the process with status 0."""
    import http.server
    import signal
    import sys
    import time

    requests = []

    class Api(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            requests.append(self.path)
            body = b"" if "watch=1" in self.path else json.dumps(
                {"metadata": {"resourceVersion": "5"}, "items": SLICES}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    output = tmp_path / "fleet.toml"
    proc = subprocess.Popen([sys.executable, "-m", "kvmiss.enricher.cli", "fleet-sync", "--service", "vllm-engines",
                             "--namespace", "serving", "--output", str(output), "--members", "serving",
                             "--api-server", f"http://127.0.0.1:{server.server_address[1]}", "--token-file", "",
                             "--ca-file", ""], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not output.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "timed out"
            time.sleep(0.05)
        time.sleep(2.5)
        assert [w.id for w in parse_fleet_file(output.read_text())] == ["vllm-0", "vllm-2", "vllm-3", "vllm-4"]
        watches = [p for p in requests if "watch=1" in p]
        assert 1 <= len(watches) <= 4  # about one a second, not hundreds
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(watches[0]).query)
        assert query["labelSelector"] == ["kubernetes.io/service-name=vllm-engines"] and query["resourceVersion"] == ["5"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        server.shutdown()
