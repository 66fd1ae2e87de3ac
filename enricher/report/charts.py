"""The report's charts, drawn with matplotlib's headless Agg backend into PNG bytes.

Each function takes rows (and the optional context) and returns a `Chart` -- file name,
title, one explanatory line, PNG bytes -- or None when its input has nothing to show.
Every chart uses the same colour per label (its `colour` in schemas/labels.py). Times are
seconds since the report's origin ``t0`` (the earliest lookup or stream fact).
"""

from __future__ import annotations

import collections
import io
import math
from dataclasses import dataclass
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.patches import Patch  # noqa: E402

from kvmiss.enricher.report.data import LABELS, NOT_MISSES, UNKNOWN, Row  # noqa: E402
from kvmiss.schemas.labels import info  # noqa: E402

INK, MUTED, GRID = "#263238", "#607d8b", "#eceff1"
DPI = 130


@dataclass
class Chart:
    name: str  # file name, e.g. "labels_over_time.png"
    title: str
    explanation: str
    png: bytes


def _style() -> None:
    plt.rcParams.update({
        "font.size": 9, "axes.titlesize": 11, "axes.titleweight": "bold",
        "axes.edgecolor": "#b0bec5", "axes.labelcolor": INK, "xtick.color": MUTED,
        "ytick.color": MUTED, "axes.spines.top": False, "axes.spines.right": False,
        "axes.grid": True, "grid.color": GRID, "axes.axisbelow": True,
        "legend.frameon": False, "figure.facecolor": "white",
    })


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def origin(rows: list[Row], context: dict[str, Any]) -> float:
    times = [r.lookup_time for r in rows if r.lookup_time]
    times += [f[0] for f in context.get("faults", ())]
    for lane in context.get("timeline", {}).values():
        times += [a[0] for a in lane.get("applied", ())[:1]]
    return min(times) if times else 0.0


def _bucket(span: float) -> float:
    for size in (0.1, 0.2, 0.25, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600):
        if span / size <= 45:
            return size
    return 3600 * math.ceil(span / 3600 / 45)


# Only `kvmiss demo` injects faults (its context lists them); a user's own data has none.
_FAULT_NOTE = " Dashed red lines: the faults the demo injected."
FAULT_NAMES = {"lag_on": "lag", "drop": "drop (replayed)", "hole": "hole", "crash": "crash"}


def _fault_marks(ax, context: dict[str, Any], t0: float, text: bool = True) -> None:
    for t, worker, action, _ in context.get("faults", ()):
        x = t - t0
        ax.axvline(x, color="#b71c1c", lw=0.8, ls=(0, (3, 3)), alpha=0.6, zorder=1)
        if text:
            name = FAULT_NAMES.get(action, action)
            ax.annotate(f"{worker} {name}", (x, 1.0), xycoords=("data", "axes fraction"),
                        rotation=90, fontsize=7, color="#b71c1c", ha="right", va="top",
                        xytext=(-2, -2), textcoords="offset points")


def labels_over_time(rows: list[Row], context: dict[str, Any]) -> Chart | None:
    timed = [r for r in rows if r.lookup_time]
    if not timed:
        return None
    _style()
    t0 = origin(rows, context)
    span = max(r.lookup_time for r in timed) - t0
    size = _bucket(max(span, 0.1))
    buckets = int(span // size) + 1
    xs = [i * size for i in range(buckets)]
    total = [0] * buckets
    counts = {label: [0] * buckets for label in LABELS}
    tokens = {label: [0] * buckets for label in LABELS}
    for r in timed:
        i = min(buckets - 1, int((r.lookup_time - t0) // size))
        total[i] += 1
        counts[r.label][i] += 1
        tokens[r.label][i] += r.missed_tokens
    misses = [label for label in LABELS if label not in NOT_MISSES and any(counts[label])]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 5.6), sharex=True,
                                      gridspec_kw={"height_ratios": [1, 1], "hspace": 0.12})
    top.bar(xs, total, width=size * 0.92, align="edge", color="#eceff1", label="all requests")
    for ax, series in ((top, counts), (bottom, tokens)):
        base = [0] * buckets
        for label in misses:
            ax.bar(xs, series[label], width=size * 0.92, align="edge", bottom=base,
                   color=info(label).colour, label=label, linewidth=0)
            base = [b + v for b, v in zip(base, series[label])]
        _fault_marks(ax, context, t0, text=ax is top)
    top.set_ylabel(f"requests per {size:g} s")
    bottom.set_ylabel(f"missed tokens per {size:g} s")
    bottom.set_xlabel("seconds since the first request")
    handles = [Patch(color="#eceff1", label="all requests")] + [
        Patch(color=info(label).colour, label=label) for label in misses]
    top.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8,
               bbox_to_anchor=(0.5, 1.0), handlelength=1.2, columnspacing=1.2)
    return Chart("labels_over_time.png", "Misses and missed tokens by label over time",
                 "Each bar is one time bucket: the grey backdrop is every request, the coloured "
                 "stack the misses by cause (top) and the prefill they cost (bottom)."
                 + _FAULT_NOTE * bool(context.get("faults")), _png(fig))


def stream_health(rows: list[Row], context: dict[str, Any]) -> Chart | None:
    timeline = context.get("timeline") or {}
    workers = sorted(set(timeline) | {r.worker for r in rows if r.worker})
    if not workers:
        return None
    _style()
    t0 = origin(rows, context)
    fig, ax = plt.subplots(figsize=(11, 0.75 * len(workers) + 1.6))
    end = max([r.lookup_time - t0 for r in rows if r.lookup_time] + [0.0])
    for lane in timeline.values():
        end = max([end] + [a[0] - t0 for a in lane.get("applied", ())])
    for y, worker in enumerate(workers):
        lane = timeline.get(worker, {})
        groups: dict[str, list[float]] = collections.defaultdict(list)
        for ts, recv_ts, replayed in lane.get("applied", ()):
            kind = "replayed" if replayed else "late" if recv_ts - ts > 0.25 else "live"
            groups[kind].append(ts - t0)
        for kind, color in (("live", "#90a4ae"), ("late", "#fbc02d"), ("replayed", "#fb8c00")):
            if groups[kind]:
                ax.vlines(groups[kind], y - 0.28, y + 0.28, color=color, lw=0.7)
        quarantined_from = None
        for t, kind, _ in lane.get("facts", ()):
            x = t - t0
            if kind == "quarantine":
                quarantined_from = x if quarantined_from is None else quarantined_from
            elif kind in ("release", "new_epoch") and quarantined_from is not None:
                ax.broken_barh([(quarantined_from, x - quarantined_from)], (y - 0.42, 0.84),
                               color="#e53935", alpha=0.18)
                quarantined_from = None
            if kind == "hole":
                ax.plot([x], [y + 0.36], marker="X", color="#c62828", ms=8, zorder=5)
            elif kind == "new_epoch":
                ax.plot([x, x], [y - 0.45, y + 0.45], color=INK, lw=2.2, zorder=5)
                ax.annotate("new epoch", (x, y + 0.45), fontsize=7, color=INK,
                            xytext=(3, -2), textcoords="offset points", va="top")
            elif kind == "epoch_uncertain":
                ax.plot([x], [y + 0.36], marker="D", color="#6a1b9a", ms=6, zorder=5)
        if quarantined_from is not None:
            ax.broken_barh([(quarantined_from, end - quarantined_from)], (y - 0.42, 0.84),
                           color="#e53935", alpha=0.18)
        if not timeline:  # no stream data: every verdict on the lane, coloured by label
            for label in LABELS:
                xs = [r.lookup_time - t0 for r in rows
                      if r.worker == worker and r.label == label and r.lookup_time]
                if xs:
                    ax.vlines(xs, y - 0.25, y + 0.25, color=info(label).colour, lw=0.9)
        for label in sorted(UNKNOWN):
            xs = [r.lookup_time - t0 for r in rows
                  if r.worker == worker and r.label == label and r.lookup_time]
            if xs:
                ax.plot(xs, [y - 0.36] * len(xs), "o", ms=3.5, color=info(label).colour)
    ax.set_xlim(-0.02 * end, end * 1.02 + 0.01)
    ax.set_yticks(range(len(workers)), workers)
    ax.set_ylim(-0.7, len(workers) - 0.3)
    ax.invert_yaxis()
    ax.grid(axis="y", visible=False)
    ax.set_xlabel("seconds since the first request (engine clock)")
    legend = [Patch(color="#90a4ae", label="batch applied"),
              Patch(color="#fbc02d", label="arrived > 0.25 s late"),
              Patch(color="#fb8c00", label="recovered by replay"),
              plt.Line2D([], [], marker="X", color="#c62828", ls="", label="unrecoverable hole"),
              Patch(color="#e53935", alpha=0.3, label="quarantined"),
              plt.Line2D([], [], color=INK, lw=2.2, label="new epoch (restart)"),
              plt.Line2D([], [], marker="D", color="#6a1b9a", ls="", label="epoch uncertain"),
              plt.Line2D([], [], marker="o", color=info("unknown_history").colour, ls="",
                         label="unknown_history verdict"),
              plt.Line2D([], [], marker="o", color=info("unknown_epoch").colour, ls="",
                         label="unknown_epoch verdict")]
    if not timeline:
        legend = [Patch(color=info(label).colour, label=label) for label in LABELS
                  if any(r.label == label for r in rows)] + legend[-2:]
    ax.legend(handles=legend, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=5, fontsize=8,
              handlelength=1.4)
    _fault_marks(ax, context, t0, text=False)
    explanation = ("One lane per worker: every KV-event batch kvmiss applied (grey; amber when "
                   "it arrived late, orange when replay recovered it), holes replay could not "
                   "fill (red X), quarantine (red band) and restarts (black bar); the dots above a "
                   "lane are unknown verdicts for requests routed to that worker, at their lookup "
                   "times." + _FAULT_NOTE * bool(context.get("faults")))
    title = "Stream health per worker"
    if not timeline:
        title = "Verdicts per worker over time"
        explanation = ("No stream data in this input (kvmiss report --recording FILE adds it from a "
                       "`kvmiss collect --record` recording of the same period): each lane shows every "
                       "request routed to that worker, coloured by label, with the unknown verdicts "
                       "marked above it.")
    return Chart("stream_health.png", title, explanation, _png(fig))


def latency(context: dict[str, Any]) -> Chart | None:
    spec = context.get("speculative") or {}
    samples = [s for s in spec.get("samples_ms", ()) if s > 0]
    if not samples:
        return None
    _style()
    fig, ax = plt.subplots(figsize=(11, 3.4))
    low, high = max(min(samples), 0.05), max(samples)
    edges = [low * (high / low) ** (i / 60) for i in range(61)] if high > low else [low, low * 2]
    ax.hist(samples, bins=edges, color="#78909c", edgecolor="white", linewidth=0.3)
    ax.set_xscale("log")
    for key, color in (("p50_ms", "#2e7d32"), ("p95_ms", "#ef6c00"), ("p99_ms", "#c62828")):
        value = spec.get(key)
        if value:
            ax.axvline(value, color=color, lw=1.6)
            ax.annotate(f"{key[:3]} {value:g} ms", (value, 0.97), xycoords=("data", "axes fraction"),
                        color=color, fontsize=8, fontweight="bold", xytext=(4, 0),
                        textcoords="offset points", va="top")
    ax.set_xlabel("route decision -> BlockStored received by kvmiss (ms, log scale)")
    ax.set_ylabel("blocks")
    explanation = (f"{spec.get('confirmed', 0)} speculative entries confirmed by a store, "
                   f"{spec.get('expired', 0)} expired unconfirmed after {spec.get('ttl_s', '?')} s "
                   "(stores lost in holes or with a crashed process). The p99 sizes the history "
                   "wait and speculative TTL.")
    return Chart("route_to_stored_latency.png", "Route-to-BlockStored latency", explanation,
                 _png(fig))


def divergence(rows: list[Row]) -> Chart | None:
    no_match = [r for r in rows if r.label == "no_match"]
    digests = collections.Counter(r.first_miss_digest for r in rows
                                  if r.first_miss_digest and r.label not in NOT_MISSES)
    if not no_match and not digests:
        return None
    _style()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"wspace": 0.55})
    indices = [r.divergence_token for r in no_match
               if r.divergence_kind == "tokens" and r.divergence_token is not None]
    kinds = collections.Counter(k for r in no_match if r.divergence_kind == "extra_keys"
                                for k in (r.extra_key_kinds or ("extra keys",)))
    carried = collections.Counter(k for r in no_match for k in r.extra_key_kinds)
    if indices:
        step = max(1, math.ceil((max(indices) + 1) / 40))
        left.hist(indices, bins=range(0, max(indices) + step + 1, step),
                  color=info("no_match").colour, edgecolor="white", linewidth=0.4)
        left.set_xlabel("first differing token index in the prompt")
        left.set_ylabel("no_match requests")
    else:
        left.text(0.5, 0.5, "no token divergence detail\n(routers opt in with kvmiss.token_ids)",
                  ha="center", va="center", color=MUTED, transform=left.transAxes)
        left.set_xticks([])
        left.set_yticks([])
    note = ", ".join(f"{k} {n}" for k, n in kinds.most_common()) or "none"
    salted = ", ".join(f"{k} {n}" for k, n in carried.most_common()) or "none"
    left.set_title(f"Where no_match prompts diverged ({len(indices)} with a differing token)",
                   fontsize=9)
    left.text(0.5, -0.2, f"same tokens, other extra keys: {note}\n"
              f"no_match requests carrying extra keys: {salted}", transform=left.transAxes,
              ha="center", va="top", fontsize=8, color=MUTED)
    top = digests.most_common(10)
    if top:
        names = [d for d, _ in top][::-1]
        base = [0] * len(names)
        present = [label for label in LABELS if label not in NOT_MISSES]
        for label in present:
            values = [sum(1 for r in rows if r.first_miss_digest == d and r.label == label)
                      for d in names]
            if any(values):
                right.barh(names, values, left=base, color=info(label).colour, label=label)
                base = [b + v for b, v in zip(base, values)]
        right.tick_params(axis="y", labelsize=7)
        right.set_xlabel("misses at this block")
        right.legend(fontsize=7, loc="lower right")
    right.set_title("Most common first-miss blocks (keyed digests)", fontsize=9)
    return Chart("divergence.png", "Where requests first missed",
                 "Left: for no_match requests that shared a parent block with a chain the worker "
                 "had, the prompt index of the first differing token. Right: the blocks most "
                 "misses stopped at, by keyed digest (never token values), coloured by label.",
                 _png(fig))


def agreement(context: dict[str, Any]) -> Chart | None:
    truth = context.get("ground_truth") or {}
    if not truth:
        return None
    _style()
    labels = [label for label in LABELS if label in truth][::-1]
    fig, ax = plt.subplots(figsize=(11, 0.32 * len(labels) + 1.2))
    base = [0] * len(labels)
    for key, color, name in (("agree", "#43a047", "kvmiss named the true cause"),
                             ("unknown", "#9e9e9e", "kvmiss said unknown (honest)"),
                             ("wrong", "#d32f2f", "WRONG cause")):
        values = [truth[label].get(key, 0) for label in labels]
        ax.barh(labels, values, left=base, color=color, label=name)
        base = [b + v for b, v in zip(base, values)]
    for y, label in enumerate(labels):
        counts = truth[label]
        ax.annotate(f"{counts.get('agree', 0)} / {sum(counts.values())}", (base[y], y),
                    xytext=(4, 0), textcoords="offset points", va="center", fontsize=8, color=INK)
    ax.set_xlabel("requests, by the simulator's true label")
    ax.legend(fontsize=8, loc="lower right")
    return Chart("ground_truth.png", "Ground-truth agreement",
                 "The simulator saw every block pool at every lookup: each bar is one true label, "
                 "split by what kvmiss answered. Unknown is allowed; a wrong cause is not.",
                 _png(fig))


def whatif(context: dict[str, Any]) -> Chart | None:
    """What a larger pool would have kept of the tokens evicted misses lost (an estimate)."""
    spec = context.get("whatif") or {}
    shares = spec.get("kept_share_by_scale") or {}
    if not spec.get("evicted_tokens") or not shares:
        return None
    _style()
    fig, ax = plt.subplots(figsize=(11, 2.8))
    scales = list(shares)
    values = [shares[s] * 100 for s in scales]
    ax.bar([f"{s}x" for s in scales], values, color="#5c6bc0")
    for x, v in enumerate(values):
        ax.annotate(f"{v:.0f} %", (x, v), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8, color=INK)
    ax.set_ylim(0, 110)
    ax.set_ylabel("evicted tokens kept (%)")
    ax.set_xlabel("pool size, as a multiple of each worker's")
    most = spec.get("scale_keeping_most")
    explanation = (f"Of the {spec['evicted_tokens']} prompt tokens lost to evicted misses, the share a pool of each "
                   "size would have kept cached, from the evictions counted between each block's removal and its "
                   "lookup (kvmiss.whatif.scale on each span). " + (f"{most}x the pool recovers most of them. "
                   if most else "") + "A model estimate under vLLM's pool policy: it never changes a label.")
    return Chart("whatif.png", "What a larger cache would buy (estimate)", explanation, _png(fig))


def all_charts(rows: list[Row], context: dict[str, Any]) -> list[Chart]:
    charts = [labels_over_time(rows, context), stream_health(rows, context), latency(context),
              divergence(rows), agreement(context), whatif(context)]
    return [c for c in charts if c is not None]
