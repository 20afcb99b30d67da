"""Each request's log lines and the completions' latency: `AccessLog` is a pure ASGI middleware,
the outermost, so every request is seen whatever answers it (the transfers' limits, the guard,
the app). One access line a request (`shadow.access`, INFO: method, path, status, seconds,
session, response bytes; a request whose client went away before any response is a 499); one
line with the cause of each refusal or failure (`shadow.http`: WARNING for a 4xx, ERROR for a
5xx, from its error body, and an error event that ends a stream; a probe's 503 is its answer,
not a failure); an exception that escapes the app is one ERROR line with its traceback and a 500
in the one error shape. Each completion answered 200 is timed from its arrival to its last byte
(`latency`).
"""

from __future__ import annotations

import json
import logging
import time

from shadow.server.http.errors import error_bytes
from shadow.server.settings import PROBE_PATHS
from shadow.server.timings import REQUEST_SECONDS, Histogram

COMPLETIONS = ("/v1/chat/completions", "/v1/completions")
ERROR_BODY = 4096  # the bytes of an error response read for its cause
CAUSE = 300  # the characters of a cause a line carries (an engine's message may echo a request)
access_log = logging.getLogger("shadow.access")
log = logging.getLogger("shadow.http")


class AccessLog:
    """ASGI middleware: the access and error lines of each request, the completions' latency.
    `sessions`: the request headers that name a session (the response's `x-shadow-session`
    comes first)."""

    def __init__(self, app, sessions: tuple[str, ...] = (), latency: Histogram | None = None):
        self.app = app
        self.sessions = tuple(h.lower() for h in sessions)
        self.latency = latency if latency is not None else Histogram(REQUEST_SECONDS)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        seen = Seen(scope, time.perf_counter())
        watched = _watched(send, seen)
        try:
            await self.app(scope, receive, watched)
        except Exception as e:  # noqa: BLE001 - the service failed this request: one line, its traceback, a 500
            seen.failure = f"{type(e).__name__}: {e}"
            log.error("%s %s failed: %s", scope.get("method"), scope.get("path"), seen.failure, exc_info=True)
            if seen.status is not None:
                raise  # a response begun cannot become a 500: the server cuts it
            body = error_bytes(f"the service failed this request ({type(e).__name__})", "server_error")
            await watched({"type": "http.response.start", "status": 500, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await watched({"type": "http.response.body", "body": body})
        finally:
            self._logged(seen)

    def _logged(self, seen: "Seen") -> None:
        """The request's access line; a line with the cause of a refusal or failure the app did
        not log itself (a probe's 503 is its answer, not a failure); its latency, for a completion
        answered 200."""
        scope, status = seen.scope, seen.status or 499  # no response: the client went away first
        method, path = scope.get("method", ""), scope.get("path", "")
        seconds = time.perf_counter() - seen.started
        session = seen.session or next((v.decode("latin-1") for k, v in scope.get("headers", [])
                                        if k.decode("latin-1").lower() in self.sessions), None)
        if status >= 400 and status != 499 and seen.failure is None and path not in PROBE_PATHS:
            cause = _cause(bytes(seen.error)) if seen.error is not None else "(no body)"
            (log.error if status >= 500 else log.warning)("%d %s %s: %s", status, method, path, cause,
                                                          extra={"session": session})
        if seen.stream_error is not None:
            log.error("the stream of %s %s ended on an error: %s", method, path, seen.stream_error,
                      extra={"session": session})
        if status == 200 and method == "POST" and path in COMPLETIONS:
            self.latency.observe(seconds)
        note = " (the client hung up)" if status == 499 else " (failed)" if seen.failure else ""
        access_log.info("%s %s %d %.3f s %d bytes%s%s", method, path, status, seconds, seen.bytes,
                        f" session={session}" if session else "", note,
                        extra={"method": method, "path": path, "status": status, "duration_s": round(seconds, 6),
                               "bytes": seen.bytes, "session": session})


class Seen:
    """What a request's response was: its status, session header, bytes, the start of an error
    body, an error event in its stream, an exception that escaped the app."""

    def __init__(self, scope, started: float):
        self.scope, self.started = scope, started
        self.status: int | None = None
        self.session: str | None = None
        self.bytes = 0
        self.error: bytearray | None = None  # an error response's first ERROR_BODY bytes
        self.stream_error: str | None = None
        self.failure: str | None = None
        self.stream = False


def _watched(send, seen: Seen):
    """`send`, noting what goes out in `seen` (a few comparisons a message; an error body's start)."""

    async def watched(message):
        if message["type"] == "http.response.start":
            seen.status = message["status"]
            for k, v in message.get("headers", []):
                name = k.decode("latin-1").lower()
                if name == "x-shadow-session":
                    seen.session = v.decode("latin-1")
                elif name == "content-type":
                    seen.stream = v.startswith(b"text/event-stream")
            if seen.status >= 400:
                seen.error = bytearray()
        elif message["type"] == "http.response.body":
            body = message.get("body", b"")
            seen.bytes += len(body)
            if seen.error is not None and len(seen.error) < ERROR_BODY:
                seen.error += body[:ERROR_BODY - len(seen.error)]
            elif seen.stream and seen.stream_error is None and b'data: {"error"' in body:
                seen.stream_error = _event_cause(body)
        await send(message)

    return watched


def _cause(body: bytes) -> str:
    """An error body's message (the one error shape, or an engine's `detail`), else its size."""
    try:
        event = json.loads(body)
    except ValueError:
        return f"(an error body of {len(body)} bytes that is not JSON)" if body else "(no body)"
    error = event.get("error") if isinstance(event, dict) else None
    if isinstance(error, dict):
        return f"{str(error.get('message', ''))[:CAUSE]} ({str(error.get('type', ''))[:60]})"
    if isinstance(error, str):
        return error[:CAUSE]
    if isinstance(event, dict) and isinstance(event.get("detail"), str):
        return event["detail"][:CAUSE]
    return f"(an error body of {len(body)} bytes)"


def _event_cause(body: bytes) -> str:
    """The error event's message in a piece of a stream."""
    at = body.index(b'data: {"error"')
    line = body[at + 6:].split(b"\n", 1)[0]
    return _cause(line)
