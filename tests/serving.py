"""Shared by the serve tests: a real `shadow serve` app under uvicorn on loopback, and waits on it."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from shadow.core.reader import open_reader
from shadow.core.schedule import BandwidthRule
from shadow.core.store import SessionStore
from shadow.offline.verify import compare_states
from shadow.server.generator import Generator
from shadow.server.host import Shadow
from shadow.server.http.app import ShadowApp
from shadow.server.service import ShadowService
from shadow.server.settings import (EngineSettings, LineTiming, ModelSettings, ServeSettings, SessionSettings,
                                    StatusSettings, StoreSettings)
from shadow.text.tokenizer import load_tokenizer

GRID = 128


def answers(journal) -> list[dict]:
    """The journal's answers (its turn records left out)."""
    return [r for r in map(json.loads, journal.read_text().splitlines()) if r.get("kind") != "turn"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settings_for(upstream: str | None = None, disk=None, journal=None, label_from_upstream=False, prefix_match=True,
                 require_exact=False, session_headers=None, status_channel="auto", status_timing=None,
                 rule: BandwidthRule = BandwidthRule(), dialect: str = "auto", engine_timeout_s: float = 600.0,
                 predict: bool = True, read_ahead: bool = False, **more) -> ServeSettings:
    """The settings a test's service runs with: grid GRID, no cap, and what the test names."""
    sessions = SessionSettings(prefix_match=prefix_match, **({"headers": tuple(session_headers)} if session_headers else {}))
    return ServeSettings(
        model=ModelSettings("tiny", grid=GRID), store=StoreSettings(cap_gib=None, disk=disk), schedule=rule,
        engine=EngineSettings(upstream=upstream, dialect=dialect, label_from_upstream=label_from_upstream,
                              timeout_s=engine_timeout_s, predict=predict, read_ahead=read_ahead),
        sessions=sessions, status=StatusSettings(status_channel, timing=LineTiming(**(status_timing or {}))),
        journal=journal, require_exact=require_exact, **more)


def service_for(settings: ServeSettings, reader, store, weights: str = "random", **parts) -> ShadowService:
    """A service over a shadow already loaded (`parts`: standing, voice, clock, pool_free)."""
    return ShadowService(settings, Shadow(reader, store, weights), reader.model.config, **parts)


@contextmanager
def running(upstream: str | None = None, disk=None, journal=None, standing=None, label_from_upstream=False,
            prefix_match=True, require_exact=False, renderer=None, wrap=None, pieces=False, **options):
    """A real `shadow serve` app on loopback in a thread: embedded, or a proxy in front of
    `upstream` (`wrap`: an ASGI middleware around it); leaving it is a planned stop (sessions
    parked on `disk`). `pieces`: the shadow reads through the piecewise forward (graphs off: the
    pieces a GPU replays), so batched reads can be read a piece at a time."""
    loaded, reader = open_reader("tiny", grid=GRID)
    if pieces:
        from shadow.model.piecewise import PiecewiseForward

        reader.forward = PiecewiseForward(loaded.model, sizes={GRID}, graphs=False, batches={2, 4, 8})
    store = SessionStore(reader, loaded.weights_hash, cap_gib=None, disk=disk)
    settings = settings_for(upstream, disk, journal, label_from_upstream, prefix_match, require_exact, **options)
    service = service_for(settings, reader, store, loaded.weights_label, standing=standing)
    generator = None if upstream else Generator(loaded.model)
    app = ShadowApp(settings, service, load_tokenizer(None), "upstream" if upstream else "tiny", generator=generator,
                    renderer=renderer).app
    with serving(app if wrap is None else wrap(app)) as client:
        yield client, service


@contextmanager
def serving(app):
    """`app` under uvicorn on a free loopback port in a thread; a client of it."""
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    assert srv.started
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            yield client
    finally:
        srv.should_exit = True
        thread.join(timeout=30)


def long_text(seed: int, words: int = 400) -> str:
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(["cache", "reader", "grid", "chunk", "state", "token", "session", "row"]) for _ in range(words))


def wait_until_read(service: ShadowService, names, timeout: float = 60.0) -> None:
    """The idle window reads every session to its last whole chunk."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        with service.state_lock:
            sessions = [service.store.get(n) for n in names]
            done = all(s.readable - s.committed < GRID for s in sessions) and not service.turns  # held ids wait
            done = done and not service.pending  # standing questions answered
        if done:
            service.device.run(lambda: None)  # and no chunk in flight
            return
        time.sleep(0.1)
    raise AssertionError("the idle window did not catch up")


def settled(service: ShadowService, timeout: float = 30.0) -> None:
    """Wait until no turn is in flight (a proxy feeds the shadow after the response has gone)."""
    deadline = time.time() + timeout
    while service.turns and time.time() < deadline:
        time.sleep(0.02)
    assert not service.turns


def assert_exact(service: ShadowService, name: str) -> None:
    with service.device.hold(), service.state_lock:
        s = service.store.get(name)
        fresh = service.reader.prefill(s.ids[: s.committed])
        compared, mismatched, _ = compare_states(s.state, fresh)
    assert compared > 0 and mismatched == []


def scripted_stream(steps, seen: list[dict] | None = None, usage: dict | None = None):
    """An OpenAI-compatible engine on a FastAPI app that streams `steps`, each (seconds to wait
    first, delta, finish reason or None), after a role chunk; with the client's include_usage, a
    usage chunk at the end. `steps` may be a function of the request body. Requests go to `seen`."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "m"}]}

    async def chat(request: Request):
        body = await request.json()
        if seen is not None:
            seen.append(body)

        def chunk(delta, finish=None) -> str:
            return "data: " + json.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                          "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"

        async def events():
            yield chunk({"role": "assistant", "content": ""})
            for wait, delta, finish in (steps(body) if callable(steps) else steps):
                await asyncio.sleep(wait)
                yield chunk(delta, finish)
            if (body.get("stream_options") or {}).get("include_usage"):
                yield "data: " + json.dumps({"choices": [], "usage": usage or {"prompt_tokens": 1,
                                                                               "completion_tokens": 2}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    return app
