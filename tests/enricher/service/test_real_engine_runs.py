"""Whole runs of the real vLLM CPU engine, captured (examples/vllm-cpu/run_field.py
--capture-run), replayed through kvmiss with no engine: every live message the engine
published, as sent, and each request as kvmiss was given it (chain, counts, the lookup time it
took from vLLM's ``llm_request`` -- the earliest it can have been -- and, in captures since
2026-12-05, the latest, and whether the request skipped reading the cache).

The expected labels are not stored: they are derived here from the captured stream by the
oracle the live run used (examples/vllm-cpu/engine_truth.py: residency per KV-cache group,
vLLM's hit rule, checked against the engine's own cached-token counts). The frames go through
kvmiss's own path -- a recording played by `collectors.fleet` into a residency index -- and
every request the oracle judged must get its label (an ``unknown_*`` answer counts against
the 1 % budget, never as right).

* ``vllm-0.32.0-gemma3-run``: a Gemma-3-style hybrid (window group 0, full-attention group 1),
  the designed window cases, then 8 requests in flight.
* ``vllm-0.32.0-llama-full-report-run``: the single-group Llama with
  ``kv_cache_report_mode: "full"`` on half the requests, the last half 8 in flight (with its
  lookup windows: judged at the earliest time alone, one ``evicted`` comes out
  ``resident_miss``).
* ``vllm-0.32.0-gemma3-plugin-run``: the same hybrid with full report mode on 30 %, 8 in flight,
  lookups from the kvmiss plugin (2026-12-06): one request looked up twice before admission.
* ``vllm-0.32.0-llama-router-spans``, ``vllm-0.32.0-gemma3-router-spans``,
  ``vllm-0.32.0-llama-full-report-sequential`` (2026-12-07, issue 35): router spans with
  SPANS.md's inputs and the report mode, no plugin; full report mode on half, 30 % and every
  request, the first two partly 8 in flight. Replayed by the router tests at the end.
* ``vllm-0.32.0-qwen3-next-run``: a Qwen3-Next-style hybrid (a gated-delta-net layer, KV-cache
  kind ``mamba``, beside full attention; 96-token blocks), sequential: where the state group
  cut a hit, the state it needed decides (``window_limit`` never kept, ``evicted`` removed);
  the capture's own truth, from before the oracle modelled the kind, said ``unknown_history``.
"""

from __future__ import annotations

import base64
import collections
import gzip
import io
import json
import sys
from pathlib import Path

import msgspec
import pytest

from kvmiss.collectors.recording import RecordedMessage, RecordingWriter
from kvmiss.enricher.service.offline import attribute_requests, index_from_recording
from kvmiss.schemas.attribution import AttributionRecord, RequestFacts
from kvmiss.schemas.config import WorkerSpec

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "tests" / "data" / "engines"
sys.path.insert(0, str(ROOT / "examples" / "vllm-cpu"))
import engine_truth  # noqa: E402

RUNS = sorted(DATA.glob("vllm-*-run.jsonl.gz"))
WORKER = "vllm-cpu-0"
UNKNOWN_BUDGET = 0.01


def load(path: Path) -> tuple[dict, list[dict], list[dict]]:
    rows = [json.loads(line) for line in gzip.open(path, "rt") if line.strip()]
    run = next(r["run"] for r in rows if "run" in r)
    return run, [r for r in rows if r.get("source") == "live"], [r["request"] for r in rows if "request" in r]


def truth(live: list[dict], requests: list[dict]) -> tuple[engine_truth.Stream, list[engine_truth.Truth]]:
    batches = [(m["seq"], m["recv_ts"], msgspec.msgpack.decode(base64.b64decode(m["frames"][2]))[1]) for m in live]
    stream = engine_truth.Stream(batches, requests[0]["block_size"])
    lookups = [engine_truth.Lookup(str(i), r["block_hashes"], r["prompt_tokens"], r["cached_tokens"], r["sent_at"],
                                   r["done_at"], r["full_report"]) for i, r in enumerate(requests)]
    stream.note_lookups(lookups)
    stream.mark_re_announcements(lookups)
    return stream, [stream.judge(lk) for lk in lookups]


def kvmiss_verdicts(live: list[dict], requests: list[dict], tmp_path: Path,
                    full_reports: bool | None = None) -> list[tuple[str, str]]:
    """kvmiss's (label, reason) per request, through offline attribution (`attribute_requests`,
    which notes every request's re-announcements before judging the ones before it).
    ``full_reports``: whether the run used full report mode (the deployment's [history]
    kv_cache_report_mode: "incremental" when not, its stores with no parent then real
    copies); by default, whether any request given says so."""
    recording = tmp_path / "run.kvrec"
    with RecordingWriter(recording) as writer:
        for m in live:
            writer.write(RecordedMessage(m["recv_ts"], WORKER, "sub", [base64.b64decode(f) for f in m["frames"]]))
    if full_reports is None:
        full_reports = any(r.get("full_report") for r in requests)
    index = index_from_recording(str(recording), [WorkerSpec(id=WORKER, endpoint="recorded")],
                                 re_announcements=full_reports)
    given = []
    for r in requests:
        # (the request's report mode reaches kvmiss as the vLLM plugin's lookup span or the
        # router that set vllm_xargs says it: `kvmiss.kv_cache_report_mode`)
        t, latest = r["lookup_time"], r.get("lookup_time_latest")
        if t is None and r.get("full_report") and r["cached_tokens"] >= r["block_size"]:
            # A full-report hit judged before vLLM's llm_request said when it looked up (the
            # captures before 2026-12-06; kvmiss now waits for it): the client's own send and
            # answer times bound the lookup, a wider window than llm_request's.
            t, latest = r["sent_at"], r["done_at"]
        facts = RequestFacts(prompt_tokens=r["prompt_tokens"], cached_tokens=r["cached_tokens"],
                             block_size=r["block_size"], worker=r["worker"], lookup_time=t,
                             lookup_time_latest=latest,
                             block_hashes=r["block_hashes"],
                             kv_cache_report_mode="full" if r.get("full_report") else None,
                             skip_reading_prefix_cache=r.get("skip_reading_prefix_cache"),
                             earlier_lookups=tuple((t, c) for t, c in r.get("earlier_lookups") or ()),
                             # llm_request's end, which captures lack: the client's answer came later
                             finish_time=r["done_at"] if latest is not None else None)
        given.append(facts)
    out = io.BytesIO()
    attribute_requests(index, given, out)
    records = [msgspec.json.decode(line, type=AttributionRecord) for line in out.getvalue().splitlines()]
    return [(record.verdict.label.value, record.verdict.reason or "") for record in records]


def test_captures_of_the_hybrid_and_full_report_runs_are_present():
    names = {p.name for p in RUNS}
    assert {"vllm-0.32.0-gemma3-run.jsonl.gz", "vllm-0.32.0-llama-full-report-run.jsonl.gz"} <= names, names


@pytest.mark.parametrize("path", RUNS, ids=lambda p: p.name)
def test_kvmiss_gives_the_engines_truth_on_a_captured_run(path, tmp_path):
    run, live, requests = load(path)
    assert [m["seq"] for m in live] == list(range(len(live))), "the capture has a gap: it proves nothing"
    stream, truths = truth(live, requests)
    assert not any(t.excluded == "oracle_mismatch" for t in truths), "the hit rule did not give the engine's count"
    verdicts = kvmiss_verdicts(live, requests, tmp_path)
    labels = [label for label, _ in verdicts]

    judged = [(t.label, got, r) for t, got, r in zip(truths, labels, requests) if t.label is not None]
    misses = [x for x in judged if x[0] not in ("hit", "lookup_limit")]
    wrong = [(want, got, r["kind"]) for want, got, r in judged if not got.startswith("unknown") and got != want]
    # Where a group kvmiss does not model (Mamba state) cut the hit, the truth is an honest
    # unknown_history naming the kind; other unknowns count against the budget.
    unknown = [x for x in misses if x[0] != "unknown_history" and x[1].startswith("unknown")]
    for (want, got, _), (_, reason) in zip(judged, [v for t, v in zip(truths, verdicts) if t.label is not None]):
        if want == "unknown_history":
            assert got == "unknown_history" and any(kind in reason for kind in stream.unmodelled), reason
    assert len(unknown) <= UNKNOWN_BUDGET * len(misses), collections.Counter(x[1] for x in unknown)
    # The oracle judges what it judged when the capture was taken, with the same truth, less
    # what it has since learned is ambiguous; and kvmiss offline agrees with kvmiss live (the
    # release that ran it) wherever it does not now give the truth instead.
    for t, r in zip(truths, requests):
        assert t.label == r["truth"] or (t.label is None and t.excluded.startswith("ambiguous")) or (
            r["truth"] == "unknown_history" and "mamba" in run.get("unmodelled_kinds", ())
            and t.label in ("window_limit", "evicted")), (t, r["truth"])
    assert len(judged) <= run["with_truth"]
    differ = [(r["kvmiss_live"], got, want) for want, got, r in judged if got != r["kvmiss_live"] and got != want]
    assert differ == [], differ
    seen = {want for want, _, _ in judged}
    assert {"hit", "no_match"} <= seen
    if stream.unmodelled:  # the Mamba-style hybrid: some hits were cut by its state group
        assert "unknown_history" in seen and stream.unmodelled == ["mamba"]
    else:
        assert "evicted" in seen
    if len(stream.groups) > 1 and not stream.unmodelled:  # a window or state group limited some hits
        assert "window_limit" in seen and {g.kind for g in stream.groups.values()} in (
            {"sliding_window", "full_attention"}, {"mamba", "full_attention"})
    if any(r["full_report"] for r in requests):
        assert stream.skipped, "full report mode re-announced nothing"
    if any(r["concurrent"] for r in requests):
        excluded = collections.Counter((t.excluded or "").split(":")[0] for t in truths if t.excluded)
        assert set(excluded) <= {"ambiguous", "no_store_seen"}, excluded
    assert wrong == [], wrong


def judged_against_truth(path: Path, tmp_path: Path, strip: tuple[str, ...] = ()) -> tuple[list, list, list]:
    """(misses, wrong, unknown) of kvmiss on a capture, with the request facts in ``strip``
    left out (what kvmiss would have had without them)."""
    _, live, requests = load(path)
    _, truths = truth(live, requests)
    given = [{**r, **{k: None for k in strip}} for r in requests]
    tmp_path.mkdir(parents=True, exist_ok=True)
    verdicts = kvmiss_verdicts(live, given, tmp_path, full_reports=any(r.get("full_report") for r in requests))
    judged = [(t.label, got, reason) for t, (got, reason) in zip(truths, verdicts) if t.label is not None]
    misses = [x[:2] for x in judged if x[0] not in ("hit", "lookup_limit")]
    wrong = [x[:2] for x in judged if not x[1].startswith("unknown") and x[1] != x[0]]
    unknown = [x for x in judged if x[0] not in ("hit", "lookup_limit") and x[1].startswith("unknown")]
    return misses, wrong, unknown


def test_a_lookup_time_from_llm_request_is_judged_over_its_window_on_the_real_engine(tmp_path):
    """8 requests in flight on the real engine: vLLM's queue time put one request's lookup a
    step early, where the block it missed was still resident (removed in the lookup's own
    step), so the earliest time alone gives resident_miss for an evicted block. The window up
    to time to first token - prefill settles it; without the request's word that it read the
    cache, the steps after its own recompute cannot be ruled out (unknown, never wrong)."""
    path = DATA / "vllm-0.32.0-llama-full-report-run.jsonl.gz"
    misses, wrong, unknown = judged_against_truth(path, tmp_path / "window")
    assert wrong == [] and len(unknown) <= UNKNOWN_BUDGET * len(misses)
    _, wrong, _ = judged_against_truth(path, tmp_path / "earliest", strip=("lookup_time_latest",))
    assert wrong == [("evicted", "resident_miss")]
    _, wrong, unknown = judged_against_truth(path, tmp_path / "no-flag", strip=("skip_reading_prefix_cache",))
    assert wrong == [] and len(unknown) > 0


def test_the_hybrid_with_full_reports_and_8_in_flight_gets_no_wrong_label_over_its_windows(tmp_path):
    """The Gemma-3-style hybrid, full report mode on 30 % and the last 40 % 8 in flight
    (2026-12-05). Every label is the engine's or honestly unknown. Judged as the live run was
    (each request when it came), it had 6 unknowns of 80 misses; 5 are settled since:
    a `window_limit` miss's recompute is a real copy, not a possible re-announcement (the
    window group stored a tail it did not hold), a copy earlier in the lookup step would have
    been hit with the window blocks its call stored, and a step where the engine would have hit
    is ruled out whatever its label. One remains: a window reaching the step after a store of
    the block and its removal (evicted there, no_match before) -- nothing on the wire says the
    store was the request's own recompute."""
    path = DATA / "vllm-0.32.0-gemma3-full-report-concurrent.jsonl.gz"
    _, live, requests = load(path)
    assert [m["seq"] for m in live] == list(range(len(live)))
    stream, truths = truth(live, requests)
    assert not any(t.excluded == "oracle_mismatch" for t in truths)
    verdicts = kvmiss_verdicts(live, requests, tmp_path)
    judged = [(t.label, label, reason) for t, (label, reason) in zip(truths, verdicts) if t.label is not None]
    assert [(want, got) for want, got, _ in judged if not got.startswith("unknown") and got != want] == []
    assert {"window_limit", "evicted", "no_match"} <= {want for want, _, _ in judged} and stream.skipped
    unknown = [reason for want, got, reason in judged if got.startswith("unknown")]
    assert len(unknown) <= 1 and all("window" in r for r in unknown), unknown


def test_the_linear_attention_hybrids_state_group_misses_are_judged_not_unknown(tmp_path):
    """The Qwen3-Next-style capture: of its 44 misses, the 4 its state group cut were
    ``unknown_history`` naming the kind until the kind had a rule (vLLM's `MambaManager`: the
    rightmost kept state). Now each is read in the state group: requests 24, 91 and 109 share
    a prefix whose end no request kept a state at (window_limit); request 28 repeats a prompt
    whose state was kept and evicted 76 ms before (evicted). The oracle's rule gives the
    engine's count on all 120; 0 unknown, 0 wrong."""
    path = DATA / "vllm-0.32.0-qwen3-next-run.jsonl.gz"
    _, live, requests = load(path)
    stream, truths = truth(live, requests)
    assert stream.unmodelled == [] and not any(t.excluded for t in truths)
    verdicts = kvmiss_verdicts(live, requests, tmp_path)
    changed = {i: (t.label, verdicts[i][0]) for i, (t, r) in enumerate(zip(truths, requests))
               if r["truth"] != t.label}
    assert changed == {24: ("window_limit", "window_limit"), 28: ("evicted", "evicted"),
                       91: ("window_limit", "window_limit"), 109: ("window_limit", "window_limit")}
    assert all(requests[i]["truth"] == requests[i]["kvmiss_live"] == "unknown_history" for i in changed)
    assert "linear-attention (Mamba) group never kept a state" in verdicts[24][1]
    assert verdicts[28][1].startswith("the state the linear-attention (Mamba) group needed was removed")
    misses, wrong, unknown = judged_against_truth(path, tmp_path / "again")
    assert (len(misses), wrong, unknown) == (44, [], [])


def test_the_mamba_groups_stores_without_a_hash_are_counted_logged_once_and_skipped(tmp_path, caplog):
    """vLLM's Mamba state group (the Qwen3-Next-style capture) sends a BlockStored with 96 token
    ids and no hash where its blocks in the cached range are all null: nothing to hold. Each is
    counted per worker
    (``kvmiss_index_stores_without_hashes``) and logged once, the group is still learned from
    it, and the run's batches all apply."""
    import logging

    from kvmiss.enricher.service.handoff import IndexFeed

    path = DATA / "vllm-0.32.0-qwen3-next-run.jsonl.gz"
    _, live, _ = load(path)
    hashless = sum(1 for m in live for e in msgspec.msgpack.decode(base64.b64decode(m["frames"][2]))[1]
                   if e.get("type") == "BlockStored" and not e.get("block_hashes"))
    assert hashless > 0
    recording = tmp_path / "run.kvrec"
    with RecordingWriter(recording) as writer:
        for m in live:
            writer.write(RecordedMessage(m["recv_ts"], WORKER, "sub", [base64.b64decode(f) for f in m["frames"]]))
    index = index_from_recording(str(recording), [WorkerSpec(id=WORKER, endpoint="recorded")])
    assert index.anomalies[("stores_without_hashes", WORKER)] == hashless
    view = index.current[WORKER]
    assert view.last_seq == live[-1]["seq"] and "mamba" in {g.kind for g in view.groups.values()}
    feed = IndexFeed(index, clock=lambda: 0.0)
    with caplog.at_level(logging.WARNING, logger="kvmiss.index"):
        feed._log_new_anomalies()
        feed._log_new_anomalies()
    lines = [r.getMessage() for r in caplog.records if "no block hash" in r.getMessage()]
    assert len(lines) == 1 and WORKER in lines[0]


def test_a_full_report_request_looked_up_before_admission_re_announced_each_time(tmp_path):
    """The Gemma-3-style hybrid with the kvmiss plugin (2026-12-06, dbeab3c): a full-report
    request did not fit in the step of its first lookup and was admitted in the next; both
    lookups re-announced its chain. The plugin's span names the earlier one: with it every miss
    is judged; without it (as before 94dd785) the store of the first stays a possible copy and a
    later miss over its block is unknown."""
    path = DATA / "vllm-0.32.0-gemma3-plugin-run.jsonl.gz"
    _, _, requests = load(path)
    assert sum(1 for r in requests if r.get("earlier_lookups")) == 1
    misses, wrong, unknown = judged_against_truth(path, tmp_path / "with")
    assert wrong == [] and unknown == []
    misses, wrong, unknown = judged_against_truth(path, tmp_path / "without", strip=("earlier_lookups",))
    assert wrong == [] and len(unknown) == 1


# --- router spans, no plugin (issue 35) ---------------------------------------------------------

# What a router's span gives kvmiss beyond SPANS.md's inputs (request id, prompt and cached
# tokens, worker, block size, chain; the lookup window and finish from vLLM's own llm_request),
# as docs/VLLM.md's router table lists it: the request's report mode. Without it no store
# with no parent is told apart from a second copy.
ROUTER_ADDS = ("kvmiss.kv_cache_report_mode",)
# Captures of router runs with full report mode: single-group and hybrid, sequential and 8 in
# flight, on half, 30 % or all of the requests. (The plugin's run has lookups before
# admission, which only the plugin sees: test_a_full_report_request_looked_up_before_admission...)
ROUTER_RUNS = ["vllm-0.32.0-llama-full-report-run.jsonl.gz", "vllm-0.32.0-gemma3-full-report-concurrent.jsonl.gz",
               "vllm-0.32.0-llama-router-spans.jsonl.gz", "vllm-0.32.0-gemma3-router-spans.jsonl.gz",
               "vllm-0.32.0-llama-full-report-sequential.jsonl.gz"]
RE_ANNOUNCEMENT = "may re-announce a reused chain"


def as_router_spans(requests: list[dict], *, report_mode: bool) -> list[dict]:
    """Each request as a router's span and vLLM's llm_request give it, no plugin: neither the
    plugin's earlier lookups nor its word that the request read the cache; the report mode
    only if the router says it."""
    return [{**r, "earlier_lookups": None, "skip_reading_prefix_cache": None,
             "full_report": r["full_report"] if report_mode else None} for r in requests]


def router_judged(name: str, tmp_path: Path, *, report_mode: bool) -> tuple[list, list, list]:
    _, live, requests = load(DATA / name)
    _, truths = truth(live, requests)
    tmp_path.mkdir(parents=True, exist_ok=True)
    verdicts = kvmiss_verdicts(live, as_router_spans(requests, report_mode=report_mode), tmp_path, full_reports=True)
    judged = [(t.label, got, reason) for t, (got, reason) in zip(truths, verdicts) if t.label is not None]
    misses = [x for x in judged if x[0] not in ("hit", "lookup_limit")]
    wrong = [x for x in judged if not x[1].startswith("unknown") and x[1] != x[0]]
    return misses, wrong, [x for x in misses if x[1].startswith("unknown")]


def test_docs_list_what_a_router_adds_to_spans_md():
    text = (ROOT / "docs" / "VLLM.md").read_text()
    assert all(f"`{name}`" in text for name in ROUTER_ADDS), ROUTER_ADDS


def test_router_spans_settle_full_report_runs_within_the_unknown_budget(tmp_path):
    """The real engine, full report mode on a share of the requests or all of them,
    sequential and 8 in flight, single-group and hybrid, router spans only (SPANS.md's inputs
    and the report mode): 0 wrong, unknown within 1 % of the misses, and never for want of a
    re-announcement's request."""
    total_misses, total_unknown = 0, []
    for name in ROUTER_RUNS:
        misses, wrong, unknown = router_judged(name, tmp_path / name, report_mode=True)
        assert wrong == [], (name, wrong)
        assert not any(RE_ANNOUNCEMENT in reason for _, _, reason in unknown), (name, unknown)
        total_misses += len(misses)
        total_unknown += unknown
    assert len(total_unknown) <= UNKNOWN_BUDGET * total_misses, total_unknown


@pytest.mark.parametrize("name", ROUTER_RUNS[2:], ids=lambda n: n.split("0.32.0-")[1].split(".")[0])
def test_without_the_report_mode_a_re_announcement_is_never_taken_for_none(name, tmp_path):
    """SPANS.md's inputs alone: a store with no parent stays possibly a second copy (vLLM's
    re-announcement is the same event, and llm_request does not carry the mode), so misses
    after its block's removal are unknown -- never wrong. The report mode settles them."""
    misses, wrong, unknown = router_judged(name, tmp_path / "without", report_mode=False)
    assert wrong == [] and any(RE_ANNOUNCEMENT in reason for _, _, reason in unknown), unknown
    misses, wrong, unknown = router_judged(name, tmp_path / "with", report_mode=True)
    assert wrong == [] and not any(RE_ANNOUNCEMENT in reason for _, _, reason in unknown), unknown
