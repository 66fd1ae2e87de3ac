"""The demo's ending: what kvmiss concluded (read back from the enriched spans it exported),
how that compares with the simulator's truth, how the streams held up, how fast stores
confirmed the router's expectations. `DemoReport` scores rows as they are read back;
`as_json` is the machine summary (``kvmiss demo --json``), `render` the terminal one.
"""

from __future__ import annotations

import collections
from typing import Any

from kvmiss.collectors.stream import WorkerStream
from kvmiss.enricher.demo.engine import SimRequest
from kvmiss.enricher.demo.truth import Agreement, judge, truth_label
from kvmiss.enricher.report.data import LABELS, Row, Totals
from kvmiss.enricher.report.streams import stream_health
from kvmiss.schemas.attribution import Label
from kvmiss.schemas.labels import owner_of

UNKNOWN_BUDGET = 0.05  # share of misses allowed to be unknown_* (MetricsConfig default)


class WrongVerdict:
    __slots__ = ("request_id", "kind", "worker", "policy", "truth", "verdict", "reason",
                 "index_saw")

    def __init__(self, request: SimRequest, truth: Label, row: Row, index_saw: list[str]):
        self.request_id, self.kind = request.id, request.kind
        self.worker, self.policy = request.worker, request.route_policy
        self.truth, self.verdict, self.reason = truth, Label(row.label), row.reason
        self.index_saw = index_saw  # what kvmiss's index knew about the true holders at t

    def line(self) -> str:
        saw = "".join(f"\n      true holder {s}" for s in self.index_saw)
        return (f"WRONG VERDICT {self.request_id} ({self.kind}, {self.policy} to {self.worker}): "
                f"kvmiss said {self.verdict.value}, the simulator knows {self.truth.value} "
                f"-- kvmiss reason: {self.reason}{saw}")


class DemoReport:
    """Read-back rows scored against the truth. Fed on the main thread only."""

    def __init__(self, requests: dict[str, SimRequest], block_size: int,
                 diagnoses: dict[str, list[str]]):
        self.requests, self.block_size, self.diagnoses = requests, block_size, diagnoses
        self.rows: dict[str, Row] = {}
        self.duplicates = 0
        self.agreement: dict[Label, collections.Counter[Agreement]] = collections.defaultdict(
            collections.Counter)
        self.wrong: list[WrongVerdict] = []
        self.by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        self.unrequested = 0  # labelled spans of no simulated request (never expected)

    def add(self, row: Row) -> WrongVerdict | None:
        request = self.requests.get(row.request_id or "")
        if request is None or request.truth is None:
            self.unrequested += 1
            return None
        if request.id in self.rows:
            self.duplicates += 1
            return None
        self.rows[request.id] = row
        truth = truth_label(len(request.token_ids), request.cached_tokens, self.block_size,
                            request.truth)
        agreement = judge(truth, Label(row.label))
        self.agreement[truth][agreement] += 1
        self.by_kind[request.kind][row.label] += 1
        if agreement is not Agreement.WRONG:
            return None
        wrong = WrongVerdict(request, truth, row, self.diagnoses.get(request.id, []))
        self.wrong.append(wrong)
        return wrong

    def counts(self) -> collections.Counter[Agreement]:
        total: collections.Counter[Agreement] = collections.Counter()
        for per_label in self.agreement.values():
            total.update(per_label)
        return total

    def ground_truth(self) -> dict[str, dict[str, int]]:
        return {label.value: {a.value: self.agreement[label][a] for a in Agreement}
                for label in Label if self.agreement.get(label)}

    def as_json(self, streams: dict[str, WorkerStream], extra: dict[str, Any]) -> dict[str, Any]:
        totals = Totals(list(self.rows.values()))
        return {
            **extra,
            "requests": totals.requests,
            "misses": totals.misses,
            "by_label": {label: totals.by_label[label] for label in totals.labels()},
            "missed_tokens_by_label": {label: totals.tokens_by_label[label]
                                       for label in totals.labels()},
            "by_owner": dict(sorted(totals.by_owner.items())),
            "by_kind": {kind: {label: c[label] for label in LABELS if c[label]}
                        for kind, c in sorted(self.by_kind.items())},
            "unknown_share": round(totals.unknown_share, 4),
            "unknown_budget": UNKNOWN_BUDGET,
            "ground_truth": self.ground_truth(),
            "wrong_verdicts": len(self.wrong),
            "wrong": [{"request_id": w.request_id, "kind": w.kind, "worker": w.worker,
                       "route_policy": w.policy, "truth": w.truth.value,
                       "verdict": w.verdict.value, "reason": w.reason,
                       "true_holders_in_index": w.index_saw} for w in self.wrong],
            "not_read_back": sorted(set(self.requests) - set(self.rows)),
            "streams": {worker: stream_health(stream) for worker, stream in streams.items()},
        }

    def render(self, summary: dict[str, Any]) -> str:
        totals = Totals(list(self.rows.values()))
        out = [
            f"kvmiss demo: {summary['requests']} requests on {summary['workers']} simulated vLLM "
            f"workers (seed {summary['seed']}, faults: {','.join(summary['faults']) or 'none'}, "
            f"{summary['runtime_s']:.1f} s)",
            f"pipeline: {summary['spans_emitted']} spans over OTLP (router gRPC, engine HTTP) -> "
            f"kvmiss serve -> {summary['spans_exported']} enriched spans in "
            f"{summary['enriched_spans_file']}",
            "",
            f"{'label':<18}{'owner':<13}{'requests':>9}{'missed tokens':>15}",
        ]
        for label in totals.labels():
            out.append(f"{label:<18}{owner_of(label).value:<13}"
                       f"{totals.by_label[label]:>9}{totals.tokens_by_label[label]:>15}")
        owners = ", ".join(f"{o} {n}" for o, n in summary["by_owner"].items())
        share = summary["unknown_share"]
        within = "within" if share <= UNKNOWN_BUDGET else "OVER"
        out += ["", f"by owner: {owners}",
                f"misses {totals.misses} of {totals.requests} requests; unknown share of misses "
                f"{share:.1%} ({within} the {UNKNOWN_BUDGET:.0%} budget)", ""]
        out.append(f"{'worker':<8}{'applied':>8}{'replayed':>9}{'gaps':>6}{'replays ok/failed':>19}"
                   f"{'unrecoverable':>15}{'epochs':>8}{'quarantine':>12}")
        for worker, h in summary["streams"].items():
            quarantine = f"{h['quarantine_s']:.1f}s" + (" NOW" if h["quarantined"] else "")
            out.append(f"{worker:<8}{h['batches_applied']:>8}{h['batches_replayed']:>9}"
                       f"{h['gaps_detected']:>6}"
                       f"{h['replays_recovered']:>11}/{h['replays_failed']:<7}"
                       f"{h['unrecoverable_gaps']:>15}{h['epoch_changes']:>8}{quarantine:>12}")
        whatif = summary.get("whatif") or {}
        if whatif.get("evicted_tokens"):
            shares = ", ".join(f"{scale}x {x:.0%}" for scale, x in whatif["kept_share_by_scale"].items())
            most = whatif["scale_keeping_most"]
            out += [f"what-if (an estimate, never a label): of {whatif['evicted_tokens']} tokens lost to evictions, "
                    f"a larger pool would have kept {shares}"
                    + (f"; {most}x the pool recovers most of them" if most else "; no size up to 8x recovers most")]
        if summary.get("whatif_command"):
            out += [f"replay the pool at other sizes: {summary['whatif_command']}"]
        spec = summary["route_to_stored"]
        out += ["", f"route-to-BlockStored: p50 {spec['p50_ms']} ms, p95 {spec['p95_ms']} ms, "
                f"p99 {spec['p99_ms']} ms ({spec['confirmed']} speculative entries confirmed, "
                f"{spec['expired']} expired after {spec['ttl_s']:g} s)"]
        out += ["", "ground truth (the simulator saw every cache at every lookup):",
                f"{'true label':<18}{'requests':>9}{'agree':>7}{'unknown':>9}{'WRONG':>7}"]
        for label, counts in summary["ground_truth"].items():
            total = sum(counts.values())
            out.append(f"{label:<18}{total:>9}{counts['agree']:>7}{counts['unknown']:>9}"
                       f"{counts['wrong']:>7}")
        if summary["not_read_back"]:
            out += ["", f"!!! {len(summary['not_read_back'])} request(s) never came back "
                    f"enriched: {', '.join(summary['not_read_back'][:10])}"]
        if self.wrong:
            out += ["", "!" * 78, f"!!! {len(self.wrong)} WRONG VERDICT(S): kvmiss named a cause "
                    "that is not the true one", "!" * 78]
            out += [f"!!! {w.line()}" for w in self.wrong]
        else:
            out += ["", "wrong verdicts: 0 (every answer was the true cause or an honest unknown)"]
        privacy = ("no raw prompt material" if not summary["raw_material_in_export"]
                   else "RAW PROMPT MATERIAL FOUND")
        out.append(f"exported spans checked: {privacy} (kvmiss.token_ids, kvmiss.extra_keys, salts)")
        if "raw_material_in_request_records" in summary:
            privacy = ("no raw prompt material" if not summary["raw_material_in_request_records"]
                       else "RAW PROMPT MATERIAL FOUND")
            out.append(f"request records checked: {privacy} ({summary['request_records']} in "
                       f"{summary['request_records_file']})")
        out.append(f"report: {summary['report_path']}")
        return "\n".join(out)
