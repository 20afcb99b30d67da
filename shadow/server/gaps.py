"""Long gaps in the streams, placed and taken apart. A user watching a stream sees its longest
gaps; this keeps every gap of `LONG_MS` or more between two tokens of a stream, with when it ended
(seconds since the epoch, to set beside a client's own times and the collector's pauses) and what
ran inside it, at the two places a gap can come from:

- `round`: on the device thread, between two tokens the embedded engine handed out: the engine's
  step (its round on the device), the shadow's work after the token before (of which the chunks
  read and the phrase step written, as charged), the collector's pauses, and the time the device
  was away at another request's slice;
- `write`: in the HTTP stream, between two writes that carried tokens (what the client receives).

A round gap without a write gap beside it never reached the client; a write gap without a round
gap came from the HTTP side (the event loop, the thread hop). `add` takes no lock but its write
gaps' histogram's (`timings.Histogram`)."""

from __future__ import annotations

import time
from collections import deque

from shadow.server.timings import TOKEN_SECONDS, Histogram

LONG_MS = 10.0  # a gap this long is kept (the stall a user notices)
KEEP = 64  # the last this many of each place


class LongGaps:
    """The last `keep` gaps of at least `long_ms` at each place, and how many there were."""

    def __init__(self, long_ms: float = LONG_MS, keep: int = KEEP):
        self.long_s = long_ms / 1000
        self._kept = {"round": deque(maxlen=keep), "write": deque(maxlen=keep)}
        self.counts = {"round": 0, "write": 0}
        self.writes = Histogram(TOKEN_SECONDS)  # every write gap, long or not: the streams' inter-token latency

    def add(self, place: str, seconds: float, parts: dict[str, float] | None = None) -> None:
        """A gap of `seconds` at `place` ("round" or "write") that ended now; `parts`: seconds of
        what ran inside it, by name. Kept only when it is long; a write gap is timed either way."""
        if place == "write":
            self.writes.observe(seconds)
        if seconds < self.long_s:
            return
        self.counts[place] += 1
        self._kept[place].append((time.time(), seconds, parts or {}))

    def status(self) -> dict:
        """Per place: the long gaps counted, and the last ones kept with when they ended and their
        parts, in milliseconds."""
        return {"long_ms": round(1000 * self.long_s, 3),
                **{place: {"count": self.counts[place],
                           "last": [{"at": round(at, 4), "ms": round(1000 * s, 3),
                                     **{f"{k}_ms": round(1000 * v, 3) for k, v in parts.items()}}
                                    for at, s, parts in list(kept)]}
                   for place, kept in self._kept.items()}}


class RoundClock:
    """One stream's round gaps on the device thread: `token` when the engine hands out a token
    (its step's seconds given), `after` once the shadow's work after that token is done (its
    seconds and what of it was charged to reads and the phrase), `away`/`back` around the device
    going to another request's slice. Each gap from one token to the next of `gaps.long_s` or more
    goes to `gaps` with its parts; a short one costs a clock read and a subtraction."""

    def __init__(self, gaps: LongGaps, collected=lambda: 0.0):
        self.gaps, self.collected = gaps, collected  # collected(): the collector's seconds so far
        self._at = None  # perf time of the last token
        self._gc = 0.0  # the collector's seconds then
        self._after = (0.0, 0.0, 0.0)  # the shadow's seconds after the last token, read, phrase
        self._away = 0.0
        self._away_at = None

    def token(self, step_s: float) -> None:
        now, collected = time.perf_counter(), self.collected()
        if self._at is not None and now - self._at >= self.gaps.long_s:
            shadow, read, phrase = self._after
            self.gaps.add("round", now - self._at, {"engine": step_s, "shadow": shadow, "read": read, "phrase": phrase,
                                                    "gc": collected - self._gc, "away": self._away})
        self._at, self._gc, self._after, self._away = now, collected, (0.0, 0.0, 0.0), 0.0

    def after(self, seconds: float, read_s: float, phrase_s: float) -> None:
        self._after = (seconds, read_s, phrase_s)

    def away(self) -> None:
        self._away_at = time.perf_counter()

    def back(self) -> None:
        if self._away_at is not None and self._at is not None:
            self._away += time.perf_counter() - self._away_at
        self._away_at = None
