"""`shadow store`: list and check a folder of spilled sessions."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from shadow.cli.common import GridOpt, JsonOpt, emit_json, model_name, show, user_errors
from shadow.errors import ShadowInputError


@user_errors
def store(
    folder: Annotated[Path, typer.Argument(help="A store folder (verify-exact --disk, serve's disk).")],
    model: Annotated[str | None, typer.Option("--model", "-m", callback=model_name, help="Read every file in full against this model (weights hash, shapes, checksums); without it only headers are checked.")] = None,
    grid: GridOpt = 512,
    store_key: Annotated[str | None, typer.Option(envvar="SHADOW_STORE_KEY", help="The store's key (serve's --store-key): only files whose keyed digest was made with it are valid.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """List each session file: session, tokens, bytes, age, and whether it is valid or why not.
    Exit 0 when every file is valid, 1 when any is not, 2 on bad input."""
    from shadow.core.reader import open_reader
    from shadow.core.store import check_folder

    if not folder.is_dir():
        raise ShadowInputError(f"no store folder {folder}")
    reader = weights = None
    if model:
        loaded, reader = open_reader(model, grid=grid)
        weights = loaded.weights_hash
    rows = check_folder(folder, reader, weights, key=store_key)
    table = Table(title=f"store {folder}" + (f" · checked against {model}, grid {grid}" if model else " · headers only"))
    for col in ("file", "session", "tokens", "MiB", "age", "valid"):
        table.add_column(col, justify="left" if col in ("file", "session", "valid") else "right")
    for r in rows:
        table.add_row(r.file[:20] + "…", escape(r.session) if r.session is not None else "-", f"{r.tokens:,}" if r.tokens is not None else "-",
                      f"{r.bytes / 2**20:.1f}", _age(r.age_s), "[green]yes[/]" if r.valid else f"[red]no[/]: {escape(r.reason)}")
    show(table)
    if json_out:
        emit_json({"command": "store", "folder": str(folder), "files": [dataclasses.asdict(r) for r in rows],
                   "valid": sum(r.valid for r in rows), "invalid": sum(not r.valid for r in rows)})
    if not all(r.valid for r in rows):
        raise typer.Exit(1)


def _age(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"
