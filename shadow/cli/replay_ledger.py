"""`shadow replay-ledger`: what an operator would see of the shadow on real request timelines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
from rich.table import Table

from shadow.cli.common import (
    CsvOpt, GridOpt, JsonOpt, PlotOpt, bounds, console, emit_json, input_file, output_path, progress, refuse,
    save_figure, user_errors, user_text_file, write_csv, wrote,
)
from shadow.engines.jsonlimits import collection_paused
from shadow.errors import ShadowInputError

FORMATS = ("auto", "mooncake", "trajectory", "ledger")
MAX_PACK = 10_000  # active sessions --pack may ask for (the set is repeated to reach it: copies grow with it)
MAX_SAMPLES = 100_000


def _target(ctx, param, value):
    """--solve-share: a target (`targets.parse_target`), parsed before any work."""
    if value is None:
        return None
    from shadow.offline.targets import parse_target

    try:
        return parse_target(value)
    except ValueError as e:
        refuse(param, str(e))


def _ids(ctx, param, value):
    from shadow.offline.limits import IDS

    if value not in IDS:
        refuse(param, f"is one of {', '.join(IDS)} (got {value!r})")
    return value


def _preset(ctx, param, value):
    from shadow.model.config import PRESETS

    if value not in PRESETS:
        refuse(param, f"is a preset for the sessions' state sizes ({', '.join(PRESETS)}; got {value!r})")
    return value


@user_errors
def replay_ledger(
    inputs: Annotated[list[Path], typer.Argument(help="Trace files: a Mooncake trace (.jsonl), mini-swe-agent trajectories (.traj.json, or a folder of them), or the project's ledger (.jsonl).")],
    fmt: Annotated[str, typer.Option("--format", help="auto, mooncake, trajectory or ledger.")] = "auto",
    read_ms_per_1k: Annotated[list[float] | None, typer.Option("--read-ms-per-1k", callback=bounds(gt=0), help="A chunk cost of this many ms per 1,000 tokens at every depth (repeatable: a sweep).")] = None,
    read_rate_json: Annotated[list[Path] | None, typer.Option(callback=input_file, help="Chunk cost by depth from `shadow read-rate --json` (its last line: rows with context and ms_per_chunk at --grid, linear between depths; one ms_per_1k_tokens if it has no rows), and a batched read's by its batch rows. Repeatable: one arm for each file, each charged its own file's chunk and batch costs (several device calls side by side). Default, with no --read-ms-per-1k: the built-in H200 table (0.8B, grid 512).")] = None,
    batch: Annotated[int, typer.Option(callback=bounds(ge=1, le=8), help="Sessions whose next chunks one read may take together, as `shadow serve --batch` (2, 4 or 8; 1: none). A batched read is charged by the batch rows of --read-rate-json (`shadow read-rate --batches 2,4,8`), else by the H200's measured batches.")] = 1,
    batch_ms: Annotated[float, typer.Option(callback=bounds(gt=0), help="With --batch: the longest a batched read may hold the device at once, by estimate, ms (in the share, the lower of this and the slice), as `shadow serve --batch-ms`.")] = 10.0,
    batch_read_ms: Annotated[float | None, typer.Option(callback=bounds(gt=0), help="With --batch: the longest a batched read in the share may take in all, ms, read in pieces of at most --batch-ms between rounds, as `shadow serve --batch-read-ms` (default: --batch-ms, one piece).")] = None,
    batch_wait_ms: Annotated[float, typer.Option(callback=bounds(ge=0), help="With --batch: while the share is busy (--batch-busy), how long a batch short of --batch waits for more chunks, ms, as `shadow serve --batch-wait-ms` (0: never).")] = 0.0,
    batch_busy: Annotated[float, typer.Option(callback=bounds(gt=0, le=1), help="With --batch-wait-ms: the share is busy when its reads of the last 10 s used at least this part of the share of those 10 s and less than 4 s of its budget is left, as `shadow serve --batch-busy`.")] = 0.4,
    share: Annotated[list[float] | None, typer.Option("--share", callback=bounds(gt=0, lt=1), help="In-turn share(s) of the time since the first token (repeatable). Default 0.02.")] = None,
    grid: GridOpt = 512,
    engines: Annotated[int, typer.Option(callback=bounds(ge=1, says="is at least 1"), help="Engines in the fleet, each with its own idle time, share and shadow.")] = 1,
    route: Annotated[str, typer.Option(help="How requests reach engines: affinity (a session stays where its first request went, the engine with the fewest requests in flight), hash or rendezvous (of the session name; stays) or round-robin (request by request).")] = "affinity",
    pack_to: Annotated[float | None, typer.Option("--pack", callback=bounds(gt=0, le=MAX_PACK, says=f"needs a positive number of active sessions, at most {MAX_PACK:,}"), help="Shift sessions' start times so that this many are active at once on average (repeating the set where shifting alone cannot; at most 10,000). Not for Mooncake traces (their times come from the service model).")] = None,
    priorities: Annotated[list[str] | None, typer.Option("--priorities", help="The scheduler's order steps: all, none, or some of question,running,fewest,recent,oldest joined by commas (repeatable: arms side by side on the same timelines). Default all.")] = None,
    solve_share: Annotated[str | None, typer.Option("--solve-share", callback=_target, help="Also find the smallest share that meets a target (bisection), for each cost and priority set: 'p99 ask wait <= 50 ms', 'p90 time to fresh <= 2 s', 'stale sessions <= 5 %', 'fresh >= 97 %' (a bare number N: fresh >= N %).")] = None,
    ids: Annotated[str, typer.Option("--ids", callback=_ids, help="When a turn's ids reach the shadow: engine (prompt ids on the first streamed chunk, output as streamed: vLLM), tokenizer (the proxy's template round trip, output as streamed), end (output only when the response is over), none (output never), embedded (at once: the embedded generator).")] = "engine",
    cap_gib: Annotated[float, typer.Option(callback=bounds(gt=0, zero=True), help="Resident cap of each shadow, GiB, as `shadow serve --cap-gib` (0: no cap).")] = 4.0,
    disk: Annotated[bool, typer.Option("--disk/--no-disk", help="Sessions past the cap spill to disk and are restored (or dropped, where reading again is cheaper), as `shadow serve --disk`; without, they are dropped and read again.")] = False,
    model: Annotated[str, typer.Option(callback=_preset, help="The shadow's model, for its sessions' state sizes (bf16).")] = "qwen3.5-0.8b",
    voice_share: Annotated[float, typer.Option(callback=bounds(ge=0, le=0.5), help="Each decoding turn's voice phrases as load, up to this share of its time since its first token (`shadow serve --voice-share`; 0: none).")] = 0.03,
    label_ms: Annotated[float, typer.Option(callback=bounds(ge=0), help="After each turn, a standing question's label asked of the engine for this long before the turn ends (`--label-from-upstream`; 0: none).")] = 0.0,
    asks_per_hour: Annotated[float, typer.Option(callback=bounds(ge=0), help="Asks per active session per hour (Poisson), each reading its session to its end and one forward, as load.")] = 0.0,
    restore_gib_s: Annotated[float, typer.Option(callback=bounds(gt=0), help="Restore speed, GiB/s of a session's file (default: the H200's, docs/STORE.md).")] = 1.86,
    spill_gib_s: Annotated[float, typer.Option(callback=bounds(gt=0), help="Spill speed, GiB/s (default: the H200's).")] = 1.34,
    ask_ms: Annotated[float, typer.Option(callback=bounds(ge=0), help="One ask's forward, ms (default: the H200's at 41k ids).")] = 8.0539,
    phrase_ms: Annotated[float, typer.Option(callback=bounds(gt=0), help="One voice phrase, ms (default: the H200's median).")] = 66.56,
    tokenize_ms_per_1k: Annotated[float, typer.Option(callback=bounds(ge=0), help="The proxy's template and tokenizer, ms per 1,000 prompt ids (--ids tokenizer, end, none; default: measured on a 2-core CPU).")] = 2.621,
    samples: Annotated[int, typer.Option(callback=bounds(ge=0, le=MAX_SAMPLES), help="Random times at which every active session is looked at (lag, ask wait).")] = 1000,
    seed: Annotated[int, typer.Option(callback=bounds(ge=0, le=2**63 - 1), help="Seed of the random times and asks.")] = 0,
    window_s: Annotated[float, typer.Option(callback=bounds(gt=0), help="Width of the windows of the load over time, seconds.")] = 60.0,
    check_fleet: Annotated[bool, typer.Option("--check-fleet", help="Also replay on one engine more and report every turn start fresh on --engines and stale on one more, and why.")] = False,
    prefill_tok_s: Annotated[float, typer.Option(callback=bounds(gt=0), help="Service model, for traces without first-token and end times: prefill tokens per second.")] = 20_000.0,
    decode_tok_s: Annotated[float, typer.Option(callback=bounds(gt=0), help="Service model: decode tokens per second per request.")] = 40.0,
    slots: Annotated[int, typer.Option(callback=bounds(ge=1), help="Service model (Mooncake): requests each engine serves at once, first come first served.")] = 32,
    token_counts: Annotated[str, typer.Option(help="Trajectories: 'qwen' (re-render and re-tokenise with the Qwen3.5 vocabulary) or 'usage' (the provider's counts).")] = "qwen",
    write_ledger_to: Annotated[Path | None, typer.Option("--write-ledger", callback=output_path, help="Write the imported (and packed) requests as a ledger (JSONL).")] = None,
    plot: PlotOpt = None,
    csv: CsvOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Replay request timelines through the read scheduler (`shadow/core/schedule.py`) on a fleet of
    engines, with the live service's limits (the resident cap and its store, when ids reach the
    shadow, turns ended as the service ends them, the voice, asks) and the device's costs (a chunk
    by its depth, restores, spills), and report what an operator would see: freshness at turn
    starts, the wait an ask would have then and at random times, each turn's time until its prompt
    was read, each session's worst lag, and the load over time beside it. Arms: idle only and
    idle + share for each cost, share and priority set. The command checks that more share and
    faster reads are never less fresh, and exits 1 if they are."""
    from shadow.offline.ledger import ROUTES, ServiceModel, import_trajectory, mooncake_arrivals, read_ledger, rebase, \
        write_ledger

    if fmt not in FORMATS:
        raise ShadowInputError(f"unknown format {fmt!r} ({', '.join(FORMATS)})")
    if token_counts not in ("qwen", "usage"):
        raise ShadowInputError("--token-counts is 'qwen' or 'usage'")
    if route not in ROUTES:
        raise ShadowInputError(f"--route is one of {', '.join(ROUTES)} (got {route!r})")
    from shadow.core.schedule import BandwidthRule, Priorities
    from shadow.offline.costs import BatchTable, ChunkTable, CostTable
    from shadow.offline.limits import live

    if batch not in (1, 2, 4, 8):
        raise ShadowInputError(f"--batch is 1, 2, 4 or 8 (the batch sizes a reader has CUDA graphs for; got {batch})")
    paths = read_rate_json or []
    if len({p.resolve() for p in paths}) < len(paths):
        raise ShadowInputError("--read-rate-json names the same file twice (each file is one arm)")
    names = [p.name for p in paths]  # a file's name labels its arms, its path where two share a name
    measured = [_table_from(p, grid, p.name if names.count(p.name) == 1 else str(p)) for p in paths]
    # a flat cost is charged the first file's batch rows (the H200's where no file has any); a file its own
    first_batches = next((b for _, b in measured if b is not None), None) or BatchTable.h200()
    pairs = [(ChunkTable.flat(r, grid), first_batches) for r in read_ms_per_1k or []]
    pairs += [(table, batches or BatchTable.h200()) for table, batches in measured]
    pairs = pairs or [(ChunkTable.h200(grid), BatchTable.h200())]
    tables, batches_of = [t for t, _ in pairs], {id(t): b for t, b in pairs}
    batch_label = ", ".join(dict.fromkeys(b.label for _, b in pairs))
    shares = share or [0.02]
    try:
        prio_sets = [Priorities.parse(p) for p in (priorities or ["all"])]
    except ValueError as e:
        raise ShadowInputError(str(e)) from None
    limits = live(ids, cap_gib or None, model, disk, voice_share, label_s=label_ms / 1000, asks_per_hour=asks_per_hour,
                  seed=seed)
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
        if check_fleet and arrivals and requests:
            raise ShadowInputError("--check-fleet replays a Mooncake trace on its own")
        requests = rebase(requests) if requests else requests
        fleets = {}
        for n in [engines] + ([engines + 1] if check_fleet else []):
            fleets[n] = _routed(arrivals, requests, service, n, route, pack_to)
        requests, engine_of = fleets[engines]
        if write_ledger_to:
            write_ledger(write_ledger_to, requests)
            wrote(write_ledger_to)
        from shadow.offline.metrics import load, summary
        from shadow.offline.replay import density, replay
        from shadow.offline.timelines import windows

        dens = density(requests, engines)
        series = windows(requests, engine_of, engines, window_s, grid, limits.state)

        def run(table, s: float | None, prio, n: int = engines):
            reqs, eo = fleets[n]
            costs = CostTable(table, restore_gib_s, spill_gib_s, ask_ms / 1000, phrase_ms / 1000,
                              tokenize_ms_per_1k / 1000, batches_of[id(table)])
            rule = BandwidthRule(share=s or 0.02, batch=batch, batch_s=batch_ms / 1000,
                                 batch_read_s=None if batch_read_ms is None else batch_read_ms / 1000,
                                 batch_wait_s=batch_wait_ms / 1000, batch_busy=batch_busy)
            arm = replay(reqs, None, grid, rule, use_share=bool(s), name=_share_name(s), engines=n, route=route,
                         engine_of=eo, priorities=prio, costs=costs, limits=limits, samples=samples, seed=seed)
            if table.depths == (0,):
                arm.read_ms_per_1k = table.ms_per_1k(0, grid)
            return arm

        plan = [x for prio in prio_sets
                for x in [(prio, t, None) for t in tables] + [(prio, t, s) for t in tables for s in shares]]
        task = bar.add_task("replaying", total=len(plan) * (2 if check_fleet else 1))
        arms, summaries = [], []
        for prio, table, s in plan:
            arms.append(run(table, s, prio))
            summaries.append(summary(arms[-1], series, grid))
            bar.advance(task)
        fleet = []
        if check_fleet:
            from shadow.offline.fleet import inversions

            for (prio, table, s), arm in zip(plan, arms):
                more = run(table, s, prio, engines + 1)
                fleet.append(inversions(fleets[engines + 1][0], arm, more, engine_of, fleets[engines + 1][1]))
                fleet[-1]["arm"] = _label(arm, len(tables) > 1, len(prio_sets) > 1)
                bar.advance(task)
        solved = []
        if solve_share is not None:
            from shadow.offline.targets import solve

            task = bar.add_task(f"solving for {solve_share.text}", total=len(tables) * len(prio_sets))
            for prio in prio_sets:
                for table in tables:
                    seen: dict[float, dict] = {}

                    def figure_at(x: float, table=table, prio=prio, seen=seen):
                        seen[x] = summary(run(table, x or None, prio), series, grid)
                        return solve_share.figure(seen[x])

                    solved.append((prio, table, solve(figure_at, solve_share), seen))
                    bar.advance(task)

    multi_cost, multi_prio = len(tables) > 1, len(prio_sets) > 1
    sessions = len({r.session for r in requests})
    _tables(arms, summaries, multi_cost, multi_prio, requests, sessions, grid, engines, route)
    console.print(_load_table(load(series), window_s))
    console.print(f"mean over the whole span, per engine: {dens.active:.1f} sessions active at once, "
                  f"{dens.new_tok_s:,.0f} new tokens per second, over {dens.span_s:,.0f} s"
                  + (f" (packed to {pack_to:g} active)" if pack_to else ""))
    solve_rows = _print_solved(solved, multi_prio, grid)
    for f in fleet:
        _print_fleet(f)
    from shadow.offline.replay import monotone_checks

    checks = monotone_checks(arms)
    for line in checks["failures"]:
        console.print(f"[bold red]check failed:[/] {line}")
    console.print("checks: more share never less fresh, faster reads never less fresh: "
                  + ("[green]hold[/]" if checks["ok"] else "[bold red]FAIL[/]"))
    console.print(_limits_line(limits, tables, restore_gib_s, spill_gib_s, ask_ms, phrase_ms, tokenize_ms_per_1k,
                               batch, batch_label, _batch_words(batch_ms, batch_read_ms, batch_wait_ms, batch_busy)))
    if any(kind != "ledger" for kind in kinds.values()):
        console.print(f"service model (where the trace has no first-token or end times): prefill {prefill_tok_s:g} tok/s, "
                      f"decode {decode_tok_s:g} tok/s per request, {slots} slots an engine (Mooncake); trajectories: "
                      f"one slot, ends clamped to the next request; token counts: {token_counts}")
    rows = [_row(a, s) for a, s in zip(arms, summaries)]
    if csv:
        write_csv(csv, [{k: v for k, v in r.items() if k != "summary"} for r in rows])
    if plot:
        _plot(plot, arms)
    if json_out:
        emit_json({
            "command": "replay-ledger", "inputs": [str(f) for f in files], "turns": len(arms[0].turns),
            "sessions": sessions, "requests": len(requests), "grid": grid,
            "read_ms_per_1k": [t.ms_per_1k(0, grid) for t in tables if t.depths == (0,)],
            "costs": [{"label": t.label, "depths": list(t.depths), "ms_per_chunk": [round(x * 1000, 6) for x in t.seconds],
                       "batch_costs": batches_of[id(t)].label} for t in tables],
            "shares": shares, "batch": batch, "batch_ms": batch_ms if batch > 1 else None,
            "batch_read_ms": (batch_read_ms or batch_ms) if batch > 1 else None,
            "batch_wait_ms": batch_wait_ms if batch > 1 else None, "batch_busy": batch_busy if batch > 1 and batch_wait_ms else None,
            "batch_costs": batch_label if batch > 1 else None,
            "engines": engines, "route": route, "pack": pack_to,
            "priorities": [p.label for p in prio_sets],
            "limits": {"ids": ids, "cap_gib": cap_gib or None, "disk": disk, "model": model, "voice_share": voice_share,
                       "label_ms": label_ms, "asks_per_hour": asks_per_hour, "restore_gib_s": restore_gib_s,
                       "spill_gib_s": spill_gib_s, "ask_ms": ask_ms, "phrase_ms": phrase_ms,
                       "tokenize_ms_per_1k": tokenize_ms_per_1k, "samples": samples, "seed": seed},
            "density": {"active_per_engine": round(dens.active, 3), "new_tok_s_per_engine": round(dens.new_tok_s, 1),
                        "span_s": round(dens.span_s, 3)},
            "load": load(series),
            "windows": [{"engine": w.engine, "start": round(w.start, 3), "active": round(w.active, 3),
                         "new_tok_s": round(w.new_tok_s, 1),
                         "state_gib": None if w.state_gib is None else round(w.state_gib, 3)} for w in series],
            "service": {"prefill_tok_s": prefill_tok_s, "decode_tok_s": decode_tok_s,
                        "slots": slots, "token_counts": token_counts},
            "arms": rows, "solve": solve_rows, "fleet": fleet, "checks": checks,
        })
    if not checks["ok"]:
        raise typer.Exit(1)


def _routed(arrivals, requests, service, engines: int, route: str, pack_to):
    """(requests, engine of each) for a fleet of `engines`: a Mooncake trace routed as it arrives
    and timed by its engine; other timelines packed, then routed."""
    from shadow.offline.ledger import rebase, route_requests
    from shadow.offline.timelines import pack

    if arrivals:  # routed as they come, then timed by their engine's service model
        served, engine_of = service.serve_fleet(arrivals, engines, route)
        return rebase(served + list(requests)), engine_of + [0] * len(requests)
    reqs = pack(requests, pack_to) if pack_to is not None else requests
    return reqs, route_requests(reqs, engines, route)


def _share_name(s: float | None) -> str:
    if not s:
        return "idle only"
    return f"idle + {s:.0%} share" if round(s * 100, 6) == round(s * 100) else f"idle + {s:.2%} share"


def _label(arm, multi_cost: bool, multi_prio: bool) -> str:
    short = "idle" if not arm.share else arm.name.removeprefix("idle + ").removesuffix(" share")
    return " · ".join([short] + ([arm.cost] if multi_cost else []) + ([arm.priorities] if multi_prio else []))


def _fmt(v, digits: int = 1, never: bool = False) -> str:
    if v is None:
        return "never" if never else "-"
    return f"{v:,.0f}" if digits == 0 else f"{v:,.{digits}f}"


def _tables(arms, summaries, multi_cost, multi_prio, requests, sessions, grid, engines, route) -> None:
    """The arms' figures in tables of at most 80 columns."""
    console.print(f"replay-ledger · {len(requests):,} requests · {sessions:,} sessions · grid {grid} · {engines} "
                  f"engine{'s' if engines > 1 else ''}{f' ({route})' if engines > 1 else ''}")
    specs = [
        ("turn starts of sessions with earlier turns", ["fresh %", "p50\nbehind", "p90\nbehind", "ask wait\np50 ms", "ask wait\np99 ms"],
         lambda s: [_fmt(s["turn_starts"]["fresh_pct"]), _fmt(s["turn_starts"]["behind"]["p50"], 0),
                    _fmt(s["turn_starts"]["behind"]["p90"], 0), _fmt(s["turn_starts"]["ask_wait_ms"]["p50"]),
                    _fmt(s["turn_starts"]["ask_wait_ms"]["p99"])]),
        ("random times: an ask about an active session", ["stale %", "p50 lag", "ask wait\np50 ms", "ask wait\np90 ms",
                                                           "ask wait\np99 ms"],
         lambda s: [_fmt(s["random"]["stale_pct"]), _fmt(s["random"]["lag"]["p50"], 0),
                    _fmt(s["random"]["ask_wait_ms"]["p50"]), _fmt(s["random"]["ask_wait_ms"]["p90"]),
                    _fmt(s["random"]["ask_wait_ms"]["p99"])]),
        ("turns and sessions", ["to fresh\np50 s", "to fresh\np90 s", "never\nfresh %", "sessions\never stale %",
                                "worst lag\nmax"],
         lambda s: [_fmt(s["to_fresh_s"]["p50"], 2, True), _fmt(s["to_fresh_s"]["p90"], 2, True),
                    _fmt(s["to_fresh_s"]["never_pct"]), _fmt(s["sessions"]["ever_stale_pct"]),
                    _fmt(s["sessions"]["worst_lag"]["max"], 0)]),
        ("the busiest windows (new tokens/s at or above their p90)", ["windows", "turn\nstarts", "fresh %",
                                                                      "ask wait\np99 ms", "turn start\np99 ms"],
         lambda s: [str(s["peak"]["windows"]), f"{s['peak']['turn_starts']:,}", _fmt(s["peak"]["fresh_pct"]),
                    _fmt(s["peak"]["ask_wait_ms"]["p99"]), _fmt(s["peak"]["turn_start_ask_wait_ms"]["p99"])]),
        ("the shadow's device work", ["spills", "restores", "drops", "rollbacks", "voice s"],
         lambda s: [f"{s['store']['spills']:,}", f"{s['store']['restores']:,}", f"{s['store']['drops']:,}",
                    f"{s['rollbacks']:,}", _fmt(s["voice_s"])]),
    ]
    for name, cols, cells in specs:
        table = Table(title=name, title_justify="left")
        table.add_column("arm")
        for col in cols:
            table.add_column(col, justify="right")
        for a, s in zip(arms, summaries):
            table.add_row(_label(a, multi_cost, multi_prio), *cells(s | {"rollbacks": a.rollbacks}))
        console.print(table)


def _load_table(load: dict, window_s: float) -> Table:
    table = Table(title=f"load per engine over time ({load['windows']:,} windows of {window_s:g} s)",
                  title_justify="left")
    for col in ("", "p50", "p90", "peak"):
        table.add_column(col, justify="right" if col else "left")
    for key, name, digits in (("active", "sessions active", 1), ("new_tok_s", "new tokens/s", 0),
                              ("state_gib", "state if all held, GiB", 2)):
        v = load.get(key)
        if v:
            table.add_row(name, *(_fmt(v[k], digits) for k in ("p50", "p90", "peak")))
    return table


def _row(a, s: dict) -> dict:
    return {"arm": a.name, "priorities": a.priorities, "engines": a.engines, "route": a.route,
            "read_ms_per_1k": a.read_ms_per_1k, "cost": a.cost, "share": a.share, "turns": len(a.turns),
            "fresh": a.fresh, "fresh_pct": round(a.fresh_pct, 2), "p50_behind": a.behind_pct(50),
            "p90_behind": a.behind_pct(90), "chunks_idle": a.chunks_idle, "chunks_share": a.chunks_share,
            "chunks_ask": a.chunks_ask, "chunks_wasted": a.chunks_wasted, "rollbacks": a.rollbacks,
            "share_s": round(a.share_s, 3), "longest_slice_ms": round(a.longest_slice_s * 1000, 3), "summary": s}


def _print_solved(solved, multi_prio: bool, grid: int) -> list[dict]:
    out = []
    for prio, table, r, seen in solved:
        fresh = {x: s["turn_starts"]["fresh_pct"] for x, s in seen.items()}
        out.append({"priorities": prio.label, "cost": table.label,
                    "read_ms_per_1k": table.ms_per_1k(0, grid) if table.depths == (0,) else None,
                    "target": r.target.text, "target_pct": r.target.value if r.target.metric == "fresh" else None,
                    "share": r.share, "value": r.value, "fresh_pct": fresh.get(r.share),
                    "below_share": r.below, "below_value": r.below_value, "below_fresh_pct": fresh.get(r.below),
                    "monotone": r.monotone, "tried": [[round(x, 6), v] for x, v in r.tried]})
        where = table.label + (f", priorities {prio.label}" if multi_prio else "")
        unit = r.target.text.rsplit(" ", 1)[-1]
        if r.share is None:
            console.print(f"share for {r.target.text} ({where}): not met at {r.below:.0%} ({_fmt(r.below_value, 2)} {unit})")
        else:
            below = "" if r.below is None else f"; {r.below:.2%} gives {_fmt(r.below_value, 2)} {unit}"
            console.print(f"share for {r.target.text} ({where}): {r.share:.2%} ({_fmt(r.value, 2)} {unit}{below})"
                          + ("" if r.monotone else " [bold red](not monotone in share among the tries)[/]"))
    return out


def _print_fleet(f: dict) -> None:
    n, m = f["engines"]
    causes = ", ".join(f"{c['sessions']} {name}" for name, c in f["causes"].items() if c["sessions"])
    console.print(f"fleet {n} -> {m} engines ({f['arm']}): fresh turn starts {f['fresh'][0]:,} -> {f['fresh'][1]:,}; "
                  f"{f['inversions']:,} fresh on {n} and stale on {m}, in {f['sessions']} sessions"
                  + (f" ({causes})" if causes else ""))
    for r in f["rows"][:5]:
        console.print(f"  {r['session']}: {r['turns']} turn start(s), {r['why']}")


def _batch_words(batch_ms: float, read_ms: float | None, wait_ms: float, busy: float) -> str:
    """How batches are bounded, in words: 'at most 10 ms', '50 ms in pieces of 10 ms', with the wait."""
    words = f"at most {batch_ms:g} ms" if read_ms is None or read_ms <= batch_ms else \
        f"up to {read_ms:g} ms in pieces of {batch_ms:g} ms between rounds"
    if wait_ms:
        words += f", a batch short of the most waiting up to {wait_ms:g} ms for more while the share is {busy:.0%} used and its budget low"
    return words


def _limits_line(limits, tables, restore, spill, ask, phrase, tokenize, batch, batch_label, batch_ms) -> str:
    cap = f"cap {limits.cap_gib:g} GiB a shadow ({'spill to disk' if limits.disk else 'no disk: dropped past it'})" \
        if limits.cap_gib else "no cap"
    batches = f"batches of up to {batch}, {batch_ms} ({batch_label})" if batch > 1 else "no batches"
    return (f"live limits: ids {limits.ids}; {cap}; voice share {limits.voice_share:g}; label {limits.label_s * 1000:g} ms; "
            f"asks {limits.asks_per_hour:g}/h a session; {batches}. costs: chunk {', '.join(t.label for t in tables)}; restore "
            f"{restore:g} GiB/s, spill {spill:g} GiB/s, ask {ask:g} ms, phrase {phrase:g} ms, tokenizer {tokenize:g} "
            "ms/1k (defaults: measured, docs/FRESHNESS.md)")


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
        with collection_paused():
            row = json.loads(first)
    except (ValueError, RecursionError):  # not JSON, a number of thousands of digits, nesting past the limit
        raise ShadowInputError(f"{path}:1: not JSON; cannot tell the format (give --format)") from None
    if isinstance(row, dict) and "hash_ids" in row:
        return "mooncake"
    if isinstance(row, dict) and "session" in row:
        return "ledger"
    raise ShadowInputError(f"{path}: unknown format (a Mooncake trace, a trajectory or a ledger; give --format)")


def _table_from(path: Path, grid: int, label: str):
    """The chunk table of a `read-rate --json` output, and its batch table (None: no batch rows),
    both labelled `label`."""
    from shadow.offline.costs import BatchTable, ChunkTable, read_rate_document

    try:
        with collection_paused():
            doc = read_rate_document(path.read_text())
        return ChunkTable.from_read_rate(doc, grid, label), BatchTable.from_read_rate(doc, grid, label)
    except (OSError, IndexError, KeyError, ValueError, TypeError, RecursionError, UnicodeDecodeError) as e:
        raise ShadowInputError(f"{path}: not a read-rate --json output ({type(e).__name__}: {e})") from None


def _plot(path: Path, arms) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for a in arms:
        values = sorted(t.behind for t in a.turns)
        waits = sorted(p.wait_s * 1000 for p in a.probes)
        label = f"{a.name}, {a.cost} ({a.fresh_pct:.1f} % fresh)"
        if values:
            left.step([v + 1 for v in values], [(i + 1) / len(values) for i in range(len(values))], where="post",
                      label=label)
        if waits:
            right.step([w + 0.01 for w in waits], [(i + 1) / len(waits) for i in range(len(waits))], where="post",
                       label=a.name)
    left.set_xscale("log")
    left.set_xlabel("tokens behind at turn start (+1)")
    left.set_ylabel("share of turn starts")
    left.set_title("how far behind the shadow is")
    left.legend(fontsize=7)
    right.set_xscale("log")
    right.set_xlabel("ask wait at a random time, ms (+0.01)")
    right.set_ylabel("share of looks")
    right.set_title("how long an ask would wait")
    save_figure(fig, path)
