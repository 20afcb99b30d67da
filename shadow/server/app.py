"""The HTTP service: OpenAI-compatible completions (from the embedded generator, or passed to an
upstream engine in proxy mode) and the shadow's endpoints. Asked with `return_token_ids`, the
embedded generator returns ids the vLLM way (`prompt_token_ids` on the first chunk or the body,
`choices[].token_ids`), so another `shadow serve` can use it as its engine."""

from __future__ import annotations

import asyncio
import itertools
import json
import queue
import threading
import time
import uuid
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from shadow.chat import Message, render_prompt, render_question
from shadow.chat_template import ChatRenderer
from shadow.errors import ShadowInputError, ShadowNotExact, ShadowUnavailable
from shadow.server.dialects import Dialect, EngineChoice, as_carried
from shadow.server.generator import Generator
from shadow.server.idcheck import TurnIds, check_turn
from shadow.server.proxy import Proxy, passed_headers, response_headers
from shadow.server.service import ShadowService
from shadow.tokenizer import Tokenizer

MAX_CHOICES = 26
MAX_QUESTION_TOKENS = 8192
SESSION_HEADERS = ("x-session-id", "x-openwebui-chat-id")


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


def create_app(
    service: ShadowService, tokenizer: Tokenizer, model_name: str, generator: Generator | None = None,
    upstream: str | None = None, dialect: Dialect | str | None = None, renderer: ChatRenderer | None = None,
    session_headers: tuple[str, ...] = SESSION_HEADERS, label_from_upstream: bool = False,
    template_kwargs: dict | None = None,
) -> FastAPI:
    """Embedded mode with a `generator`; proxy mode with an `upstream` base URL (…/v1), whose
    engine speaks `dialect` (a name, a Dialect, or None: probed at start). `renderer` is the big
    model's chat template and tokenizer (proxy: for the dialects that render; embedded: the
    generator's template, else the in-code one of `shadow.chat`). A request's session: the first
    of `session_headers` it carries, else the service's choice (`ShadowService.session_for`)."""
    session_headers = tuple(h.lower() for h in session_headers)
    if (generator is None) == (upstream is None):
        raise ValueError("give a generator (embedded mode) or an upstream (proxy mode)")
    turn_ids = itertools.count(1)
    eos_id = service.config.eos_token_id if generator is None else generator.model.config.eos_token_id
    eos = [eos_id]
    engine = EngineChoice(upstream, dialect, renderer, eos_id, template_kwargs) if upstream else None
    proxy_of: dict[str, Proxy] = {}

    def proxy() -> Proxy:
        if "p" not in proxy_of:
            proxy_of["p"] = Proxy(upstream, engine.dialect or Dialect(renderer, eos_id=eos_id), service,
                                  label_from_upstream)
        return proxy_of["p"]

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()
        if engine is not None:
            await asyncio.to_thread(engine.choose)
            service.engine = engine.describe()
        yield
        if proxy_of:
            await proxy_of["p"].close()
        await asyncio.to_thread(service.stop)  # a planned stop: sessions go to disk

    app = FastAPI(title="shadow serve", lifespan=lifespan)

    @app.exception_handler(ShadowInputError)
    async def bad_input(request: Request, exc: ShadowInputError):
        return error(400, str(exc))

    @app.exception_handler(ShadowUnavailable)
    async def unavailable(request: Request, exc: ShadowUnavailable):
        return error(503, str(exc), "unavailable")

    @app.exception_handler(ShadowNotExact)
    async def not_exact(request: Request, exc: ShadowNotExact):
        return error(409, str(exc), "not_exact")

    def session_named(body: dict) -> str:
        session = body.get("session")
        if not isinstance(session, str) or not session:
            raise ShadowInputError("'session' must be a session name")
        return session

    async def body_of(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ShadowInputError(f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ShadowInputError("the body must be a JSON object")
        return body

    @app.get("/v1/models")
    async def models(request: Request):
        if upstream:
            try:
                r = await proxy().client.get(upstream.rstrip("/") + "/models", headers=passed_headers(request.headers))
            except httpx.HTTPError as e:
                return error(502, f"upstream unreachable: {type(e).__name__}: {e}", "upstream_error")
            return Response(r.content, status_code=r.status_code, headers=response_headers(r, None))
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "shadow"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await body_of(request)
        if upstream:
            return await forward(request, body, chat=True)
        return await complete(request, body, embedded_prompt(body), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        if upstream:
            return await forward(request, body, chat=False)
        p = body.get("prompt")
        if isinstance(p, str) and p:
            prompt = tokenizer.encode(p)
        elif isinstance(p, list) and p and all(isinstance(i, int) and not isinstance(i, bool) for i in p):
            prompt = list(p)
        else:
            raise ShadowInputError("'prompt' must be a non-empty string or a list of token ids")
        return await complete(request, body, prompt, chat=False)

    def embedded_prompt(body: dict) -> list[int]:
        """The embedded engine's prompt ids: its template (given, else the in-code one)."""
        if renderer is None:
            return tokenizer.encode(render_prompt(parse_messages(body.get("messages"))))
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise ShadowInputError("'messages' must be a non-empty list")
        messages, tools, kwargs = as_carried(body)
        return renderer.prompt_ids(messages, tools, {**(template_kwargs or {}), **kwargs})

    def reference_of(request: Request) -> str | None:
        """The turn's reference label for a standing question (e.g. the router's class), if sent."""
        q = service.standing
        return request.headers.get(q.label_header) if q else None

    def named_session(request: Request) -> str | None:
        return next((request.headers[h] for h in session_headers if h in request.headers), None)

    async def forward(request: Request, body: dict, chat: bool):
        """Proxy mode: the turn is registered, its prompt ids sought beside the request, and the
        request forwarded. A request that names no session waits for its prompt ids (to find
        its session by prefix); one that names it does not."""
        p = proxy()
        if engine.dialect is None:  # the engine did not answer at start: probe it now
            p.dialect = await asyncio.to_thread(engine.choose)
            service.engine = engine.describe()
        else:
            p.dialect = engine.dialect
        turn_id = next(turn_ids)
        before = p.prompt(body, chat)
        named = named_session(request)
        session = None
        if named is None and service.ready.is_set():
            try:
                ids = (await asyncio.wrap_future(before)).ids
            except Exception:  # noqa: BLE001 - the turn says why at its end
                ids = None
            if ids:
                session = service.session_for(None, ids)
        service.begin_turn(turn_id, session, reference=reference_of(request), requested=named)
        return await p.forward(request.headers, body, chat, turn_id, named or session, before)

    async def complete(request: Request, body: dict, prompt: list[int], chat: bool):
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens", 64))
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= 4096:
            raise ShadowInputError("'max_tokens' must be an integer from 1 to 4096")
        stop_ids = [] if body.get("ignore_eos") else eos  # as vLLM: generate max_tokens whatever comes
        service.reader.check_ids(prompt)
        session = service.session_for(named_session(request), prompt)
        want_ids = bool(body.get("return_token_ids"))  # as vLLM: ids only when asked for
        turn_id, rid, created = next(turn_ids), f"cmpl-{uuid.uuid4().hex[:16]}", int(time.time())
        events: queue.Queue = queue.Queue()
        worker = threading.Thread(
            target=serve_turn, args=(turn_id, session, prompt, max_tokens, stop_ids, events, reference_of(request)),
            daemon=True,
        )
        worker.start()

        def chunk(token: int | None, text: str, finish: str | None, first: bool) -> dict:
            choice = {"index": 0, "finish_reason": finish}
            if want_ids:
                choice["token_ids"] = [] if token is None else [token]
            if chat:
                choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
            else:
                choice["text"] = text
            out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                   "created": created, "model": model_name, "choices": [choice]}
            if first and want_ids:
                out["prompt_token_ids"] = prompt
            return out

        if body.get("stream"):
            def event_lines(kind: str, value, out: list[int], first: bool) -> tuple[str, bool]:
                """The SSE text of one event, and whether the stream ends with it."""
                if kind == "token":
                    out.append(value)
                    text = stream.push(value) if value not in eos else ""
                    return f"data: {json.dumps(chunk(value, text, None, first))}\n\n", False
                if kind == "done":
                    return f"data: {json.dumps(chunk(None, stream.rest(), value, first))}\n\ndata: [DONE]\n\n", True
                return f"data: {json.dumps({'error': {'message': value, 'type': 'server_error'}})}\n\n", True

            stream = TextStream(tokenizer)

            async def sse():
                out: list[int] = []
                while True:
                    batch = [await asyncio.to_thread(events.get)]
                    while True:  # whatever else is queued goes in the same write
                        try:
                            batch.append(events.get_nowait())
                        except queue.Empty:
                            break
                    text = []
                    for kind, value in batch:
                        line, last = event_lines(kind, value, out, first=not out)
                        text.append(line)
                        if last:
                            yield "".join(text)
                            return
                    yield "".join(text)

            return StreamingResponse(sse(), media_type="text/event-stream", headers={"x-shadow-session": session})

        out, finish = [], None
        while finish is None:
            kind, value = await asyncio.to_thread(events.get)
            if kind == "token":
                out.append(value)
            elif kind == "done":
                finish = value
            else:
                return error(500, value, "server_error")
        text = tokenizer.decode([t for t in out if t not in eos])
        choice = {"index": 0, "finish_reason": finish}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(out), "total_tokens": len(prompt) + len(out)}
        result = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                  "model": model_name, "choices": [choice], "usage": usage}
        if want_ids:
            choice["token_ids"] = out
            result["prompt_token_ids"] = prompt
        return JSONResponse(result, headers={"x-shadow-session": session})

    def serve_turn(turn_id: int, session: str, prompt: list[int], max_tokens: int, stop_ids: list[int],
                   events: queue.Queue, reference: str | None) -> None:
        """One request (run on the device thread): feed the prompt, generate, and between rounds the share."""
        service.run_request(lambda: generate_turn(turn_id, session, prompt, max_tokens, stop_ids, events, reference))

    def generate_turn(turn_id: int, session: str, prompt: list[int], max_tokens: int, stop_ids: list[int],
                      events: queue.Queue, reference: str | None) -> None:
        out: list[int] = []
        try:
            service.begin_turn(turn_id, session, prompt, reference)
            for token in generator.generate(prompt, max_tokens, stop_ids):
                if not out:
                    service.first_token(turn_id)
                out.append(token)
                events.put(("token", token))
                service.add_output(turn_id, [token])  # the output so far is readable in the share
                service.share_slice(turn_id)
            events.put(("done", "stop" if out and out[-1] in eos else "length"))
            ids = TurnIds(list(prompt), "engine", list(out), "engine", prompt_tokens=len(prompt),
                          completion_tokens=len(out))
            service.record_turn(turn_id, check_turn(ids), ids)  # its own engine: the ids are the ones read
        except Exception as e:  # the client gets the error; the shadow keeps what it fed
            events.put(("error", f"{type(e).__name__}: {e}"))
        finally:
            if turn_id in service.turns:
                service.end_turn(turn_id)

    @app.post("/v1/shadow/ask")
    async def ask(request: Request):
        body = await body_of(request)
        session = session_named(body)
        choices = body.get("choices")
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ShadowInputError("'choices' must be a non-empty list of single-token strings (letters)")
        if len(choices) > MAX_CHOICES:
            raise ShadowInputError(f"at most {MAX_CHOICES} choices")
        if len(set(choices)) != len(choices):
            raise ShadowInputError("choices repeat")
        choice_ids = [tokenizer.single_token(c) for c in choices]
        if isinstance(body.get("question_ids"), list):
            question = body["question_ids"]
            if not all(isinstance(i, int) for i in question):
                raise ShadowInputError("'question_ids' must be token ids")
        elif isinstance(body.get("question"), str) and body["question"]:
            question = tokenizer.encode(body["question"])
        else:
            raise ShadowInputError("give 'question' (text) or 'question_ids'")
        if not question or len(question) > MAX_QUESTION_TOKENS:
            raise ShadowInputError(f"the question must have 1 to {MAX_QUESTION_TOKENS} tokens")
        timeout = body.get("timeout_s", 10.0)
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ShadowInputError("'timeout_s' must be a positive number")
        reference = body.get("reference", request.headers.get("x-shadow-label"))
        if reference is not None and reference not in choices:
            raise ShadowInputError("'reference' (or x-shadow-label) must be one of the choices")
        fresh = body.get("fresh")
        if fresh is not None and not isinstance(fresh, bool):
            raise ShadowInputError("'fresh' must be true or false")
        return await asyncio.to_thread(service.ask, session, question, choice_ids, choices, float(timeout),
                                       reference, fresh)

    @app.post("/v1/shadow/summarize")
    async def summarize(request: Request):
        """A summary of a session decoded from a fork over the whole session (text and ids)."""
        body = await body_of(request)
        session = session_named(body)
        instruction = body.get("instruction", "Summarise the latest turn in one sentence.")
        if not isinstance(instruction, str) or not instruction:
            raise ShadowInputError("'instruction' must be text")
        max_tokens = body.get("max_tokens", 48)
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= 512:
            raise ShadowInputError("'max_tokens' must be an integer from 1 to 512")
        prompt = tokenizer.encode(render_question(instruction))
        answer = await asyncio.to_thread(service.summarize, session, prompt, max_tokens)
        return answer | {"text": tokenizer.decode([t for t in answer["ids"] if t not in eos])}

    @app.post("/v1/shadow/switch")
    async def switch(request: Request):
        """Turn the shadow off or on (for A/B runs): off, it feeds and reads nothing."""
        body = await body_of(request)
        if not isinstance(body.get("on"), bool):
            raise ShadowInputError("'on' must be true or false")
        service.enabled = body["on"]
        return {"on": service.enabled}

    @app.get("/v1/shadow/status")
    async def status():
        return await asyncio.to_thread(service.status)

    return app


def parse_messages(raw) -> list[Message]:
    """OpenAI chat messages (content as text or parts; assistant reasoning as `reasoning_content`
    or `reasoning`) as the template's messages; a ShadowInputError for anything else."""
    if not isinstance(raw, list) or not raw:
        raise ShadowInputError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ShadowInputError(f"messages[{i}] needs a role of system, user, assistant or tool")
        content = m.get("content") or ""
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
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
