"""Fleet membership from the publishers themselves ([fleet.topics]), as llm-d deploys vLLM:
every engine's PUB connects out to one SUB that kvmiss binds, and its topic
(``kv@{pod}@{model}``) says who it is. `TopicScheme` reads a topic into the worker it
belongs to and builds that worker's spec; `TopicSource` hands the workers that announced
themselves to the fleet, on the service's loop.

How a worker joins (members = "announced"): the collector thread reads a message whose topic
names a worker that is not a member. It announces the worker (`Announcements`) and holds its
messages (bounded) until the join comes back as a `FleetChange` -- through the same path as
every other source, so the index learns the join before any of its batches. The first
message is then its first connection: with a replay endpoint the stream asks for the whole
ring from seq 0 (what it published before kvmiss heard it), and the join rule of
docs/HISTORY.md decides from where it is followed.

How a worker departs: not by silence -- an idle engine publishes nothing, and a publisher
whose connection dropped comes back by itself. In "announced" mode an announced worker stays
a member (an unresolved holder while silent) until kvmiss restarts; in "listed" mode the
members are whoever [fleet.dns] resolves (or [fleet] file lists with this bind endpoint), and
that source says when one left. docs/FLEET.md explains the choice.

Pure but for `Announcements` (a lock: the collector thread writes, the loop reads).
"""

from __future__ import annotations

import re
import string
import threading

from kvmiss.collectors.membership import Desired
from kvmiss.schemas.config import FleetTopicsConfig, WorkerSpec

SOURCE = "topic"


def _pattern(template: str) -> re.Pattern[str]:
    """A template's fields as named groups; a field takes the shortest text that lets the
    rest match (``kv@{pod}@{model}`` reads ``kv@10.0.0.7:8000@llama@v2`` as pod
    ``10.0.0.7:8000``, model ``llama@v2``)."""
    regex = "".join(re.escape(literal) + (f"(?P<{name}>.+?)" if name is not None else "")
                    for literal, name, _, _ in string.Formatter().parse(template))
    return re.compile(regex, re.S)


class TopicScheme:
    """One [fleet.topics] section: topic -> worker id, worker id -> spec. Validated config
    only (`check_fleet_topics`)."""

    def __init__(self, config: FleetTopicsConfig):
        self.config = config
        self._topic = _pattern(config.topic_template)
        self._id = _pattern(config.id)
        self._id_fields = [n for _, n, _, _ in string.Formatter().parse(config.id) if n is not None]
        self._instance_template = config.topic_template if "{instance}" in config.topic_template else None

    def feeds(self, spec: WorkerSpec) -> bool:
        """Whether ``spec``'s events arrive on this section's SUB (not on a socket of its own)."""
        return spec.bind and spec.endpoint == self.config.bind

    def worker_of(self, topic: str) -> str | None:
        """The worker id ``topic`` names; None if it does not fit the template."""
        match = self._topic.fullmatch(topic)
        if match is None:
            return None
        return self.config.id.format(**match.groupdict())

    def spec(self, worker: str) -> WorkerSpec | None:
        """The spec of worker ``worker``; None if the id does not fit the ``id`` template."""
        match = self._id.fullmatch(worker)
        if match is None or self.config.id.format(**match.groupdict()) != worker:
            return None
        fields = match.groupdict()
        replay = self.config.replay_endpoint
        return WorkerSpec(
            id=worker, endpoint=self.config.bind, bind=True, offset_by_rank=False,
            replay_endpoint=None if replay is None else replay.format(**fields),
            topic=self._prefix(fields), topic_template=self._instance_template)

    def _prefix(self, fields: dict[str, str]) -> str:
        """The topic rendered up to its first field the id does not fix: a SUB prefix of this
        worker's messages, different for every worker (no two workers share an endpoint and
        topic in a fleet)."""
        out = []
        for literal, name, _, _ in string.Formatter().parse(self.config.topic_template):
            out.append(literal)
            if name is None:
                continue
            if name not in fields:
                break
            out.append(fields[name])
        return "".join(out)

    @property
    def subscription(self) -> str:
        """What the shared SUB subscribes to: the topic's text before its first field."""
        return next(iter(string.Formatter().parse(self.config.topic_template)))[0]


class Announcements:
    """Workers that announced themselves with a message: written by the collector thread,
    read by the loop's `TopicSource`. Bounded by ``max_workers``; beyond it a new worker is
    refused (counted)."""

    def __init__(self, max_workers: int):
        self.max_workers = max_workers
        self._lock = threading.Lock()
        self._specs: dict[str, WorkerSpec] = {}
        self._version = 0
        self.refused = 0  # new workers beyond max_workers

    def announce(self, spec: WorkerSpec) -> bool:
        """Collector thread: ``spec`` is heard from; False if it is refused (the cap)."""
        with self._lock:
            if spec.id in self._specs:
                return True
            if len(self._specs) >= self.max_workers:
                self.refused += 1
                return False
            self._specs[spec.id] = spec
            self._version += 1
            return True

    def snapshot(self) -> tuple[int, tuple[WorkerSpec, ...]]:
        with self._lock:
            return self._version, tuple(self._specs.values())


class TopicSource:
    """The `MembershipSource` of members = "announced": every worker that announced itself."""

    name = SOURCE

    def __init__(self, scheme: TopicScheme, announcements: Announcements):
        self.where = f"{scheme.config.topic_template} on {scheme.config.bind}"
        self.announcements = announcements
        self._seen = -1

    async def poll(self) -> Desired | None:
        version, specs = self.announcements.snapshot()
        if version == self._seen:
            return None
        self._seen = version
        return Desired(specs)
