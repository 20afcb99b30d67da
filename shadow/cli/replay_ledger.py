"""`shadow replay-ledger`: what an operator would see of the shadow on real request timelines. The
experiment is the library's (`shadow.offline.plan`); this reads the traces, hands the plan over and
shows its outcome. The options it shares with `shadow serve` (the grid, the bandwidth rule and its
batches, the priorities, the resident cap, the voice's share) are generated from the serve settings,
defaults included; the replay's own take theirs from the library's defaults."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
from rich.table import Table

from shadow.cli.common import (
    CsvOpt, JsonOpt, PlotOpt, bounds, console, emit_json, input_file, output_path, progress, refuse, save_figure,
    setting_parameter, user_errors, user_text_file, with_options, write_csv, wrote,
)
from shadow.engines.jsonlimits import collection_paused
from shadow.errors import ShadowInputError
from shadow.offline.costs import (
    CPU_TOKENIZE_MS_PER_1K, H200_ASK_MS, H200_PHRASE_MS, H200_RESTORE_GIB_S, H200_SPILL_GIB_S, GPU_HOST_GIB_S,
)
from shadow.offline.ledger import ServiceModel
from shadow.offline.limits import LIVE_IDS, LIVE_MODEL, ReplayLimits
from shadow.offline.metrics import spread
from shadow.offline.plan import Plan, flat_ms_per_1k
from shadow.server.settings import StoreSettings, options, settings_from

FORMATS = ("auto", "mooncake", "trajectory", "ledger")
MAX_PACK = 10_000  # active sessions --pack may ask for (the set is repeated to reach it: copies grow with it)
MAX_SAMPLES = 100_000
# serve's options the replay shares: (name, repeatable, 0 passes as "none", what the replay adds to the help)
SHARED = {"grid": (False, False, ""), "cap_gib": (False, True, "Each shadow's (proxy mode's default); 0: no cap."),
          "host_cap_gib": (False, False, "Each shadow's (as on a GPU); its moves are charged --host-gib-s."),
          "restore_ahead": (False, False, "Modelled: one restore at a time, beside the reads, charged to no device time."),
          "prefix_cache": (False, False, "Modelled (`shadow/offline/prefixmodel.py`): every first prompt shares "
                                         "--shared-prefix-tokens ids; a hit's copies are charged --host-gib-s."),
          "prefix_cache_gib": (False, False, "Each shadow's."),
          "predict": (False, False, "Modelled where a ledger says what each turn's end predicts (its predicted_* "
                                    "counts: trajectories imported with --chat-template)."),
          "read_ahead": (False, False, "Modelled as --predict is."),
          "chat_template": (False, False, "Trajectories are rendered with it and the real Qwen3.5 vocabulary, as the "
                                          "proxy renders them, each next prompt predicted as the proxy predicts it "
                                          "(else the Qwen3.5-style template in code)."),
          "share": (True, False, "Repeatable: an arm for each."), "slice_ms": (False, False, ""),
          "batch": (False, False, "A batched read is charged by the batch rows of --read-rate-json (`shadow read-rate "
                                  "--batches 2,4,8`), else by the built-in table's."),
          "batch_ms": (False, False, ""), "batch_read_ms": (False, False, ""), "batch_wait_ms": (False, False, ""),
          "batch_busy": (False, False, ""),
          "priorities": (True, False, "Repeatable: arms side by side on the same timelines."),
          "voice_share": (False, False, "As load: each decoding turn's phrases (0: none).")}


def _shared() -> list:
    """The generated options `shadow serve` shares with the replay (no environment variables: those are serve's)."""
    return [setting_parameter(s, repeat=SHARED[s.name][0], zero=SHARED[s.name][1], note=SHARED[s.name][2])
            for s in options() if s.name in SHARED]


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


@with_options(_shared())
@user_errors
def replay_ledger(
    inputs: Annotated[list[Path], typer.Argument(help="Trace files: a Mooncake trace (.jsonl), mini-swe-agent trajectories (.traj.json, or a folder of them), or the project's ledger (.jsonl).")],
    *,
    fmt: Annotated[str, typer.Option("--format", help="auto, mooncake, trajectory or ledger.")] = "auto",
    read_ms_per_1k: Annotated[list[float] | None, typer.Option("--read-ms-per-1k", callback=bounds(gt=0), help="A chunk cost of this many ms per 1,000 tokens at every depth (repeatable: a sweep).")] = None,
    read_rate_json: Annotated[list[Path] | None, typer.Option(callback=input_file, help="Chunk cost by depth from `shadow read-rate --json` (its last line: rows with context and ms_per_chunk at --grid, linear between depths; one ms_per_1k_tokens if it has no rows), and a batched read's by its batch rows. Repeatable: one arm for each file, each charged its own file's chunk and batch costs (several device calls side by side). Default, with no --read-ms-per-1k: the built-in table, measured on an H200 (0.8B, grid 512).")] = None,
    charge_json: Annotated[Path | None, typer.Option(callback=input_file, help="What a share read is charged at most, by depth (at two depths at least) and a batched read's by its batch rows, in `read-rate --json`'s shape: the costs a live `serve --share-charge alone` kept at load (its status `reading.charge_ms_by_depth`, as the density driver writes it to `charge.json`). Default: a share read is charged its modelled seconds.")] = None,
    engines: Annotated[int, typer.Option(callback=bounds(ge=1, says="is at least 1"), help="Engines in the fleet, each with its own idle time, share and shadow.")] = Plan.engines,
    route: Annotated[str, typer.Option(help="How requests reach engines: affinity (a session stays where its first request went, the engine with the fewest requests in flight), hash or rendezvous (of the session name; stays) or round-robin (request by request).")] = Plan.route,
    pack_to: Annotated[float | None, typer.Option("--pack", callback=bounds(gt=0, le=MAX_PACK, says=f"needs a positive number of active sessions, at most {MAX_PACK:,}"), help="Shift sessions' start times so that this many are active at once on average (repeating the set where shifting alone cannot; at most 10,000). Not for Mooncake traces (their times come from the service model).")] = None,
    solve_share: Annotated[str | None, typer.Option("--solve-share", callback=_target, help="Also find the smallest share that meets a target (bisection), for each cost and priority set: 'p99 ask wait <= 50 ms', 'p90 time to fresh <= 2 s', 'stale sessions <= 5 %', 'fresh >= 90 %', 'ready >= 97 %' (turn starts ready for the new prompt; a bare number N: fresh >= N %).")] = None,
    ids: Annotated[str, typer.Option("--ids", callback=_ids, help="When a turn's ids reach the shadow: engine (prompt ids on the first streamed chunk, output as streamed: vLLM), tokenizer (the proxy's template round trip, output as streamed), end (output only when the response is over), none (output never), embedded (at once: the embedded generator).")] = LIVE_IDS,
    disk: Annotated[bool, typer.Option("--disk/--no-disk", help="Sessions past the caps spill to disk and are restored, as `shadow serve` does (its default disk folder, or --disk); --no-disk: they are dropped and read again, as `shadow serve --no-disk`.")] = not StoreSettings().no_disk,
    model: Annotated[str, typer.Option(callback=_preset, help="The shadow's model, for its sessions' state sizes (bf16).")] = LIVE_MODEL,
    label_ms: Annotated[float, typer.Option(callback=bounds(ge=0), help="After each turn, a standing question's label asked of the engine for this long before the turn ends (`--label-from-upstream`; 0: none).")] = ReplayLimits.label_s * 1000,
    asks_per_hour: Annotated[float, typer.Option(callback=bounds(ge=0), help="Asks per active session per hour (Poisson), each reading its session to its end and one forward, as load.")] = ReplayLimits.asks_per_hour,
    asks_at: Annotated[Path | None, typer.Option("--asks-at", callback=input_file, help="Asks at the times a client sent them instead of --asks-per-hour (JSON Lines: time on the ledger's clock, session, optional kind; a live run's asks), the answers' waits reported by kind. Not with --pack.")] = None,
    shared_prefix_tokens: Annotated[int, typer.Option(callback=bounds(ge=0), help="With --prefix-cache: the ids every session's first prompt shares with the others' (a system prompt and tool definitions; a ledger holds no ids, so this says what the sessions share).")] = ReplayLimits.shared_prefix_tokens,
    restore_gib_s: Annotated[float, typer.Option(callback=bounds(gt=0), help="Restore speed, GiB/s of a session's file (default: measured on an H200, docs/STORE.md).")] = H200_RESTORE_GIB_S,
    spill_gib_s: Annotated[float, typer.Option(callback=bounds(gt=0), help="Spill speed, GiB/s (default: measured on an H200).")] = H200_SPILL_GIB_S,
    host_gib_s: Annotated[float, typer.Option(callback=bounds(gt=0), help="Speed of a move to or from the host tier, GiB/s (default: the host tier's measured moves, docs/STORE.md).")] = GPU_HOST_GIB_S,
    ask_ms: Annotated[float, typer.Option(callback=bounds(ge=0), help="One ask's forward, ms (default: measured on an H200 at depth).")] = H200_ASK_MS,
    ask_samples_json: Annotated[Path | None, typer.Option("--ask-forwards-json", callback=input_file, help="An ask's forward as a live run measured them: a JSON list of ms (a live density run's `ask-forwards.json`); each replayed ask draws one (seeded by --seed) instead of --ask-ms.")] = None,
    host_rates_json: Annotated[Path | None, typer.Option(callback=input_file, help="A move back from the host tier as a live run measured them: a JSON list of GiB/s (a live density run's `host-rates.json`); each replayed move back draws one (seeded by --seed) instead of --host-gib-s.")] = None,
    ask_chunk_scale: Annotated[float, typer.Option(callback=bounds(gt=0, le=100), help="An ask's chunks cost this times the table's (a live run's asks' seconds per chunk over its share's: their reads meet another share of the engine's work).")] = 1.0,
    phrase_ms: Annotated[float, typer.Option(callback=bounds(gt=0), help="One voice phrase, ms (default: the median measured on an H200).")] = H200_PHRASE_MS,
    tokenize_ms_per_1k: Annotated[float, typer.Option(callback=bounds(ge=0), help="The proxy's template and tokenizer, ms per 1,000 prompt ids (--ids tokenizer, end, none; default: measured on a 2-core CPU).")] = CPU_TOKENIZE_MS_PER_1K,
    samples: Annotated[int, typer.Option(callback=bounds(ge=0, le=MAX_SAMPLES), help="Random times at which every active session is looked at (lag, ask wait).")] = Plan.samples,
    seed: Annotated[int, typer.Option(callback=bounds(ge=0, le=2**63 - 1), help="Seed of the random times and asks.")] = ReplayLimits.seed,
    window_s: Annotated[float, typer.Option(callback=bounds(gt=0), help="Width of the windows of the load over time, seconds.")] = Plan.window_s,
    check_fleet: Annotated[bool, typer.Option("--check-fleet", help="Also replay on one engine more and report every turn start fresh on --engines and stale on one more, and why.")] = Plan.check_fleet,
    prefill_tok_s: Annotated[float, typer.Option(callback=bounds(gt=0), help="Service model, for traces without first-token and end times: prefill tokens per second.")] = ServiceModel.prefill_tok_s,
    decode_tok_s: Annotated[float, typer.Option(callback=bounds(gt=0), help="Service model: decode tokens per second per request.")] = ServiceModel.decode_tok_s,
    slots: Annotated[int, typer.Option(callback=bounds(ge=1), help="Service model (Mooncake): requests each engine serves at once, first come first served.")] = ServiceModel.slots,
    token_counts: Annotated[str, typer.Option(help="Trajectories: 'qwen' (re-render and re-tokenise with the Qwen3.5 vocabulary) or 'usage' (the provider's counts).")] = "qwen",
    write_ledger_to: Annotated[Path | None, typer.Option("--write-ledger", callback=output_path, help="Write the imported (and packed) requests as a ledger (JSONL).")] = None,
    turns_to: Annotated[Path | None, typer.Option("--turns", callback=output_path, help="Write every arm's turn starts (JSONL: arm, cost, share, session, start, behind, fresh, engine), to set beside a live run's, turn by turn.")] = None,
    plot: PlotOpt = None,
    csv: CsvOpt = None,
    json_out: JsonOpt = False,
    **shared,
) -> None:
    """Replay request timelines through the read scheduler (`shadow/core/schedule.py`) on a fleet of
    engines, with the live service's limits (the resident cap and its store, when ids reach the
    shadow, turns ended as the service ends them, the voice, asks) and the device's costs (a chunk
    by its depth, restores, spills), and report what an operator would see: freshness at turn
    starts, the wait an ask would have then and at random times, each turn's time until its prompt
    was read, each session's worst lag, and the load over time beside it. Arms: idle only and
    idle + share for each cost, share and priority set. The command checks that more share and
    faster reads are never less fresh, and exits 1 if they are."""
    from shadow.offline.costs import BatchTable, ChunkTable, CostTable
    from shadow.offline.ledger import ROUTES, read_asks, write_ledger
    from shadow.offline.limits import for_model
    from shadow.offline.plan import run_plan

    if fmt not in FORMATS:
        raise ShadowInputError(f"unknown format {fmt!r} ({', '.join(FORMATS)})")
    if token_counts not in ("qwen", "usage"):
        raise ShadowInputError("--token-counts is 'qwen' or 'usage'")
    if route not in ROUTES:
        raise ShadowInputError(f"--route is one of {', '.join(ROUTES)} (got {route!r})")
    if asks_at is not None and (asks_per_hour or pack_to is not None):
        raise ShadowInputError("--asks-at gives the asks' own times: not with --asks-per-hour or --pack")
    given_asks = user_text_file(asks_at, read_asks) if asks_at is not None else ()
    shares, priorities = shared.pop("share"), shared.pop("priorities")
    settings = settings_from(shared)  # serve's: the grid, the rule (its share each arm's own), the cap, the voice
    prio_sets = [settings_from({"priorities": p}).priorities for p in priorities]
    grid, rule = settings.model.grid, settings.schedule
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
    charge = _charge_from(charge_json, grid) if charge_json is not None else None
    ask_samples = _samples_from(ask_samples_json, *FORWARDS) if ask_samples_json is not None else ()
    host_rates = _samples_from(host_rates_json, *HOST_RATES) if host_rates_json is not None else ()
    costs = [CostTable(table, restore_gib_s=restore_gib_s, spill_gib_s=spill_gib_s, host_gib_s=host_gib_s,
                       ask_s=ask_ms / 1000, ask_chunk_scale=ask_chunk_scale,
                       phrase_s=phrase_ms / 1000, tokenize_s_per_1k=tokenize_ms_per_1k / 1000, batch=batches,
                       charge=charge, ask_samples=ask_samples, host_rates=host_rates)
             for table, batches in pairs]
    cap_gib = settings.store.cap_for("cuda", proxy=True) or None  # serve's default beside an engine; 0: no cap
    limits = for_model(model, ids=ids, cap_gib=cap_gib, disk=disk,
                       host_cap_gib=settings.store.host_cap_gib if cap_gib else None,
                       restore_ahead=settings.store.restore_ahead,
                       prefix_cache_gib=settings.prefix.gib if settings.prefix.on else None,
                       shared_prefix_tokens=shared_prefix_tokens, predict=settings.engine.predict,
                       read_ahead=settings.engine.read_ahead,
                       hold_max=2 * grid if settings.voice.share > 0 else None,
                       voice_share=settings.voice.share, label_s=label_ms / 1000, asks_per_hour=asks_per_hour,
                       asks_at=given_asks, seed=seed)
    plan = Plan(costs, shares, prio_sets, rule, limits, grid=grid, engines=engines, route=route, pack_to=pack_to,
                check_fleet=check_fleet, solve=solve_share, samples=samples, window_s=window_s,
                service=ServiceModel(prefill_tok_s, decode_tok_s, slots))

    files = _expand(inputs)
    read = {p.resolve() for p in [*files, *(read_rate_json or []), *([asks_at] if asks_at else []),
                                  *([charge_json] if charge_json else []), *([ask_samples_json] if ask_samples_json else []),
                                  *([host_rates_json] if host_rates_json else [])]}
    for flag, out in (("--turns", turns_to), ("--write-ledger", write_ledger_to), ("--csv", csv), ("--plot", plot)):
        if out is not None and out.resolve() in read:
            raise ShadowInputError(f"{flag} {out} is a file this command reads: give another name")
    kinds = {f: _detect(f) if fmt == "auto" else fmt for f in files}  # every file's format before any import
    with progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()) as bar:
        requests, arrivals = _import(files, kinds, token_counts, plan.service, bar, settings.engine.chat_template)
        unknown = sorted({s for _, s, _ in given_asks} - {r.session for r in requests})
        if unknown:
            raise ShadowInputError(f"{asks_at}: {len(unknown)} asked sessions are not in the trace, "
                                   f"e.g. {unknown[0]!r}")
        tasks: dict[str, int] = {}

        def step(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage if stage != "solving" else f"solving for {solve_share.text}", total=total)
            bar.update(tasks[stage], completed=done)

        outcome = run_plan(plan, requests, arrivals, progress=step)
    if write_ledger_to:
        write_ledger(write_ledger_to, outcome.requests)
        wrote(write_ledger_to)
    if turns_to:
        _write_turns(turns_to, outcome.arms)
        wrote(turns_to)
    _show(plan, outcome, pack_to)
    rows = [_row(a, s) for a, s in zip(outcome.arms, outcome.summaries)]
    if csv:
        write_csv(csv, [{k: v for k, v in r.items() if k != "summary"} for r in rows])
    if plot:
        _plot(plot, outcome.arms)
    if any(kind != "ledger" for kind in kinds.values()):
        console.print(f"service model (where the trace has no first-token or end times): prefill {prefill_tok_s:g} tok/s, "
                      f"decode {decode_tok_s:g} tok/s per request, {slots} slots an engine (Mooncake); trajectories: "
                      f"one slot, ends clamped to the next request; token counts: {token_counts}")
    if json_out:
        emit_json(_document(plan, outcome, rows, files=files, model=model, token_counts=token_counts))
    if not outcome.checks["ok"]:
        raise typer.Exit(1)


def _import(files: list[Path], kinds: dict[Path, str], token_counts: str, service, bar,
            chat_template: Path | None = None) -> tuple[list, list]:
    """(requests, Mooncake arrivals) of every file, by its format; trajectories rendered with
    `chat_template` where one is given."""
    from shadow.offline.ledger import import_trajectory, mooncake_arrivals, read_ledger

    requests, arrivals, tokenizer, renderer = [], [], None, None
    if chat_template is not None and any(k == "trajectory" for k in kinds.values()):
        from shadow.text.chat_template import renderer_for

        renderer = renderer_for(chat_template, None, None)
    task = bar.add_task("importing", total=len(files))
    for f in files:
        kind = kinds[f]
        if kind == "mooncake":
            arrivals += user_text_file(f, mooncake_arrivals)
        elif kind == "trajectory":
            if tokenizer is None and token_counts == "qwen":
                from shadow.text.tokenizer import load_tokenizer

                tokenizer = load_tokenizer(None)
            requests += user_text_file(f, lambda p: import_trajectory(p, service, tokenizer, renderer))
        else:
            requests += user_text_file(f, read_ledger)
        bar.advance(task)
    return requests, arrivals


def _show(plan: Plan, outcome, pack_to: float | None) -> None:
    """The outcome's tables and lines, each solved share, each fleet check, the checks and the limits."""
    from shadow.offline.metrics import load

    dens = outcome.density
    _tables(plan, outcome)
    console.print(_load_table(load(outcome.windows), plan.window_s))
    console.print(f"mean over the whole span, per engine: {dens.active:.1f} sessions active at once, "
                  f"{dens.new_tok_s:,.0f} new tokens per second, over {dens.span_s:,.0f} s"
                  + (f" (packed to {pack_to:g} active)" if pack_to else ""))
    for solved in outcome.solved:
        _print_solved(solved, len(plan.priorities) > 1)
    for arm, report in outcome.fleet:
        _print_fleet({**report, "arm": _label(arm, plan)})
    for line in outcome.checks["failures"]:
        console.print(f"[bold red]check failed:[/] {line}")
    console.print("checks: more share never less fresh, faster reads never less fresh: "
                  + ("[green]hold[/]" if outcome.checks["ok"] else "[bold red]FAIL[/]"))
    console.print(_limits_line(plan))


def _document(plan: Plan, outcome, rows: list[dict], *, files: list[Path], model: str, token_counts: str) -> dict:
    """The --json document."""
    from shadow.offline.metrics import load

    rule, limits, dens, first = plan.rule, plan.limits, outcome.density, plan.costs[0]
    batched = rule.batch > 1
    return {
        "command": "replay-ledger", "inputs": [str(f) for f in files], "turns": len(outcome.arms[0].turns),
        "sessions": len({r.session for r in outcome.requests}), "requests": len(outcome.requests), "grid": plan.grid,
        "read_ms_per_1k": [flat_ms_per_1k(c, plan.grid) for c in plan.costs if c.chunk.depths == (0,)],
        "costs": [{"label": c.chunk.label, "depths": list(c.chunk.depths),
                   "ms_per_chunk": [round(x * 1000, 6) for x in c.chunk.seconds], "batch_costs": c.batch.label}
                  for c in plan.costs],
        "shares": list(plan.shares), "batch": rule.batch, "batch_ms": _ms(rule.batch_s) if batched else None,
        "batch_read_ms": _ms(rule.batch_read_s or rule.batch_s) if batched else None,
        "batch_wait_ms": _ms(rule.batch_wait_s) if batched else None,
        "batch_busy": rule.batch_busy if batched and rule.batch_wait_s else None,
        "batch_costs": _batch_label(plan) if batched else None,
        "engines": plan.engines, "route": plan.route, "pack": plan.pack_to,
        "priorities": [p.label for p in plan.priorities],
        "limits": {"ids": limits.ids, "cap_gib": limits.cap_gib, "disk": limits.disk, "model": model,
                   "voice_share": limits.voice_share, "label_ms": _ms(limits.label_s),
                   "asks_per_hour": limits.asks_per_hour, "asks_at": len(limits.asks_at), "restore_gib_s": first.restore_gib_s,
                   "spill_gib_s": first.spill_gib_s, "host_gib_s": first.host_gib_s,
                   "host_cap_gib": limits.host_cap_gib, "restore_ahead": limits.restore_ahead,
                   "prefix_cache_gib": limits.prefix_cache_gib, "shared_prefix_tokens": limits.shared_prefix_tokens,
                   "ask_ms": _ms(first.ask_s), "ask_chunk_scale": first.ask_chunk_scale, "phrase_ms": _ms(first.phrase_s),
                   "charge": first.charge.label if first.charge is not None else None,
                   "ask_forwards": {"n": len(first.ask_samples), **spread(first.ask_samples, scale=1000)}
                   if first.ask_samples else None,
                   "host_rates": {"n": len(first.host_rates), **spread(first.host_rates, qs=(1, 10, 50))} if first.host_rates else None,
                   "tokenize_ms_per_1k": _ms(first.tokenize_s_per_1k), "samples": plan.samples, "seed": limits.seed},
        "density": {"active_per_engine": round(dens.active, 3), "new_tok_s_per_engine": round(dens.new_tok_s, 1),
                    "span_s": round(dens.span_s, 3)},
        "load": load(outcome.windows),
        "windows": [{"engine": w.engine, "start": round(w.start, 3), "active": round(w.active, 3),
                     "new_tok_s": round(w.new_tok_s, 1),
                     "state_gib": None if w.state_gib is None else round(w.state_gib, 3)} for w in outcome.windows],
        "service": {"prefill_tok_s": plan.service.prefill_tok_s, "decode_tok_s": plan.service.decode_tok_s,
                    "slots": plan.service.slots, "token_counts": token_counts},
        "arms": rows, "solve": [s.row(plan.grid) for s in outcome.solved],
        "fleet": [{**report, "arm": _label(arm, plan)} for arm, report in outcome.fleet], "checks": outcome.checks,
    }


def _ms(seconds: float) -> float:
    """Seconds as ms, as given (10.0, not 10.000000000000002)."""
    return round(seconds * 1000, 9)


def _batch_label(plan: Plan) -> str:
    return ", ".join(dict.fromkeys(c.batch.label for c in plan.costs))


def _label(arm, plan: Plan) -> str:
    """An arm's short name in the tables: its share, with its cost and priorities where the plan has several."""
    short = "idle" if not arm.share else arm.name.removeprefix("idle + ").removesuffix(" share")
    return " · ".join([short] + ([arm.cost] if len(plan.costs) > 1 else [])
                      + ([arm.priorities] if len(plan.priorities) > 1 else []))


def _fmt(v, digits: int = 1, never: bool = False) -> str:
    if v is None:
        return "never" if never else "-"
    return f"{v:,.0f}" if digits == 0 else f"{v:,.{digits}f}"


def _tables(plan: Plan, outcome) -> None:
    """The arms' figures in tables of at most 80 columns."""
    requests, engines = outcome.requests, plan.engines
    sessions = len({r.session for r in requests})
    console.print(f"replay-ledger · {len(requests):,} requests · {sessions:,} sessions · grid {plan.grid} · {engines} "
                  f"engine{'s' if engines > 1 else ''}{f' ({plan.route})' if engines > 1 else ''}")
    specs = [
        ("turn starts of sessions with earlier turns", ["fresh %", "p50\nbehind", "p90\nbehind", "ask wait\np50 ms",
                                                        "ask wait\np99 ms", "ready for\nthe prompt %", "p90 to\nthe prompt"],
         lambda s: [_fmt(s["turn_starts"]["fresh_pct"]), _fmt(s["turn_starts"]["behind"]["p50"], 0),
                    _fmt(s["turn_starts"]["behind"]["p90"], 0), _fmt(s["turn_starts"]["ask_wait_ms"]["p50"]),
                    _fmt(s["turn_starts"]["ask_wait_ms"]["p99"]), _fmt(s["turn_starts"]["ready_pct"]),
                    _fmt(s["turn_starts"]["to_prompt"]["p90"], 0)]),
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
        ("the shadow's device work", ["spills", "restores", "drops", "rollbacks", "predicted\n(missed)", "voice s"],
         lambda s: [f"{s['store']['spills']:,}", f"{s['store']['restores']:,}", f"{s['store']['drops']:,}",
                    f"{s['rollbacks']:,}", f"{s['predictions']:,} ({s['predictions_missed']:,})", _fmt(s["voice_s"])]),
    ]
    for name, cols, cells in specs:
        table = Table(title=name, title_justify="left")
        table.add_column("arm")
        for col in cols:
            table.add_column(col, justify="right")
        for a, s in zip(outcome.arms, outcome.summaries):
            table.add_row(_label(a, plan), *cells(s | {"rollbacks": a.rollbacks, "predictions": a.predictions,
                                                         "predictions_missed": a.predictions_missed}))
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


def _write_turns(path: Path, arms) -> None:
    """Every arm's turn starts, one JSON line each, in the arm's order (by start, then session)."""
    with open(path, "w") as f:
        for a in arms:
            for t in a.turns:
                f.write(json.dumps({"arm": a.name, "cost": a.cost, "share": a.share, "priorities": a.priorities,
                                    "session": t.session, "start": round(t.start, 6), "behind": t.behind,
                                    "fresh": t.fresh, "engine": t.engine}) + "\n")


def _row(a, s: dict) -> dict:
    return {"arm": a.name, "priorities": a.priorities, "engines": a.engines, "route": a.route,
            "read_ms_per_1k": a.read_ms_per_1k, "cost": a.cost, "share": a.share, "turns": len(a.turns),
            "fresh": a.fresh, "fresh_pct": round(a.fresh_pct, 2), "p50_behind": a.behind_pct(50),
            "p90_behind": a.behind_pct(90), "chunks_idle": a.chunks_idle, "chunks_share": a.chunks_share,
            "chunks_ask": a.chunks_ask, "chunks_wasted": a.chunks_wasted, "rollbacks": a.rollbacks,
            "predictions": a.predictions, "predictions_missed": a.predictions_missed,
            "share_s": round(a.share_s, 3), "share_charged_s": round(a.share_charged_s, 3), "longest_slice_ms": round(a.longest_slice_s * 1000, 3), "summary": s}


def _print_solved(solved, multi_prio: bool) -> None:
    """One line for a solved share (`plan.SolvedShare`)."""
    r = solved.solved
    where = solved.costs.chunk.label + (f", priorities {solved.priorities.label}" if multi_prio else "")
    unit = r.target.text.rsplit(" ", 1)[-1]
    if r.share is None:
        console.print(f"share for {r.target.text} ({where}): not met at {r.below:.0%} ({_fmt(r.below_value, 2)} {unit})")
    else:
        below = "" if r.below is None else f"; {r.below:.2%} gives {_fmt(r.below_value, 2)} {unit}"
        console.print(f"share for {r.target.text} ({where}): {r.share:.2%} ({_fmt(r.value, 2)} {unit}{below})"
                      + ("" if r.monotone else " [bold red](not monotone in share among the tries)[/]"))


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


def _limits_line(plan: Plan) -> str:
    """The live limits and device costs the arms ran with, in one line."""
    limits, rule, first = plan.limits, plan.rule, plan.costs[0]
    host = f"a host tier of {limits.host_cap_gib:g} GiB, then " if limits.host_cap_gib else ""
    ahead = ", restores started at arrival" if limits.restore_ahead and (limits.disk or limits.host_cap_gib) else ""
    cap = f"cap {limits.cap_gib:g} GiB a shadow ({host}{'spill to disk' if limits.disk else 'no disk: dropped past it'}{ahead})" \
        if limits.cap_gib else "no cap"
    words = _batch_words(_ms(rule.batch_s), None if rule.batch_read_s is None else _ms(rule.batch_read_s),
                         _ms(rule.batch_wait_s), rule.batch_busy)
    batches = f"batches of up to {rule.batch}, {words} ({_batch_label(plan)})" if rule.batch > 1 else "no batches"
    prefix = f"; prefix cache {limits.prefix_cache_gib:g} GiB ({limits.shared_prefix_tokens:,} ids of every first prompt " \
        "shared)" if limits.prefix_cache_gib else "; no prefix cache"
    asks = f"{len(limits.asks_at):,} as given" if limits.asks_at else f"{limits.asks_per_hour:g}/h a session"
    forwards, rates = spread(first.ask_samples, scale=1000), spread(first.host_rates, qs=(1, 50))
    return (f"live limits: ids {limits.ids}; {cap}{prefix}; voice share {limits.voice_share:g}; label {_ms(limits.label_s):g} ms; "
            f"asks {asks}; {batches}. costs: chunk {', '.join(c.chunk.label for c in plan.costs)}; "
            f"restore {first.restore_gib_s:g} GiB/s, spill {first.spill_gib_s:g} GiB/s, "
            + (f"host moves {first.host_gib_s:g} GiB/s, " if not first.host_rates else
               f"a move back from host memory drawn from {len(first.host_rates):,} measured (p50 {rates['p50']:g}, "
               f"p1 {rates['p1']:g} GiB/s), ")
            + (f"ask {_ms(first.ask_s):g} ms " if not first.ask_samples else "ask ")
            + f"(its chunks x{first.ask_chunk_scale:g}), "
            + (f"a share read charged at most {first.charge.label}'s costs, " if first.charge is not None else "")
            + (f"an ask's forward drawn from {len(first.ask_samples):,} measured (p50 {forwards['p50']:g}, "
               f"p99 {forwards['p99']:g} ms), " if first.ask_samples else "")
            + f"phrase {_ms(first.phrase_s):g} ms, tokenizer {_ms(first.tokenize_s_per_1k):g} ms/1k "
            "(defaults: measured, docs/FRESHNESS.md)")


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
    from shadow.offline.costs import BatchTable, ChunkTable

    return _read_rate_file(path, lambda doc: (ChunkTable.from_read_rate(doc, grid, label),
                                              BatchTable.from_read_rate(doc, grid, label)))


def _read_rate_file(path: Path, use):
    """`use` of a `read-rate --json` output's document; anything it cannot read or use refused as
    bad input naming the file."""
    from shadow.offline.costs import read_rate_document

    try:
        with collection_paused():
            return use(read_rate_document(path.read_text()))
    except (OSError, IndexError, KeyError, ValueError, TypeError, OverflowError, RecursionError, UnicodeDecodeError) as e:
        raise ShadowInputError(f"{path}: not a read-rate --json output ({type(e).__name__}: {e})") from None


def _charge_from(path: Path, grid: int):
    """The costs a share read is charged at most, from a `read-rate --json`-shaped file."""
    from shadow.offline.costs import known_costs

    known = _read_rate_file(path, lambda doc: known_costs(doc, grid, path.name))
    if len(known.chunks) < 2:  # past the deepest depth the charge follows the line through the two deepest
        raise ShadowInputError(f"{path}: --charge-json needs chunk costs at two depths at least")
    return known


# what a samples file holds: (its values' name, their unit, the most one may be, its words, a scale to the replay's unit)
FORWARDS = ("an ask's forwards", "ms", 3_600_000, "an hour", 1 / 1000)
HOST_RATES = ("moves back from host memory", "GiB/s", 100_000, "100,000 GiB/s", 1.0)


def _samples_from(path: Path, what: str, unit: str, most: float, most_words: str, scale: float) -> tuple[float, ...]:
    """Measured samples the replay draws from, from a JSON list of numbers in `unit`, each above 0
    and at most `most`; scaled to the replay's unit (seconds, GiB/s)."""
    def read(p: Path):
        try:
            return json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ShadowInputError(f"{p}: not a JSON list of {unit} ({e})") from None

    values = user_text_file(path, read)
    if not isinstance(values, list) or not values or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= most for v in values):
        raise ShadowInputError(f"{path}: {what} are a non-empty JSON list of {unit}, each a number above 0 "
                               f"and at most {most:,} ({most_words})")
    return tuple(v * scale for v in values)


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
