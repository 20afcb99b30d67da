"""Request timelines: the ids a session's engine holds at a time, density (overall and in windows
over time), and packing sessions to a density."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from shadow.core.residency import StateSize
from shadow.offline.ledger import Request


def readable(r: Request, t: float) -> int:
    """Ids of a request's session known at t: its prompt from its start, its output as decoded."""
    if t >= r.end:
        return r.prompt_tokens + r.output_tokens
    if t < r.first_token or r.end <= r.first_token:
        return r.prompt_tokens
    return r.prompt_tokens + int(r.output_tokens * (t - r.first_token) / (r.end - r.first_token))


def time_readable(r: Request, tokens: int) -> float:
    """When request r makes `tokens` ids of its session known (inf: never)."""
    if tokens > r.prompt_tokens + r.output_tokens:
        return math.inf
    if tokens <= r.prompt_tokens:
        return r.start
    t = r.first_token + (tokens - r.prompt_tokens) / r.output_tokens * (r.end - r.first_token)
    while readable(r, t) < tokens:  # int() above rounds down: step past the float edge
        t = math.nextafter(t, math.inf)
    return t


def known_before(requests: Sequence[Request]) -> list[int | None]:
    """For each request (same order): its session's ids known at its start from the session's
    previous request (prompt and output so far), None for a session's first request."""
    out: list[int | None] = [None] * len(requests)
    last: dict[str, Request] = {}
    for i in sorted(range(len(requests)), key=lambda i: requests[i].start):
        r = requests[i]
        p = last.get(r.session)
        if p is not None:
            out[i] = readable(p, r.start)
        last[r.session] = r
    return out


@dataclass(frozen=True)
class Density:
    """How loaded a timeline is: sessions active at once (a session is active from its first
    request's start to its last request's end) and new tokens (new prompt and output) per second,
    both per engine, over the span from the first start to the last end."""

    span_s: float
    active: float
    new_tok_s: float


def density(requests: Sequence[Request], engines: int = 1) -> Density:
    if not requests:
        return Density(0.0, 0.0, 0.0)
    spans: dict[str, list[float]] = {}
    for r in requests:
        a = spans.setdefault(r.session, [r.start, r.end])
        a[0], a[1] = min(a[0], r.start), max(a[1], r.end)
    span = max(r.end for r in requests) - min(r.start for r in requests)
    if span <= 0:
        return Density(0.0, 0.0, 0.0)
    busy = sum(b - a for a, b in spans.values())
    tokens = sum(r.new_prompt_tokens + r.output_tokens for r in requests)
    return Density(span, busy / span / engines, tokens / span / engines)


@dataclass(frozen=True)
class Window:
    """One engine's load in one window [start, start + seconds): sessions active on it (time
    averaged; a session is active on an engine from its first request's start there to its last
    request's end there), new tokens per second (new prompt tokens at their request's start, output
    as decoded), and the state those sessions would hold read to their grid line (GiB, at the
    window's middle; None without state sizes)."""

    engine: int
    start: float
    seconds: float
    active: float
    new_tok_s: float
    state_gib: float | None


def windows(requests: Sequence[Request], engine_of: Sequence[int], engines: int, window_s: float = 60.0,
            grid: int = 512, size: StateSize | None = None, *, max_checkpoints: int = 6) -> list[Window]:
    """Every engine's windows of `window_s` from the first start to the last end (the last one
    shorter), engine by engine."""
    if not requests:
        return []
    t0, t1 = min(r.start for r in requests), max(r.end for r in requests)
    n = max(1, math.ceil((t1 - t0) / window_s - 1e-9))
    bounds = [(t0 + k * window_s, min(t1, t0 + (k + 1) * window_s)) for k in range(n)]
    active = [[0.0] * n for _ in range(engines)]
    tokens = [[0.0] * n for _ in range(engines)]
    spans: dict[tuple[int, str], list[float]] = {}
    by_session: dict[tuple[int, str], list[Request]] = {}
    for r, e in zip(requests, engine_of):
        a = spans.setdefault((e, r.session), [r.start, r.end])
        a[0], a[1] = min(a[0], r.start), max(a[1], r.end)
        by_session.setdefault((e, r.session), []).append(r)
        k = min(n - 1, int((r.start - t0) // window_s))
        tokens[e][k] += r.new_prompt_tokens
        _spread(tokens[e], bounds, t0, window_s, r.first_token, r.end, total=r.output_tokens)
    for (e, _), (a, b) in spans.items():
        _spread(active[e], bounds, t0, window_s, a, b, total=None)
    held_by: list[list[tuple[list[Request], float]]] = [[] for _ in range(engines)]
    for (e, name), rs in by_session.items():
        held_by[e].append((sorted(rs, key=lambda r: r.start), spans[(e, name)][1]))
    out = []
    for e in range(engines):
        for k, (a, b) in enumerate(bounds):
            gib = None if size is None else _held_gib(held_by[e], (a + b) / 2, grid, size, max_checkpoints)
            out.append(Window(e, a, b - a, active[e][k] / max(b - a, 1e-9), tokens[e][k] / max(b - a, 1e-9), gib))
    return out


def _held_gib(sessions: list[tuple[list[Request], float]], t: float, grid: int, size: StateSize,
              max_checkpoints: int) -> float:
    """GiB the sessions active at t would hold, each read to the grid line of its ids then, with a
    checkpoint for each of its turns so far (at most `max_checkpoints`)."""
    held = 0
    for rs, last_end in sessions:
        if rs[0].start > t or last_end < t:
            continue
        started = [r for r in rs if r.start <= t]
        rows = readable(started[-1], t) // grid * grid
        held += size.resident(size.capacity(rows), min(max_checkpoints, len(started)))
    return held / 2**30


def _spread(into: list[float], bounds, t0: float, window_s: float, a: float, b: float, *, total: float | None) -> None:
    """Add to each window its share of [a, b]: its overlap in seconds (total None), or `total`
    spread evenly over [a, b] (all of it in a's window when a == b)."""
    n = len(into)
    if b <= a:
        if total:
            into[min(n - 1, max(0, int((a - t0) // window_s)))] += total
        return
    first, last = max(0, int((a - t0) // window_s)), min(n - 1, int((b - t0) // window_s))
    for k in range(first, last + 1):
        lo, hi = max(a, bounds[k][0]), min(b, bounds[k][1])
        if hi > lo:
            into[k] += (hi - lo) if total is None else total * (hi - lo) / (b - a)


def pack(requests: Sequence[Request], active: float) -> list[Request]:
    """Shift sessions in time (each keeps its own timeline) so that `active` are active at once on
    average (`density`, one engine). Session i (in order of first start) begins at
    (M - d_i) * (i + 0.5) / n, its duration d_i, the makespan M chosen by bisection. Where shifting
    alone cannot reach the target (the longest session would outlast M), the whole set is repeated
    as copies named 'name~2', 'name~3', ... (the fewest that can)."""
    if active <= 0:
        raise ValueError("pack needs a positive number of active sessions")
    by: dict[str, list[Request]] = {}
    for r in sorted(requests, key=lambda r: r.start):
        by.setdefault(r.session, []).append(r)
    if not by:
        return []
    first = {s: rs[0].start for s, rs in by.items()}
    dur = {s: max(r.end for r in rs) - first[s] for s, rs in by.items()}
    total, longest = sum(dur.values()), max(dur.values())
    if total <= 0:
        raise ValueError("sessions of zero duration cannot be packed")
    copies = max(1, math.ceil(active * longest / total * 1.05 - 1e-9))
    order = [(s, c) for c in range(copies) for s in sorted(by, key=lambda s: (first[s], s))]
    d = [dur[s] for s, _ in order]
    n = len(order)

    def starts(m: float) -> list[float]:
        return [max(0.0, (m - d[j]) * (j + 0.5) / n) for j in range(n)]

    def achieved(m: float) -> float:
        st = starts(m)
        return copies * total / (max(a + b for a, b in zip(st, d)) - min(st))

    lo, hi = longest, copies * total / active * 4 + longest
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if achieved(mid) > active else (lo, mid)
    st = starts(hi)
    out = []
    for (s, c), begin in zip(order, st):
        name = s if c == 0 else f"{s}~{c + 1}"
        shift = begin - first[s]
        out += [replace(r, session=name, start=r.start + shift, first_token=r.first_token + shift, end=r.end + shift)
                for r in by[s]]
    return out
