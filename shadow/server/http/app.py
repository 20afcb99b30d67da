"""The HTTP service: OpenAI-compatible completions (from the embedded generator, or passed to an
upstream engine in proxy mode), the shadow's own endpoints (`shadow_api`), and in front of all of
them the guard (keys, body size, requests in flight) and, around everything, the access log (each
request's line, each refusal's and failure's cause, the completions' latency: `access`); beside
them the probes (`/health`, `/ready`: `health`) and the Prometheus metrics (`/metrics`:
`shadow.server.metrics`, read at scrape time).
Every error a client causes is a 4xx in the one error shape (`errors`); 404 and 405 too."""

from __future__ import annotations

import asyncio
import types
import weakref
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from shadow.engines import jsonlimits
from shadow.engines.dialects import Dialect, EngineChoice
from shadow.errors import ShadowInputError
from shadow.server import logs
from shadow.server.generator import Generator
from shadow.server.http import errors
from shadow.server.http.access import AccessLog
from shadow.server.http.channels import Channel, choose
from shadow.server.http.embedded import EmbeddedCompletions
from shadow.server.http.guard import Guard, valid_session_id
from shadow.server.http.health import Probes
from shadow.server.http.proxy import Proxy, response_headers
from shadow.server.http.transfers import Transfers
from shadow.server.http.schemas import ChatBody, CompletionBody, openapi_body
from shadow.server.http.shadow_api import shadow_routes
from shadow.server.metrics import Metrics
from shadow.server.service import ShadowService
from shadow.server.settings import METRICS_PATH, ServeSettings
from shadow.server.timings import REQUEST_SECONDS, Histogram
from shadow.text.chat_template import ChatRenderer
from shadow.text.framing import strip_request
from shadow.text.tokenizer import Tokenizer


def weakly(method):
    """`method`, bound to a weak proxy of its object instead of the object."""
    return types.MethodType(method.__func__, weakref.proxy(method.__self__))


class ShadowApp:
    """The FastAPI app (`.app`) of one service. Embedded mode with a `generator`; proxy mode when
    `settings.engine.upstream` is set, whose engine speaks `dialect` (a Dialect, or None: the
    settings' name, probed at start when 'auto'). `renderer` is the big model's chat template and
    tokenizer (proxy: for the dialects that render; embedded: the generator's template, else the
    in-code one of `text.chat`). A request's session is the first of the settings' session
    headers it carries (validated: `guard.valid_session_id`), else found from its prompt
    (`ShadowService.name_turn`). Framed status lines a client sends back are taken out of every
    request first (`framing.strip_request`)."""

    def __init__(self, settings: ServeSettings, service: ShadowService, tokenizer: Tokenizer, model_name: str,
                 *, generator: Generator | None = None, renderer: ChatRenderer | None = None,
                 dialect: Dialect | None = None):
        if (generator is None) == (not settings.proxy):
            raise ValueError("give a generator (embedded mode) or an upstream in the settings (proxy mode)")
        self.settings, self.service, self.tokenizer, self.model_name = settings, service, tokenizer, model_name
        self.headers = tuple(h.lower() for h in settings.sessions.headers)
        eos_id = service.config.eos_token_id if generator is None else generator.model.config.eos_token_id
        engine = settings.engine
        self.engine = EngineChoice(engine.upstream, dialect or (None if engine.dialect == "auto" else engine.dialect),
                                   renderer, eos_id, engine.template_kwargs,
                                   probe_timeout_s=engine.probe_timeout_s) if settings.proxy else None
        self.embedded = EmbeddedCompletions(settings, service, generator, tokenizer, model_name, renderer) \
            if generator is not None else None
        self.proxy: Proxy | None = None  # made at start, in the server's event loop
        self.fallback = Dialect(renderer, eos_id=eos_id)  # until the engine answers the probe
        app = self.app = FastAPI(title="shadow serve", lifespan=self._lifespan)
        app.add_middleware(Guard, access=settings.access, limits=settings.limits)
        app.add_middleware(Transfers, access=settings.access, limits=settings.limits)  # outside the guard
        self.latency = Histogram(REQUEST_SECONDS)  # each completion's, end to end (timed by the access log)
        app.add_middleware(AccessLog, sessions=self.headers, latency=self.latency)  # the outermost: every request
        errors.install(app)
        # the routes hold the app, its service and tokenizer weakly (the FastAPI app holds this object
        # through its lifespan): FastAPI keeps every endpoint it was given in a process-wide cache,
        # which must not keep a stopped app's models alive
        me, held = weakref.proxy(self), weakref.proxy(service)
        app.add_api_route("/v1/models", weakly(self.models), methods=["GET"])
        app.add_api_route("/v1/chat/completions", weakly(self.chat), methods=["POST"],
                          openapi_extra=openapi_body(ChatBody))
        app.add_api_route("/v1/completions", weakly(self.completions), methods=["POST"],
                          openapi_extra=openapi_body(CompletionBody))
        app.include_router(shadow_routes(held, weakref.proxy(tokenizer), [eos_id], settings.limits))
        app.include_router(Probes(held, me).routes())
        self.metrics = Metrics(service, self.latency)  # the app's own registry
        app.add_api_route(METRICS_PATH, weakly(self.scrape), methods=["GET"], include_in_schema=False)

    @asynccontextmanager
    async def _lifespan(self, app: FastAPI):
        self.service.start()
        if self.engine is not None:
            self.proxy = Proxy(self.settings, self.engine.dialect or self.fallback, self.service, self.tokenizer)
            self.service.engine = self.engine.describe()
            self.engine.on_chosen = lambda: setattr(self.service, "engine", self.engine.describe())
            self.engine.begin()  # beside the service: the port answers while the engine is probed
        yield
        if self.proxy is not None:
            await self.proxy.close()
        await asyncio.to_thread(self.service.stop)  # a planned stop: sessions go to disk

    # the routes ---------------------------------------------------------------------------

    async def models(self, request: Request):
        if self.proxy is None:
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "shadow"}]}
        try:
            r = await self.proxy.client.get(self.proxy.upstream + "/models",
                                            headers=self.proxy.engine_headers(request.headers))
        except httpx.HTTPError as e:
            return errors.error_response(502, f"upstream unreachable: {type(e).__name__}: {e}", "upstream_error")
        return Response(r.content, status_code=r.status_code, headers=response_headers(r, None))

    async def scrape(self):
        """The Prometheus metrics, read from the service now."""
        body, content_type = await asyncio.to_thread(self.metrics.render)
        return Response(body, media_type=content_type)

    async def chat(self, request: Request):
        """OpenAI chat completions: the engine's answer, passed through (proxy) or generated here."""
        return await self._complete(request, chat=True)

    async def completions(self, request: Request):
        """OpenAI completions: the engine's answer, passed through (proxy) or generated here."""
        return await self._complete(request, chat=False)

    # a completion -------------------------------------------------------------------------

    async def _complete(self, request: Request, chat: bool):
        named = self._named_session(request)
        body, _ = strip_request(await self._body(request))  # lines a client echoes back never reach a reader
        channel = choose(self.settings.status.channel, request.headers) if chat and body.get("stream") \
            else Channel("off")
        reference = self._reference(request)
        service = self.service
        if self.embedded is not None:
            prompt, max_tokens = self.embedded.parse(body, chat)  # bad input refused before the turn begins
            if self.embedded.full():  # the queue is bounded: a client tries again
                limit = self.settings.limits.max_queued
                refusal = errors.error_response(429, f"{limit} requests are generating or waiting; try again",
                                                "rate_limit_error")
                refusal.headers["retry-after"] = "1"
                return refusal
            turn = service.begin_turn(named, reference, embedded=True)
            logs.bind(turn=turn.id, session=named)
            try:
                return await self.embedded.complete(body, prompt, max_tokens, chat, turn, channel,
                                                    disconnected=request.is_disconnected)
            except BaseException:  # its generation (if it started) stops; the turn ends either way
                turn.client_gone = True
                await asyncio.to_thread(service.end_turn, turn)
                raise
        return await self._forward(request, body, chat, named, reference, channel)

    async def _forward(self, request: Request, body: dict, chat: bool, named: str | None, reference: str | None,
                       channel: Channel):
        """Proxy mode: the turn begins, its prompt ids are sought beside the request, and the
        request is forwarded. A request that names no session waits for its prompt ids (to find
        its session by prefix); one that names it does not."""
        proxy, service = self.proxy, self.service
        if self.engine.dialect is None:  # the engine did not answer at start: probe it now
            proxy.dialect = await self.engine.settled()
        else:
            proxy.dialect = self.engine.dialect
        before = proxy.prompt(body, chat)
        turn = service.begin_turn(named, reference)
        turn.hold_output = chat and self.settings.engine.predict and proxy.dialect.renderer is not None
        logs.bind(turn=turn.id, session=named)
        try:
            if named is None and service.ready.is_set():
                try:
                    ids = (await asyncio.wrap_future(before)).ids
                except Exception:  # noqa: BLE001 - the turn says why at its end
                    ids = None
                if ids:
                    service.name_turn(turn, ids)
            session = named or turn.session
            logs.bind(session=session)
            cached = lambda ids: service.cached_prefix(session, ids)  # noqa: E731
            return await proxy.forward(request.headers, body, turn, before, chat=chat, session=session, channel=channel,
                                       cached=cached)
        except BaseException:
            await asyncio.to_thread(service.end_turn, turn)  # ends it unless it ended already
            raise

    # what a request says ------------------------------------------------------------------

    async def _body(self, request: Request) -> dict:
        """The body as a JSON object, within the limits (nesting, digits of a number:
        `jsonlimits.loads`); anything else is a ShadowInputError (400), before any turn begins."""
        try:
            body = jsonlimits.loads(await request.body(), max_depth=self.settings.limits.max_json_depth)
        except jsonlimits.JSONLimitError as e:
            raise ShadowInputError(f"the body is refused: {e}") from None
        if not isinstance(body, dict):
            raise ShadowInputError("the body must be a JSON object")
        return body

    def _named_session(self, request: Request) -> str | None:
        name = next((request.headers[h] for h in self.headers if h in request.headers), None)
        if name is not None and not valid_session_id(name):
            raise ShadowInputError("a session id header must be 1 to 128 letters, digits or ._:@-")
        return name

    def _reference(self, request: Request) -> str | None:
        """The turn's reference label for a standing question (e.g. the router's class), if sent."""
        q = self.service.standing
        return request.headers.get(q.label_header) if q else None
