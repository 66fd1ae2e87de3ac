"""Engines asked for their own KV-event endpoints: the ``[fleet.engines]`` section, a fleet
file's ``[[engines]]`` tables, and the answer of vLLM's ``GET /kv_event_sources`` (0.32+).

The answer maps each data-parallel rank (a JSON object key, "0", "1", ...) to vLLM's
``KVEventsConfig`` with the endpoints as the publisher bound them (``tcp://*:0`` becomes the
node's address and the port the OS picked). collectors/membership_engines.py asks; the rules
of the config live here beside its Structs (docs/FLEET.md, "Engines asked for their endpoints").
"""

from __future__ import annotations

import math
import urllib.parse
from typing import Literal

import msgspec

# Fields of the worker id template: the engine URL's host (IPv6 in brackets) and port, and the
# rank. What routers report as kvmiss.route.worker must render from these.
ID_FIELDS = frozenset({"host", "port", "dp_rank"})
DNS_URL_FIELDS = frozenset({"ip", "host", "name"})
DEFAULT_ID = "{host}:{port}"


class EngineDnsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[fleet.engines.dns]: the engines' HTTP Service by name, re-resolved as [fleet.dns] is
    (the same answer rules: a failure departs no one, no addresses only after the grace)."""

    name: str
    url: str = "http://{host}:8000"  # each address's base URL: a template over {ip} {host} {name}
    interval_s: float = 1.0
    timeout_s: float = 2.0
    nameserver: str | None = None  # "ip:port"; None: the system's
    record: Literal["A", "AAAA"] = "A"
    empty_grace_s: float = 30.0


class FleetEnginesConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """[fleet.engines]: engines asked for ``/kv_event_sources``; one worker per rank answered."""

    urls: list[str] = msgspec.field(default_factory=list)  # engines' HTTP base URLs
    id: str = DEFAULT_ID  # worker id per rank; {dp_rank} needed for an engine with several ranks
    interval_s: float = 2.0  # each engine asked again this often: a restart on new ports shows within it
    timeout_s: float = 1.0  # one ask's deadline (capped at interval_s)
    dns: EngineDnsConfig | None = None  # [fleet.engines.dns]


class EngineEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A fleet file's ``[[engines]]`` table: one engine to ask, with its own id template."""

    url: str
    id: str | None = None  # None: [fleet.engines] id


class RankSource(msgspec.Struct, frozen=True):
    """One rank's entry of a ``/kv_event_sources`` answer (vLLM's ``KVEventsConfig``; its other
    fields -- hwm, max_queue_size -- are read past)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    enable_kv_cache_events: bool = True
    publisher: str | None = "zmq"
    buffer_steps: int | None = None


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot be an engine's HTTP base URL, or None. Credentials in it are refused:
    they would be printed wherever the URL is."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - a port that is not a number, or out of range, raises here
    except ValueError as exc:
        return f"{url[:80]!r}: {exc}"
    if parts.scheme not in ("http", "https"):
        return f"{url[:80]!r} must start with http:// or https://"
    if not parts.hostname:
        return f"{url[:80]!r} names no host"
    if parts.username is not None or parts.password is not None:
        return "an engine URL must not carry credentials"
    if parts.query or parts.fragment:
        return f"{url[:80]!r}: a base URL has no query or fragment"
    return None


def id_fields(url: str, dp_rank: int) -> dict[str, object]:
    """The id template's fields for rank ``dp_rank`` of the engine at ``url`` (a valid URL)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return {"host": f"[{host}]" if ":" in host else host, "port": port, "dp_rank": dp_rank}


def check_fleet_engines(engines: FleetEnginesConfig, source: str, *, file: bool) -> None:
    """[fleet.engines]'s own rules; ``file``: a [fleet] file may list engines too."""
    from kvmiss.schemas.config import ConfigError, check_name_resolution, template_fields
    key = f"{source}: fleet.engines"
    if not engines.urls and engines.dns is None and not file:
        raise ConfigError(f"{key} lists no engines: set urls, [fleet.engines.dns] or a [fleet] file "
                          "with [[engines]]")
    for i, url in enumerate(engines.urls):
        problem = url_problem(url)
        if problem is not None:
            raise ConfigError(f"{key}.urls[{i}]: {problem}")
    if len(set(engines.urls)) != len(engines.urls):
        raise ConfigError(f"{key}.urls: an engine is listed twice")
    if "host" not in template_fields(f"{key}.id", engines.id, ID_FIELDS):
        raise ConfigError(f"{key}.id must contain {{host}}: one id per engine, e.g. \"{DEFAULT_ID}\"")
    for name in ("interval_s", "timeout_s"):
        value = getattr(engines, name)
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{key}.{name} must be a finite number of seconds > 0, got {value}")
    dns = engines.dns
    if dns is None:
        return
    check_name_resolution(dns, f"{key}.dns")
    if not {"ip", "host"} & set(template_fields(f"{key}.dns.url", dns.url, DNS_URL_FIELDS)):
        raise ConfigError(f"{key}.dns.url must contain {{ip}} or {{host}}: one engine per address")
    problem = url_problem(dns.url.format(ip="192.0.2.1", host="192.0.2.1", name=dns.name))
    if problem is not None:
        raise ConfigError(f"{key}.dns.url: {problem} (rendered from {dns.url!r})")


def check_engine_entries(entries: list[EngineEntry], source: str) -> None:
    """A fleet file's ``[[engines]]``: each URL valid and listed once, each id template over
    the id fields."""
    from kvmiss.schemas.config import ConfigError, template_fields

    seen: set[str] = set()
    for i, entry in enumerate(entries):
        problem = url_problem(entry.url)
        if problem is not None:
            raise ConfigError(f"{source}: engines[{i}].url: {problem}")
        if entry.url in seen:
            raise ConfigError(f"{source}: engines: {entry.url!r} is listed twice", "duplicate_endpoint")
        seen.add(entry.url)
        if entry.id is not None:
            template_fields(f"{source}: engines[{i}].id", entry.id, ID_FIELDS)
