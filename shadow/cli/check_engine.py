"""`shadow check-engine URL`: can a shadow beside this engine read the ids it reads?"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from shadow.cli.common import (
    CsvOpt, JsonOpt, console, emit_json, readable_path, show, template_kwargs, tokenizer_path, user_errors,
    write_csv,
)
from shadow.errors import ShadowInputError

QWEN_END = 248046  # <|im_end|>: the end token of the Qwen chat models, when no tokenizer says otherwise


@user_errors
def check_engine(
    url: Annotated[str, typer.Argument(help="The engine's OpenAI-compatible base URL, e.g. http://127.0.0.1:8001/v1.")],
    *,
    engine: Annotated[str, typer.Option(help="The engine's dialect: auto (probe), vllm, sglang, llamacpp, transformers, openai.")] = "auto",
    chat_template: Annotated[Path | None, typer.Option(callback=readable_path, help="The big model's chat template (.jinja, tokenizer_config.json, or its folder), for the dialects that render.")] = None,
    tokenizer: Annotated[Path | None, typer.Option(callback=tokenizer_path, help="The big model's tokenizer (a folder with tokenizer.json, or the file). Default: the template folder's, else the real Qwen3.5 vocabulary.")] = None,
    chat_template_kwargs: Annotated[str | None, typer.Option(help="JSON object of template kwargs the engine applies by default.")] = None,
    model_name: Annotated[str | None, typer.Option("--model-name", help="The `model` field of every request (default: the first of the engine's /v1/models).")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, max=4096, help="Tokens each request may generate.")] = 16,
    long_words: Annotated[int, typer.Option(min=100, help="Words in the long prompt's filler.")] = 3000,
    timeout_s: Annotated[float, typer.Option(min=1, help="Seconds one request may take.")] = 600.0,
    csv: CsvOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Send the conformance cases (plain, multi-turn with reasoning, tools with a tool call and its
    result, a long prompt, a plain completion; each streamed and not) to the engine exactly as
    `shadow serve` would, and show per request where the prompt and output ids come from, whether
    they equal the engine's own where it shows them, whether their counts equal `usage`, and each
    part's state: verified, unverified (read, nothing could be checked), mismatched, or not read
    (an output the engine shows no ids for: the shadow leaves it to the next prompt). A request is
    verified only when both its prompt and its output are. Exit code 1 when a request's ids do not
    match the engine, or when a request failed (the engine answered anything but 200, or nothing):
    each failed request is named with its cause (the status and the engine's message, 200
    characters at most) in the table, below it, and in --json (`error`)."""
    import httpx

    from shadow.text.chat_template import renderer_for
    from shadow.engines.enginecheck import check_engine as run, summary
    from shadow.engines.dialects import DIALECTS, ENGINES, probe

    if engine != "auto" and engine not in ENGINES:
        raise ShadowInputError(f"--engine must be auto or one of {', '.join(ENGINES)}")
    if not url.startswith(("http://", "https://")):
        raise ShadowInputError(f"{url!r} is not an http(s) URL")
    kwargs = template_kwargs(chat_template_kwargs)
    with httpx.Client() as client:
        try:
            models = client.get(url.rstrip("/") + "/models", timeout=10).json()
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as e:
            raise ShadowInputError(f"no engine answers at {url} ({type(e).__name__}: {e})") from None
        name, evidence = (engine, "given") if engine != "auto" else probe(client, url)
    if model_name is None:
        data = models.get("data") if isinstance(models, dict) else None
        model_name = data[0].get("id") if isinstance(data, list) and data and isinstance(data[0], dict) else None
    renderer = renderer_for(chat_template, tokenizer, None) if (chat_template or tokenizer) else None
    eos = getattr(renderer.tokenizer, "eos_token_id", None) if renderer else None
    dialect = DIALECTS[name](renderer, template_kwargs=kwargs, eos_id=eos if isinstance(eos, int) else QWEN_END)
    console.print(f"{dialect.describe()} (found by: {evidence})", markup=False)
    with console.status("checking") as status:
        results = run(url, dialect, max_tokens, model_name, long_words, timeout_s,
                      progress=lambda r: status.update(f"checking: {r.case} request {r.request}"))
    failed = any(r.status != 200 for r in results)
    table = Table(title=f"check-engine {url} · dialect {name}")
    for col in ("case", "#", "HTTP", "prompt from", "ids", "usage", "prompt", "output from", "ids", "usage", "output",
                "engine's ids", "template", "verified") + (("failed because",) if failed else ()):
        table.add_column(col, justify="right" if col in ("#", "HTTP", "ids", "usage") else "left")
    for r in results:
        table.add_row(r.case, str(r.request), str(r.status), r.prompt_source or "-", _n(r.prompt_ids), _n(r.usage_prompt),
                      _state(r.prompt_check), r.output_source or "-", _n(r.output_ids), _n(r.usage_completion),
                      _state(r.output_check),
                      _yes(r.prompt_equal if r.output_equal is None else (r.prompt_equal is not False and r.output_equal)),
                      _yes(r.template_equal), _yes(r.verified), *((r.error or "",) if failed else ()))
    show(table)
    for r in results:
        if r.status != 200:  # no answer to check: the request failed
            console.print(f"failed: {r.case} #{r.request}: {r.error}", markup=False, style="red")
        elif r.verified is not True and r.reasons:
            console.print(f"{r.case} #{r.request}: {'; '.join(r.reasons)}", markup=False, style="dim")
    totals = summary(results)
    console.print(f"{totals['verified']} of {totals['requests']} requests verified (prompt and output), "
                  f"{totals['mismatched']} mismatched, {totals['unverified']} not verified, {totals['failed']} failed")
    for part in ("prompts", "outputs"):
        by = totals[part]
        console.print(f"{part}: {by['verified']} verified, {by['unverified']} unverified, "
                      f"{by['mismatched']} mismatched, {by['not_read']} not read")
    if csv:
        write_csv(csv, [vars(r) | {"reasons": "; ".join(r.reasons)} for r in results])
    if json_out:
        emit_json({"command": "check-engine", "url": url, "dialect": name, "evidence": evidence,
                   "template": renderer.origin if renderer else None, "summary": totals,
                   "requests": [vars(r) for r in results]})
    if totals["mismatched"] or totals["failed"]:
        raise typer.Exit(1)


def _n(v) -> str:
    return "-" if v is None else f"{v:,}"


def _state(v: str | None) -> str:
    colour = {"verified": "green", "mismatched": "red", "unverified": "yellow"}.get(v)
    return "-" if v is None else (f"[{colour}]{v}[/]" if colour else v.replace("_", " "))


def _yes(v) -> str:
    return "-" if v is None else ("[green]yes[/]" if v else "[red]no[/]")
