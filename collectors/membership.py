"""Where the fleet's members come from while kvmiss runs, and how a new answer becomes a
`FleetChange` (docs/FLEET.md).

A `MembershipSource` is asked, every ``[fleet] poll_interval_s``, for the workers it wants
now: `Desired` (the full set, not a delta), `Refusal` (its answer cannot be used: the last
good set stays) or None (nothing new since it was last asked). `FleetMembers` keeps each
source's last good set beside the static ``[[workers]]`` and turns a new one into a change
with `diff_fleet`; an id or endpoint another source already lists is refused, never
guessed between. Nothing here opens a socket or starts a thread: the service polls.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Iterable, Mapping
from typing import Protocol

import msgspec

from kvmiss.schemas.config import ConfigError, FleetConfig, WorkerSpec, check_workers, parse_fleet_entries
from kvmiss.schemas.engine_sources import EngineEntry, FleetEnginesConfig
from kvmiss.schemas.fleet import FleetChange

STATIC = "static"  # the main config's [[workers]]: members for the life of the process


class RefusalReason(str, enum.Enum):
    """Why an update was refused: `kvmiss_fleet_updates_refused_total{source,reason}`."""

    MISSING = "missing"  # the file is not there (yet)
    UNREADABLE = "unreadable"  # it is there but cannot be read
    EMPTY = "empty"  # no workers key at all: a writer that truncated it in place
    NOT_TOML = "not_toml"
    INVALID = "invalid"  # an unknown key, a wrong type, a bad value
    DUPLICATE_ID = "duplicate_id"  # one id twice in the source's own answer
    DUPLICATE_ENDPOINT = "duplicate_endpoint"  # two workers on one endpoint, rank and topic
    ID_CLASH = "id_clash"  # an id or endpoint another source already lists


class Desired(msgspec.Struct, frozen=True):
    """The whole set of workers a source wants now. ``at``: by when the fleet became this
    (kvmiss's wall clock, seconds), and ``since``: after when (its previous answer, which did
    not show it), where the source knows better than the poll that takes the answer -- a busy
    event loop takes it late, and a change stamped late leaves lookups between the router's
    switch and the band's start judged on the old fleet. None: the poll's own times."""

    specs: tuple[WorkerSpec, ...]
    at: float | None = None
    since: float | None = None


class Refusal(msgspec.Struct, frozen=True):
    """A source's answer that cannot be used; ``detail`` names the key or id, never a value
    that could be a secret."""

    reason: RefusalReason
    detail: str


class MembershipSource(Protocol):
    """One place members come from. ``name`` is its `FleetChange.source` and metric label
    ("file", "dns", "topic"); ``where`` says what it follows, for logs and ``serve --check``.

    `poll` runs on the service's event loop: it may await (a resolver), must not block it,
    and returns None when nothing changed since the last call, so a bad answer is refused
    (and logged) once, not at every poll. The first call always answers."""

    name: str
    where: str

    async def poll(self) -> Desired | Refusal | None: ...


def diff_fleet(current: Mapping[str, WorkerSpec], desired: Iterable[WorkerSpec], *,
               at: float, source: str, since: float | None = None) -> FleetChange:
    """What turns ``current`` (id -> spec) into ``desired``. A spec that changed under the
    same id (a new endpoint: another process) departs and joins again: a new stream."""
    wanted = {spec.id: spec for spec in desired}
    departed = tuple(sorted(i for i, spec in current.items() if wanted.get(i) != spec))
    joined = tuple(spec for i, spec in sorted(wanted.items()) if current.get(i) != spec)
    return FleetChange(at=at, since=since, source=source, joined=joined, departed=departed)


class FleetMembers:
    """Every source's last good set of workers, the static ``[[workers]]`` included."""

    def __init__(self, static: Iterable[WorkerSpec] = ()):
        self.by_source: dict[str, dict[str, WorkerSpec]] = {STATIC: {s.id: s for s in static}}

    def members(self) -> dict[str, WorkerSpec]:
        return {i: spec for specs in self.by_source.values() for i, spec in specs.items()}

    def propose(self, source: str, desired: Desired, at: float,
                since: float | None = None) -> FleetChange | Refusal:
        """Take ``source``'s new set if it keeps the fleet's rules: the change it makes (maybe
        empty), or a refusal that leaves everything as it was."""
        others = [spec for name, specs in self.by_source.items() if name != source for spec in specs.values()]
        owner = {i: name for name, specs in self.by_source.items() if name != source for i in specs}
        clash = next((s.id for s in desired.specs if s.id in owner), None)
        if clash is not None:
            return Refusal(RefusalReason.ID_CLASH, f"worker id {clash!r} is already listed by {owner[clash]}")
        try:
            check_workers(list(desired.specs), source)
        except ConfigError as exc:
            return Refusal(RefusalReason(exc.reason), str(exc))
        try:
            check_workers([*others, *desired.specs], source)
        except ConfigError:
            return Refusal(RefusalReason.ID_CLASH, f"{source}: a worker subscribes to the endpoint, rank and "
                                                   "topic of a worker another source lists")
        current = self.by_source.get(source, {})
        change = diff_fleet(current, desired.specs, at=at, source=source, since=since)
        self.by_source[source] = {spec.id: spec for spec in desired.specs}
        return change


class FileSource:
    """``[fleet] file``: a TOML file of ``[[workers]]`` tables, re-read when its identity
    changes -- device, inode, size, mtime or ctime. Writers replace it by rename (a new
    inode; a Kubernetes ConfigMap volume swaps a symlink, which `os.stat` follows), so a
    half-written file is never read; one rewritten in place is read again once it settles.

    A fleet read is stamped with the file's status-change time (ctime): when the rename (or
    write) made it visible. Unlike the modification time, no writer can set it, so a copy
    that keeps an old mtime (``cp -p``, ``rsync -t``) does not move the change into the past.
    The stamp is kept within [the previous poll, now]: the previous poll still saw the old
    file, and a network file system's clock may be ahead of kvmiss's."""

    name = "file"

    def __init__(self, path: str):
        self.where = self.path = path
        self._seen: tuple | None = None  # the identity of what was last read, or an error's
        self._polled = float("-inf")  # when (wall clock) the previous poll began
        self.engines: tuple[EngineEntry, ...] = ()  # the last good file's [[engines]] (asked by EngineSource)

    async def poll(self) -> Desired | Refusal | None:
        now, previous = time.time(), self._polled
        self._polled = now
        try:
            with open(self.path, "rb") as file:
                # The identity of what is read, not of whatever is at the path a moment later.
                st = os.fstat(file.fileno())
                seen = ("file", st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                if seen == self._seen:
                    return None
                data = file.read()
        except FileNotFoundError:
            return self._once(("missing",), Refusal(RefusalReason.MISSING, f"{self.path}: no such file"))
        except OSError as exc:
            return self._once(("unreadable", exc.errno), Refusal(
                RefusalReason.UNREADABLE, f"{self.path}: cannot read: {exc.strerror}"))
        self._seen = seen
        try:
            text = data.decode()
        except UnicodeDecodeError:
            return Refusal(RefusalReason.NOT_TOML, f"{self.path}: not valid TOML: not UTF-8")
        try:
            workers, engines = parse_fleet_entries(text, source=self.path)
        except ConfigError as exc:
            return Refusal(RefusalReason(exc.reason), str(exc))
        specs, self.engines = tuple(workers), tuple(engines)
        at = min(max(st.st_ctime_ns / 1e9, previous), now)
        return Desired(specs, at=at, since=at)

    def _once(self, seen: tuple, refusal: Refusal) -> Refusal | None:
        if seen == self._seen:
            return None
        self._seen = seen
        return refusal


def build_sources(config: FleetConfig, announcements=None) -> list[MembershipSource]:
    """The sources ``[fleet]`` names, in a fixed order (their changes apply in it).
    ``announcements``: where the collector thread reports workers that announced themselves
    on [fleet.topics] (members = "announced"); without it that source is left out."""
    from kvmiss.collectors.membership_dns import DnsMembership  # (they import this module)
    from kvmiss.collectors.membership_engines import EngineSource
    from kvmiss.collectors.membership_topics import TopicScheme, TopicSource

    sources: list[MembershipSource] = []
    file = None if config.file is None else FileSource(config.file)
    if file is not None:
        sources.append(file)
    topics = None if config.topics is None else TopicScheme(config.topics)
    if config.dns is not None:
        listed = topics is not None and config.topics.members == "listed"
        sources.append(DnsMembership(config.dns, topics=topics if listed else None))
    if topics is not None and config.topics.members == "announced" and announcements is not None:
        sources.append(TopicSource(topics, announcements))
    if config.engines is not None or file is not None:  # (after the file: it asks the file's [[engines]])
        sources.append(EngineSource(config.engines or FleetEnginesConfig(), file=file))
    return sources
