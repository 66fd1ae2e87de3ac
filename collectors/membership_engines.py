"""Fleet membership by asking the engines: each engine's HTTP server answers
``GET /kv_event_sources`` (vLLM 0.32+) with every data-parallel rank's bound event and replay
endpoints, and each rank is one worker with its endpoints as bound (docs/FLEET.md, "Engines
asked for their endpoints").

Which engines to ask is a list: ``[fleet.engines] urls``, the addresses of
``[fleet.engines.dns]`` (re-resolved, with [fleet.dns]'s answer rules), and a fleet file's
``[[engines]]``. An engine leaves the fleet only when it leaves that list. What an engine
answers decides its workers:

  * an answer: one worker per rank; a changed answer (a restart on new ports) is the same
    ids with new specs, which `diff_fleet` makes a departure and a join (a new stream, a new
    epoch);
  * no answer (refused connection, time-out, HTTP 5xx): says nothing about membership. Its
    last answered workers stay members -- their streams show unreachable if the engine is
    down, an unresolved holder (honest unknowns) -- because departing a worker that still
    serves would rule it out as a holder and could make a label wrong;
  * an answer kvmiss cannot use (not JSON, a missing field, a rank that is not a number, a
    multi-rank engine under an id without {dp_rank}): refused for that engine, counted by
    reason, logged once per distinct problem; its last good workers stay.

Asks run on the event loop as tasks (aiohttp, one connection each, bounded by ``timeout_s``),
started at one poll and read at a later one, so a slow engine delays no other source.
`read_answer` and `workers_for` are pure: the policy is tested without a server.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time
from collections.abc import Mapping

import msgspec

from kvmiss.collectors.membership import Desired, FileSource
from kvmiss.collectors.membership_dns import DnsMembership
from kvmiss.schemas.config import ConfigError, FleetDnsConfig, WorkerSpec, check_workers, check_zmq_endpoint
from kvmiss.schemas.engine_sources import FleetEnginesConfig, RankSource, id_fields

log = logging.getLogger("kvmiss.collectors")

SOURCE = "engines"
PATH = "/kv_event_sources"
MAX_ANSWER_BYTES = 1 << 20  # a rank's entry is ~250 bytes: room for thousands of ranks
WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")  # a fixed-port bind answers as configured: tcp://*:5557


class Outcome(str, enum.Enum):
    """How one ask ended: `kvmiss_fleet_engine_answers_total{outcome,reason}`."""

    ANSWERED = "answered"
    FAILED = "failed"  # no answer: nothing is known, nothing changes
    REFUSED = "refused"  # an answer kvmiss cannot use (``reason`` names why)


class Problem(str, enum.Enum):
    """Why an answer was refused."""

    HTTP_STATUS = "http_status"  # 4xx/3xx: 404 is a vLLM before 0.32, or not a vLLM
    TOO_LARGE = "too_large"
    INVALID_JSON = "invalid_json"
    UNKNOWN_SHAPE = "unknown_shape"  # not an object of ranks
    NO_SOURCES = "no_sources"  # {}: KV events are off (or a render-only server)
    UNKNOWN_RANK = "unknown_rank"  # a key that is not a rank number
    MISSING_FIELD = "missing_field"
    INVALID_FIELD = "invalid_field"
    EVENTS_OFF = "events_off"  # a rank whose publisher is "null"
    BAD_ENDPOINT = "bad_endpoint"  # not an endpoint kvmiss can connect to (inproc://, no port)
    ID_NEEDS_DP_RANK = "id_needs_dp_rank"  # several ranks, one id
    DUPLICATE = "duplicate"  # two ranks on one endpoint, or an id another engine has


class EngineAnswer(msgspec.Struct, frozen=True):
    outcome: Outcome
    ranks: dict[int, RankSource] = {}
    reason: str = ""  # FAILED: what went wrong; REFUSED: a `Problem` value
    detail: str = ""  # for the log and --check: a path or a key, never a secret


def refused(problem: Problem, detail: str) -> EngineAnswer:
    return EngineAnswer(Outcome.REFUSED, reason=problem.value, detail=detail)


def read_answer(status: int, body: bytes) -> EngineAnswer:
    """What an engine's HTTP reply says: its ranks, or why it cannot be used."""
    if status >= 500:
        return EngineAnswer(Outcome.FAILED, reason=f"HTTP {status}")
    if status != 200:
        return refused(Problem.HTTP_STATUS, f"HTTP {status}" + (" (no /kv_event_sources: vLLM before 0.32?)"
                                                                  if status == 404 else ""))
    if len(body) > MAX_ANSWER_BYTES:
        return refused(Problem.TOO_LARGE, f"more than {MAX_ANSWER_BYTES} bytes")
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        return refused(Problem.INVALID_JSON, str(exc)[:120])
    if not isinstance(raw, dict):
        return refused(Problem.UNKNOWN_SHAPE, f"a JSON {type(raw).__name__}, not an object of ranks")
    if not raw:
        return refused(Problem.NO_SOURCES, "no ranks: KV-cache events are off (--kv-events-config)")
    ranks = {}
    for key, value in raw.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 6):
            return refused(Problem.UNKNOWN_RANK, f"key {key[:40]!r} is not a rank number")
        try:
            source = msgspec.convert(value, RankSource)
        except msgspec.ValidationError as exc:
            text = str(exc).replace("`$", f"`$.{key}") if "`$" in str(exc) else f"{exc} - at `$.{key}`"
            missing = "missing required field" in text or not isinstance(value, dict)
            return refused(Problem.MISSING_FIELD if missing else Problem.INVALID_FIELD, text[:160])
        if not source.enable_kv_cache_events or source.publisher in ("null", None):
            return refused(Problem.EVENTS_OFF, f"rank {key}: publisher {source.publisher!r}")
        ranks[int(key)] = source
    return EngineAnswer(Outcome.ANSWERED, ranks=dict(sorted(ranks.items())))


def reachable(endpoint: str, url_host: str) -> str:
    """The endpoint as kvmiss connects to it: a wildcard host (a fixed port bound on every
    interface) is the engine URL's host. ValueError if kvmiss cannot connect to it."""
    scheme, sep, rest = endpoint.partition("://")
    if scheme == "inproc":
        raise ValueError(f"{endpoint!r} is inside the engine's process")
    if scheme == "tcp" and sep:
        host, _, port = rest.rpartition(":")
        if host in WILDCARD_HOSTS:
            endpoint = f"tcp://{url_host}:{port}"
    check_zmq_endpoint(endpoint, bind=False)
    return endpoint


def workers_for(url: str, id_template: str, answer: EngineAnswer) -> dict[str, WorkerSpec] | EngineAnswer:
    """The workers an answered engine stands for (id -> spec), or the refusal saying why not."""
    if len(answer.ranks) > 1 and "{dp_rank}" not in id_template:
        return refused(Problem.ID_NEEDS_DP_RANK, f"{len(answer.ranks)} ranks, one id {id_template!r}: "
                       "put {dp_rank} in the id")
    specs = {}
    for rank, source in answer.ranks.items():
        fields = id_fields(url, rank)
        try:
            endpoint = reachable(source.endpoint, str(fields["host"]))
            replay = None if source.replay_endpoint is None else reachable(source.replay_endpoint, str(fields["host"]))
        except ValueError as exc:
            return refused(Problem.BAD_ENDPOINT, f"rank {rank}: {exc}")
        spec = WorkerSpec(id=id_template.format(**fields), endpoint=endpoint, replay_endpoint=replay,
                          dp_rank=rank, topic=source.topic, offset_by_rank=False)
        specs[spec.id] = spec
    try:
        check_workers(list(specs.values()), url)
    except ConfigError as exc:
        return refused(Problem.DUPLICATE, str(exc))
    return specs


class _Engine:
    """One engine's asking state: its last good workers and the times that date a change."""

    def __init__(self, url: str, id_template: str, listed_at: float):
        self.url, self.id_template = url, id_template
        self.workers: dict[str, WorkerSpec] = {}
        self.last: EngineAnswer | None = None  # what the last ask got, for --check
        self.shown_since = listed_at  # start of the last ask whose answer matched `workers`
        self.change: tuple[float, float] | None = None  # (since, at) of a change not yet handed on
        self.failing: str | None = None  # the failure streak's reason, logged once
        self.logged: set[tuple[str, str]] = set()  # refusals logged (reason, detail)
        self.task: asyncio.Task | None = None
        self.next_ask = float("-inf")  # time.monotonic()


class EngineSource:
    """A `MembershipSource` (collectors/membership.py): the workers the listed engines
    answered for; see the module docstring. ``file``: the [fleet] file source, whose last good
    ``engines`` are asked too (it is polled before this one)."""

    name = SOURCE

    def __init__(self, config: FleetEnginesConfig, *, file: FileSource | None = None):
        self.config = config
        self.file = file
        self.engines: dict[str, _Engine] = {}
        self.outcomes: collections.Counter[tuple[str, str]] = collections.Counter()  # (outcome, reason)
        self._dns = None if config.dns is None else DnsMembership(FleetDnsConfig(
            name=config.dns.name, interval_s=config.dns.interval_s, timeout_s=config.dns.timeout_s,
            nameserver=config.dns.nameserver, record=config.dns.record, empty_grace_s=config.dns.empty_grace_s,
            endpoint="tcp://{host}:1", id="{ip}"))  # (only its addresses are used: one member per address)
        self._addresses: tuple[str, ...] = ()
        self._list_change: tuple[float, float] | None = None
        self._shown: dict[str, WorkerSpec] | None = None  # the set last handed on
        self._clashes: set[str] = set()
        self._polled = time.time()
        where = [f"{len(config.urls)} URL{'' if len(config.urls) == 1 else 's'}"] if config.urls else []
        if config.dns is not None:
            where.append(f"{config.dns.url} over {self._dns.where}")  # type: ignore[union-attr]
        if file is not None:
            where.append(f"[[engines]] of {file.path}")
        self.where = "(" + "; ".join(where or ["nothing listed"]) + f", each asked every {config.interval_s:g} s)"

    @property
    def known_through(self) -> float:
        """What this source has seen of the list: DNS's reach; a static list or the file is
        known at each poll. Engines' answers never hold it back (they change no membership)."""
        return self._dns.known_through if self._dns is not None else float("inf")

    def listed(self) -> dict[str, str]:
        """Engine URL -> id template, for every engine the lists name now."""
        out = dict.fromkeys(self.config.urls, self.config.id)
        if self.config.dns is not None:
            for ip in self._addresses:
                host = f"[{ip}]" if ":" in ip else ip
                out.setdefault(self.config.dns.url.format(ip=ip, host=host, name=self.config.dns.name.rstrip(".")),
                               self.config.id)
        for entry in getattr(self.file, "engines", ()):
            out.setdefault(entry.url, entry.id or self.config.id)
        return out

    async def poll(self) -> Desired | None:
        """The whole set of workers when an answer or the list changed it, else None; the
        first call waits for the first answers (at most ``timeout_s``)."""
        first, now, previous = self._shown is None, time.time(), self._polled
        self._polled = now
        if self._dns is not None:
            desired = await self._dns.poll()
            if desired is not None:
                self._addresses = tuple(sorted(spec.id for spec in desired.specs))
                self._list_change = (desired.since if desired.since is not None else previous,
                                     desired.at if desired.at is not None else now)
        listed = self.listed()
        for url in [u for u in self.engines if u not in listed]:
            engine = self.engines.pop(url)
            if engine.task is not None:
                engine.task.cancel()
            if engine.workers and self._list_change is None:
                self._list_change = (previous, now)
        for url, template in listed.items():
            engine = self.engines.get(url)
            if engine is None or engine.id_template != template:
                if engine is not None and engine.task is not None:
                    engine.task.cancel()
                self.engines[url] = _Engine(url, template, now)
        started = [self._ask_if_due(engine) for engine in self.engines.values()]
        if first and any(started):
            await asyncio.wait([e.task for e in self.engines.values() if e.task is not None])
        for engine in self.engines.values():
            if engine.task is not None and engine.task.done():
                (began, ended, answer), engine.task = engine.task.result(), None
                self._take(engine, answer, began, ended)
        return self._desired(first)

    def _ask_if_due(self, engine: _Engine) -> bool:
        mono = time.monotonic()
        if engine.task is not None or mono < engine.next_ask:
            return False
        engine.next_ask = mono + self.config.interval_s
        engine.task = asyncio.get_running_loop().create_task(self._timed_ask(engine.url), name="kvmiss-fleet-engine")
        return True

    def _take(self, engine: _Engine, answer: EngineAnswer, began: float, ended: float) -> None:
        """Apply one ask's ``answer`` to ``engine``: log, count, and maybe new workers."""
        got = workers_for(engine.url, engine.id_template, answer) if answer.outcome is Outcome.ANSWERED else answer
        if isinstance(got, EngineAnswer):
            answer = got
        engine.last = answer
        self.outcomes[(answer.outcome.value, answer.reason if answer.outcome is Outcome.REFUSED else "")] += 1
        if answer.outcome is Outcome.FAILED:
            if engine.failing is None:
                log.warning("fleet engines: %s does not answer (%s); its %d workers stay members until it "
                            "answers or leaves the list", engine.url, answer.reason, len(engine.workers))
            engine.failing = answer.reason
            return
        if engine.failing is not None:
            log.info("fleet engines: %s answers again", engine.url)
            engine.failing = None
        if isinstance(got, EngineAnswer):
            if (answer.reason, answer.detail) not in engine.logged:
                engine.logged.add((answer.reason, answer.detail))
                log.warning("fleet engines: %s: answer refused (%s): %s; its last good %d workers stay",
                            engine.url, answer.reason, answer.detail, len(engine.workers))
            return
        if got != engine.workers:
            log.info("fleet engines: %s answered %d ranks: %s", engine.url, len(got),
                     ", ".join(f"{s.dp_rank}={s.endpoint}" for s in got.values()))
            since, at = engine.shown_since, ended
            if engine.change is not None:  # (a change not yet handed on: the two are one)
                since, at = min(since, engine.change[0]), max(at, engine.change[1])
            engine.change = (since, at)
            engine.workers = got
        engine.shown_since = began

    def _desired(self, first: bool) -> Desired | None:
        workers: dict[str, WorkerSpec] = {}
        taken: dict[tuple[str, str], str] = {}  # (endpoint, topic) -> id
        for url, engine in sorted(self.engines.items()):
            clash = next((s.id for s in engine.workers.values()
                          if s.id in workers or (s.sub_endpoint(), s.topic) in taken), None)
            if clash is not None:
                if url not in self._clashes:  # an id template that gives two engines one id
                    self._clashes.add(url)
                    self.outcomes[(Outcome.REFUSED.value, Problem.DUPLICATE.value)] += 1
                    log.warning("fleet engines: %s: worker %r is another engine's id or endpoint; this engine's "
                                "workers are left out until that changes", url, clash)
                continue
            self._clashes.discard(url)
            for spec in engine.workers.values():
                workers[spec.id] = spec
                taken[(spec.sub_endpoint(), spec.topic)] = spec.id
        if not first and workers == self._shown:
            for engine in self.engines.values():
                engine.change = None
            self._list_change = None
            return None
        changes = [e.change for e in self.engines.values() if e.change is not None]
        if self._list_change is not None:
            changes.append(self._list_change)
        for engine in self.engines.values():
            engine.change = None
        self._list_change = None
        self._shown = workers
        if not changes:
            return Desired(tuple(workers.values()))
        return Desired(tuple(workers.values()), at=max(c[1] for c in changes), since=min(c[0] for c in changes))

    # --- I/O -------------------------------------------------------------------------------

    async def ask(self, url: str) -> EngineAnswer:
        """One ``GET <url>/kv_event_sources``, bounded by ``timeout_s``; never raises. A new
        connection each time: a restarted engine is never asked over a stale one."""
        import aiohttp

        limit = min(self.config.timeout_s, self.config.interval_s)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=limit)) as session:
                async with session.get(url.rstrip("/") + PATH, allow_redirects=False) as reply:
                    body = await reply.content.read(MAX_ANSWER_BYTES + 1)
                    return read_answer(reply.status, body)
        except TimeoutError:
            return EngineAnswer(Outcome.FAILED, reason=f"no answer within {limit:g} s")
        except aiohttp.ClientConnectorError as exc:
            return EngineAnswer(Outcome.FAILED, reason=f"cannot connect: {exc.os_error.strerror or exc.os_error}")
        except (aiohttp.ClientError, OSError) as exc:
            return EngineAnswer(Outcome.FAILED, reason=f"{type(exc).__name__}: {str(exc)[:120]}")

    async def _timed_ask(self, url: str) -> tuple[float, float, EngineAnswer]:
        began = time.time()
        answer = await self.ask(url)
        return began, time.time(), answer

    def check_lines(self) -> list[str]:
        """``serve --check``: what each engine answered, one line per engine and per worker."""
        lines = []
        for url, engine in sorted(self.engines.items()):
            said = engine.last
            if said is None:
                lines.append(f"  {url}: not asked yet")
            elif said.outcome is Outcome.FAILED:
                lines.append(f"  {url}: no answer ({said.reason}): asked again once running")
            elif said.outcome is Outcome.REFUSED:
                lines.append(f"  {url}: answer refused ({said.reason}): {said.detail}")
            else:
                lines.append(f"  {url}: {len(said.ranks)} ranks" + ("" if url not in self._clashes else
                                                                   ": left out (an id or endpoint clash)"))
            lines += [f"    {s.id} (rank {s.dp_rank}): {s.endpoint} (replay {s.replay_endpoint or 'none'})"
                      for s in engine.workers.values()]
        if self._dns is not None and self._dns.last_answer is not None and not self._addresses:
            said_dns = self._dns.last_answer
            lines.append(f"  {self.config.dns.name}: {said_dns.outcome.value} ({said_dns.reason})")  # type: ignore[union-attr]
        return lines

    def answers(self) -> Mapping[tuple[str, str], int]:
        return dict(self.outcomes)

    def close(self) -> None:
        for engine in self.engines.values():
            if engine.task is not None:
                engine.task.cancel()
        if self._dns is not None:
            self._dns.close()
