"""Fleet membership from DNS: a name re-resolved on an interval, one engine per address, as a
Kubernetes headless Service answers (one A/AAAA record per ready pod). The same idea as the
OpenTelemetry Collector's `loadbalancing` exporter `dns` resolver, with one difference in how
an answer without addresses is read (below).

What an answer means (docs/FLEET.md, "DNS"):
  * addresses: the fleet is exactly those addresses (times ``dp_size`` ranks); a changed set
    is handed on whole, and the fleet diffs it (`FleetMembers.propose`).
  * a failure (time-out, SERVFAIL, REFUSED, no route to the server, a malformed reply) says
    nothing about the engines: the last good membership stays, however long it lasts.
    Departing a worker that still serves would drop a holder from every later verdict (a
    wrong label); keeping one that left costs at most an honest unknown.
  * no addresses (NXDOMAIN, or the name exists without records of this type): an answer,
    but one DNS servers also give by mistake (CoreDNS before its first sync with the API
    server, a Service deleted and re-created). The members depart only once every answer for
    ``empty_grace_s`` said so; an answer with addresses in between ends the wait.

Resolution is asynchronous (dnspython's asyncio resolver): it never blocks the event loop,
and the collector thread never sees it. `DnsMembership.update` is pure: answers in, changes
out, so the policy is tested without a server; `resolve` talks to the real one.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time

import dns.asyncresolver
import dns.exception
import dns.resolver
import msgspec

from kvmiss.collectors.membership import Desired
from kvmiss.collectors.membership_topics import TopicScheme
from kvmiss.schemas.config import FleetDnsConfig, WorkerSpec, parse_nameserver

log = logging.getLogger("kvmiss.collectors")

SOURCE = "dns"


class Outcome(str, enum.Enum):
    """How one resolution ended, as `kvmiss_fleet_dns_resolutions{outcome}` counts it."""

    ADDRESSES = "addresses"
    EMPTY = "empty"  # NXDOMAIN, or no records of the type: an answer that there are none
    FAILED = "failed"  # no answer: time-out, SERVFAIL/REFUSED from every server, bad reply


class DnsAnswer(msgspec.Struct, frozen=True):
    outcome: Outcome
    addresses: tuple[str, ...] = ()
    reason: str = ""  # for FAILED and EMPTY: why, for the log (no addresses in it)


class DnsMembership:
    """The workers one name resolves to; see the module docstring.

    ``members`` is the current membership (worker id -> spec): what the last usable answer
    stood for. A `MembershipSource` (collectors/membership.py): the service polls it.
    """

    name = SOURCE

    def __init__(self, config: FleetDnsConfig, *, topics: TopicScheme | None = None,
                 resolver: dns.asyncresolver.Resolver | None = None):
        self.config = config
        # [fleet.topics] members = "listed": the name lists workers whose events come on the
        # topics SUB; each address gives an id (the ``id`` template), the topics section the rest.
        self.topics = topics
        self.members: dict[str, WorkerSpec] = {}
        self.outcomes: collections.Counter[Outcome] = collections.Counter()
        self.last_answer: DnsAnswer | None = None  # what the last resolution said (for --check)
        self._empty_since: float | None = None
        self._failing: str | None = None  # the reason of the current failure streak, logged once
        self._resolver = resolver if resolver is not None else _resolver(config)
        self._search = config.nameserver is None  # the system's search domains, as a pod resolves
        self.where = f"{config.name} ({config.record}, every {config.interval_s:g} s" + (
            f", server {config.nameserver})" if config.nameserver else ")")
        self._task: asyncio.Task | None = None  # the resolution out, if one is
        self._next = float("-inf")  # when the next one is due (time.monotonic)
        self._first = True
        self._unfit: set[str] = set()  # addresses whose id [fleet.topics] cannot read (logged)
        # The start (wall clock) of the last resolution answered (addresses or none): the name's
        # changes are seen through then. A failure moves nothing.
        self.known_through = float("-inf")
        # The start of the last resolution whose answer stood for `members`: a change of them
        # was made after it.
        self._shown_since: float | None = None

    # --- pure ------------------------------------------------------------------------------

    def specs_for(self, addresses: tuple[str, ...]) -> dict[str, WorkerSpec]:
        """The workers ``addresses`` stand for: one per address and data-parallel rank."""
        c = self.config
        name = c.name.rstrip(".")
        specs = {}
        for ip in sorted(set(addresses)):
            host = f"[{ip}]" if ":" in ip else ip
            for rank in range(c.dp_size):
                fields = {"ip": ip, "host": host, "name": name, "dp_rank": rank}
                if self.topics is not None:
                    spec = self.topics.spec(c.id.format(**fields))
                    if spec is None:
                        if ip not in self._unfit:  # once per address
                            self._unfit.add(ip)
                            log.warning("fleet: %s: id %r does not fit [fleet.topics] id %r; left out",
                                        c.name, c.id.format(**fields), self.topics.config.id)
                    else:
                        specs[spec.id] = spec
                    continue
                spec = WorkerSpec(
                    id=c.id.format(**fields), endpoint=c.endpoint.format(**fields),
                    replay_endpoint=None if c.replay_endpoint is None else c.replay_endpoint.format(**fields),
                    dp_rank=rank,
                    # The templates may name the rank's own port ({dp_rank}); if they do not,
                    # the engines' rule offsets it, as for a [[workers]] entry.
                    offset_by_rank="{dp_rank}" not in c.endpoint)
                specs[spec.id] = spec
        return specs

    def update(self, answer: DnsAnswer, now: float) -> tuple[WorkerSpec, ...] | None:
        """Apply one resolution's ``answer``, received at ``now`` (seconds, any steady clock):
        the whole new set of workers when it changed, else None."""
        self.outcomes[answer.outcome] += 1
        self.last_answer = answer
        if answer.outcome is Outcome.FAILED:
            if self._failing is None:
                log.warning("fleet: resolving %s failed (%s); the last good fleet of %d workers stays "
                            "until an answer comes", self.config.name, answer.reason, len(self.members))
            self._failing = answer.reason
            return None
        if self._failing is not None:
            log.info("fleet: %s resolves again", self.config.name)
            self._failing = None
        if answer.outcome is Outcome.EMPTY:
            if self._empty_since is None:
                self._empty_since = now
                if self.members:
                    log.warning("fleet: %s has no addresses (%s); its %d workers depart if it still has "
                                "none after %g s", self.config.name, answer.reason, len(self.members),
                                self.config.empty_grace_s)
            if now - self._empty_since < self.config.empty_grace_s:
                return None
            return self._become({})
        self._empty_since = None
        return self._become(self.specs_for(answer.addresses))

    def _become(self, specs: dict[str, WorkerSpec]) -> tuple[WorkerSpec, ...] | None:
        if specs == self.members:
            return None
        self.members = specs
        return tuple(specs.values())

    # --- I/O -------------------------------------------------------------------------------

    async def resolve(self) -> DnsAnswer:
        """One resolution, bounded by ``timeout_s`` (and ``interval_s``); never raises."""
        c = self.config
        try:
            answer = await self._resolver.resolve(
                c.name, c.record, lifetime=min(c.timeout_s, c.interval_s), search=self._search)
        except dns.resolver.NXDOMAIN:
            return DnsAnswer(Outcome.EMPTY, reason="NXDOMAIN")
        except dns.resolver.NoAnswer:
            return DnsAnswer(Outcome.EMPTY, reason=f"no {c.record} records")
        except dns.resolver.LifetimeTimeout:
            return DnsAnswer(Outcome.FAILED, reason=f"no answer within {min(c.timeout_s, c.interval_s):g} s")
        except dns.resolver.NoNameservers as exc:
            return DnsAnswer(Outcome.FAILED, reason=f"every server refused or failed ({_first_line(exc)})")
        except dns.exception.DNSException as exc:
            return DnsAnswer(Outcome.FAILED, reason=f"{type(exc).__name__}: {_first_line(exc)}")
        except OSError as exc:
            return DnsAnswer(Outcome.FAILED, reason=f"{type(exc).__name__}: {exc.strerror or exc}")
        return DnsAnswer(Outcome.ADDRESSES, tuple(rdata.address for rdata in answer))

    async def poll(self) -> Desired | None:
        """The source's answer (collectors/membership.py), asked every ``[fleet]
        poll_interval_s``: the whole set when a finished resolution changed it, else None.
        A resolution is started when ``interval_s`` has passed and none is out, and read at a
        later poll, so a slow server delays no other source. The first call waits for its
        resolution (at most ``timeout_s``): kvmiss starts with the fleet DNS has."""
        now = time.monotonic()
        if self._task is None and now >= self._next:
            self._next = now + self.config.interval_s
            self._task = asyncio.get_running_loop().create_task(self._timed_resolve(), name="kvmiss-fleet-dns")
            if self._first:
                self._first = False
                await asyncio.wait([self._task])
        if self._task is None or not self._task.done():
            return None
        (started, answered, answer), self._task = self._task.result(), None
        if answer.outcome is Outcome.FAILED:
            self.update(answer, time.monotonic())
            return None
        self.known_through = started
        specs = self.update(answer, time.monotonic())
        # A change was made after the last answer that still showed the old members, and by
        # the end of the one that shows it (the server answered so then).
        since = self._shown_since
        if answer.outcome is Outcome.ADDRESSES or not self.members:  # (an empty one in grace does not)
            self._shown_since = started
        return None if specs is None else Desired(specs, at=answered, since=since)

    async def _timed_resolve(self) -> tuple[float, float, DnsAnswer]:
        started = time.time()
        answer = await self.resolve()
        return started, time.time(), answer

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


def _resolver(config: FleetDnsConfig) -> dns.asyncresolver.Resolver:
    if config.nameserver is None:
        return dns.asyncresolver.Resolver()  # /etc/resolv.conf: servers, search domains, ndots
    host, port = parse_nameserver(config.nameserver)
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [host]
    resolver.port = port
    return resolver


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
