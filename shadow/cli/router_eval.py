"""`shadow router-eval`: ask a classification question offline at journaled points."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
from rich.table import Table

from shadow.cli.common import (
    CsvOpt, DeviceOpt, DtypeOpt, JsonOpt, KernelsOpt, check_kernels, console, emit_json, input_file, input_folder,
    model_name, parse_dtype, progress, refuse, show, user_errors, user_text_file, write_csv,
)
from shadow.errors import ShadowInputError


def _question_spec(ctx, param, value):
    """Each --question: 'journal' or an existing question file."""
    for spec in value or []:
        if spec != "journal" and not Path(spec).is_file():
            refuse(param, f"{spec}: neither 'journal' nor a question file")
    return value


@user_errors
def router_eval(
    *,
    journal: Annotated[Path, typer.Option(callback=input_file, help="The journal `shadow serve --journal` wrote (asks with a reference label).")],
    sessions: Annotated[Path, typer.Option(callback=input_folder, help="The folder of parked session files (`shadow serve --disk`).")],
    model: Annotated[list[str] | None, typer.Option("--model", "-m", callback=model_name, help="Model(s) to ask (presets or checkpoint folders); default tiny.")] = None,
    question: Annotated[list[str] | None, typer.Option(callback=_question_spec, help="'journal' (the journal's own question) or a JSON file {name, text, choices}; repeatable.")] = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
    kernels: KernelsOpt = "auto",
    csv: CsvOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Re-ask each journaled question at its insertion point (the session read exactly as live,
    on the journal's grid) with each model and question, and compare with the journal's reference
    labels: agreement, the constant-answer baseline (the most frequent label), the same on the
    "fresh" subset, a confusion table, and the control (the journal's own model and question must
    give the journal's probabilities again within 0.02; like for like only with the live server's
device, dtype and kernels, which the journal records as its arithmetic)."""
    from shadow.core.reader import open_reader
    from shadow.offline.routereval import evaluate, load_question, read_journal, session_ids
    from shadow.text.tokenizer import load_tokenizer

    check_kernels(kernels, device)
    entries, unlabelled = user_text_file(journal, read_journal)
    grids = {e.grid for e in entries}
    if len(grids) != 1:
        raise ShadowInputError(f"the journal mixes grids {sorted(grids)}")
    if not sessions.is_dir():
        raise ShadowInputError(f"no session folder {sessions}")
    questions = [user_text_file(q, load_question) for q in (question or ["journal"])]
    ids = session_ids(sessions, {e.session for e in entries})
    scores = []
    with progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()) as bar:
        for name in model or ["tiny"]:
            loaded, reader = open_reader(name, grid=next(iter(grids)), device=device, dtype=parse_dtype(dtype),
                                         kernels=kernels)
            tokenizer = load_tokenizer(loaded.path)
            for q in questions:
                task = bar.add_task(f"{name} · {q.name}", total=len(entries))
                scores.append(evaluate(entries, ids, reader, loaded.weights_hash, loaded.random, tokenizer, question=q,
                                       model_name=name, progress=lambda task=task: bar.advance(task)))
    table = Table(title=f"router-eval · {journal} · {len(entries)} labelled asks ({unlabelled} unlabelled)")
    for col in ("model", "question", "turns", "agree", "constant", "fresh", "fresh agree", "fresh constant", "control max |Δp|", "changed"):
        table.add_column(col, justify="left" if col in ("model", "question") else "right")
    rows = []
    for s in scores:
        row = {"model": s.model, "question": s.question, "random_weights": s.random_weights, "turns": s.turns,
               "agree": s.agree, "constant_baseline": s.constant_baseline, "fresh_turns": s.fresh_turns,
               "fresh_agree": s.fresh_agree, "fresh_constant_baseline": s.fresh_constant_baseline,
               "control_max_abs_diff": s.control_max_abs_diff, "control_same_arithmetic": s.control_same_arithmetic,
               "changed": s.changed,
               "confusion": {ref: dict(c) for ref, c in s.confusion.items()}}
        rows.append(row)
        table.add_row(s.model, s.question, str(s.turns), str(s.agree), str(s.constant_baseline), str(s.fresh_turns),
                      str(s.fresh_agree), str(s.fresh_constant_baseline),
                      "-" if s.control_max_abs_diff is None else f"{s.control_max_abs_diff:.2g}", str(s.changed))
    show(table)
    for s in scores:
        labels = sorted(set(s.confusion) | {p for c in s.confusion.values() for p in c})
        confusion = Table(title=f"confusion · {s.model} · {s.question} (rows: reference, columns: answer)")
        confusion.add_column("")
        for label in labels:
            confusion.add_column(label, justify="right")
        for ref in labels:
            confusion.add_row(ref, *(str(s.confusion.get(ref, {}).get(p, 0)) for p in labels))
        show(confusion)
    if any(s.control_same_arithmetic is False for s in scores):
        console.print("[yellow]the control re-asked with other arithmetic[/] than the live server's (device, dtype or "
                      "kernels): pass the server's --device and --dtype for a like-for-like control.")
    if any(s.random_weights for s in scores):
        console.print("[yellow]weights are random:[/] agreement figures mean nothing here; the mechanics "
                      "(insertion points, control, baselines) are what this run shows.")
    if csv:
        write_csv(csv, [{k: v for k, v in r.items() if k != "confusion"} for r in rows])
    if json_out:
        emit_json({"command": "router-eval", "journal": str(journal), "turns": len(entries),
                   "fresh_turns": sum(e.fresh for e in entries), "unlabelled": unlabelled, "results": rows})
