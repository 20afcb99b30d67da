"""Histograms of durations: counts by upper bound, their sum and their number, added to by the
part that times something and read by the metrics at scrape time (`snapshot`, a copy taken
under the histogram's own lock, so a scrape never sees a count without its sum).

The bounds of each kind of duration (seconds, as Prometheus's base unit) and `Freshness`, which
times each turn's session until the shadow has read its prompt.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence

# an ask is a few chunks and one fork (milliseconds on a GPU, seconds on a CPU or far behind)
ASK_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# a request: to its first token, to its end (vLLM's bounds, cut at 10 minutes)
REQUEST_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 600.0)
# between two writes of a stream's tokens
TOKEN_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# one chunk read, a spill, a restore (milliseconds on a GPU, seconds for a large session on a CPU)
DEVICE_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# the shadow's own bookkeeping between two rounds (microseconds)
ROUND_SECONDS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025)
# a session from its turn's start until its prompt is read (the time to fresh of docs/FRESHNESS.md)
FRESH_SECONDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class Histogram:
    """Observed values counted under each upper bound (a value equal to a bound counts under it,
    as Prometheus's `le`), with their sum and count. Safe to observe from any thread."""

    def __init__(self, bounds: Sequence[float] = ASK_SECONDS):
        self.bounds = tuple(sorted(bounds))
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.bounds, value)] += 1
            self.sum += value
            self.count += 1

    def snapshot(self) -> "Histogram":
        """A copy of it now, whole."""
        out = Histogram(self.bounds)
        with self._lock:
            out.counts, out.sum, out.count = list(self.counts), self.sum, self.count
        return out

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, values at or below it) for each bound and +inf, as a histogram exposes them."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            total += n
            out.append((bound, total))
        return out


class Freshness:
    """Each turn's time to fresh: from the turn's start until its session's read position reaches
    the grid line of its prompt (`due` when the prompt is fed, `reached` whenever the session's
    position is told). A session whose next prompt comes first was never fresh for the turn
    before (`never`). The caller holds the service's lock."""

    def __init__(self):
        self.seconds = Histogram(FRESH_SECONDS)
        self.never = 0
        self._due: dict[str, tuple[float, int]] = {}  # session -> (its turn's start, the line to reach)

    def due(self, name: str, started: float, line: int) -> None:
        if self._due.pop(name, None) is not None:
            self.never += 1
        self._due[name] = (started, line)

    def reached(self, name: str, committed: int | None, now: float) -> None:
        """The session's read position now (None: not resident)."""
        due = self._due.get(name)
        if due is not None and committed is not None and committed >= due[1]:
            del self._due[name]
            self.seconds.observe(max(0.0, now - due[0]))


class ServiceTimes:
    """The service's own latencies: each turn's from its start to its first token (its first
    streamed event behind a proxy, its first generated token embedded), and each session file
    written (`spill`: a spill, a host copy written out, a write at the stop) and read back
    (`restore`), as the store times them (`stored`, its `timed`)."""

    def __init__(self):
        self.first_token = Histogram(REQUEST_SECONDS)
        self.spill = Histogram(DEVICE_SECONDS)
        self.restore = Histogram(DEVICE_SECONDS)

    def stored(self, kind: str, seconds: float) -> None:
        (self.spill if kind == "spill" else self.restore).observe(seconds)
