"""`shadow verify-exact`: replay conversations turn by turn and check the state bit for bit."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from shadow.cli.common import (
    CsvOpt, DeviceOpt, DtypeOpt, GridOpt, JsonOpt, KernelsOpt, ModelOpt, bounds, check_kernels, console, emit_json,
    folder_to_write, grid_size, input_file, parse_dtype, progress, seed_bounds, show, user_errors, user_text_file,
    write_csv,
)
from shadow.model import runtime


@user_errors
def verify_exact(
    *,
    conversation: Annotated[list[Path] | None, typer.Option("--conversation", "-c", callback=input_file, help="A conversation file (mini-swe-agent .traj.json, SWE-agent .traj, or the project's .jsonl); repeatable. Default: the built-in seeded sample session.")] = None,
    model: ModelOpt = "tiny",
    grid: GridOpt = 512,
    against_grid: Annotated[int, typer.Option(callback=grid_size, help="Also compare with a fresh prefill in chunks of this size (0: skip).")] = 2048,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
    kernels: KernelsOpt = "auto",
    cap_gib: Annotated[float | None, typer.Option(callback=bounds(ge=0), help="Resident cap in GiB; past it the least recently used sessions are spilled to --disk (or dropped and read again). Default: no cap.")] = None,
    disk: Annotated[Path | None, typer.Option(callback=folder_to_write, help="Folder for spilled sessions (one safetensors file each).")] = None,
    disk_cap_gib: Annotated[float, typer.Option(callback=bounds(gt=0), help="Disk cap in GiB; the oldest files past it are removed.")] = 64.0,
    batch: Annotated[int, typer.Option(callback=bounds(ge=1, le=8), help="Read up to this many conversations' chunks in one forward (each a session at its own depth, as `shadow serve --batch`); every state is then still compared with its own fresh prefill. Not with --cap-gib. 1: one session a forward.")] = 1,
    chat_template: Annotated[Path | None, typer.Option(callback=input_file, help="Render turns as the proxy does: the big model's chat template (a .jinja, or a tokenizer_config.json / chat_template.json holding one), tokenized by --tokenizer. Default: the project's Qwen3.5-style template in code.")] = None,
    tokenizer: Annotated[Path | None, typer.Option(help="With --chat-template: a folder with the big model's tokenizer.json. Default: the model's own, else the real Qwen3.5 vocabulary.")] = None,
    predict: Annotated[bool, typer.Option(help="With --chat-template: hold each output out of reading and, at the turn's end, read the next prompt's start as the template will render it (as `shadow serve --predict` does); the next prompt confirms it or sends the session back. Without --chat-template: no effect.")] = True,
    read_ahead: Annotated[bool, typer.Option(help="With --predict: at each turn's end take the next prompt's start as predicted and read it (as `shadow serve --read-ahead`), rather than read only what it keeps of the ids served.")] = False,
    hold_max: Annotated[int | None, typer.Option(callback=bounds(ge=1), help="With --predict: an output that leaves more than this many ids unread is read as it comes and its prediction sends those rows back, as serve does when a phrase or an ask must read a held output from a fork (a phrase may read 2 grids). Default: never (a replay has no phrase or ask mid-turn).")] = None,
    seed: Annotated[int, typer.Option(callback=seed_bounds, help="Seed of the random preset weights and of the sample session (0 to 2**63 - 1).")] = 0,
    csv: CsvOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Replay each conversation as its requests came (prompts re-rendered, so an earlier turn's
    reasoning drops and the reader rolls back), several conversations' turns interleaved round
    robin, through a session store (with --cap-gib and --disk, sessions spill to disk and come
    back between turns). Then compare each state with a fresh prefill of the same ids on the same
    grid (every tensor, bit for bit) and on another grid (largest differences, question probes).
    With --batch B, a round's turns are read B sessions a forward. Exit code 1 when a state is
    not bit-equal."""
    from shadow.text.conversations import load_conversation
    from shadow.core.reader import open_reader
    from shadow.text.sample import sample_conversation
    from shadow.core.store import SessionStore
    from shadow.text.tokenizer import load_tokenizer
    from shadow.offline.verify import KINDS, verify

    check_kernels(kernels, device)
    if tokenizer is not None and chat_template is None:
        raise typer.BadParameter("the big model's tokenizer renders turns only with --chat-template", param_hint="--tokenizer")
    if batch > 1 and cap_gib is not None:
        raise typer.BadParameter("batched reads keep a round's sessions resident together; give --batch without --cap-gib",
                                 param_hint="--batch")
    conversations = ([user_text_file(p, load_conversation) for p in conversation] if conversation
                     else [sample_conversation(seed)])
    started = time.perf_counter()
    loaded, reader = open_reader(
        model, grid=grid, device=device, dtype=parse_dtype(dtype), kernels=kernels, seed=seed
    )
    words = load_tokenizer(loaded.path)
    rendering = None
    if chat_template is not None:
        from shadow.text.chat_template import renderer_for
        from shadow.offline.verify import TemplateRendering

        rendering = TemplateRendering(renderer_for(chat_template, tokenizer, loaded.path))
    predicting = predict and rendering is not None
    held = hold_max
    store = SessionStore(reader, loaded.weights_hash, cap_gib=cap_gib, disk=disk,
                         disk_cap_gib=disk_cap_gib, model=model)
    with progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        task = bar.add_task("replay", total=None)

        def step(done: int, total: int, stage: str) -> None:
            bar.update(task, completed=done, total=total, description=stage)

        verdicts = verify(reader, words, conversations, against_grid or None, store, step, batch=batch,
                          rendering=rendering, predict=predicting, hold_max=held, read_ahead=read_ahead)
    store.close()
    counters = store.counters
    seconds = time.perf_counter() - started

    rows = [_row(v) for v in verdicts]
    table = Table(title=f"verify-exact · {model} ({loaded.weights_label} weights) · grid {grid}"
                  + (f" · batches of {batch}" if batch > 1 else "") + f" · {device}")
    for key in rows[0]:
        table.add_column(key.replace("_", " "), justify="left" if key == "conversation" else "right",
                         overflow="fold")
    for row in rows:
        table.add_row(*(_cell(x) for x in row.values()))
    show(table)
    if loaded.random:
        console.print("[yellow]weights are random:[/] exactness holds whatever the weights; probe answers mean nothing.")
    if csv:
        write_csv(csv, rows)
    equal = all(v.same_grid_bit_equal for v in verdicts)
    console.print(f"same grid bit-equal: [bold]{'yes' if equal else 'NO'}[/] in {seconds:.1f} s")
    if cap_gib is not None:
        _print_store(store)
        rate = counters.restore_gib_per_s
        console.print(
            f"store: cap {cap_gib:g} GiB, {counters.spills} spills, {counters.restores} restores"
            + (f" at {rate:.2f} GiB/s" if rate else "") + f", {counters.drops} drops, "
            f"{counters.bytes_written / 2**20:.1f} MiB written, {len(counters.rejected)} files refused"
        )
    if json_out:
        others = [v.other_grid for v in verdicts if v.other_grid]
        emit_json({
            "command": "verify-exact", "model": model, "weights": loaded.weights_label,
            "weights_hash": loaded.weights_hash, "device": device, "kernels": loaded.model.kernels.name, "autotune_pins": runtime.pinned(), "dtype": str(loaded.model.dtype).removeprefix("torch."),
            "grid": grid, "batch": batch, "turns": sum(v.turns for v in verdicts), "tokens": sum(v.tokens for v in verdicts),
            "rollbacks": sum(v.rollbacks for v in verdicts), "ids_reread": sum(v.ids_reread for v in verdicts),
            "rendering": f"template {rendering.renderer.origin}" if rendering else "code", "predict": predicting, "read_ahead": predicting and read_ahead, "hold_max": held if predicting else None,
            "predictions": sum(v.predictions for v in verdicts),
            "predictions_missed": sum(v.predictions_missed for v in verdicts),
            "same_grid_bit_equal": equal, "tensors_compared": sum(v.tensors_compared for v in verdicts),
            "other_grid": {
                "grid": against_grid,
                "max_abs_diff": {k: max(o.max_abs_diff[k] for o in others) for k in KINDS},
                "probe_top1_agree": sum(o.probe_top1_agree for o in others),
                "probes": sum(o.probes for o in others),
                "probe_max_kl": max(o.probe_max_kl for o in others),
            } if others else None,
            "cap_gib": cap_gib, "disk": str(disk) if disk else None,
            "spills": counters.spills, "restores": counters.restores, "drops": counters.drops,
            "bytes_written": counters.bytes_written, "bytes_restored": counters.bytes_restored,
            "restore_gib_per_s": counters.restore_gib_per_s, "files_refused": counters.rejected,
            "store": store.totals(), "sessions": [dataclasses.asdict(r) for r in store.status()],
            "conversations": [dataclasses.asdict(v) for v in verdicts],
            "seconds": round(seconds, 3),
        })
    if not equal:
        raise typer.Exit(1)


def _print_store(store) -> None:
    table = Table(title="session store at the end (after the planned stop wrote every resident session)")
    for col in ("session", "committed", "backlog", "MiB", "checkpoints", "where"):
        table.add_column(col, justify="left" if col in ("session", "where") else "right")
    for r in store.status():
        table.add_row(r.name, f"{r.committed:,}", f"{r.pending:,}", f"{r.bytes / 2**20:.1f}", str(r.checkpoints),
                      "resident" if r.resident else "disk")
    show(table)
    t = store.totals()
    cap = "no cap" if t["cap_bytes"] is None else f"cap {t['cap_bytes'] / 2**20:.1f} MiB"
    console.print(f"resident {t['resident_bytes'] / 2**20:.1f} MiB ({cap}), {t['resident_sessions']} sessions; "
                  f"disk {t['disk_bytes'] / 2**20:.1f} MiB in {t['files']} files")


def _row(v) -> dict:
    o = v.other_grid
    return {
        "conversation": v.name, "turns": v.turns, "tokens": v.tokens, "rollbacks": v.rollbacks,
        "reread": v.ids_reread, "predicted": f"{v.predictions - v.predictions_missed}/{v.predictions}",
        "batched": v.chunks_batched, "bit_equal": v.same_grid_bit_equal,
        "other_grid": o.grid if o else None,
        "max_diff_k": o.max_abs_diff["k"] if o else None,
        "max_diff_rec": o.max_abs_diff["recurrent"] if o else None,
        "top1": f"{o.probe_top1_agree}/{o.probes}" if o else None,
        "max_kl": o.probe_max_kl if o else None,
    }


def _cell(x) -> str:
    if isinstance(x, bool):
        return "[green]yes[/]" if x else "[red]NO[/]"
    if isinstance(x, float):
        return f"{x:.3g}"
    if isinstance(x, int):
        return f"{x:,}"
    return "-" if x is None else str(x)
