"""The kvmiss configuration file (TOML): one Struct tree, validated once at start-up.

Unknown keys and wrong types fail with the exact path (``workers[1].dp_rank: Expected
`int`, got `str```). Secrets never appear in errors or reprs. See
examples/kvmiss.toml for a commented example.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import string
import tomllib
from pathlib import Path
from typing import Annotated, Literal, TypeVar

import msgspec

from kvmiss.schemas.engine_sources import (
    EngineDnsConfig,
    EngineEntry,
    FleetEnginesConfig,
    check_engine_entries,
    check_fleet_engines,
)
from kvmiss.schemas.span_attributes import InputNames

# The engines a worker may name (`WorkerSpec.engine`): each has its adapter in
# collectors/engines (which checks that both lists agree).
ENGINES = ("vllm", "sglang", "trtllm", "atom")
# Engines whose ranks also suffix an ``ipc://`` endpoint with ``_dp<rank>`` (vLLM, SGLang: inproc only).
IPC_RANK_SUFFIX = frozenset({"trtllm", "atom"})


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One engine event stream: (endpoint, dp_rank), with a stable id from the config.

    ``endpoint`` / ``replay_endpoint`` are given as the engine was configured; like vLLM and
    SGLang, the port is offset by ``dp_rank`` (``offset_by_rank``) so a config can be copied
    from the engine's. ``bind``: the publisher connects out, so kvmiss binds the SUB.
    """

    id: str
    endpoint: str
    replay_endpoint: str | None = None
    dp_rank: int = 0
    topic: str = ""  # SUB prefix filter
    topic_template: str | None = None  # e.g. "kv@{instance}@{model}"
    bind: bool = False
    offset_by_rank: bool = True
    # The engine's KV-cache pool in blocks (vLLM's start-up log: "GPU KV cache size" /
    # num_gpu_blocks), for what-if sizing (`kvmiss whatif`); 0: not given.
    pool_blocks: Annotated[int, msgspec.Meta(ge=0)] = 0
    engine: str = "vllm"  # which engine publishes: one of `ENGINES` (its wire adapter)

    def sub_endpoint(self) -> str:
        if not self.offset_by_rank:
            return self.endpoint
        return offset_endpoint(self.endpoint, self.dp_rank, ipc=self.engine in IPC_RANK_SUFFIX)

    def replay_address(self) -> str | None:
        if self.replay_endpoint is None:
            return None
        if not self.offset_by_rank:
            return self.replay_endpoint
        return offset_endpoint(self.replay_endpoint, self.dp_rank, ipc=self.engine in IPC_RANK_SUFFIX)


# At most 5 ASCII digits: a longer "port" is left as given (the socket refuses it at start-up)
# instead of overflowing int() -- and \d would also take non-ASCII digits.
_TCP_PORT = re.compile(r"^(?P<head>tcp://.*:)(?P<port>[0-9]{1,5})$")


def offset_endpoint(endpoint: str, dp_rank: int, *, ipc: bool = False) -> str:
    """The engines' data-parallel rule: tcp port + rank (port 0 unchanged), inproc gets
    a ``_dp<rank>`` suffix (ipc too with ``ipc``: `IPC_RANK_SUFFIX`), other transports unchanged."""
    if not dp_rank:
        return endpoint
    if endpoint.startswith("inproc://") or (ipc and endpoint.startswith("ipc://")):
        return f"{endpoint}_dp{dp_rank}"
    match = _TCP_PORT.match(endpoint)
    if match is None or match["port"] == "0":
        return endpoint
    return f"{match['head']}{int(match['port']) + dp_rank}"


# --- addresses: one home for the shapes kvmiss accepts ---------------------------------------

MAX_PORT = 65535


def parse_listen_address(address: str) -> tuple[str, int]:
    """``"host:port"``, ``"[::1]:port"``, ``":port"`` or ``"port"`` -> (host, port); a missing
    host means loopback (never all interfaces by accident). ValueError says what is wrong."""
    text = address.strip()
    host, sep, port = text.rpartition(":")
    if not sep and not text.isdigit():
        raise ValueError(f"{address!r} is not host:port (e.g. \"127.0.0.1:4317\", \"[::1]:4318\", \":9464\")")
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        raise ValueError(f"{address!r}: an IPv6 host goes in brackets, e.g. \"[::1]:4317\"")
    _check_port(port, address, allow_zero=True)
    return host.strip("[]") or "127.0.0.1", int(port)


def _check_port(port: str, where: str, *, allow_zero: bool) -> None:
    if not port.isascii() or not port.isdigit():
        raise ValueError(f"{where!r}: the port {port!r} is not a number" if port else f"{where!r} has no port")
    low = 0 if allow_zero else 1
    if len(port) > 5 or not low <= int(port) <= MAX_PORT:  # (5 digits first: int() of a huge one is slow, or refused)
        raise ValueError(f"{where[:80]!r}: port {port[:12]}{'...' if len(port) > 12 else ''} is outside {low}-{MAX_PORT}")


ENDPOINT_SCHEMES = ("tcp", "ipc", "inproc")


def check_zmq_endpoint(endpoint: str, *, bind: bool) -> str | None:
    """A ZeroMQ endpoint kvmiss connects to (or binds, ``bind``): ``tcp://host:port``,
    ``ipc://path`` or ``inproc://name``. Returns the host to resolve (tcp, connecting), or None;
    ValueError says what is wrong, as libzmq's own "Invalid argument" does not."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ENDPOINT_SCHEMES:
        raise ValueError(f"{endpoint!r} needs a scheme: tcp://host:port (or ipc://, inproc://)")
    if not rest:
        raise ValueError(f"{endpoint!r} names nothing after {scheme}://")
    if scheme != "tcp":
        return None
    host, sep, port = rest.rpartition(":")
    if not sep or not host or host in ("[]",):
        raise ValueError(f"{endpoint!r} has no port: tcp://host:port")
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        raise ValueError(f"{endpoint!r}: an IPv6 host goes in brackets, e.g. tcp://[::1]:5557")
    _check_port(port, endpoint, allow_zero=bind)
    if host == "*":
        if not bind:
            raise ValueError(f"{endpoint!r}: '*' (every interface) is for binding; name the engine's host")
        return None
    if ";" in host:  # libzmq's "source;destination" form
        host = host.rpartition(";")[2]
    return host.strip("[]")


HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]


MAX_CONNECTIONS_LIMIT = 1_000_000
MAX_FLEET_POLL_INTERVAL_S = 60.0  # above any file-descriptor limit; grpc takes a C int


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class OtlpConfig(_Section):
    grpc: str | None = "127.0.0.1:4317"  # OTLP/gRPC listen address; None/"" disables it
    http: str | None = "127.0.0.1:4318"  # OTLP/HTTP listen address
    max_body_bytes: int = 20 * 1024 * 1024  # after decompression
    max_pending_spans: int = 200_000  # beyond it: UNAVAILABLE / 503 with a retry delay
    max_spans_per_s: float = 0.0  # intake rate limit across both receivers (0: none); beyond
    # it senders get UNAVAILABLE / 503 with a retry delay, like a full buffer
    # The same per client (peer IP address, over both receivers; 0: none): one sender cannot
    # take the others' share. Beyond it: UNAVAILABLE / 429 with a retry delay.
    max_spans_per_s_per_client: float = 0.0
    max_connections: int = 256  # open connections per receiver (0: no cap); more are closed
    # OTLP/HTTP: open connections from one peer address (0: no cap), so one client cannot hold
    # every slot (a Collector uses a handful; its sending queue's consumers, 10 by default)
    max_connections_per_client: int = 64
    # OTLP/HTTP: seconds a request's body may take to arrive once its headers are in (a client
    # trickling it would hold a connection forever); beyond it: 503 + Retry-After, then closed.
    body_timeout_s: float = 30.0
    tls_cert: str | None = None  # PEM certificate chain: with tls_key, both receivers use TLS
    tls_key: str | None = None  # PEM private key


class ExportConfig(_Section):
    endpoint: str | None = None  # http(s)://host:port (OTLP/HTTP) or grpc://host:port
    file: str | None = None  # also write enriched spans as OTLP/JSON lines
    # No destination on purpose: spans are judged, counted and dropped. Without an endpoint or
    # a file kvmiss refuses to start unless this says so (a forgotten section loses nothing).
    discard: bool = False
    keep_block_hashes: bool = False
    timeout_s: float = 10.0
    tls_ca: str | None = None  # PEM CA bundle to verify https:// / grpcs:// (default: system)
    # A directory: the write-ahead journal of accepted request bodies (enricher/otlp/journal.py).
    # A body is on disk (fsync'd by group commit every journal_sync_interval_s) before the
    # sender gets its OK, and replayed after a crash until its spans are exported.
    journal: str | None = None
    journal_max_bytes: Annotated[int, msgspec.Meta(ge=1 << 20)] = 1 << 30  # beyond: UNAVAILABLE / 503
    # Group commit: one fsync covers every body written while the previous one ran; this is the
    # least time between two (0: as fast as the disk allows).
    journal_sync_interval_s: Annotated[float, msgspec.Meta(ge=0, le=0.05)] = 0.0
    # A file: one JSON line per judged request, the request records `kvmiss attribute` and
    # `kvmiss whatif` read (enricher/service/request_records.py). No token ids, extra keys,
    # salts or adapter paths are written; block hashes are.
    request_records: str | None = None
    # Before it would grow past this the file is renamed to <file>.old (replacing an older one):
    # at most twice this on disk.
    request_records_max_bytes: Annotated[int, msgspec.Meta(ge=1 << 20)] = 256 << 20


class EngineConfig(_Section):
    hash_algo: HashAlgo = "sha256"
    hash_seed: str | None = None  # the engines' PYTHONHASHSEED; None: the engine default
    block_size: int = 16
    extra_keys_format: Literal["tagged", "untagged"] = "tagged"


class PrivacyConfig(_Section):
    digest_key: str | None = None
    digest_key_env: str | None = None

    def __repr__(self) -> str:  # never print the secret
        return f"PrivacyConfig(digest_key={'<set>' if self.digest_key else None}, digest_key_env={self.digest_key_env!r})"


class MetricsConfig(_Section):
    listen: str | None = "127.0.0.1:9464"  # /metrics, /healthz, /readyz
    unknown_budget: float = 0.05  # the share of misses allowed to be unknown_*
    # /readyz fails while fewer than this share of the members' event streams are connected
    # (a member counts as unreachable once it has not connected for a few seconds). Half:
    # one engine down for maintenance keeps kvmiss ready, while a config whose endpoints are
    # all wrong, or a replica cut off from the fleet, never becomes ready (so a rollout stops).
    ready_min_connected_share: float = 0.5


class HistoryConfig(_Section):
    retention_s: float = 600.0  # exact records of closed residency intervals
    wait_s: float = 5.0  # how long a request waits for its worker's events to catch up
    assemble_wait_s: float = 10.0  # how long spans of one request are awaited
    aged_out_as_recent_match: bool = False
    # How long (engine time) the blocks whose records retention dropped are remembered, so
    # that a miss needing one answers "aged out" rather than "never stored". Past it they
    # are forgotten (bounded memory: ~3.6 bytes per eviction of this horizon) and an absent
    # block is "no recent match" over the window kvmiss still remembers.
    aged_out_horizon_s: float = 3600.0
    # Idle workers publish nothing. A worker's stream that has received nothing for this
    # long asks its replay endpoint whether anything follows its last batch (a tail probe);
    # "nothing" proves its history reaches the probe's time. 0 disables probing.
    tail_probe_interval_s: float = 0.5
    # Tail probes out at once across the fleet (each is a socket and a connection to a
    # publisher); a quiet fleet's probes beyond it wait their turn.
    tail_probes_in_flight: int = 64
    # Bound on how far kvmiss's clock (tail probes) and the engines' clocks (batch ts,
    # lookup times) may differ, either way.
    clock_skew_s: float = 0.25
    # Bound on how long after a cache lookup its engine step's batch reaches the publisher's
    # replay ring: the rest of the step (a long prefill chunk) plus the publisher's queue. A
    # probe answered sooner says nothing about that step. A confirmation sent at `at` proves
    # history through `at - clock_skew_s - publish_delay_s`.
    publish_delay_s: float = 1.0
    # How the bound is checked: each worker's smallest receive lag (kvmiss receive time
    # minus engine ts) over its live batches of the last this-many seconds (and at least
    # its last 16) estimates its clock offset; below -clock_skew_s, or above clock_skew_s +
    # publish_delay_s, every verdict relying on its timing is unknown_history (clock skew)
    # until it is back within. Longer: slower to notice a clock falling behind, and to
    # trust one that came back from running ahead; shorter: a long stall can flip it.
    clock_skew_window_s: float = 30.0
    # Whether requests may use vLLM's `kv_cache_report_mode: "full"` (0.32+), which
    # re-announces a reused chain as a BlockStored with no parent -- on the wire the same as
    # a recomputed second copy. "any" (default): no claim rests on such a store until the
    # request it was for says so (ATTRIBUTION.md rule 7). "incremental": the deployment
    # promises no request uses "full"; such a store is then a real copy and counted.
    kv_cache_report_mode: Literal["any", "incremental"] = "any"


class CollectorConfig(_Section):
    # ZMTP heartbeats on each worker's SUB socket: a PING every interval; no reply within the
    # timeout closes the connection and ZeroMQ reconnects (the publisher is asked to drop its
    # end after the same time). Without them a connection whose packets are silently dropped
    # (no RST: a firewall, a lost route, a dead host) is never noticed. 0 turns them off.
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 4.0


class FleetDnsConfig(_Section):
    """[fleet.dns]: engines found by re-resolving a name, as a Kubernetes headless Service
    answers with one address per ready pod (collectors/membership_dns.py)."""

    name: str  # e.g. "vllm-engines.serving.svc.cluster.local"
    interval_s: float = 1.0  # re-resolved this often
    timeout_s: float = 2.0  # one resolution's deadline (capped at interval_s)
    nameserver: str | None = None  # "host:port"; None: the system's (/etc/resolv.conf, search domains)
    record: Literal["A", "AAAA"] = "A"  # one family: a dual-stack pod is one engine, not two
    # Templates over {ip} (the address), {host} (the address as an endpoint takes it: [..] for
    # IPv6), {name} (the name above) and {dp_rank} (0 .. dp_size-1).
    endpoint: str = "tcp://{host}:5557"
    replay_endpoint: str | None = None  # e.g. "tcp://{host}:5558"
    id: str = "{name}-{ip}"  # must be what spans name as the worker
    dp_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1  # data-parallel ranks per address
    # An answer that the name has no addresses (NXDOMAIN, or no records of this type) departs
    # the members only once every answer for this long said so; failures (time-outs,
    # SERVFAIL, REFUSED, no route) never depart anyone (docs/FLEET.md).
    empty_grace_s: float = 30.0


class FleetTopicsConfig(_Section):
    """[fleet.topics]: publishers that connect out (as llm-d deploys vLLM) to one SUB kvmiss
    binds; a message's topic says whose it is (collectors/membership_topics.py)."""

    bind: str  # where kvmiss's SUB binds, e.g. "tcp://*:5557"; the engines' endpoint points here
    topic_template: str  # the engines' topic, e.g. "kv@{pod}@{model}"
    id: str  # the worker id, a template over the topic's fields, e.g. "{pod}" (what spans name)
    # The worker's replay endpoint, a template over the fields ``id`` uses, e.g. "tcp://{pod}:5558"
    replay_endpoint: str | None = None
    # Who the members are. "announced": a worker joins with its first message and departs only
    # when kvmiss is told (never by silence: see docs/FLEET.md). "listed": the members are the
    # workers [fleet.dns] resolves (or [fleet] file lists with this bind endpoint); a message
    # from a worker not listed is dropped and counted.
    members: Literal["announced", "listed"] = "announced"
    max_workers: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 1024  # "announced": beyond, refused


class FleetConfig(_Section):
    """Membership that changes while kvmiss runs (docs/FLEET.md). The static ``[[workers]]``
    are always members; a source adds its own workers, and no id may be listed twice."""

    # A TOML file of ``[[workers]]`` tables in the main config's form, re-read whenever it
    # changes (writers replace it by rename: a ConfigMap, a sidecar, a deploy tool).
    file: str | None = None
    poll_interval_s: float = 0.25  # how often sources are checked; a change applies within it
    # Bound on how far the router's switch may lie from the instant a source stamps a change
    # (the file's ctime, the poll that saw it), engine clock skew included: lookups this close
    # to a join or departure are uncertain. Replicas need no share of it (their intervals hold
    # the change). A router seen choosing a worker later than this after it left widens it.
    membership_uncertainty_s: float = 0.5
    dns: FleetDnsConfig | None = None  # [fleet.dns]
    topics: FleetTopicsConfig | None = None  # [fleet.topics]
    engines: FleetEnginesConfig | None = None  # [fleet.engines]: engines asked for their endpoints


class Config(_Section):
    otlp: OtlpConfig = msgspec.field(default_factory=OtlpConfig)
    export: ExportConfig = msgspec.field(default_factory=ExportConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    workers: list[WorkerSpec] = msgspec.field(default_factory=list)
    privacy: PrivacyConfig = msgspec.field(default_factory=PrivacyConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    history: HistoryConfig = msgspec.field(default_factory=HistoryConfig)
    collector: CollectorConfig = msgspec.field(default_factory=CollectorConfig)
    attributes: InputNames = msgspec.field(default_factory=InputNames)
    fleet: FleetConfig = msgspec.field(default_factory=FleetConfig)


class FleetFile(_Section):
    """A ``[fleet] file``: ``[[workers]]`` tables, nothing else."""

    workers: list[WorkerSpec] | None = None  # None: the key is missing (an empty file)
    engines: list[EngineEntry] | None = None  # engines asked for their endpoints ([fleet.engines])


# ZeroMQ carries the heartbeat TTL in tenths of a second in 16 bits.
MAX_HEARTBEAT_TIMEOUT_S = 6553.0


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the key. ``reason`` classifies it
    for a fleet file's refusal metric: not_toml, invalid, duplicate_id, duplicate_endpoint,
    empty, unreadable."""

    def __init__(self, message: str, reason: str = "invalid"):
        super().__init__(message)
        self.reason = reason


def _path_text(msg: str) -> str:
    # msgspec says "- at `$.workers[1].dp_rank`"; users think in TOML keys.
    return msg.replace("`$.", "`").replace("- at ", "at ")


_T = TypeVar("_T")


def _decode(text: str, kind: type[_T], source: str) -> _T:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}", "not_toml") from None
    except RecursionError:  # tomllib recurses into inline arrays and tables
        raise ConfigError(f"{source}: not valid TOML: nested too deeply", "not_toml") from None
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {_path_text(str(exc))}") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply") from None


def parse_config(text: str, *, source: str = "<config>") -> Config:
    config = _decode(text, Config, source)
    _check(config, source)
    return config


def parse_fleet_file(text: str, *, source: str = "<fleet file>") -> list[WorkerSpec]:
    """The workers of a ``[fleet] file``, under the same rules as the main config's
    ``[[workers]]``. A file without a ``workers`` key (empty: a writer that truncated it in
    place) is refused; ``workers = []`` is a fleet of none."""
    return parse_fleet_entries(text, source=source)[0]


def parse_fleet_entries(text: str, *, source: str = "<fleet file>") -> tuple[list[WorkerSpec], list[EngineEntry]]:
    """A ``[fleet] file``'s workers and the engines it lists to ask (``[[engines]]``); a file
    with neither key is refused as empty."""
    fleet = _decode(text, FleetFile, source)
    if fleet.workers is None and fleet.engines is None:
        raise ConfigError(f"{source}: no workers key (write `workers = []` for an empty fleet)", "empty")
    check_workers(fleet.workers or [], source)
    check_engine_entries(fleet.engines or [], source)
    return fleet.workers or [], fleet.engines or []


def load_config(path: str | os.PathLike[str]) -> Config:
    """The config in file ``path``; ``"-"``: read from stdin (`kvmiss config example | kvmiss serve --config -`)."""
    if str(path) == "-":
        import sys

        try:
            text = sys.stdin.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"<stdin>: cannot read: {exc}") from None
        return parse_config(text, source="<stdin>")
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    return parse_config(text, source=str(path))


def check_workers(workers: list[WorkerSpec], source: str) -> None:
    """The rules a list of workers keeps, wherever it comes from: unique ids, and no two
    workers on the same endpoint, rank and topic."""
    seen: set[str] = set()
    for i, worker in enumerate(workers):
        check_worker_endpoints(worker, f"{source}: workers[{i}] (id {worker.id!r})")
        if worker.engine not in ENGINES:
            raise ConfigError(f"{source}: workers[{i}] (id {worker.id!r}).engine: unknown engine "
                              f"{worker.engine!r}; engines: {', '.join(ENGINES)}")
        if worker.id in seen:
            raise ConfigError(f"{source}: workers: duplicate id {worker.id!r}", "duplicate_id")
        seen.add(worker.id)
    addresses = [(w.sub_endpoint(), w.topic) for w in workers]
    if len(set(addresses)) != len(addresses):
        raise ConfigError(f"{source}: workers: two workers subscribe to the same endpoint and rank",
                          "duplicate_endpoint")


def check_worker_endpoints(worker: WorkerSpec, where: str) -> None:
    """``endpoint`` and ``replay_endpoint`` as the worker's rank moves them: ConfigError naming
    ``where`` and the key."""
    for key, endpoint, bind in (("endpoint", worker.sub_endpoint(), worker.bind),
                                ("replay_endpoint", worker.replay_address(), False)):
        if endpoint is None:
            continue
        try:
            check_zmq_endpoint(endpoint, bind=bind)
        except ValueError as exc:
            moved = f" (dp_rank {worker.dp_rank} moves the port)" if worker.dp_rank and worker.offset_by_rank else ""
            raise ConfigError(f"{where}.{key}: {exc}{moved}") from None


LISTEN_KEYS = ("otlp.grpc", "otlp.http", "metrics.listen")


def listen_addresses(config: Config) -> dict[str, str]:
    """Every address kvmiss listens on, by key (the ones switched off are left out)."""
    values = (config.otlp.grpc, config.otlp.http, config.metrics.listen)
    return {key: value for key, value in zip(LISTEN_KEYS, values) if value}


def _check(config: Config, source: str) -> None:
    check_workers(config.workers, source)
    bound: dict[int, tuple[str, str]] = {}  # port -> (key, host) of the listeners so far
    for key, address in listen_addresses(config).items():
        try:
            host, port = parse_listen_address(address)
        except ValueError as exc:
            raise ConfigError(f"{source}: {key}: {exc}") from None
        other = bound.get(port) if port else None
        if other is not None and (other[1] == host or {other[1], host} & {"0.0.0.0", "::"}):
            raise ConfigError(f"{source}: {key}: {address} is also {other[0]}'s address: each listener needs its own port")
        bound[port] = (key, host)
    if config.export.discard and (config.export.endpoint or config.export.file):
        raise ConfigError(f"{source}: export.discard = true drops every span: it cannot go with "
                          "export.endpoint or export.file")
    if not 0.0 <= config.metrics.ready_min_connected_share <= 1.0:
        raise ConfigError(f"{source}: metrics.ready_min_connected_share must be between 0 and 1, "
                          f"got {config.metrics.ready_min_connected_share}")
    for name, value in (("otlp.max_body_bytes", config.otlp.max_body_bytes),
                        ("otlp.max_pending_spans", config.otlp.max_pending_spans),
                        ("export.timeout_s", config.export.timeout_s)):
        if not value > 0:
            raise ConfigError(f"{source}: {name} must be positive, got {value}")
    if not (math.isfinite(config.otlp.body_timeout_s) and config.otlp.body_timeout_s > 0):
        raise ConfigError(f"{source}: otlp.body_timeout_s must be a finite number of seconds > 0, "
                          f"got {config.otlp.body_timeout_s}")
    for name, value in (("otlp.max_spans_per_s", config.otlp.max_spans_per_s),
                        ("otlp.max_spans_per_s_per_client", config.otlp.max_spans_per_s_per_client)):
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{source}: {name} must be a finite number >= 0 (0: no limit), got {value}")
    for key in ("max_connections", "max_connections_per_client"):
        value = getattr(config.otlp, key)
        if not 0 <= value <= MAX_CONNECTIONS_LIMIT:
            raise ConfigError(f"{source}: otlp.{key} must be between 0 (no cap) and "
                              f"{MAX_CONNECTIONS_LIMIT}, got {value}")
    if bool(config.otlp.tls_cert) != bool(config.otlp.tls_key):
        raise ConfigError(f"{source}: otlp.tls_cert and otlp.tls_key go together")
    if config.engine.block_size <= 0:
        raise ConfigError(f"{source}: engine.block_size must be positive")
    if config.history.retention_s <= 0 or config.history.wait_s < 0:
        raise ConfigError(f"{source}: history.retention_s must be > 0 and wait_s >= 0")
    history = config.history
    if not history.aged_out_horizon_s > 0:
        raise ConfigError(f"{source}: history.aged_out_horizon_s must be > 0 (seconds of engine "
                          f"time the aged-out blocks are remembered), got {history.aged_out_horizon_s}")
    if history.tail_probe_interval_s < 0 or history.clock_skew_s < 0 or history.publish_delay_s < 0:
        raise ConfigError(f"{source}: history.tail_probe_interval_s, clock_skew_s and "
                          "publish_delay_s must be >= 0 (tail_probe_interval_s = 0 disables probes)")
    if history.tail_probes_in_flight < 1:
        raise ConfigError(f"{source}: history.tail_probes_in_flight must be >= 1 "
                          "(tail_probe_interval_s = 0 disables probes)")
    if not history.clock_skew_window_s > 0:
        raise ConfigError(f"{source}: history.clock_skew_window_s must be positive")
    collector = config.collector
    if not (math.isfinite(collector.heartbeat_interval_s) and 0 <= collector.heartbeat_interval_s <= 3600):
        raise ConfigError(f"{source}: collector.heartbeat_interval_s must be between 0 (off) and 3600 "
                          f"seconds, got {collector.heartbeat_interval_s}")
    if collector.heartbeat_interval_s and not (
            math.isfinite(collector.heartbeat_timeout_s)
            and collector.heartbeat_interval_s < collector.heartbeat_timeout_s <= MAX_HEARTBEAT_TIMEOUT_S):
        raise ConfigError(f"{source}: collector.heartbeat_timeout_s must be longer than heartbeat_interval_s "
                          f"and at most {MAX_HEARTBEAT_TIMEOUT_S:g} seconds, got {collector.heartbeat_timeout_s}")
    if config.privacy.digest_key and config.privacy.digest_key_env:
        raise ConfigError(f"{source}: privacy: set digest_key or digest_key_env, not both")
    fleet = config.fleet
    if fleet.file is not None and not fleet.file.strip():
        raise ConfigError(f"{source}: fleet.file must be a path (omit it for no watched file)")
    if not (math.isfinite(fleet.poll_interval_s) and 0 < fleet.poll_interval_s <= MAX_FLEET_POLL_INTERVAL_S):
        raise ConfigError(f"{source}: fleet.poll_interval_s must be > 0 and <= {MAX_FLEET_POLL_INTERVAL_S:g} "
                          f"seconds (a change applies within it), got {fleet.poll_interval_s}")
    if not (math.isfinite(fleet.membership_uncertainty_s) and fleet.membership_uncertainty_s >= fleet.poll_interval_s):
        raise ConfigError(f"{source}: fleet.membership_uncertainty_s must be a finite number of seconds >= "
                          f"fleet.poll_interval_s ({fleet.poll_interval_s:g}: one replica may see a change a "
                          f"whole poll later than another), got {fleet.membership_uncertainty_s}")
    if fleet.dns is not None:
        # (No floor from interval_s: a change is dated between two answers, however far apart.)
        check_fleet_dns(fleet.dns, source)
    if fleet.engines is not None:
        check_fleet_engines(fleet.engines, source, file=fleet.file is not None)
    if fleet.topics is not None:
        check_fleet_topics(fleet.topics, source)
        if fleet.topics.members == "listed" and fleet.dns is None and fleet.file is None:
            raise ConfigError(f"{source}: fleet.topics.members = \"listed\" needs [fleet.dns] or fleet.file "
                              "to list the members")


# --- [fleet.dns] and [fleet.topics] ---------------------------------------------------------

DNS_TEMPLATE_FIELDS = frozenset({"ip", "host", "name", "dp_rank"})


def template_fields(key: str, template: str, allowed: frozenset[str] | None = None) -> list[str]:
    """The ``{field}`` names of ``template`` in order; ConfigError naming ``key`` for bad braces,
    a positional or attribute field, or (with ``allowed``) an unknown one."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc} in {template!r}") from None
    for name in names:
        if not name.isidentifier():
            raise ConfigError(f"{key}: {{{name}}} in {template!r} is not a field name")
        if allowed is not None and name not in allowed:
            raise ConfigError(f"{key}: unknown field {{{name}}} in {template!r}; the fields are "
                              + ", ".join("{" + f + "}" for f in sorted(allowed)))
    return names


def parse_nameserver(text: str) -> tuple[str, int]:
    """"host:port" (host an IP address, IPv6 in brackets) -> (host, port); ValueError if not."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not host:port")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    ipaddress.ip_address(host)  # dnspython wants an address
    return host, int(port)


def check_name_resolution(dns: FleetDnsConfig | EngineDnsConfig, where: str) -> None:
    """The rules of a section that re-resolves a DNS name (``where``: e.g. "kvmiss.toml:
    fleet.dns"): its name, its interval, timeout and empty grace, its nameserver."""
    if not dns.name.strip(". "):
        raise ConfigError(f"{where}.name must be a DNS name")
    for key in ("interval_s", "timeout_s"):
        value = getattr(dns, key)
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{where}.{key} must be a finite number of seconds > 0, got {value}")
    if not (math.isfinite(dns.empty_grace_s) and dns.empty_grace_s >= 0):
        raise ConfigError(f"{where}.empty_grace_s must be a finite number of seconds >= 0, got {dns.empty_grace_s}")
    if dns.nameserver is not None:
        try:
            parse_nameserver(dns.nameserver)
        except ValueError:
            raise ConfigError(f"{where}.nameserver must be \"ip:port\" (IPv6 in brackets), "
                              f"got {dns.nameserver!r}") from None


def check_fleet_dns(dns: FleetDnsConfig, source: str) -> None:
    """[fleet.dns]'s own rules (the section's types are checked by msgspec)."""
    check_name_resolution(dns, f"{source}: fleet.dns")
    for key in ("endpoint", "replay_endpoint", "id"):
        template = getattr(dns, key)
        if template is not None:
            template_fields(f"{source}: fleet.dns.{key}", template, DNS_TEMPLATE_FIELDS)
    sample = {"ip": "192.0.2.1", "host": "192.0.2.1", "name": dns.name, "dp_rank": 0}
    for key in ("endpoint", "replay_endpoint"):
        template = getattr(dns, key)
        if template is not None:
            try:
                check_zmq_endpoint(template.format(**sample), bind=False)
            except ValueError as exc:
                raise ConfigError(f"{source}: fleet.dns.{key}: {exc} (rendered from {template!r})") from None
    if not {"ip", "host"} & set(template_fields("", dns.id)):
        raise ConfigError(f"{source}: fleet.dns.id must contain {{ip}} or {{host}}: one worker per address")
    if dns.dp_size > 1 and "dp_rank" not in template_fields("", dns.id):
        raise ConfigError(f"{source}: fleet.dns.id must contain {{dp_rank}} when dp_size > 1")


def check_fleet_topics(topics: FleetTopicsConfig, source: str) -> None:
    """[fleet.topics]'s own rules: fields named once each, ``id`` and ``replay_endpoint``
    over the topic's fields (the replay endpoint over ``id``'s alone, so a listed worker's is
    known before its first message)."""
    if not topics.bind.strip():
        raise ConfigError(f"{source}: fleet.topics.bind must be an endpoint, e.g. \"tcp://*:5557\"")
    try:
        check_zmq_endpoint(topics.bind, bind=True)
    except ValueError as exc:
        raise ConfigError(f"{source}: fleet.topics.bind: {exc}") from None
    fields = template_fields(f"{source}: fleet.topics.topic_template", topics.topic_template)
    if not fields:
        raise ConfigError(f"{source}: fleet.topics.topic_template must have a field naming the worker, "
                          "e.g. \"kv@{pod}@{model}\"")
    if len(set(fields)) != len(fields):
        raise ConfigError(f"{source}: fleet.topics.topic_template names a field twice: {topics.topic_template!r}")
    parts = list(string.Formatter().parse(topics.topic_template))
    if any(literal == "" and i > 0 for i, (literal, _, _, _) in enumerate(parts)):
        raise ConfigError(f"{source}: fleet.topics.topic_template: two fields need text between them "
                          f"(where would one end?): {topics.topic_template!r}")
    id_fields = template_fields(f"{source}: fleet.topics.id", topics.id, frozenset(fields))
    if not id_fields:
        raise ConfigError(f"{source}: fleet.topics.id must use a field of the topic, e.g. \"{{{fields[0]}}}\"")
    if topics.replay_endpoint is not None:
        template_fields(f"{source}: fleet.topics.replay_endpoint", topics.replay_endpoint, frozenset(id_fields))
