"""What the whole-process benchmarks share: ports, percentiles, a process's CPU and RSS from
/proc, an OTLP/HTTP sink server, and setting an OTLP attribute from a Python value.

Imported by bench_serve.py, bench_otlp_passthrough.py and soak.py (run from the repository
root: ``.venv/bin/python benchmarks/<script>.py``; the script's own folder is on sys.path).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable

from aiohttp import web

# Big enough for any batch a load generator sends (the sink must never be the limit).
SINK_MAX_BODY = 256 * 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (nearest rank on the sorted values); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu_s() -> dict[str, float]:
    """CPU seconds of the whole machine since boot, by state (/proc/stat): ``busy`` (user,
    nice, system, irq, softirq), ``steal`` (taken by the hypervisor for other guests: a
    shared VM's neighbours), ``idle`` (idle + iowait)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq, steal = (values + [0] * 8)[:8]
    return {"busy": (user + nice + system + irq + softirq) / tick, "steal": steal / tick, "idle": (idle + iowait) / tick}


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def start_sink(handler: Callable[[web.Request], Awaitable[web.Response]]) -> tuple[web.AppRunner, int]:
    """An OTLP/HTTP trace sink on a free loopback port: ``handler`` answers POST /v1/traces
    (aiohttp gunzips the body). Returns the runner (``await runner.cleanup()`` to stop)
    and the port."""
    app = web.Application(client_max_size=SINK_MAX_BODY)
    app.router.add_post("/v1/traces", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]


def set_attr(attributes, key: str, value) -> None:
    """Append one OTLP KeyValue to a repeated ``attributes`` field: str, bool, int, float,
    or a sequence of ints (an int array, as block-hash chains are sent)."""
    v = attributes.add(key=key).value
    if isinstance(value, str):
        v.string_value = value
    elif isinstance(value, bool):
        v.bool_value = value
    elif isinstance(value, int):
        v.int_value = value
    elif isinstance(value, float):
        v.double_value = value
    else:
        v.array_value.values.extend([type(v)(int_value=x) for x in value])
