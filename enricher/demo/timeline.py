"""What the collector told kvmiss over time: narrated as it happens, and kept for the report.

`StreamNarrator` prints the stream facts that matter (holes, quarantine, restarts) from the
main thread as the service's collector records them. `report_context` gathers what no span
carries -- per-worker stream timelines, injected faults, route-to-BlockStored latencies,
stream health, ground truth -- into the JSON that `kvmiss report --context` reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvmiss.enricher.demo.faults import FaultRunner
from kvmiss.enricher.demo.host import Speculation, StreamLog
from kvmiss.enricher.report.streams import KINDS, describe


class StreamNarrator:
    """Says each new stream fact once (the collector thread appends, this reads)."""

    def __init__(self, streams: StreamLog, say: Callable[[str], None]):
        self.streams, self.say, self.cursor = streams, say, 0

    def narrate(self) -> None:
        facts = self.streams.facts
        while self.cursor < len(facts):
            _, worker, action = facts[self.cursor]
            self.cursor += 1
            self.say(f"kvmiss: {worker} {describe(action)}")


def report_context(summary: dict[str, Any], streams: StreamLog, faults: FaultRunner | None,
                   speculation: Speculation, budget: float) -> dict[str, Any]:
    timeline: dict[str, dict[str, list]] = {}
    for worker, applied in streams.applied.items():
        timeline.setdefault(worker, {"applied": [], "facts": []})["applied"] = [
            [round(ts, 6), round(recv, 6), replayed] for ts, recv, replayed in applied]
    for t, worker, action in streams.facts:
        lane = timeline.setdefault(worker, {"applied": [], "facts": []})
        lane["facts"].append([round(t, 6), KINDS.get(type(action), "other"), describe(action)])
    spec = dict(summary["route_to_stored"], samples_ms=speculation.samples_ms())
    struck = faults.struck if faults is not None else []
    return {
        "title": "kvmiss demo: why requests missed the prefix cache",
        "subtitle": (f"{summary['requests']} requests on {summary['workers']} simulated vLLM "
                     f"workers through kvmiss serve (seed {summary['seed']}, faults: "
                     f"{', '.join(summary['faults']) or 'none'})"),
        "span_note": f"{summary['spans_emitted']} spans in over OTLP",
        "footer": (f"Labels read back from {summary['enriched_spans_file']} (OTLP/JSON, as kvmiss "
                   "exported them); the same report: kvmiss report --spans FILE --context "
                   "report_context.json."),
        "unknown_budget": budget,
        "wrong_verdicts": summary["wrong_verdicts"],
        "wrong": summary["wrong"],
        "ground_truth": summary["ground_truth"],
        "streams": summary["streams"],
        "speculative": spec,
        "whatif": summary.get("whatif") or {},
        "timeline": dict(sorted(timeline.items())),
        "faults": [[round(t, 6), worker, action, note] for t, worker, action, note in struck
                   if action not in ("stall", "lag_off")],
        "fault_notes": [[round(t, 6), f"{worker}: {note}"] for t, worker, _, note in struck],
    }
