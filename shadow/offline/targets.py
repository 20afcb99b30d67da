"""A target on one of a replay's figures, and the smallest share that meets it.

A target is `[pNN|max] METRIC OP NUMBER [UNIT]`: "p99 ask wait <= 50 ms", "p90 time to fresh <= 2 s",
"stale sessions <= 5 %", "fresh >= 97 %", "peak fresh >= 95 %", "ready >= 97 %". The metrics are
`metrics.METRICS` and "ready" (`TARGET_METRICS`: the share of turn starts ready for the new prompt,
under a chunk to read to stand at the part of it known before it came); a metric with percentiles
needs one (pNN among p50, p90, p99, or max), a plain one takes none. A bare number N is "fresh >= N
%" (the share of turn starts fresh). Percentiles of empty sets (no turn start, no probe) are
missing, and a missing figure meets no target.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from shadow.offline.metrics import METRICS

# figures a target may name: `metrics.METRICS`, and the turn starts ready for the new prompt
TARGET_METRICS: dict[str, tuple[tuple[str, ...], str, bool]] = {
    **METRICS, "ready": (("turn_starts", "ready_pct"), "%", True)}
UNITS = {"ms": "ms", "s": "s", "%": "%", "tokens": "tokens", "token": "tokens"}
OPS = {"<=": "<=", "≤": "<=", "<": "<", ">=": ">=", "≥": ">=", ">": ">"}
_FORM = re.compile(r"^\s*(?:(p\d+(?:\.\d+)?|max|median)\s+)?([a-z][a-z -]*?)\s*(<=|>=|≤|≥|<|>)\s*"
                   r"([0-9]+(?:\.[0-9]+)?)\s*(ms|s|%|tokens?|)\s*$")


@dataclass(frozen=True)
class Target:
    """`metric` (a TARGET_METRICS name), `stat` (p50, p90, p99, max, or None for a plain figure), `op`,
    `value` in the metric's own unit."""

    metric: str
    stat: str | None
    op: str
    value: float

    @property
    def text(self) -> str:
        unit = TARGET_METRICS[self.metric][1]
        return f"{self.stat + ' ' if self.stat else ''}{self.metric} {self.op} {self.value:g} {unit}"

    @property
    def higher_is_better(self) -> bool:
        return self.op in (">=", ">")

    def figure(self, summary: dict) -> float | None:
        """The figure this target is on, in `summary` (`metrics.summary`)."""
        node = summary
        for key in TARGET_METRICS[self.metric][0]:
            node = node.get(key) if isinstance(node, dict) else None
        if self.stat is not None:
            node = node.get(self.stat) if isinstance(node, dict) else None
        return node if isinstance(node, (int, float)) else None

    def met(self, value: float | None) -> bool:
        if value is None:
            return False
        return {"<=": value <= self.value, "<": value < self.value, ">=": value >= self.value,
                ">": value > self.value}[self.op]


def parse_target(text: str) -> Target:
    """A target from its text; ValueError with what is wrong."""
    text = text.strip()
    try:
        number = float(text)
    except ValueError:
        number = None
    if number is not None:
        if not 0 < number <= 100:
            raise ValueError(f"is a percentage in (0, 100] or a target such as 'p99 ask wait <= 50 ms' (got {text})")
        return Target("fresh", None, ">=", number)
    m = _FORM.match(text.lower())
    if m is None:
        raise ValueError(f"a target reads like 'p99 ask wait <= 50 ms' or 'fresh >= 97 %' (got {text!r})")
    stat, metric, op, value, unit = m.groups()
    metric = metric.strip()
    if metric not in TARGET_METRICS:
        raise ValueError(f"unknown metric {metric!r} in {text!r} (metrics: {', '.join(TARGET_METRICS)})")
    _, own, _ = TARGET_METRICS[metric]
    has_stats = own != "%" and metric not in ("fresh", "peak fresh")
    stat = "p50" if stat == "median" else stat
    if has_stats and stat not in ("p50", "p90", "p99", "max"):
        raise ValueError(f"{metric!r} needs p50, p90, p99 or max before it (got {text!r})")
    if not has_stats and stat is not None:
        raise ValueError(f"{metric!r} is one figure, with no percentile (got {text!r})")
    unit = UNITS.get(unit, own) if unit else own
    scale = {("s", "ms"): 1e-3, ("ms", "s"): 1e3}.get((own, unit), 1.0)
    if unit != own and scale == 1.0:
        raise ValueError(f"{metric!r} is in {own}, not {unit} (got {text!r})")
    if own == "%" and float(value) > 100:
        raise ValueError(f"{metric!r} is a percentage, at most 100 (got {text!r})")
    return Target(metric, stat, OPS[op], float(value) * scale)


@dataclass
class Solved:
    """The smallest share found to meet `target` (None: not even at the highest tried), its
    figure, the share just below it (within the tolerance) and its figure, and every share tried
    with its figure; `monotone`: more share never made the figure worse among them."""

    target: Target
    share: float | None
    value: float | None
    below: float | None
    below_value: float | None
    tried: list[tuple[float, float | None]]

    @property
    def monotone(self) -> bool:
        values = [v for _, v in sorted(self.tried)]
        sign = 1 if self.target.higher_is_better else -1
        known = [v for v in values if v is not None]
        return all(sign * (b - a) >= -1e-9 for a, b in zip(known, known[1:]))


def solve(figure_at: Callable[[float], float | None], target: Target, high: float = 0.5, rel_tol: float = 0.02,
          abs_tol: float = 1e-4) -> Solved:
    """Bisect the share in [0, high] for the smallest that meets `target`, assuming the figure gets
    no worse with more share (`Solved.monotone` says whether the tries bear it out).
    `figure_at(share)` replays at that share (0: idle only). Stops when the bracket is narrower
    than max(abs_tol, rel_tol * share)."""
    tried: dict[float, float | None] = {}

    def at(s: float) -> float | None:
        if s not in tried:
            tried[s] = figure_at(s)
        return tried[s]

    if target.met(at(0.0)):
        return Solved(target, 0.0, tried[0.0], None, None, sorted(tried.items()))
    if not target.met(at(high)):
        return Solved(target, None, None, high, tried[high], sorted(tried.items()))
    lo, hi = 0.0, high
    while hi - lo > max(abs_tol, rel_tol * hi):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if target.met(at(mid)) else (mid, hi)
    return Solved(target, hi, tried[hi], lo, tried[lo], sorted(tried.items()))
