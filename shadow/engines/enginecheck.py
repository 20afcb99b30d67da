"""A conformance run against a live engine, before anyone trusts a shadow beside it (what
`shadow check-engine` runs): plain chat, multi-turn with reasoning, tools with a tool call and
its result, streamed and not, a long prompt, and a plain completion. For every request: where
the dialect takes the prompt and output ids from, whether they equal the engine's where the
engine shows them, whether their counts equal the engine's `usage`, and each part's state
(verified, unverified, mismatched, or not read: an output the engine shows no ids for).

The requests go to the engine directly (no shadow), with the fields the dialect adds, exactly as
the proxy sends them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx

from shadow.engines import jsonlimits
from shadow.engines.dialects import Dialect, engine_root
from shadow.engines.idcheck import PART_STATES, check_turn, first_difference
from shadow.engines.reply import Reply

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city."},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city"]}}}
READ_TOOL = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the project.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}


@dataclass
class CaseResult:
    case: str
    request: int  # 1-based within the case
    endpoint: str
    streamed: bool
    status: int
    prompt_source: str | None = None
    output_source: str | None = None
    prompt_ids: int | None = None
    output_ids: int | None = None
    usage_prompt: int | None = None
    usage_completion: int | None = None
    prompt_equal: bool | None = None  # equal to the engine's own ids, where it showed them
    template_equal: bool | None = None  # the big model's template gives the same ids (where both exist)
    output_equal: bool | None = None
    verified: bool | None = None  # both parts verified (False: either mismatched)
    prompt_check: str | None = None  # idcheck.PART_STATES: verified, unverified, mismatched, not_read
    output_check: str | None = None
    reasons: list[str] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None  # a failed request's cause: "HTTP 422: the engine's message" (200 chars), or no answer


def engine_message(status: int, body: bytes) -> str:
    """A refusal's cause in one line: `HTTP status: message`, the message being the engine's own
    (`error.message`, FastAPI's `detail`, else the body), cut to 200 characters."""
    try:
        doc = json.loads(body)
        error = doc.get("error") if isinstance(doc, dict) else None
        message = error.get("message") if isinstance(error, dict) else error if isinstance(error, str) else None
        message = message if message is not None else doc.get("detail") if isinstance(doc, dict) else None
    except ValueError:
        message = None
    if message is None:
        message = body.decode("utf-8", "replace")
    text = message if isinstance(message, str) else json.dumps(message)
    return f"HTTP {status}: {' '.join(text.split())[:200]}"


@dataclass(frozen=True)
class Case:
    name: str
    streamed: bool
    requests: Callable[[Reply | None, int], Iterator[tuple[str, dict]]]


def _filler(n_words: int) -> str:
    words = ("shadow", "reader", "session", "engine", "prompt", "token", "chunk", "grid", "state", "exact")
    return " ".join(f"{words[i % len(words)]}{i % 97}" for i in range(n_words))


def cases(max_tokens: int, long_words: int = 3000) -> list[Case]:
    """The conversations of the run; each yields (endpoint, body) per request, built on the
    engine's previous reply (`Reply`, None for the first)."""

    def plain(streamed: bool):
        def gen(prev, _):
            yield "chat", {"messages": [{"role": "system", "content": "You are a careful assistant."},
                                        {"role": "user", "content": "Name three prime numbers."}],
                           "max_tokens": max_tokens, "temperature": 0, "stream": streamed}
        return gen

    def reasoning(streamed: bool):
        def gen(prev, k):
            history = [{"role": "user", "content": "What is 17 times 23? Think first."}]
            yield "chat", {"messages": history, "max_tokens": max_tokens, "temperature": 0, "stream": streamed}
            reply = prev[-1].message() if prev else {"role": "assistant", "content": ""}
            history = history + [reply, {"role": "user", "content": "And 17 times 24?"}]
            yield "chat", {"messages": history, "max_tokens": max_tokens, "temperature": 0, "stream": streamed}
        return gen

    def tools(streamed: bool):
        def gen(prev, k):
            history = [{"role": "system", "content": "You help with the weather."},
                       {"role": "user", "content": "What is the weather in Paris and in Oslo?"}]
            body = {"messages": history, "tools": [WEATHER_TOOL, READ_TOOL], "max_tokens": max_tokens,
                    "temperature": 0, "stream": streamed}
            yield "chat", body
            call = {"role": "assistant", "content": "",
                    "reasoning_content": "Two cities: I call the tool twice.",
                    "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "C"})}},
                        {"id": "call_2", "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}]}
            history = history + [call,
                                 {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 11, \"sky\": \"rain\"}"},
                                 {"role": "tool", "tool_call_id": "call_2", "content": "{\"temp\": 2, \"sky\": \"snow\"}"}]
            yield "chat", body | {"messages": history}
        return gen

    def long(streamed: bool):
        def gen(prev, k):
            yield "chat", {"messages": [{"role": "user", "content": [
                {"type": "text", "text": "Summarise this log:\n"}, {"type": "text", "text": _filler(long_words)}]}],
                "max_tokens": max_tokens, "temperature": 0, "stream": streamed}
        return gen

    def completion(streamed: bool):
        def gen(prev, k):
            yield "completions", {"prompt": "The shadow reader keeps an exact state of", "max_tokens": max_tokens,
                                  "temperature": 0, "stream": streamed}
        return gen

    out = []
    for streamed in (False, True):
        tag = "streamed" if streamed else "whole"
        out += [Case(f"plain/{tag}", streamed, plain(streamed)), Case(f"reasoning/{tag}", streamed, reasoning(streamed)),
                Case(f"tools/{tag}", streamed, tools(streamed)), Case(f"long/{tag}", streamed, long(streamed)),
                Case(f"completion/{tag}", streamed, completion(streamed))]
    return out


def _words(seed: int, n: int) -> str:
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(["def", "return", "self", "path", "error", "test", "assert", "value", "None", "x"])
                    for _ in range(n))


def _tool_call(k: int, name: str, args: dict) -> dict:
    return {"role": "assistant", "content": "", "reasoning_content": f"I need the tool ({k}).",
            "tool_calls": [{"id": f"call_{k}", "type": "function",
                            "function": {"name": name, "arguments": json.dumps(args)}}]}


def session_script() -> dict[str, list[tuple[list[dict], dict]]]:
    """Five sessions of chat turns: (messages the client adds before the request, request fields).
    A turn whose added messages open with an assistant message replaces the engine's last reply
    with it (the client got a tool call); otherwise the engine's reply is added first."""
    tools = {"tools": [WEATHER_TOOL, READ_TOOL]}
    sessions = {
        "plain": [([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}], {})]
        + [([{"role": "user", "content": f"Again, {k}."}], {}) for k in range(5)],
        "reasoning": [([{"role": "user", "content": "Think about 12 * 13."}], {"stream": True})]
        + [([{"role": "user", "content": f"Now {k} more."}], {"stream": True}) for k in range(5)],
        "tools": [
            ([{"role": "user", "content": "Weather in Paris?"}], tools),
            ([_tool_call(1, "get_weather", {"city": "Paris"}),
              {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 11}"}], tools | {"stream": True}),
            ([{"role": "user", "content": "And Oslo, in F?"}], tools),
            ([_tool_call(2, "get_weather", {"city": "Oslo", "unit": "F"}),
              {"role": "tool", "tool_call_id": "call_2", "content": "{\"temp\": 35}"}], tools | {"stream": True}),
            ([{"role": "user", "content": "Read setup.py."}], tools),
            ([_tool_call(3, "read_file", {"path": "setup.py"}),
              {"role": "tool", "tool_call_id": "call_3", "content": _words(3, 120)}], tools | {"stream": True}),
        ],
        "parts": [([{"role": "user", "content": [{"type": "text", "text": "Part one."},
                                                 {"type": "text", "text": f"Part {k}."}]}],
                   {"chat_template_kwargs": {"enable_thinking": False}, "stream": bool(k % 2)}) for k in range(6)],
        "agent": [([{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "Fix the failing test."}],
                   tools)]
        + [([_tool_call(10 + k, "read_file", {"path": f"src/m{k}.py"}),
             {"role": "tool", "tool_call_id": f"call_{10 + k}", "content": _words(10 + k, 300)}],
            tools | {"stream": bool(k % 2)}) for k in range(6)],
    }
    return sessions


def play_sessions(client: httpx.Client, script: dict[str, list[tuple[list[dict], dict]]], max_tokens: int = 8,
                  model: str | None = None) -> Iterator[tuple[str, dict, Reply, int]]:
    """Send every session's turns through `client` (a shadow serve, or an engine) as a client
    would: `x-session-id` the session's name, the engine's last reply added to the history before
    the next turn (or replaced by the turn's scripted assistant message). Yields (session, body,
    reply, HTTP status) after each request."""
    for name, steps in script.items():
        history: list[dict] = []
        previous: Reply | None = None
        for added, fields in steps:
            if previous is not None and added[0]["role"] != "assistant":
                history.append(previous.message())
            history = history + added
            body = {"messages": history, "max_tokens": max_tokens, "temperature": 0} | fields
            if model is not None:
                body["model"] = model
            reply, status = Reply(), 0
            if body.get("stream"):
                with client.stream("POST", "/v1/chat/completions", headers={"x-session-id": name}, json=body) as r:
                    status = r.status_code
                    for line in r.iter_lines():
                        if line.startswith("data:") and line[5:].strip() != "[DONE]":
                            try:
                                reply.read(jsonlimits.loads(line[5:]), chat=True)
                            except jsonlimits.JSONLimitError:
                                reply.malformed += 1
            else:
                r = client.post("/v1/chat/completions", headers={"x-session-id": name}, json=body)
                status = r.status_code
                if status == 200:
                    try:
                        reply.read(jsonlimits.loads(r.content), chat=True)
                    except jsonlimits.JSONLimitError:
                        reply.malformed += 1
            previous = reply
            yield name, body, reply, status


def run_request(client: httpx.Client, upstream: str, dialect: Dialect, endpoint: str, body: dict,
                model: str | None, *, headers: dict | None = None) -> tuple[CaseResult, Reply]:
    """One request to the engine as the proxy would send it, and what the dialect makes of it."""
    import time

    chat = endpoint == "chat"
    if model is not None:
        body = {"model": model} | body
    before = dialect.prompt(client, engine_root(upstream), body, chat)
    asked = dialect.ask(body, chat)
    reply = Reply()
    url = upstream.rstrip("/") + ("/chat/completions" if chat else "/completions")
    result = CaseResult("", 0, endpoint, bool(body.get("stream")), 0)
    start = time.perf_counter()
    try:
        if body.get("stream"):
            with client.stream("POST", url, json=asked.body, headers=headers) as r:
                result.status = r.status_code
                if r.status_code == 200:
                    for line in r.iter_lines():
                        if line.startswith("data:") and line[5:].strip() != "[DONE]":
                            try:
                                reply.read(jsonlimits.loads(line[5:]), chat)
                            except jsonlimits.JSONLimitError:
                                reply.malformed += 1
                else:
                    result.error = engine_message(r.status_code, r.read())
        else:
            r = client.post(url, json=asked.body, headers=headers)
            result.status = r.status_code
            if r.status_code == 200:
                reply.read(jsonlimits.loads(r.content), chat)  # a body past the limits: the reason below
            else:
                result.error = engine_message(r.status_code, r.content)
    except (httpx.HTTPError, ValueError) as e:
        cause = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        if result.status == 200:  # broken off, or past the limits, after the answer began
            result.reasons.append(cause)
        else:
            result.error = cause
    result.seconds = round(time.perf_counter() - start, 3)
    if result.status != 200:
        result.error = result.error or f"HTTP {result.status}"
        result.reasons.append(result.error)
        return result, reply
    ids = dialect.turn_ids(reply, before, body, chat)
    check = check_turn(ids)
    result.prompt_source, result.output_source = ids.prompt_source, ids.output_source
    result.prompt_ids = None if ids.prompt is None else len(ids.prompt)
    result.output_ids = len(ids.output) if ids.output_source and ids.output_skipped is None else None
    result.usage_prompt, result.usage_completion = ids.prompt_tokens, ids.completion_tokens
    if reply.prompt_ids is not None and ids.prompt is not None:
        result.prompt_equal = ids.prompt == reply.prompt_ids
    shown = reply.engine_output()
    if shown is not None and ids.output_source and ids.output_skipped is None:
        result.output_equal = ids.output[: len(shown)] == shown
    result.verified = check.verified
    result.prompt_check, result.output_check = check.prompt_check, check.output_check
    result.reasons += list(check.reasons) + ids.notes
    if dialect.renderer is not None and reply.prompt_ids is not None:
        rendered = dialect.render(body, chat)
        if rendered.ids is not None:
            result.template_equal = rendered.ids == reply.prompt_ids
            if not result.template_equal:
                result.reasons.append(f"the template differs from the engine's prompt at "
                                      f"{first_difference(rendered.ids, reply.prompt_ids)}")
    return result, reply


def check_engine(upstream: str, dialect: Dialect, max_tokens: int = 16, model: str | None = None,
                 long_words: int = 3000, timeout_s: float = 600.0, *,
                 progress: Callable[[CaseResult], None] | None = None) -> list[CaseResult]:
    """Every case against the engine; one result a request."""
    results = []
    # idle connections given up before an engine closes them (llama.cpp: after 5 s)
    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=httpx.Limits(keepalive_expiry=3.0)) as client:
        for case in cases(max_tokens, long_words):
            replies: list[Reply] = []
            for k, (endpoint, body) in enumerate(case.requests(replies, 0), start=1):
                result, reply = run_request(client, upstream, dialect, endpoint, body, model)
                result.case, result.request = case.name, k
                replies.append(reply)
                results.append(result)
                if progress:
                    progress(result)
    return results


def summary(results: list[CaseResult]) -> dict:
    """Requests answered (HTTP 200) and failed (any other status, or no answer); verified (prompt and
    output both), mismatched (either), unverified (the rest of those answered); and the prompts and
    outputs apart, by state (`not_read`: the shadow would read none of it)."""
    n = len(results)
    ok = [r for r in results if r.status == 200]
    return {
        "requests": n, "answered": len(ok), "failed": n - len(ok),
        "verified": sum(r.verified is True for r in ok), "mismatched": sum(r.verified is False for r in ok),
        "unverified": sum(r.verified is None for r in ok),
        "prompts": {state: sum(r.prompt_check == state for r in ok) for state in PART_STATES},
        "outputs": {state: sum(r.output_check == state for r in ok) for state in PART_STATES},
        "prompt_count_equal": sum(r.prompt_ids is not None and r.prompt_ids == r.usage_prompt for r in ok),
        "output_count_equal": sum(r.output_ids is not None and r.output_ids == r.usage_completion for r in ok),
        "template_equal": sum(r.template_equal is True for r in ok),
        "template_compared": sum(r.template_equal is not None for r in ok),
    }
