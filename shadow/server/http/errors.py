"""The one error shape every refusal of the service has, `{"error": {"message", "type"}}`, as
OpenAI-compatible engines answer, and the handlers that map the library's errors onto it:
bad input 400, an ask on a session not exact enough 409 (with its `exact` and `why_not` beside
the error), no shadow yet 503, unknown paths 404,
wrong methods 405, invalid bodies 400; a client that hangs up mid-body is a 499, whose access line
(`guard.Guard`) is its one log line. Each refusal's cause is logged by the guard, from its body."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from shadow.errors import ShadowInputError, ShadowNotExact, ShadowUnavailable


def error_body(message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind}}


def error_bytes(message: str, kind: str = "invalid_request_error") -> bytes:
    return json.dumps(error_body(message, kind)).encode()


def error_event(message: str, kind: str) -> bytes:
    """The error as one SSE event (a stream that has started can only end this way)."""
    return b"data: " + error_bytes(message, kind) + b"\n\n"


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(error_body(message, kind), status_code=status)


def install(app: FastAPI) -> None:
    """The handlers for the library's errors and FastAPI's own, all in the one shape."""

    @app.exception_handler(ShadowInputError)
    async def bad_input(request: Request, exc: ShadowInputError):
        return error_response(400, str(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        parts = [f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
                 for e in exc.errors()]
        return error_response(400, "; ".join(parts) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kinds = {404: "not_found", 405: "method_not_allowed"}
        return error_response(exc.status_code, str(exc.detail), kinds.get(exc.status_code, "invalid_request_error"))

    @app.exception_handler(ClientDisconnect)
    async def hung_up(request: Request, exc: ClientDisconnect):
        """A client that hangs up before its body is read: a 499 nobody reads, no traceback (its access
        line says the client hung up)."""
        return Response(status_code=499)

    @app.exception_handler(ShadowUnavailable)
    async def unavailable(request: Request, exc: ShadowUnavailable):
        return error_response(503, str(exc), "unavailable")

    @app.exception_handler(ShadowNotExact)
    async def not_exact(request: Request, exc: ShadowNotExact):
        exact = getattr(exc, "exactness", None) or {}  # the refusal says exact and why_not, as an answer would
        extra = {k: exact[k] for k in ("exact", "why_not") if k in exact}
        return JSONResponse(error_body(str(exc), "not_exact") | extra, status_code=409)
