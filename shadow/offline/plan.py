"""The experiment `shadow replay-ledger` runs, as one call (`run_plan`) that prints nothing.

A `Plan` is its arms: for each priority set, each device cost idle only, then each cost at each
share (idle + share), all on the same timelines, routed to a fleet of `engines` (packed first where
asked); optionally the same arms on one engine more (`check_fleet`: which turn starts a larger
fleet makes stale, and why) and, for each cost and priority set, the smallest share that meets a
target (`solve`, by bisection). The `Outcome` holds every arm with its figures (`metrics.summary`),
the load over time, the solved shares and the replay's own checks (`replay.monotone_checks`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from shadow.core.schedule import BandwidthRule, Priorities
from shadow.errors import ShadowInputError
from shadow.offline.costs import CostTable
from shadow.offline.fleet import inversions
from shadow.offline.ledger import Arrival, Request, ServiceModel, rebase, route_requests
from shadow.offline.limits import ReplayLimits
from shadow.offline.metrics import summary
from shadow.offline.replay import Arm, monotone_checks, replay
from shadow.offline.targets import Solved, Target, solve
from shadow.offline.timelines import Density, Window, density, pack, windows

# (stage, done, total): "replaying" and "solving" steps as they end
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Plan:
    """What to replay: one arm per (priority set, cost, share or idle only); `rule` gives every
    arm's reading settings but its share; `limits` the live service's; the fleet of `engines`
    routed by `route`, timelines packed to `pack_to` sessions active at once; `samples` random
    looks (seeded by `limits.seed`); the load in windows of `window_s`."""

    costs: Sequence[CostTable]
    shares: Sequence[float] = (BandwidthRule().share,)
    priorities: Sequence[Priorities] = (Priorities(),)
    rule: BandwidthRule = BandwidthRule()
    limits: ReplayLimits = ReplayLimits()
    grid: int = 512
    engines: int = 1
    route: str = "affinity"
    pack_to: float | None = None
    check_fleet: bool = False
    solve: Target | None = None
    samples: int = 1000
    window_s: float = 60.0
    service: ServiceModel = field(default_factory=ServiceModel)

    def arms(self) -> list[tuple[Priorities, CostTable, float | None]]:
        """(priorities, costs, share) of each arm, in the order they are replayed (None: idle only)."""
        return [x for prio in self.priorities
                for x in [(prio, c, None) for c in self.costs] + [(prio, c, s) for c in self.costs for s in self.shares]]


@dataclass
class SolvedShare:
    """The smallest share found for the plan's target at one priority set and cost, with the
    share of turn starts fresh at each share tried."""

    priorities: Priorities
    costs: CostTable
    solved: Solved
    fresh_pct: dict[float, float | None]

    def row(self, grid: int) -> dict:
        r = self.solved
        return {"priorities": self.priorities.label, "cost": self.costs.chunk.label,
                "read_ms_per_1k": flat_ms_per_1k(self.costs, grid),
                "target": r.target.text, "target_pct": r.target.value if r.target.metric == "fresh" else None,
                "share": r.share, "value": r.value, "fresh_pct": self.fresh_pct.get(r.share),
                "below_share": r.below, "below_value": r.below_value, "below_fresh_pct": self.fresh_pct.get(r.below),
                "monotone": r.monotone, "tried": [[round(x, 6), v] for x, v in r.tried]}


@dataclass
class Outcome:
    """A plan replayed: the requests as routed (and packed) with each one's engine, every arm with
    its summary, the load's windows and mean density, the fleet check's reports beside the arms
    they compare (one engine more), the solved shares, and the checks ({"ok", "failures"})."""

    requests: list[Request]
    engine_of: list[int]
    arms: list[Arm]
    summaries: list[dict]
    windows: list[Window]
    density: Density
    fleet: list[tuple[Arm, dict]]
    solved: list[SolvedShare]
    checks: dict


def arm_name(share: float | None) -> str:
    """'idle only', 'idle + 2% share', 'idle + 2.50% share'."""
    if not share:
        return "idle only"
    return f"idle + {share:.0%} share" if round(share * 100, 6) == round(share * 100) else f"idle + {share:.2%} share"


def flat_ms_per_1k(costs: CostTable, grid: int) -> float | None:
    """A flat chunk cost's ms per 1,000 tokens (None: a table by depth)."""
    return costs.chunk.ms_per_1k(0, grid) if costs.chunk.depths == (0,) else None


def run_plan(plan: Plan, requests: Sequence[Request] = (), arrivals: Sequence[Arrival] = (),
             progress: Progress | None = None) -> Outcome:
    """Replay `plan` on `requests` (timelines with their times) and Mooncake `arrivals` (timed by
    `plan.service` on the fleet they are routed to). ShadowInputError for a plan the inputs cannot
    take (a Mooncake trace beside other timelines on several engines, or packed)."""
    if arrivals and (requests and plan.engines > 1 or plan.pack_to is not None):
        raise ShadowInputError("replay a Mooncake trace on its own with --engines, and without --pack "
                               "(its times come from the service model)")
    if plan.check_fleet and arrivals and requests:
        raise ShadowInputError("--check-fleet replays a Mooncake trace on its own")
    step = progress or (lambda stage, done, total: None)
    requests = rebase(requests) if requests else list(requests)
    fleets = {n: _routed(plan, arrivals, requests, n) for n in [plan.engines] + [plan.engines + 1] * plan.check_fleet}
    routed, engine_of = fleets[plan.engines]
    series = windows(routed, engine_of, plan.engines, plan.window_s, plan.grid, plan.limits.state)

    def run(costs: CostTable, share: float | None, prio: Priorities, engines: int = plan.engines) -> Arm:
        reqs, where = fleets[engines]
        rule = replace(plan.rule, share=share or plan.rule.share)
        arm = replay(reqs, grid=plan.grid, rule=rule, use_share=bool(share), name=arm_name(share), engines=engines,
                     route=plan.route, engine_of=where, priorities=prio, costs=costs, limits=plan.limits,
                     samples=plan.samples, seed=plan.limits.seed)
        arm.read_ms_per_1k = flat_ms_per_1k(costs, plan.grid)  # a flat cost's, for the checks of faster reads
        return arm

    todo = plan.arms()
    arms, summaries = [], []
    for prio, costs, share in todo:
        arms.append(run(costs, share, prio))
        summaries.append(summary(arms[-1], series, plan.grid))
        step("replaying", len(arms), len(todo))
    fleet = []
    if plan.check_fleet:
        more_reqs, more_engine_of = fleets[plan.engines + 1]
        for (prio, costs, share), arm in zip(todo, arms):
            more = run(costs, share, prio, plan.engines + 1)
            fleet.append((arm, inversions(more_reqs, arm, more, engine_of, more_engine_of)))
            step("checking the fleet", len(fleet), len(todo))
    solved = []
    if plan.solve is not None:
        for prio in plan.priorities:
            for costs in plan.costs:
                solved.append(_solve(plan.solve, lambda x, c=costs, p=prio: summary(run(c, x or None, p), series,
                                                                                  plan.grid), prio, costs))
                step("solving", len(solved), len(plan.priorities) * len(plan.costs))
    return Outcome(list(routed), list(engine_of), arms, summaries, series, density(routed, plan.engines), fleet,
                   solved, monotone_checks(arms))


def _solve(target: Target, summary_at: Callable[[float], dict], prio: Priorities, costs: CostTable) -> SolvedShare:
    """The smallest share meeting `target`, each share tried replayed once (`summary_at`)."""
    fresh: dict[float, float | None] = {}

    def figure_at(share: float) -> float | None:
        s = summary_at(share)
        fresh[share] = s["turn_starts"]["fresh_pct"]
        return target.figure(s)

    return SolvedShare(prio, costs, solve(figure_at, target), fresh)


def _routed(plan: Plan, arrivals: Sequence[Arrival], requests: list[Request], engines: int) -> tuple[list, list]:
    """(requests, engine of each) for a fleet of `engines`: a Mooncake trace routed as it arrives
    and timed by its engine; other timelines packed, then routed."""
    if arrivals:  # routed as they come, then timed by their engine's service model
        served, engine_of = plan.service.serve_fleet(arrivals, engines, plan.route)
        return rebase(served + list(requests)), engine_of + [0] * len(requests)
    reqs = pack(requests, plan.pack_to) if plan.pack_to is not None else requests
    return reqs, route_requests(reqs, engines, plan.route)
