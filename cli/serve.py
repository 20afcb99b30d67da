"""`shadow serve`: the live service with an embedded generator, or in front of an engine, and the
shadow beside it. Every option has a SHADOW_SERVE_* environment variable (keys: SHADOW_API_KEY,
SHADOW_ADMIN_KEY, SHADOW_UPSTREAM_API_KEY) and a key in a --config TOML file."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from cli.common import console, parse_dtype, user_errors
from shadow.text.chat_template import parse_template_kwargs, renderer_for
from shadow.errors import ShadowInputError
from shadow.server.http.channels import CHANNELS
from shadow.engines.dialects import DIALECTS, ENGINES

log = logging.getLogger("shadow.serve")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _load_config(ctx: typer.Context, path: Path | None) -> Path | None:
    """--config FILE (TOML): its keys are the options' names (cap_gib, disk, upstream, ...); the
    command line and SHADOW_SERVE_* variables win over it."""
    if path is None:
        return None
    import tomllib

    try:
        values = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise typer.BadParameter(f"cannot read {path} as TOML: {type(e).__name__}: {e}") from None
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
    config: Annotated[Path | None, typer.Option(help="A TOML file of these options (e.g. cap_gib = 2, disk = \"/var/cache/shadow\"); the command line and SHADOW_SERVE_* environment variables win.", is_eager=True, callback=_load_config)] = None,
    model: Annotated[str, typer.Option("--model", "-m", envvar=_env("model"), help="The shadow: a preset (tiny, qwen3.5-0.8b, qwen3.5-2b, qwen3.5-4b: random weights) or a Qwen3.5 checkpoint folder.")] = "tiny",
    generator_model: Annotated[str | None, typer.Option(envvar=_env("generator_model"), help="The embedded generator's checkpoint or preset (default: the shadow's own).")] = None,
    host: Annotated[str, typer.Option(envvar=_env("host"), help="Address to listen on. Beyond loopback, an --api-key is required.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar=_env("port"), min=1, max=65535, help="Port to listen on.")] = 8000,
    grid: Annotated[int, typer.Option(envvar=_env("grid"), help="Grid G: rows per chunk (a positive multiple of 64).")] = 512,
    device: Annotated[str, typer.Option(envvar=_env("device"), help="torch device: cpu, cuda, cuda:1 ...")] = "cpu",
    dtype: Annotated[str, typer.Option(envvar=_env("dtype"), help="Model dtype: auto, float32, bfloat16.")] = "auto",
    kernels: Annotated[str, typer.Option(envvar=_env("kernels"), help="Kernels: auto, reference, fast (fla-triton), fla-fused, fla.")] = "auto",
    cap_gib: Annotated[float, typer.Option(envvar=_env("cap_gib"), min=0.001, help="Resident cap for shadow sessions, GiB.")] = 4.0,
    disk: Annotated[Path | None, typer.Option(envvar=_env("disk"), help="Folder where sessions past the cap (and all, at a planned stop) are written.")] = None,
    disk_cap_gib: Annotated[float, typer.Option(envvar=_env("disk_cap_gib"), min=0.001, help="Bound on the store's own files in --disk, GiB (oldest removed first).")] = 64.0,
    share: Annotated[float, typer.Option(envvar=_env("share"), help="In-turn share of the time since the first token the shadow may read.")] = 0.02,
    journal: Annotated[Path | None, typer.Option(envvar=_env("journal"), help="JSONL journal (mode 0600) of every turn's check against the engine and every question asked, with its answer, lag and backlog.")] = None,
    upstream: Annotated[str | None, typer.Option(envvar=_env("upstream"), help="Proxy mode: the engine's OpenAI-compatible base URL (e.g. http://127.0.0.1:8001/v1). Without it: embedded mode.")] = None,
    standing_question: Annotated[Path | None, typer.Option(envvar=_env("standing_question"), help="A JSON file {name, text, choices, min_prompt_tokens (8192), label_header (x-shadow-label)}: asked of the shadow at every turn with at least that many prompt tokens, at the prompt's last <|im_end|>, journaled beside the turn's label header.")] = None,
    session_headers: Annotated[str, typer.Option(envvar=_env("session_headers"), help="Request headers that name a session, first match wins (comma-separated).")] = "x-session-id,x-openwebui-chat-id",
    prefix_match: Annotated[bool, typer.Option(envvar=_env("prefix_match"), help="Without a session header, continue the resident session sharing the longest prefix with the prompt (off: two header-less users sharing a system prompt would land in one session).")] = False,
    label_from_upstream: Annotated[bool, typer.Option(envvar=_env("label_from_upstream"), help="Proxy mode, with --standing-question: after a turn with no label header, ask the engine the standing question (one greedy token) and journal its answer as the reference label.")] = False,
    unload_slack_gib: Annotated[float | None, typer.Option(envvar=_env("unload_slack_gib"), min=0.0, help="Proxy mode, with --disk: after an idle burst that leaves more than this many GiB free in the shadow's CUDA memory pool, park every session on disk and unload the model (DESIGN suggests 2). Default: never.")] = None,
    engine: Annotated[str, typer.Option(envvar=_env("engine"), help="Proxy mode: the engine's dialect (where the ids it read and wrote come from): vllm, sglang, llamacpp, transformers, openai; auto probes the engine.")] = "auto",
    chat_template: Annotated[Path | None, typer.Option(envvar=_env("chat_template"), help="The big model's chat template: a .jinja file, a tokenizer_config.json, or its checkpoint folder (default: the --tokenizer folder's, else the shadow checkpoint's).")] = None,
    tokenizer_path: Annotated[Path | None, typer.Option("--tokenizer", envvar=_env("tokenizer"), help="The big model's tokenizer: a folder with tokenizer.json, or the file (default: the template's folder, else the real Qwen3.5 vocabulary).")] = None,
    chat_template_kwargs: Annotated[str | None, typer.Option(envvar=_env("chat_template_kwargs"), help="JSON object of template kwargs the engine applies by default (e.g. '{\"enable_thinking\": false}'); a request's own win.")] = None,
    require_exact: Annotated[bool, typer.Option(envvar=_env("require_exact"), help="Asks and summaries about a session whose ids are not all verified against the engine answer 409 with the reason.")] = False,
    api_key: Annotated[str | None, typer.Option(envvar="SHADOW_API_KEY", help="Require 'Authorization: Bearer KEY' on every endpoint (required to listen beyond loopback).")] = None,
    admin_key: Annotated[str | None, typer.Option(envvar="SHADOW_ADMIN_KEY", help="A separate key for the shadow's own endpoints (ask, summarize, status, switch).")] = None,
    upstream_api_key: Annotated[str | None, typer.Option(envvar="SHADOW_UPSTREAM_API_KEY", help="Proxy mode: the engine's key, sent in place of the client's Authorization.")] = None,
    max_body_mb: Annotated[float, typer.Option(envvar=_env("max_body_mb"), min=0.001, help="Largest request body, MiB (413 beyond).")] = 32.0,
    max_prompt_tokens: Annotated[int, typer.Option(envvar=_env("max_prompt_tokens"), min=1, help="Longest prompt the embedded engine takes (400 beyond) or the shadow reads (proxy: longer prompts pass, unread).")] = 262_144,
    max_question_tokens: Annotated[int, typer.Option(envvar=_env("max_question_tokens"), min=1, help="Longest ask question, tokens.")] = 8192,
    max_tokens: Annotated[int, typer.Option(envvar=_env("max_tokens"), min=1, help="Most tokens the embedded engine generates for one request.")] = 4096,
    max_ask_tail: Annotated[int, typer.Option(envvar=_env("max_ask_tail"), min=1, help="Most unread ids an ask or summary may prefill in one fork; a session further behind answers 503 (ask again with a longer timeout_s).")] = 16384,
    max_concurrent: Annotated[int, typer.Option(envvar=_env("max_concurrent"), min=1, help="Completion, ask and summary requests in flight (429 beyond).")] = 64,
    status_channel: Annotated[str, typer.Option(envvar=_env("status_channel"), help="Where status lines (waiting, reading N tokens, thinking, writing a file) go in streamed chat: auto (Open WebUI: status events, then reasoning; opencode: inline; other clients: none), reasoning, content, inline, off.")] = "auto",
    voice: Annotated[bool, typer.Option(envvar=_env("voice"), help="The voice: a short phrase from the shadow's state after a thinking, decided or writing line, said only if it passes its checks (with random weights none does).")] = True,
    voice_model: Annotated[str | None, typer.Option(envvar=_env("voice_model"), help="A checkpoint (or preset) of its own for the voice, e.g. a real Qwen3.5-2B folder: it reads each session's newest 2,048 ids afresh (default: the voice forks the shadow's own state).")] = None,
    voice_share: Annotated[float, typer.Option(envvar=_env("voice_share"), min=0.0, max=0.5, help="The voice's share of the time since a turn's first token (one phrase a slice of at most 150 ms).")] = 0.03,
    engine_slots: Annotated[int, typer.Option(envvar=_env("engine_slots"), min=1, help="Requests the engine prefills at once (llama.cpp's -np; high for vLLM and SGLang): a request waits behind that many.")] = 1,
) -> None:
    """Serve OpenAI-compatible /v1/chat/completions, /v1/completions and /v1/models from an
    embedded Qwen3.5 generator (the project's own forward), with a shadow reading every session
    under the bandwidth rule, and /v1/shadow/ask, /summarize, /status. With --upstream, proxy
    mode: requests go to the engine and come back as it sent them while the shadow reads the
    engine's own ids beside it (a dialect per engine), every turn checked against the engine.
    Session identity: the x-session-id or X-OpenWebUI-Chat-Id header (else, with --prefix-match,
    the longest matching prefix of a known session)."""
    import faulthandler
    import signal

    from shadow.server.http.guard import Access, Limits

    # every option is checked before any work: nothing is loaded, written or bound on bad input
    if not 0 < share < 1:
        raise ShadowInputError("--share must be between 0 and 1 (a fraction: 0.02 is 2 %)")
    if label_from_upstream and (not upstream or standing_question is None):
        raise ShadowInputError("--label-from-upstream needs proxy mode (--upstream) and a --standing-question")
    if unload_slack_gib is not None and (not upstream or disk is None):
        raise ShadowInputError("--unload-slack-gib needs proxy mode (--upstream) and a --disk to park sessions on")
    if engine != "auto" and engine not in ENGINES:
        raise ShadowInputError(f"--engine must be auto or one of {', '.join(ENGINES)}")
    if status_channel not in CHANNELS:
        raise ShadowInputError(f"--status-channel must be one of {', '.join(CHANNELS)}")
    if upstream is not None and not upstream.startswith(("http://", "https://")):
        raise ShadowInputError(f"--upstream {upstream!r} is not an http(s) URL")
    if host not in LOOPBACK and not api_key:
        raise ShadowInputError(f"listening on {host} (beyond loopback) needs an --api-key (or SHADOW_API_KEY)")
    if disk is not None and disk.exists() and not disk.is_dir():
        raise ShadowInputError(f"--disk {disk} is a file, not a folder")
    if journal is not None and (journal.is_dir() or not journal.parent.is_dir()):
        raise ShadowInputError(f"--journal {journal} must be a file in an existing folder")
    parse_dtype(dtype)
    kwargs = parse_template_kwargs(chat_template_kwargs)
    listener = _bind(host, port)  # before the model loads: a port in use fails at once
    limits = Limits(max_body_bytes=int(max_body_mb * 2**20), max_prompt_tokens=max_prompt_tokens,
                    max_question_tokens=max_question_tokens, max_tokens=max_tokens, max_ask_tail=max_ask_tail,
                    max_concurrent=max_concurrent)
    access = Access(api_key=api_key, admin_key=admin_key)
    headers = tuple(h.strip() for h in session_headers.split(",") if h.strip())
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    logging.getLogger("shadow").setLevel(logging.INFO)
    try:
        app, random = _build(model=model, generator_model=generator_model, grid=grid, device=device, dtype=dtype,
                             kernels=kernels, cap_gib=cap_gib, disk=disk, disk_cap_gib=disk_cap_gib, share=share, journal=journal,
                             upstream=upstream, standing_question=standing_question, headers=headers,
                             prefix_match=prefix_match, label_from_upstream=label_from_upstream,
                             unload_slack_gib=unload_slack_gib, engine=engine, chat_template=chat_template,
                             tokenizer_path=tokenizer_path, template_kwargs=kwargs, require_exact=require_exact,
                             access=access, limits=limits, upstream_key=upstream_api_key,
                             lines={"status_channel": status_channel, "engine_slots": engine_slots},
                             voice={"voice": voice, "voice_share": voice_share, "voice_model": voice_model})
    except BaseException:
        listener.close()
        raise
    if random:
        console.print("[yellow]weights are random:[/] answers and generated text mean nothing; exactness and timing do.")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` prints every thread's stack
    _run(app, listener, host, port)


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

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started:
                log.info("listening on http://%s:%d", host if ":" not in host else f"[{host}]", port)

    server = Server(uvicorn.Config(app, log_level="warning"))
    try:
        server.run(sockets=[listener])
    finally:
        listener.close()


def _build(*, model, generator_model, grid, device, dtype, kernels, cap_gib, disk, disk_cap_gib, share, journal, upstream,
           standing_question, headers, prefix_match, label_from_upstream, unload_slack_gib, engine, chat_template,
           tokenizer_path, template_kwargs, require_exact, access, limits, upstream_key, lines, voice):
    """The app for these settings, and whether its weights are random."""
    from shadow.core.reader import open_reader
    from shadow.model import load_model
    from shadow.model.checkpoint import RANDOM_MARKER, read_config, resolve_checkpoint
    from shadow.model.runtime import choose_kernels as pick
    from shadow.core.reader import check_grid
    from shadow.core.schedule import BandwidthRule
    from shadow.server.http.app import create_app
    from shadow.server.generator import Generator
    from shadow.server.service import ShadowService, load_standing
    from shadow.core.store import SessionStore
    from shadow.text.tokenizer import load_tokenizer

    rule = BandwidthRule(share=share)
    options = {"prefix_match": prefix_match, "require_exact": require_exact, "max_ask_tail": limits.max_ask_tail,
               "voice_share": voice["voice_share"]}
    if voice["voice"] and voice["voice_model"]:
        _, options["voice_reader"] = open_reader(voice["voice_model"], grid=grid, device=device,
                                                 dtype=parse_dtype(dtype), kernels=kernels)
    common = {"session_headers": headers, "template_kwargs": template_kwargs, "access": access, "limits": limits,
              **lines}
    check_grid(grid)
    folder = resolve_checkpoint(model)
    config = read_config(folder)
    pick(kernels, device, config.linear_key_head_dim)  # a bad --kernels fails here, not in the background
    if upstream:  # proxy mode: requests pass through at once; the shadow loads in the background
        tokenizer = load_tokenizer(folder)
        standing = load_standing(standing_question, tokenizer) if standing_question else None
        renderer = renderer_for(chat_template, tokenizer_path, folder)
        dialect = None if engine == "auto" else DIALECTS[engine](renderer, template_kwargs=template_kwargs,
                                                                  eos_id=config.eos_token_id)

        def load():
            loaded, reader = open_reader(model, grid=grid, device=device, dtype=parse_dtype(dtype), kernels=kernels)
            store = SessionStore(reader, loaded.weights_hash, cap_gib=cap_gib, disk=disk, disk_cap_gib=disk_cap_gib,
                                 model=model)
            log.info("the shadow is ready: %s (%s), grid %d, %s", model, loaded.weights_label[:16], grid,
                     store.identity.arithmetic)
            return reader, store, loaded.weights_label

        slack = None if unload_slack_gib is None else int(unload_slack_gib * 2**30)
        service = ShadowService(None, None, rule, journal, standing=standing, load=load, config=config,
                                unload_slack_bytes=slack, label_from_upstream=label_from_upstream,
                                voice_tokenizer=tokenizer if voice["voice"] else None, **options)
        app = create_app(service, tokenizer, "upstream", upstream=upstream, dialect=dialect, renderer=renderer,
                         label_from_upstream=label_from_upstream, upstream_key=upstream_key, **common)
        return app, (folder / RANDOM_MARKER).exists()
    # embedded: the generator needs its model before the first request
    loaded, reader = open_reader(model, grid=grid, device=device, dtype=parse_dtype(dtype), kernels=kernels)
    store = SessionStore(reader, loaded.weights_hash, cap_gib=cap_gib, disk=disk, disk_cap_gib=disk_cap_gib,
                         model=model)
    tokenizer = load_tokenizer(loaded.path)
    standing = load_standing(standing_question, tokenizer) if standing_question else None
    service = ShadowService(reader, store, rule, journal, loaded.weights_label, standing=standing,
                            voice_tokenizer=tokenizer if voice["voice"] else None, **options)
    gen_model = loaded.model if generator_model in (None, model) else load_model(
        generator_model, dtype=parse_dtype(dtype), device=device, kernels=loaded.model.kernels).model
    renderer = renderer_for(chat_template, tokenizer_path, None) if chat_template else None
    app = create_app(service, tokenizer, generator_model or model, generator=Generator.on(gen_model),
                     renderer=renderer, **common)
    log.info("the shadow is ready: %s (%s), grid %d, %s", model, loaded.weights_label[:16], grid,
             store.identity.arithmetic)
    return app, loaded.random
