"""The /metrics, /healthz and /readyz listener of `kvmiss serve`: a scraper's and a probe's
face of the service, apart from the service's own work.

It serves a scraper and a few probes: a small connection cap and short waits (Prometheus
scrapes every 15-60 s and reconnects when an idle connection was closed). Every route is a
GET: a body over `MAX_BODY_BYTES`, or one not in within `BODY_TIMEOUT_S`, is answered 413 /
408 and the connection closed.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, exposition as prom_text
from prometheus_client.openmetrics import exposition as openmetrics

from kvmiss.enricher.otlp.listener import (
    BodyRefused,
    ConnectionBounds,
    HttpListener,
    LimitLog,
    answer_and_close,
    listen_as,
    read_body,
)

log = logging.getLogger("kvmiss.serve")

BOUNDS = ConnectionBounds(max_connections=16, idle_s=15.0)
MAX_BODY_BYTES = 4096
BODY_TIMEOUT_S = 5.0


class HealthEndpoint:
    """``ready()``: (ready, detail by worker) -- the service's own rule (`Service.ready`)."""

    def __init__(self, registry: CollectorRegistry, ready: Callable[[], tuple[bool, dict[str, str]]],
                 detail: Callable[[], dict[str, dict]] | None = None):
        self.registry = registry
        self.ready = ready
        self.detail = detail  # per worker: endpoint, connection, cause (`Service.worker_status`)
        self.stats: collections.Counter[str] = collections.Counter()  # refused bodies, by reason
        self.listener: HttpListener | None = None
        self.port: int | None = None

    async def start(self, address: str) -> None:
        app = web.Application(middlewares=[self._refuse_bodies])
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        self.listener = HttpListener(
            app, BOUNDS, name="metrics endpoint", stats=self.stats,
            cap_hint="counted in kvmiss_metrics_http_connections_refused_total", warnings=LimitLog(log))
        await listen_as("metrics.listen", address, self.listener.start)
        self.port = self.listener.port

    async def shutdown(self) -> None:
        if self.listener is not None:
            await self.listener.shutdown()

    def counts(self) -> dict[str, int]:
        """Its own counters and open connections, for the metrics it serves."""
        return {**self.stats, "connections": self.listener.connections if self.listener is not None else 0}

    @web.middleware
    async def _refuse_bodies(self, request: web.Request, handler) -> web.StreamResponse:
        """Every route is a GET: a body is read (and dropped) only when small and prompt."""
        if request.body_exists:
            try:
                await read_body(request, limit=MAX_BODY_BYTES, timeout_s=BODY_TIMEOUT_S)
            except BodyRefused as refused:
                self.stats[f"requests_{refused.reason}"] += 1
                status = 413 if refused.reason == "too_large" else 408
                return await answer_and_close(request, web.Response(status=status, text=str(refused)))
        return await handler(request)

    async def _metrics(self, request: web.Request) -> web.Response:
        """The families are read here, on the service's loop (the state they read is its own);
        the text is written in a thread: with a 64-worker fleet, ~1,300 samples, writing took
        3-10 ms of the 5-13 ms a scrape held the loop (benchmarks/bench_fleet_churn.py)."""
        if "application/openmetrics-text" in request.headers.get("Accept", ""):
            write, ctype = openmetrics.generate_latest, openmetrics.CONTENT_TYPE_LATEST
        else:
            write, ctype = prom_text.generate_latest, prom_text.CONTENT_TYPE_LATEST
        families = _Families(list(self.registry.collect()))
        body = await asyncio.get_running_loop().run_in_executor(None, write, families)
        return web.Response(body=body, headers={"Content-Type": ctype})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        ready, states = self.ready()
        body = {"ready": ready, "workers": states}
        if self.detail is not None:
            body["detail"] = self.detail()
        return web.json_response(body, status=200 if ready else 503)


class _Families:
    """Metric families read at one moment, in the shape the writers take a registry in."""

    def __init__(self, families: list):
        self.families = families

    def collect(self):
        return iter(self.families)
