"""What every command shares: option types, user-error handling, the final JSON line."""

from __future__ import annotations

import csv
import functools
import json
import sys
from pathlib import Path
from typing import Annotated, Callable

import click
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


EXIT_FAILED = 1  # the check failed: not bit-equal, gate failed, invalid files
EXIT_USAGE = 2  # bad input: one line on stderr, nothing changed
EXIT_INTERNAL = 3  # a bug or an environment failure: one line (the traceback under --debug)


def debugging() -> bool:
    ctx = click.get_current_context(silent=True)
    root = ctx.find_root() if ctx is not None else None
    return bool(root is not None and isinstance(root.obj, dict) and root.obj.get("debug"))


def user_errors(fn: Callable) -> Callable:
    """The CLI's contract, in one place: bad input (a ShadowInputError, or a file the user named
    that cannot be read or written) is one clear line on stderr and exit code 2; anything else
    unexpected is one line and exit code 3, with the traceback only under `shadow --debug`;
    Ctrl-C exits 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ShadowInputError as e:
            errors.print(f"[bold red]error:[/] {e}", markup=True)
            raise typer.Exit(EXIT_USAGE) from None
        except (typer.Exit, click.exceptions.Exit, click.ClickException, click.exceptions.Abort):
            raise
        except KeyboardInterrupt:
            errors.print("interrupted")
            raise typer.Exit(130) from None
        except OSError as e:
            if debugging():
                raise
            where = f" {e.filename}" if getattr(e, "filename", None) else ""
            errors.print(f"[bold red]error:[/] cannot use{where}: {e.strerror or e}")
            raise typer.Exit(EXIT_USAGE) from None
        except Exception as e:  # noqa: BLE001 - the contract: no traceback unless asked for
            if debugging():
                raise
            errors.print(f"[bold red]internal error:[/] {type(e).__name__}: {e}", markup=True)
            errors.print("run `shadow --debug ...` for the traceback")
            raise typer.Exit(EXIT_INTERNAL) from None

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
