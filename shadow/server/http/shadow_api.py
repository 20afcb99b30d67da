"""The shadow's own endpoints: ask, summarize, switch, status. Requests are pydantic models, so
FastAPI validates them (and the OpenAPI schema documents them); anything else is a 400 with the
error shape, before any state changes."""

from __future__ import annotations

import asyncio
import math

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from shadow.text.chat import render_question
from shadow.errors import ShadowInputError
from shadow.server.http.guard import Limits
from shadow.server.service import ShadowService
from shadow.text.tokenizer import Tokenizer

MAX_CHOICES = 26


def _seconds(v):
    """A timeout: a finite number (not a boolean, not text)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError("must be a finite number of seconds")
    return v


class AskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    session: str = Field(min_length=1, max_length=256, description="The session's name.")
    question: str | None = Field(None, min_length=1, description="The question as text (or give question_ids).")
    question_ids: list[StrictInt] | None = Field(None, min_length=1, description="The question as token ids.")
    choices: list[str] = Field(min_length=1, max_length=MAX_CHOICES,
                               description="The answers, each a single token (e.g. letters).")
    timeout_s: float = Field(10.0, gt=0, le=3600, description="How long the shadow may read to catch up.")
    reference: str | None = Field(None, description="The label the router chose, if known (one of the choices).")
    fresh: StrictBool | None = Field(None, description="Whether the reference was decided on this turn.")

    @field_validator("timeout_s", mode="before")
    @classmethod
    def seconds(cls, v):
        return _seconds(v)

    @field_validator("choices")
    @classmethod
    def distinct(cls, v: list[str]) -> list[str]:
        if any(not c for c in v):
            raise ValueError("a choice is empty")
        if len(set(v)) != len(v):
            raise ValueError("choices repeat")
        return v


class SummarizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    session: str = Field(min_length=1, max_length=256)
    instruction: str = Field("Summarise the latest turn in one sentence.", min_length=1)
    max_tokens: StrictInt = Field(48, ge=1, description="Tokens to decode (at most the server's limit, 512 by default).")
    timeout_s: float = Field(10.0, gt=0, le=3600)

    @field_validator("timeout_s", mode="before")
    @classmethod
    def seconds(cls, v):
        return _seconds(v)


class SwitchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    on: StrictBool = Field(description="The shadow: off, it feeds and reads nothing.")
    voice: StrictBool | None = Field(None, description="The voice's phrases (default: as the shadow).")


def shadow_routes(service: ShadowService, tokenizer: Tokenizer, eos: list[int], limits: Limits) -> APIRouter:
    router = APIRouter(prefix="/v1/shadow")

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
                                       reference, req.fresh)

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
        """Turn the shadow (and the voice) off or on (for A/B runs): off, it feeds and reads nothing."""
        service.enabled = req.on
        service.voice_enabled = req.on if req.voice is None else req.voice
        return {"on": service.enabled, "voice": service.voice_enabled}

    @router.get("/status")
    async def status():
        """Every session's read position, backlog, bytes, checkpoints, residency and checks
        against the engine; the store's totals; the scheduler's counters; the last answers."""
        return await asyncio.to_thread(service.status)

    return router
