"""Replay a request ledger through the bandwidth rule: how far behind the shadow is at turn starts.

The big model's timeline is the ledger's (fixed: the reader's slices, at most the share, do not
move it). One reader reads whole grid chunks at a fixed cost (`read_ms_per_1k`). In the idle
window (no request running or waiting) it reads the session with the most recent turn first; with
the share on, while the engine decodes it reads the decoding requests' sessions (the newest turn
first, prompt then the output generated so far), the budget counted from the first token of the
engine's current decode stretch (one turn at a time, as in the source, when requests do not
overlap). At each turn start of a session that had earlier turns, "behind" is the session's ids
known before the turn (earlier prompts and outputs) not yet read; fresh = less than one chunk.
A prompt that shares less than was read (a re-rendered answer) rolls the session back to the last
grid line of the shared prefix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shadow.ledger import Request
from shadow.schedule import BandwidthRule


@dataclass(frozen=True)
class TurnStart:
    session: str
    start: float
    behind: int
    fresh: bool


@dataclass
class Arm:
    """One replay: its parameters and every measured turn start."""

    name: str
    share: float
    read_ms_per_1k: float
    turns: list[TurnStart] = field(default_factory=list)
    chunks_idle: int = 0
    chunks_share: int = 0
    rollbacks: int = 0

    @property
    def fresh_pct(self) -> float:
        return 100.0 * sum(t.fresh for t in self.turns) / len(self.turns) if self.turns else 0.0

    def behind_pct(self, q: float) -> int:
        """The q-th percentile (0..100) of tokens behind, nearest rank."""
        if not self.turns:
            return 0
        values = sorted(t.behind for t in self.turns)
        return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]


@dataclass
class _Session:
    name: str
    committed: int = 0
    current: Request | None = None

    def readable(self, t: float) -> int:
        r = self.current
        if r is None:
            return 0
        if t >= r.end:
            return r.prompt_tokens + r.output_tokens
        if t < r.first_token or r.end <= r.first_token:
            return r.prompt_tokens
        return r.prompt_tokens + int(r.output_tokens * (t - r.first_token) / (r.end - r.first_token))

    def time_readable(self, tokens: int) -> float:
        """When the current request makes `tokens` of the session readable (inf: never)."""
        r = self.current
        if r is None or tokens > r.prompt_tokens + r.output_tokens:
            return math.inf
        if tokens <= r.prompt_tokens:
            return r.start
        return r.first_token + (tokens - r.prompt_tokens) / r.output_tokens * (r.end - r.first_token)


def decode_stretches(requests: Sequence[Request]) -> list[tuple[float, float]]:
    """The union of the requests' [first_token, end) intervals, merged and sorted."""
    spans = sorted((r.first_token, r.end) for r in requests if r.end > r.first_token)
    merged: list[list[float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def replay(
    requests: Sequence[Request], read_ms_per_1k: float, grid: int = 512,
    rule: BandwidthRule = BandwidthRule(), use_share: bool = True, name: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Arm:
    chunk_s = grid * read_ms_per_1k / 1e6
    arm = Arm(name or ("idle + share" if use_share else "idle only"), rule.share if use_share else 0.0, read_ms_per_1k)
    reqs = sorted(requests, key=lambda r: r.start)
    stretches = decode_stretches(reqs) if use_share and chunk_s <= rule.slice_s else []
    sessions: dict[str, _Session] = {}
    recent: dict[str, None] = {}  # sessions that may have whole chunks to read, oldest turn first
    active: list[Request] = []  # started, not known to have ended
    state = {"t": 0.0, "stretch": 0, "used": 0.0}

    def pick_idle() -> _Session | None:
        found, stale = None, []
        for key in reversed(recent):
            s = sessions[key]
            if s.committed + grid <= s.readable(math.inf):
                found = s
                break
            stale.append(key)  # all read: nothing more until its next turn
        for key in stale:
            del recent[key]
        return found

    def pick_share(t: float, decoding: list[Request]) -> tuple[_Session | None, float]:
        """A session with a whole chunk readable at t, or None and when the next one will be."""
        soonest = math.inf
        for r in sorted(decoding, key=lambda r: -r.start):
            s = sessions[r.session]
            if s.current is not r:
                continue
            if s.committed + grid <= s.readable(t):
                return s, t
            soonest = min(soonest, s.time_readable(s.committed + grid))
        return None, soonest

    def read_until(t1: float) -> None:
        t = max(state["t"], 0.0)
        while t < t1:
            active[:] = [r for r in active if r.end > t]
            running = [r for r in active if r.start <= t]
            if not running:  # the idle window
                t = rule.next_poll(t)
                if t >= t1:
                    t = t1
                    break
                burst_start = t
                while t < t1 and rule.burst_allows(burst_start, t, chunk_s):
                    s = pick_idle()
                    if s is None:
                        t = t1
                        break
                    s.committed += grid
                    arm.chunks_idle += 1
                    t += chunk_s
                continue
            events = [r.first_token for r in running if r.first_token > t] + [r.end for r in running] + [t1]
            while state["stretch"] < len(stretches) and stretches[state["stretch"]][1] <= t:
                state["stretch"] += 1
                state["used"] = 0.0
            i = state["stretch"]
            if i >= len(stretches) or stretches[i][0] > t:  # waiting or prefilling: the reader waits
                t = min(events + ([stretches[i][0]] if i < len(stretches) else []))
                continue
            d0, d1 = stretches[i]
            ready = d0 + (state["used"] + chunk_s) / rule.share  # budget for one more chunk
            when = max(t, ready)
            if when >= min(d1, min(events)):
                t = min(d1, min(events))
                continue
            decoding = [r for r in running if r.first_token <= when < r.end]
            s, soonest = pick_share(when, decoding)
            if s is None:
                t = min(max(soonest, when + 1e-9), d1, min(events))
                continue
            s.committed += grid
            arm.chunks_share += 1
            state["used"] += chunk_s
            t = when + chunk_s
        state["t"] = t

    for n, r in enumerate(reqs):
        read_until(r.start)
        s = sessions.get(r.session)
        if s is None:
            s = sessions[r.session] = _Session(r.session)
        else:
            known = s.readable(r.start)
            behind = max(0, known - s.committed)
            arm.turns.append(TurnStart(r.session, r.start, behind, behind < grid))
        shared = r.prompt_tokens - r.new_prompt_tokens
        if shared < s.committed:
            s.committed = shared // grid * grid
            arm.rollbacks += 1
        s.current = r
        recent.pop(r.session, None)
        recent[r.session] = None
        active.append(r)
        if progress and n % 500 == 0:
            progress(n, len(reqs))
    return arm
