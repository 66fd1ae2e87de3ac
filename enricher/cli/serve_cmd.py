"""`kvmiss serve --config kvmiss.toml`: the enricher service (every key: docs/CONFIGURATION.md).

Flags override the file: ``--otlp-grpc``, ``--otlp-http``, ``--export``, ``--metrics``.
Runs until SIGINT or SIGTERM, then stops intake, judges what it holds, flushes the
exporters and exits. A bad configuration exits with status 2 and a message naming the key.
``--check`` validates the configuration (and the digest key source) without opening a
socket, prints what would run, and exits: 0 when it would start.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import signal
import sys
import time

import msgspec
import zmq

from kvmiss.schemas.config import ConfigError, load_config


class JsonLogFormatter(logging.Formatter):
    """Structured logs: one JSON object per record. kvmiss's messages carry counts, sequence
    numbers, worker ids and enum values only (tests/security checks no prompt material)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 6), "level": record.levelname, "logger": record.name,
               "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


# Shown under `kvmiss serve --help`: what it reads, in one schema line, and one example.
HELP_INPUT = """\
input:    --config FILE ('-': stdin): kvmiss.toml, from `kvmiss config example` (--list: every layout;
          `kvmiss config example full`: every key); spans over OTLP, KV events over ZeroMQ; the digest
          secret from the variable [privacy] digest_key_env names (KVMISS_DIGEST_KEY in the examples)
example:  kvmiss config example single > kvmiss.toml
          KVMISS_DIGEST_KEY=$(openssl rand -hex 16) kvmiss serve --config kvmiss.toml --check
"""

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True,
                        help="kvmiss.toml ('-': read it from stdin); start from `kvmiss config example`")
    parser.add_argument("--otlp-grpc", help="OTLP/gRPC listen address (overrides [otlp] grpc)")
    parser.add_argument("--otlp-http", help="OTLP/HTTP listen address (overrides [otlp] http)")
    parser.add_argument("--export", help="downstream OTLP endpoint (overrides [export] endpoint)")
    parser.add_argument("--metrics", help="metrics/health listen address (overrides [metrics] listen)")
    parser.add_argument("--check", action="store_true",
                        help="validate the configuration, print what would run, exit (0: it would start)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", choices=("text", "json"), default="text",
                        help="json: one object per line (ts, level, logger, msg) for log pipelines")
    parser.add_argument("--processes", type=int, default=1,
                        help="run N serve processes, each following the whole fleet; process i listens on "
                             "the configured ports + i (OTLP gRPC, HTTP, metrics) and writes [export] file, "
                             "journal and request_records with suffix .i: list all N in the Collector's trace-id "
                             "load balancer")
    parser.add_argument("--process-index", type=int, default=None, help=argparse.SUPPRESS)


def _with_overrides(config, args):
    otlp = msgspec.structs.replace(config.otlp, **{k: v for k, v in (
        ("grpc", args.otlp_grpc), ("http", args.otlp_http)) if v is not None})
    export = config.export if args.export is None else msgspec.structs.replace(config.export, endpoint=args.export)
    metrics = config.metrics if args.metrics is None else msgspec.structs.replace(config.metrics, listen=args.metrics)
    return msgspec.structs.replace(config, otlp=otlp, export=export, metrics=metrics)


def process_config(config, index: int):
    """The configuration of process ``index`` of a ``--processes`` group: every listen port
    moved up by ``index`` (port 0 stays 0: any free port), and its own export file, journal
    and request-records file, so no two processes share a port or a file."""
    from kvmiss.schemas.config import parse_listen_address

    if index == 0:
        return config

    def moved(address: str) -> str:
        if not address:
            return address  # that receiver is off
        host, port = parse_listen_address(address)
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{port + index if port else 0}"

    export = config.export
    return msgspec.structs.replace(
        config,
        otlp=msgspec.structs.replace(config.otlp, grpc=moved(config.otlp.grpc), http=moved(config.otlp.http)),
        metrics=msgspec.structs.replace(config.metrics, listen=moved(config.metrics.listen)),
        export=msgspec.structs.replace(export, file=export.file and f"{export.file}.{index}",
                                       journal=export.journal and f"{export.journal}.{index}",
                                       request_records=export.request_records and f"{export.request_records}.{index}"))


def _run_group(args: argparse.Namespace) -> int:
    """``--processes N``: N child serve processes; SIGINT/SIGTERM is passed to each (each
    judges what it holds and flushes). When one exits, the others are stopped too, so a
    supervisor restarts the group as a whole; the exit status is the worst child's."""
    import subprocess
    import time

    command = [sys.executable, "-m", "kvmiss.enricher.cli", "serve", "--config", args.config,
               "--log-level", args.log_level, "--log-format", args.log_format, "--processes", str(args.processes)]
    for flag, value in (("--otlp-grpc", args.otlp_grpc), ("--otlp-http", args.otlp_http),
                        ("--export", args.export), ("--metrics", args.metrics)):
        if value is not None:
            command += [flag, value]
    children = [subprocess.Popen(command + ["--process-index", str(i)]) for i in range(args.processes)]

    signalled: set[int] = set()

    def stop(*_):
        # Once per child: a second SIGTERM could arrive after its loop removed the handler
        # (while it flushes) and kill it mid-flush.
        for child in children:
            if child.poll() is None and child.pid not in signalled:
                signalled.add(child.pid)
                child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while all(child.poll() is None for child in children):
        time.sleep(0.2)
    stop()
    codes = [child.wait() for child in children]
    return max(codes, key=abs)


def _check(config, processes: int = 1) -> int:
    """What `serve` would run, from the validated config, and whether it would start: the
    destination writable, every listen port free (bound for a moment), every host resolved
    (a worker's that does not is a warning). Never prints the key."""
    from google.protobuf.internal import api_implementation

    from kvmiss.collectors.frames import READER_COMPILED
    from kvmiss.enricher.core.privacy import DigestKeyError, load_digest_key
    from kvmiss.enricher.core.residency_table import ACCELERATED
    from kvmiss.enricher.otlp.spans import WIRE_SCAN
    from kvmiss.enricher.service.preflight import Finding

    privacy = config.privacy
    if privacy.digest_key or privacy.digest_key_env:
        try:
            key = f"key id {load_digest_key(privacy.digest_key, privacy.digest_key_env).key_id}"
        except DigestKeyError as exc:
            print(f"kvmiss serve: privacy: {exc}", file=sys.stderr)
            return 2
    else:
        key = "none configured: a random key per process (digests will not match across restarts)"
    from kvmiss.enricher.otlp.exporter import build_exporters
    from kvmiss.enricher.service.preflight import export_findings, listen_findings, worker_findings

    findings = export_findings(config.export)
    for index in range(processes):
        findings += [f for f in listen_findings(process_config(config, index)) if f not in findings]
    findings += worker_findings(config.workers)
    if not any(f.fatal and f.key == "export.endpoint" for f in findings):
        try:  # the endpoint's TLS CA, as at start-up (the file is not opened here)
            build_exporters(msgspec.structs.replace(config.export, file=None))
        except (OSError, ValueError) as exc:
            key, _, message = str(exc).partition(": ")
            findings.append(Finding(key if key.startswith("export.") else "export", message or str(exc), fatal=True))
    fatal = [f for f in findings if f.fatal]
    for finding in fatal:
        print(f"kvmiss serve: {finding}", file=sys.stderr)
    if fatal:
        return 2
    export = " + ".join(filter(None, (config.export.endpoint, config.export.file))) or \
        "discard (spans are judged, counted and dropped)"
    records = config.export.request_records
    fleet = _resolved_fleet(config)
    if fleet is None:
        return 2
    lines = [
        f"otlp: grpc {config.otlp.grpc}, http {config.otlp.http}",
        f"export: {export}",
        f"request records: {records} (renamed to .old at {config.export.request_records_max_bytes / (1 << 20):g} MiB)"
        if records else "request records: off",
        f"metrics: {config.metrics.listen}",
        f"engine: {config.engine.hash_algo}, seed "
        f"{'unset (the engine default)' if config.engine.hash_seed is None else repr(config.engine.hash_seed)}, "
        f"block size {config.engine.block_size}",
        f"history: retention {config.history.retention_s:g} s, wait {config.history.wait_s:g} s",
        f"privacy: {key}",
        f"workers: {len(config.workers)}",
        *(f"  {w.id}: {w.sub_endpoint()} (replay {w.replay_address() or 'none'})" for w in config.workers),
        *fleet,
        *(f"warning: {f}" for f in findings),
        f"protobuf backend: {api_implementation.Type()}",
        f"residency table: {'compiled' if ACCELERATED else 'pure-Python reference model (slow)'}",
        f"OTLP wire path: {'compiled' if WIRE_SCAN else 'parsed messages only (slower)'}",
        f"KV-event reader: {'compiled' if READER_COMPILED else 'reference decoder only (slower)'}",
        "configuration OK",
    ]
    print("\n".join(lines))
    return 0


def _resolved_fleet(config) -> list[str] | None:
    """``--check``: each membership source's fleet as it resolves now, checked against the
    static workers as a running service would; None (printed) when one would be refused. A
    watched file that is not there yet is fine: it is followed once it appears."""
    from kvmiss.collectors.membership import Desired, FleetMembers, RefusalReason, build_sources

    members, lines = FleetMembers(config.workers), []
    lines.append(f"fleet: poll every {config.fleet.poll_interval_s:g} s, "
                 f"membership uncertainty {config.fleet.membership_uncertainty_s:g} s")
    for source in build_sources(config.fleet):
        answer = asyncio.run(source.poll())
        if isinstance(answer, Desired):
            answer = members.propose(source.name, answer, 0.0)
        engines = getattr(source, "check_lines", None)  # [fleet.engines]: what each engine answered
        if engines is not None and (config.fleet.engines is not None or source.engines):
            lines.append(f"fleet {source.name} {source.where}: {len(source.engines)} listed, "
                         f"{len(members.by_source.get(source.name, {}))} workers")
            lines += engines()
            if hasattr(answer, "reason"):
                print(f"kvmiss serve: fleet {source.name}: would be refused ({answer.reason.value}): {answer.detail}",
                      file=sys.stderr)
                return None
            continue
        if engines is not None:
            continue
        if answer is None:
            said = getattr(source, "last_answer", None)  # what a resolver was told, if it was
            what = "no answer yet" if said is None else f"{said.outcome.value} ({said.reason})"
            lines.append(f"fleet {source.name} {source.where}: {what}: 0 workers for now (asked again once running)")
        elif not hasattr(answer, "reason"):
            specs = members.by_source.get(source.name, {}).values()
            lines.append(f"fleet {source.name} {source.where}: {len(specs)} workers")
            lines += [f"  {w.id}: {w.sub_endpoint()} (replay {w.replay_address() or 'none'})" for w in specs]
        elif answer.reason is RefusalReason.MISSING:
            lines.append(f"fleet {source.name} {source.where}: not there yet (followed once it appears)")
        else:
            print(f"kvmiss serve: fleet {source.name}: would be refused ({answer.reason.value}): {answer.detail}",
                  file=sys.stderr)
            return None
    return lines


# The cyclic collector's thresholds for the serve process. Nearly every object kvmiss makes per
# span is freed by reference counting; the collector's frequent young collections and the full
# walks they cascade into (over every upb wrapper and pending assembly alive) were what set a
# batch's p99 added latency: paced p99 36-41 ms with the defaults (700, 10, 10), 16 ms with
# these (benchmarks/bench_serve.py, RESULTS "GC thresholds"); the soak keeps RSS flat with them.
GC_THRESHOLDS = (50_000, 20, 100)

# How long a thread waiting for the GIL waits before the holder is asked to drop it (CPython's
# default 5 ms). The event loop gives the GIL up at every syscall and must win it back from the
# collector thread each time: under a full ingest an HTTP answer (accept, read, write: dozens of
# syscalls) waited out the default interval each time, /healthz up to ~1 s
# (benchmarks/bench_ingest_serve.py --scrape-hz 20 --scrape-path /healthz).
SWITCH_INTERVAL_S = 0.001


async def _serve(config) -> None:
    from kvmiss.enricher.service.serve import Service

    service = Service(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await service.start()
    freeze_startup_objects()
    logging.getLogger("kvmiss.serve").info(
        "kvmiss serve: OTLP grpc :%s http :%s, metrics :%s",
        service.receivers.grpc_port, service.receivers.http_port, service.metrics_port)
    await stop.wait()
    log = logging.getLogger("kvmiss.serve")
    log.info("kvmiss serve: stopping (signal): intake closed, judging what is held, flushing the exporters")
    started = time.monotonic()
    await service.shutdown()
    stats = service.pipeline.stats
    log.info("kvmiss serve: stopped in %.1f s: %d spans received, %d handed to export, %d delivered, %d dropped",
             time.monotonic() - started, stats.spans_in, stats.spans_out,
             sum(q.sent_spans for q in service.queues), sum(q.dropped_total for q in service.queues))


def apply_process_policies() -> None:
    """The serve process's own settings (process-wide, so serve's, not the library's): the
    cyclic collector's thresholds, the GIL switch interval, the open-files limit. A benchmark
    that runs `Service` in its own process applies them too, to measure what serve runs."""
    gc.set_threshold(*GC_THRESHOLDS)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    _raise_open_files_limit()


def freeze_startup_objects() -> None:
    """Once the service has started: everything alive now (modules, the config, the service's
    own structures) lives as long as the process; frozen, the collector's full walks skip it
    (gc.freeze, CPython >= 3.7)."""
    gc.collect()
    gc.freeze()


def _raise_open_files_limit() -> None:
    """Every worker holds a few sockets (SUB, monitor, replay and probe DEALERs): lift the
    soft limit on open files to the hard one, so a large fleet does not run out of them."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16), hard))
    except (ImportError, ValueError, OSError):
        pass  # not on this platform, or not allowed: the default stays


def run(args: argparse.Namespace) -> int:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter() if args.log_format == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    if args.config == "-" and args.processes > 1 and not args.check:
        # Each process of a group reads the config itself; stdin can be read only once.
        print("kvmiss serve: --processes needs --config FILE, not '-'", file=sys.stderr)
        return 2
    try:
        config = _with_overrides(load_config(args.config), args)
    except ConfigError as exc:
        print(f"kvmiss serve: {exc}", file=sys.stderr)
        return 2
    if args.processes < 1:
        print("kvmiss serve: --processes must be >= 1", file=sys.stderr)
        return 2
    if args.check:
        return _check(config, args.processes)
    if args.processes > 1 and args.process_index is None:
        return _run_group(args)
    from kvmiss.enricher.service.preflight import export_findings, listen_findings

    config = process_config(config, args.process_index or 0)
    # A destination and every port before anything starts: nothing is left half-running.
    for finding in export_findings(config.export) + listen_findings(config):
        if finding.fatal:
            print(f"kvmiss serve: {finding}", file=sys.stderr)
            return 2
        logging.getLogger("kvmiss.serve").warning("%s", finding)
    apply_process_policies()
    from kvmiss.enricher.otlp.listener import ListenError

    try:
        asyncio.run(_serve(config))
    except ListenError as exc:  # a port in use: the key and the address, one line
        print(f"kvmiss serve: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError, zmq.ZMQError) as exc:  # a file that cannot be opened, a socket
        print(f"kvmiss serve: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - anything else is reported, never a traceback storm
        logging.getLogger("kvmiss.serve").exception("kvmiss serve failed")
        print(f"kvmiss serve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0
