"""`shadow doctor`: is this install right, on this device?"""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer
from rich.table import Table

from shadow.cli.common import JsonOpt, console, device_name, emit_json, kernels_name, progress, show, user_errors


@user_errors
def doctor(
    device: Annotated[str, typer.Option(callback=device_name, help="The device to check: cpu, cuda, cuda:1 ...")] = "cpu",
    kernels: Annotated[str, typer.Option(callback=kernels_name, help="The kernel set the exactness run uses (auto: what serve and the other commands choose on this device).")] = "auto",
    json_out: JsonOpt = False,
) -> None:
    """Check the packages, the real Qwen3.5 vocabulary, the cache folder, the device and the kernels
    chosen on it, then read a short session on the device over two turns (with a rollback and an
    ask) and compare every state tensor with a fresh prefill bit for bit. Under a minute; exit code
    1 when something is broken (warnings pass)."""
    from rich.progress import TextColumn

    from shadow.offline.doctor import run_checks

    with progress(TextColumn("{task.description}")) as bar:
        task = bar.add_task("checking")
        checks = run_checks(device, kernels, lambda name: bar.update(task, description=f"checking {name}"))
    table = Table(title=f"shadow doctor · {device}")
    table.add_column("check")
    table.add_column("", justify="center")
    table.add_column("detail", overflow="fold")
    for c in checks:
        mark = "[green]ok[/]" if c.ok else "[red]broken[/]" if c.ok is False else "[yellow]warn[/]"
        table.add_row(c.name, mark, c.detail)
    show(table)
    broken = [c for c in checks if c.ok is False]
    console.print("[green]all good[/]" if not broken else f"[red]{len(broken)} broken:[/] " + ", ".join(c.name for c in broken))
    if json_out:
        emit_json({"command": "doctor", "device": device, "ok": not broken,
                   "checks": [dataclasses.asdict(c) for c in checks]})
    if broken:
        raise typer.Exit(1)
