"""The bandwidth rule (DESIGN.md section 6): when the reader may use the GPU.

Two windows. The idle window: every `poll_s`, when no request runs or waits, read for at most
`burst_s`, checking before every chunk whether a request now waits (so one waits at most one
chunk). Inside a turn: between two rounds of the big model, the reader may use `share` of the
time since the turn's first token, in slices of at most `slice_s` of whole chunks.

Pure arithmetic on times in seconds; the clock belongs to the caller, so the live server and the
ledger replay run the same rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BandwidthRule:
    poll_s: float = 0.2
    burst_s: float = 2.0
    share: float = 0.02
    slice_s: float = 0.15

    def next_poll(self, t: float) -> float:
        """The first poll tick at or after t (ticks at multiples of poll_s)."""
        return math.ceil(round(t / self.poll_s, 9)) * self.poll_s

    def burst_allows(self, burst_start: float, now: float, chunk_s: float) -> bool:
        """Whether one more chunk fits in the idle burst that began at burst_start."""
        return now + chunk_s <= burst_start + self.burst_s + 1e-12

    def share_budget(self, first_token: float, now: float, used: float) -> float:
        """Seconds the reader may still use inside a turn whose first token came at first_token."""
        return self.share * max(0.0, now - first_token) - used

    def slice_chunks(self, budget_s: float, chunk_s: float) -> int:
        """Whole chunks in one slice: as many as the budget and the slice cap allow."""
        return max(0, int((min(budget_s, self.slice_s) + 1e-12) // chunk_s))
