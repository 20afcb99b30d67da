"""Who may call the service, and how much one request may ask of it (`settings.Access` and
`settings.Limits`): with an API key set, every endpoint wants `Authorization: Bearer KEY` (as
vLLM and llama.cpp's `--api-key`); the shadow's own endpoints (`/v1/shadow/*`) and `/metrics`
want the admin key instead when one is set; the probes (`/health`, `/ready`) want the API key
too, unless `--health-without-key`. Each refusal is a 4xx in the one error shape and changes no
state.

`Guard` is a pure ASGI middleware: it refuses before the app reads a body (413 on a declared or
streamed body over the limit, 401 on a missing or wrong key, 429 past the requests in flight),
and reads every POST body as JSON (`curl -d` declares form encoding).
"""

from __future__ import annotations

from shadow.server.http.errors import error_bytes
from shadow.server.settings import Access, Limits

LIMITED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/shadow/ask", "/v1/shadow/summarize")


class BodyTooLarge(Exception):
    pass


class Guard:
    """ASGI middleware: body size, access and requests in flight, before the app sees a request."""

    def __init__(self, app, access: Access, limits: Limits):
        self.app, self.access, self.limits = app, access, limits
        self.in_flight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        if not self.access.allows(path, headers.get("authorization")):
            return await _refuse(send, 401, "a valid API key is required (Authorization: Bearer KEY)",
                                 "authentication_error", {"www-authenticate": "Bearer"})
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limits.max_body_bytes):
            return await _refuse(send, 413, f"the body is over {self.limits.max_body_bytes:,} bytes",
                                 "request_too_large")
        limited = scope.get("method") == "POST" and path in LIMITED_PATHS
        if limited and self.in_flight >= self.limits.max_concurrent:
            return await _refuse(send, 429, f"{self.limits.max_concurrent} requests are in flight; try again",
                                 "rate_limit_error", {"retry-after": "1"})
        seen, started = 0, False

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limits.max_body_bytes:
                    raise BodyTooLarge()
            return message

        async def tracked_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        if scope.get("method") == "POST":  # every body here is JSON, whatever a client (curl -d) declares
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-type"]
            scope["headers"].append((b"content-type", b"application/json"))
        if limited:
            self.in_flight += 1
        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await _refuse(send, 413, f"the body is over {self.limits.max_body_bytes:,} bytes", "request_too_large")
        finally:
            if limited:
                self.in_flight -= 1


async def _refuse(send, status: int, message: str, kind: str, extra: dict | None = None) -> None:
    body = error_bytes(message, kind)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


SESSION_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:@-")
MAX_SESSION_ID = 128


def valid_session_id(value: str) -> bool:
    """A session id from a client: 1 to 128 of letters, digits and `._:@-` (`~` names the
    server's own side branches, so a client cannot name one)."""
    return 0 < len(value) <= MAX_SESSION_ID and all(c in SESSION_ID_CHARS for c in value)
