"""What every command shares: option types, user-error handling, the final JSON line."""

from __future__ import annotations

import csv
import functools
import json
import sys
from pathlib import Path
from typing import Annotated, Callable

import typer
from rich.console import Console

from shadow.errors import ShadowInputError

# a pipe or file gets a wide table rather than rich's default 80 columns
console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
errors = Console(stderr=True, highlight=False, soft_wrap=True)  # one error, one line

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Preset (tiny, qwen3.5-0.8b, qwen3.5-2b, qwen3.5-4b: random weights) or a Qwen3.5 checkpoint folder.")]
GridOpt = Annotated[int, typer.Option(help="Grid G: rows per chunk; the state advances only at multiples of G (a positive multiple of 64).")]
DeviceOpt = Annotated[str, typer.Option(help="torch device: cpu, cuda, cuda:1 ...")]
DtypeOpt = Annotated[str, typer.Option(help="Model dtype: auto (as stored: float32 for tiny, bfloat16 for the other presets), float32, bfloat16.")]
KernelsOpt = Annotated[str, typer.Option(help="Kernels: auto (fast on CUDA when fla is installed, else reference), reference (plain PyTorch), fast = fla-triton (fused steps: merged projections, fla and Triton kernels, Triton chunk attention), fla-fused (the same with SDPA attention), fla (fla's kernels in the plain steps).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="End stdout with one JSON object on its own line.")]
CsvOpt = Annotated[Path | None, typer.Option("--csv", help="Also write the table as CSV to this path.")]


def user_errors(fn: Callable) -> Callable:
    """Turn a ShadowInputError into one clear line on stderr and exit code 2 (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ShadowInputError as e:
            errors.print(f"[bold red]error:[/] {e}")
            raise typer.Exit(2) from None

    return wrapper


def parse_dtype(name: str):
    import torch

    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": None}
    if name not in table:
        raise ShadowInputError(f"unknown dtype {name!r} (float32, bfloat16, float16, auto)")
    return table[name]


def emit_json(obj: dict) -> None:
    """The last stdout line: one JSON document."""
    sys.stdout.flush()
    print(json.dumps(obj, separators=(",", ":")), flush=True)


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
