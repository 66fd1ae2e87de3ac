"""`kvmiss report`: the same HTML report and PNG charts from attribution records or from
enriched OTLP/JSON spans (as the file exporter writes them), with or without context."""

from __future__ import annotations

import json

import msgspec
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from PIL import Image

from kvmiss.enricher.cli import main
from kvmiss.enricher.otlp.exporter import to_otlp_json
from kvmiss.enricher.otlp.spans import upsert_attributes, verdict_attributes
from kvmiss.enricher.report import load_records, load_spans
from kvmiss.enricher.report.data import Totals
from kvmiss.schemas.attribution import (
    LABEL_OWNER,
    AttributionRecord,
    Divergence,
    DivergenceKind,
    History,
    Label,
    Verdict,
)

T0 = 1_790_000_000.0
PNG = b"\x89PNG\r\n\x1a\n"


def verdict(label: Label, i: int) -> Verdict:
    missed = label not in (Label.HIT, Label.LOOKUP_LIMIT)
    return Verdict(
        label=label, owner=LABEL_OWNER[label], reason=f"because {label.value}",
        history=History.LAGGING if label is Label.UNKNOWN_HISTORY else History.CONTINUOUS,
        first_miss_block=1 if missed else None, missed_tokens=32 if missed else 0,
        first_miss_digest=f"k1a2b3c4:{i % 3:016x}" if missed else None,
        extra_key_kinds=("cache_salt",) if label is Label.NO_MATCH and i % 2 else (),
        divergence=Divergence(DivergenceKind.TOKENS, first_token_index=17 + i % 5)
        if label is Label.NO_MATCH else None)


def records(labels: list[Label]) -> list[AttributionRecord]:
    return [AttributionRecord(request_id=f"r{i}", trace_id=f"{i:032x}", worker=f"w{i % 2}",
                              lookup_time=T0 + 0.05 * i, prompt_tokens=65, cached_tokens=16,
                              verdict=verdict(label, i))
            for i, label in enumerate(labels)]


LABELS = [label for label in Label for _ in range(3)]


@pytest.fixture
def records_file(tmp_path):
    path = tmp_path / "attributions.jsonl"
    path.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in records(LABELS)))
    return path


@pytest.fixture
def spans_file(tmp_path):
    """Router spans with kvmiss's outputs written by the real span writer, plus vLLM's
    llm_request spans carrying the prompt tokens, as OTLP/JSON lines."""
    lines = []
    for record in records(LABELS):
        request = ExportTraceServiceRequest()
        scope = request.resource_spans.add().scope_spans.add()
        route, llm = scope.spans.add(), scope.spans.add()
        for span, name, span_id in ((route, "route", b"\x01" * 8), (llm, "llm_request", b"\x02" * 8)):
            span.name, span.span_id = name, span_id
            span.trace_id = bytes.fromhex(record.trace_id)
            span.start_time_unix_nano = int(record.lookup_time * 1e9)
        upsert_attributes(route, {
            "gen_ai.request.id": record.request_id, "kvmiss.route.worker": record.worker,
            "kvmiss.route.policy": "prefix", "gen_ai.usage.cache_read.input_tokens": 16,
            "kvmiss.lookup_time_unix_nano": int(record.lookup_time * 1e9),
            **verdict_attributes(record.verdict, record.lookup_time)})
        upsert_attributes(llm, {"gen_ai.request.id": record.request_id,
                                "gen_ai.usage.prompt_tokens": record.prompt_tokens})
        lines.append(to_otlp_json(request))
    path = tmp_path / "enriched.otlp.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def check_report(out, labels: set[str]) -> str:
    html = (out / "report.html").read_text()
    for label in labels:
        assert label in html
    pngs = sorted(out.glob("*.png"))
    assert {p.name for p in pngs} >= {"labels_over_time.png", "stream_health.png", "divergence.png"}
    for png in pngs:
        assert png.read_bytes().startswith(PNG)
        with Image.open(png) as image:
            image.verify()
        assert png.name in html
    # One self-contained file: charts inline, nothing fetched.
    assert html.count("data:image/png;base64,") == len(pngs)
    for external in ("<script", "<link", 'src="http', "url(http", "@import"):
        assert external not in html
    return html


def test_a_report_from_attribution_records(records_file, tmp_path, capsys):
    out = tmp_path / "from-records"
    assert main(["report", "--records", str(records_file), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out / "report.html")
    html = check_report(out, {label.value for label in Label})
    assert "25.0%" in html  # unknown share: 6 of 24 misses
    assert "OVER" in html  # ... against the default 5% budget


def test_a_report_from_enriched_spans_matches_the_records(records_file, spans_file, tmp_path):
    from_spans, from_records = load_spans(spans_file), load_records(records_file)
    assert len(from_spans) == len(LABELS)  # one row per labelled span; llm_request joined
    assert [(r.label, r.request_id, r.worker, r.prompt_tokens, r.missed_tokens,
             r.first_miss_digest, r.divergence_token) for r in from_spans] == [
        (r.label, r.request_id, r.worker, r.prompt_tokens, r.missed_tokens,
         r.first_miss_digest, r.divergence_token) for r in from_records]
    assert Totals(from_spans).by_label == Totals(from_records).by_label
    out = tmp_path / "from-spans"
    assert main(["report", "--spans", str(spans_file), "--out", str(out)]) == 0
    check_report(out, {label.value for label in Label})


def test_context_adds_stream_latency_and_ground_truth_sections(spans_file, tmp_path):
    context = {
        "title": "a test fleet", "unknown_budget": 0.5, "wrong_verdicts": 0,
        "ground_truth": {"evicted": {"agree": 2, "unknown": 1, "wrong": 0}},
        "streams": {"w0": {"batches_applied": 10, "gaps_detected": 1}},
        "timeline": {"w0": {"applied": [[T0 + 0.01 * i, T0 + 0.01 * i + 0.001, i == 5]
                                        for i in range(40)],
                            "facts": [[T0 + 0.2, "hole", "hole seq 3..4"],
                                      [T0 + 0.2, "quarantine", "quarantined"],
                                      [T0 + 0.3, "new_epoch", "new epoch 1"]]}},
        "faults": [[T0 + 0.2, "w0", "hole", "batches lost"]],
        "fault_notes": [[T0 + 0.2, "w0: batches lost"]],
        "speculative": {"p50_ms": 1.0, "p95_ms": 4.0, "p99_ms": 9.0, "confirmed": 50,
                        "expired": 2, "ttl_s": 2.0, "samples_ms": [0.5 + i / 10 for i in range(90)]},
        "whatif": {"evicted_tokens": 416, "scale_keeping_most": "1.5",
                   "kept_share_by_scale": {"1.25": 0.38, "1.5": 0.62, "2": 0.62, "4": 1.0, "8": 1.0}},
    }
    path = tmp_path / "context.json"
    path.write_text(json.dumps(context))
    out = tmp_path / "with-context"
    assert main(["report", "--spans", str(spans_file), "--context", str(path), "--out", str(out)]) == 0
    html = check_report(out, {label.value for label in Label})
    assert {"route_to_stored_latency.png", "ground_truth.png", "whatif.png"} <= {p.name for p in out.glob("*.png")}
    assert "What a larger cache would buy" in html and "1.5x the pool recovers most" in html
    assert "a test fleet" in html and "within" in html and "Wrong verdicts: 0" in html
    assert "w0: batches lost" in html


def test_bad_input_is_reported_and_the_rest_still_renders(records_file, tmp_path, capsys):
    with open(records_file, "a") as f:
        f.write('{"not": "a record"}\n')
    out = tmp_path / "partial"
    assert main(["report", "--records", str(records_file), "--out", str(out)]) == 0
    assert "line 31" in capsys.readouterr().err  # 10 labels x 3 records, then the bad line
    assert (out / "report.html").exists()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["report", "--spans", str(empty), "--out", str(out)]) == 1
    assert main(["report", "--spans", str(tmp_path / "missing"), "--out", str(out)]) == 2
