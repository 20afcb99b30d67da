"""Each request's access line (`shadow.access`) and each refusal's or failure's one line with its
cause (`shadow.http`), from a real `shadow serve` on loopback: a proxy in front of a real engine
on loopback that answers 400, answers 502 or hangs past the engine's timeout, a body that is not
JSON, and an embedded service whose device thread has stopped (a 500)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import logging
import time
from contextlib import contextmanager

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from scripted import renderer
from serving import running, service_for, serving, settings_for
from shadow.core.reader import open_reader
from shadow.core.store import SessionStore
from shadow.server import logs
from shadow.server.http.app import ShadowApp
from shadow.text.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow  # real servers, engines or clients: `pytest -m 'not slow'` leaves them out


def failing_engine() -> FastAPI:
    """An OpenAI-compatible engine whose answer the request's `model` chooses: `refuse` a 400,
    `broken` a 502, `hang` nothing for 30 s; `breaks` a stream that stops mid-way (its connection
    cut), `stalls` a stream whose second event comes 30 s after its first."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        model = (await request.json()).get("model")
        if model in ("breaks", "stalls"):
            async def events():
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "Hel"}}]}) + "\n\n"
                if model == "breaks":
                    raise ConnectionError("the engine's worker died mid-stream")
                await asyncio.sleep(30)
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        if model == "refuse":
            return JSONResponse({"error": {"message": "max_tokens is too large", "type": "BadRequestError"}}, 400)
        if model == "broken":
            return JSONResponse({"error": {"message": "the worker died", "type": "InternalServerError"}}, 502)
        await asyncio.sleep(30)
        return JSONResponse({})

    return app


@contextmanager
def proxy_timing_out(upstream: str, seconds: float):
    """A real proxy on loopback whose engine must send its first byte within `seconds`, and
    each piece after it within `seconds` of the one before."""
    loaded, reader = open_reader("tiny", grid=128)
    settings = settings_for(upstream, prefix_match=False, dialect="openai")
    engine = dataclasses.replace(settings.engine, first_byte_timeout_s=seconds, idle_timeout_s=seconds)
    settings = dataclasses.replace(settings, engine=engine)
    store = SessionStore(reader, loaded.weights_hash, cap_gib=None)
    service = service_for(settings, reader, store, loaded.weights_label)
    with serving(ShadowApp(settings, service, load_tokenizer(None), "upstream", renderer=renderer()).app) as client:
        yield client


def lines_of(caplog, logger: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == logger]


def logged(caplog, timeout: float = 10.0) -> tuple[list[logging.LogRecord], list[logging.LogRecord]]:
    """The request's error and access lines, once its access line (written after its last byte
    went out, so at times after the client has it) is there."""
    deadline = time.time() + timeout
    while not lines_of(caplog, "shadow.access") and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)  # a line that would follow it
    return lines_of(caplog, "shadow.http"), lines_of(caplog, "shadow.access")


def test_each_refusal_and_engine_failure_is_one_line_with_its_cause_beside_its_access_line(tiny, caplog):
    caplog.set_level(logging.INFO)
    with serving(failing_engine()) as engine:
        upstream = str(engine.base_url).rstrip("/") + "/v1"
        with proxy_timing_out(upstream, 1.0) as proxy:
            statuses = {}
            for model in ("refuse", "broken", "hang"):
                caplog.clear()
                r = proxy.post("/v1/chat/completions", headers={"x-session-id": f"s-{model}"},
                               json={"model": model, "messages": [{"role": "user", "content": "hello"}]})
                statuses[model] = (r.status_code, *logged(caplog))
            caplog.clear()
            bad = proxy.post("/v1/chat/completions", content=b"{not json")
            statuses["bad"] = (bad.status_code, *logged(caplog))
    for model, (status, errors, access) in statuses.items():
        assert len(errors) == 1 and len(access) == 1, (model, [r.getMessage() for r in errors + access])
        a = access[0]
        assert (a.method, a.path, a.status) == ("POST", "/v1/chat/completions", status), model
        assert a.bytes > 0 and 0 < a.duration_s < 30 and a.levelno == logging.INFO
        assert a.session == (None if model == "bad" else f"s-{model}")
        assert a.getMessage().startswith(f"POST /v1/chat/completions {status} ")
    status, (refused,), _ = statuses["refuse"]
    assert status == 400 and refused.levelno == logging.WARNING and "max_tokens is too large" in refused.getMessage()
    status, (broken,), _ = statuses["broken"]
    assert status == 502 and broken.levelno == logging.ERROR and "the worker died" in broken.getMessage()
    status, (hung,), _ = statuses["hang"]
    assert status >= 500 and hung.levelno == logging.ERROR and "timeout" in hung.getMessage().lower()
    assert hung.getMessage().startswith(f"{status} POST /v1/chat/completions: ")
    status, (bad,), _ = statuses["bad"]
    assert status == 400 and bad.levelno == logging.WARNING and "not valid JSON" in bad.getMessage()


def test_a_stream_the_engine_breaks_off_or_stalls_is_one_error_line_with_its_cause(tiny, caplog):
    """A stream begun (200) that the engine cuts, or leaves silent past the time limit, ends with an
    error event; the log has one line that says so beside the access line."""
    caplog.set_level(logging.INFO)
    with serving(failing_engine()) as engine:
        with proxy_timing_out(str(engine.base_url).rstrip("/") + "/v1", 1.0) as proxy:
            seen = {}
            for model in ("breaks", "stalls"):
                caplog.clear()
                with proxy.stream("POST", "/v1/chat/completions", headers={"x-session-id": f"s-{model}"},
                                  json={"model": model, "stream": True,
                                        "messages": [{"role": "user", "content": "hello"}]}) as r:
                    text = r.read().decode()
                seen[model] = (r.status_code, text, *logged(caplog))
    for model, (status, text, errors, access) in seen.items():
        assert status == 200 and '"error"' in text, (model, text)
        assert len(errors) == 1 and errors[0].levelno == logging.ERROR, (model, [e.getMessage() for e in errors])
        assert errors[0].getMessage().startswith("the stream of POST /v1/chat/completions ended on an error: ")
        assert [(a.status, a.session) for a in access] == [(200, f"s-{model}")]
    assert "broke off" in seen["breaks"][2][0].getMessage()
    assert "timeout" in seen["stalls"][2][0].getMessage().lower()


def test_a_500_is_one_error_line_with_its_traceback_and_the_one_error_shape(tiny, caplog):
    """The device thread stopped under a running service: an ask raises (the guard answers 500 in
    the one error shape and logs its traceback once), and a completion's generation fails (the
    embedded engine answers 500 itself: one line with its cause)."""
    caplog.set_level(logging.INFO)
    with running() as (client, service):
        r = client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 2},
                        headers={"x-session-id": "s"})
        assert r.status_code == 200
        logged(caplog)  # its access line, written after its last byte went out, is in before the clear
        service.device.close()
        caplog.clear()
        asked = client.post("/v1/shadow/ask", json={"session": "s", "question": "A or B?", "choices": ["A", "B"]})
        failed, access = logged(caplog)
        caplog.clear()
        completion = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        generated, _ = logged(caplog)
    assert asked.status_code == 500 and asked.json()["error"]["type"] == "server_error"
    assert len(failed) == 1 and failed[0].levelno == logging.ERROR and failed[0].exc_info is not None
    assert "RuntimeError: the device thread has stopped" in failed[0].getMessage()
    assert [(a.path, a.status) for a in access] == [("/v1/shadow/ask", 500)]
    assert completion.status_code == 500
    assert len(generated) == 1 and generated[0].levelno == logging.ERROR
    assert "500 POST /v1/completions: RuntimeError: the device thread has stopped" in generated[0].getMessage()


def test_an_access_line_in_json_carries_its_fields():
    stream = io.StringIO()
    log = logging.getLogger("shadow.test.access")
    log.addHandler(logs.handler("json", stream))
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        log.info("GET /metrics 200 0.004 s 10 bytes", extra={"method": "GET", "path": "/metrics", "status": 200,
                                                            "duration_s": 0.004, "bytes": 10, "session": None})
    finally:
        log.handlers.clear()
    line = json.loads(stream.getvalue())
    assert {k: line[k] for k in ("method", "path", "status", "duration_s", "bytes")} == {
        "method": "GET", "path": "/metrics", "status": 200, "duration_s": 0.004, "bytes": 10}
    assert "session" not in line
