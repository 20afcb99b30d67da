"""`shadow replay-ledger`: how fresh the shadow is at turn starts, on real request timelines."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
from rich.table import Table

from cli.common import (
    CsvOpt, GridOpt, JsonOpt, PlotOpt, bounds, console, emit_json, input_file, output_path, progress, user_errors,
    user_text_file, write_csv,
)
from shadow.errors import ShadowInputError

FORMATS = ("auto", "mooncake", "trajectory", "ledger")
MAX_PACK = 10_000  # active sessions --pack may ask for (the set is repeated to reach it: copies grow with it)


@user_errors
def replay_ledger(
    inputs: Annotated[list[Path], typer.Argument(help="Trace files: a Mooncake trace (.jsonl), mini-swe-agent trajectories (.traj.json, or a folder of them), or the project's ledger (.jsonl).")],
    fmt: Annotated[str, typer.Option("--format", help="auto, mooncake, trajectory or ledger.")] = "auto",
    read_ms_per_1k: Annotated[list[float] | None, typer.Option("--read-ms-per-1k", callback=bounds(gt=0), help="Read rate(s) in ms per 1,000 tokens (repeatable: a sweep). Default 87.")] = None,
    read_rate_json: Annotated[Path | None, typer.Option(callback=input_file, help="Also use the rate measured by `shadow read-rate --json` (its last line's ms_per_1k_tokens).")] = None,
    share: Annotated[list[float] | None, typer.Option("--share", callback=bounds(gt=0, lt=1), help="In-turn share(s) of the time since the first token (repeatable). Default 0.02.")] = None,
    grid: GridOpt = 512,
    engines: Annotated[int, typer.Option(callback=bounds(ge=1, says="is at least 1"), help="Engines in the fleet, each with its own idle time, share and shadow.")] = 1,
    route: Annotated[str, typer.Option(help="How requests reach engines: affinity (a session stays where its first request went, the engine with the fewest requests in flight), hash (of the session name; stays) or round-robin (request by request).")] = "affinity",
    pack_to: Annotated[float | None, typer.Option("--pack", callback=bounds(gt=0, le=MAX_PACK, says=f"needs a positive number of active sessions, at most {MAX_PACK:,}"), help="Shift sessions' start times so that this many are active at once on average (repeating the set where shifting alone cannot; at most 10,000). Not for Mooncake traces (their times come from the service model).")] = None,
    priorities: Annotated[list[str] | None, typer.Option("--priorities", help="The scheduler's order steps: all, none, or some of question,running,recent,oldest joined by commas (repeatable: arms side by side on the same timelines). Default all.")] = None,
    solve_share: Annotated[float | None, typer.Option("--solve-share", callback=bounds(gt=0, le=100, says="is a percentage in (0, 100]"), help="Also find the smallest share giving this percentage of fresh turn starts (bisection), for each read rate and priority set.")] = None,
    prefill_tok_s: Annotated[float, typer.Option(callback=bounds(gt=0), help="Service model, for traces without first-token and end times: prefill tokens per second.")] = 20_000.0,
    decode_tok_s: Annotated[float, typer.Option(callback=bounds(gt=0), help="Service model: decode tokens per second per request.")] = 40.0,
    slots: Annotated[int, typer.Option(callback=bounds(ge=1), help="Service model (Mooncake): requests each engine serves at once, first come first served.")] = 32,
    token_counts: Annotated[str, typer.Option(help="Trajectories: 'qwen' (re-render and re-tokenise with the Qwen3.5 vocabulary) or 'usage' (the provider's counts).")] = "qwen",
    write_ledger_to: Annotated[Path | None, typer.Option("--write-ledger", callback=output_path, help="Write the imported (and packed) requests as a ledger (JSONL).")] = None,
    plot: PlotOpt = None,
    csv: CsvOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Replay request timelines through the read scheduler (`shadow/schedule.py`: idle window, and
    the in-turn share) on a fleet of engines with a given read rate, and report, at every turn
    start of a session with earlier turns, how many of its tokens the shadow of the turn's engine
    had not read: fresh = less than one grid chunk behind. Arms: idle only and idle + share for
    each read rate, each share of a sweep and each priority set. The command checks that more
    share and faster reads are never less fresh, and exits 1 if they are."""
    from shadow.offline.ledger import ROUTES, ServiceModel, import_trajectory, mooncake_arrivals, read_ledger, rebase, \
        route_requests, write_ledger
    from shadow.offline.replay import density, monotone_checks, pack, replay, solve_share as solve
    from shadow.core.schedule import BandwidthRule, Priorities

    if fmt not in FORMATS:
        raise ShadowInputError(f"unknown format {fmt!r} ({', '.join(FORMATS)})")
    if token_counts not in ("qwen", "usage"):
        raise ShadowInputError("--token-counts is 'qwen' or 'usage'")
    if route not in ROUTES:
        raise ShadowInputError(f"--route one of {', '.join(ROUTES)} (got {route!r})")
    rates = list(read_ms_per_1k or [])
    if read_rate_json:
        rates.append(_rate_from(read_rate_json))
    rates = rates or [87.0]
    shares = share or [0.02]
    try:
        prio_sets = [Priorities.parse(p) for p in (priorities or ["all"])]
    except ValueError as e:
        raise ShadowInputError(str(e)) from None
    service = ServiceModel(prefill_tok_s, decode_tok_s, slots)

    files = _expand(inputs)
    kinds = {f: _detect(f) if fmt == "auto" else fmt for f in files}  # every file's format before any import
    requests, arrivals = [], []
    with progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()) as bar:
        task = bar.add_task("importing", total=len(files))
        tokenizer = None
        for f in files:
            kind = kinds[f]
            if kind == "mooncake":
                arrivals += user_text_file(f, mooncake_arrivals)
            elif kind == "trajectory":
                if tokenizer is None and token_counts == "qwen":
                    from shadow.text.tokenizer import load_tokenizer

                    tokenizer = load_tokenizer(None)
                requests += user_text_file(f, lambda p: import_trajectory(p, service, tokenizer))
            else:
                requests += user_text_file(f, read_ledger)
            bar.advance(task)
        if arrivals and (requests and engines > 1 or pack_to is not None):
            raise ShadowInputError("replay a Mooncake trace on its own with --engines, and without --pack "
                                   "(its times come from the service model)")
        engine_of = None
        if arrivals:  # routed as they come, then timed by their engine's service model
            served, engine_of = service.serve_fleet(arrivals, engines, route)
            requests, engine_of = served + requests, engine_of if not requests else None
        requests = rebase(requests)
        if pack_to is not None:
            requests = pack(requests, pack_to)
        if engine_of is None:
            engine_of = route_requests(requests, engines, route)
        if write_ledger_to:
            write_ledger(write_ledger_to, requests)
        dens = density(requests, engines)

        def run(rate: float, s: float | None, prio: Priorities):
            rule = BandwidthRule(share=s or 0.02)
            name = "idle only" if not s else f"idle + {s:.0%} share" if round(s * 100, 6) == round(s * 100) \
                else f"idle + {s:.2%} share"
            return replay(requests, rate, grid, rule, use_share=bool(s), name=name, engines=engines, route=route,
                          engine_of=engine_of, priorities=prio)

        plan = [x for prio in prio_sets for x in [(prio, r, None) for r in rates] + [(prio, r, s) for r in rates for s in shares]]
        task = bar.add_task("replaying", total=len(plan))
        arms = []
        for prio, rate, s in plan:
            arms.append(run(rate, s, prio))
            bar.advance(task)
        solved = []
        if solve_share is not None:
            task = bar.add_task(f"solving for {solve_share:g} % fresh", total=len(rates) * len(prio_sets))
            for prio in prio_sets:
                for rate in rates:
                    solved.append((prio, rate, solve(lambda s: run(rate, s, prio).fresh_pct, solve_share)))
                    bar.advance(task)

    sessions = len({r.session for r in requests})
    multi = len(prio_sets) > 1
    title = (f"replay-ledger · {len(requests):,} requests · {sessions:,} sessions · grid {grid} · "
             f"{engines} engine{'s' if engines > 1 else ''}{f' ({route})' if engines > 1 else ''}")
    table = Table(title=title)
    cols = ["arm"] + (["priorities"] if multi else []) + ["read ms/1k", "turn starts", "fresh %", "p50 behind",
                                                          "p90 behind", "rollbacks", "longest slice ms"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("arm", "priorities") else "right")
    rows = []
    for a in arms:
        row = {"arm": a.name, "priorities": a.priorities, "engines": a.engines, "route": a.route,
               "read_ms_per_1k": a.read_ms_per_1k, "share": a.share, "turns": len(a.turns),
               "fresh": a.fresh, "fresh_pct": round(a.fresh_pct, 2), "p50_behind": a.behind_pct(50),
               "p90_behind": a.behind_pct(90), "chunks_idle": a.chunks_idle, "chunks_share": a.chunks_share,
               "chunks_wasted": a.chunks_wasted, "rollbacks": a.rollbacks, "share_s": round(a.share_s, 3),
               "longest_slice_ms": round(a.longest_slice_s * 1000, 3)}
        rows.append(row)
        table.add_row(a.name, *([a.priorities] if multi else []), f"{a.read_ms_per_1k:g}", f"{len(a.turns):,}",
                      f"{a.fresh_pct:.1f}", f"{row['p50_behind']:,}", f"{row['p90_behind']:,}", f"{a.rollbacks:,}",
                      f"{row['longest_slice_ms']:.1f}")
    console.print(table)
    console.print(f"density per engine: {dens.active:.1f} sessions active at once, {dens.new_tok_s:,.0f} new tokens "
                  f"per second, over {dens.span_s:,.0f} s" + (f" (packed to {pack_to:g} active)" if pack_to else ""))
    solve_rows = []
    for prio, rate, r in solved:
        solve_rows.append({"priorities": prio.label, "read_ms_per_1k": rate, "target_pct": r.target_pct,
                           "share": r.share, "fresh_pct": r.fresh_pct, "below_share": r.below,
                           "below_fresh_pct": r.below_pct, "monotone": r.monotone,
                           "tried": [[round(s, 6), round(f, 2)] for s, f in r.tried]})
        where = f"{rate:g} ms/1k" + (f", priorities {prio.label}" if multi else "")
        if r.share is None:
            console.print(f"share for {r.target_pct:g} % fresh ({where}): not reached at {r.below:.0%} "
                          f"({r.below_pct:.2f} %)")
        else:
            below = "" if r.below is None else f"; {r.below:.2%} gives {r.below_pct:.2f} %"
            console.print(f"share for {r.target_pct:g} % fresh ({where}): {r.share:.2%} ({r.fresh_pct:.2f} %{below})")
    checks = monotone_checks(arms, [r for _, _, r in solved])
    for line in checks["failures"]:
        console.print(f"[bold red]check failed:[/] {line}")
    console.print("checks: more share never less fresh, faster reads never less fresh: "
                  + ("[green]hold[/]" if checks["ok"] else "[bold red]FAIL[/]"))
    if any(kind != "ledger" for kind in kinds.values()):
        console.print(f"service model (where the trace has no first-token or end times): prefill {prefill_tok_s:g} tok/s, "
                      f"decode {decode_tok_s:g} tok/s per request, {slots} slots an engine (Mooncake); trajectories: "
                      f"one slot, ends clamped to the next request; token counts: {token_counts}")
    if csv:
        write_csv(csv, rows)
    if plot:
        _plot(plot, arms)
    if json_out:
        emit_json({
            "command": "replay-ledger", "inputs": [str(f) for f in files], "turns": len(arms[0].turns),
            "sessions": sessions, "requests": len(requests), "grid": grid, "read_ms_per_1k": rates,
            "shares": shares, "engines": engines, "route": route, "pack": pack_to,
            "priorities": [p.label for p in prio_sets],
            "density": {"active_per_engine": round(dens.active, 3), "new_tok_s_per_engine": round(dens.new_tok_s, 1),
                        "span_s": round(dens.span_s, 3)},
            "service": {"prefill_tok_s": prefill_tok_s, "decode_tok_s": decode_tok_s,
                        "slots": slots, "token_counts": token_counts},
            "arms": rows, "solve": solve_rows, "checks": checks,
        })
    if not checks["ok"]:
        raise typer.Exit(1)


def _expand(inputs: list[Path]) -> list[Path]:
    files = []
    for p in inputs:
        if p.is_dir():
            found = sorted(p.glob("*.traj.json"))
            if not found:
                raise ShadowInputError(f"{p} holds no *.traj.json files")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise ShadowInputError(f"no such file or folder {p}")
    return files


def _detect(path: Path) -> str:
    if path.name.endswith(".traj.json"):
        return "trajectory"
    with open(path, errors="replace") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        row = json.loads(first)
    except (ValueError, RecursionError):  # not JSON, a number of thousands of digits, nesting past the limit
        raise ShadowInputError(f"{path}:1: not JSON; cannot tell the format (give --format)") from None
    if isinstance(row, dict) and "hash_ids" in row:
        return "mooncake"
    if isinstance(row, dict) and "session" in row:
        return "ledger"
    raise ShadowInputError(f"{path}: unknown format (a Mooncake trace, a trajectory or a ledger; give --format)")


def _rate_from(path: Path) -> float:
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        rate = float(json.loads(lines[-1])["ms_per_1k_tokens"])
    except (OSError, IndexError, KeyError, ValueError, TypeError, RecursionError) as e:
        raise ShadowInputError(f"{path}: not a read-rate --json output ({type(e).__name__})") from None
    if not math.isfinite(rate) or rate <= 0:
        raise ShadowInputError(f"{path}: its ms_per_1k_tokens is not a positive number ({rate})")
    return rate


def _plot(path: Path, arms) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for a in arms:
        values = sorted(t.behind for t in a.turns)
        if not values:
            continue
        ys = [(i + 1) / len(values) for i in range(len(values))]
        ax.step([v + 1 for v in values], ys, where="post", label=f"{a.name}, {a.read_ms_per_1k:g} ms/1k ({a.fresh_pct:.0f}% fresh)")
    ax.set_xscale("log")
    ax.set_xlabel("tokens behind at turn start (+1)")
    ax.set_ylabel("share of turn starts")
    ax.set_title("how far behind the shadow is")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
