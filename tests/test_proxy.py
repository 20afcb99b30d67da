"""The proxy against an engine that behaves in scripted ways: a real FastAPI server on loopback
that answers in the documented OpenAI shapes, with its own headers, without usage, with events
the shadow cannot read, and breaking off mid-stream. What the client gets must never depend on
the shadow; every turn ends; what the shadow could not verify, it says."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serving import GRID, assert_exact, running, serving, settled
from shadow.text.chat_template import ChatRenderer, Template, default_hf_tokenizer

pytestmark = pytest.mark.slow  # real servers, engines or clients: `pytest -m 'not slow'` leaves them out

END = 248046


def scripted_engine(seen: list[dict], mode: dict) -> FastAPI:
    """An OpenAI-compatible engine whose behaviour `mode` sets: `usage` (bool), `broken` (stop the
    stream after two chunks by closing the connection), `junk` (events the shadow cannot read),
    `delay_s` (seconds before it answers)."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        raw = await request.body()
        body = json.loads(raw)
        seen.append({"headers": dict(request.headers), "body": body})
        if mode.get("delay_s"):  # the engine keeps the request waiting before it answers
            import asyncio

            await asyncio.sleep(mode["delay_s"])
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
        with running(upstream=url, dialect="openai", renderer=renderer(), require_exact=True,
                     predict=False) as (proxy, service):  # the reply as the engine wrote it, not a prediction
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


def test_a_turn_start_counts_unread_the_output_an_engine_never_showed_as_ids(tiny, tmp_path):
    """An engine that shows no output ids (its usage counts them): the shadow is never fed the
    output, the next prompt brings it. Until then the engine holds ids the shadow does not, so the
    session's next turn start counts them unread; a turn start after that prompt does not."""
    seen, mode = [], {"prompt_tokens": len(renderer().prompt_ids([{"role": "user", "content": "hi"}]))}
    journal = tmp_path / "journal.jsonl"
    with serving(scripted_engine(seen, mode)) as engine:
        url = str(engine.base_url).rstrip("/") + "/v1"
        with running(upstream=url, dialect="openai", renderer=renderer(), journal=journal) as (proxy, service):
            messages = [{"role": "user", "content": "hi"}]
            for _ in range(3):
                r = proxy.post("/v1/chat/completions", json={"messages": messages, "stream": True},
                               headers={"x-session-id": "n"})
                assert r.status_code == 200
                settled(service)
                messages = messages + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "hi"}]
                mode["prompt_tokens"] = len(renderer().prompt_ids(messages))
    turns = [json.loads(x) for x in journal.read_text().splitlines() if '"kind": "turn"' in x]
    assert [t["output_ids"] for t in turns] == [0, 0, 0]  # no output ids shown
    prompts = [t["prompt_ids"] for t in turns]
    assert prompts[2] < GRID  # nothing is read: what is unread is what the session holds
    assert [t["unread_at_start"] for t in turns] == [None, prompts[0] + 2, prompts[1] + 2]


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
        "sglang-2026": {"/model_info": {"model_path": "m", "served_model_name": "m", "is_generation": True}},
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
        assert name == want.split("-")[0], (want, name)


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


# an output is read only as the engine's own ids ---------------------------------------------

def trimming_renderer() -> ChatRenderer:
    """A template that writes each message's content trimmed, as many real templates do: the
    reply " Pago is here" comes back as "Pago is here", whose first id is another token."""
    template = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}"
                "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return ChatRenderer(Template(template, "trim.jinja"), default_hf_tokenizer())


def text_only_engine(renderer: ChatRenderer, seen: list[dict]) -> FastAPI:
    """An engine like `transformers serve`: text and `usage` only, no ids, no logprobs. It
    "generated" " Pago is here" and the end token; the ids it generated are shown beside, in a
    field no dialect reads (`x_generated_ids`), so the test knows them."""
    app = FastAPI()
    tok = renderer.tokenizer
    content = " Pago is here"
    generated = tok.encode(content, add_special_tokens=False) + [END]

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        seen.append(body)
        usage = {"prompt_tokens": len(renderer.prompt_ids(body["messages"])), "completion_tokens": len(generated)}
        if not body.get("stream"):
            return {"id": "c", "object": "chat.completion", "x_generated_ids": generated, "usage": usage,
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": content}}]}

        async def events():
            yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + "\n\n"
            yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": content}}]}) + "\n\n"
            yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                                         "x_generated_ids": generated}) + "\n\n"
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.mark.parametrize("stream", [False, True])
def test_an_output_whose_text_retokenises_to_the_same_count_and_other_ids_is_never_read(tiny, tmp_path, stream):
    """The case seen in front of `transformers serve`: the engine generated " Pago" (one id), the
    reply's text as the template writes it back starts "Pago" (another id), and the counts agree.
    An equal count is not equal ids: the output is not read, the turn is not verified (its
    output `not_read`, everywhere it is counted), no wrong id is in the session, and the next
    prompt brings the reply as the engine itself reads it."""
    r = trimming_renderer()
    generated = r.tokenizer.encode(" Pago is here", add_special_tokens=False) + [END]
    history = [{"role": "user", "content": "Who is there?"}]
    rewritten = r.encode(r.reply_text(history, {"role": "assistant", "content": " Pago is here"}, end="<|im_end|>"))
    assert len(rewritten) == len(generated) and rewritten != generated  # the trap: same count, other ids
    journal, seen = tmp_path / "journal.jsonl", []
    with serving(text_only_engine(r, seen)) as engine:
        url = str(engine.base_url).rstrip("/") + "/v1"
        with running(upstream=url, dialect="transformers", renderer=r, journal=journal,
                     predict=False) as (proxy, service):  # the output's own rule, without the next prompt predicted
            body = {"messages": history, "stream": stream}
            if stream:
                with proxy.stream("POST", "/v1/chat/completions", json=body, headers={"x-session-id": "pago"}) as resp:
                    text = resp.read().decode()
                assert "x_generated_ids" in text  # the client gets what the engine sent
            else:
                resp = proxy.post("/v1/chat/completions", json=body, headers={"x-session-id": "pago"})
                assert resp.json()["x_generated_ids"] == generated
            settled(service)
            prompt = r.prompt_ids(history)
            with service.state_lock:
                held = list(service.store.get("pago").ids)
            assert held == prompt  # the prompt, and no id of the reply: neither 79389 ("Pago") nor any other
            record = [x for x in map(json.loads, journal.read_text().splitlines()) if x.get("kind") == "turn"][-1]
            assert record["verified"] is not True and record["output_check"] == "not_read"
            assert record["prompt_check"] == "verified" and record["output_verified"] is None
            assert any("not re-tokenised" in x for x in record["reasons"])
            status = proxy.get("/v1/shadow/status").json()
            assert status["counters"]["turn_parts"]["output"] == {"verified": 0, "unverified": 0, "mismatched": 0,
                                                                  "not_read": 1}
            checks = next(s for s in status["sessions"] if s["name"] == "pago")["id_checks"]
            assert checks["turns_verified"] == 0 and checks["outputs"]["not_read"] == 1
            assert checks["prompts"]["verified"] == 1 and checks["exact"] is True  # every id it holds is verified
            answer = proxy.post("/v1/shadow/ask", json={"session": "pago", "question": "A or B?",
                                                        "choices": ["A", "B"]}).json()
            assert answer["exact"] is True and answer["id_checks"]["outputs"]["not_read"] == 1
            # the next turn: the reply as the client sends it back, read as the engine's template renders it
            history2 = history + [{"role": "assistant", "content": " Pago is here"},
                                  {"role": "user", "content": "And?"}]
            proxy.post("/v1/chat/completions", json={"messages": history2}, headers={"x-session-id": "pago"})
            settled(service)
            with service.state_lock:
                held = list(service.store.get("pago").ids)
            assert held == r.prompt_ids(history2) and 79389 in held and 233154 not in held  # what the engine read


# a bad engine and bad clients: numbers of thousands of digits, nesting 100,000 deep -----------

HUGE = b"9" * 5000
DEEP = b"[" * 100_000 + b"]" * 100_000
WHOLE_BODIES = {
    "digits": b'{"id": "c", "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, '
              b'"finish_reason": "stop"}], "usage": {"prompt_tokens": ' + HUGE + b', "completion_tokens": 2}}',
    "deep": b'{"id": "c", "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, '
            b'"finish_reason": "stop", "x": ' + DEEP + b'}]}',
    "float": b'{"id": "c", "choices": [], "x": 0.' + HUGE + b'}',
}


def bad_engine() -> FastAPI:
    """An engine that sends what no engine should: the body `WHOLE_BODIES[mode]` whole, or as one
    event between good ones in a stream (the mode is the request's `model`)."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = json.loads(await request.body())
        bad = WHOLE_BODIES[body["model"]]
        if not body.get("stream"):
            return Response(bad, media_type="application/json")

        async def events():
            yield b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "o"}}]}\n\n'
            yield b"data: " + bad + b"\n\n"
            yield b'data: {"choices": [{"index": 0, "delta": {"content": "k"}, "finish_reason": "stop"}]}\n\n'
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.mark.parametrize("mode", sorted(WHOLE_BODIES))
def test_a_bad_engine_body_reaches_the_client_as_sent_and_every_turn_ends(tiny, mode):
    with serving(bad_engine()) as engine:
        url = str(engine.base_url).rstrip("/") + "/v1"
        with running(upstream=url, dialect="openai", renderer=renderer()) as (proxy, service):
            body = {"model": mode, "messages": [{"role": "user", "content": "hi"}]}
            r = proxy.post("/v1/chat/completions", json=body, headers={"x-session-id": f"whole-{mode}"})
            assert r.status_code == 200 and r.content == WHOLE_BODIES[mode]  # the engine's bytes, unread
            with proxy.stream("POST", "/v1/chat/completions", json=body | {"stream": True},
                              headers={"x-session-id": f"stream-{mode}"}) as s:
                text = s.read()
            assert s.status_code == 200 and b"data: " + WHOLE_BODIES[mode] + b"\n\n" in text
            assert b'"content": "k"' in text and text.endswith(b"data: [DONE]\n\n")  # the stream went on
            settled(service)
            status = proxy.get("/v1/shadow/status").json()
            assert status["turns_in_flight"] == 0 and status["overdue_turns"] == []
            assert service.checks[f"whole-{mode}"].turns == 1 and service.checks[f"stream-{mode}"].turns == 1
            service.device.run(lambda: None)  # the device thread still answers


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/shadow/ask"])
def test_a_client_body_with_a_huge_number_or_deep_nesting_is_a_400_that_begins_no_turn(scripted, path):
    proxy, service, seen, _ = scripted
    before, sent = service.status()["counters"]["requests"], len(seen)
    for raw in (b'{"messages": [{"role": "user", "content": "x"}], "prompt": "x", "max_tokens": ' + HUGE + b"}",
                b'{"messages": [{"role": "user", "content": "x"}], "prompt": "x", "max_tokens": 1.' + HUGE + b"}",
                b'{"messages": ' + DEEP + b"}", b'{"session": "s", "question": "q", "choices": ' + DEEP + b"}",
                '{"messages": [{"role": "user", "content": "x"}], "prompt": "x"}'.encode("utf-16"),
                b'{"messages": [{"role": "user", "content": "\xff"}], "prompt": "\xff"}'):
        r = proxy.post(path, content=raw)
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type"}, (path, r.text[:300])
    assert service.status()["counters"]["requests"] == before and len(seen) == sent  # nothing began, nothing sent


def test_a_streamed_turn_whose_client_went_away_before_the_stream_started_ends(tiny):
    """The engine answers after 1.5 s; the client hangs up after 0.3 s, before the proxy returns
    its stream: the stream's generator never starts, and the turn still ends."""
    import socket

    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        import asyncio

        await asyncio.sleep(1.5)

        async def events():
            yield 'data: {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": "stop"}]}\n\n'
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    with serving(app) as engine:
        url = str(engine.base_url).rstrip("/") + "/v1"
        with running(upstream=url, dialect="openai", renderer=renderer(), status_channel="off") as (proxy, service):
            body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
            host, port = proxy.base_url.host, proxy.base_url.port
            with socket.create_connection((host, port)) as conn:
                conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"x-session-id: early\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                time.sleep(0.3)
            deadline = time.time() + 30
            while time.time() < deadline and (service.turns or "early" not in service.checks):
                time.sleep(0.05)
            assert not service.turns and service.status()["turns_in_flight"] == 0
            assert service.checks["early"].turns == 1  # its check recorded: nothing of the reply read
            assert service.checks["early"].parts["output"]["not_read"] == 1


class GoneAtFirstByte:
    """Around the app: a request marked `x-gone: 1` has a client that went away before the first
    byte of the response, as an ASGI server of spec 2.4 reports it (`send` raises OSError), so a
    streamed response's generator never starts."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or (b"x-gone", b"1") not in scope.get("headers", []):
            return await self.app(scope, receive, send)
        scope = dict(scope, asgi={**scope.get("asgi", {}), "spec_version": "2.4"})

        async def gone(message):
            if message["type"] == "http.response.start":
                raise OSError("the client has gone")
            await send(message)

        try:
            await self.app(scope, receive, gone)
        except Exception:  # noqa: BLE001 - the client is gone: whatever the app raised, answer the test's client
            pass
        await send({"type": "http.response.start", "status": 499, "headers": []})
        await send({"type": "http.response.body", "body": b""})


@pytest.mark.parametrize("channel", ["off", "reasoning"])
def test_a_streamed_turn_whose_stream_never_started_ends(tiny, channel):
    """A streamed response whose client is gone before its first byte (its generator never runs,
    nor its `finally`): the turn still ends, with its check recorded. With status lines on, the
    engine keeps the request waiting past the first line's time, so the stream is opened before
    the engine answered (and the request to it is given up)."""
    seen: list = []
    with serving(scripted_engine(seen, {"delay_s": 2.0 if channel != "off" else 0})) as engine:
        url = str(engine.base_url).rstrip("/") + "/v1"
        with running(upstream=url, dialect="openai", renderer=renderer(), wrap=GoneAtFirstByte,
                     status_channel=channel) as (proxy, service):
            r = proxy.post("/v1/chat/completions", headers={"x-session-id": "never", "x-gone": "1"},
                           json={"messages": [{"role": "user", "content": "hi"}], "stream": True})
            assert r.status_code == 499
            deadline = time.time() + 30
            while time.time() < deadline and (service.turns or "never" not in service.checks):
                time.sleep(0.05)
            assert not service.turns and service.status()["turns_in_flight"] == 0
            assert service.checks["never"].turns == 1


def test_a_turn_in_flight_past_the_engines_timeout_shows_in_status(tiny, caplog):
    """The watchdog: a stream that lasts longer than the engine's timeout (each read within it)
    is listed under `overdue_turns` while it lasts, logged once, and gone when it ends."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        import asyncio

        async def events():
            for _ in range(12):
                await asyncio.sleep(0.25)
                yield 'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    with serving(app) as engine:
        url = str(engine.base_url).rstrip("/") + "/v1"
        with running(upstream=url, dialect="openai", renderer=renderer(), engine_timeout_s=1.0) as (proxy, service):
            overdue = []
            with caplog.at_level("WARNING"):
                with proxy.stream("POST", "/v1/chat/completions", headers={"x-session-id": "slow"},
                                  json={"messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
                    for line in r.iter_lines():
                        if not overdue:
                            overdue = proxy.get("/v1/shadow/status").json()["overdue_turns"]
                settled(service)
            assert overdue and overdue[0]["session"] == "slow" and overdue[0]["age_s"] >= 1.0
            assert proxy.get("/v1/shadow/status").json()["overdue_turns"] == []
            assert sum("longer than the engine's timeout" in rec.getMessage() for rec in caplog.records) == 1


def test_an_ask_about_a_session_whose_template_failed_says_why_it_is_not_exact(tiny):
    seen, mode = [], {}
    bad = ChatRenderer(Template("{{ raise_exception('no such role') }}", "bad.jinja"), default_hf_tokenizer())
    with serving(scripted_engine(seen, mode)) as engine:
        url = str(engine.base_url).rstrip("/") + "/v1"
        for require_exact in (False, True):
            with running(upstream=url, dialect="openai", renderer=bad, require_exact=require_exact) as (proxy, service):
                proxy.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                           headers={"x-session-id": "t"})
                settled(service)
                r = proxy.post("/v1/shadow/ask", json={"session": "t", "question": "A or B?", "choices": ["A", "B"]})
                assert r.status_code == (409 if require_exact else 200), r.text
                answer = r.json()
                assert answer["exact"] is False and "holds no ids" in answer["why_not"]
                assert "no such role" in answer["why_not"]
                if not require_exact:
                    assert answer["id_checks"]["prompts"]["not_read"] == 1


def test_the_stream_never_waits_for_a_hand_over_to_the_shadow(tiny):
    """A hand-over between events held as long as the test likes: the client gets its whole
    stream meanwhile, the turn's end waits for the hand-over, and then the session holds the
    engine's prompt and output, verified, its state bit-equal to a fresh prefill."""
    with running() as (engine, _), running(upstream=str(engine.base_url).rstrip("/") + "/v1") as (proxy, service):
        entered, release, returned = threading.Event(), threading.Event(), threading.Event()
        feed_due = service.feed_due

        def held_back(turn, *, wait, share):
            if not wait and not entered.is_set():  # the first hand-over between events
                entered.set()
                release.wait(30)
                try:
                    return feed_due(turn, wait=wait, share=share)
                finally:
                    returned.set()
            return feed_due(turn, wait=wait, share=share)

        service.feed_due = held_back
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 12, "stream": True,
                "ignore_eos": True, "min_tokens": 12, "return_token_ids": True}
        with proxy.stream("POST", "/v1/chat/completions", json=body, headers={"x-session-id": "beside"}) as r:
            tokens = sum(1 for line in r.iter_lines() if '"token_ids": [' in line and '"token_ids": []' not in line)
        assert tokens == 12 and entered.is_set() and not returned.is_set()
        assert service.turns  # its end waits for the hand-over in flight
        release.set()
        settled(service)
        status = proxy.get("/v1/shadow/status").json()
        assert status["counters"]["turn_parts"]["prompt"]["verified"] == 1
        assert status["counters"]["turn_parts"]["output"]["verified"] == 1
        with service.state_lock:
            assert len(service.store.get("beside").ids) > 12
        assert_exact(service, "beside")



def test_a_turn_start_counts_unread_the_output_of_a_response_whose_end_is_still_under_way(tiny, tmp_path):
    """A session's next request can come before the shadow was fed the last response's output (its
    end waits for the device). The engine holds that output, so the turn start counts it unread
    (the replay's turn starts fresh): the journal's `unread_at_start` is the prompt unread plus
    every output id the engine streamed."""
    journal = tmp_path / "journal.jsonl"
    with running() as (engine, _), \
            running(upstream=str(engine.base_url).rstrip("/") + "/v1", journal=journal) as (proxy, service):
        entered, release = threading.Event(), threading.Event()
        feed_due = service.feed_due

        def end_held(turn, *, wait, share):
            if not wait and turn.shown.fed_prompt is not None and not entered.is_set():
                return False  # as a busy device answers a hand-over between events: the output waits
            if wait and not entered.is_set():  # the first turn's end: held until the next request came
                entered.set()
                release.wait(30)
            return feed_due(turn, wait=wait, share=share)

        service.feed_due = end_held
        first = [{"role": "user", "content": "hello"}]
        body = {"messages": first, "max_tokens": 12, "stream": True, "ignore_eos": True, "min_tokens": 12,
                "return_token_ids": True}
        with proxy.stream("POST", "/v1/chat/completions", json=body, headers={"x-session-id": "u"}) as r:
            text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                           for line in r.iter_lines() if line.startswith("data: {") and '"choices": [{' in line)
        assert entered.wait(30)
        nxt = first + [{"role": "assistant", "content": text}, {"role": "user", "content": "and?"}]
        second = threading.Thread(target=lambda: proxy.post("/v1/chat/completions", json={
            "messages": nxt, "max_tokens": 2}, headers={"x-session-id": "u"}))
        second.start()
        deadline = time.time() + 30
        while len(service.turns) < 2 and time.time() < deadline:
            time.sleep(0.01)
        release.set()
        second.join(60)
        settled(service)
    turns = [json.loads(x) for x in journal.read_text().splitlines() if '"kind": "turn"' in x]
    assert len(turns) == 2 and turns[0]["output_ids"] == 12 and turns[0]["prompt_ids"] + 12 < GRID
    assert turns[1]["unread_at_start"] == turns[0]["prompt_ids"] + 12  # nothing read: under a grid


def test_a_turns_end_waits_for_its_latest_hand_over_not_an_earlier_ones_callback():
    """A task's done callbacks run a loop step after `done()` turns true, so the relay can start the
    next hand-over before the previous one's callback has run. That late callback must not mark the
    turn's hand-overs idle while the next one is in flight: the turn's end would then feed the same
    output beside it (its ids taken twice)."""
    from concurrent.futures import Future

    from shadow.server.http.proxy import Proxy
    from shadow.server.http.proxy_turn import ProxiedTurn
    from shadow.server.turn import ServedTurn, Shown

    async def scenario() -> list[bool]:
        proxy = Proxy.__new__(Proxy)  # only the hand-over bookkeeping: no engine, no service
        proxy._feeds = set()
        release = {1: asyncio.Event(), 2: asyncio.Event()}
        calls = []

        async def feed(proxied) -> float:  # a hand-over that ends when the scenario lets it
            calls.append(len(calls) + 1)
            await release[len(calls)].wait()
            return 0.0

        proxy._feed = feed
        proxied = ProxiedTurn(ServedTurn(id=1, started=0.0, shown=Shown()), {}, True, "s", Future())
        idle, seen = proxied.turn.shown.feed_idle, []
        first = proxy._feed_beside(proxied)
        await asyncio.sleep(0)
        seen.append(idle.is_set())  # in flight
        release[1].set()
        while not first.done():
            await asyncio.sleep(0)
        second = proxy._feed_beside(proxied)  # as the relay does: the first is done, its callback not run yet
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        seen.append(idle.is_set())  # the first's callback has run; the second is in flight
        release[2].set()
        await second
        await asyncio.sleep(0)
        seen.append(idle.is_set())
        return seen

    assert asyncio.run(scenario()) == [False, False, True]
