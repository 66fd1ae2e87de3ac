"""The demo's ending: what kvmiss concluded, how that compares with the truth, how the
streams held up. One `DemoReport` collects results as requests are attributed; `as_json`
is the machine summary (``kvmiss demo --json``) and `render` the human one.
"""

from __future__ import annotations

import collections
from typing import Any

from kvmiss.collectors.stream import WorkerStream
from kvmiss.enricher.demo.truth import Agreement
from kvmiss.enricher.offline import Summary
from kvmiss.schemas.attribution import LABEL_OWNER, AttributionRecord, Label

UNKNOWN_BUDGET = 0.05  # share of misses allowed to be unknown_* (MetricsConfig default)


class WrongVerdict:
    __slots__ = ("request_id", "kind", "worker", "policy", "truth", "verdict", "reason",
                 "index_saw")

    def __init__(self, request_id, kind, worker, policy, truth: Label, verdict: Label, reason,
                 index_saw: list[str]):
        self.request_id, self.kind, self.worker, self.policy = request_id, kind, worker, policy
        self.truth, self.verdict, self.reason = truth, verdict, reason
        self.index_saw = index_saw  # what kvmiss's index knew about the true holders at t

    def line(self) -> str:
        saw = "".join(f"\n      true holder {s}" for s in self.index_saw)
        return (f"WRONG VERDICT {self.request_id} ({self.kind}, {self.policy} to {self.worker}): "
                f"kvmiss said {self.verdict.value}, the simulator knows {self.truth.value} "
                f"-- kvmiss reason: {self.reason}{saw}")


class DemoReport:
    """Results by label, owner and ground truth. Fed on the main thread only."""

    def __init__(self) -> None:
        self.summary = Summary()
        self.agreement: dict[Label, collections.Counter[Agreement]] = collections.defaultdict(
            collections.Counter)
        self.wrong: list[WrongVerdict] = []
        self.by_kind: dict[str, collections.Counter[Label]] = collections.defaultdict(
            collections.Counter)

    def add(self, record: AttributionRecord, truth: Label, agreement: Agreement, *, kind: str,
            policy: str | None, index_saw: list[str]) -> WrongVerdict | None:
        self.summary.add(record)
        self.agreement[truth][agreement] += 1
        self.by_kind[kind][record.verdict.label] += 1
        if agreement is not Agreement.WRONG:
            return None
        wrong = WrongVerdict(record.request_id, kind, record.worker, policy, truth,
                             record.verdict.label, record.verdict.reason, index_saw)
        self.wrong.append(wrong)
        return wrong

    def as_json(self, streams: dict[str, WorkerStream], extra: dict[str, Any]) -> dict[str, Any]:
        s = self.summary
        by_owner: collections.Counter[str] = collections.Counter()
        for label, n in s.by_label.items():
            by_owner[LABEL_OWNER[label].value] += n
        return {
            **extra,
            "requests": s.requests,
            "misses": s.misses,
            "by_label": {label.value: s.by_label[label] for label in Label if s.by_label[label]},
            "missed_tokens_by_label": {label.value: s.tokens_by_label[label] for label in Label
                                       if s.by_label[label]},
            "by_owner": dict(sorted(by_owner.items())),
            "by_kind": {kind: {label.value: n for label, n in sorted(c.items())}
                        for kind, c in sorted(self.by_kind.items())},
            "unknown_share": round(s.unknown_share, 4),
            "unknown_budget": UNKNOWN_BUDGET,
            "ground_truth": {
                label.value: {a.value: self.agreement[label][a] for a in Agreement}
                for label in Label if self.agreement.get(label)
            },
            "wrong_verdicts": len(self.wrong),
            "wrong": [{"request_id": w.request_id, "kind": w.kind, "worker": w.worker,
                       "route_policy": w.policy, "truth": w.truth.value,
                       "verdict": w.verdict.value, "reason": w.reason,
                       "true_holders_in_index": w.index_saw} for w in self.wrong],
            "streams": {worker: stream_health(stream) for worker, stream in streams.items()},
        }

    def render(self, summary: dict[str, Any]) -> str:
        s = self.summary
        out = [
            f"kvmiss demo: {summary['requests']} requests on {summary['workers']} simulated vLLM "
            f"workers (seed {summary['seed']}, faults: {','.join(summary['faults']) or 'none'}, "
            f"{summary['runtime_s']:.1f} s)",
            "",
            f"{'label':<18}{'owner':<13}{'requests':>9}{'missed tokens':>15}",
        ]
        for label in Label:
            if s.by_label[label]:
                out.append(f"{label.value:<18}{LABEL_OWNER[label].value:<13}"
                           f"{s.by_label[label]:>9}{s.tokens_by_label[label]:>15}")
        owners = ", ".join(f"{o} {n}" for o, n in summary["by_owner"].items())
        share = summary["unknown_share"]
        within = "within" if share <= UNKNOWN_BUDGET else "OVER"
        out += ["", f"by owner: {owners}",
                f"misses {s.misses} of {s.requests} requests; unknown share of misses "
                f"{share:.1%} ({within} the {UNKNOWN_BUDGET:.0%} budget)", ""]
        out.append(f"{'worker':<8}{'applied':>8}{'replayed':>9}{'gaps':>6}{'replays ok/failed':>19}"
                   f"{'unrecoverable':>15}{'epochs':>8}{'quarantine':>12}")
        for worker, h in summary["streams"].items():
            quarantine = f"{h['quarantine_s']:.1f}s" + (" NOW" if h["quarantined"] else "")
            out.append(f"{worker:<8}{h['batches_applied']:>8}{h['batches_replayed']:>9}"
                       f"{h['gaps_detected']:>6}"
                       f"{h['replays_recovered']:>11}/{h['replays_failed']:<7}"
                       f"{h['unrecoverable_gaps']:>15}{h['epoch_changes']:>8}{quarantine:>12}")
        out += ["", "ground truth (the simulator saw every cache at every lookup):",
                f"{'true label':<18}{'requests':>9}{'agree':>7}{'unknown':>9}{'WRONG':>7}"]
        for label, counts in summary["ground_truth"].items():
            total = sum(counts.values())
            out.append(f"{label:<18}{total:>9}{counts['agree']:>7}{counts['unknown']:>9}"
                       f"{counts['wrong']:>7}")
        if self.wrong:
            out += ["", "!" * 78, f"!!! {len(self.wrong)} WRONG VERDICT(S): kvmiss named a cause "
                    "that is not the true one", "!" * 78]
            out += [f"!!! {w.line()}" for w in self.wrong]
        else:
            out += ["", "wrong verdicts: 0 (every answer was the true cause or an honest unknown)"]
        out.append(f"records: {summary['out']}")
        return "\n".join(out)


def stream_health(stream: WorkerStream) -> dict[str, Any]:
    h = stream.health
    return {
        "batches_applied": h.batches_applied,
        "batches_replayed": h.batches_replayed,
        "gaps_detected": h.gaps_detected,
        "replays_requested": h.replays_requested,
        "replays_recovered": h.replays_recovered,
        "replays_failed": h.replays_failed,
        "unrecoverable_gaps": sum(h.unrecoverable_gaps.values()),
        "lost_batches": sum(h.lost_batches.values()),
        "epoch_changes": h.epoch_changes,
        "identity_unverified": h.identity_unverified,
        "quarantine_s": round(h.quarantine_s, 3),
        "quarantined": stream.quarantined,
    }
