"""Embedded completions: OpenAI chat and completion requests answered by a Qwen3.5 checkpoint
generating in-process with the project's own forward (`server.generator`) on the device thread,
with the shadow reading between its rounds. Asked with `return_token_ids`, it returns ids the
vLLM way (`prompt_token_ids` on the first chunk or the body, `choices[].token_ids`), so another
`shadow serve` can use it as its engine. The ids the shadow reads are the ids it generated from
(its prompt once the generator has read it all, then each token): every turn is verified.

The queue is fair and bounded: at most `limits.max_generating` generations hold their state at
once (the rest wait in arrival order, `limits.max_queued` in all: a 429 beyond), and they take
turns on the device in slices (`server.generation`): a slice runs prefill chunks and decode rounds until
the generation ends, or until it has held the device `SLICE_S` while another job waits, so a
short request is served between the chunks of a long prefill. A request whose client goes away
is cancelled at its next step (a stream's disconnect or close; a whole response's client is
looked for while it waits)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable

from fastapi.responses import JSONResponse, Response

from shadow.engines.dialects import as_carried
from shadow.errors import ShadowInputError
from shadow.server.events import Events
from shadow.server.generation import EmbeddedEngine, StreamEvents
from shadow.server.generator import Generator
from shadow.server.http.channels import Channel, LineWriter
from shadow.server.http.closing import ClosingStream
from shadow.server.http.errors import error_response
from shadow.server.http.lines import TurnStatus, said
from shadow.server.http.shapes import Completion, parse_messages
from shadow.server.service import ShadowService
from shadow.server.settings import ServeSettings
from shadow.server.turn import ServedTurn
from shadow.server.voicing import voice_failed
from shadow.text.chat import render_prompt
from shadow.text.chat_template import ChatRenderer
from shadow.text.tokenizer import SpecialIds, Tokenizer
from shadow.voice.checks import request_language


class EmbeddedCompletions:
    """Completions from `generator` under `model_name`; `renderer`: the chat template to render
    chat requests with (None: the in-code one of `shadow.text.chat`)."""

    def __init__(self, settings: ServeSettings, service: ShadowService, generator: Generator, tokenizer: Tokenizer,
                 model_name: str, renderer: ChatRenderer | None = None):
        self.service, self.tokenizer = service, tokenizer
        self.engine = EmbeddedEngine(service, generator, settings.limits.max_generating)
        self.model_name, self.limits = model_name, settings.limits
        self.renderer, self.template_kwargs = renderer, dict(settings.engine.template_kwargs)
        self.timing = vars(settings.status.timing)  # TurnStatus's thresholds
        self.load = service.load  # the waiting line's queue and the reading rate

    def full(self) -> bool:
        """Whether `limits.max_queued` requests are generating or waiting already (a 429 then)."""
        return self.service.embedded_in_flight() >= self.limits.max_queued

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
                       channel: Channel = Channel("off"), *, disconnected: Callable[[], Awaitable[bool]] | None = None
                       ) -> Response:
        """Answer one request (`parse` gave its prompt and tokens), whose turn has begun: it is
        named here, and its `Generation` feeds the prompt, generates and ends the turn.
        `disconnected()`: whether the client of a whole (not streamed) response has gone."""
        session = self.service.name_turn(turn, prompt)  # (what raises here or below ends the turn: the app's)
        want_ids = bool(body.get("return_token_ids"))  # as vLLM: ids only when asked for
        rid, created = f"cmpl-{uuid.uuid4().hex[:16]}", int(time.time())
        events = StreamEvents()  # a generation runs at most a few events ahead of its relay
        self.load.sent(turn, time.monotonic(), len(prompt))  # no prefix cache: it reads the whole prompt
        lines = None
        if chat and body.get("stream") and channel.on:
            writer = LineWriter(channel, TurnStatus(time.monotonic(), new_tokens=len(prompt), **self.timing), self.load,
                                turn)
            writer.like = {"id": rid, "created": created, "model": self.model_name}
            lines = TokenLines(writer, prompt, self.tokenizer, self.service, events, request_language(body))
        run = self.engine.start(turn, prompt, max_tokens, events, ignore_eos=bool(body.get("ignore_eos")))
        options = body.get("stream_options")
        with_usage = isinstance(options, dict) and bool(options.get("include_usage"))  # as OpenAI
        reply = Completion(self.tokenizer, self.model_name, self.engine.eos, rid, created, chat=chat, want_ids=want_ids,
                           prompt=prompt, with_usage=with_usage)
        if body.get("stream"):
            def ended() -> None:
                self.load.answered(turn)
                if lines is not None:
                    self.service.journal_lines(turn, said(lines.writer.status.lines, lines.writer.status.started))

            async def closed() -> None:  # however the stream ended: a generation still running is cancelled
                if not run.over:
                    turn.client_gone = True

            return ClosingStream(reply.sse(events, self.service.counters.gaps, lines, ended), on_close=closed,
                                 on_disconnect=lambda: setattr(turn, "client_gone", True),
                                 media_type="text/event-stream", headers={"x-shadow-session": session})
        out, finish = [], None
        try:
            while finish is None:
                event = await events.get(0.5)
                if event is None:
                    if disconnected is not None and await disconnected():
                        turn.client_gone = True  # nobody will read the answer: the generation stops
                        return Response(status_code=499)
                    continue
                kind, value = event
                if kind == "token":
                    out.append(value)
                elif kind == "done":
                    finish = value
                else:
                    return error_response(500, value, "server_error")
        finally:
            self.load.answered(turn)
        return JSONResponse(reply.whole(out, finish), headers={"x-shadow-session": session})


def _cancel_arrived(asked: asyncio.Future) -> None:
    """A phrase request that arrived after its stream closed: cancelled (dropped if not begun)."""
    if not asked.cancelled() and asked.exception() is None and asked.result() is not None:
        asked.result().cancel()


class TokenLines:
    """The embedded engine's tokens classified for the status lines: reasoning between <think>
    and </think> (from the start, when the prompt opens a think block), a tool call between
    <tool_call> and </tool_call> (its text kept, to read its action and target), else content."""

    def __init__(self, writer: LineWriter, prompt: list[int], tokenizer: Tokenizer, service: ShadowService,
                 events: Events, lang: str = "en"):
        """`events`: the stream's events, told ("lines", None) when a phrase held is written."""
        self.writer, self.tokenizer, self.service, self.lang = writer, tokenizer, service, lang
        self.events = events
        self.marks = marks = SpecialIds.of(tokenizer)
        tail = prompt[-2:]
        self.thinking = marks.think is not None and marks.think in tail and marks.end_think not in tail
        self.tool_ids: list[int] | None = None
        self.held: deque = deque()  # (line, its phrase's task or None), in the order they were due

    def hold(self, said: list) -> None:
        """Lines due, in order, each that takes a phrase with the voice's phrase begun: the stream
        goes on while the turn's rounds write it, and the line goes out once it is written."""
        for line in said:
            task = None
            if line.takes_phrase and self.service.voicing.voice is not None:
                recent = [x.text for x in self.writer.status.lines if x is not line][-4:]
                task = asyncio.ensure_future(self._phrase(line, recent))
                task.add_done_callback(self._wake)
            self.held.append((line, task))

    def ready(self, everything: bool = False) -> list:
        """The lines held whose phrases are written (or not tried), in order: a line waits for
        the ones before it. `everything`: every line held, one whose phrase is not written without it."""
        out = []
        while self.held and (everything or self.held[0][1] is None or self.held[0][1].done()):
            line, task = self.held.popleft()
            phrase = task.result() if task is not None and task.done() and not task.cancelled() else None
            if phrase is not None:
                line.with_phrase(phrase.text, {"said": phrase.text is not None, "raw": phrase.raw,
                                               "reason": phrase.reason, "seconds": round(phrase.seconds, 4)})
            out.append(line)
        return out

    async def rest(self, wait_s: float = 1.0) -> list:
        """At the turn's last event: the phrases still being written waited for (at most `wait_s`),
        then every line held; a phrase not written by then is given up (its line goes without it)."""
        tasks = [task for _, task in self.held if task is not None and not task.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=wait_s)
        self.close()
        return self.ready(everything=True)

    def close(self) -> None:
        """The stream is over: the phrases still held are given up."""
        for _, task in self.held:
            if task is not None:
                task.cancel()

    def _wake(self, _task) -> None:
        self.events.put(("lines", None))

    async def _phrase(self, line, recent: list[str]):
        voicing, turn = self.service.voicing, self.writer.turn
        asked = asyncio.ensure_future(asyncio.to_thread(voicing.request, turn, line.kind, (), recent, self.lang))
        try:
            request = await asyncio.shield(asked)  # a request on its way is cancelled when it arrives
        except asyncio.CancelledError:  # the stream closed while the request was being made
            asked.add_done_callback(_cancel_arrived)
            return None
        if request is None:
            return None
        try:
            return await asyncio.wrap_future(request)
        except asyncio.CancelledError:  # never begun before the turn's rounds ended, or the stream closed
            request.cancel()
            return None
        except Exception:  # noqa: BLE001 - the line goes out with its facts alone
            voice_failed(turn, line.kind)
            return None

    def before(self, kind: str, value, now: float) -> tuple[list, str]:
        """The lines due before this event, and the event's kind (reasoning, content, tool, end)."""
        if kind != "token":
            return self.writer.before_delta(now, "end"), "end"
        marks = self.marks
        if value == marks.think:
            self.thinking = True
        elif value == marks.end_think:
            self.thinking = False
        elif value == marks.tool:
            self.tool_ids = []
        elif value == marks.end_tool:
            self.tool_ids = None
        elif self.tool_ids is not None:
            self.tool_ids.append(value)
        if self.tool_ids is not None:
            text = self.tokenizer.decode(self.tool_ids)
            name = text.split("<function=", 1)[1].split(">", 1)[0] if "<function=" in text else ""
            return self.writer.before_delta(now, "tool", (name, text)), "tool"
        delta = "reasoning" if self.thinking else "content"
        return self.writer.before_delta(now, delta), delta
