"""Fleet membership from Kubernetes EndpointSlices: the engines' Service's endpoints rendered
into a ``[fleet] file`` (docs/FLEET.md), the file kvmiss re-reads when it is replaced.

`render_fleet` is pure: EndpointSlice objects (``discovery.k8s.io/v1``, as the API server or
``kubectl get endpointslices -o json`` gives them) in, the file's TOML text out. `write_fleet`
replaces the file by rename. `watch` lists and watches the slices of one Service through the
API server with the pod's service-account token, and writes the file whenever the rendered
fleet changes. ``kvmiss fleet-sync`` (enricher/cli/fleet_sync_cmd.py) runs it as a sidecar.

Who is a member (docs/DEPLOY.md, "Kubernetes"):
  * ``members = "ready"`` (default): endpoints whose ``conditions.ready`` is true or absent
    (the API says nil means true). That is the set a router choosing among the Service's
    ready endpoints can pick from, so a worker joins and departs when the router's choice
    does: a draining pod (``terminating``, ``ready`` false) departs when routers stop
    sending to it, and a lookup after that is never called a routing miss towards it. With
    ``publishNotReadyAddresses`` on the Service the controller marks every endpoint ready, so
    a pod departs only when it is deleted (a readiness flap then departs no one).
  * ``members = "serving"``: endpoints whose ``conditions.serving`` is true or absent, ready
    or terminating: for routers that keep sending to a draining pod until it stops serving.
Terminating alone never decides: it is what ``ready`` already folds in.

One address family (``address_type``): a dual-stack Service has one slice per family for the
same pods, and a pod must be one worker, not two. Ids must be unique: an endpoint listed in
two slices at once (the controller moving it) is one worker; two different endpoints that
would get one id keep the first in sorted order and are reported. The output is sorted by
id and rank, and carries no timestamp, so an unchanged fleet renders the same bytes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import ssl
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kvmiss.schemas.config import ConfigError, offset_endpoint, parse_fleet_file, template_fields

log = logging.getLogger("kvmiss.collectors")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
ID_FIELDS = frozenset({"pod", "namespace", "ip", "host", "hostname", "node", "zone", "dp_rank"})
ENDPOINT_FIELDS = ID_FIELDS | {"port", "replay_port"}

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class SliceRendering:
    """How endpoints become ``[[workers]]``. ``port`` and ``replay_port`` name a port of the
    slices (its ``name``, as the Service's port is named) or give a number; templates run
    over {pod} (targetRef name), {namespace}, {ip}, {host} (the address as an endpoint takes
    it: [..] for IPv6), {hostname}, {node}, {zone}, {dp_rank}, and {port} / {replay_port}."""

    port: str = "kv-events"
    replay_port: str | None = "kv-replay"  # None: no replay endpoint
    id: str = "{pod}"
    endpoint: str = "tcp://{host}:{port}"
    replay_endpoint: str = "tcp://{host}:{replay_port}"
    members: Literal["ready", "serving"] = "ready"
    address_type: Literal["IPv4", "IPv6"] = "IPv4"
    dp_size: int = 1  # data-parallel ranks per endpoint: the engine offsets both ports by rank

    def check(self) -> None:
        """ConfigError naming the option for a rendering that cannot give a valid fleet."""
        if self.members not in ("ready", "serving"):
            raise ConfigError(f"members: must be 'ready' or 'serving', got {self.members!r}")
        if self.address_type not in ("IPv4", "IPv6"):
            raise ConfigError(f"address_type: must be 'IPv4' or 'IPv6', got {self.address_type!r}")
        if not 1 <= self.dp_size <= 1024:
            raise ConfigError(f"dp_size: must be between 1 and 1024, got {self.dp_size}")
        for key, value in (("port", self.port), ("replay_port", self.replay_port)):
            if value is not None and not value.strip():
                raise ConfigError(f"{key}: a port name or number, got {value!r}")
        id_fields = template_fields("id", self.id, ID_FIELDS)
        if not id_fields:
            raise ConfigError(f"id: {self.id!r} names no field: every endpoint would get the same id")
        if self.dp_size > 1 and "dp_rank" not in id_fields:
            raise ConfigError(f"id: with dp_size {self.dp_size} the id must use {{dp_rank}}, got {self.id!r}")
        template_fields("endpoint", self.endpoint, ENDPOINT_FIELDS - {"replay_port"})
        if self.replay_port is not None:
            template_fields("replay_endpoint", self.replay_endpoint, ENDPOINT_FIELDS - {"port"})


@dataclass
class Rendered:
    """The file's text, and what was left out and why (for the log; no fleet data lost)."""

    text: str
    workers: int
    skipped: list[str] = field(default_factory=list)


def is_member(conditions: dict | None, members: str) -> bool:
    """Whether an endpoint with these ``conditions`` is a member (module docstring)."""
    conditions = conditions or {}
    if members == "serving":
        return conditions.get("serving") is not False
    return conditions.get("ready") is not False


def _port_number(spec: str, ports: list[dict]) -> int | None:
    if spec.isdigit():
        return int(spec)
    for port in ports:
        if (port.get("name") or "") == spec and port.get("port") is not None:
            return int(port["port"])
    return None


def _host(ip: str) -> str:
    try:
        return f"[{ip}]" if ipaddress.ip_address(ip).version == 6 else ip
    except ValueError:
        return ip


def render_fleet(slices: list[dict], rendering: SliceRendering, *, service: str = "") -> Rendered:
    """The ``[fleet] file`` text for the member endpoints of ``slices``; ConfigError when the
    result would not be a valid fleet file (it is checked with ``parse_fleet_file``)."""
    rendering.check()
    candidates: dict[tuple[str, int], tuple[str, str | None]] = {}
    skipped: list[str] = []
    rows = []
    for item in slices:
        name = (item.get("metadata") or {}).get("name", "?")
        if item.get("addressType") != rendering.address_type:
            continue  # the other family's slice for the same pods
        ports = item.get("ports") or []
        port = _port_number(rendering.port, ports)
        replay = None if rendering.replay_port is None else _port_number(rendering.replay_port, ports)
        endpoints = item.get("endpoints") or []
        if port is None or (rendering.replay_port is not None and replay is None):
            missing = rendering.port if port is None else rendering.replay_port
            if endpoints:
                skipped.append(f"slice {name}: no port {missing!r} ({len(endpoints)} endpoints left out)")
            continue
        for endpoint in endpoints:
            if not is_member(endpoint.get("conditions"), rendering.members):
                continue
            addresses = endpoint.get("addresses") or []
            if not addresses:
                continue
            ip = addresses[0]  # the API allows one address per endpoint; consumers use the first
            ref = endpoint.get("targetRef") or {}
            fields = {"pod": ref.get("name") or "", "namespace": ref.get("namespace") or "",
                      "ip": ip, "host": _host(ip), "hostname": endpoint.get("hostname") or "",
                      "node": endpoint.get("nodeName") or "", "zone": endpoint.get("zone") or ""}
            for rank in range(rendering.dp_size):
                values = {**fields, "dp_rank": rank, "port": port, "replay_port": replay}
                worker_id = rendering.id.format(**values)
                if not worker_id:
                    skipped.append(f"slice {name}: endpoint {ip} has an empty id under {rendering.id!r}")
                    break
                rows.append((worker_id, rank, rendering.endpoint.format(**values),
                             None if replay is None else rendering.replay_endpoint.format(**values)))
    for worker_id, rank, endpoint, replay in sorted(rows, key=lambda r: (r[0], r[1], r[2], r[3] or "")):
        key = (worker_id, rank)
        if key in candidates:
            if candidates[key] != (endpoint, replay):
                skipped.append(f"id {worker_id!r}: also at {endpoint}, kept {candidates[key][0]}")
            continue  # the same endpoint in two slices at once is one worker
        candidates[key] = (endpoint, replay)
    where = f" from the EndpointSlices of Service {service!r}" if service else ""
    lines = [f"# Rendered by kvmiss fleet-sync{where} (members: {rendering.members});",
             "# replaced by rename whenever they change: do not edit."]
    seen_endpoints: dict[str, str] = {}
    count = 0
    for (worker_id, rank), (endpoint, replay) in sorted(candidates.items()):
        subscribed = offset_endpoint(endpoint, rank)
        if subscribed in seen_endpoints:
            skipped.append(f"id {worker_id!r}: {subscribed} is already worker {seen_endpoints[subscribed]!r}")
            continue
        seen_endpoints[subscribed] = worker_id
        lines += ["", "[[workers]]", f"id = {toml_string(worker_id)}", f"endpoint = {toml_string(endpoint)}"]
        if replay is not None:
            lines.append(f"replay_endpoint = {toml_string(replay)}")
        if rendering.dp_size > 1:
            lines.append(f"dp_rank = {rank}")
        count += 1
    if not count:
        lines += ["", "workers = []"]
    text = "\n".join(lines) + "\n"
    parse_fleet_file(text, source="rendered fleet")  # never hand kvmiss a file it would refuse
    return Rendered(text, count, skipped)


def toml_string(value: str) -> str:
    """A TOML basic string: quote, backslash and control characters escaped."""
    out = ['"']
    for ch in value:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def write_fleet(path: str | os.PathLike, text: str) -> bool:
    """Replace ``path`` with ``text`` by rename (a temporary file in the same directory,
    fsynced first), so kvmiss never reads a half-written file. False when the file already
    holds exactly this text: an unchanged fleet is not rewritten (kvmiss dates a change by
    the file's ctime)."""
    path = Path(path)
    try:
        if path.read_text() == text:
            return False
    except (OSError, UnicodeDecodeError):
        pass
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return True


# --- the Kubernetes API -------------------------------------------------------------------


class ApiError(Exception):
    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class KubeApi:
    """Where the API server is and how to authenticate: in a pod, its service account."""

    server: str  # https://host:port
    namespace: str
    token_file: Path | None = SERVICE_ACCOUNT_DIR / "token"
    ca_file: Path | None = SERVICE_ACCOUNT_DIR / "ca.crt"

    @classmethod
    def in_cluster(cls, namespace: str | None = None) -> KubeApi:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise ApiError("not in a pod: KUBERNETES_SERVICE_HOST / KUBERNETES_SERVICE_PORT are unset "
                           "(give --api-server)")
        if namespace is None:
            namespace = (SERVICE_ACCOUNT_DIR / "namespace").read_text().strip()
        return cls(server=f"https://{_host(host)}:{port}", namespace=namespace)

    def headers(self) -> dict[str, str]:
        # Read at every request: the kubelet rotates a projected token in place.
        if self.token_file is None:
            return {}
        return {"Authorization": f"Bearer {self.token_file.read_text().strip()}"}

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.server.startswith("https://"):
            return None
        return ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)

    def slices_url(self, service: str, **params) -> str:
        query = urllib.parse.urlencode({"labelSelector": f"{SERVICE_NAME_LABEL}={service}", **params})
        return (f"{self.server.rstrip('/')}/apis/discovery.k8s.io/v1/namespaces/"
                f"{urllib.parse.quote(self.namespace)}/endpointslices?{query}")


@dataclass
class WatchSettings:
    settle_s: float = 0.2  # a burst of events is written once, this long after its last event
    watch_timeout_s: int = 240  # the server ends each watch after this; it is resumed at once
    backoff_max_s: float = 10.0


class SliceWatch:
    """The Service's slices as the API server last said, kept by list + watch; the file is
    written after a burst of changes settles. Errors never write: the last file stays."""

    def __init__(self, api: KubeApi, service: str, rendering: SliceRendering, output: str | os.PathLike,
                 settings: WatchSettings | None = None):
        rendering.check()
        self.api, self.service, self.rendering = api, service, rendering
        self.output = Path(output)
        self.settings = settings or WatchSettings()
        self.slices: dict[str, dict] = {}
        self.resource_version = ""
        self.writes = 0  # files written (a changed fleet)
        self.lists = 0  # full lists (the first, and after a watch expired or failed)
        self.rendered: Rendered | None = None

    def apply(self, event: dict) -> bool:
        """One watch event into the state; True when the slices changed."""
        kind, obj = event.get("type"), event.get("object") or {}
        meta = obj.get("metadata") or {}
        if meta.get("resourceVersion"):
            self.resource_version = meta["resourceVersion"]
        if kind == "BOOKMARK":
            return False
        if kind == "ERROR":
            raise ApiError(f"watch: {obj.get('message', obj)}", int(obj.get("code") or 0))
        name = meta.get("name")
        if name is None:
            return False
        if kind == "DELETED":
            return self.slices.pop(name, None) is not None
        self.slices[name] = obj
        return True

    def write(self) -> None:
        rendered = render_fleet([self.slices[n] for n in sorted(self.slices)], self.rendering,
                                service=self.service)
        for reason in rendered.skipped:
            if self.rendered is None or reason not in self.rendered.skipped:
                log.warning("fleet-sync: %s", reason)
        self.rendered = rendered
        if write_fleet(self.output, rendered.text):
            self.writes += 1
            log.info("fleet-sync: wrote %s: %d workers", self.output, rendered.workers)

    async def run(self, session, *, stop: asyncio.Event | None = None) -> None:
        """List, write, watch from the list's version; on an expired version (410) or any
        failure list again after a back-off. Runs until ``stop`` is set."""
        stop = stop or asyncio.Event()
        backoff, failing = 0.5, False
        while not stop.is_set():
            try:
                await self._list(session)
                self.write()
                if failing:
                    log.warning("fleet-sync: the API server answers again")
                failing, backoff = False, 0.5
                while not stop.is_set():
                    started = time.monotonic()
                    await self._watch_once(session, stop)
                    if time.monotonic() - started < 1.0:
                        # A watch the server (or a proxy) ends at once: no tight loop of requests.
                        await _sleep(stop, 1.0)
            except Exception as exc:  # aiohttp's errors, OSError, a bad answer, a refused render
                if isinstance(exc, ApiError) and exc.status == 410:
                    log.info("fleet-sync: watch version expired; listing again")
                    continue
                if not failing:
                    log.warning("fleet-sync: %s: %s; the last file stays, retrying", type(exc).__name__, exc)
                failing = True
                await _sleep(stop, backoff)
                backoff = min(backoff * 2, self.settings.backoff_max_s)

    async def _get(self, session, url: str, timeout: float):
        import aiohttp

        response = await session.get(url, headers=self.api.headers(), ssl=self.api.ssl_context(),
                                     timeout=aiohttp.ClientTimeout(total=None, sock_connect=10,
                                                                   sock_read=timeout))
        if response.status != 200:
            body = (await response.text())[:300]
            response.release()
            raise ApiError(f"GET {url.split('?')[0]}: HTTP {response.status}: {body}", response.status)
        return response

    async def _list(self, session) -> None:
        response = await self._get(session, self.api.slices_url(self.service), 30)
        async with response:
            body = await response.json(content_type=None)
        self.slices = {item["metadata"]["name"]: item for item in body.get("items") or []}
        self.resource_version = (body.get("metadata") or {}).get("resourceVersion", "")
        self.lists += 1

    async def _watch_once(self, session, stop: asyncio.Event) -> None:
        url = self.api.slices_url(self.service, watch="1", allowWatchBookmarks="true",
                                  resourceVersion=self.resource_version,
                                  timeoutSeconds=str(self.settings.watch_timeout_s))
        response = await self._get(session, url, self.settings.watch_timeout_s + 30)
        stopping = asyncio.ensure_future(stop.wait())
        read = None
        try:
            async with response:
                pending = False
                while True:
                    # One read outlives a settle time-out (never cancelled mid-line), and a stop
                    # ends the wait at once: the server may send nothing for minutes.
                    read = read or asyncio.ensure_future(response.content.readline())
                    done, _ = await asyncio.wait({read, stopping}, return_when=asyncio.FIRST_COMPLETED,
                                                 timeout=self.settings.settle_s if pending else None)
                    if stopping in done:
                        break
                    if read not in done:
                        self.write()  # the burst settled
                        pending = False
                        continue
                    line, read = read.result(), None
                    if not line:
                        break  # the server ended this watch (timeoutSeconds): resume from the version
                    if line.strip():
                        pending |= self.apply(json.loads(line))
                if pending:
                    self.write()
        finally:
            for task in (read, stopping):
                if task is not None and not task.done():
                    task.cancel()


async def _sleep(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass


async def watch(api: KubeApi, service: str, rendering: SliceRendering, output: str | os.PathLike,
                settings: WatchSettings | None = None, stop: asyncio.Event | None = None) -> SliceWatch:
    import aiohttp

    state = SliceWatch(api, service, rendering, output, settings)
    async with aiohttp.ClientSession() as session:
        await state.run(session, stop=stop)
    return state


def slices_of(document: dict | list) -> list[dict]:
    """The slices in ``kubectl get endpointslices -o json`` output (a List), one slice, or a
    JSON array of slices."""
    if isinstance(document, list):
        return document
    if document.get("kind") == "EndpointSlice":
        return [document]
    return list(document.get("items") or [])
