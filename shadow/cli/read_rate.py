"""`shadow read-rate`: how fast the shadow reads, beside the transformers reference path."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from rich.progress import SpinnerColumn, TextColumn

from shadow.cli.common import (
    CsvOpt, DeviceOpt, DtypeOpt, JsonOpt, KernelsOpt, ModelOpt, PlotOpt, bounds, check_kernels, console, emit_json,
    grid_size, kernels_name, model_name, parse_dtype, progress, save_figure, show, user_errors, write_csv,
)
from shadow.errors import ShadowInputError
from shadow.model import runtime


@user_errors
def read_rate(
    *,
    model: ModelOpt = "tiny",
    also_model: Annotated[list[str] | None, typer.Option(callback=model_name, help="More presets or checkpoints whose per-chunk sweep is timed too (repeatable), e.g. qwen3.5-2b.")] = None,
    grid: Annotated[list[int] | None, typer.Option(callback=grid_size, help="Grid(s) to sweep (repeatable); the first one is used for the whole-session read, ask, decode and the reference. Default 512.")] = None,
    contexts: Annotated[str, typer.Option(help="Context depths for the per-chunk timing, comma-separated.")] = "0,16384,65536",
    batches: Annotated[str, typer.Option(help="Batch sizes whose batched reads are timed at each context too, comma-separated (e.g. 2,4,8: one forward reading the next chunk of that many sessions, as `shadow serve --batch`); and one session's next B chunks as one run; their rows go to --json as batch_rows (a run's with run true), which `replay-ledger --read-rate-json` charges batched reads by. Empty: none.")] = "",
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
    kernels: KernelsOpt = "auto",
    also_kernels: Annotated[list[str] | None, typer.Option(callback=kernels_name, help="More kernel sets for the same model whose per-chunk sweep is timed too, in the same run (repeatable), e.g. fla-fused beside the default fast.")] = None,
    repeats: Annotated[int, typer.Option(callback=bounds(ge=1), help="Timed repeats per measurement (the median is reported; at least 1).")] = 5,
    full_read_tokens: Annotated[int, typer.Option(callback=bounds(ge=0), help="Session length for the whole read from empty (0: skip; else at least the first grid).")] = 58_278,
    ask_tokens: Annotated[int, typer.Option(callback=bounds(ge=0), help="Session length at whose end ask and fork decode are timed (0: skip).")] = 41_802,
    decode_tokens: Annotated[int, typer.Option(callback=bounds(ge=1), help="Tokens decoded from the fork per timing (at least 1).")] = 32,
    reference_tokens: Annotated[int, typer.Option(callback=bounds(ge=0), help="Ids read by both us and the transformers reference for the side-by-side (0: skip the reference; else at least the first grid).")] = 16_384,
    plot: PlotOpt = None,
    csv: CsvOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Time the reader on seeded random ids (speed does not depend on the values): ms per grid
    chunk and per 1,000 tokens by grid and context depth; a whole session read from empty; an ask
    (9 choices, a 290-id question, the pending tail) at the end of a long session; fork decode ms
    per token (each timing at key lengths no earlier one met); and, in the same run on the same ids, transformers' Qwen3_5ForCausalLM read in
    grid chunks through its cache (with flash-linear-attention when installed). Timings are
    medians after warm-up, the device synchronised around each."""
    import torch

    from shadow.offline.bench import readrate as rr
    from shadow.offline.bench.reference import reference_model, reference_read_ms_per_1k, uses_fla
    from shadow.core.reader import open_reader, reader_for

    grids = grid or [512]
    try:
        depths = [int(x) for x in contexts.split(",") if x.strip()]
    except ValueError:
        raise ShadowInputError(f"--contexts must be whole numbers, e.g. 0,16384,65536 (got {contexts!r})") from None
    if not depths or min(depths) < 0:
        raise ShadowInputError("--contexts needs non-negative depths, e.g. 0,16384,65536")
    try:
        sizes = sorted({int(x) for x in batches.split(",") if x.strip()})
    except ValueError:
        raise ShadowInputError(f"--batches must be whole numbers, e.g. 2,4,8 (got {batches!r})") from None
    if any(b not in (2, 4, 8) for b in sizes):
        raise ShadowInputError(f"--batches takes 2, 4 and 8 (the batch sizes a reader has CUDA graphs for; got {batches!r})")
    for option, tokens in (("--full-read-tokens", full_read_tokens), ("--reference-tokens", reference_tokens)):
        if 0 < tokens < grids[0]:  # fewer ids than one chunk: nothing would be read, a time of nothing
            raise ShadowInputError(f"{option} must be 0 (skip) or at least the grid, {grids[0]} (got {tokens})")
    check_kernels([kernels, *(also_kernels or [])], device)
    loaded, reader = open_reader(model, grid=grids[0], device=device, dtype=parse_dtype(dtype), kernels=kernels)
    dev = loaded.model.device
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    result = rr.ReadRate()
    started = time.perf_counter()
    with progress(SpinnerColumn(), TextColumn("read-rate: {task.description}")) as bar:
        task = bar.add_task("")
        say = lambda text: bar.update(task, description=text)  # noqa: E731
        for i, g in enumerate(grids):
            r = reader if i == 0 else reader_for(loaded, g)
            result.rows += rr.chunk_times(r, depths, repeats, progress=say, model=model)
        if sizes:
            result.batch_rows = rr.batch_times(reader, depths, sizes, repeats, progress=say, model=model)
        extras = [(other, kernels) for other in also_model or []] + [(model, k) for k in also_kernels or []]
        for name, kernel_set in extras:  # other models, or the same model with other kernels
            extra, _ = open_reader(name, grid=grids[0], device=device, dtype=parse_dtype(dtype), kernels=kernel_set)
            for g in grids:
                result.rows += rr.chunk_times(reader_for(extra, g), depths, repeats, progress=say, model=name)
            del extra
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        if full_read_tokens:
            say(f"whole read of {full_read_tokens:,} ids")
            result.full_read_tokens = full_read_tokens
            result.full_read_s = rr.read_seconds(reader, rr.random_ids(full_read_tokens, seed=2), runs=min(3, repeats))
        if ask_tokens:
            say(f"ask and fork decode at the end of {ask_tokens:,} ids")
            result.ask_session_tokens = ask_tokens
            result.ask_ms, result.fork_decode_ms_per_token = rr.ask_and_decode(reader, ask_tokens, repeats, decode_tokens)
        if reference_tokens:
            ids = rr.random_ids(reference_tokens // grids[0] * grids[0], seed=5)
            result.compare_tokens = len(ids)
            say(f"ours on {len(ids):,} ids")
            result.ms_per_1k_tokens_read = rr.read_seconds(reader, ids, runs=min(3, repeats)) * 1e6 / len(ids)
            say(f"transformers reference on the same {len(ids):,} ids")
            ref = reference_model(loaded)
            result.reference_ms_per_1k_tokens = reference_read_ms_per_1k(ref, ids, grids[0], dev, runs=min(3, repeats))
            del ref
    seconds = time.perf_counter() - started

    mine = loaded.model.kernels.name
    head = _headline([r for r in result.rows if r.model == model and r.kernels == mine], grids[0])
    table = Table(title=f"read-rate · {model} ({loaded.weights_label} weights) · {loaded.model.kernels.name} kernels · {device_name}")
    for col in ("model", "kernels", "grid", "context", "ms / chunk", "ms / 1k tokens"):
        table.add_column(col, justify="left" if col in ("model", "kernels") else "right")
    for row in result.rows:
        table.add_row(row.model, row.kernels, f"{row.grid:,}", f"{row.context:,}", f"{row.ms_per_chunk:.2f}",
                      f"{row.ms_per_1k_tokens:.2f}")
    show(table)
    if result.batch_rows:
        show(_batch_table(result.batch_rows))
    if full_read_tokens:
        console.print(f"whole read of {result.full_read_tokens:,} ids from empty: {result.full_read_s:.3f} s")
    if ask_tokens:
        console.print(f"ask at the end of {ask_tokens:,} ids: {result.ask_ms:.2f} ms; fork decode {result.fork_decode_ms_per_token:.2f} ms/token")
    if result.reference_ms_per_1k_tokens is not None:
        console.print(
            f"same {result.compare_tokens:,} ids from empty: ours {result.ms_per_1k_tokens_read:.2f} ms/1k, "
            f"transformers{' + fla' if uses_fla() else ' (no fla: pure torch GDN)'} {result.reference_ms_per_1k_tokens:.2f} ms/1k, "
            f"speed-up {result.speedup_vs_reference:.1f}x"
        )
    if csv:
        write_csv(csv, [vars(r) for r in result.rows])
    if plot:
        _plot(plot, result, f"{model} on {device_name}")
    if json_out:
        emit_json({
            "command": "read-rate", "device": device_name, "model": model, "weights": loaded.weights_label,
            "kernels": loaded.model.kernels.name, "autotune_pins": runtime.pinned(), "dtype": str(loaded.model.dtype).removeprefix("torch."),
            "grid": head.grid, "context": head.context, "ms_per_chunk": round(head.ms_per_chunk, 4),
            "ms_per_1k_tokens": round(head.ms_per_1k_tokens, 4),
            "compare_tokens": result.compare_tokens or None,  # None: that part was skipped (0)
            "ms_per_1k_tokens_same_ids": _r(result.ms_per_1k_tokens_read) if reference_tokens else None,
            "reference_ms_per_1k_tokens": _r(result.reference_ms_per_1k_tokens),
            "reference": ("transformers+fla" if uses_fla() else "transformers (torch GDN)") if reference_tokens else None,
            "speedup_vs_reference": _r(result.speedup_vs_reference),
            "ask_ms": _r(result.ask_ms) if ask_tokens else None, "ask_session_tokens": result.ask_session_tokens or None,
            "fork_decode_ms_per_token": _r(result.fork_decode_ms_per_token) if ask_tokens else None,
            "full_read_s": _r(result.full_read_s) if full_read_tokens else None,
            "full_read_tokens": result.full_read_tokens or None,
            "rows": [vars(r) for r in result.rows], "batch_rows": [vars(r) for r in result.batch_rows],
            "repeats": repeats, "seconds": round(seconds, 2),
        })


def _batch_table(rows) -> Table:
    """Batched reads by depth: ms a read, ms a chunk, tokens a second, against one session's chunk;
    B sessions' next chunks, and one session's next B chunks as a run."""
    table = Table(title="batched reads: B chunks in one forward (B sessions', or one session's run)")
    for col in ("context", "B", "of", "ms / read", "ms / chunk", "tokens / s", "vs B = 1"):
        table.add_column(col, justify="right")
    single = {r.context: r.ms_per_chunk for r in rows if r.batch == 1}
    for r in rows:
        table.add_row(f"{r.context:,}", str(r.batch), "one session" if r.run else "sessions", f"{r.ms_per_read:.2f}",
                      f"{r.ms_per_chunk:.2f}", f"{r.grid * 1000 / r.ms_per_chunk:,.0f}",
                      f"x{single[r.context] / r.ms_per_chunk:.2f}")
    return table


def _headline(rows, grid: int):
    mine = [r for r in rows if r.grid == grid]
    return min(mine, key=lambda r: abs(r.context - 16384))


def _r(x):
    return None if x is None else round(x, 4)


def _plot(path: Path, result, title: str) -> None:
    """Per-chunk cost by depth (left) and, like for like, the same ids read from empty by us and by
    the transformers reference (right), as the text beside it says."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    side = result.reference_ms_per_1k_tokens is not None
    fig, axes = plt.subplots(1, 2 if side else 1, figsize=(10 if side else 7, 4),
                             gridspec_kw={"width_ratios": [2.2, 1]} if side else None)
    ax = axes[0] if side else axes
    for m, k, g in sorted({(r.model, r.kernels, r.grid) for r in result.rows}):
        rows = [r for r in result.rows if (r.model, r.kernels, r.grid) == (m, k, g)]
        ax.plot([r.context for r in rows], [r.ms_per_1k_tokens for r in rows], marker="o", label=f"{m}, {k}, grid {g}")
    ax.set_xlabel("context depth (tokens)")
    ax.set_ylabel("ms per 1,000 tokens (one chunk at that depth)")
    ax.set_yscale("log")
    ax.set_title(f"read rate by depth: {title}", fontsize=10)
    ax.legend(fontsize=8)
    if side:
        bx = axes[1]
        values = [result.ms_per_1k_tokens_read, result.reference_ms_per_1k_tokens]
        bars = bx.bar(["shadow", "transformers"], values, color=["tab:blue", "grey"])
        bx.bar_label(bars, labels=[f"{v:,.1f}" for v in values], fontsize=8)
        bx.set_ylabel("ms per 1,000 tokens (whole read)")
        bx.set_title(f"same {result.compare_tokens:,} ids from empty:\n"
                     f"speed-up {result.speedup_vs_reference:.1f}x", fontsize=10)
    save_figure(fig, path)
