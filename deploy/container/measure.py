"""The image's size and start-up times, as benchmarks/RESULTS.md records them.

    python3 deploy/container/measure.py [IMAGE] [--runs N]

Runs the image through `buildah run --isolation chroot` (a working container made from it, the
host's network) and reports medians over N runs: a bare `true` (what buildah itself costs),
`kvmiss --version`, `kvmiss --help`, and `kvmiss serve` with the image's own entrypoint,
command and config from process start to /healthz and to /readyz answering 200. Only the
standard library: it runs with any python3. Root, podman and buildah needed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=1) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def timed(args: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def serve_start(run: list[str], name: str, entry: list[str]) -> tuple[float, float]:
    """Seconds from starting the process to /healthz, then to /readyz, answering 200."""
    metrics, closed = free_port(), free_port()
    # Loopback: on the host's network 0.0.0.0 would open the host's interfaces. The export
    # destination is a closed port: nothing is sent during start-up.
    command = run + ["--env", "KVMISS_DIGEST_KEY=measure-startup-key-01", name, "--"] + entry + [
        "--export", f"http://127.0.0.1:{closed}", "--otlp-grpc", f"127.0.0.1:{free_port()}",
        "--otlp-http", f"127.0.0.1:{free_port()}", "--metrics", f"127.0.0.1:{metrics}"]
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    healthy = ready = None
    try:
        while ready is None:
            if proc.poll() is not None or time.perf_counter() - started > 60:
                raise RuntimeError(f"serve did not become ready (exit {proc.poll()})")
            if healthy is None and status(f"http://127.0.0.1:{metrics}/healthz") == 200:
                healthy = time.perf_counter() - started
            if healthy is not None and status(f"http://127.0.0.1:{metrics}/readyz") == 200:
                ready = time.perf_counter() - started
            time.sleep(0.01)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
    return healthy, ready


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("image", nargs="?", default="localhost/kvmiss:0.2.0")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    info = json.loads(subprocess.run(["podman", "image", "inspect", args.image], check=True,
                                     capture_output=True, text=True).stdout)[0]
    entry = info["Config"]["Entrypoint"] + info["Config"]["Cmd"]
    name = subprocess.run(["buildah", "from", "--pull-never", args.image], check=True,
                          capture_output=True, text=True).stdout.strip()
    buildah = ["buildah", "run", "--isolation", "chroot"]
    run = buildah + [name]
    try:
        venv = subprocess.run(run + ["--", "du", "-sm", "/opt/kvmiss"], check=True, capture_output=True,
                              text=True).stdout.split()[0]
        print(f"image {args.image}: {info['Size'] / 1e6:.0f} MB ({venv} MiB of it /opt/kvmiss), "
              f"{len(info['RootFS']['Layers'])} layers")
        rows = {
            "buildah run true": lambda: timed(run + ["--", "true"]),
            "kvmiss --version": lambda: timed(run + ["--", "kvmiss", "--version"]),
            "kvmiss --help": lambda: timed(run + ["--", "kvmiss", "--help"]),
        }
        timed(run + ["--", "kvmiss", "--version"])  # the page cache warm, as on a running node
        for label, measure in rows.items():
            values = [measure() for _ in range(args.runs)]
            print(f"{label:<28} median {statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f})")
        starts = [serve_start(buildah, name, entry) for _ in range(args.runs)]
        for label, values in (("serve: start to /healthz", [h for h, _ in starts]),
                              ("serve: start to /readyz", [r for _, r in starts])):
            print(f"{label:<28} median {statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f})")
    finally:
        subprocess.run(["buildah", "rm", name], capture_output=True)


if __name__ == "__main__":
    main()
