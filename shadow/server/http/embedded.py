"""Embedded completions: OpenAI chat and completion requests answered by a Qwen3.5 checkpoint
generating in-process with the project's own forward (`server.generator`), one request at a time
on the device thread, with the shadow reading between its rounds. Asked with `return_token_ids`,
it returns ids the vLLM way (`prompt_token_ids` on the first chunk or the body,
`choices[].token_ids`), so another `shadow serve` can use it as its engine. The ids the shadow
reads are the ids it generated from: every turn is verified."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid

from fastapi.responses import JSONResponse, Response, StreamingResponse

from shadow.engines.dialects import as_carried
from shadow.engines.idcheck import TurnIds, check_turn
from shadow.errors import ShadowInputError
from shadow.server.generator import Generator
from shadow.server.http.channels import Channel, LineWriter
from shadow.server.http.errors import error_body, error_response
from shadow.server.http.lines import TurnStatus, said
from shadow.server.service import ShadowService
from shadow.server.settings import ServeSettings
from shadow.server.turn import ServedTurn
from shadow.text.chat import Message, render_prompt
from shadow.text.chat_template import ChatRenderer
from shadow.text.tokenizer import Tokenizer
from shadow.voice.checks import request_language


class EmbeddedCompletions:
    """Completions from `generator` under `model_name`; `renderer`: the chat template to render
    chat requests with (None: the in-code one of `shadow.text.chat`)."""

    def __init__(self, settings: ServeSettings, service: ShadowService, generator: Generator, tokenizer: Tokenizer,
                 model_name: str, renderer: ChatRenderer | None = None):
        self.service, self.generator, self.tokenizer = service, generator, tokenizer
        self.model_name, self.limits = model_name, settings.limits
        self.renderer, self.template_kwargs = renderer, dict(settings.engine.template_kwargs)
        self.timing = vars(settings.status.timing)  # TurnStatus's thresholds
        self.eos = [generator.model.config.eos_token_id]
        self.load = service.load  # one request at a time: the waiting line's queue and the reading rate

    def parse(self, body: dict, chat: bool) -> tuple[list[int], int]:
        """The prompt ids (the template, given, else the in-code one of `shadow.text.chat`, over the
        messages; or the completion's prompt, text or ids) and the tokens to generate. A
        ShadowInputError for anything else, before any state changes."""
        if chat:
            if self.renderer is None:
                ids = self.tokenizer.encode(render_prompt(parse_messages(body.get("messages"))))
            else:
                if not isinstance(body.get("messages"), list) or not body["messages"]:
                    raise ShadowInputError("'messages' must be a non-empty list")
                messages, tools, kwargs = as_carried(body)
                ids = self.renderer.prompt_ids(messages, tools, {**self.template_kwargs, **kwargs})
        else:
            p = body.get("prompt")
            if isinstance(p, str) and p:
                ids = self.tokenizer.encode(p)
            elif isinstance(p, list) and p and all(isinstance(i, int) and not isinstance(i, bool) for i in p):
                ids = list(p)
            else:
                raise ShadowInputError("'prompt' must be a non-empty string or a list of token ids")
        if len(ids) > self.limits.max_prompt_tokens:
            raise ShadowInputError(f"the prompt has {len(ids):,} tokens; at most {self.limits.max_prompt_tokens:,}")
        ids = self.service.reader.check_ids(ids)
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens", 64))
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= self.limits.max_tokens:
            raise ShadowInputError(f"'max_tokens' must be an integer from 1 to {self.limits.max_tokens}")
        return ids, max_tokens

    async def complete(self, body: dict, prompt: list[int], max_tokens: int, chat: bool, turn: ServedTurn,
                       channel: Channel = Channel("off")) -> Response:
        """Answer one request (`parse` gave its prompt and tokens), whose turn has begun: it is
        named here, and its job on the device feeds the prompt, generates and ends the turn."""
        try:
            session = self.service.name_turn(turn, prompt)
        except BaseException:  # no job will end it
            await asyncio.to_thread(self.service.end_turn, turn)
            raise
        stop_ids = [] if body.get("ignore_eos") else self.eos  # as vLLM: generate max_tokens whatever comes
        want_ids = bool(body.get("return_token_ids"))  # as vLLM: ids only when asked for
        rid, created = f"cmpl-{uuid.uuid4().hex[:16]}", int(time.time())
        events: queue.Queue = queue.Queue()
        self.load.sent(turn, time.monotonic(), len(prompt))  # no prefix cache: it reads the whole prompt
        lines = None
        if chat and body.get("stream") and channel.on:
            writer = LineWriter(channel, TurnStatus(time.monotonic(), new_tokens=len(prompt), **self.timing), self.load,
                                turn)
            writer.like = {"id": rid, "created": created, "model": self.model_name}
            lines = TokenLines(writer, prompt, self.tokenizer, self.service, request_language(body))
        threading.Thread(target=self._serve_turn, args=(turn, prompt, max_tokens, stop_ids, events),
                         name="shadow-turn", daemon=True).start()
        reply = Completion(self, rid, created, chat, want_ids, prompt)
        if body.get("stream"):
            def ended() -> None:
                self.load.answered(turn)
                if lines is not None:
                    self.service.journal_lines(turn, said(lines.writer.status.lines, lines.writer.status.started))

            return StreamingResponse(reply.sse(events, lines, ended),
                                     media_type="text/event-stream", headers={"x-shadow-session": session})
        out, finish = [], None
        try:
            while finish is None:
                kind, value = await asyncio.to_thread(events.get)
                if kind == "token":
                    out.append(value)
                elif kind == "done":
                    finish = value
                else:
                    return error_response(500, value, "server_error")
        finally:
            self.load.answered(turn)
        return JSONResponse(reply.whole(out, finish), headers={"x-shadow-session": session})

    def _serve_turn(self, turn: ServedTurn, prompt, max_tokens, stop_ids, events) -> None:
        """One request (on the device thread): feed the prompt, generate, and between rounds the share."""
        try:
            self.service.run_request(lambda: self._generate(turn, prompt, max_tokens, stop_ids, events))
        except Exception as e:  # the device thread has stopped: the client is told
            events.put(("error", f"{type(e).__name__}: {e}"))
            self.service.end_turn(turn)

    def _generate(self, turn: ServedTurn, prompt, max_tokens, stop_ids, events) -> None:
        service, out = self.service, []
        try:
            service.set_prompt(turn, prompt)
            for token in self.generator.generate(prompt, max_tokens, stop_ids):
                if not out:
                    service.first_token(turn)
                out.append(token)
                events.put(("token", token))
                # between two rounds: the output so far readable in the share, the share's slice, the
                # voice's phrases (its rounds hold the device: the voice is served between them)
                service.between_rounds(turn, (token,))
            events.put(("done", "stop" if out and out[-1] in self.eos else "length"))
            ids = TurnIds(list(prompt), "engine", list(out), "engine", prompt_tokens=len(prompt),
                          completion_tokens=len(out))
            service.record_turn(turn, check_turn(ids), ids)  # its own engine: the ids are the ones read
        except Exception as e:  # the client gets the error; the shadow keeps what it fed
            events.put(("error", f"{type(e).__name__}: {e}"))
        finally:
            service.end_turn(turn)


THINK, END_THINK, TOOL, END_TOOL = 248068, 248069, 248058, 248059  # <think> </think> <tool_call> </tool_call>


class TokenLines:
    """The embedded engine's tokens classified for the status lines: reasoning between <think>
    and </think> (from the start, when the prompt opens a think block), a tool call between
    <tool_call> and </tool_call> (its text kept, to read its action and target), else content."""

    def __init__(self, writer: LineWriter, prompt: list[int], tokenizer: Tokenizer, service: ShadowService,
                 lang: str = "en"):
        self.writer, self.tokenizer, self.service, self.lang = writer, tokenizer, service, lang
        tail = prompt[-2:]
        self.thinking = THINK in tail and END_THINK not in tail
        self.tool_ids: list[int] | None = None

    async def voice(self, said: list) -> list:
        """The voice's phrase after each line that takes one, written between the turn's rounds."""
        for line in said:
            if line.takes_phrase:
                recent = [x.text for x in self.writer.status.lines if x is not line][-4:]
                phrase = await asyncio.to_thread(self.service.voicing.phrase, self.writer.turn, line.kind, (), recent,
                                                 self.lang)
                if phrase is not None:
                    line.with_phrase(phrase.text, {"said": phrase.text is not None, "raw": phrase.raw,
                                                   "reason": phrase.reason, "seconds": round(phrase.seconds, 4)})
        return said

    def before(self, kind: str, value, now: float) -> tuple[list, str]:
        """The lines due before this event, and the event's kind (reasoning, content, tool, end)."""
        if kind != "token":
            return self.writer.before_delta(now, "end"), "end"
        if value == THINK:
            self.thinking = True
        elif value == END_THINK:
            self.thinking = False
        elif value == TOOL:
            self.tool_ids = []
        elif value == END_TOOL:
            self.tool_ids = None
        elif self.tool_ids is not None:
            self.tool_ids.append(value)
        if self.tool_ids is not None:
            text = self.tokenizer.decode(self.tool_ids)
            name = text.split("<function=", 1)[1].split(">", 1)[0] if "<function=" in text else ""
            return self.writer.before_delta(now, "tool", (name, text)), "tool"
        delta = "reasoning" if self.thinking else "content"
        return self.writer.before_delta(now, delta), delta


class Completion:
    """One response of the embedded engine, in the OpenAI shapes (and vLLM's ids when asked)."""

    def __init__(self, engine: EmbeddedCompletions, rid: str, created: int, chat: bool, want_ids: bool, prompt: list[int]):
        self.engine, self.rid, self.created, self.chat = engine, rid, created, chat
        self.want_ids, self.prompt = want_ids, prompt
        self.text = TextStream(engine.tokenizer)

    def chunk(self, token: int | None, text: str, finish: str | None, first: bool) -> dict:
        choice = {"index": 0, "finish_reason": finish}
        if self.want_ids:
            choice["token_ids"] = [] if token is None else [token]
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["text"] = text
        out = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.engine.model_name, "choices": [choice]}
        if first and self.want_ids:
            out["prompt_token_ids"] = self.prompt
        return out

    def event(self, kind: str, value, out: list[int], first: bool) -> tuple[str, bool]:
        """The SSE text of one event, and whether the stream ends with it."""
        if kind == "token":
            out.append(value)
            text = self.text.push(value) if value not in self.engine.eos else ""
            return f"data: {json.dumps(self.chunk(value, text, None, first))}\n\n", False
        if kind == "done":
            return f"data: {json.dumps(self.chunk(None, self.text.rest(), value, first))}\n\ndata: [DONE]\n\n", True
        return f"data: {json.dumps(error_body(value, 'server_error'))}\n\ndata: [DONE]\n\n", True

    async def sse(self, events: queue.Queue, lines: TokenLines | None = None, ended=lambda: None):
        out: list[int] = []
        try:
            while True:
                try:
                    batch = [await asyncio.to_thread(events.get, True, 1.0 if lines else None)]
                except queue.Empty:  # the engine is silent: lines that are due
                    said = await lines.voice(lines.writer.due(time.monotonic()))
                    yield b"".join(lines.writer.encode(said))
                    continue
                while True:  # whatever else is queued goes in the same write
                    try:
                        batch.append(events.get_nowait())
                    except queue.Empty:
                        break
                text = []
                for kind, value in batch:
                    if lines is not None:
                        said, delta = lines.before(kind, value, time.monotonic())
                        said = await lines.voice(said)
                        text.append(b"".join(lines.writer.encode(said) + lines.writer.resume(delta)).decode())
                    line, last = self.event(kind, value, out, first=not out)
                    text.append(line)
                    if last:
                        yield "".join(text)
                        return
                yield "".join(text)
        finally:
            ended()

    def whole(self, out: list[int], finish: str) -> dict:
        text = self.engine.tokenizer.decode([t for t in out if t not in self.engine.eos])
        choice = {"index": 0, "finish_reason": finish}
        choice.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
        n = len(self.prompt)
        result = {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                  "created": self.created, "model": self.engine.model_name, "choices": [choice],
                  "usage": {"prompt_tokens": n, "completion_tokens": len(out), "total_tokens": n + len(out)}}
        if self.want_ids:
            choice["token_ids"] = out
            result["prompt_token_ids"] = self.prompt
        return result


def parse_messages(raw) -> list[Message]:
    """OpenAI chat messages (content as text or text parts; assistant reasoning as
    `reasoning_content` or `reasoning`) as the in-code template's messages; a ShadowInputError for
    anything else."""
    if not isinstance(raw, list) or not raw:
        raise ShadowInputError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ShadowInputError(f"messages[{i}] needs a role of system, user, assistant or tool")
        content = m.get("content") or ""
        if isinstance(content, list):
            parts = [p.get("text", "") for p in content if isinstance(p, dict)]
            if not all(isinstance(p, str) for p in parts):
                raise ShadowInputError(f"messages[{i}].content parts must carry text")
            content = "".join(parts)
        if not isinstance(content, str):
            raise ShadowInputError(f"messages[{i}].content must be text")
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        out.append(Message(m["role"], content, reasoning if isinstance(reasoning, str) else None))
    return out


class TextStream:
    """Text of a stream of ids, piece by piece: each `push` returns what the new id adds, holding
    back a character split over ids until it is whole; `rest` returns what is still held. Work
    per id stays constant (a short window is decoded, never the whole output)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] decode to text already emitted
        self.read = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        done = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(done) :]
        return ""

    def rest(self) -> str:
        done = self.tokenizer.decode(self.ids[self.prefix : self.read])
        return self.tokenizer.decode(self.ids[self.prefix :])[len(done) :]

