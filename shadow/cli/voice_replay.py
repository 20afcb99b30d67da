"""`shadow voice-replay`: the voice on recorded sessions: phrase latency, what passes its checks, why not."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from shadow.cli.common import (
    CsvOpt, DeviceOpt, DtypeOpt, GridOpt, JsonOpt, KernelsOpt, ModelOpt, console, emit_json, errors, input_file,
    parse_dtype, seed_bounds, show, user_errors, user_text_file, write_csv,
)


@user_errors
def voice_replay(
    *,
    conversation: Annotated[list[Path] | None, typer.Option("--conversation", "-c", callback=input_file, help="A conversation file (mini-swe-agent .traj.json, SWE-agent .traj, or the project's .jsonl); repeatable. Default: the built-in seeded sample session.")] = None,
    model: ModelOpt = "tiny",
    grid: GridOpt = 512,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
    kernels: KernelsOpt = "auto",
    max_turns: Annotated[int | None, typer.Option(min=1, help="Turns of each conversation to replay (default: all).")] = None,
    min_reasoning_tokens: Annotated[int, typer.Option(min=1, help="A turn's reasoning must have this many ids for the voice to speak about it.")] = 32,
    seed: Annotated[int, typer.Option(callback=seed_bounds, help="Seed of the random preset weights and of the sample session (0 to 2**63 - 1).")] = 0,
    csv: CsvOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Read each conversation turn by turn as a live shadow would; at every assistant turn that
    reasons, the voice writes a thinking phrase at a third and two thirds of the reasoning and a
    decided phrase at its end, each from a fork of the session, each checked before it would be
    said. Reports each phrase's latency (one phrase is one slice; the slice cap is 150 ms), the
    share said, and why the others were not. With random weights nothing should pass."""
    from shadow.text.conversations import load_conversation
    from shadow.core.reader import open_reader
    from shadow.text.sample import sample_conversation
    from shadow.text.tokenizer import load_tokenizer
    from shadow.voice.replay import voice_replay as run

    conversations = ([user_text_file(p, load_conversation) for p in conversation] if conversation
                     else [sample_conversation(seed)])
    loaded, reader = open_reader(model, grid=grid, device=device, dtype=parse_dtype(dtype), kernels=kernels, seed=seed)
    tokenizer = load_tokenizer(loaded.path)
    with Progress(TextColumn("voice"), BarColumn(), TextColumn("{task.completed} phrases"), TimeElapsedColumn(),
                  console=errors, transient=True) as bar:
        task = bar.add_task("voice", total=None)
        report = run(conversations, reader, tokenizer, min_reasoning_tokens, max_turns,
                     progress=lambda a: bar.update(task, advance=1))
    summary = report.summary()
    weights = loaded.weights_label
    table = Table(title=f"voice-replay · {model} ({'random weights: nothing should pass' if loaded.random else weights[:12]})"
                        f" · {len(conversations)} conversation(s)")
    for col in ("kind", "phrases", "said", "median ms", "p90 ms", "fits 150 ms"):
        table.add_column(col, justify="left" if col == "kind" else "right")
    for kind, row in summary["by_kind"].items():
        table.add_row(kind, str(row["phrases"]), f"{row['said']} ({row['said_pct']} %)", f"{row['median_ms']:.1f}",
                      f"{row['p90_ms']:.1f}", f"{row['fits_slice_pct']} %")
    show(table)
    if summary["reasons"]:
        console.print("not said: " + ", ".join(f"{k} {v}" for k, v in summary["reasons"].items()))
    said = [a for a in report.attempts if a.said][:5]
    for a in said:
        console.print(f"said ({a.kind}, {a.conversation} turn {a.turn}): {a.text}", markup=False)
    if csv:
        write_csv(csv, [vars(a) for a in report.attempts])
    if json_out:
        emit_json({"command": "voice-replay", "model": model, "weights": weights, "device": device,
                   "conversations": [c.name for c in conversations], **summary})
