"""Replay request timelines through the read scheduler: what an operator would have seen of the
shadow, engine by engine.

Each engine of a fleet gets its own `ReadScheduler` (its own idle time, share and shadow), driven
as the live service drives one (`engine_replay.EngineReplay`), with the live service's limits
where `limits` asks for them (`limits.ReplayLimits`: when ids reach the shadow, the resident cap and
store, the voice, labels, asks) and the device's costs from a cost table (`costs.CostTable`: a
chunk by its depth, restores and spills by their bytes). The big model's timeline is the
ledger's. Measured: at each turn start of a session with earlier turns, how many of the ids its
engine held the shadow had not read (`behind`; fresh = less than one chunk) and how long an ask
would wait; the same at random times (`samples`); each turn's time until its prompt was read; the
store's spills, restores and drops.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from shadow.core.schedule import BandwidthRule, ChunkCosts, Priorities, ReadScheduler
from shadow.offline.costs import ChunkTable, CostTable
from shadow.offline.engine_replay import Answered, EngineReplay, Probe, Tally, ToFresh, TurnStart
from shadow.offline.ledger import Request, route_requests
from shadow.offline.limits import ReplayLimits
from shadow.offline.timelines import Density, density, known_before, pack, readable, time_readable

__all__ = ["Arm", "Density", "Probe", "ToFresh", "TurnStart", "density", "known_before", "monotone_checks", "pack",
           "readable", "replay", "solve_share", "time_readable"]


@dataclass
class Arm:
    """One replay: its parameters, every measured turn start, probe and turn's time to fresh, and
    what the shadows did (summed over engines)."""

    name: str
    share: float
    read_ms_per_1k: float | None  # a flat cost; None for a table by depth (`cost`)
    engines: int = 1
    route: str = "affinity"
    priorities: str = "all"
    cost: str = ""
    turns: list[TurnStart] = field(default_factory=list)
    probes: list[Probe] = field(default_factory=list)
    to_fresh: list[ToFresh] = field(default_factory=list)
    asks: list[Answered] = field(default_factory=list)
    left: list[tuple[float, str, bool]] = field(default_factory=list)  # sessions past the cap: (when, name, state kept)
    chunks_idle: int = 0
    chunks_share: int = 0
    chunks_ask: int = 0
    chunks_wasted: int = 0  # chunks read and then rolled back (ids read again, in chunks)
    rollbacks: int = 0
    predictions: int = 0  # next prompts predicted at turns' ends
    predictions_missed: int = 0  # of those, the ones the next prompt sent back
    share_s: float = 0.0  # seconds read inside decode stretches
    share_charged_s: float = 0.0  # what those reads charged the stretches (at most share_s: `--charge-json`)
    longest_slice_s: float = 0.0
    voice_s: float = 0.0
    spills: int = 0
    restores: int = 0
    drops: int = 0
    restore_s: float = 0.0
    spill_s: float = 0.0
    to_host: int = 0  # sessions moved to the host tier
    from_host: int = 0  # and back
    host_s: float = 0.0  # seconds of those moves
    restores_ahead: int = 0  # restores started at a request's arrival, beside the reads

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

    def add(self, tally: Tally, grid: int, store) -> None:
        self.chunks_idle += tally.chunks_idle
        self.chunks_share += tally.chunks_share
        self.chunks_ask += tally.chunks_ask
        self.chunks_wasted += tally.ids_reread // grid
        self.rollbacks += tally.rollbacks
        self.predictions += tally.predictions
        self.predictions_missed += tally.predictions_missed
        self.share_s += tally.share_s
        self.share_charged_s += tally.share_charged_s
        self.longest_slice_s = max(self.longest_slice_s, tally.longest_slice_s)
        self.voice_s += tally.voice_s
        self.asks += tally.asks
        self.left += tally.left
        self.restores_ahead += tally.restores_ahead
        c = store.counts
        self.spills, self.restores, self.drops = self.spills + c.spills, self.restores + c.restores, self.drops + c.drops
        self.restore_s, self.spill_s = self.restore_s + c.restore_s, self.spill_s + c.spill_s
        self.to_host, self.from_host, self.host_s = self.to_host + c.to_host, self.from_host + c.from_host, \
            self.host_s + c.host_s


def replay(
    requests: Sequence[Request], read_ms_per_1k: float | None = None, grid: int = 512,
    rule: BandwidthRule = BandwidthRule(), use_share: bool = True, name: str | None = None, *,
    progress: Callable[[int, int], None] | None = None, engines: int = 1, route: str = "affinity",
    engine_of: Sequence[int] | None = None, priorities: Priorities = Priorities(),
    costs: CostTable | None = None, limits: ReplayLimits = ReplayLimits(), samples: int = 0, seed: int = 0,
) -> Arm:
    """Replay `requests` on a fleet of `engines` engines, each with its own shadow and scheduler.
    The device's costs: `costs`, or one chunk cost of `read_ms_per_1k` at every depth. `engine_of`
    (aligned with `requests`) fixes each request's engine, as `ServiceModel.serve_fleet` chose it;
    otherwise `route_requests` routes them by `route`. `samples`: random times (seeded by `seed`)
    at which every active session is looked at."""
    if costs is None:
        if read_ms_per_1k is None:
            raise ValueError("a replay needs a cost table or a read rate")
        costs = CostTable(ChunkTable.flat(read_ms_per_1k, grid))
    share = rule.share if use_share else 0.0
    arm = Arm(name or ("idle + share" if use_share else "idle only"), share, read_ms_per_1k, engines, route,
              priorities.label, costs.chunk.label)
    requests = list(requests)
    if engine_of is None:
        engine_of = route_requests(requests, engines, route)
    if len(engine_of) != len(requests) or (requests and not 0 <= min(engine_of) <= max(engine_of) < engines):
        raise ValueError("engine_of must give an engine in range for every request")
    before = known_before(requests)
    ranked = sorted(range(len(requests)), key=lambda i: (requests[i].start, i))
    order = [0] * len(requests)
    for rank, i in enumerate(ranked):
        order[i] = rank
    next_start = _next_starts(requests, ranked)
    probes = _placed(requests, engine_of, engines, _sample_times(requests, samples, seed))
    asks = _placed(requests, engine_of, engines, _ask_times(requests, limits, seed), per_session=True)
    by_engine: list[list[tuple[int, Request]]] = [[] for _ in range(engines)]
    for i, (r, e) in enumerate(zip(requests, engine_of)):
        by_engine[e].append((i, r))
    engine_rule = rule if use_share else _no_share(rule)
    if costs.charge is not None:  # a share read charged at most what a live load kept (`--share-charge alone`)
        engine_rule = replace(engine_rule, charge="alone")
    for e, reqs in enumerate(by_engine):
        sched = ReadScheduler(engine_rule, grid, ChunkCosts(), priorities)
        if costs.charge is not None:
            sched.keep_alone(list(costs.charge.chunks), list(costs.charge.batches))
        one = EngineReplay(e, reqs, order, before, next_start, sched, costs=costs, limits=limits,
                           use_share=use_share, probes=probes[e], asks=asks[e])
        one.run()
        arm.turns += one.starts
        arm.probes += one.probes
        arm.to_fresh += one.to_fresh
        arm.add(one.tally, grid, one.store)
        if progress:
            progress(e + 1, engines)
    arm.turns.sort(key=lambda t: (t.start, t.session))
    arm.probes.sort(key=lambda p: (p.time, p.session))
    arm.to_fresh.sort(key=lambda f: (f.start, f.session))
    return arm


def _no_share(rule: BandwidthRule) -> BandwidthRule:
    return replace(rule, share=0.0)


def _next_starts(requests: Sequence[Request], ranked: Sequence[int]) -> list[float]:
    out, later = [math.inf] * len(requests), {}
    for i in reversed(ranked):
        out[i] = later.get(requests[i].session, math.inf)
        later[requests[i].session] = requests[i].start
    return out


def _sample_times(requests: Sequence[Request], samples: int, seed: int) -> list[tuple[float, None]]:
    """`samples` times drawn evenly at random between the first start and the last end."""
    if not samples or not requests:
        return []
    rng = random.Random(seed)
    t0, t1 = min(r.start for r in requests), max(r.end for r in requests)
    return [(rng.uniform(t0, t1), None) for _ in range(samples)]


def _ask_times(requests: Sequence[Request], limits: ReplayLimits, seed: int) -> list[tuple]:
    """Asks (time, session[, kind]): `limits.asks_at` as given, else `limits.asks_per_hour` per
    session while it is active (Poisson arrivals)."""
    if limits.asks_at:
        return sorted(limits.asks_at)
    if limits.asks_per_hour <= 0:
        return []
    rng = random.Random(seed + 1)
    out = []
    for s, (a, b) in sorted(_spans(requests).items()):
        t = a + rng.expovariate(limits.asks_per_hour / 3600)
        while t <= b:
            out.append((t, s))
            t += rng.expovariate(limits.asks_per_hour / 3600)
    return out


def _spans(requests: Sequence[Request]) -> dict[str, tuple[float, float]]:
    spans: dict[str, list[float]] = {}
    for r in requests:
        a = spans.setdefault(r.session, [r.start, r.end])
        a[0], a[1] = min(a[0], r.start), max(a[1], r.end)
    return {s: (a, b) for s, (a, b) in spans.items()}


def _placed(requests: Sequence[Request], engine_of: Sequence[int], engines: int,
            times: list[tuple], per_session: bool = False) -> list[list[tuple]]:
    """Each (time, session, ...) on the engine of the session's latest request started by then; a
    time without a session stands for every session active then."""
    out: list[list[tuple]] = [[] for _ in range(engines)]
    if not times:
        return out
    starts: dict[str, list[tuple[float, int]]] = {}
    for r, e in zip(requests, engine_of):
        starts.setdefault(r.session, []).append((r.start, e))
    for v in starts.values():
        v.sort()
    spans = _spans(requests)

    def engine(s: str, t: float) -> int:
        v = starts[s]
        k = bisect.bisect_right(v, (t, math.inf)) - 1
        return v[max(0, k)][1]

    if per_session:
        for item in times:  # (time, session, ...)
            out[engine(item[1], item[0])].append(item)
        return out
    ordered = sorted(t for t, _ in times)
    for s, (a, b) in spans.items():
        for t in ordered[bisect.bisect_left(ordered, a):bisect.bisect_right(ordered, b)]:
            out[engine(s, t)].append((t, s))
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
        groups.setdefault(("more share", *fleet, a.read_ms_per_1k, a.cost), []).append((a.share, a))
        if a.read_ms_per_1k is not None:  # (a table by depth is not faster or slower than a flat cost)
            groups.setdefault(("faster reads", *fleet, a.share), []).append((-a.read_ms_per_1k, a))
    for key, members in groups.items():
        members.sort(key=lambda m: m[0])
        for (_, a), (_, b) in zip(members, members[1:]):
            if b.fresh < a.fresh:
                failures.append(f"{key[0]} was less fresh: {b.name} at {b.cost} {b.fresh_pct:.2f} % "
                                f"< {a.name} at {a.cost} {a.fresh_pct:.2f} % (priorities {a.priorities})")
    for r in solved:
        if not r.monotone:
            failures.append(f"solving for {r.target_pct:g} %: more share was less fresh among {r.tried}")
    return {"ok": not failures, "failures": failures}
