"""The HTTP service: OpenAI-compatible completions (from the embedded engine, or passed to an
upstream engine in proxy mode), the shadow's own endpoints (`shadow_api`), and in front of all of
them the guard (keys, body size, requests in flight). Every error a client causes is a 4xx
with the error shape `{"error": {"message", "type"}}`; 404 and 405 too."""

from __future__ import annotations

import asyncio
import itertools
import json
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from shadow.text.chat_template import ChatRenderer
from shadow.errors import ShadowInputError, ShadowNotExact, ShadowUnavailable
from shadow.server.http.channels import Channel, choose
from shadow.engines.dialects import Dialect, EngineChoice
from shadow.server.http.embedded import EmbeddedEngine
from shadow.server.generator import Generator
from shadow.server.http.guard import Access, Guard, Limits, json_depth, valid_session_id
from shadow.server.http.proxy import Proxy, response_headers
from shadow.server.service import ShadowService
from shadow.server.http.shadow_api import shadow_routes
from shadow.text.framing import strip_request
from shadow.text.tokenizer import Tokenizer

SESSION_HEADERS = ("x-session-id", "x-openwebui-chat-id")
CHAT_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["messages"], "additionalProperties": True, "properties": {
        "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role"], "properties": {
            "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
            "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}}}},
        "max_tokens": {"type": "integer", "minimum": 1}, "stream": {"type": "boolean"},
        "tools": {"type": "array", "items": {"type": "object"}}}}}}}}
COMPLETION_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["prompt"], "additionalProperties": True, "properties": {
        "prompt": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]},
        "max_tokens": {"type": "integer", "minimum": 1}, "stream": {"type": "boolean"}}}}}}}


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


def create_app(
    service: ShadowService, tokenizer: Tokenizer, model_name: str, generator: Generator | None = None,
    upstream: str | None = None, dialect: Dialect | str | None = None, renderer: ChatRenderer | None = None,
    session_headers: tuple[str, ...] = SESSION_HEADERS, label_from_upstream: bool = False,
    template_kwargs: dict | None = None, access: Access = Access(), limits: Limits = Limits(),
    upstream_key: str | None = None, status_channel: str = "auto", engine_slots: int = 1,
    status_timing: dict | None = None,
) -> FastAPI:
    """Embedded mode with a `generator`; proxy mode with an `upstream` base URL (…/v1), whose
    engine speaks `dialect` (a name, a Dialect, or None: probed at start). `renderer` is the big
    model's chat template and tokenizer (proxy: for the dialects that render; embedded: the
    generator's template, else the in-code one of `shadow.text.chat`). A request's session: the first
    of `session_headers` it carries (validated: `guard.valid_session_id`), else the service's
    choice (`ShadowService.session_for`). `upstream_key`, when given, is the engine's key, sent in
    place of the client's `Authorization`. `status_channel`: where status lines go in streamed
    chat responses (`channels.choose`); framed lines a client sends back are taken out of every
    request first (`framing.strip_request`). `engine_slots`: requests the engine prefills at once."""
    session_headers = tuple(h.lower() for h in session_headers)
    if (generator is None) == (upstream is None):
        raise ValueError("give a generator (embedded mode) or an upstream (proxy mode)")
    turn_ids = itertools.count(1)
    eos_id = service.config.eos_token_id if generator is None else generator.model.config.eos_token_id
    engine = EngineChoice(upstream, dialect, renderer, eos_id, template_kwargs) if upstream else None
    embedded = EmbeddedEngine(service, generator, tokenizer, model_name, limits, renderer, template_kwargs,
                              status_timing) if generator is not None else None
    proxy_of: dict[str, Proxy] = {}

    def proxy() -> Proxy:
        if "p" not in proxy_of:
            proxy_of["p"] = Proxy(upstream, engine.dialect or Dialect(renderer, eos_id=eos_id), service,
                                  label_from_upstream, upstream_key=upstream_key,
                                  max_prompt_tokens=limits.max_prompt_tokens, engine_slots=engine_slots,
                                  tokenizer=tokenizer, timing=status_timing)
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
    app.add_middleware(Guard, access=access, limits=limits)

    @app.exception_handler(ShadowInputError)
    async def bad_input(request: Request, exc: ShadowInputError):
        return error(400, str(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        parts = [f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
                 for e in exc.errors()]
        return error(400, "; ".join(parts) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kinds = {404: "not_found", 405: "method_not_allowed"}
        return error(exc.status_code, str(exc.detail), kinds.get(exc.status_code, "invalid_request_error"))

    @app.exception_handler(ShadowUnavailable)
    async def unavailable(request: Request, exc: ShadowUnavailable):
        return error(503, str(exc), "unavailable")

    @app.exception_handler(ShadowNotExact)
    async def not_exact(request: Request, exc: ShadowNotExact):
        return error(409, str(exc), "not_exact")

    async def body_of(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ShadowInputError(f"the body is not valid JSON: {e}") from None
        except RecursionError:
            raise ShadowInputError("the body nests too deeply") from None
        if not isinstance(body, dict):
            raise ShadowInputError("the body must be a JSON object")
        if not json_depth(body, limits.max_json_depth):
            raise ShadowInputError(f"the body nests deeper than {limits.max_json_depth} levels")
        return body

    @app.get("/v1/models")
    async def models(request: Request):
        if upstream:
            try:
                r = await proxy().client.get(upstream.rstrip("/") + "/models",
                                             headers=proxy().engine_headers(request.headers))
            except httpx.HTTPError as e:
                return error(502, f"upstream unreachable: {type(e).__name__}: {e}", "upstream_error")
            return Response(r.content, status_code=r.status_code, headers=response_headers(r, None))
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "shadow"}]}

    @app.post("/v1/chat/completions", openapi_extra=CHAT_BODY)
    async def chat(request: Request):
        """OpenAI chat completions: the engine's answer, passed through (proxy) or generated here."""
        return await complete(request, chat=True)

    @app.post("/v1/completions", openapi_extra=COMPLETION_BODY)
    async def completions(request: Request):
        """OpenAI completions: the engine's answer, passed through (proxy) or generated here."""
        return await complete(request, chat=False)

    def reference_of(request: Request) -> str | None:
        """The turn's reference label for a standing question (e.g. the router's class), if sent."""
        q = service.standing
        return request.headers.get(q.label_header) if q else None

    def named_session(request: Request) -> str | None:
        name = next((request.headers[h] for h in session_headers if h in request.headers), None)
        if name is not None and not valid_session_id(name):
            raise ShadowInputError("a session id header must be 1 to 128 letters, digits or ._:@-")
        return name

    async def complete(request: Request, chat: bool):
        named = named_session(request)
        body, _ = strip_request(await body_of(request))  # lines a client echoes back never reach a reader
        turn_id = next(turn_ids)
        channel = choose(status_channel, request.headers) if chat and body.get("stream") else Channel("off")
        if embedded is not None:
            prompt = embedded.prompt_of(body, chat)
            session = service.session_for(named, prompt)
            return await embedded.complete(body, prompt, chat, session, turn_id, reference_of(request), channel)
        return await forward(request, body, chat, named, turn_id, channel)

    async def forward(request: Request, body: dict, chat: bool, named: str | None, turn_id: int, channel: Channel):
        """Proxy mode: the turn is registered, its prompt ids sought beside the request, and the
        request forwarded. A request that names no session waits for its prompt ids (to find
        its session by prefix); one that names it does not."""
        p = proxy()
        if engine.dialect is None:  # the engine did not answer at start: probe it now
            p.dialect = await asyncio.to_thread(engine.choose)
            service.engine = engine.describe()
        else:
            p.dialect = engine.dialect
        before = p.prompt(body, chat)
        session = None
        if named is None and service.ready.is_set():
            try:
                ids = (await asyncio.wrap_future(before)).ids
            except Exception:  # noqa: BLE001 - the turn says why at its end
                ids = None
            if ids:
                session = service.session_for(None, ids)
        service.begin_turn(turn_id, session, reference=reference_of(request), requested=named)
        cached = lambda ids: service.cached_prefix(named or session, ids)  # noqa: E731
        return await p.forward(request.headers, body, chat, turn_id, named or session, before, channel, cached)

    app.include_router(shadow_routes(service, tokenizer, [eos_id], limits))
    return app

