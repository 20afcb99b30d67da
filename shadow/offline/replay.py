"""Replay request timelines through the read scheduler: how far behind the shadow is at turn starts.

Each engine of a fleet gets its own `ReadScheduler` (its own idle time, share and shadow), driven
here exactly as the live service drives one: told of turns, first tokens, ends and ids as they
come, asked `next_read` (between decode rounds while the engine decodes), told `read_done`. The big
model's timeline is the ledger's (the reader's slices, at most the share, do not move it). A chunk
costs `grid * read_ms_per_1k / 1e6` s; the scheduler's estimate is warmed with that cost. Inside
a decode stretch, the next share slice comes one decode round after the last one ended (a round:
the decoding requests' shortest time per output token), so slices are separate and capped.

At each turn start of a session that had earlier turns (on any engine), "behind" is the session's
ids known before the turn (the previous request's prompt and the output it had produced) not yet
read by the shadow of the turn's engine; fresh = less than one chunk. A chunk still being read at a
turn start does not count. A prompt that shares less than was read (a re-rendered answer) rolls the
session back to the last grid line of the shared prefix (a chunk in flight past it is wasted).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shadow.offline.ledger import Request, route_requests
from shadow.core.schedule import BandwidthRule, ChunkCosts, Priorities, Read, ReadScheduler


@dataclass(frozen=True)
class TurnStart:
    session: str
    start: float
    behind: int
    fresh: bool
    engine: int = 0


@dataclass
class Arm:
    """One replay: its parameters and every measured turn start."""

    name: str
    share: float
    read_ms_per_1k: float
    engines: int = 1
    route: str = "affinity"
    priorities: str = "all"
    turns: list[TurnStart] = field(default_factory=list)
    chunks_idle: int = 0
    chunks_share: int = 0
    chunks_wasted: int = 0  # read past a rollback's line while the rollback came
    rollbacks: int = 0
    share_s: float = 0.0  # seconds read inside decode stretches
    longest_slice_s: float = 0.0

    @property
    def fresh(self) -> int:
        return sum(t.fresh for t in self.turns)

    @property
    def fresh_pct(self) -> float:
        return 100.0 * self.fresh / len(self.turns) if self.turns else 0.0

    def behind_pct(self, q: float) -> int:
        """The q-th percentile (0..100) of tokens behind, nearest rank."""
        if not self.turns:
            return 0
        values = sorted(t.behind for t in self.turns)
        return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]


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


_START, _FIRST, _END = 0, 1, 2


class _EngineReplay:
    """One engine and its shadow, over that engine's requests."""

    def __init__(self, requests: list[tuple[int, Request]], before: Sequence[int | None], arm: Arm,
                 sched: ReadScheduler, chunk_s: float, use_share: bool):
        self.arm, self.sched, self.chunk_s, self.use_share = arm, sched, chunk_s, use_share
        self.grid = sched.grid
        self.before = before
        self.events = sorted(
            [(r.start, _START, i, r) for i, r in requests] + [(r.first_token, _FIRST, i, r) for i, r in requests]
            + [(r.end, _END, i, r) for i, r in requests], key=lambda e: (e[0], e[1], e[2]))
        self.next_event = 0
        self.last_start = max((n for n, e in enumerate(self.events) if e[1] == _START), default=-1)
        self.committed: dict[str, int] = {}
        self.current: dict[str, Request] = {}  # session -> its latest request on this engine
        self.decoding: dict[int, Request] = {}
        self.next_round = -math.inf
        self.inflight: tuple[str, int] | None = None  # (session, the row the chunk being read ends at)

    def _push(self, session: str, t: float) -> None:
        r = self.current[session]
        self.sched.update(session, self.committed[session], readable(r, t), t)

    def _handle(self, t: float, kind: int, i: int, r: Request) -> None:
        s = r.session
        if kind == _START:
            committed = self.committed.setdefault(s, 0)
            if self.before[i] is not None:
                behind = max(0, self.before[i] - committed)
                self.arm.turns.append(TurnStart(s, r.start, behind, behind < self.grid, self.engine))
            shared = r.prompt_tokens - r.new_prompt_tokens
            reach = self.inflight[1] if self.inflight is not None and self.inflight[0] == s else committed
            if max(committed, reach) > shared:  # the ids read (or being read) past `shared` changed
                self.committed[s] = min(committed, shared // self.grid * self.grid)
                self.arm.rollbacks += 1
                if reach > shared and self.inflight is not None and self.inflight[0] == s:
                    self.inflight = None  # the chunk in flight is wasted
            self.current[s] = r
            self.sched.turn_started(i, s, t)
            self._push(s, t)
        elif kind == _FIRST:
            self.sched.first_token(i, t)
            if r.end > r.first_token:
                self.decoding[i] = r
        else:
            self.sched.turn_ended(i, t)
            self.decoding.pop(i, None)
            if self.current.get(s) is r:
                self._push(s, t)

    def _events_before(self, t: float, inclusive: bool) -> None:
        ev = self.events
        while self.next_event < len(ev) and (ev[self.next_event][0] <= t if inclusive else ev[self.next_event][0] < t):
            self._handle(*ev[self.next_event])
            self.next_event += 1

    def _round_s(self) -> float:
        return min(((r.end - r.first_token) / r.output_tokens for r in self.decoding.values() if r.output_tokens),
                   default=0.0)

    def _read(self, read: Read, t: float) -> float:
        s = read.session
        start = t
        done = 0
        for _ in range(read.chunks):
            depth = read.depth + done * self.grid
            end = t + self.chunk_s
            self.inflight = (s, depth + self.grid)
            self._events_before(end, inclusive=False)  # what happens while the chunk runs
            t = end
            if self.inflight is None or self.committed[s] != depth:  # rolled back under it: wasted
                self.inflight = None
                self.arm.chunks_wasted += 1
                break
            self.inflight = None
            self.committed[s] = depth + self.grid
            done += 1
        if read.window == "share":
            self.arm.chunks_share += done
            self.arm.share_s += t - start
            self.arm.longest_slice_s = max(self.arm.longest_slice_s, t - start)
        else:
            self.arm.chunks_idle += done
        self.sched.read_done(read, done, t - start, t)
        self._push(s, t)
        return t

    def run(self, engine: int) -> None:
        self.engine = engine
        t = 0.0
        sched = self.sched
        while True:
            self._events_before(t, inclusive=True)
            if self.next_event > self.last_start:  # every turn start measured: what follows counts for none
                return
            for r in self.decoding.values():  # output decoded so far is known
                if self.current.get(r.session) is r:
                    self._push(r.session, t)
            between = self.use_share and bool(self.decoding) and t >= self.next_round
            decision = sched.next_read(t, between_rounds=between)
            if isinstance(decision, Read):
                t = self._read(decision, t)
                if decision.window == "share":
                    self.next_round = t + self._round_s()
                continue
            wake = [decision.until]
            if self.next_event < len(self.events):
                wake.append(self.events[self.next_event][0])
            if self.use_share and self.decoding and self.next_round > t:
                wake.append(self.next_round)
            for r in self.decoding.values():  # the next whole chunk of a decoding session's output
                if self.current.get(r.session) is r:
                    known = readable(r, t)
                    wake.append(time_readable(r, (known // self.grid + 1) * self.grid))
            nxt = min(wake)
            if nxt == math.inf:
                return
            t = max(nxt, math.nextafter(t, math.inf))


def replay(
    requests: Sequence[Request], read_ms_per_1k: float, grid: int = 512,
    rule: BandwidthRule = BandwidthRule(), use_share: bool = True, name: str | None = None,
    progress: Callable[[int, int], None] | None = None, engines: int = 1, route: str = "affinity",
    engine_of: Sequence[int] | None = None, priorities: Priorities = Priorities(),
) -> Arm:
    """Replay `requests` on a fleet of `engines` engines, each with its own shadow and scheduler.
    `engine_of` (aligned with `requests`) fixes each request's engine, as `ServiceModel.serve_fleet`
    chose it; otherwise `route_requests` routes them by `route`."""
    chunk_s = grid * read_ms_per_1k / 1e6
    share = rule.share if use_share else 0.0
    arm = Arm(name or ("idle + share" if use_share else "idle only"), share, read_ms_per_1k, engines, route,
              priorities.label)
    requests = list(requests)
    if engine_of is None:
        engine_of = route_requests(requests, engines, route)
    if len(engine_of) != len(requests) or (requests and not 0 <= min(engine_of) <= max(engine_of) < engines):
        raise ValueError("engine_of must give an engine in range for every request")
    before = known_before(requests)
    by_engine: list[list[tuple[int, Request]]] = [[] for _ in range(engines)]
    for i, (r, e) in enumerate(zip(requests, engine_of)):
        by_engine[e].append((i, r))
    for e, reqs in enumerate(by_engine):
        costs = ChunkCosts()
        costs.warm(0, chunk_s)
        sched = ReadScheduler(rule if use_share else _no_share(rule), grid, costs, priorities)
        _EngineReplay(reqs, before, arm, sched, chunk_s, use_share).run(e)
        if progress:
            progress(e + 1, engines)
    arm.turns.sort(key=lambda t: (t.start, t.session))
    return arm


def _no_share(rule: BandwidthRule) -> BandwidthRule:
    return BandwidthRule(rule.poll_s, rule.burst_s, 0.0, rule.slice_s)


# timelines ---------------------------------------------------------------------------------------


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
        out += [Request(name, r.start + shift, r.first_token + shift, r.end + shift, r.prompt_tokens,
                        r.new_prompt_tokens, r.output_tokens) for r in by[s]]
    return out


# the share a target needs ------------------------------------------------------------------------


@dataclass
class Solved:
    """The smallest share found to reach `target_pct` fresh (None: not even at `high`), the
    freshness there, the share just below it (within the tolerance) and its freshness, and every
    share tried with its fresh turn starts; `monotone`: more share was never less fresh among
    them."""

    target_pct: float
    share: float | None
    fresh_pct: float | None
    below: float | None
    below_pct: float | None
    tried: list[tuple[float, float]]

    @property
    def monotone(self) -> bool:
        values = [f for _, f in sorted(self.tried)]
        return all(a <= b + 1e-9 for a, b in zip(values, values[1:]))


def solve_share(fresh_at: Callable[[float], float], target_pct: float, high: float = 0.5,
                rel_tol: float = 0.02, abs_tol: float = 1e-4) -> Solved:
    """Bisect the share in [0, high] for the smallest that gives `target_pct` fresh, assuming
    freshness grows with the share (`Solved.monotone` says whether the tries bear it out).
    `fresh_at(share)` replays at that share (0: idle only) and returns fresh %. Stops when the
    bracket is narrower than max(abs_tol, rel_tol * share)."""
    tried: dict[float, float] = {}

    def at(s: float) -> float:
        if s not in tried:
            tried[s] = fresh_at(s)
        return tried[s]

    if at(0.0) >= target_pct:
        return Solved(target_pct, 0.0, tried[0.0], None, None, sorted(tried.items()))
    if at(high) < target_pct:
        return Solved(target_pct, None, None, high, tried[high], sorted(tried.items()))
    lo, hi = 0.0, high
    while hi - lo > max(abs_tol, rel_tol * hi):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if at(mid) >= target_pct else (mid, hi)
    return Solved(target_pct, hi, tried[hi], lo, tried[lo], sorted(tried.items()))


def monotone_checks(arms: Sequence[Arm], solved: Sequence[Solved] = ()) -> dict:
    """The replay's own checks: at each priority set, more share (idle only counts as share 0) is
    never less fresh at one read rate, and faster reads are never less fresh at one share; and each
    solver's tries are monotone in share. Returns {"ok": bool, "failures": [sentences]}."""
    failures = []
    groups: dict[tuple, list] = {}
    for a in arms:
        fleet = (a.priorities, a.engines, a.route)
        groups.setdefault(("more share", *fleet, a.read_ms_per_1k), []).append((a.share, a))
        groups.setdefault(("faster reads", *fleet, a.share), []).append((-a.read_ms_per_1k, a))
    for key, members in groups.items():
        members.sort(key=lambda m: m[0])
        for (_, a), (_, b) in zip(members, members[1:]):
            if b.fresh < a.fresh:
                failures.append(f"{key[0]} was less fresh: {b.name} at {b.read_ms_per_1k:g} ms/1k {b.fresh_pct:.2f} % "
                                f"< {a.name} at {a.read_ms_per_1k:g} ms/1k {a.fresh_pct:.2f} % (priorities {a.priorities})")
    for r in solved:
        if not r.monotone:
            failures.append(f"solving for {r.target_pct:g} %: more share was less fresh among {r.tried}")
    return {"ok": not failures, "failures": failures}
