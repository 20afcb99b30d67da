"""The shadow's own endpoints: ask, summarize, switch, status. Their bodies are the pydantic models
of `schemas`, so FastAPI validates them (and the OpenAPI schema documents them); anything else is
a 400 in the one error shape, before any state changes."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request

from shadow.engines import jsonlimits
from shadow.errors import ShadowInputError
from shadow.server.http.schemas import AskRequest, SummarizeRequest, SwitchRequest
from shadow.server.service import ShadowService
from shadow.server.settings import Limits
from shadow.text.chat import render_question
from shadow.text.tokenizer import Tokenizer


async def utf8_json(request: Request) -> None:
    """A POST body is JSON in UTF-8 within the limits (`jsonlimits.loads`), as the completions'
    are: FastAPI alone would also take UTF-16 and UTF-32, guessed from the bytes."""
    if request.method == "POST":
        try:
            jsonlimits.loads(await request.body())
        except jsonlimits.JSONLimitError as e:
            raise ShadowInputError(f"the body is refused: {e}") from None


def shadow_routes(service: ShadowService, tokenizer: Tokenizer, eos: list[int], limits: Limits) -> APIRouter:
    router = APIRouter(prefix="/v1/shadow", dependencies=[Depends(utf8_json)])

    @router.post("/ask")
    async def ask(req: AskRequest, request: Request):
        """Read the session up to its last id (within timeout_s), then one forward of the unread
        tail and the question in a fork: each choice's probability. The session is left as it was."""
        choice_ids = [tokenizer.single_token(c) for c in req.choices]
        if req.question_ids is not None:
            question = list(req.question_ids)
        elif req.question is not None:
            question = tokenizer.encode(req.question)
        else:
            raise ShadowInputError("give 'question' (text) or 'question_ids'")
        if not question or len(question) > limits.max_question_tokens:
            raise ShadowInputError(f"the question must have 1 to {limits.max_question_tokens:,} tokens")
        reference = req.reference if req.reference is not None else request.headers.get("x-shadow-label")
        if reference is not None and reference not in req.choices:
            raise ShadowInputError("'reference' (or x-shadow-label) must be one of the choices")
        return await asyncio.to_thread(service.ask, req.session, question, choice_ids, req.choices, req.timeout_s,
                                       reference, fresh=req.fresh)

    @router.post("/summarize")
    async def summarize(req: SummarizeRequest):
        """A summary decoded greedily from a fork over the whole session (text and ids)."""
        if req.max_tokens > limits.max_summary_tokens:
            raise ShadowInputError(f"'max_tokens' must be at most {limits.max_summary_tokens}")
        prompt = tokenizer.encode(render_question(req.instruction))
        if len(prompt) > limits.max_instruction_tokens:
            raise ShadowInputError(f"the instruction must have at most {limits.max_instruction_tokens:,} tokens")
        answer = await asyncio.to_thread(service.summarize, req.session, prompt, req.max_tokens, req.timeout_s)
        return answer | {"text": tokenizer.decode([t for t in answer["ids"] if t not in eos])}

    @router.post("/switch")
    async def switch(req: SwitchRequest):
        """Turn the shadow (and the voice) off or on (for A/B runs): off, it feeds and reads nothing,
        and its share starts afresh when it is switched back on."""
        return await asyncio.to_thread(service.switch, req.on, req.voice)

    @router.get("/status")
    async def status():
        """Every session's read position, backlog, bytes, checkpoints, residency and checks
        against the engine; the store's totals; the scheduler's counters; the last answers."""
        return await asyncio.to_thread(service.status)

    return router
