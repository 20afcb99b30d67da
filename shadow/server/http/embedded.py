"""Embedded completions: OpenAI chat and completion requests answered by a Qwen3.5 checkpoint
generating in-process with the project's own forward (`server.generator`) on the device thread,
with the shadow reading between its rounds. Asked with `return_token_ids`, it returns ids the
vLLM way (`prompt_token_ids` on the first chunk or the body, `choices[].token_ids`), so another
`shadow serve` can use it as its engine. The ids the shadow reads are the ids it generated from
(its prompt once the generator has read it all, then each token): every turn is verified.

The queue is fair and bounded: at most `limits.max_generating` generations hold their state at
once (the rest wait in arrival order, `limits.max_queued` in all: a 429 beyond), and they take
turns on the device in slices (`Generation`): a slice runs prefill chunks and decode rounds until
the generation ends, or until it has held the device `SLICE_S` while another job waits, so a
short request is served between the chunks of a long prefill. A request whose client goes away
is cancelled at its next step (a stream's disconnect or close; a whole response's client is
looked for while it waits)."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable

from fastapi.responses import JSONResponse, Response

from shadow.engines.dialects import as_carried
from shadow.engines.idcheck import TurnIds, check_turn
from shadow.errors import ShadowInputError
from shadow.server import gcpauses
from shadow.server.gaps import LongGaps, RoundClock
from shadow.server.generator import Generator
from shadow.server.http.channels import Channel, LineWriter
from shadow.server.http.closing import ClosingStream
from shadow.server.http.errors import error_body, error_response
from shadow.server.http.lines import TurnStatus, said
from shadow.server.service import ShadowService
from shadow.server.settings import ServeSettings
from shadow.server.turn import ServedTurn
from shadow.server.voicing import voice_failed
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
        self.load = service.load  # the waiting line's queue and the reading rate
        self.slots = threading.Semaphore(settings.limits.max_generating)  # generations holding their state

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
            lines = TokenLines(writer, prompt, self.tokenizer, self.service, events, request_language(body))
        run = Generation(self, turn, prompt, max_tokens, stop_ids, events)
        threading.Thread(target=run.serve, name="shadow-turn", daemon=True).start()
        options = body.get("stream_options")
        with_usage = isinstance(options, dict) and bool(options.get("include_usage"))  # as OpenAI
        reply = Completion(self, rid, created, chat, want_ids, prompt, with_usage=with_usage)
        if body.get("stream"):
            def ended() -> None:
                self.load.answered(turn)
                if lines is not None:
                    self.service.journal_lines(turn, said(lines.writer.status.lines, lines.writer.status.started))

            async def closed() -> None:  # however the stream ended: a generation still running is cancelled
                if not run.over:
                    turn.client_gone = True

            return ClosingStream(reply.sse(events, lines, ended), on_close=closed,
                                 on_disconnect=lambda: setattr(turn, "client_gone", True),
                                 media_type="text/event-stream", headers={"x-shadow-session": session})
        out, finish = [], None
        try:
            while finish is None:
                try:
                    kind, value = await asyncio.to_thread(events.get, True, 0.5)
                except queue.Empty:
                    if disconnected is not None and await disconnected():
                        turn.client_gone = True  # nobody will read the answer: the generation stops
                        return Response(status_code=499)
                    continue
                if kind == "token":
                    out.append(value)
                elif kind == "done":
                    finish = value
                else:
                    return error_response(500, value, "server_error")
        finally:
            self.load.answered(turn)
        return JSONResponse(reply.whole(out, finish), headers={"x-shadow-session": session})


class Generation:
    """One request's generation: a slot among the engine's `slots`, then slices on the device
    thread until it is over; its turn is recorded and ended whatever happens (`serve`'s
    `finally`). Per round it adds two attribute reads to what the round did (and a clock read
    while another job waits)."""

    def __init__(self, engine: EmbeddedCompletions, turn: ServedTurn, prompt: list[int], max_tokens: int,
                 stop_ids: list[int], events: queue.Queue):
        self.engine, self.service, self.turn = engine, engine.service, turn
        self.prompt, self.max_tokens, self.stop_ids, self.events = prompt, max_tokens, stop_ids, events
        self.steps = None
        self.out: list[int] = []
        self.over = False  # its last event is out
        self.clock = RoundClock(self.service.counters.gaps, gcpauses.collected_s)  # its long gaps, taken apart

    def serve(self) -> None:
        """On its own thread: wait for a slot (giving up if the client goes away), then hand the
        device one slice after another; the turn ends in the `finally`."""
        turn, slots = self.turn, self.engine.slots
        held = False
        try:
            while not turn.client_gone and not held:
                held = slots.acquire(timeout=0.25)
            if not held:  # its client went away while it waited: nothing was read
                self._record()
                return
            while not self.service.run_request(self._slice):
                pass
        except Exception as e:  # noqa: BLE001 - the device has stopped, or the generator failed: the client is told
            self.events.put(("error", f"{type(e).__name__}: {e}"))
        finally:
            self.over = True
            if held:
                slots.release()
            if self.steps is not None:
                self.steps.close()
            self.service.voicing.drop_waiting(self.turn)
            self.service.end_turn(self.turn)

    def _slice(self) -> bool:
        """On the device thread: steps until the generation is over (True) or it has held the
        device `SLICE_S` while another job waits (False: it gives way, and goes on in its next
        slice). Its prompt is fed to the shadow once the generator has read it (at the first
        token: a request cancelled in its prefill leaves the shadow as it was)."""
        turn, service, device = self.turn, self.service, self.service.device
        if self.steps is None:
            self.steps = self.engine.generator.steps(self.prompt, self.max_tokens, self.stop_ids)
        clock, perf = self.clock, time.perf_counter
        start = perf()
        clock.back()
        try:
            while not turn.client_gone:
                stepped = perf()
                token = next(self.steps, END)
                if token is END:
                    break
                if token is not None:
                    if not self.out:
                        service.set_prompt(turn, self.prompt)
                        service.first_token(turn)
                    self.out.append(token)
                    self.events.put(("token", token))
                    clock.token(perf() - stepped)
                    # between two rounds: the output so far readable in the share, the share's slice, a
                    # step of the voice's phrase (its rounds hold the device: the voice is served between them)
                    begun, read, spoken = perf(), turn.share_used, turn.voice.used_s
                    service.between_rounds(turn, (token,))
                    clock.after(perf() - begun, turn.share_used - read, turn.voice.used_s - spoken)
                if device.queued() and perf() - start >= SLICE_S:
                    clock.away()
                    return False
        finally:  # the device goes to another job, or the turn ends: no phrase's fork is left open
            service.voicing.finish_phrases(turn)
        self._record()
        return True

    def _record(self) -> None:
        """Its last event and its check: its own engine, so its ids are the ones read (as far as the
        shadow took them: a cancelled request's prompt before its first token, not at all)."""
        out, eos = self.out, self.engine.eos
        self.service.voicing.drop_waiting(self.turn)  # its rounds are over: no phrase begins now
        if self.turn.client_gone:
            self.events.put(("error", "the request was cancelled: its client went away"))
        else:
            self.events.put(("done", "stop" if out and out[-1] in eos else "length"))
        self.over = True
        ids = TurnIds(list(self.prompt), "engine", list(out), "engine", prompt_tokens=len(self.prompt),
                      completion_tokens=len(out))
        if self.turn.client_gone:
            ids.notes.append(f"cancelled after {len(out)} token(s): its client went away")
            if not out:
                ids.output_source = None
                ids.output_skipped = "output not read: the request was cancelled before its first token"
        self.service.record_turn(self.turn, check_turn(ids), ids)


def _wrote(gaps: LongGaps, wrote: float | None) -> float:
    """A write of tokens now: the gap since the one before (`wrote`) to `gaps`; now."""
    now = time.perf_counter()
    if wrote is not None:
        gaps.add("write", now - wrote)
    return now


def _cancel_arrived(asked: asyncio.Future) -> None:
    """A phrase request that arrived after its stream closed: cancelled (dropped if not begun)."""
    if not asked.cancelled() and asked.exception() is None and asked.result() is not None:
        asked.result().cancel()


END = object()  # the generator's steps are over
SLICE_S = 0.1  # how long a generation holds the device while another job waits, before it gives way


THINK, END_THINK, TOOL, END_TOOL = 248068, 248069, 248058, 248059  # <think> </think> <tool_call> </tool_call>


class TokenLines:
    """The embedded engine's tokens classified for the status lines: reasoning between <think>
    and </think> (from the start, when the prompt opens a think block), a tool call between
    <tool_call> and </tool_call> (its text kept, to read its action and target), else content."""

    def __init__(self, writer: LineWriter, prompt: list[int], tokenizer: Tokenizer, service: ShadowService,
                 events: queue.Queue, lang: str = "en"):
        """`events`: the stream's queue, told ("lines", None) when a phrase held is written."""
        self.writer, self.tokenizer, self.service, self.lang = writer, tokenizer, service, lang
        self.events = events
        tail = prompt[-2:]
        self.thinking = THINK in tail and END_THINK not in tail
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

    def __init__(self, engine: EmbeddedCompletions, rid: str, created: int, chat: bool, want_ids: bool,
                 prompt: list[int], *, with_usage: bool = False):
        """`with_usage`: a stream's last chunk before [DONE] carries the usage, with no choices."""
        self.engine, self.rid, self.created, self.chat = engine, rid, created, chat
        self.want_ids, self.prompt, self.with_usage = want_ids, prompt, with_usage
        self.text = TextStream(engine.tokenizer)

    def usage(self, out: list[int]) -> dict:
        n = len(self.prompt)
        return {"prompt_tokens": n, "completion_tokens": len(out), "total_tokens": n + len(out)}

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

    def usage_chunk(self, out: list[int]) -> dict:
        return {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.engine.model_name, "choices": [], "usage": self.usage(out)}

    def event(self, kind: str, value, out: list[int], first: bool) -> tuple[str, bool]:
        """The SSE text of one event, and whether the stream ends with it."""
        if kind == "token":
            out.append(value)
            text = self.text.push(value) if value not in self.engine.eos else ""
            return f"data: {json.dumps(self.chunk(value, text, None, first))}\n\n", False
        if kind == "done":
            text = f"data: {json.dumps(self.chunk(None, self.text.rest(), value, first))}\n\n"
            if self.with_usage:  # as OpenAI: one more chunk, with no choices and the whole usage
                text += f"data: {json.dumps(self.usage_chunk(out))}\n\n"
            return text + "data: [DONE]\n\n", True
        return f"data: {json.dumps(error_body(value, 'server_error'))}\n\ndata: [DONE]\n\n", True

    async def sse(self, events: queue.Queue, lines: TokenLines | None = None, ended=lambda: None):
        """The stream's SSE text. Status lines go out before the delta they are due with; a line
        that takes a phrase is held while the turn's rounds write it (the tokens go on), and goes
        out when it is written, in order; at the last event every line still held goes out."""
        out: list[int] = []
        gaps, wrote = self.engine.service.counters.gaps, None  # the last write that carried tokens
        try:
            while True:
                try:
                    batch = [await asyncio.to_thread(events.get, True, 1.0)]
                except queue.Empty:  # the engine is silent (a long prefill): lines that are due
                    if lines is not None:
                        lines.hold(lines.writer.due(time.monotonic()))
                        yield b"".join(lines.writer.encode(lines.ready()))
                    continue
                while True:  # whatever else is queued goes in the same write
                    try:
                        batch.append(events.get_nowait())
                    except queue.Empty:
                        break
                text, tokens = [], False  # tokens: the text holds a token
                for kind, value in batch:
                    if kind == "lines":  # a phrase held is written
                        if lines is not None:
                            text.append(b"".join(lines.writer.encode(lines.ready())).decode())
                        continue
                    if lines is not None:
                        said, delta = lines.before(kind, value, time.monotonic())
                        lines.hold(said)
                        if kind != "token" and tokens:  # the tokens before the end go out now: only the
                            wrote = _wrote(gaps, wrote)  # end waits for its lines' phrases
                            yield "".join(text)
                            text, tokens = [], False
                        ready = lines.ready() if kind == "token" else await lines.rest()
                        text.append(b"".join(lines.writer.encode(ready) + lines.writer.resume(delta)).decode())
                    line, last = self.event(kind, value, out, first=not out)
                    text.append(line)
                    tokens = tokens or kind == "token"
                    if last:
                        if tokens:
                            wrote = _wrote(gaps, wrote)
                        yield "".join(text)
                        return
                if tokens:
                    wrote = _wrote(gaps, wrote)
                yield "".join(text)
        finally:
            if lines is not None:
                lines.close()
            ended()

    def whole(self, out: list[int], finish: str) -> dict:
        text = self.engine.tokenizer.decode([t for t in out if t not in self.engine.eos])
        choice = {"index": 0, "finish_reason": finish}
        choice.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
        result = {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                  "created": self.created, "model": self.engine.model_name, "choices": [choice],
                  "usage": self.usage(out)}
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

