"""Replay window sizing (shared/spec/ATTRIBUTION.md, "Replay window sizing").

The publisher's ring holds ``buffer_steps`` *batches* (vLLM default 10,000). It must cover
the longest consumer outage plus reconnect and catch-up at the peak batch rate, times a
burst safety factor; otherwise an outage becomes an unrecoverable hole and a quarantine.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable

VLLM_DEFAULT_BUFFER_STEPS = 10_000


def min_replay_window(peak_batches_per_s: float, outage_s: float, catchup_s: float,
                      safety_factor: float = 2.0) -> int:
    """Smallest ring, in batches, that survives the outage: ceil(peak x (outage + catch-up) x safety)."""
    for name, value in (("peak_batches_per_s", peak_batches_per_s), ("outage_s", outage_s),
                        ("catchup_s", catchup_s), ("safety_factor", safety_factor)):
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return math.ceil(peak_batches_per_s * (outage_s + catchup_s) * safety_factor - 1e-9)


def window_lasts_s(buffer_steps: int, peak_batches_per_s: float) -> float:
    """How long a ring of ``buffer_steps`` batches lasts at the peak rate, in seconds."""
    if peak_batches_per_s <= 0:
        return math.inf
    return buffer_steps / peak_batches_per_s


def peak_rate(timestamps: Iterable[float], window_s: float = 1.0) -> float:
    """The most batches seen in any ``window_s``-second window, per second.

    ``timestamps`` must be non-decreasing (arrival order); O(n) with a sliding window.
    """
    recent: collections.deque[float] = collections.deque()
    best = 0
    for ts in timestamps:
        recent.append(ts)
        while recent[0] <= ts - window_s:
            recent.popleft()
        best = max(best, len(recent))
    return best / window_s
