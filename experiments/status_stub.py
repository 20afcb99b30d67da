"""A tiny OpenAI-compatible server that streams Open WebUI status events, then reasoning and content.

It lets `openwebui_run.py` probe, in one run of a real Open WebUI, event shapes `shadow serve`
does not send (a final event hidden, apart, or missing) beside the ones it does. One model
(`--model`, default "stub"). A streamed chat request gets:

  1. `--statuses` status events, `--status-delay` seconds apart, each alone in its chunk:
     `data: {"event": {"type": "status", "data": {"description": "...", "done": false}}}`
  2. at the first token, a last status event `{"description": "Read ... in ... s", "done": true}`
     sharing its chunk with the first delta (`choices`): so one chunk carries an event and content;
  3. reasoning deltas (`delta.reasoning_content`; none with `--no-reasoning`), then the answer in
     content deltas, `--token-delay` seconds apart, then `finish_reason: "stop"` and `data: [DONE]`.

A variant is picked per request by a marker in the last user message (`variant=NAME`), so one
Open WebUI run can probe several shapes: `default` (above), `hidden` (the final event carries
`"hidden": true`), `separate` (the final event in a chunk of its own), `noreason` (no reasoning
deltas), `nofinal` (no done:true event at all), `action` (statuses carry `"action": "shadow"`),
`reasoningkey` (`delta.reasoning` instead of `delta.reasoning_content`), `midway` (a status line
in the middle of the answer, done:true at its end).

Every request's headers and messages (contents cut to 120 characters) are kept: `GET /stub/requests`
returns them (newest last), and `--log FILE` appends one JSON line per request. Non-streamed requests get the
same answer as one message. Runs until stopped (SIGTERM/SIGINT).

    python experiments/status_stub.py --port 18001 --log out/stub.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

ANSWER = "The shadow read the whole prompt; here is the answer, word by word, from the stub."
REASONING = "The user asks a question. I read the context first, then I answer briefly."
VARIANTS = ("default", "hidden", "separate", "noreason", "nofinal", "action", "reasoningkey", "midway")


def status_lines(n: int, tokens: int) -> list[str]:
    """The lines said before the first token: waiting, then reading with a countdown."""
    lines = ["waiting for the engine"]
    for i in range(max(n - 1, 0)):
        left = max(n - 1 - i, 1) * 3
        lines.append(f"reading {tokens:,} tokens, about {left} s left")
    return lines[:n]


def variant_of(messages: list[dict]) -> str:
    """The variant named in the last user message (`variant=NAME`), else `default`."""
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            text = content if isinstance(content, str) else json.dumps(content)
            found = re.search(r"variant=(\w+)", text)
            return found.group(1) if found and found.group(1) in VARIANTS else "default"
    return "default"


def last_user_text(messages: list[dict]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            return content if isinstance(content, str) else json.dumps(content)
    return ""


def prompt_tokens(messages: list[dict]) -> int:
    """A rough count (4 characters a token) said in the status lines."""
    return max(sum(len(json.dumps(m.get("content"))) for m in messages) // 4, 1)


def chunk(model: str, delta: dict | None = None, finish: str | None = None, event: dict | None = None) -> str:
    """One SSE `data:` line: an OpenAI chunk (choices) and/or an Open WebUI event."""
    body: dict = {}
    if event is not None:
        body["event"] = event
    if delta is not None or finish is not None:
        body |= {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": int(time.time()),
                 "model": model, "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n"


def status_event(description: str, done: bool, **extra) -> dict:
    return {"type": "status", "data": {"description": description, "done": done, **extra}}


def create_app(model: str = "stub", statuses: int = 4, status_delay: float = 1.5, reasoning: bool = True,
               token_delay: float = 0.05, log: Path | None = None) -> FastAPI:
    """The stub app; its knobs are the CLI's."""
    app = FastAPI()
    app.state.requests = []

    def record(request: Request, path: str, body: dict | None) -> None:
        entry = {"time": time.time(), "path": path, "headers": dict(request.headers)}
        if body is not None:
            entry |= {"stream": bool(body.get("stream")), "model": body.get("model"),
                      "last_user": last_user_text(body.get("messages", []))[:200],
                      "prompt_tokens": prompt_tokens(body.get("messages", [])),
                      "messages": [{k: (v[:120] if isinstance(v, str) else v) for k, v in m.items()}
                                   for m in body.get("messages", [])]}
        app.state.requests.append(entry)
        if log is not None:
            with log.open("a") as f:
                f.write(json.dumps(entry) + "\n")

    @app.get("/v1/models")
    async def models(request: Request):
        record(request, "/v1/models", None)
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "stub"}]}

    @app.get("/stub/requests")
    async def requests():
        return app.state.requests

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        record(request, "/v1/chat/completions", body)
        messages = body.get("messages", [])
        if not body.get("stream"):
            return JSONResponse({"id": "chatcmpl-stub", "object": "chat.completion", "created": int(time.time()),
                                 "model": model, "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": ANSWER}}]})
        variant = variant_of(messages)
        return StreamingResponse(stream(variant, prompt_tokens(messages)), media_type="text/event-stream")

    async def stream(variant: str, tokens: int):
        started = time.monotonic()
        extra = {"action": "shadow"} if variant == "action" else {}
        for line in status_lines(statuses, tokens):
            yield chunk(model, event=status_event(line, False, **extra))
            await asyncio.sleep(status_delay)
        waited = time.monotonic() - started
        final = status_event(f"Read {tokens:,} tokens in {waited:.0f} s", True,
                             **({"hidden": True} if variant == "hidden" else {}), **extra)
        words = [w + " " for w in ANSWER.split(" ")]
        thoughts = [] if variant == "noreason" or not reasoning else [w + " " for w in REASONING.split(" ")]
        key = "reasoning" if variant == "reasoningkey" else "reasoning_content"
        deltas = [{"role": "assistant", key: t} for t in thoughts] + [{"role": "assistant", "content": w} for w in words]
        if variant == "separate":
            yield chunk(model, event=final)
        for i, delta in enumerate(deltas):
            shares = i == 0 and variant not in ("separate", "nofinal")
            yield chunk(model, delta=delta, event=final if shares else None)
            if variant == "midway" and i == len(deltas) - len(words) // 2:  # a line in the middle of the answer
                yield chunk(model, event=status_event("checking a tool call", False))
                await asyncio.sleep(status_delay)
            await asyncio.sleep(token_delay)
        if variant == "midway":
            yield chunk(model, event=status_event("tool call checked", True))
        yield chunk(model, delta={}, finish="stop")
        yield "data: [DONE]\n\n"

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=18001)
    parser.add_argument("--model", default="stub")
    parser.add_argument("--statuses", type=int, default=4, help="status lines before the first token")
    parser.add_argument("--status-delay", type=float, default=1.5, help="seconds between status lines")
    parser.add_argument("--token-delay", type=float, default=0.05, help="seconds between deltas")
    parser.add_argument("--no-reasoning", action="store_true", help="no reasoning_content deltas")
    parser.add_argument("--log", type=Path, help="append one JSON line per request (headers included)")
    args = parser.parse_args()
    app = create_app(args.model, args.statuses, args.status_delay, not args.no_reasoning, args.token_delay, args.log)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
