"""`shadow replay-ledger`: how fresh the shadow is at turn starts, on real request timelines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from cli.common import CsvOpt, GridOpt, JsonOpt, console, emit_json, errors, user_errors, write_csv
from shadow.errors import ShadowInputError

FORMATS = ("auto", "mooncake", "trajectory", "ledger")


@user_errors
def replay_ledger(
    inputs: Annotated[list[Path], typer.Argument(help="Trace files: a Mooncake trace (.jsonl), mini-swe-agent trajectories (.traj.json, or a folder of them), or the project's ledger (.jsonl).")],
    fmt: Annotated[str, typer.Option("--format", help="auto, mooncake, trajectory or ledger.")] = "auto",
    read_ms_per_1k: Annotated[list[float] | None, typer.Option("--read-ms-per-1k", help="Read rate(s) in ms per 1,000 tokens (repeatable: a sweep). Default 87, the source's.")] = None,
    read_rate_json: Annotated[Path | None, typer.Option(help="Also use the rate measured by `shadow read-rate --json` (its last line's ms_per_1k_tokens).")] = None,
    share: Annotated[list[float] | None, typer.Option("--share", help="In-turn share(s) of the time since the first token (repeatable). Default 0.02.")] = None,
    grid: GridOpt = 512,
    prefill_tok_s: Annotated[float, typer.Option(help="Service model, for traces without first-token and end times: prefill tokens per second.")] = 20_000.0,
    decode_tok_s: Annotated[float, typer.Option(help="Service model: decode tokens per second per request.")] = 40.0,
    slots: Annotated[int, typer.Option(help="Service model (Mooncake): requests served at once, first come first served.")] = 32,
    token_counts: Annotated[str, typer.Option(help="Trajectories: 'qwen' (re-render and re-tokenise with the Qwen3.5 vocabulary) or 'usage' (the provider's counts).")] = "qwen",
    write_ledger_to: Annotated[Path | None, typer.Option("--write-ledger", help="Write the imported requests as a ledger (JSONL).")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG: the CDF of tokens behind at turn starts, one line per arm.")] = None,
    csv: CsvOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Replay request timelines through the bandwidth rule (idle window, and the in-turn share)
    with a given read rate, and report, at every turn start of a session with earlier turns, how
    many of its tokens the shadow had not read: fresh = less than one grid chunk behind. Arms:
    idle only and idle + share for each read rate, and each share of a sweep."""
    from shadow.ledger import ServiceModel, import_mooncake, import_trajectory, read_ledger, rebase, write_ledger
    from shadow.reader import check_grid
    from shadow.replay import replay
    from shadow.schedule import BandwidthRule

    check_grid(grid)
    if fmt not in FORMATS:
        raise ShadowInputError(f"unknown format {fmt!r} ({', '.join(FORMATS)})")
    if token_counts not in ("qwen", "usage"):
        raise ShadowInputError("--token-counts is 'qwen' or 'usage'")
    if min(prefill_tok_s, decode_tok_s) <= 0 or slots < 1:
        raise ShadowInputError("the service model needs positive rates and at least one slot")
    rates = list(read_ms_per_1k or [])
    if read_rate_json:
        rates.append(_rate_from(read_rate_json))
    rates = rates or [87.0]
    shares = share or [0.02]
    if min(rates) <= 0 or min(shares) <= 0 or max(shares) >= 1:
        raise ShadowInputError("read rates must be positive and shares between 0 and 1")
    service = ServiceModel(prefill_tok_s, decode_tok_s, slots)

    files = _expand(inputs)
    requests = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=errors, transient=True) as bar:
        task = bar.add_task("importing", total=len(files))
        tokenizer = None
        for f in files:
            kind = _detect(f) if fmt == "auto" else fmt
            if kind == "mooncake":
                requests += import_mooncake(f, service, block=grid)
            elif kind == "trajectory":
                if tokenizer is None and token_counts == "qwen":
                    from shadow.tokenizer import load_tokenizer

                    tokenizer = load_tokenizer(None)
                requests += import_trajectory(f, service, tokenizer)
            else:
                requests += read_ledger(f)
            bar.advance(task)
        requests = rebase(requests)
        if write_ledger_to:
            write_ledger(write_ledger_to, requests)
        arms = []
        plan = [(rate, None) for rate in rates] + [(rate, s) for rate in rates for s in shares]
        task = bar.add_task("replaying", total=len(plan))
        for rate, s in plan:
            rule = BandwidthRule(share=s or 0.02)
            name = "idle only" if s is None else f"idle + {s:.0%} share"
            arms.append(replay(requests, rate, grid, rule, use_share=s is not None, name=name))
            bar.advance(task)

    sessions = len({r.session for r in requests})
    table = Table(title=f"replay-ledger · {len(requests):,} requests · {sessions:,} sessions · grid {grid}")
    for col in ("arm", "read ms/1k", "turn starts", "fresh %", "p50 behind", "p90 behind", "rollbacks"):
        table.add_column(col, justify="left" if col == "arm" else "right")
    rows = []
    for a in arms:
        row = {"arm": a.name, "read_ms_per_1k": a.read_ms_per_1k, "share": a.share, "turns": len(a.turns),
               "fresh_pct": round(a.fresh_pct, 2), "p50_behind": a.behind_pct(50), "p90_behind": a.behind_pct(90),
               "chunks_idle": a.chunks_idle, "chunks_share": a.chunks_share, "rollbacks": a.rollbacks}
        rows.append(row)
        table.add_row(a.name, f"{a.read_ms_per_1k:g}", f"{len(a.turns):,}", f"{a.fresh_pct:.1f}",
                      f"{row['p50_behind']:,}", f"{row['p90_behind']:,}", f"{a.rollbacks:,}")
    console.print(table)
    if any(_detect(f) != "ledger" for f in files):
        console.print(f"service model (where the trace has no first-token or end times): prefill {prefill_tok_s:g} tok/s, "
                      f"decode {decode_tok_s:g} tok/s per request, {slots} slots (Mooncake); trajectories: one slot, "
                      f"ends clamped to the next request; token counts: {token_counts}")
    if csv:
        write_csv(csv, rows)
    if plot:
        _plot(plot, arms)
    if json_out:
        emit_json({
            "command": "replay-ledger", "inputs": [str(f) for f in files], "turns": len(arms[0].turns),
            "sessions": sessions, "requests": len(requests), "grid": grid, "read_ms_per_1k": rates,
            "shares": shares, "service": {"prefill_tok_s": prefill_tok_s, "decode_tok_s": decode_tok_s,
                                          "slots": slots, "token_counts": token_counts},
            "arms": rows,
        })


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
    except json.JSONDecodeError:
        raise ShadowInputError(f"{path}:1: not JSON; cannot tell the format (give --format)") from None
    if isinstance(row, dict) and "hash_ids" in row:
        return "mooncake"
    if isinstance(row, dict) and "session" in row:
        return "ledger"
    raise ShadowInputError(f"{path}: unknown format (a Mooncake trace, a trajectory or a ledger; give --format)")


def _rate_from(path: Path) -> float:
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        return float(json.loads(lines[-1])["ms_per_1k_tokens"])
    except (OSError, IndexError, KeyError, ValueError, TypeError) as e:
        raise ShadowInputError(f"{path}: not a read-rate --json output ({type(e).__name__})") from None


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
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
