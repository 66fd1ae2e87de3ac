"""Offline attribution: a recording of KV events + request records -> attribution records;
and request records from OTLP span files.

The same path as the live service, minus the sockets and spans: the recording is played
through the per-worker state machines (collectors.fleet.play_recording), every applied
batch goes into a residency index that keeps every epoch, and each request record
(`RequestFacts` as one JSON object per line) is judged at its own lookup time.

`records_from_spans` makes those request records from spans kept in files (`kvmiss requests
--otlp`): the spans' facts read and joined by the pipeline's own rules, as `kvmiss serve`
writes them with ``[export] request_records``.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator
from typing import IO

import msgspec

from kvmiss.collectors.continuity import Apply
from kvmiss.collectors.fleet import DEALER, TICK, Fleet, play_recording
from kvmiss.collectors.recording import ReadStats, read_recording
from kvmiss.enricher.core.attribution import Attributor
from kvmiss.enricher.core.hashing import BlockHasher
from kvmiss.enricher.core.index import ResidencyIndex
from kvmiss.enricher.core.privacy import DigestKey
from kvmiss.enricher.otlp.assembly import Assembly, Fragment, MissingFacts, join_target, to_request_facts
from kvmiss.enricher.otlp.spans import SpanReader
from kvmiss.enricher.service.request_records import record_of
from kvmiss.schemas.attribution import AttributionRecord, Label, Owner, RequestFacts, RequestRecord
from kvmiss.schemas.config import WorkerSpec
from kvmiss.schemas.labels import LABELS, MISS_LABELS, UNKNOWN_LABELS

_request_decoder = msgspec.json.Decoder(RequestFacts)

# Requests whose re-announcements are noted before the one judged (`attribute_requests`):
# records come in about the order requests finished, and the one that confirms a store
# finished within seconds of the request whose verdict rests on it.
NOTE_AHEAD = 4096


def workers_in_recording(path: str) -> list[WorkerSpec]:
    """Worker specs inferred from a recording: every worker seen; replay where replies or
    replay timers were recorded (endpoints are not needed to play a recording back)."""
    seen: dict[str, bool] = {}
    for message in read_recording(path):
        seen[message.worker] = seen.get(message.worker, False) or message.socket in (DEALER, TICK)
    return [WorkerSpec(id=w, endpoint="recorded", replay_endpoint="recorded" if replay else None)
            for w, replay in sorted(seen.items())]


def index_from_recording(path: str, workers: Iterable[WorkerSpec], *,
                         stats: ReadStats | None = None, re_announcements: bool = True) -> ResidencyIndex:
    """Play the recording into a fresh index that keeps every epoch (no retention).
    ``re_announcements``: False when no request used vLLM's full report mode ([history]
    kv_cache_report_mode = "incremental")."""
    workers = list(workers)
    index = ResidencyIndex([w.id for w in workers], retention_s=float("inf"),
                           keep_previous_epochs=1_000_000, re_announcements=re_announcements)

    def sink(worker: str, action) -> None:
        if isinstance(action, Apply):
            index.apply(action.batch)

    play_recording(path, Fleet(workers, sink), stats)
    return index


class BadRequestLine(msgspec.Struct):
    line: int
    error: str


def read_requests(lines: Iterable[bytes]) -> Iterator[RequestFacts | BadRequestLine]:
    """Request records, one JSON object per line; a bad line is reported, not fatal."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield _request_decoder.decode(line)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            yield BadRequestLine(number, str(exc))


class Summary:
    """Requests, misses and missed tokens by label and owner."""

    def __init__(self) -> None:
        self.requests = 0
        self.by_label: collections.Counter[Label] = collections.Counter()
        self.tokens_by_label: collections.Counter[Label] = collections.Counter()

    def add(self, record: AttributionRecord) -> None:
        self.requests += 1
        self.by_label[record.verdict.label] += 1
        self.tokens_by_label[record.verdict.label] += record.verdict.missed_tokens

    @property
    def misses(self) -> int:
        return sum(n for label, n in self.by_label.items() if label in MISS_LABELS)

    @property
    def unknown_share(self) -> float:
        unknown = sum(self.by_label[label] for label in UNKNOWN_LABELS)
        return unknown / self.misses if self.misses else 0.0

    def table(self) -> str:
        rows = [f"{'label':<18}{'owner':<13}{'requests':>9}{'missed tokens':>15}"]
        for label in Label:
            if self.by_label[label]:
                rows.append(f"{label.value:<18}{LABELS[label].owner.value:<13}"
                            f"{self.by_label[label]:>9}{self.tokens_by_label[label]:>15}")
        by_owner: collections.Counter[Owner] = collections.Counter()
        for label, n in self.by_label.items():
            by_owner[LABELS[label].owner] += n
        rows.append("")
        rows.append("by owner: " + ", ".join(f"{o.value} {n}" for o, n in sorted(by_owner.items())))
        rows.append(f"requests {self.requests}, misses {self.misses}, "
                    f"unknown share of misses {self.unknown_share:.1%}")
        return "\n".join(rows)


def attribute_requests(index: ResidencyIndex, requests: Iterable[RequestFacts | BadRequestLine],
                       out: IO[bytes], *, digest_key: DigestKey | None = None,
                       errors: IO[str] | None = None, aged_out_as_recent_match: bool = False) -> Summary:
    """Judge each request in turn. Each one's re-announcements are noted `NOTE_AHEAD` requests
    before it is judged, as the live pipeline notes a round's before judging it and holds an
    unknown for a later one: a verdict may rest on a store a later record's request confirms."""
    attributor = Attributor(index, digest_key, aged_out_as_recent_match=aged_out_as_recent_match)
    encoder = msgspec.json.Encoder()
    summary = Summary()
    ahead: collections.deque[RequestFacts] = collections.deque()

    def judge(facts: RequestFacts) -> None:
        record = attributor.record(facts, noted=True)
        summary.add(record)
        out.write(encoder.encode(record) + b"\n")

    for item in requests:
        if isinstance(item, BadRequestLine):
            if errors is not None:
                print(f"kvmiss attribute: request line {item.line}: {item.error}", file=errors)
            continue
        attributor.note_re_announcements(item)
        ahead.append(item)
        if len(ahead) > NOTE_AHEAD:
            judge(ahead.popleft())
    while ahead:
        judge(ahead.popleft())
    return summary


# --- request records from OTLP span files ----------------------------------------------------


def records_from_spans(requests: Iterable, reader: SpanReader, *, hasher: BlockHasher | None,
                       default_block_size: int, left_out: collections.Counter[str]) -> Iterator[RequestRecord]:
    """The request record of every request in ``requests`` (parsed OTLP export requests: the
    lines of a Collector's file exporter), in the order their traces first appear.

    Each span's facts are read as the pipeline reads them (`SpanReader`, the configured
    names); a trace's fragments are joined by the pipeline's rule (`assembly.join_target`) and
    merged into `RequestFacts` (`assembly.to_request_facts`: the engine's llm_request gives the
    finish time and output tokens), which become `RequestRecord` as `kvmiss serve` writes them.
    Every span of a trace is at hand here, so nothing waits: a request whose facts are still
    incomplete is left out, counted in ``left_out`` by what it lacks. Holds the facts of every
    span until the end (bounded by the files given; `[export] request_records` is the way for
    continuous traffic)."""
    scan = reader.scanner(frozenset())
    traces: dict[bytes, dict[str | None, Assembly]] = {}
    for request in requests:
        for resource_spans in request.resource_spans:
            attributes = resource_spans.resource.attributes
            instance, worker = reader.instance_of(attributes), reader.worker_of(attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans[:]:
                    found = scan(span, None, worker)
                    if found is None or found[0] is None:
                        continue
                    facts, fields, _ = found
                    trace = traces.setdefault(span.trace_id, {})
                    assembly = trace.get(facts.request_id)
                    if assembly is None:
                        assembly = trace[facts.request_id] = Assembly(span.trace_id, facts.request_id, 0.0)
                    assembly.fragments.append(Fragment(facts, None, None, instance, None, fields))
    for trace_id, trace in traces.items():
        for assembly in list(trace.values()):  # in arrival order, as the pipeline's poll
            target = join_target(assembly, trace)
            if target is not None:
                target.fragments.extend(assembly.fragments)
                assembly.done = True
                del trace[assembly.request_id]
        for assembly in trace.values():
            facts = to_request_facts(assembly, hasher=hasher, default_block_size=default_block_size, errors=[])
            if isinstance(facts, MissingFacts):
                left_out["no " + " or ".join(facts.missing)] += 1
                continue
            yield record_of(facts, trace_id)
