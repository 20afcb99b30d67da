"""`shadow ab`: what the shadow costs the big model's decode, shadow off against on."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
from rich.table import Table

from shadow.cli.common import (
    EXIT_FAILED, CsvOpt, JsonOpt, PlotOpt, bounds, console, emit_json, progress, refuse, save_figure, show, user_errors, write_csv,
)
from shadow.errors import ShadowInputError


def _http_url(ctx, param, value):
    if not value.startswith(("http://", "https://")):
        refuse(param, f"{value!r}: not an http(s) URL, e.g. http://127.0.0.1:8000/v1")
    return value


@user_errors
def ab(
    *,
    url: Annotated[str, typer.Option(callback=_http_url, help="The running `shadow serve` base URL (embedded or proxy), e.g. http://127.0.0.1:8000/v1.")] = "http://127.0.0.1:8000/v1",
    prompt_tokens: Annotated[int, typer.Option(callback=bounds(ge=1), help="Prompt length in tokens.")] = 16_350,
    output_tokens: Annotated[int, typer.Option(callback=bounds(ge=2), help="Tokens generated per run, at least 2.")] = 346,
    runs: Annotated[int, typer.Option(callback=bounds(ge=1), help="Runs per arm.")] = 6,
    pause: Annotated[float, typer.Option(callback=bounds(ge=0), help="Seconds between requests.")] = 1.5,
    gate_pct: Annotated[float, typer.Option(callback=bounds(ge=0), help="The largest decode slowdown (%) that passes.")] = 3.0,
    api_key: Annotated[str | None, typer.Option(envvar="SHADOW_API_KEY", help="The server's key (its admin key, when it has one: the switch and status want it), sent as Authorization: Bearer KEY.")] = None,
    allow_insignificant: Annotated[bool, typer.Option("--allow-insignificant", help="Exit by the gate even when the verdict is not significant (fewer than 5 pairs, or pairs spread wider than the gate); without it such a verdict exits 1, as a failed gate does.")] = False,
    voice: Annotated[bool, typer.Option("--voice", help="Arms 'shadow, status lines and voice off' against 'all on': the on runs send Open WebUI's chat-id header, for which serve's default --status-channel auto writes status lines (and the voice its phrases); the off runs get none. Without it the voice stays off in both arms.")] = False,
    plot: PlotOpt = None,
    csv: CsvOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Drive a running server with the shadow switched off and on (POST /v1/shadow/switch),
    arms alternating, a new session and a fresh prompt each run, and compare decode tok/s
    (from streamed token times, the first token excluded) and time to first token, with the time
    the shadow read inside each decode as the server charged it to its share. The switch is set
    back as it was at the end, also after an error or Ctrl-C. The fields that fix each run's length
    and ask for ids are sent only where the engine takes them (the server's dialect, else a
    refusal naming them): the output says which were dropped and what that does. Exit code 1 when
    the slowdown is over the gate, or when the verdict is not significant (fewer than MIN_PAIRS
    pairs, or their spread wider than the gate) unless --allow-insignificant."""
    import httpx

    from shadow.offline.bench.ab import MIN_PAIRS, fields_for, run_ab, summarize
    from shadow.text.tokenizer import load_tokenizer

    base = url.rstrip("/")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base + "/shadow/status", timeout=10, headers=headers)
        status = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as e:
        raise ShadowInputError(f"no shadow serve at {url} ({type(e).__name__})") from None
    if r.status_code == 401:
        raise ShadowInputError(f"the server at {url} wants a key: --api-key KEY (or SHADOW_API_KEY; its admin key if it has one)")
    if not isinstance(status, dict) or "enabled" not in status:
        raise ShadowInputError(f"no shadow serve at {url} (GET /shadow/status answered {r.status_code})")
    restore = (bool(status["enabled"]), status.get("voice"))  # the switch as it was, set back at the end
    tokenizer = load_tokenizer(None)
    with progress(TextColumn("a/b"), BarColumn(), MofNCompleteColumn()) as bar:
        task = bar.add_task("a/b", total=2 * runs)

        def report(done: int, total: int, run) -> None:
            bar.console.print(f"run {done}/{total}: pair {run.pair}, shadow {run.arm}: TTFT {run.ttft_s:.3f} s, "
                              f"decode {run.decode_tok_s:.2f} tok/s, {run.tokens} tokens")
            bar.update(task, completed=done)

        results = run_ab(base, tokenizer, prompt_tokens, output_tokens, runs, pause, progress=report, voice=voice,
                         restore=restore, api_key=api_key, fields=fields_for(status.get("engine")))
    summary = summarize(results, gate_pct)
    table = Table(title=f"ab · {url} · {prompt_tokens:,} prompt tokens, {output_tokens} out · shadow weights: {status.get('weights')}")
    for col in ("pair", "arm", "TTFT s", "decode tok/s", "ITL p50 ms", "p99", "max", "tokens") \
            + (("status lines",) if voice else ()):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(str(r.pair), r.arm, f"{r.ttft_s:.3f}", f"{r.decode_tok_s:.2f}", f"{r.itl_p50_ms:.2f}",
                      f"{r.itl_p99_ms:.2f}", f"{r.itl_max_ms:.1f}", str(r.tokens), *((str(r.lines),) if voice else ()))
    show(table)
    d, t = summary["decode_tok_s"], summary["ttft_s"]
    console.print(f"decode tok/s median: off {d['off']:.2f}, on {d['on']:.2f} ({summary['delta_pct']:+.2f} %); "
                  f"paired: {', '.join(f'{x:+.1f}' for x in summary['paired_deltas_pct'])} % "
                  f"(median {summary['paired_median_pct']:+.2f} %); "
                  f"TTFT median off {t['off']:.3f} s, on {t['on']:.3f} s; gate {gate_pct:g} %: "
                  + ("[green]passed[/]" if summary["passed"] else "[red]failed[/]")
                  + ("" if summary["significant"] else " [yellow](not significant)[/]"))
    if not summary["significant"]:
        console.print(f"[yellow]the verdict is not significant: {'; '.join(summary['not_significant_because'])}"
                      f" (at least {MIN_PAIRS} pairs within ±{gate_pct:g} % make one)[/]")
    for field, effect in summary["fields"]["effects"].items():
        console.print(f"[yellow]the engine does not take {field}: {effect}[/]")
    if voice:
        lines = summary["status_lines"]
        console.print(f"status lines seen: off {lines['off']}, on {lines['on']}"
                      + (" [yellow](none in the on runs: is the server's --status-channel off, or did each run end before its first thinking line, after 15 s of reasoning?)[/]" if not lines["on"] else "")
                      + (" [yellow](lines in the off runs: run serve with --status-channel auto)[/]" if lines["off"] else ""))
    itl = summary["itl"]
    console.print(f"inter-token latency (medians of the runs): off p50 {itl['off']['p50_ms']:.2f} ms, "
                  f"p99 {itl['off']['p99_ms']:.2f} ms, longest {itl['off']['max_ms']:.1f} ms; on p50 "
                  f"{itl['on']['p50_ms']:.2f} ms, p99 {itl['on']['p99_ms']:.2f} ms, longest {itl['on']['max_ms']:.1f} ms")
    gaps = summary["server_gaps"]
    if any(gaps[a]["round"] or gaps[a]["write"] for a in gaps):
        console.print(f"the server's own gaps of 10 ms or more (status gaps, each in --json with what ran in it): "
                      f"off {gaps['off']['round']} on the device thread, {gaps['off']['write']} in the stream's writes; "
                      f"on {gaps['on']['round']} and {gaps['on']['write']}")
    if summary["share_pct"] is not None:
        console.print(f"the shadow read inside the decode for {summary['share_pct']:.2f} % of it "
                      "(the share it was charged, median of the on runs)"
                      + (f"; the voice spoke for {summary['voice_pct']:.2f} %" if voice and summary["voice_pct"] is not None else ""))
    if csv:
        write_csv(csv, [dataclasses.asdict(r) | {"server_gaps": len(r.server_gaps)} for r in results])
    if plot:
        _plot(plot, results, f"shadow ab · {prompt_tokens:,} prompt tokens, {output_tokens} out")
    if json_out:
        emit_json({"command": "ab", "url": url, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
                   "voice": voice,
                   **summary, "per_run": [dataclasses.asdict(r) for r in results]})
    if not summary["passed"] or not (summary["significant"] or allow_insignificant):
        raise typer.Exit(EXIT_FAILED)


def _plot(path: Path, results, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for arm, color in (("off", "grey"), ("on", "tab:blue")):
        rs = [r for r in results if r.arm == arm]
        ax.plot([r.pair for r in rs], [r.decode_tok_s for r in rs], marker="o", color=color, label=f"shadow {arm}")
    ax.set_xlabel("pair")
    ax.set_ylabel("decode tok/s")
    ax.set_xticks(sorted({r.pair for r in results}))
    ax.set_title(title)
    ax.legend()
    save_figure(fig, path)
