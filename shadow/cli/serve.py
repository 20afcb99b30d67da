"""`shadow serve`: the live service with an embedded generator, or in front of an engine, and the
shadow beside it. Its options are generated from `shadow.server.settings` (each field that is an
option: its flag, default, range and help), and each has a SHADOW_SERVE_* environment variable
(the keys: SHADOW_API_KEY, SHADOW_ADMIN_KEY, SHADOW_UPSTREAM_API_KEY, SHADOW_STORE_KEY) and a key
in a --config TOML file."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from shadow.cli.common import (
    console, input_file, parse_dtype, setting_parameter, user_errors, user_text_file, with_options,
)
from shadow.errors import ShadowInputError
from shadow.server.settings import READING, SERVICE, check, options, settings_from

log = logging.getLogger("shadow.serve")
ENV_PREFIX = "SHADOW_SERVE_"
EXIT_UNSAVED = 1  # a stop that could not write every session (or a second signal cut it short)


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


@with_options([setting_parameter(s, env_prefix=ENV_PREFIX) for s in options()])
@user_errors
def serve(
    *,
    config: Annotated[Path | None, typer.Option(help="A TOML file of these options (e.g. cap_gib = 2, disk = \"/var/cache/shadow\"); the command line and SHADOW_SERVE_* environment variables win.", is_eager=True, callback=_load_config, rich_help_panel=SERVICE)] = None,
    read_rate_json: Annotated[Path | None, typer.Option(envvar=ENV_PREFIX + "READ_RATE_JSON", callback=input_file, help="A `shadow read-rate --json` output of this model at this grid (e.g. with --contexts 0,16384,65536,100352 and --batches 2,4,8): the scheduler starts from its chunk costs by depth and its batched reads' costs, so a session deeper than the load measures is estimated by its own depth before its first read; the load's measurements and every read replace them.", rich_help_panel=READING)] = None,
    **chosen,
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

    # every option is checked before any work (ranges while parsing): nothing is loaded, written or bound on bad input
    parse_dtype(chosen["dtype"])
    settings = settings_from(chosen)
    if read_rate_json is not None:
        settings = replace(settings, read_costs=_read_costs(read_rate_json, settings.model.model, settings.model.grid))
    check(settings)
    if settings.standing_question is not None:  # its choices single, distinct tokens of the shadow's vocabulary
        _check_standing(settings.standing_question, settings.model.model)
    if settings.engine.chat_template is not None:  # a template file that cannot be read fails here, not after the load
        from shadow.text.chat_template import read_template

        read_template(settings.engine.chat_template)
    host, port, log_format = settings.host, settings.port, settings.log_format
    listener = _bind(host, port)  # before the model loads: a port in use fails at once
    from shadow.server import logs
    from shadow.server.http.build import build

    logs.setup(log_format, settings.log_level)

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
    _run(built, listener, settings)
    if built.service.unsaved:  # each one was logged with its reason
        raise typer.Exit(EXIT_UNSAVED)


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


def _run(built, listener, settings) -> None:
    """uvicorn on the bound socket; says when it listens. A stop signal (SIGTERM or SIGINT) stops
    taking requests, writes the idle sessions, gives turns in flight `shutdown_timeout_s` to end,
    writes the rest (the service's stop) and returns; a second signal exits at once (every file is
    written whole or not at all, so none is half written)."""
    import asyncio
    import signal

    import uvicorn

    from shadow.server import gcpauses

    host, port, service = settings.host, settings.port, built.service

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started:
                # what the load made lives as long as the process: out of the collector's walks
                # (a full collection of it stalls every stream for tens of milliseconds)
                frozen = gcpauses.freeze()
                log.info("listening on http://%s:%d (%d objects of the load frozen out of garbage collection)",
                         host if ":" not in host else f"[{host}]", port, frozen)

        def handle_exit(self, sig, frame):  # not uvicorn's: a stop is a success, not the signal raised again
            if self.should_exit:
                log.warning("%s again: exiting now; sessions of turns in flight may be unwritten",
                            signal.Signals(sig).name)
                os._exit(EXIT_UNSAVED)
            log.info("%s: stopping; turns in flight have %g s to end", signal.Signals(sig).name,
                     settings.shutdown_timeout_s)
            self.should_exit = True

        async def shutdown(self, sockets=None):
            for server in self.servers:  # no new connection, then the idle sessions to disk first
                server.close()
            await asyncio.to_thread(service.save_idle)
            await super().shutdown(sockets=sockets)

    server = Server(uvicorn.Config(built.app, log_level="warning", log_config=None,  # its lines in the one format
                                   timeout_graceful_shutdown=settings.shutdown_timeout_s))
    try:
        server.run(sockets=[listener])
    finally:
        listener.close()


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
