"""Status lines: the templates, the framing and its stripping, one turn's timeline (pure, a clock
passed in), each channel's events; then through the proxy in front of a slow engine on loopback
and through the embedded engine, in every channel, and a client that echoes the lines back."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from fastapi import FastAPI, Request

from serving import long_text, running, scripted_stream, serving, settled
from shadow.text.chat_template import ChatRenderer, Template, default_hf_tokenizer
from shadow.server.http.channels import Channel, LineWriter, choose, client_kind
from shadow.core.turns import TurnTable
from shadow.server.http.lines import TurnStatus, reading_line, tool_action, waited_line, waiting_line
from shadow.server.load import EngineLoad
from shadow.server.turn import ServedTurn, Shown
from shadow.text.framing import MARK, frame, frame_title, strip_lines, strip_request

pytestmark = pytest.mark.slow  # real servers, engines or clients: `pytest -m 'not slow'` leaves them out


# pure --------------------------------------------------------------------------------------

def test_templates_say_facts_with_numbers():
    assert waiting_line(1, 40.2) == "waiting: another request is running, position 1, about 40 s"
    assert reading_line(20745, 17.6, 3.0) == "reading 20,745 tokens, about 18 s left"
    assert reading_line(None, None, 4.2) == "reading the prompt, 4 s so far"
    assert reading_line(60374, None, 20.4) == "reading 60,374 tokens, 20 s so far"  # no rate measured yet
    assert waited_line(12874, 14.3) == "Read 12,874 tokens in 14 s"
    assert tool_action("write", '{"filePath": "/src/render.js", "content": "a\\nb\\nc') == ("writing", "render.js", 3)
    assert tool_action("bash", '{"command": "pytest -x tests"}') == ("running", "pytest", None)
    assert tool_action("read_file", '{"path": "setup.py"') == ("calling read_file", "setup.py", None)


def test_every_framed_line_is_found_and_taken_out_exactly():
    said = [frame("reading 20,745 tokens, about 18 s left"), frame_title("thinking 25 s"),
            frame("weird \u2063 marks\ninside")]
    text = "Before. " + said[0] + "middle " + said[1] + " after" + said[2] + "end"
    assert strip_lines(text) == "Before. middle  afterend"
    body = {"messages": [
        {"role": "user", "content": "plain"},
        {"role": "assistant", "content": said[0] + "The answer.", "reasoning_content": said[1] + "I think."},
        {"role": "user", "content": [{"type": "text", "text": "a" + said[2]}, {"type": "image_url"}]}],
        "tools": [{"type": "function"}]}
    clean, n = strip_request(body)
    assert n == 3 and clean["messages"][1] == {"role": "assistant", "content": "The answer.", "reasoning_content": "I think."}
    assert clean["messages"][2]["content"] == [{"type": "text", "text": "a"}, {"type": "image_url"}]
    assert clean["tools"] == body["tools"] and MARK in json.dumps(body, ensure_ascii=False)  # the client's body is untouched
    assert strip_request({"messages": [{"role": "user", "content": "no lines"}]})[1] == 0


def test_one_turn_says_nothing_for_short_work_and_each_line_at_its_moment():
    s = TurnStatus(started=100.0, new_tokens=20000, rate=1000.0)
    assert s.tick(101.0) == []  # quiet for 1.5 s
    (line,) = s.tick(101.6)
    assert (line.kind, line.text) == ("reading", "reading 20,000 tokens, about 18 s left")
    assert s.tick(105.0) == []  # progress every 10 s, not every tick
    assert s.tick(111.7)[0].text == "reading 20,000 tokens, about 8 s left"
    (waited,) = s.on_delta(120.0, "reasoning")
    assert waited.kind == "waited" and waited.text == "Read 20,000 tokens in 20 s"
    assert s.tick(134.0) == []
    assert [x.text for x in s.tick(135.0)] == ["thinking 15 s"]  # from 15 s, then every 25 s
    assert [x.text for x in s.tick(160.0)] == ["thinking 40 s"]
    (decided,) = s.on_delta(161.0, "tool", ("write", '{"filePath": "a/render.js", "content": "x'))
    assert decided.kind == "decided" and decided.text == "thought 41 s" and decided.needs_phrase  # the voice's, or none
    assert [x.text for x in s.on_delta(163.0, "tool", ("write", '{"filePath": "a/render.js", "content": "x\\ny'))] \
        == ["writing render.js, 2 lines so far"]
    assert [x.kind for x in s.on_delta(170.0, "end")] == ["checking"]
    quick = TurnStatus(started=0.0, new_tokens=100, rate=1000.0)
    assert quick.on_delta(0.5, "content") == [] and quick.tick(30.0) == []  # a short turn says nothing


def test_the_wait_between_ticks_ends_when_the_next_line_is_due():
    s = TurnStatus(started=100.0, new_tokens=20000, rate=1000.0, quiet_s=0.2, progress_every_s=0.5)
    assert s.until_due(100.05) == pytest.approx(0.15)  # the first line at quiet_s, not a second later
    assert s.until_due(99.0, most=0.3) == 0.3 and s.until_due(100.3) == 0.01  # capped; overdue: at once
    s.tick(100.2)
    assert s.until_due(100.3) == pytest.approx(0.4)  # the next progress line
    s.on_delta(101.0, "content")
    assert s.until_due(101.0) == 1.0  # nothing is due: the caller's own cadence


def test_a_request_behind_others_is_told_its_position():
    turns = TurnTable()
    load = EngineLoad(turns, slots=1)
    one, two, three = (turns.add(ServedTurn(k, float(k))) for k in (1, 2, 3))
    load.sent(one, 0.0, 10000)
    load.first_token(one, 10.0)  # measured: 1,000 tokens a second
    load.answered(one)
    load.sent(two, 20.0, 5000)
    load.sent(three, 21.0, 3000)
    assert load.ahead(two, 21.0) == [] and load.ahead(three, 22.0) == [3.0]  # 2 reads first: 5 s from 20.0
    s = TurnStatus(started=21.0, new_tokens=3000, rate=load.rate, ahead=load.ahead(three, 23.0))
    assert s.tick(23.0)[0].text == "waiting: another request is running, position 1, about 5 s"


def test_channels_carry_a_line_as_their_client_renders_it():
    s = TurnStatus(started=0.0, new_tokens=300, rate=100.0)
    (line,) = s.tick(2.0)
    like = {"id": "chatcmpl-1", "created": 5, "model": "m"}
    (ev,) = Channel("reasoning").events(line, like)
    assert ev["choices"][0]["delta"] == {"reasoning_content": frame(line.text)} and ev["id"] == "chatcmpl-1"
    (ev,) = Channel("content").events(line, like)
    assert ev["choices"][0]["delta"] == {"content": frame(line.text)}
    close, title = Channel("inline").events(line, like)
    assert close["choices"][0]["delta"] == {"tool_calls": []}
    assert title["choices"][0]["delta"] == {"reasoning_content": frame_title(line.text)}
    (ev,) = Channel("reasoning", status_events=True).events(line, like)
    assert ev == {"event": {"type": "status", "data": {"description": line.text, "done": False}}}
    assert choose("auto", {"x-openwebui-chat-id": "c"}) == Channel("reasoning", True)
    assert choose("auto", {"user-agent": "opencode/1.18.33 ai-sdk/provider-utils/4.0.23"}) == Channel("inline")
    assert choose("auto", {}) == Channel("off") and not Channel("off").on
    assert client_kind({"x-session-affinity": "ses_1"}) == "opencode"


def test_the_reading_line_counts_the_ids_new_to_the_engine_even_once_the_shadow_holds_them():
    """Under load the shadow may take a turn's prompt in before its first line is written: the
    line still counts the ids the engine had to read (those the session held before the feed)."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from shadow.server.http.proxy_turn import Lines

    turns = TurnTable()
    turn = turns.add(ServedTurn(1, 0.0, shown=Shown()))
    before = Future()
    before.set_result(SimpleNamespace(ids=list(range(306))))
    held_now = lambda ids: len(ids)  # noqa: E731 - the session holds the whole prompt by now
    turn.shown.engine_cached = 6  # what it held when the prompt was fed
    lines = Lines(Channel("reasoning"), TurnStatus(started=0.0), EngineLoad(turns), turn, before, held_now)
    lines.refresh(2.0)
    assert lines.status.new_tokens == 300 and turn.new_tokens == 300
    fresh = turns.add(ServedTurn(2, 0.0, shown=Shown()))  # not fed yet: what the session holds now is the engine's
    lines = Lines(Channel("reasoning"), TurnStatus(started=0.0), EngineLoad(turns), fresh, before, lambda ids: 100)
    lines.refresh(2.0)
    assert lines.status.new_tokens == 206


def test_inline_lines_close_their_part_before_the_models_reasoning():
    turns = TurnTable()
    turn = turns.add(ServedTurn(1, 0.0))
    writer = LineWriter(Channel("inline"), TurnStatus(started=0.0, new_tokens=10, rate=1.0), EngineLoad(turns), turn)
    sent = writer.encode(writer.due(2.0))
    assert len(sent) == 2 and writer.open_part
    assert writer.encode(writer.before_delta(3.0, "reasoning")) == []
    (close,) = writer.resume("reasoning")
    assert json.loads(close[6:])["choices"][0]["delta"] == {"tool_calls": []} and not writer.open_part
    assert writer.resume("reasoning") == []


# through the proxy, in front of a slow engine ---------------------------------------------------------------

def slow_engine(seen: list[dict], delay_s: float) -> FastAPI:
    """An engine whose first token takes `delay_s`, then reasoning, a content piece, usage."""
    return scripted_stream([(delay_s, {"reasoning_content": "hm"}, None), (0, {"content": "ok"}, None),
                            (0, {}, "stop")], seen)


def renderer() -> ChatRenderer:
    template = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
                "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
    return ChatRenderer(Template(template, "test.jinja"), default_hf_tokenizer())


def stream(client, headers: dict, messages: list[dict]) -> list[dict]:
    events = []
    with client.stream("POST", "/v1/chat/completions", headers=headers,
                       json={"messages": messages, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


@pytest.mark.parametrize("channel", ["reasoning", "content", "inline", "openwebui"])
def test_proxied_lines_arrive_in_each_channel_with_the_right_numbers(tiny, channel):
    seen: list[dict] = []
    messages = [{"role": "user", "content": long_text(5, 300)}]
    setting = "auto" if channel == "openwebui" else channel
    headers = {"x-openwebui-chat-id": "chat-1"} if channel == "openwebui" else {"x-session-id": "s1"}
    with serving(slow_engine(seen, 3.5)) as engine, running(upstream=str(engine.base_url).rstrip("/") + "/v1",
                                                            dialect="openai", renderer=renderer(),
                                                            status_channel=setting) as (proxy, service):
        events = stream(proxy, headers, messages)
        settled(service)
    want = len(renderer().prompt_ids(messages))  # a new session: every id is new to the engine
    reading = f"reading {want:,} tokens"
    if channel == "openwebui":
        status = [e["event"]["data"] for e in events if "event" in e]
        assert status[0]["description"].startswith(reading) and not status[0]["done"]
        assert status[-1]["description"].startswith(f"Read {want:,} tokens in ") and status[-1]["done"]
        # the status events all come before the model's first piece; its reasoning is untouched
        first_model = next(i for i, e in enumerate(events) if "choices" in e and e["choices"][0]["delta"].get("reasoning_content"))
        assert all(i < first_model for i, e in enumerate(events) if "event" in e)
        assert events[first_model]["choices"][0]["delta"]["reasoning_content"] == "hm"
        return
    key = "content" if channel == "content" else "reasoning_content"
    said = [e["choices"][0]["delta"][key] for e in events if "choices" in e and e["choices"]
            and MARK in (e["choices"][0]["delta"].get(key) or "")]
    assert said and reading in said[0]
    assert all(e["id"] == "c1" for e in events if "choices" in e and e["choices"])  # the engine's own id
    if channel == "inline":
        deltas = [e["choices"][0]["delta"] for e in events if "choices" in e and e["choices"]]
        i = next(k for k, d in enumerate(deltas) if MARK in (d.get("reasoning_content") or ""))
        assert deltas[i - 1] == {"tool_calls": []}  # the line opens a part of its own
        j = next(k for k, d in enumerate(deltas) if d.get("reasoning_content") == "hm")
        assert deltas[j - 1] == {"tool_calls": []}  # and the model's reasoning another


def test_an_engine_that_opens_its_stream_at_once_still_gets_the_first_line_on_time(tiny):
    """The engine sends its role chunk at once, then reads for 0.7 s: the reading line goes out at
    quiet_s (0.2 s), not when the proxy would next look (a second after the last piece)."""
    seen: list[dict] = []
    messages = [{"role": "user", "content": long_text(5, 300)}]
    with serving(slow_engine(seen, 0.7)) as engine, running(upstream=str(engine.base_url).rstrip("/") + "/v1",
                                                            dialect="openai", renderer=renderer(),
                                                            status_channel="auto",
                                                            status_timing={"quiet_s": 0.2}) as (proxy, service):
        events = stream(proxy, {"x-openwebui-chat-id": "chat-1"}, messages)
        settled(service)
    status = [e["event"]["data"] for e in events if "event" in e]
    assert [s["done"] for s in status] == [False, True], status
    assert status[0]["description"].startswith("reading ") and status[1]["description"].startswith("Read ")


def test_a_client_that_echoes_the_lines_changes_nothing_the_engine_or_the_shadow_reads(tiny):
    """Two sessions of three turns, one whose client sends every line back in the assistant's
    content and reasoning: the engine receives the same prompts, the shadow reads the same ids
    and holds bit-equal states."""
    seen: list[dict] = []
    with serving(slow_engine(seen, 2.2)) as engine, running(upstream=str(engine.base_url).rstrip("/") + "/v1",
                                                            dialect="openai", renderer=renderer(),
                                                            status_channel="content") as (proxy, service):
        for name, echo in (("quiet", False), ("echo", True)):
            messages = [{"role": "user", "content": long_text(9, 200)}]
            for turn in range(3):
                events = stream(proxy, {"x-session-id": name}, messages)
                content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                                  if "choices" in e and e["choices"])
                reasoning = "".join(e["choices"][0]["delta"].get("reasoning_content") or "" for e in events
                                    if "choices" in e and e["choices"])
                assert (MARK in content) is True  # lines were said in this channel
                if not echo:
                    content = strip_lines(content)
                messages = messages + [{"role": "assistant", "content": content, "reasoning_content": reasoning},
                                       {"role": "user", "content": f"turn {turn}"}]
            settled(service)
        with service.state_lock:
            quiet, echoed = service.store.get("quiet"), service.store.get("echo")
            assert quiet.ids == echoed.ids and len(quiet.ids) > 0
        from serving import assert_exact

        assert_exact(service, "quiet")
        assert_exact(service, "echo")
    assert len(seen) == 6 and seen[:3] == seen[3:]  # the engine got the same requests
    assert all(MARK not in json.dumps(body, ensure_ascii=False) for body in seen)


def test_a_request_the_engine_keeps_waiting_opens_its_stream_at_its_first_line(tiny):
    """The engine sends nothing, not even headers, for 3 s: the client's stream opens with the
    first line; when the engine then refuses, the stream ends with its error and [DONE]."""
    app = FastAPI()
    gate = threading.Event()

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        await asyncio.sleep(3.0)
        from fastapi.responses import JSONResponse

        return JSONResponse({"error": {"message": "context too long", "type": "invalid_request_error"}},
                            status_code=400)

    with serving(app) as engine, running(upstream=str(engine.base_url).rstrip("/") + "/v1", dialect="openai",
                                         renderer=renderer(), status_channel="reasoning") as (proxy, service):
        start = time.monotonic()
        with proxy.stream("POST", "/v1/chat/completions", headers={"x-session-id": "w"},
                          json={"messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
            assert r.status_code == 200
            opened = time.monotonic() - start
            text = r.read().decode()
        settled(service)
    assert opened < 3.0  # opened at the first line, not when the engine answered
    assert MARK in text and "context too long" in text and text.rstrip().endswith("data: [DONE]")
    gate.set()


def test_embedded_lines_while_a_request_waits_for_another(tiny):
    """Embedded: a request behind another on the one device is told its position, then reads."""
    with running(status_channel="reasoning") as (client, service):
        hold = threading.Event()
        service.device.submit(hold.wait, "test")  # the device is busy for 2.5 s: both requests wait
        threading.Timer(2.5, hold.set).start()
        results = {}

        def go(name, delay):
            time.sleep(delay)
            results[name] = stream(client, {"x-session-id": name}, [{"role": "user", "content": long_text(3, 200)}])

        threads = [threading.Thread(target=go, args=("first", 0.0)), threading.Thread(target=go, args=("second", 0.3))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        settled(service)
    said = {name: [e["choices"][0]["delta"]["content"] for e in events if MARK in (e["choices"][0]["delta"].get("content") or "")]
            for name, events in results.items()}
    lines = {name: [e["choices"][0]["delta"].get("reasoning_content") for e in events
                    if MARK in (e["choices"][0]["delta"].get("reasoning_content") or "")]
             for name, events in results.items()}
    assert any("reading" in x for x in lines["first"]), lines
    assert any("waiting: another request is running, position 1" in x for x in lines["second"]), lines
    assert said == {"first": [], "second": []}  # the lines went to the reasoning channel only


def tool_engine(seconds: float) -> FastAPI:
    """An engine that writes a tool call (a file, line by line) for `seconds`."""
    call = {"index": 0, "id": "c1", "type": "function",
            "function": {"name": "write", "arguments": '{"filePath": "src/render.js", "content": "'}}
    lines = [(0.1, {"tool_calls": [{"index": 0, "function": {"arguments": f"line {k}\\n"}}]}, None)
             for k in range(int(seconds / 0.1))]
    return scripted_stream([(0, {"tool_calls": [call]}, None), *lines,
                            (0, {"tool_calls": [{"index": 0, "function": {"arguments": '"}'}}]}, "tool_calls")])


def test_a_tool_call_written_for_seconds_is_told_as_it_is_written_then_checked(tiny):
    with serving(tool_engine(3.0)) as engine, running(upstream=str(engine.base_url).rstrip("/") + "/v1",
                                                      dialect="openai", renderer=renderer(),
                                                      status_channel="content") as (proxy, service):
        events = stream(proxy, {"x-session-id": "w"}, [{"role": "user", "content": "write render.js"}])
        settled(service)
    said = [e["choices"][0]["delta"]["content"] for e in events if e.get("choices")
            and MARK in (e["choices"][0]["delta"].get("content") or "")]
    writing = [x for x in said if "writing render.js" in x]
    assert writing and "lines so far" in writing[0]
    counts = [int(x.split(", ")[1].split()[0]) for x in writing]
    assert counts == sorted(counts) and counts[0] >= 10  # the lines of the open call, as they grow
    assert "checking the tool call" in said[-1]


def test_lines_in_front_of_transformers_serve_with_the_engines_own_numbers(tiny, big_model, transformers_engine):
    """A long prompt to a real `transformers serve`: the reading line counts the prompt's ids as the
    engine reads them (its template), its reasoning gives thinking lines (thresholds shortened)."""
    from shadow.text.chat_template import ChatRenderer, load_hf_tokenizer, read_template

    big = ChatRenderer(read_template(big_model), load_hf_tokenizer(big_model))
    messages = [{"role": "user", "content": long_text(7, 20000)}]
    with running(upstream=transformers_engine, renderer=big, status_channel="reasoning",
                 status_timing={"quiet_s": 0.2, "progress_every_s": 0.3, "thinking_from_s": 0.3,
                                "thinking_every_s": 0.5}) as (proxy, service):
        events = []
        with proxy.stream("POST", "/v1/chat/completions", headers={"x-session-id": "t"},
                          json={"messages": messages, "stream": True, "max_tokens": 60}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
        settled(service)
    said = [e["choices"][0]["delta"]["reasoning_content"] for e in events if e.get("choices")
            and MARK in (e["choices"][0]["delta"].get("reasoning_content") or "")]
    want = len(big.prompt_ids(messages))
    assert any(f"reading {want:,} tokens" in x for x in said), said
    assert any("thinking" in x for x in said), said
