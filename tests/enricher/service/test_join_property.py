"""One verdict per request, whatever the arrival order and delays of its spans: a property
test over the spans a deployment sends for one request -- a router span (with or without its
own lookup time), vLLM's ``llm_request`` (same request id), the kvmiss plugin's lookup span
(an engine id extending it), re-sent copies -- each arriving at its own time, in its own
export request, with polls in between.

Whatever happens: exactly one span carries a label, or several carry the same one only when
they are copies of one span (a re-send); every span leaves once; and when the spans that
bring the facts arrive within ``assemble_wait_s`` of each other, the label is the one the
request's complete facts prove.
"""

from __future__ import annotations

import asyncio
import os

from fleet_builders import H, WorkerFeed, removed, stored
from hypothesis import given, settings, strategies as st
from test_pipeline import Clock, Sink, attrs, export_request, make, timed_request

from kvmiss.enricher.core.index import ResidencyIndex

SETTINGS = settings(max_examples=int(os.environ.get("KVMISS_FUZZ_EXAMPLES", 200)), deadline=None)
ASSEMBLE_WAIT_S = 15.0
RID = "cmpl-abc-0"


def history() -> ResidencyIndex:
    index, a = ResidencyIndex(), WorkerFeed("A", ts0=1000.0)
    for b in a.batches(range(0, 30), {5: [stored(H)], 12: [removed(H)]}):  # H evicted at 1012
        index.apply(b)
    return index


def spans(kind: str, span_id: bytes, outcome: str) -> dict:
    cached = 32 if outcome == "hit" else 16  # 40 tokens, 16-token blocks: L = 32
    chain = [7, H - 2**64, 9]
    if kind in ("router", "router_no_time"):
        span = {"name": "router", "gen_ai.request.id": RID, "gen_ai.usage.input_tokens": 40,
                "gen_ai.usage.cache_read.input_tokens": cached, "kvmiss.route.worker": "A",
                "kvmiss.block_hashes": chain, "span_id": span_id}
        if kind == "router":
            span["kvmiss.lookup_time_unix_nano"] = int(1020.5e9)
        return span
    if kind == "llm_request":
        return {"name": "llm_request", "gen_ai.request.id": RID, "gen_ai.usage.prompt_tokens": 40,
                "start": int(1020.25e9), "gen_ai.latency.time_in_queue": 0.25, "span_id": span_id}
    return {"name": "kvmiss.prefix_lookup", "gen_ai.request.id": RID + "-1a2b3c4d", "kvmiss.cached_tokens": cached,
            "gen_ai.usage.input_tokens": 40, "kvmiss.route.worker": "A", "kvmiss.block_hashes": chain[:2],
            "kvmiss.lookup_time_unix_nano": int(1020.5e9), "span_id": span_id}


deployments = st.sampled_from([
    ("router", "llm_request"), ("router_no_time", "llm_request"), ("lookup", "llm_request"),
    ("router", "lookup", "llm_request"), ("router_no_time", "lookup", "llm_request")])


@SETTINGS
@given(deployment=deployments, outcome=st.sampled_from(["hit", "evicted"]), data=st.data())
def test_one_label_per_request_whatever_the_arrival(deployment, outcome, data):
    kinds = list(deployment)
    resend = data.draw(st.sampled_from([None, *range(len(kinds))]))
    ids = [bytes([i + 1]) * 8 for i in range(len(kinds))]
    arrivals = [(kind, ids[i]) for i, kind in enumerate(kinds)]
    if resend is not None:
        arrivals.append((kinds[resend], ids[resend]))
    order = data.draw(st.permutations(arrivals))
    # The promise: the spans of one request arrive within assemble_wait_s of each other.
    gap = ASSEMBLE_WAIT_S / len(order)
    delays = data.draw(st.lists(st.floats(0.0, gap), min_size=len(order), max_size=len(order)))
    clock = Clock(0.0)
    pipe, sink = make(history(), clock, assemble_wait_s=ASSEMBLE_WAIT_S, history_wait_s=5.0, judge_on_arrival=True)
    for (kind, span_id), delay in zip(order, delays):
        clock.t += delay
        pipe.poll()
        request = spans(kind, span_id, outcome)
        send = timed_request if kind == "llm_request" else export_request
        asyncio.run(pipe.consume(send(request)))
    clock.t += ASSEMBLE_WAIT_S + 60.0
    pipe.poll(final=True)
    out = sink.spans()
    assert len(out) == len(order)  # every span leaves once
    labelled = [(s.span_id, attrs(s)["kvmiss.label"]) for s in out if "kvmiss.label" in attrs(s)]
    assert labelled, "every request gets a verdict"
    assert len({label for _, label in labelled}) == 1, labelled  # never two labels
    assert len({span_id for span_id, _ in labelled}) == 1, labelled  # on one span (and its re-sent copies)
    # The facts were complete once the spans within one assemble wait had come: then the
    # label is what they prove (a partial judgement is an honest unknown, never a guess).
    label = labelled[0][1]
    assert label in (outcome, "unknown_history"), labelled
    times = _arrival_times(delays)
    assert _complete_at(order, times) is not None
    assert label == outcome, (order, delays, labelled)


def _arrival_times(delays: list[float]) -> list[float]:
    out, t = [], 0.0
    for d in delays:
        t += d
        out.append(t)
    return out


def _complete_at(order, times) -> float | None:
    """When the arrived spans first held the cached tokens, prompt tokens and lookup time."""
    have: set[str] = set()
    for (kind, _), t in zip(order, times):
        have |= {"router": {"cached", "prompt", "time"}, "router_no_time": {"cached", "prompt"},
                 "llm_request": {"prompt", "time"}, "lookup": {"cached", "prompt", "time"}}[kind]
        if have >= {"cached", "prompt", "time"}:
            return t
    return None


_ = Sink  # (the sink the pipeline exports to: test_pipeline's)
