"""The proxy against an engine that behaves in scripted ways: a real FastAPI server on loopback
that answers in the documented OpenAI shapes, with its own headers, without usage, with events
the shadow cannot read, and breaking off mid-stream. What the client gets must never depend on
the shadow; every turn ends; what the shadow could not verify, it says."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from serving import running, serving, settled
from shadow.text.chat_template import ChatRenderer, Template, default_hf_tokenizer

END = 248046


def scripted_engine(seen: list[dict], mode: dict) -> FastAPI:
    """An OpenAI-compatible engine whose behaviour `mode` sets: `usage` (bool), `broken` (stop the
    stream after two chunks by closing the connection), `junk` (events the shadow cannot read)."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        raw = await request.body()
        body = json.loads(raw)
        seen.append({"headers": dict(request.headers), "body": body})
        headers = {"x-request-id": "req-42", "cache-control": "no-store", "x-engine": "scripted"}
        if mode.get("refuse_logprobs") and "logprobs" in body:
            return JSONResponse({"error": {"message": "logprobs is not supported", "type": "invalid_request_error"}},
                                status_code=400)
        usage = {"prompt_tokens": mode.get("prompt_tokens", 5), "completion_tokens": 2, "total_tokens": 7}
        if not body.get("stream"):
            out = {"id": "c", "object": "chat.completion",
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}
            if mode.get("usage", True):
                out["usage"] = usage
            return JSONResponse(out, headers=headers)

        async def events():
            yield 'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
            if mode.get("junk"):
                yield 'data: {"choices": "not a list"}\n\n'
                yield 'data: {"choices": [{"index": 0, "delta": {"content": 5}, "token_ids": ["x"]}]}\n\n'
                yield "data: {not json\n\n"
                yield ": a comment line\n\n"
            yield 'data: {"choices": [{"index": 0, "delta": {"content": "o"}}]}\n\n'
            if mode.get("broken"):
                raise RuntimeError("the engine died mid-stream")
            yield 'data: {"choices": [{"index": 0, "delta": {"content": "k"}, "finish_reason": "stop"}]}\n\n'
            if mode.get("usage", True) and (body.get("stream_options") or {}).get("include_usage"):
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    return app


def renderer() -> ChatRenderer:
    template = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
                "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
    return ChatRenderer(Template(template, "test.jinja"), default_hf_tokenizer())


@pytest.fixture()
def scripted(tiny):
    seen: list[dict] = []
    mode: dict = {}
    with serving(scripted_engine(seen, mode)) as engine:
        url = str(engine.base_url).rstrip("/") + "/v1"
        with running(upstream=url, dialect="openai", renderer=renderer()) as (proxy, service):
            yield proxy, service, seen, mode


def test_headers_pass_both_ways_and_the_proxy_sends_json(scripted):
    proxy, service, seen, _ = scripted
    # curl -d sends form-urlencoded; the engine still gets JSON, with the client's credentials
    r = proxy.post("/v1/chat/completions", content=json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
                   headers={"content-type": "application/x-www-form-urlencoded", "authorization": "Bearer k",
                            "x-session-id": "h", "x-request-id": "client-7"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
    assert r.headers["x-request-id"] == "req-42" and r.headers["cache-control"] == "no-store"
    assert r.headers["x-engine"] == "scripted" and r.headers["x-shadow-session"] == "h"
    sent = seen[-1]["headers"]
    assert sent["content-type"] == "application/json" and sent["authorization"] == "Bearer k"
    assert "logprobs" in seen[-1]["body"] and "logprobs" not in r.json()["choices"][0]  # asked, then stripped
    settled(service)


def test_a_stream_is_relayed_as_sent_less_only_what_the_proxy_added(scripted):
    proxy, service, seen, _ = scripted
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    with proxy.stream("POST", "/v1/chat/completions", json=body, headers={"x-session-id": "s"}) as r:
        text = r.read().decode()
    assert seen[-1]["body"]["stream_options"] == {"include_usage": True}  # the proxy asked for usage
    assert '"usage"' not in text and text.endswith("data: [DONE]\n\n")  # and the client did not get it
    assert '"content": "o"' in text and '"content": "k"' in text
    settled(service)
    record = service.status()["sessions"]
    assert [s["name"] for s in record] == ["s"]


def test_without_usage_the_turn_is_unverified_and_asks_say_so(scripted):
    proxy, service, _, mode = scripted
    mode["usage"] = False
    r = proxy.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi " * 200}]},
                   headers={"x-session-id": "nousage"})
    assert r.status_code == 200 and "usage" not in r.json()
    settled(service)
    row = next(s for s in proxy.get("/v1/shadow/status").json()["sessions"] if s["name"] == "nousage")
    assert row["id_checks"]["exact"] is False and row["id_checks"]["turns_unverified"] == 1
    answer = proxy.post("/v1/shadow/ask", json={"session": "nousage", "question": "A or B?", "choices": ["A", "B"]})
    assert answer.status_code == 200 and answer.json()["exact"] is False
    assert "usage" in answer.json()["why_not"]


def test_require_exact_refuses_asks_on_unverified_sessions(tiny):
    seen, mode = [], {"usage": False}
    with serving(scripted_engine(seen, mode)) as engine:
        url = str(engine.base_url).rstrip("/") + "/v1"
        with running(upstream=url, dialect="openai", renderer=renderer(), require_exact=True) as (proxy, service):
            proxy.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                       headers={"x-session-id": "u"})
            settled(service)
            r = proxy.post("/v1/shadow/ask", json={"session": "u", "question": "A or B?", "choices": ["A", "B"]})
            assert r.status_code == 409 and r.json()["error"]["type"] == "not_exact"
            mode["usage"] = True  # and counts that are right: "ok" and the end token
            mode["prompt_tokens"] = len(renderer().prompt_ids([{"role": "user", "content": "hi"}]))
            proxy.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                       headers={"x-session-id": "v"})
            settled(service)
            r = proxy.post("/v1/shadow/ask", json={"session": "v", "question": "A or B?", "choices": ["A", "B"]})
            assert r.status_code == 200 and r.json()["exact"] is True


def test_events_the_shadow_cannot_read_reach_the_client_untouched(scripted):
    proxy, service, _, mode = scripted
    mode["junk"] = True
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}}  # the client asked: nothing is added, nothing rewritten
    with proxy.stream("POST", "/v1/chat/completions", json=body, headers={"x-session-id": "junk"}) as r:
        text = r.read().decode()
    assert 'data: {"choices": "not a list"}' in text and "data: {not json" in text and ": a comment line" in text
    assert '"usage"' in text
    settled(service)
    checks = service.checks["junk"]
    assert checks.verified + checks.unverified + checks.mismatched == 1


def test_an_engine_that_breaks_off_mid_stream_ends_the_turn_and_tells_the_client(scripted):
    proxy, service, _, mode = scripted
    mode["broken"] = True
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    with proxy.stream("POST", "/v1/chat/completions", json=body, headers={"x-session-id": "broken"}) as r:
        text = r.read().decode()
    assert '"content": "o"' in text and "upstream_error" in text
    settled(service)
    assert service.status()["turns_in_flight"] == 0


def test_a_client_that_disconnects_mid_stream_ends_its_turn(tiny, caplog):
    """The client goes away after the first chunk; the turn ends and nothing is logged as an error."""
    seen, mode = [], {}
    app = scripted_engine(seen, mode)

    @app.post("/v1/slow/chat/completions")
    async def slow(request: Request):
        async def events():
            yield 'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
            for _ in range(50):
                import asyncio

                await asyncio.sleep(0.1)
                yield 'data: {"choices": [{"index": 0, "delta": {"content": "b"}}]}\n\n'
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    with serving(app) as engine:
        url = str(engine.base_url).rstrip("/") + "/v1/slow"
        with running(upstream=url, dialect="openai", renderer=renderer()) as (proxy, service):
            with caplog.at_level("ERROR"):
                with proxy.stream("POST", "/v1/chat/completions", headers={"x-session-id": "gone"},
                                  json={"messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data:"):
                            break  # and close the connection
                deadline = time.time() + 20
                while service.turns and time.time() < deadline:
                    time.sleep(0.05)
                assert not service.turns
            assert not [rec for rec in caplog.records if rec.levelname in ("ERROR", "CRITICAL")]


def test_a_template_that_raises_passes_the_request_and_says_why(tiny):
    seen, mode = [], {}
    bad = ChatRenderer(Template("{{ raise_exception('no such role') }}", "bad.jinja"), default_hf_tokenizer())
    with serving(scripted_engine(seen, mode)) as engine:
        url = str(engine.base_url).rstrip("/") + "/v1"
        with running(upstream=url, dialect="openai", renderer=bad) as (proxy, service):
            r = proxy.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                           headers={"x-session-id": "t"})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
            settled(service)
            checks = service.checks["t"]
            assert checks.unverified == 1 and any("no such role" in x for x in checks.last_reasons)


def test_an_unreachable_engine_mid_body_gives_502(tiny):
    """A non-streamed response cut short: 502 with the error shape, and the turn ends."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        async def cut():
            yield b'{"choices": ['
            raise RuntimeError("gone")

        return StreamingResponse(cut(), media_type="application/json")

    with serving(app) as engine:
        url = str(engine.base_url).rstrip("/") + "/v1"
        with running(upstream=url, dialect="openai", renderer=renderer()) as (proxy, service):
            r = proxy.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"
            settled(service)
            assert service.status()["turns_in_flight"] == 0


def test_probe_recognises_each_engine_by_its_own_endpoints(tiny):
    from shadow.engines.dialects import probe

    shapes = {
        "llamacpp": {"/props": {"default_generation_settings": {}, "build_info": "b1-x"}},
        "sglang": {"/get_model_info": {"model_path": "m", "tokenizer_path": "m", "is_generation": True}},
        "vllm": {"/version": {"version": "0.21.0"}},
        "transformers": {"/openapi.json": {"paths": {"/load_model": {}, "/v1/responses": {}}}},
        "openai": {},
    }
    for want, routes in shapes.items():
        app = FastAPI(openapi_url=None)
        app.add_api_route("/v1/models", lambda: {"data": []}, methods=["GET"])
        for path, doc in routes.items():
            app.add_api_route(path, (lambda d: (lambda: d))(doc), methods=["GET"])
        with serving(app) as engine, httpx.Client() as client:
            name, _ = probe(client, str(engine.base_url).rstrip("/") + "/v1")
        assert name == want, (want, name)


def test_an_engine_that_refuses_what_the_proxy_adds_gets_the_clients_request(scripted):
    """The engine answers 400 to a field the proxy added (llama.cpp: logprobs with tools on a
    stream): the request goes again exactly as the client sent it, and the client gets the answer."""
    proxy, service, seen, mode = scripted
    mode["refuse_logprobs"] = True
    body = {"messages": [{"role": "user", "content": "hi"}]}
    r = proxy.post("/v1/chat/completions", json=body, headers={"x-session-id": "refused"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
    assert "logprobs" in seen[-2]["body"] and seen[-1]["body"] == body  # the second as the client sent it
    settled(service)
    checks = service.checks["refused"]  # the scripted engine's usage is not this template's count: flagged
    assert checks.verified + checks.unverified + checks.mismatched == 1
