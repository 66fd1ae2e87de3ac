"""What `kvmiss serve --check` proves, and what start-up refuses: would this config start?

The config file's own rules (types, shapes, ranges) are `schemas.config`'s; these are the ones
that ask the machine: a destination for the spans, a directory that can be written, a port free
to bind, a host name that resolves. Each problem is a `Finding` naming the key; a fatal one stops
start-up (exit 2), a warning is printed or logged and start-up goes on (a name may resolve later,
an engine may start after kvmiss).
"""

from __future__ import annotations

import os
import socket
import urllib.parse
from dataclasses import dataclass

from kvmiss.enricher.otlp.listener import bind_problem
from kvmiss.schemas.config import (
    Config,
    ExportConfig,
    WorkerSpec,
    check_zmq_endpoint,
    listen_addresses,
    parse_listen_address,
)


@dataclass(frozen=True)
class Finding:
    key: str  # the config key (or worker) it is about
    message: str
    fatal: bool

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


EXPORT_SCHEMES = ("http", "https", "grpc", "grpcs")


def export_findings(export: ExportConfig, *, resolve: bool = True) -> list[Finding]:
    """Where enriched spans go: somewhere, or nowhere on purpose (``discard``)."""
    found: list[Finding] = []
    if not (export.endpoint or export.file or export.discard):
        found.append(Finding("export", "no destination for the enriched spans: set export.endpoint (your "
                             "Collector's OTLP receiver) or export.file, or discard = true to drop them on purpose",
                             fatal=True))
    if export.endpoint:
        found += _endpoint_findings(export.endpoint, resolve=resolve)
    for key, path in (("export.file", export.file), ("export.request_records", export.request_records)):
        if path:
            problem = file_problem(path)
            if problem is not None:
                found.append(Finding(key, problem, fatal=True))
    if export.journal:
        problem = directory_problem(export.journal)
        if problem is not None:
            found.append(Finding("export.journal", problem, fatal=True))
    return found


def _endpoint_findings(endpoint: str, *, resolve: bool) -> list[Finding]:
    parts = urllib.parse.urlsplit(endpoint)
    if parts.scheme not in EXPORT_SCHEMES:
        return [Finding("export.endpoint", f"{endpoint!r} must start with http://, https://, grpc:// or grpcs://",
                        fatal=True)]
    try:
        host, port = parts.hostname, parts.port
    except ValueError as exc:  # a port that is not a number or out of range
        return [Finding("export.endpoint", f"{endpoint!r}: {exc}", fatal=True)]
    if not host:
        return [Finding("export.endpoint", f"{endpoint!r} names no host", fatal=True)]
    if parts.scheme.startswith("grpc") and port is None:
        return [Finding("export.endpoint", f"{endpoint!r} needs a port (the Collector's OTLP/gRPC is 4317)",
                        fatal=True)]
    if parts.scheme.startswith("grpc") and parts.path not in ("", "/"):
        return [Finding("export.endpoint", f"{endpoint!r}: a gRPC endpoint is host:port, no path", fatal=True)]
    problem = resolve_problem(host) if resolve else None
    if problem is not None:
        return [Finding("export.endpoint", f"{problem}: spans are queued and retried until it does", fatal=False)]
    return []


def file_problem(path: str) -> str | None:
    """Why kvmiss could not append to ``path``, or None."""
    if os.path.isdir(path):
        return f"{path} is a directory, not a file"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else f"{path} is not writable by this user"
    return directory_problem(os.path.dirname(path) or ".", creating=os.path.basename(path))


def directory_problem(path: str, *, creating: str | None = None) -> str | None:
    what = f" (to create {creating} in it)" if creating else ""
    if not os.path.exists(path):
        if creating is not None:
            return f"directory {path} does not exist{what}"
        ancestor = os.path.dirname(os.path.abspath(path))  # kvmiss creates the directory and its parents
        while not os.path.exists(ancestor):
            ancestor = os.path.dirname(ancestor)
        if os.path.isdir(ancestor) and os.access(ancestor, os.W_OK | os.X_OK):
            return None
        return f"{path} cannot be created: {ancestor} is not a writable directory"
    if not os.path.isdir(path):
        return f"{path} is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"directory {path} is not writable by this user{what}"
    return None


def resolve_problem(host: str) -> str | None:
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"{host} does not resolve from here ({exc.strerror})"
    except UnicodeError:
        return f"{host!r} is not a host name"
    return None


def listen_findings(config: Config, *, port_offset: int = 0) -> list[Finding]:
    """Every listen address bound for a moment (its port moved by ``port_offset``, as process i
    of ``--processes`` moves it): a port in use is found before anything starts."""
    found = []
    for key, address in listen_addresses(config).items():
        host, port = parse_listen_address(address)
        port = port + port_offset if port else 0
        problem = bind_problem(host, port)
        if problem is not None:
            found.append(Finding(key, f"cannot listen on {host}:{port}: {problem}", fatal=True))
    return found


def worker_findings(workers: list[WorkerSpec]) -> list[Finding]:
    """Each worker's hosts resolved: a name that does not is a warning naming the worker (the
    engine may not be scheduled yet; kvmiss keeps trying and reports it unreachable)."""
    found = []
    for worker in workers:
        for key, endpoint, bind in (("endpoint", worker.sub_endpoint(), worker.bind),
                                    ("replay_endpoint", worker.replay_address(), False)):
            if endpoint is None:
                continue
            host = check_zmq_endpoint(endpoint, bind=bind)  # the config already holds it valid
            problem = resolve_problem(host) if host else None
            if problem is not None:
                found.append(Finding(f"worker {worker.id} {key}", f"{problem}: it will show as unreachable",
                                     fatal=False))
    return found
