"""Shared by the probe, metrics and log tests: an OpenAI-compatible engine that shows no ids (and,
unless told, no usage), and the small chat template a proxy renders its prompts with."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from shadow.text.chat_template import ChatRenderer, Template, default_hf_tokenizer

TEMPLATE = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
            "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def renderer() -> ChatRenderer:
    return ChatRenderer(Template(TEMPLATE, "test.jinja"), default_hf_tokenizer())


def quiet_engine(mode: dict | None = None) -> FastAPI:
    """Streams a few content deltas, `mode['wait_s']` apart (default 0.1), and no ids; with
    `mode['usage']` a usage chunk of `prompt_tokens` (default 5) where the client asks for one;
    `/v1/models` answers `mode['models_status']` (default 200)."""
    mode = {} if mode is None else mode
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]},
                            status_code=mode.get("models_status", 200))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()

        def chunk(delta: dict, finish=None) -> str:
            return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"

        async def events():
            yield chunk({"role": "assistant", "content": ""})
            for piece in ("Hello", " there", " again"):
                await asyncio.sleep(mode.get("wait_s", 0.1))
                yield chunk({"content": piece})
            yield chunk({}, "stop")
            if mode.get("usage") and (body.get("stream_options") or {}).get("include_usage"):
                yield "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": mode.get("prompt_tokens", 5),
                                                                      "completion_tokens": 3}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app
