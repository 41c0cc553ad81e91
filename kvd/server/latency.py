"""Request latency histograms, per message type, kept by the daemon thread.

Plain counters in fixed buckets (Prometheus' cumulative convention is
applied when exported), so the daemon core needs no metrics library.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict

# Upper bounds in seconds: 50 us .. 10 s, then +Inf.
BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class Latency:
    """Per-type bucket counts, count and sum of observed durations."""

    def __init__(self) -> None:
        self.counts: defaultdict[str, list[int]] = defaultdict(lambda: [0] * (len(BUCKETS) + 1))
        self.sums: defaultdict[str, float] = defaultdict(float)

    def observe(self, mtype: str, seconds: float) -> None:
        self.counts[mtype][bisect_left(BUCKETS, seconds)] += 1
        self.sums[mtype] += seconds

    def snapshot(self) -> dict[str, tuple[list[int], float]]:
        """{type: (per-bucket counts, last one +Inf; sum)} -- a copy."""
        return {t: (list(c), self.sums[t]) for t, c in self.counts.items()}
