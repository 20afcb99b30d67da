"""`shadow serve`: the live service with an embedded generator, or in front of an engine, and the
shadow beside it. Each option maps to one field of `shadow.server.settings.ServeSettings`; each has
a SHADOW_SERVE_* environment variable (the keys: SHADOW_API_KEY, SHADOW_ADMIN_KEY,
SHADOW_UPSTREAM_API_KEY) and a key in a --config TOML file."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Annotated

import typer

from shadow.cli.common import (
    console, device_name, dtype_name, grid_size, input_file, kernels_name, model_name, parse_dtype, readable_path,
    template_kwargs, tokenizer_path, user_errors, user_text_file,
)
from shadow.core.schedule import BandwidthRule
from shadow.errors import ShadowInputError
from shadow.server.settings import (
    Access, EngineSettings, Limits, ModelSettings, ProbeSettings, ServeSettings, SessionSettings, StatusSettings,
    StoreSettings, VoiceSettings, check,
)

log = logging.getLogger("shadow.serve")

MODEL, STORE, READING, ENGINE, SESSIONS, LINES, VOICE, LIMITS, ACCESS, SERVICE, OPERATIONS = (
    "The shadow's model", "Memory and disk", "When the shadow reads", "Proxy mode: the engine", "Sessions",
    "Status lines", "The voice", "Limits", "Access", "Service", "Probes, metrics and logs")


def _load_config(ctx: typer.Context, path: Path | None) -> Path | None:
    """--config FILE (TOML): its keys are the options' names (cap_gib, disk, upstream, ...); the
    command line and SHADOW_SERVE_* variables win over it."""
    if path is None:
        return None
    import tomllib

    from shadow.engines.jsonlimits import collection_paused

    try:
        with collection_paused():
            values = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # TOMLDecodeError and UnicodeDecodeError are ValueErrors
        raise typer.BadParameter(f"cannot read {path} as TOML: {type(e).__name__}: {str(e)[:200]}") from None
    known = {p.name for p in ctx.command.params}
    unknown = sorted(set(values) - known)
    if unknown:
        raise typer.BadParameter(f"{path}: unknown settings {', '.join(unknown)}")
    ctx.default_map = {**(ctx.default_map or {}), **values}
    return path


def _env(name: str) -> str:
    return f"SHADOW_SERVE_{name.upper()}"


@user_errors
def serve(
    config: Annotated[Path | None, typer.Option(help="A TOML file of these options (e.g. cap_gib = 2, disk = \"/var/cache/shadow\"); the command line and SHADOW_SERVE_* environment variables win.", is_eager=True, callback=_load_config, rich_help_panel=SERVICE)] = None,
    host: Annotated[str, typer.Option(envvar=_env("host"), help="Address to listen on. Beyond loopback, an --api-key is required.", rich_help_panel=SERVICE)] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar=_env("port"), min=1, max=65535, help="Port to listen on.", rich_help_panel=SERVICE)] = 8000,
    journal: Annotated[Path | None, typer.Option(envvar=_env("journal"), help="JSONL journal (mode 0600) of every turn's check against the engine and every question asked, with its answer, lag and backlog.", rich_help_panel=SERVICE)] = None,
    require_exact: Annotated[bool, typer.Option(envvar=_env("require_exact"), help="Asks and summaries about a session whose ids are not all verified against the engine answer 409 with the reason.", rich_help_panel=SERVICE)] = False,
    shadow: Annotated[bool, typer.Option("--shadow/--no-shadow", envvar=_env("shadow"), help="Start with the shadow on; --no-shadow serves completions alone (e.g. an embedded engine for another serve's proxy to read), until POST /v1/shadow/switch turns it on.", rich_help_panel=SERVICE)] = True,
    standing_question: Annotated[Path | None, typer.Option(envvar=_env("standing_question"), callback=input_file, help="A JSON file {name, text, choices, min_prompt_tokens (8192), label_header (x-shadow-label)}: asked of the shadow at every turn with at least that many prompt tokens, at the prompt's last <|im_end|>, journaled beside the turn's label header.", rich_help_panel=SERVICE)] = None,
    model: Annotated[str, typer.Option("--model", "-m", envvar=_env("model"), callback=model_name, help="The shadow: a preset (tiny, qwen3.5-0.8b, qwen3.5-2b, qwen3.5-4b: random weights) or a Qwen3.5 checkpoint folder.", rich_help_panel=MODEL)] = "tiny",
    generator_model: Annotated[str | None, typer.Option(envvar=_env("generator_model"), callback=model_name, help="Embedded mode: the generator's checkpoint or preset (default: the shadow's own).", rich_help_panel=MODEL)] = None,
    grid: Annotated[int, typer.Option(envvar=_env("grid"), callback=grid_size, help="Grid G: rows per chunk (a positive multiple of 64).", rich_help_panel=MODEL)] = 512,
    device: Annotated[str, typer.Option(envvar=_env("device"), callback=device_name, help="torch device: cpu, cuda, cuda:1 ... (checked before anything loads).", rich_help_panel=MODEL)] = "cpu",
    dtype: Annotated[str, typer.Option(envvar=_env("dtype"), callback=dtype_name, help="Model dtype: auto, float32, bfloat16.", rich_help_panel=MODEL)] = "auto",
    kernels: Annotated[str, typer.Option(envvar=_env("kernels"), callback=kernels_name, help="Kernels: auto, reference, fast (fla-triton), fla-fused, fla.", rich_help_panel=MODEL)] = "auto",
    cap_gib: Annotated[float, typer.Option(envvar=_env("cap_gib"), min=0.001, help="Resident cap for shadow sessions, GiB.", rich_help_panel=STORE)] = 4.0,
    disk: Annotated[Path | None, typer.Option(envvar=_env("disk"), help="Folder where sessions past the cap (and all, at a planned stop) are written.", rich_help_panel=STORE)] = None,
    disk_cap_gib: Annotated[float, typer.Option(envvar=_env("disk_cap_gib"), min=0.001, help="Bound on the store's own files in --disk, GiB (oldest removed first).", rich_help_panel=STORE)] = 64.0,
    unload_slack_gib: Annotated[float | None, typer.Option(envvar=_env("unload_slack_gib"), min=0.0, help="Proxy mode, with --disk: after an idle burst that leaves more than this many GiB free in the shadow's CUDA memory pool, park every session on disk and unload the model (2 is a good value). Default: never.", rich_help_panel=STORE)] = None,
    store_key: Annotated[str | None, typer.Option(envvar="SHADOW_STORE_KEY", help="A secret for the session files in --disk: each carries a keyed digest (HMAC-SHA256) made with it, and a file without that digest (planted by someone without the key) is refused.", rich_help_panel=STORE)] = None,
    share: Annotated[float, typer.Option(envvar=_env("share"), help="In-turn share of the time since the first token the shadow may read (0.02 is 2 %).", rich_help_panel=READING)] = 0.02,
    slice_ms: Annotated[float, typer.Option(envvar=_env("slice_ms"), min=0.001, help="The longest a share slice may hold the device between two rounds, ms (whole chunks by their estimated cost).", rich_help_panel=READING)] = 150.0,
    batch: Annotated[int, typer.Option(envvar=_env("batch"), min=1, max=8, help="Chunks one read may take together (2, 4 or 8: one forward, each session's state bit-equal to reading its chunks alone; 1: one chunk a read), in the idle window and in the share: taken in the order sessions are read, a session's next chunks first (read as one run), then the next session's. On the H200 8 sessions at 16k read 33 % more tokens a second than one at a time, one session's 8 chunks 31 % more.", rich_help_panel=READING)] = 1,
    batch_ms: Annotated[float, typer.Option(envvar=_env("batch_ms"), min=0.001, help="With --batch: the longest a batched read may hold the device at once, by estimate, ms: in the idle window (a request that comes waits for one read), and between two rounds in the share (the lower of this and --slice-ms). 8 sessions at 16k take about 21 ms on the H200.", rich_help_panel=READING)] = 10.0,
    batch_read_ms: Annotated[float | None, typer.Option(envvar=_env("batch_read_ms"), min=0.001, help="With --batch: the longest a batched read in the share may take in all, ms, read in pieces of at most --batch-ms between two rounds (the forward's pieces between its attention layers): a batch of 8 at depth costs a stream no longer a gap than --batch-ms. Default: --batch-ms (one piece).", rich_help_panel=READING)] = None,
    batch_wait_ms: Annotated[float, typer.Option(envvar=_env("batch_wait_ms"), min=0.0, help="With --batch: while the share is busy (--batch-busy), a batch that could take more chunks than are ready waits up to this long for them, ms: when the share is what limits the shadow, fuller batches read more tokens for it (0: never wait).", rich_help_panel=READING)] = 0.0,
    batch_busy: Annotated[float, typer.Option(envvar=_env("batch_busy"), min=0.001, max=1.0, help="With --batch-wait-ms: the share is busy when its reads of the last 10 s used at least this part of the share of those 10 s and less than 4 s of its budget is left.", rich_help_panel=READING)] = 0.4,
    priorities: Annotated[str, typer.Option(envvar=_env("priorities"), help="The order sessions are read in: all (a question first, then turns in flight, the most recent turn, the oldest backlog), none, or steps among question,running,fewest,recent,oldest joined by commas. Adding fewest (the session nearest to fresh first) makes more turn starts fresh when the share cannot keep up, at the cost of the sessions furthest behind (`shadow replay-ledger --priorities` replays both).", rich_help_panel=READING)] = "all",
    read_rate_json: Annotated[Path | None, typer.Option(envvar=_env("read_rate_json"), callback=input_file, help="A `shadow read-rate --json` output of this model at this grid (e.g. with --contexts 0,16384,65536,100352 and --batches 2,4,8): the scheduler starts from its chunk costs by depth and its batched reads' costs, so a session deeper than the load measures (0, 8k, 32k) is estimated by its own depth before its first read; the load's measurements and every read replace them.", rich_help_panel=READING)] = None,
    upstream: Annotated[str | None, typer.Option(envvar=_env("upstream"), help="Proxy mode: the engine's OpenAI-compatible base URL (e.g. http://127.0.0.1:8001/v1). Without it: embedded mode.", rich_help_panel=ENGINE)] = None,
    engine: Annotated[str, typer.Option(envvar=_env("engine"), help="The engine's dialect (where the ids it read and wrote come from): vllm, sglang, llamacpp, transformers, openai; auto probes the engine.", rich_help_panel=ENGINE)] = "auto",
    chat_template: Annotated[Path | None, typer.Option(envvar=_env("chat_template"), callback=readable_path, help="The big model's chat template: a .jinja file, a tokenizer_config.json, or its checkpoint folder (default: the --tokenizer folder's, else the shadow checkpoint's).", rich_help_panel=ENGINE)] = None,
    tokenizer_path: Annotated[Path | None, typer.Option("--tokenizer", envvar=_env("tokenizer"), callback=tokenizer_path, help="The big model's tokenizer: a folder with tokenizer.json, or the file (default: the template's folder, else the real Qwen3.5 vocabulary). Embedded mode: with --chat-template only.", rich_help_panel=ENGINE)] = None,
    chat_template_kwargs: Annotated[str | None, typer.Option(envvar=_env("chat_template_kwargs"), help="JSON object of template kwargs the engine applies by default (e.g. '{\"enable_thinking\": false}'); a request's own win.", rich_help_panel=ENGINE)] = None,
    label_from_upstream: Annotated[bool, typer.Option(envvar=_env("label_from_upstream"), help="With --standing-question: after a turn with no label header, ask the engine the standing question (one greedy token) and journal its answer as the reference label.", rich_help_panel=ENGINE)] = False,
    session_headers: Annotated[str, typer.Option(envvar=_env("session_headers"), help="Request headers that name a session, first match wins (comma-separated).", rich_help_panel=SESSIONS)] = "x-session-id,x-openwebui-chat-id",
    prefix_match: Annotated[bool, typer.Option(envvar=_env("prefix_match"), help="Without a session header, continue the resident session sharing the longest prefix with the prompt (off: two header-less users sharing a system prompt would land in one session).", rich_help_panel=SESSIONS)] = False,
    status_channel: Annotated[str, typer.Option(envvar=_env("status_channel"), help="Where status lines (waiting, reading N tokens, thinking, writing a file) go in streamed chat: auto (Open WebUI: status events, then reasoning; opencode: inline; other clients: none), reasoning, content, inline, off.", rich_help_panel=LINES)] = "auto",
    engine_slots: Annotated[int, typer.Option(envvar=_env("engine_slots"), min=1, help="Requests the engine prefills at once (llama.cpp's -np; high for vLLM and SGLang): a request waits behind that many.", rich_help_panel=LINES)] = 1,
    voice: Annotated[bool, typer.Option(envvar=_env("voice"), help="The voice: a short phrase from the shadow's state after a thinking, decided or writing line, said only if it passes its checks (with random weights none does).", rich_help_panel=VOICE)] = True,
    voice_model: Annotated[str | None, typer.Option(envvar=_env("voice_model"), callback=model_name, help="A checkpoint (or preset) of its own for the voice, e.g. a real Qwen3.5-2B folder: it reads each session's newest 2,048 ids afresh (default: the voice forks the shadow's own state).", rich_help_panel=VOICE)] = None,
    voice_share: Annotated[float, typer.Option(envvar=_env("voice_share"), min=0.0, max=0.5, help="The voice's share of the time since a turn's first token (phrases of at most 150 ms; in embedded mode written a forward between each two rounds).", rich_help_panel=VOICE)] = 0.03,
    max_body_mb: Annotated[float, typer.Option(envvar=_env("max_body_mb"), min=0.001, help="Largest request body, MiB (413 beyond).", rich_help_panel=LIMITS)] = 32.0,
    max_prompt_tokens: Annotated[int, typer.Option(envvar=_env("max_prompt_tokens"), min=1, help="Longest prompt the embedded generator takes (400 beyond) or the shadow reads (proxy: longer prompts pass, unread).", rich_help_panel=LIMITS)] = 262_144,
    max_question_tokens: Annotated[int, typer.Option(envvar=_env("max_question_tokens"), min=1, help="Longest ask question, tokens.", rich_help_panel=LIMITS)] = 8192,
    max_tokens: Annotated[int, typer.Option(envvar=_env("max_tokens"), min=1, help="Most tokens the embedded generator writes for one request.", rich_help_panel=LIMITS)] = 4096,
    max_ask_tail: Annotated[int, typer.Option(envvar=_env("max_ask_tail"), min=1, help="Most unread ids an ask or summary may prefill in one fork; a session further behind answers 503 (ask again with a longer timeout_s).", rich_help_panel=LIMITS)] = 16384,
    max_concurrent: Annotated[int, typer.Option(envvar=_env("max_concurrent"), min=1, help="Completion, ask and summary requests in flight (429 beyond).", rich_help_panel=LIMITS)] = 64,
    max_queued: Annotated[int, typer.Option(envvar=_env("max_queued"), min=1, help="Embedded mode: requests generating or waiting for the generator (429 beyond).", rich_help_panel=LIMITS)] = 16,
    max_generating: Annotated[int, typer.Option(envvar=_env("max_generating"), min=1, help="Embedded mode: generations that hold their state at once, taking turns on the device (a short request is served between a long prefill's chunks); the others wait in arrival order.", rich_help_panel=LIMITS)] = 2,
    api_key: Annotated[str | None, typer.Option(envvar="SHADOW_API_KEY", help="Require 'Authorization: Bearer KEY' on every endpoint (required to listen beyond loopback).", rich_help_panel=ACCESS)] = None,
    admin_key: Annotated[str | None, typer.Option(envvar="SHADOW_ADMIN_KEY", help="A separate key for the shadow's own endpoints (ask, summarize, status, switch) and /metrics; it opens the others too.", rich_help_panel=ACCESS)] = None,
    upstream_api_key: Annotated[str | None, typer.Option(envvar="SHADOW_UPSTREAM_API_KEY", help="Proxy mode: the engine's key, sent in place of the client's Authorization.", rich_help_panel=ACCESS)] = None,
    health_without_key: Annotated[bool, typer.Option(envvar=_env("health_without_key"), help="GET /health and /ready answer without a key (default: with an --api-key set they want it too). /metrics always wants the admin key, else the API key.", rich_help_panel=ACCESS)] = False,
    log_format: Annotated[str, typer.Option(envvar=_env("log_format"), help="Log lines on stderr: text, or json (one object a line, with the session and turn where the line has them; uvicorn's lines too).", rich_help_panel=OPERATIONS)] = "text",
    health_stuck_s: Annotated[float, typer.Option(envvar=_env("health_stuck_s"), min=0.0, help="GET /health answers 503 once a no-op job has waited this long for the device thread (a model load or a long generation holds it meanwhile).", rich_help_panel=OPERATIONS)] = 300.0,
    ready_engine_timeout_s: Annotated[float, typer.Option(envvar=_env("ready_engine_timeout_s"), min=0.0, help="Proxy mode: GET /ready answers 503 when the engine's /models does not answer below 500 within this many seconds.", rich_help_panel=OPERATIONS)] = 2.0,
) -> None:
    """Serve OpenAI-compatible /v1/chat/completions, /v1/completions and /v1/models from an
    embedded Qwen3.5 generator (the project's own forward), with a shadow reading every session
    under the bandwidth rule, and /v1/shadow/ask, /summarize, /status. With --upstream, proxy
    mode: requests go to the engine and come back as it sent them while the shadow reads the
    engine's own ids beside it (a dialect per engine), every turn checked against the engine.
    Session identity: the x-session-id or X-OpenWebUI-Chat-Id header (else, with --prefix-match,
    the longest matching prefix of a known session). GET /health and /ready are the liveness and
    readiness probes; GET /metrics, Prometheus's."""
    import faulthandler
    import signal

    # every option is checked before any work: nothing is loaded, written or bound on bad input
    for name, value in (("--max-body-mb", max_body_mb), ("--cap-gib", cap_gib), ("--disk-cap-gib", disk_cap_gib),
                        ("--share", share), ("--slice-ms", slice_ms), ("--batch-ms", batch_ms),
                        ("--batch-read-ms", batch_ms if batch_read_ms is None else batch_read_ms),
                        ("--batch-wait-ms", batch_wait_ms), ("--batch-busy", batch_busy), ("--voice-share", voice_share),
                        ("--health-stuck-s", health_stuck_s), ("--ready-engine-timeout-s", ready_engine_timeout_s)):
        if not math.isfinite(value):
            raise ShadowInputError(f"{name} must be a finite number (got {value})")
    parse_dtype(dtype)
    settings = ServeSettings(
        model=ModelSettings(model, generator_model, grid, device, dtype, kernels),
        store=StoreSettings(cap_gib, disk, disk_cap_gib, unload_slack_gib, store_key),
        schedule=BandwidthRule(share=share, slice_s=slice_ms / 1000, batch=batch, batch_s=batch_ms / 1000,
                               batch_read_s=None if batch_read_ms is None else batch_read_ms / 1000,
                               batch_wait_s=batch_wait_ms / 1000, batch_busy=batch_busy),
        priorities=_priorities(priorities),
        read_costs=None if read_rate_json is None else _read_costs(read_rate_json, model, grid),
        engine=EngineSettings(upstream, engine, chat_template, tokenizer_path, template_kwargs(chat_template_kwargs),
                              upstream_api_key, label_from_upstream),
        sessions=SessionSettings(tuple(h.strip() for h in session_headers.split(",") if h.strip()), prefix_match),
        status=StatusSettings(status_channel, engine_slots),
        voice=VoiceSettings(voice, voice_model, voice_share),
        limits=Limits(max_body_bytes=int(max_body_mb * 2**20), max_prompt_tokens=max_prompt_tokens,
                      max_question_tokens=max_question_tokens, max_tokens=max_tokens, max_ask_tail=max_ask_tail,
                      max_concurrent=max_concurrent, max_queued=max_queued, max_generating=max_generating),
        access=Access(api_key, admin_key, health_without_key),
        probes=ProbeSettings(stuck_s=health_stuck_s, engine_timeout_s=ready_engine_timeout_s),
        journal=journal, standing_question=standing_question, require_exact=require_exact, shadow_on=shadow,
        log_format=log_format,
        host=host, port=port,
    )
    check(settings)
    if standing_question is not None:  # its choices single, distinct tokens of the shadow's vocabulary
        _check_standing(standing_question, model)
    listener = _bind(host, port)  # before the model loads: a port in use fails at once
    from shadow.server import logs
    from shadow.server.http.build import build

    logs.setup(log_format)

    try:
        built = build(settings)
    except BaseException:
        listener.close()
        raise
    if built.random and log_format == "json":  # stderr holds nothing but JSON lines
        log.warning("weights are random: answers and generated text mean nothing; exactness and timing do")
    elif built.random:
        console.print("[yellow]weights are random:[/] answers and generated text mean nothing; exactness and timing do.")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` prints every thread's stack
    _run(built.app, listener, host, port)


def _check_standing(path: Path, model: str) -> None:
    """The standing question as serve will read it, with the shadow's tokenizer, before any work
    (a checkpoint folder's own tokenizer.json, else the Qwen3.5 vocabulary the presets use)."""
    from shadow.server.standing import load_standing
    from shadow.text.tokenizer import load_tokenizer

    folder = Path(model)
    load_standing(path, load_tokenizer(folder if folder.is_dir() else None))


def _bind(host: str, port: int):
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ShadowInputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _run(app, listener, host: str, port: int) -> None:
    """uvicorn on the bound socket; says when it listens (the service says what it wrote at the stop)."""
    import uvicorn

    from shadow.server import gcpauses

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started:
                # what the load made lives as long as the process: out of the collector's walks
                # (a full collection of it stalls every stream for tens of milliseconds)
                frozen = gcpauses.freeze()
                log.info("listening on http://%s:%d (%d objects of the load frozen out of garbage collection)",
                         host if ":" not in host else f"[{host}]", port, frozen)

    server = Server(uvicorn.Config(app, log_level="warning", log_config=None))  # its lines in the one format
    try:
        server.run(sockets=[listener])
    finally:
        listener.close()


def _priorities(spec: str):
    from shadow.core.schedule import Priorities

    try:
        return Priorities.parse(spec)
    except ValueError as e:
        raise ShadowInputError(f"--priorities: {e}") from None


def _read_costs(path: Path, model: str, grid: int):
    """The costs a `read-rate --json` output gives the scheduler to start from, checked: the same
    model and grid as this serve's, positive costs."""
    from shadow.offline.costs import known_costs, read_rate_document

    try:
        doc = user_text_file(path, lambda p: read_rate_document(p.read_text(encoding="utf-8")))
        if doc.get("model") != model:
            raise ShadowInputError(f"{path}: measured for model {doc.get('model')!r}, not this serve's {model!r}")
        return known_costs(doc, grid, path.name)
    except ShadowInputError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise ShadowInputError(f"{path}: not a read-rate --json output at grid {grid} ({type(e).__name__}: {e})") from None
