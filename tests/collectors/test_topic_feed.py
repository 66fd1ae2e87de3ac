"""[fleet.topics]: real SGLang 0.5.23 publishers (a port of vLLM's ZmqEventPublisher) whose PUB
connects out to the one SUB kvmiss binds, as llm-d deploys vLLM; a real `Subscriber` with a
`TopicFeed`, and the membership path a service runs (`TopicSource` -> `FleetMembers` ->
`Subscriber.change_fleet`). A worker joins with its first message and is followed from seq 0
of its ring; a reconnection on another connection is re-identified before anything more is
trusted; members = "listed" drops what no source lists, and a topic that does not fit is
counted, not applied."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time

import pytest
import zmq
from sglang_publisher import batch, close, publisher
from zmq_ports import free_port

from kvmiss.collectors.continuity import Apply, EpochUncertain, NewEpoch, StreamConfig
from kvmiss.collectors.fleet import Fleet
from kvmiss.collectors.membership import Desired, FleetMembers
from kvmiss.collectors.membership_topics import Announcements, TopicScheme, TopicSource
from kvmiss.collectors.subscriber import Subscriber
from kvmiss.collectors.topic_feed import TopicFeed
from kvmiss.schemas.config import ConfigError, FleetTopicsConfig, check_fleet_topics, parse_config

WAIT_S = 10.0
STREAMS = StreamConfig(tail_probe_interval_s=None)


class Sink:
    def __init__(self) -> None:
        self.applied: list[tuple[str, int, int]] = []  # (worker, epoch, seq)
        self.facts: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def __call__(self, worker: str, action) -> None:
        with self.lock:
            if isinstance(action, Apply):
                self.applied.append((worker, action.batch.epoch, action.batch.seq))
            else:
                self.facts.append((worker, action))

    def seqs(self, worker: str) -> list[int]:
        with self.lock:
            return [s for w, _, s in self.applied if w == worker]

    def facts_of(self, worker: str, kind) -> list:
        with self.lock:
            return [f for w, f in self.facts if w == worker and isinstance(f, kind)]


class Kvmiss:
    """The collector side of a service following [fleet.topics]: the Subscriber with its
    TopicFeed, and a thread doing what the service's FleetWatch does (poll, propose, apply)."""

    def __init__(self, members: str = "announced", **over):
        self.port = free_port()
        config = FleetTopicsConfig(bind=f"tcp://127.0.0.1:{self.port}", topic_template="kv@{pod}@{model}",
                                   id="{pod}", replay_endpoint="tcp://{pod}", members=members, **over)
        check_fleet_topics(config, "test")
        self.scheme = TopicScheme(config)
        self.sink = Sink()
        self.fleet = Fleet([], self.sink, config=STREAMS)
        self.announcements = Announcements(config.max_workers) if members == "announced" else None
        self.feed = TopicFeed(self.scheme, self.fleet, self.announcements)
        self.sub = Subscriber(self.fleet, topics=self.feed)
        self.members = FleetMembers()
        self.changes = []
        self._stop = threading.Event()
        self.sub.start()
        if self.announcements is not None:
            self.source = TopicSource(self.scheme, self.announcements)
            self._thread = threading.Thread(target=self._follow, daemon=True)
            self._thread.start()

    def _follow(self) -> None:
        while not self._stop.is_set():
            answer = asyncio.run(self.source.poll())
            if isinstance(answer, Desired):
                self.list_members(answer)
            time.sleep(0.05)

    def list_members(self, desired: Desired) -> None:
        change = self.members.propose("topic", desired, time.time())
        self.changes.append(change)
        self.sub.change_fleet(change)

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._stop.set()
        self.sub.shutdown()


class Engine:
    """One engine: the real publisher, connecting out to ``endpoint``, its replay ROUTER
    bound on its own port; its topic names it as llm-d's does (address and model)."""

    def __init__(self, endpoint: str, replay_port: int | None = None, model: str = "llama",
                 ts_base: float = 1000.0):
        self.ts_base = ts_base
        self.replay_port = replay_port or free_port()
        self.pod = f"127.0.0.1:{self.replay_port}"
        deadline = time.monotonic() + WAIT_S
        while True:  # a restarted engine rebinds its replay port once the old process let go
            try:
                self.pub = publisher(endpoint=endpoint, replay_endpoint=f"tcp://{self.pod}",
                                     topic=f"kv@{self.pod}@{model}", bind=False)
                break
            except zmq.ZMQError:
                assert time.monotonic() < deadline, f"replay port {self.replay_port} stays taken"
                time.sleep(0.1)
        self.published = 0

    def publish(self, n: int = 1) -> None:
        for _ in range(n):
            self.pub.publish(batch(self.ts_base + self.published, stored=[([self.published + 1], None)]))
            self.published += 1

    def close(self) -> None:
        close(self.pub)


def until(condition, what: str, engine: Engine | None = None):
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        if engine is not None:
            engine.publish()
        time.sleep(0.05)


@pytest.fixture
def made():
    things: list = []
    yield things
    for thing in reversed(things):
        thing.close()


def test_a_publisher_that_connects_out_joins_with_its_first_message_and_is_followed_from_seq_0(made):
    kvmiss = Kvmiss()
    made.append(kvmiss)
    a = Engine(kvmiss.endpoint)
    made.append(a)
    a.publish(5)  # sent before its connection carried anything: lost live, held in its ring
    until(lambda: len(kvmiss.sink.seqs(a.pod)) >= 8, "the worker's batches", a)
    b = Engine(kvmiss.endpoint, model="other-model")
    made.append(b)
    until(lambda: len(kvmiss.sink.seqs(b.pod)) >= 3, "the second worker's batches", b)

    joins = [spec for change in kvmiss.changes for spec in change.joined]
    assert [(s.id, s.replay_endpoint, s.endpoint, s.bind) for s in joins] == [
        (a.pod, f"tcp://{a.pod}", kvmiss.endpoint, True), (b.pod, f"tcp://{b.pod}", kvmiss.endpoint, True)]
    for engine in (a, b):  # every batch from seq 0, once, in order: the ring filled what was lost
        seqs = kvmiss.sink.seqs(engine.pod)
        assert seqs == list(range(len(seqs)))
    assert kvmiss.sub.connection(a.pod) == "connected"
    assert not any(change.departed for change in kvmiss.changes)  # nothing ever departs by itself


class Relay:
    """A TCP relay the test opens when it chooses: until then the publisher cannot connect,
    and what it publishes is lost (no subscriber) while its ring keeps it."""

    def __init__(self, upstream_port: int):
        self.port = free_port()
        self.upstream = upstream_port
        self._socks: list[socket.socket] = []
        self._listener: socket.socket | None = None

    def open(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            self._socks += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        for s in self._socks:
            s.close()


def test_a_new_process_behind_the_same_topic_whose_first_seq_runs_on_is_caught_on_its_new_connection(made):
    """The publisher restarts under the same topic and replay port; its first batches are lost
    while it connects, so the first one kvmiss reads continues the old sequence. Only the new
    connection tells: the stream re-reads its last applied batch through replay, finds other
    bytes there, and starts a new, uncertain epoch instead of crediting the new process's
    batches to the old one."""
    kvmiss = Kvmiss()
    made.append(kvmiss)
    a = Engine(kvmiss.endpoint)
    made.append(a)
    until(lambda: len(kvmiss.sink.seqs(a.pod)) >= 3, "the first process's batches", a)
    last = kvmiss.sink.seqs(a.pod)[-1]
    a.close()
    made.remove(a)

    relay = Relay(kvmiss.port)
    made.append(relay)
    again = Engine(f"tcp://127.0.0.1:{relay.port}", replay_port=a.replay_port,  # the same pod and topic
                   ts_base=2000.0)  # (later: its batches are other bytes at the same seqs)
    made.append(again)
    again.publish(last + 4)  # no connection yet: lost live, kept in the new ring
    relay.open()
    before = len(kvmiss.sink.seqs(a.pod))
    until(lambda: kvmiss.sink.facts_of(a.pod, (EpochUncertain, NewEpoch)), "the new process to be noticed", again)
    facts = kvmiss.sink.facts_of(a.pod, (EpochUncertain, NewEpoch))
    assert facts, "the reconnection must not pass as the same process"
    # Nothing the new process published was applied as the old process's continuation.
    with kvmiss.sink.lock:
        old_epoch = kvmiss.sink.applied[0][1]
        after_old = [s for w, e, s in kvmiss.sink.applied[before:] if w == a.pod and e == old_epoch]
    assert after_old == []


def test_listed_members_only_and_a_topic_that_does_not_fit_is_counted_not_applied(made):
    kvmiss = Kvmiss(members="listed")
    made.append(kvmiss)
    a, b = Engine(kvmiss.endpoint), Engine(kvmiss.endpoint)
    made += [a, b]
    kvmiss.list_members(Desired((kvmiss.scheme.spec(a.pod),)))  # a source lists a, not b
    until(lambda: len(kvmiss.sink.seqs(a.pod)) >= 3, "the listed worker's batches", a)
    until(lambda: kvmiss.feed.counts["unlisted"] >= 3, "the unlisted worker's messages to be dropped", b)
    assert kvmiss.sink.seqs(b.pod) == [] and b.pod not in kvmiss.fleet.streams

    odd = publisher(endpoint=kvmiss.endpoint, replay_endpoint=None, topic="kv@no-model-field", bind=False)
    try:
        deadline = time.monotonic() + WAIT_S
        while kvmiss.feed.counts["unmatched"] == 0:
            assert time.monotonic() < deadline, "a topic that does not fit was not counted"
            odd.publish(batch(1.0, stored=[([1], None)]))
            time.sleep(0.05)
    finally:
        close(odd)
    # Listed later: it is followed from seq 0 of its ring, what was dropped before included.
    kvmiss.list_members(Desired((kvmiss.scheme.spec(a.pod), kvmiss.scheme.spec(b.pod))))
    until(lambda: len(kvmiss.sink.seqs(b.pod)) >= 3, "the worker listed late", b)
    seqs = kvmiss.sink.seqs(b.pod)
    assert seqs == list(range(len(seqs)))


def test_the_topic_scheme_reads_ids_and_builds_specs():
    config = FleetTopicsConfig(bind="tcp://*:5557", topic_template="kv@{pod}@{model}", id="{pod}",
                               replay_endpoint="tcp://{pod}:5558")
    scheme = TopicScheme(config)
    assert scheme.subscription == "kv@"
    assert scheme.worker_of("kv@10.0.0.7@llama@v2") == "10.0.0.7"
    assert scheme.worker_of("kv-10.0.0.7") is None
    spec = scheme.spec("10.0.0.7")
    assert (spec.endpoint, spec.bind, spec.replay_endpoint, spec.topic) == (
        "tcp://*:5557", True, "tcp://10.0.0.7:5558", "kv@10.0.0.7@")
    assert scheme.feeds(spec)
    with_instance = TopicScheme(FleetTopicsConfig(bind="tcp://*:5557", topic_template="kv@{pod}@{instance}", id="{pod}"))
    assert with_instance.spec("p").topic_template == "kv@{pod}@{instance}"  # an instance change is a new epoch


@pytest.mark.parametrize("text, message", [
    ('bind = "tcp://*:5557"\ntopic_template = "kv@{pod}{model}"\nid = "{pod}"', "two fields need text between them"),
    ('bind = "tcp://*:5557"\ntopic_template = "kv@{pod}@{pod}"\nid = "{pod}"', "names a field twice"),
    ('bind = "tcp://*:5557"\ntopic_template = "kv-events"\nid = "{pod}"', "must have a field naming the worker"),
    ('bind = "tcp://*:5557"\ntopic_template = "kv@{pod}@{model}"\nid = "{ip}"', "fleet.topics.id: unknown field {ip}"),
    ('bind = "tcp://*:5557"\ntopic_template = "kv@{pod}@{model}"\nid = "{pod}"\nreplay_endpoint = "tcp://{model}:1"',
     "fleet.topics.replay_endpoint: unknown field {model}"),
    ('bind = "tcp://*:5557"\ntopic_template = "kv@{pod}@{model}"\nid = "{pod}"\nmembers = "listed"',
     'members = "listed" needs [fleet.dns] or fleet.file'),
    ('bind = "tcp://*:5557"\ntopic_template = "kv@{pod}@{model}"\nid = "{pod}"\nmembers = "everyone"',
     "fleet.topics.members"),
])
def test_a_bad_topics_section_is_refused_naming_the_key(text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config("[fleet.topics]\n" + text, source="kvmiss.toml")


def test_the_membership_band_need_not_cover_how_often_dns_is_asked():
    """A DNS change is dated by the interval between the answers (`DnsMembership.poll`), so
    the band covers only the router's lag and the clocks: a 5 s interval with the default band."""
    config = parse_config('[fleet.dns]\nname = "engines.ns.svc"\ninterval_s = 5.0\n', source="kvmiss.toml")
    assert (config.fleet.dns.interval_s, config.fleet.membership_uncertainty_s) == (5.0, 0.5)
    with pytest.raises(ConfigError, match=r"membership_uncertainty_s must be a finite number of seconds >= "):
        parse_config("[fleet]\npoll_interval_s = 0.5\nmembership_uncertainty_s = 0.2\n", source="kvmiss.toml")
