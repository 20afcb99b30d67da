"""What an operator reads off a replay: freshness at turn starts (behind the ids held, and ready
for the part of the new prompt known before it came), the wait an ask would have (at turn
starts and at random times), each turn's time until its prompt was read, each session's worst lag,
the share of sessions ever stale, the same in the busiest windows, and the load beside it.

`summary(arm, windows, grid)` is one nested dict of plain numbers (the CLI's tables and `--json`);
`METRICS` names every figure a target may be set on (`targets.Target`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from shadow.offline.timelines import Window


def pct(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by nearest rank; None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def spread(values: Sequence[float], qs=(50, 90, 99), scale: float = 1.0, digits: int = 3) -> dict:
    """{"p50": .., "p90": .., "p99": .., "max": ..} of values times `scale` (None where empty, or
    where the value is infinite: never)."""
    out = {f"p{q:g}": pct(values, q) for q in qs}
    out["max"] = max(values) if values else None
    return {k: None if v is None or math.isinf(v) else round(v * scale, digits) for k, v in out.items()}


def peak_windows(windows: Sequence[Window]) -> set[tuple[int, float]]:
    """(engine, start) of each engine's busiest windows: new tokens per second at or above that
    engine's 90th percentile of its windows."""
    out = set()
    for e in {w.engine for w in windows}:
        mine = [w for w in windows if w.engine == e]
        line = pct([w.new_tok_s for w in mine], 90)
        out |= {(e, w.start) for w in mine if w.new_tok_s >= line and w.new_tok_s > 0}
    return out


class _Peak:
    """Whether (engine, time) falls in one of the engine's busiest windows (O(1) a question)."""

    def __init__(self, windows: Sequence[Window]):
        self.peak = peak_windows(windows)
        self.t0 = min((w.start for w in windows), default=0.0)
        self.width = max((w.seconds for w in windows), default=1.0) or 1.0
        self.starts = sorted({w.start for w in windows})

    def __call__(self, engine: int, t: float) -> bool:
        if not self.starts:
            return False
        k = min(len(self.starts) - 1, max(0, int((t - self.t0) // self.width)))
        return (engine, self.starts[k]) in self.peak


def load(windows: Sequence[Window]) -> dict:
    """The load over time, every engine's windows together: sessions active, new tokens per
    second, state GiB (p50, p90, peak)."""
    def of(values):
        return {"p50": pct(values, 50), "p90": pct(values, 90), "peak": max(values) if values else None}

    out = {"windows": len(windows), "window_s": round(windows[0].seconds, 3) if windows else None,
           "active": of([w.active for w in windows]), "new_tok_s": of([w.new_tok_s for w in windows])}
    gib = [w.state_gib for w in windows if w.state_gib is not None]
    out["state_gib"] = of(gib) if gib else None
    for key in ("active", "new_tok_s", "state_gib"):
        if out[key]:
            out[key] = {k: None if v is None else round(v, 2 if key != "new_tok_s" else 1) for k, v in out[key].items()}
    return out


def summary(arm, windows: Sequence[Window], grid: int) -> dict:
    """Every figure of one arm (see the module docstring)."""
    starts, probes = arm.turns, arm.probes
    peak = _Peak(windows)
    worst: dict[str, int] = {}
    stale: set[str] = set()
    for s, lag in [(t.session, t.behind) for t in starts] + [(p.session, p.lag) for p in probes]:
        worst[s] = max(worst.get(s, 0), lag)
        if lag >= grid:
            stale.add(s)
    sessions = {t.session for t in starts} | {p.session for p in probes} | {f.session for f in arm.to_fresh}
    for s in sessions:
        worst.setdefault(s, 0)
    peak_starts = [t for t in starts if peak(t.engine, t.start)]
    peak_probes = [p for p in probes if peak(p.engine, p.time)]
    fresh_times = [math.inf if f.censored else f.seconds for f in arm.to_fresh]  # never fresh: past every time
    return {
        "turn_starts": {"n": len(starts), "fresh_pct": _pct_of(starts, lambda t: t.fresh),
                        "behind": spread([t.behind for t in starts], (50, 90, 99), digits=0),
                        "ready_pct": _pct_of(starts, lambda t: t.to_prompt < grid),
                        "to_prompt": spread([t.to_prompt for t in starts], (50, 90, 99), digits=0),
                        "ask_wait_ms": spread([t.wait_s for t in starts], scale=1000)},
        "random": {"n": len(probes), "ask_wait_ms": spread([p.wait_s for p in probes], scale=1000),
                   "lag": spread([p.lag for p in probes], digits=0),
                   "stale_pct": _pct_of(probes, lambda p: p.lag >= grid)},
        "to_fresh_s": {**spread(fresh_times), "n": len(fresh_times),
                       "never": sum(f.censored for f in arm.to_fresh),
                       "never_pct": _pct_of(arm.to_fresh, lambda f: f.censored)},
        "sessions": {"n": len(sessions), "ever_stale_pct": round(100 * len(stale) / len(sessions), 2) if sessions else None,
                     "worst_lag": spread(list(worst.values()), digits=0)},
        "peak": {"windows": len(peak.peak), "turn_starts": len(peak_starts),
                 "fresh_pct": _pct_of(peak_starts, lambda t: t.fresh),
                 "ask_wait_ms": spread([p.wait_s for p in peak_probes], scale=1000),
                 "turn_start_ask_wait_ms": spread([t.wait_s for t in peak_starts], scale=1000)},
        "store": {"spills": arm.spills, "restores": arm.restores, "drops": arm.drops,
                  "restore_s": round(arm.restore_s, 3), "spill_s": round(arm.spill_s, 3),
                  "to_host": arm.to_host, "from_host": arm.from_host, "host_s": round(arm.host_s, 3),
                  "restores_ahead": arm.restores_ahead},
        "asks": _asks(arm.asks),
        "voice_s": round(arm.voice_s, 3),
    }


def _asks(asks: list) -> dict:
    """The asks answered (`engine_replay.Answered`): the wait until each answer and, of it, the wait
    for the device; by kind where the asks came with one (`ReplayLimits.asks_at`)."""
    def of(some: list) -> dict:
        return {"n": len(some), "wait_ms": spread([a.wait_s for a in some], scale=1000),
                "queued_ms": spread([a.queued_s for a in some], scale=1000)}

    kinds = sorted({a.kind for a in asks if a.kind is not None})
    return {**of(asks), **({"by_kind": {k: of([a for a in asks if a.kind == k]) for k in kinds}} if kinds else {})}


def _pct_of(items, test: Callable) -> float | None:
    return round(100 * sum(1 for x in items if test(x)) / len(items), 2) if items else None


# figures a target may name: (path in `summary`, unit, whether more is better)
METRICS: dict[str, tuple[tuple[str, ...], str, bool]] = {
    "fresh": (("turn_starts", "fresh_pct"), "%", True),
    "ask wait": (("random", "ask_wait_ms"), "ms", False),
    "turn-start ask wait": (("turn_starts", "ask_wait_ms"), "ms", False),
    "time to fresh": (("to_fresh_s",), "s", False),
    "lag": (("random", "lag"), "tokens", False),
    "behind": (("turn_starts", "behind"), "tokens", False),
    "worst lag": (("sessions", "worst_lag"), "tokens", False),
    "stale sessions": (("sessions", "ever_stale_pct"), "%", False),
    "stale": (("random", "stale_pct"), "%", False),
    "peak fresh": (("peak", "fresh_pct"), "%", True),
    "peak ask wait": (("peak", "ask_wait_ms"), "ms", False),
}
