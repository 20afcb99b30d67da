"""A plain histogram of durations: counts by upper bound, their sum and their number, added to by
the part that times something and read by the metrics at scrape time. No dependency, no lock of
its own: the caller holds the service's lock on both sides."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

# seconds: an ask is a few chunks and one fork (milliseconds on a GPU, seconds on a CPU or far behind)
ASK_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    """Observed values counted under each upper bound (a value equal to a bound counts under it,
    as Prometheus's `le`), with their sum and count."""

    def __init__(self, bounds: Sequence[float] = ASK_SECONDS):
        self.bounds = tuple(sorted(bounds))
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, values at or below it) for each bound and +inf, as a histogram exposes them."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            total += n
            out.append((bound, total))
        return out
