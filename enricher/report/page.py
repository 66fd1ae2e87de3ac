"""The report as one self-contained HTML file (inline CSS, charts as base64 PNG), plus the
PNG files beside it. No scripts, fonts or images are fetched from anywhere."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from kvmiss.enricher.report.charts import Chart, all_charts, origin
from kvmiss.enricher.report.data import LABELS, NOT_MISSES, Row, Totals
from kvmiss.schemas.labels import info

DEFAULT_BUDGET = 0.05

CSS = """
body{font:14px/1.45 -apple-system,'Segoe UI',Roboto,'Helvetica Neue',Arial,sans-serif;
 color:#263238;background:#f5f7f8;margin:0}
main{max-width:1180px;margin:0 auto;padding:24px 28px 48px}
h1{font-size:26px;margin:0 0 4px}h2{font-size:19px;margin:34px 0 6px}
.sub{color:#607d8b;margin:0 0 18px}
.cards{display:flex;flex-wrap:wrap;gap:12px;margin:14px 0 6px}
.card{background:#fff;border-radius:10px;padding:12px 16px;min-width:150px;flex:1;
 box-shadow:0 1px 2px rgba(0,0,0,.08)}
.card .k{color:#607d8b;font-size:12px;text-transform:uppercase;letter-spacing:.04em}
.card .v{font-size:26px;font-weight:700}.card .n{color:#607d8b;font-size:12px}
.good .v{color:#2e7d32}.warn .v{color:#e65100}.bad .v{color:#c62828}
section{background:#fff;border-radius:10px;padding:16px 20px;margin-top:16px;
 box-shadow:0 1px 2px rgba(0,0,0,.08)}
section h2{margin-top:0}.explain{color:#546e7a;margin:2px 0 10px}
img{width:100%;height:auto;display:block}
table{border-collapse:collapse;width:100%;font-size:13px}
th{text-align:left;color:#607d8b;font-weight:600;border-bottom:2px solid #eceff1;padding:5px 8px}
td{border-bottom:1px solid #eceff1;padding:5px 8px}td.n,th.n{text-align:right;
 font-variant-numeric:tabular-nums}
.sw{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:7px;
 vertical-align:-1px}
.bar{background:#eceff1;border-radius:3px;height:9px;width:160px;display:inline-block}
.bar i{display:block;height:9px;border-radius:3px}
.two{display:grid;grid-template-columns:1fr 1fr;gap:22px}
.alert{background:#ffebee;color:#b71c1c;border-radius:8px;padding:10px 14px;font-weight:600}
.ok{background:#e8f5e9;color:#1b5e20;border-radius:8px;padding:10px 14px;font-weight:600}
footer{color:#90a4ae;font-size:12px;margin-top:26px}
code{background:#eceff1;border-radius:4px;padding:0 4px}
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _label(label: str) -> str:
    colour = info(label).colour if label in LABELS else "#999"
    return f'<span class="sw" style="background:{colour}"></span>{_e(label)}'


def _card(title: str, value: str, note: str = "", tone: str = "") -> str:
    return (f'<div class="card {tone}"><div class="k">{_e(title)}</div><div class="v">{_e(value)}'
            f'</div><div class="n">{_e(note)}</div></div>')


def _cards(totals: Totals, context: dict[str, Any]) -> str:
    budget = context.get("unknown_budget", DEFAULT_BUDGET)
    share = totals.unknown_share
    cards = [
        _card("requests", f"{totals.requests:,}", context.get("span_note", "")),
        _card("misses", f"{totals.misses:,}",
              f"{totals.misses / totals.requests:.0%} of requests" if totals.requests else ""),
        _card("missed tokens", f"{totals.missed_tokens:,}", "prefill the cache could have saved"),
        _card("unknown share", f"{share:.1%}", f"of misses; budget {budget:.0%} "
              f"({'within' if share <= budget else 'OVER'})", "good" if share <= budget else "warn"),
    ]
    if "wrong_verdicts" in context:
        wrong = context["wrong_verdicts"]
        cards.append(_card("wrong verdicts", str(wrong), "against the simulator's truth",
                           "good" if wrong == 0 else "bad"))
    spec = context.get("speculative") or {}
    if spec.get("p99_ms") is not None:
        cards.append(_card("route→stored p99", f"{spec['p99_ms']:g} ms",
                           f"p50 {spec.get('p50_ms')} · p95 {spec.get('p95_ms')} ms"))
    return '<div class="cards">' + "".join(cards) + "</div>"


def _summary_table(totals: Totals) -> str:
    top = max(totals.by_label.values(), default=1)
    rows = []
    for label in totals.labels():
        n = totals.by_label[label]
        width = 100 * n / top
        rows.append(
            f"<tr><td>{_label(label)}</td><td>{_e(info(label).owner.value)}</td>"
            f'<td class="n">{n:,}</td><td class="n">{n / totals.requests:.1%}</td>'
            f'<td><span class="bar"><i style="width:{width:.0f}%;background:'
            f'{info(label).colour}"></i></span></td>'
            f'<td class="n">{totals.tokens_by_label[label]:,}</td></tr>')
    owners = ", ".join(f"{_e(o)} {n:,}" for o, n in sorted(totals.by_owner.items()))
    return ('<table><tr><th>label</th><th>owner</th><th class="n">requests</th>'
            '<th class="n">share</th><th></th><th class="n">missed tokens</th></tr>'
            + "".join(rows) + f"</table><p class=explain>By owner: {owners}.</p>")


def _streams_table(streams: dict[str, Any]) -> str:
    if not streams:
        return ""
    columns = [("batches_applied", "applied"), ("batches_replayed", "replayed"),
               ("gaps_detected", "gaps"), ("replays_recovered", "replays ok"),
               ("replays_failed", "replays failed"), ("unrecoverable_gaps", "unrecoverable"),
               ("epoch_changes", "epochs"), ("quarantine_s", "quarantined s")]
    head = "".join(f'<th class="n">{_e(name)}</th>' for _, name in columns)
    body = "".join(
        f"<tr><td>{_e(worker)}</td>" + "".join(f'<td class="n">{_e(h.get(key, ""))}</td>'
                                               for key, _ in columns) + "</tr>"
        for worker, h in streams.items())
    return f"<table><tr><th>worker</th>{head}</tr>{body}</table>"


def _truth_table(context: dict[str, Any]) -> str:
    truth = context.get("ground_truth") or {}
    if not truth:
        return ""
    body = "".join(
        f'<tr><td>{_label(label)}</td><td class="n">{sum(c.values())}</td>'
        f'<td class="n">{c.get("agree", 0)}</td><td class="n">{c.get("unknown", 0)}</td>'
        f'<td class="n">{c.get("wrong", 0)}</td></tr>'
        for label in LABELS if (c := truth.get(label)))
    wrong = context.get("wrong") or []
    verdict = ('<p class="ok">Wrong verdicts: 0 — every answer was the true cause or an honest '
               "unknown.</p>" if not wrong else
               f'<p class="alert">{len(wrong)} WRONG verdict(s): ' + "; ".join(
                   f"{_e(w['request_id'])} said {_e(w['verdict'])}, truth {_e(w['truth'])}"
                   for w in wrong[:20]) + "</p>")
    return (verdict + '<table><tr><th>true label</th><th class="n">requests</th>'
            '<th class="n">agree</th><th class="n">unknown</th><th class="n">wrong</th></tr>'
            + body + "</table>")


def _section(chart: Chart | None, extra: str = "") -> str:
    if chart is None:
        return ""
    data = base64.b64encode(chart.png).decode()
    return (f"<section><h2>{_e(chart.title)}</h2><p class=explain>{_e(chart.explanation)}</p>"
            f'<img alt="{_e(chart.title)}" src="data:image/png;base64,{data}">{extra}</section>')


def render_html(rows: list[Row], context: dict[str, Any], charts: list[Chart]) -> str:
    totals = Totals(rows)
    by_name = {c.name: c for c in charts}
    todo = "".join(f"<tr><td>{_label(label)}</td><td>{_e(info(label).advice)}</td></tr>"
                   for label in totals.labels() if label not in NOT_MISSES)
    faults = context.get("fault_notes") or []
    t0 = origin(rows, context)
    parts = [
        f"<h1>{_e(context.get('title', 'kvmiss report: why requests missed the prefix cache'))}</h1>",
        f"<p class=sub>{_e(context.get('subtitle', ''))}</p>",
        _cards(totals, context),
        "<section><h2>Why requests missed</h2><p class=explain>Every request, by the one cause "
        "kvmiss could prove, with the prefill it cost; unknown_* is counted like any other "
        "answer.</p>" + _summary_table(totals) + "</section>",
        _section(by_name.get("labels_over_time.png")),
        _section(by_name.get("stream_health.png"), _streams_table(context.get("streams") or {})),
        _section(by_name.get("route_to_stored_latency.png")),
        _section(by_name.get("divergence.png")),
        _section(by_name.get("ground_truth.png"), _truth_table(context)),
        _section(by_name.get("whatif.png")),
        ("<section><h2>What to do about each miss</h2><table>" + todo + "</table></section>"
         if todo else ""),
        ("<section><h2>Injected faults</h2><ul>" + "".join(
            f"<li><b>{t - t0:.2f} s</b> &nbsp;{_e(note)}</li>" for t, note in faults)
         + "</ul></section>" if faults else ""),
        f"<footer>{_e(context.get('footer', ''))} Charts are also in this folder as PNG files: "
        + ", ".join(f"<code>{_e(c.name)}</code>" for c in charts) + ".</footer>",
    ]
    return ("<!doctype html><html lang=en><head><meta charset=utf-8>"
            "<meta name=viewport content='width=device-width,initial-scale=1'>"
            f"<title>{_e(context.get('title', 'kvmiss report'))}</title><style>{CSS}</style>"
            "</head><body><main>" + "".join(parts) + "</main></body></html>")


def write_report(rows: list[Row], context: dict[str, Any], out_dir: str | Path) -> Path:
    """Draw the charts, write them as PNGs and the HTML report into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    charts = all_charts(rows, context)
    for chart in charts:
        (out / chart.name).write_bytes(chart.png)
    path = out / "report.html"
    path.write_text(render_html(rows, context, charts), encoding="utf-8")
    return path
