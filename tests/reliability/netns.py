"""Two hosts on one machine: network namespaces joined by a veth pair, and the faults this
kernel can put on the wire between them.

    engine host (``engine_ns``)  10.77.0.1 ve ===== vk 10.77.0.2  (``kvmiss_ns``) kvmiss host

Each namespace is made with ``ip netns add`` under a name unique to this process and a
counter (parallel runs do not collide) and deleted whatever happens; the veth pair is made
inside them and goes with them. Processes run in one with ``prefix(ns) + argv``; code of this
process runs in one on a thread that entered it (`NetnsThread`: every socket that thread
opens, and every thread it starts, lives there). ZeroMQ opens its connections on its own I/O
threads, so ZeroMQ peers run as processes.

Faults, all on the engine host's side of the link, both directions unless said (``tc netem``
is not available in this kernel):

* `link_down` / `link_up`: ``ip link set ve down`` (its routes go; the peer loses carrier);
* `drop_all`: an nftables rule drops every packet in and out of ``ve``: connections stay
  open on both ends, nothing is reset (a half-open connection);
* `random_loss`: nftables ``numgen random mod 100 < pct`` drops, in and out;
* `rate_limit`: a ``tbf`` qdisc on ``ve`` (engine -> kvmiss), queueing delay under load;
* `clear`: everything above removed, the link up.

Needs root, ``ip`` (iproute2), ``nft`` (nftables) and ``tc``; `unavailable()` says which is
missing, in one line.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import itertools
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Sequence
from typing import TypeVar

from reliability_rig import Kvmiss, Metrics

ENGINE_ADDR, KVMISS_ADDR = "10.77.0.1", "10.77.0.2"
ENGINE_DEV, KVMISS_DEV = "ve", "vk"
_CLONE_NEWNET = 0x40000000
_NAMES = itertools.count()
T = TypeVar("T")


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=20)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (one line), or None."""
    if os.geteuid() != 0:
        return "network-namespace tests need root (ip netns, nft, tc)"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            return f"network-namespace tests need `{tool}` (Debian package {package})"
    name = f"kvmiss-probe-{os.getpid()}-{next(_NAMES)}"
    made = _run("ip", "netns", "add", name, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    try:
        table = _run("ip", "netns", "exec", name, "nft", "add", "table", "inet", "probe", check=False)
        if table.returncode != 0:
            return f"nftables does not work in a namespace: {table.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", name, check=False)
    return None


def _remove_stale() -> None:
    """Namespaces left by a run that was SIGKILLed (the pid in their name is gone): what that
    run started inside them is stopped, and they are deleted."""
    listing = _run("ip", "netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) == 4 and parts[0] == "kvmiss" and parts[1] == "nf" and parts[2].isdigit():
            if not os.path.exists(f"/proc/{parts[2]}"):
                for pid in _run("ip", "netns", "pids", name, check=False).stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                _run("ip", "netns", "del", name, check=False)


def _enter(ns: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
    finally:
        os.close(fd)


class NetnsThread:
    """One thread inside network namespace ``ns``; `call` runs a function on it."""

    def __init__(self, ns: str):
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"netns-{ns}",
                                                           initializer=_enter, initargs=(ns,))

    def call(self, fn: Callable[..., T], *args, timeout: float | None = 120, **kwargs) -> T:
        return self._pool.submit(fn, *args, **kwargs).result(timeout)

    def submit(self, fn: Callable[..., T], *args, **kwargs) -> concurrent.futures.Future:
        """Run ``fn`` on the thread without waiting (it has one thread: a long ``fn`` holds it)."""
        return self._pool.submit(fn, *args, **kwargs)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Link:
    """The two namespaces and the veth pair between them; `close()` deletes both."""

    def __init__(self) -> None:
        _remove_stale()
        tag = f"kvmiss-nf-{os.getpid()}-{next(_NAMES)}"
        self.engine_ns, self.kvmiss_ns = f"{tag}e", f"{tag}k"
        self._threads: dict[str, NetnsThread] = {}
        self._rate_limited = False
        try:
            for ns in (self.engine_ns, self.kvmiss_ns):
                _run("ip", "netns", "add", ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", self.engine_ns, "link", "add", ENGINE_DEV, "type", "veth",
                 "peer", "name", KVMISS_DEV, "netns", self.kvmiss_ns)
            for ns, dev, addr in ((self.engine_ns, ENGINE_DEV, ENGINE_ADDR),
                                  (self.kvmiss_ns, KVMISS_DEV, KVMISS_ADDR)):
                _run("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
            self._nft("add", "table", "inet", "kvmissfault")
            for chain, hook in (("in", "input"), ("out", "output")):
                self._nft("add", "chain", "inet", "kvmissfault", chain,
                          f"{{ type filter hook {hook} priority 0; policy accept; }}")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def prefix(ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def thread(self, ns: str) -> NetnsThread:
        if ns not in self._threads:
            self._threads[ns] = NetnsThread(ns)
        return self._threads[ns]

    # --- faults, on the engine side of the link -----------------------------------------

    def _nft(self, *args: str) -> None:
        _run(*self.prefix(self.engine_ns), "nft", *args)

    def _engine(self, *argv: str) -> None:
        _run("ip", "-n", self.engine_ns, *argv)

    def link_down(self) -> None:
        self._engine("link", "set", ENGINE_DEV, "down")

    def link_up(self) -> None:
        self._engine("link", "set", ENGINE_DEV, "up")

    def _drop(self, condition: Sequence[str]) -> None:
        for chain, direction in (("in", "iifname"), ("out", "oifname")):
            self._nft("add", "rule", "inet", "kvmissfault", chain, direction, ENGINE_DEV, *condition, "drop")

    def drop_all(self) -> None:
        self._drop(())

    def random_loss(self, percent: int) -> None:
        self._drop(("numgen", "random", "mod", "100", "<", str(percent)))

    def rate_limit(self, rate: str, burst: str = "3000", latency: str = "5s") -> None:
        """``tbf``: ``rate`` (e.g. "96kbit") with a queue of ``latency`` worth of it."""
        _run(*self.prefix(self.engine_ns), "tc", "qdisc", "replace", "dev", ENGINE_DEV, "root", "tbf",
             "rate", rate, "burst", burst, "latency", latency)
        self._rate_limited = True

    def clear(self) -> None:
        for chain in ("in", "out"):
            self._nft("flush", "chain", "inet", "kvmissfault", chain)
        if self._rate_limited:
            _run(*self.prefix(self.engine_ns), "tc", "qdisc", "del", "dev", ENGINE_DEV, "root", check=False)
            self._rate_limited = False
        self.link_up()

    def close(self) -> None:
        for thread in self._threads.values():
            thread.close()
        for ns in (self.engine_ns, self.kvmiss_ns):
            _run("ip", "netns", "del", ns, check=False)


class NetnsKvmiss(Kvmiss):
    """`Kvmiss` started under ``prefix`` in a namespace, its metrics read from ``thread`` (a
    `NetnsThread` inside it: its loopback is not this process's)."""

    def __init__(self, *args, thread: NetnsThread, **kwargs):
        self.thread = thread
        super().__init__(*args, **kwargs)

    def scrape(self) -> Metrics:
        return self.thread.call(Kvmiss.scrape, self)

    def ready(self) -> bool:
        return self.thread.call(Kvmiss.ready, self)
