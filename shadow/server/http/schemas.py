"""Every request body the service takes, as pydantic models: the shadow's own endpoints are
validated by them (FastAPI answers 400 in the one error shape before any state changes); the
OpenAI-compatible bodies are documented by them and checked for what the service itself reads
(in proxy mode the engine judges the rest: the body goes to it as the client sent it)."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

MAX_CHOICES = 26


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str = Field(json_schema_extra={"enum": ["system", "user", "assistant", "tool"]})
    content: str | list[dict[str, Any]] | None = None


class ChatBody(BaseModel):
    """An OpenAI chat completion request (other fields pass to the engine, or are ignored)."""

    model_config = ConfigDict(extra="allow")
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    stream: bool | None = None
    tools: list[dict[str, Any]] | None = None


class CompletionBody(BaseModel):
    """An OpenAI completion request (other fields pass to the engine, or are ignored)."""

    model_config = ConfigDict(extra="allow")
    prompt: str | list[int]
    max_tokens: int | None = Field(None, ge=1)
    stream: bool | None = None


def openapi_body(model: type[BaseModel]) -> dict:
    """A route's `openapi_extra` documenting `model` as its required JSON body."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


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
