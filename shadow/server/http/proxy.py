"""Proxy mode: requests pass to a real OpenAI-compatible engine and its responses come back as the
engine sent them (status, headers, body, SSE events as they arrive), less only what the proxy
itself asked for that the client did not (`shadow.engines.dialects`). The shadow reads beside it
the ids the engine read and wrote, from the best source the engine's dialect offers, and checks
every turn against what the engine shows (`shadow.engines.idcheck`).

Nothing the client sees depends on the shadow: ids the shadow cannot take are skipped, a stream
never waits for the device, engine bodies and events it cannot read (not JSON, numbers of
thousands of digits, nesting past `jsonlimits.MAX_DEPTH`) pass to the client untouched, and every
turn ends whatever happens to the stream: a streamed response is a `ClosingStream`, whose close
ends the turn in a `finally` even when the client went away before the stream started.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
from fastapi.responses import Response

from shadow.engines import jsonlimits
from shadow.engines.dialects import Asked, Dialect, Prompt, engine_root
from shadow.engines.idcheck import check_turn
from shadow.server.http.channels import Channel
from shadow.server.http.closing import ClosingStream
from shadow.server.http.deadlines import Deadlines
from shadow.server.http.errors import error_event, error_response
from shadow.server.http.lines import TurnStatus
from shadow.server.http.lines import said as shown_lines
from shadow.server.http.proxy_turn import Lines, ProxiedTurn
from shadow.server.service import ShadowService
from shadow.server.settings import ServeSettings
from shadow.server.turn import Phase, ServedTurn
from shadow.voice.checks import request_language

log = logging.getLogger("shadow.proxy")

# the client's headers the engine gets: credentials and content negotiation (content-type is
# set by the proxy itself: it forwards JSON)
PASS_HEADERS = ("authorization", "accept", "openai-organization", "openai-project", "x-request-id")
# the engine's headers the client does not get: hop by hop, or no longer true of the body
DROP_RESPONSE_HEADERS = ("content-length", "content-encoding", "transfer-encoding", "connection", "keep-alive",
                         "date", "server")


def passed_headers(request_headers) -> dict[str, str]:
    return {k: v for k, v in request_headers.items() if k.lower() in PASS_HEADERS}


def response_headers(upstream: httpx.Response, session: str | None) -> dict[str, str]:
    out = {k: v for k, v in upstream.headers.items() if k.lower() not in DROP_RESPONSE_HEADERS}
    if session:
        out["x-shadow-session"] = session
    return out


class Proxy:
    """The engine behind the shadow: its URL, its dialect, the HTTP clients."""

    def __init__(self, settings: ServeSettings, dialect: Dialect, service: ShadowService, tokenizer=None):
        """From `settings.engine`: the upstream URL, its own key (sent in place of the client's
        `Authorization`), whether it is asked for standing questions' labels, the timeout; from
        `settings.limits`: longer prompts than `max_prompt_tokens` pass to the engine, unread.
        `tokenizer`: the shadow's (the newest text of a turn for the voice)."""
        engine = settings.engine
        self.upstream = engine.upstream.rstrip("/")
        self.upstream_key = engine.upstream_key
        self.tokenizer = tokenizer
        self.timing = vars(settings.status.timing)  # TurnStatus's thresholds
        self.max_prompt_tokens = settings.limits.max_prompt_tokens
        self.root = engine_root(engine.upstream)
        self.dialect = dialect
        self.service = service
        self.label_from_upstream = engine.label_from_upstream
        self.first_byte_s, self.idle_s = engine.first_byte_timeout_s, engine.idle_timeout_s
        # an idle connection is given up before the engine would close it (llama.cpp: after 5 s), so
        # a request never goes out on a connection the engine has just closed. A completion's reads
        # are timed by its `Deadlines`; every other call waits at most `idle_s` for each read.
        limits = httpx.Limits(keepalive_expiry=3.0)
        self.completion_timeout = httpx.Timeout(None, connect=engine.connect_timeout_s)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.idle_s, connect=engine.connect_timeout_s),
                                        limits=limits)
        self.sync_client = httpx.Client(timeout=httpx.Timeout(self.idle_s, connect=engine.connect_timeout_s),
                                        limits=limits)  # /tokenize
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="shadow-prompt")
        self.load = service.load  # requests in flight to the engine, its prefill rate
        self._feeds: set[asyncio.Task] = set()  # hand-overs to the shadow in flight (held till done)

    async def close(self) -> None:
        await self.client.aclose()
        self.sync_client.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def engine_headers(self, request_headers) -> dict[str, str]:
        headers = passed_headers(request_headers)
        if self.upstream_key is not None:
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            headers["authorization"] = f"Bearer {self.upstream_key}"
        return headers

    def prompt(self, body: dict, chat: bool) -> Future:
        """The prompt ids the dialect knows before the response, computed in a thread beside the request."""
        return self.pool.submit(self.dialect.prompt, self.sync_client, self.root, body, chat)

    async def forward(self, request_headers, body: dict, turn: ServedTurn, before: Future, *, chat: bool,
                      session: str | None, channel: Channel = Channel("off"),
                      cached: Callable[[list[int]], int] | None = None) -> Response:
        """Forward one completion request; the turn is registered already and is ended here (once,
        through its `ProxiedTurn`). With a `channel` on (a streamed chat), status lines go to the
        client while the engine works; a request the engine keeps waiting has its stream opened at
        its first line. `before`: the prompt ids sought beside the request; `cached(prompt ids)`:
        how many of them the engine holds already (the shadow knows)."""
        service = self.service
        label = None
        if chat and self.label_from_upstream and service.standing is not None:
            label = label_asker(self.upstream, request_headers, body, service.standing)
        proxied = ProxiedTurn(turn, body, chat, session, before, label=label)
        asked = self.dialect.ask(body, chat)
        if chat and proxied.stream and channel.on:
            proxied.lines = Lines(channel, TurnStatus(time.monotonic(), **self.timing), self.load, turn, before, cached)
        self.load.sent(turn, time.monotonic())
        proxied.deadlines = Deadlines(self.first_byte_s, self.idle_s)
        url = self.upstream + ("/chat/completions" if chat else "/completions")
        sending = asyncio.ensure_future(self._send(url, asked, proxied, request_headers))
        try:
            return await self._answer(proxied, sending, session)
        except asyncio.CancelledError:  # the client went away before its response began
            await self._client_gone(proxied, sending)
            raise

    async def _answer(self, proxied: ProxiedTurn, sending: asyncio.Future, session: str | None) -> Response:
        """The client's response to a request sent: a stream, or the engine's whole answer."""
        headers = {"x-shadow-session": session} if session else {}
        if proxied.lines is not None:
            done, _ = await asyncio.wait({sending}, timeout=proxied.lines.status.quiet_s)
            if not done:  # the engine keeps the request waiting: its stream opens at the first line
                return ClosingStream(self._relay_when_answered(proxied, sending),
                                     on_close=lambda: self._closed(proxied, sending),
                                     status_code=200, media_type="text/event-stream", headers=headers)
        try:
            upstream, asked = await sending
        except httpx.TimeoutException as e:
            await self._end_unanswered(proxied, "timeout")
            return error_response(504, f"upstream timeout: {_said(e)}", "upstream_timeout")
        except httpx.HTTPError as e:
            await self._end_unanswered(proxied, "unreachable")
            return error_response(502, f"upstream unreachable: {type(e).__name__}: {e}", "upstream_error")
        proxied.added = asked.added
        headers = response_headers(upstream, session)
        if upstream.status_code != 200 or not proxied.stream:
            return await self._whole_response(proxied, upstream, headers)
        finished = asyncio.get_running_loop().create_future()
        finished.set_result((upstream, asked))
        return ClosingStream(self._relay(proxied, upstream), on_close=lambda: self._closed(proxied, finished),
                             status_code=200, headers=headers)

    async def _client_gone(self, proxied: ProxiedTurn, sending: asyncio.Future) -> None:
        """A request whose client went away before its response began (`transfers.Transfers`
        cancels it): the engine's request is closed, and the turn ends as `_closed` ends one."""
        if not sending.done():
            sending.cancel()
        elif not sending.cancelled() and sending.exception() is None:
            await sending.result()[0].aclose()
        turn = proxied.turn
        if turn.reach(Phase.ENDING):
            turn.notes.append("the client went away before the engine answered: its request was closed")
            self.load.answered(turn)
            await asyncio.to_thread(self._finish, proxied)

    async def _whole_response(self, proxied: ProxiedTurn, upstream: httpx.Response, headers: dict) -> Response:
        """A response that is not a 200 stream: read whole, passed on (less what the proxy added)."""
        try:
            content = await proxied.deadlines.read(upstream)
        except httpx.TimeoutException as e:
            await self._end_unanswered(proxied, "timeout")
            return error_response(504, f"upstream timeout: {_said(e)}", "upstream_timeout")
        except httpx.HTTPError as e:
            await self._end_unanswered(proxied, "broke_off")
            return error_response(502, f"the engine's response broke off: {type(e).__name__}: {e}", "upstream_error")
        finally:
            await upstream.aclose()
        if upstream.status_code != 200:
            await self._end_unanswered(proxied, f"status_{upstream.status_code // 100}xx")
            return Response(content, status_code=upstream.status_code, headers=headers)
        try:
            content = self._whole(content, proxied)
        finally:
            self._finish_later(proxied)
        return Response(content, status_code=200, headers=headers)

    def _whole(self, content: bytes, proxied: ProxiedTurn) -> bytes:
        """A whole response body as the client gets it (less what the proxy added); the shadow
        reads it on the way. A body it cannot read (not JSON, a number of thousands of digits,
        nesting past the limit), or cannot clean, passes as the engine sent it."""
        reply = proxied.turn.shown.reply
        event = _json(content)
        if event is None:
            reply.malformed += 1
            return content
        try:
            reply.read(event, proxied.chat)
            cleaned = self.dialect.clean(event, proxied.added, proxied.body)
            return content if cleaned is event else json.dumps(cleaned, ensure_ascii=False).encode()
        except Exception:  # noqa: BLE001 - the client's response never depends on the shadow
            reply.malformed += 1
            log.exception("a response body could not be read; it passes as the engine sent it")
            return content

    async def _closed(self, proxied: ProxiedTurn, sending: asyncio.Future) -> None:
        """A streamed response is over (its ClosingStream's close): the turn ends here unless its
        stream already saw to it (a stream whose client went away before it started never ran)."""
        if proxied.turn.phase >= Phase.ENDING:
            return
        if not sending.done():
            sending.cancel()
        elif not sending.cancelled() and sending.exception() is None:
            await sending.result()[0].aclose()
        proxied.turn.notes.append("the client went away before the response was relayed")
        self._finish_later(proxied)

    async def _send(self, url: str, asked: Asked, proxied: ProxiedTurn, request_headers
                    ) -> tuple[httpx.Response, Asked]:
        """Send the request as the dialect asks it; an engine that refuses what the proxy added
        (a 400 or 422) gets the client's request as it came instead: the client's response never
        depends on the shadow (that turn's ids then come from what the engine shows unasked)."""
        headers, deadlines = self.engine_headers(request_headers), proxied.deadlines

        def post(body: dict):
            request = self.client.build_request("POST", url, json=body, headers=headers, timeout=self.completion_timeout)
            return deadlines.within(self.client.send(request, stream=True))

        try:
            upstream = await post(asked.body)
        except httpx.RemoteProtocolError:  # a keep-alive connection the engine had closed: no response came
            upstream = await post(asked.body)
        if upstream.status_code not in (400, 422) or not asked.added:
            return upstream, asked
        try:
            refusal = _error_summary(upstream.status_code, await Deadlines(self.idle_s, self.idle_s).read(upstream))
        finally:
            await upstream.aclose()
        self.service.count_upstream_error("refused_added_fields")
        fields = ", ".join(sorted(asked.added))
        log.warning("the engine refused the fields the proxy adds (%s): %s; sent as the client sent it", fields, refusal)
        proxied.turn.notes.append(f"the engine refused {fields}: sent as the client sent it")
        return await post(proxied.body), Asked(proxied.body, frozenset())

    async def _end_unanswered(self, proxied: ProxiedTurn, error: str) -> None:
        """A turn the engine did not answer (unreachable, refused, broken off): counted as an
        upstream error of kind `error`, and ended unread."""
        self.service.count_upstream_error(error)
        proxied.before.cancel()
        turn = proxied.turn
        turn.reach(Phase.ENDING)
        self.load.answered(turn)
        await asyncio.to_thread(self.service.end_turn, turn)

    async def _relay_when_answered(self, proxied: ProxiedTurn, sending: asyncio.Future):
        """The client's stream, opened before the engine answered: lines while it waits, then
        the engine's stream; an engine that refuses or fails ends it with an error object."""
        lines = proxied.lines
        while not sending.done():
            for data in lines.encode(lines.due(time.monotonic())):
                yield data
            await asyncio.wait({sending}, timeout=lines.status.until_due(time.monotonic()))
        failure = error = None
        kind = "upstream_error"
        try:
            upstream, asked = sending.result()
            proxied.added = asked.added
        except httpx.TimeoutException as e:
            failure, error, kind = f"upstream timeout: {_said(e)}", "timeout", "upstream_timeout"
        except httpx.HTTPError as e:
            failure, error = f"upstream unreachable: {type(e).__name__}: {e}", "unreachable"
        else:
            if upstream.status_code != 200:
                error = f"status_{upstream.status_code // 100}xx"
                try:
                    content = (await proxied.deadlines.read(upstream)).decode("utf-8", "replace")
                except httpx.HTTPError:
                    content = ""
                await upstream.aclose()
                failure = f"the engine answered {upstream.status_code}: {content[:500]}"
        if failure is not None:
            await self._end_unanswered(proxied, error)
            yield error_event(failure, kind) + b"data: [DONE]\n\n"
            return
        relay = self._relay(proxied, upstream)
        try:
            async for data in relay:
                yield data
        finally:
            await relay.aclose()  # closed with this one (its `finally` ends the turn)

    async def _relay(self, proxied: ProxiedTurn, upstream: httpx.Response):
        """The engine's stream, event by event, as it sent it (less what the proxy added), with
        status lines between events; the shadow is fed beside it (`_feed_beside`), the stream never
        waiting for the device or for the feed."""
        pieces: asyncio.Queue = asyncio.Queue()

        async def pump():
            try:
                async for piece in proxied.deadlines.pieces(upstream):
                    await pieces.put(piece)
            except httpx.HTTPError as e:
                await pieces.put(e)
            finally:
                await pieces.put(None)

        pumping = asyncio.ensure_future(pump())
        turn, lines = proxied.turn, proxied.lines
        reply = turn.shown.reply
        buffer, boundary = b"", True
        gaps, wrote, fed = self.service.counters.gaps, None, 0.0  # the last write of events; the last feed's seconds
        feeding: asyncio.Task | None = None  # the turn's hand-over in flight (at most one)
        try:
            while True:
                try:
                    wait = lines.status.until_due(time.monotonic()) if lines is not None else None
                    piece = await asyncio.wait_for(pieces.get(), timeout=wait)
                except asyncio.TimeoutError:
                    piece = b""
                arrived = time.perf_counter()
                if piece is None:
                    break
                if isinstance(piece, httpx.TimeoutException):  # the engine fell silent: the client is told
                    self.service.count_upstream_error("timeout")
                    yield error_event(f"upstream timeout: {_said(piece)}", "upstream_timeout")
                    break
                if isinstance(piece, httpx.HTTPError):  # the engine broke off mid-stream: the client is told
                    self.service.count_upstream_error("broke_off")
                    yield error_event(f"the engine's stream broke off: {type(piece).__name__}: {piece}", "upstream_error")
                    break
                buffer += piece
                *complete, buffer = buffer.split(b"\n")
                out, carried = [], False  # carried: an event among the lines
                for line in complete:
                    event = _event(line)
                    carried = carried or event is not None
                    if lines is not None and event is not None and boundary:
                        said, kind = lines.before_event(event, reply, time.monotonic())
                        out += lines.encode(await self._voice(said, proxied)) + lines.resume(kind)
                    out.append(self._line(line, event, proxied))
                    boundary = line.strip() == b""
                    if event is not None and reply.events == 1:
                        self.service.first_token(turn)  # at once: the share counts from here
                if lines is not None and boundary:
                    out += lines.encode(await self._voice(lines.due(time.monotonic()), proxied))
                if out:
                    if carried:
                        now = time.perf_counter()  # a gap: the engine's, what the proxy held, its last feed
                        if feeding is not None and feeding.done() and not feeding.cancelled():
                            fed = feeding.result()
                        if wrote is not None:
                            gaps.add("write", now - wrote, {"held": now - arrived, "feed": fed})
                        wrote = now
                    yield b"".join(out)
                if feeding is None or feeding.done():
                    feeding = self._feed_beside(proxied)
            if buffer:
                yield self._line(buffer, _event(buffer), proxied).rstrip(b"\n")
        finally:
            pumping.cancel()
            await upstream.aclose()
            self._finish_later(proxied)

    def _feed_beside(self, proxied: ProxiedTurn) -> asyncio.Task:
        """`_feed` as a task beside the stream; the turn's `feed_idle` is clear until the turn's
        latest hand-over is done (its end waits for it) and the proxy holds the task till then. A
        task's done callback runs after `done()` is already true, so an earlier task's callback may
        come after the next task started: only the latest sets `feed_idle`, else the turn's end
        would feed beside a hand-over still in flight (its ids taken twice)."""
        idle = proxied.turn.shown.feed_idle
        idle.clear()
        task = asyncio.ensure_future(self._feed(proxied))
        self._feeds.add(task)
        proxied.feeding = task

        def done(_) -> None:
            self._feeds.discard(task)
            if proxied.feeding is task:
                idle.set()

        task.add_done_callback(done)
        return task

    async def _feed(self, proxied: ProxiedTurn) -> float:
        """What the engine has shown so far is handed to the shadow if the device is free (never
        waited for), with a slice of the share; a failure is logged once a turn. Its seconds."""
        turn = proxied.turn
        start = time.perf_counter()
        try:
            proxied.take_shown(self.max_prompt_tokens)
            await asyncio.to_thread(self.service.feed_due, turn, wait=False, share=True)
        except Exception:  # noqa: BLE001 - the client's stream never depends on the shadow
            if "feeding failed" not in turn.notes:
                turn.notes.append("feeding failed")
                log.exception("the shadow could not be fed between events of turn %s", turn.id,
                              extra={"session": turn.session, "turn": turn.id})
        return time.perf_counter() - start

    async def _voice(self, said: list, proxied: ProxiedTurn) -> list:
        """The voice's phrase after each line that takes one (thinking, decided, writing), where
        the turn's voice budget and the device allow it now; a stream never waits for more than
        one phrase's slice."""
        voicing = self.service.voicing
        if not said or self.tokenizer is None or voicing.voice is None:
            return said
        turn, lines = proxied.turn, proxied.lines
        shown = turn.shown
        for line in said:
            if not line.takes_phrase:
                continue
            reply = shown.reply
            extra = [] if shown.fed_output else self.tokenizer.encode("".join(reply.reasoning) + "".join(reply.content))
            recent = [x.text for x in lines.status.lines if x is not line][-4:]
            phrase = await asyncio.to_thread(voicing.phrase, turn, line.kind, extra[-2048:],
                                             recent, request_language(proxied.body))
            if phrase is not None:
                line.with_phrase(phrase.text, {"said": phrase.text is not None, "raw": phrase.raw,
                                               "reason": phrase.reason, "seconds": round(phrase.seconds, 4)})
        return said

    def _line(self, line: bytes, event: dict | None, proxied: ProxiedTurn) -> bytes:
        """One SSE line as the client gets it; the shadow reads its event on the way. A line it
        cannot read or clean passes as the engine sent it."""
        if event is None:
            return line + b"\n"
        reply = proxied.turn.shown.reply
        try:
            reply.read(event, proxied.chat)
            if not proxied.added:
                return line + b"\n"
            cleaned = self.dialect.clean(event, proxied.added, proxied.body)
            if cleaned is event:
                return line + b"\n"
            if cleaned is None:
                return b""  # an event the client did not ask for (its blank line stays: an empty event)
            return b"data: " + json.dumps(cleaned, ensure_ascii=False).encode() + b"\n"
        except Exception:  # noqa: BLE001 - the client's stream never depends on the shadow
            reply.malformed += 1
            log.exception("an event could not be read; it passes as the engine sent it")
            return line + b"\n"

    def _finish_later(self, proxied: ProxiedTurn) -> None:
        """The turn's end (`_finish`) on a thread of its own, once, whichever path gets here first."""
        turn = proxied.turn
        if not turn.reach(Phase.ENDING):
            return
        self.load.answered(turn)
        context = contextvars.copy_context()  # the request's log fields follow the turn
        threading.Thread(target=context.run, args=(self._finish, proxied), name="shadow-turn-end", daemon=True).start()

    def _finish(self, proxied: ProxiedTurn) -> None:
        """After the response: settle the turn's ids, feed what waited, check the turn against the
        engine, ask the upstream for a standing question's label, end the turn. Always ends it."""
        service, turn = self.service, proxied.turn
        shown = turn.shown
        try:
            if not shown.feed_idle.wait(timeout=120):  # the hand-over beside the stream, still in flight
                turn.notes.append("a hand-over to the shadow was still in flight after 120 s")
            try:
                prompt = proxied.before.result(timeout=120)
            except Exception as e:  # noqa: BLE001 - a prompt that could not be had: the turn says why
                prompt = Prompt(None, None, [f"the prompt could not be had ({type(e).__name__}: {e})"])
            ids = self.dialect.turn_ids(shown.reply, prompt, proxied.body, proxied.chat)
            ids.notes += turn.notes
            if ids.prompt is not None and self.max_prompt_tokens is not None and len(ids.prompt) > self.max_prompt_tokens:
                ids.notes.append(f"a prompt of {len(ids.prompt):,} ids, over the limit of {self.max_prompt_tokens:,}: not read")
                ids.prompt, ids.prompt_source, ids.output, ids.output_source = None, None, [], None
                shown.prompt_due, shown.output_due = None, []
            if ids.prompt is not None and ids.prompt != (shown.fed_prompt or shown.prompt_due):
                if shown.fed_prompt is not None:
                    ids.notes.append("the prompt fed first was replaced")
                shown.fed_prompt, shown.prompt_due = None, list(ids.prompt)
            if ids.output_source == "engine":
                shown.output_due += ids.output[shown.fed_output + len(shown.output_due):]
            elif ids.output:
                shown.output_due = list(ids.output)
            service.feed_due(turn, wait=True, share=False)
            lines = proxied.lines
            said = [] if lines is None else shown_lines(lines.status.lines, lines.status.started)
            service.record_turn(turn, check_turn(ids), ids, said)
            if turn.hold_output:
                service.predict(turn, self.dialect.next_prompt(proxied.body, shown.reply, proxied.chat))
            if proxied.label is not None and service.wants_label(turn):
                service.upstream_label(turn, *proxied.label())
        except Exception:  # noqa: BLE001 - logged, and the turn still ends
            log.exception("the shadow could not finish turn %s", turn.id, extra={"session": turn.session, "turn": turn.id})
        finally:
            service.end_turn(turn)


def _said(e: httpx.TimeoutException) -> str:
    """A timeout in words: ours say which limit passed; httpx's own (the connection) say little."""
    if isinstance(e, httpx.ConnectTimeout):
        return f"the engine did not accept a connection in time ({type(e).__name__})"
    return str(e) or type(e).__name__


def _error_summary(status: int, body: bytes) -> str:
    """An engine's refusal for the log: its status and its error's type and message, never its
    body (an engine may echo the request, prompt included)."""
    event = _json(body)
    error = event.get("error") if isinstance(event, dict) else None
    if isinstance(error, dict):
        return f"{status} {str(error.get('type', ''))[:60]}: {str(error.get('message', ''))[:120]}"
    if isinstance(event, dict) and isinstance(event.get("detail"), str):
        return f"{status}: {event['detail'][:120]}"
    return f"{status} (an error body of {len(body)} bytes)"


def _event(line: bytes) -> dict | None:
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if data == b"[DONE]":
        return None
    return _json(data)


def _json(data: bytes):
    """A JSON object within the limits (`jsonlimits.loads`), or None for anything else: not JSON,
    not UTF-8, a number of thousands of digits, nesting past the limit (such a body or event
    passes to the client as the engine sent it, unread)."""
    try:
        event = jsonlimits.loads(data)
    except (jsonlimits.JSONLimitError, RecursionError):
        return None
    return event if isinstance(event, dict) else None


def label_asker(upstream: str, request_headers, body: dict, question) -> Callable[[], tuple[str | None, str | None]]:
    """A function that asks the upstream model the standing question after the turn's messages
    (one token, greedy) and returns (the label if the answer is one of the choices, the answer)."""
    headers = passed_headers(request_headers)
    request = {"messages": list(body["messages"]) + [{"role": "user", "content": question.text}],
               "max_tokens": 1, "temperature": 0, "stream": False}
    if "model" in body:
        request["model"] = body["model"]

    def ask() -> tuple[str | None, str | None]:
        try:
            r = httpx.post(upstream.rstrip("/") + "/chat/completions", json=request, headers=headers, timeout=120)
            r.raise_for_status()
            answer = (r.json()["choices"][0]["message"].get("content") or "").strip()
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
            log.warning("the upstream gave no label: %s", e)
            return None, None
        return (answer if answer in question.labels else None), answer

    return ask

