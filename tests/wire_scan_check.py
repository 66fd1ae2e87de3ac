"""The wire scanner's contract, checked on one body (tests/enricher/otlp/test_span_scan.py and the
OTLP fuzzers use it): for bytes upb accepts, `WireScanner.scan` and `count_spans` either
abstain (None) or answer exactly what the reference scanner reads from the parsed message."""

from __future__ import annotations

from array import array

import msgspec
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvmiss.enricher.otlp import interfaces, spans as S


def _plain(value):
    """A block-hash chain as a list: the wire scanner hands it over as array('Q')."""
    return value.tolist() if isinstance(value, array) else value


def _comparable(facts):
    if facts is None:
        return None
    return repr({k: _plain(v) for k, v in msgspec.structs.asdict(facts).items()})  # repr: NaN reads equal to NaN


def check_against_reference(reader, drop, body: bytes, *, may_abstain: bool) -> None:
    request = ExportTraceServiceRequest.FromString(body)
    table = reader._scan_table(drop)
    hits = S.WireScanner(table).scan(body)
    counted = interfaces.count_spans(body)
    if hits is None or counted is None:
        assert may_abstain, "the wire scanner abstained on a canonical encoding"
        return
    assert counted == (interfaces.span_count(request),
                       sum(len(s.trace_id) != 16 or len(s.span_id) != 8 for rs in request.resource_spans
                           for ss in rs.scope_spans for s in ss.spans))
    by_position = {hit[:3]: hit for hit in hits}
    assert len(by_position) == len(hits) and [h[:3] for h in hits] == sorted(by_position)  # wire order
    scan = reader.scanner(drop)
    for r, resource_spans in enumerate(request.resource_spans):
        worker = reader.worker_of(resource_spans.resource.attributes)
        for s, scope_spans in enumerate(resource_spans.scope_spans):
            for i, span in enumerate(scope_spans.spans):
                hit = by_position.pop((r, s, i), None)
                interesting = any(kv.key in table for kv in span.attributes)
                assert (hit is not None) == interesting
                bad: list[str] = []
                reference = scan(span, bad, worker)
                if hit is None:
                    assert reference is None
                    continue
                assert hit[3] == span.trace_id
                if hit[4] is None:  # handed back for the reference rules: the pipeline reads the message
                    continue
                assert bad == []  # whatever the reference could not use, the C side hands back
                facts, fields, marks = S.WireScanner.found(hit, worker)
                if reference is None:
                    assert facts is None and marks is None
                    continue
                assert _comparable(facts) == _comparable(reference[0])
                assert repr(fields and {k: _plain(v) for k, v in fields.items()}) == repr(reference[1])
                if facts is not None:  # a chain never as a list of Python ints
                    assert type(facts.block_hashes) in (type(None), array)
                assert marks == reference[2]
    assert not by_position  # no hit for a span that is not there
