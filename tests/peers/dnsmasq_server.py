"""A real DNS server on loopback for the [fleet.dns] tests: Debian's dnsmasq, answering from
a hosts file the test rewrites (SIGHUP makes it re-read), NXDOMAIN for any other name under
its zone. Absent dnsmasq, a test skips with one line naming the package, unless
KVMISS_REQUIRE_FLEET_PEERS=1 (CI's .ci/run installs it) says it must be there.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import dns.resolver
import pytest
from zmq_ports import free_port

ZONE = "kvmiss.test"


def dnsmasq_path() -> str:
    path = shutil.which("dnsmasq") or next(
        (p for p in ("/usr/sbin/dnsmasq", "/sbin/dnsmasq") if os.access(p, os.X_OK)), None)
    if path is None:
        if os.environ.get("KVMISS_REQUIRE_FLEET_PEERS") == "1":
            pytest.fail("dnsmasq is required (KVMISS_REQUIRE_FLEET_PEERS=1): apt-get install -y dnsmasq")
        pytest.skip("dnsmasq is not installed (Debian package dnsmasq): the [fleet.dns] tests need a real DNS server")
    return path


class Dnsmasq:
    """One dnsmasq process on 127.0.0.1:<port>; `set(name, addresses)` changes its answers."""

    def __init__(self, workdir: Path):
        self.binary = dnsmasq_path()
        self.hosts = workdir / "engines.hosts"
        self.hosts.write_text("")
        self.port = free_port()
        self.records: dict[str, list[str]] = {}
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--keep-in-foreground", "--conf-file=/dev/null", "--pid-file",
             f"--port={self.port}", "--listen-address=127.0.0.1", "--bind-interfaces",
             "--no-resolv", "--no-hosts", f"--addn-hosts={self.hosts}", f"--local=/{ZONE}/",
             "--cache-size=0", "--local-ttl=0", f"--user={getpass.getuser()}", "--log-facility=-"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._wait_answering()

    def _wait_answering(self) -> None:
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers, resolver.port = ["127.0.0.1"], self.port
        deadline = time.monotonic() + 10
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dnsmasq exited: {self.proc.stderr.read().decode(errors='replace')[-500:]}")
            try:
                resolver.resolve(f"probe.{ZONE}", "A", lifetime=0.5)
                return
            except dns.resolver.NXDOMAIN:
                return  # it answers
            except dns.exception.DNSException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def set(self, name: str, addresses: list[str]) -> None:
        """Make ``name`` resolve to ``addresses`` (none: NXDOMAIN), effective when this returns."""
        self.records[name] = list(addresses)
        lines = [f"{ip} {host}" for host, ips in self.records.items() for ip in ips]
        tmp = self.hosts.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in lines))
        tmp.replace(self.hosts)
        self.proc.send_signal(signal.SIGHUP)
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers, resolver.port = ["127.0.0.1"], self.port
        deadline = time.monotonic() + 10
        while True:  # SIGHUP is handled asynchronously: wait until the answer is the new one
            try:
                got = sorted(r.address for r in resolver.resolve(name, "A", lifetime=1))
            except dns.resolver.NXDOMAIN:
                got = []
            if got == sorted(addresses) or time.monotonic() > deadline:
                return
            time.sleep(0.02)

    def pause(self) -> None:
        """Stop answering (SIGSTOP): every query times out."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
