"""What a client sends and reads, bounded in time (`settings.Limits`): `Transfers` is a pure ASGI
middleware outside the guard.

- A POST's body is read whole before the guard and the app see the request, within
  `body_timeout_s` of the request's start (408 beyond), at most `max_sending` bodies at once (the
  others wait their turn within the same time): a body still arriving holds no request slot, so
  stalled bodies cannot take the requests in flight. A request the guard refuses without reading
  its body (no key, a declared length over the limit) passes to it unread.
- Once its body is read, a client that goes away before its response starts cancels the
  request (a proxied request's connection to the engine closes, its turn ends).
- A write waits at most `write_timeout_s` for the client to read; beyond, the response is given
  up: the connection closes, and a stream's close ends its turn (an embedded generation stops; a
  proxied one closes its engine request). A stream's socket and transport buffers are kept small,
  so a client that reads nothing is found after tens of kilobytes, not megabytes.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from shadow.server.http.errors import error_bytes
from shadow.server.settings import Access, Limits

log = logging.getLogger("shadow.http")

STREAM_BUFFER = 4096  # bytes: a stream's socket send buffer and its transport's high-water mark


class ClientNotReading(Exception):
    """A write waited `write_timeout_s` for its client to read."""


class Transfers:
    """ASGI middleware: bodies read within a time and a bound, disconnects watched, writes timed."""

    def __init__(self, app, access: Access, limits: Limits):
        self.app, self.access, self.limits = app, access, limits
        self.sending = asyncio.Semaphore(limits.max_sending)  # a place among the bodies read at once

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        timed = self._timed_send(send, receive)
        if scope.get("method") != "POST" or not self._reads_body(scope):
            return await self._run(scope, receive, timed, receive)
        try:
            body = await self._body(receive)
        except TimeoutError:
            return await _refuse(timed, 408, f"the request's body did not arrive within {self.limits.body_timeout_s:g} s",
                                 "request_timeout")
        except _TooLarge:
            return await _refuse(timed, 413, f"the body is over {self.limits.max_body_bytes:,} bytes",
                                 "request_too_large")
        if body is None:  # the client went away before its body had all come: nobody to answer
            return None
        await self._watched(scope, body, receive, timed)

    def _reads_body(self, scope) -> bool:
        """Whether the body is read here: the guard would read it too (a key that opens the path,
        a declared length within the limit)."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if not self.access.allows(scope.get("path", ""), headers.get("authorization")):
            return False
        length = headers.get("content-length")
        return length is None or (length.isdigit() and int(length) <= self.limits.max_body_bytes)

    async def _body(self, receive) -> bytes | None:
        """The whole body, within `body_timeout_s` of now; None when the client goes away first.
        A body that comes in one piece is taken at once; one that comes in more waits for a place
        among the `max_sending` read at once after its first piece."""
        loop = asyncio.get_running_loop()
        parts: list = []  # the pieces, and `_GONE` last if the client went away
        async with asyncio.timeout_at(loop.time() + self.limits.body_timeout_s):
            over = await self._piece(receive, parts)
            if not over:
                async with self.sending:
                    while not over:
                        over = await self._piece(receive, parts)
        return None if parts[-1] is _GONE else b"".join(parts)

    async def _piece(self, receive, parts: list) -> bool:
        """One more piece of the body into `parts`: whether the body is over (or the client gone:
        `_GONE` last)."""
        message = await receive()
        if message["type"] == "http.disconnect":
            parts.append(_GONE)
            return True
        parts.append(message.get("body", b""))
        if sum(map(len, parts)) > self.limits.max_body_bytes:
            raise _TooLarge()
        return not message.get("more_body", False)

    async def _watched(self, scope, body: bytes, receive, send) -> None:
        """The app with the body read, the client's disconnect watched: gone before the response
        starts, the app is cancelled."""
        gone = asyncio.ensure_future(receive())  # the next message after the body: a disconnect
        started, handed = False, False

        async def replay():
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await asyncio.shield(gone)  # a caller's cancellation (a look that does not wait) leaves it

        async def tracked(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        app = asyncio.ensure_future(self._run(scope, replay, tracked, receive))
        left = False  # the client left before its response, and the app was cancelled for it
        try:
            await asyncio.wait({app, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not app.done() and not started and not gone.cancelled() and gone.exception() is None \
                    and gone.result().get("type") == "http.disconnect":
                log.info("the client went away before its response: %s %s is cancelled", scope.get("method"),
                         scope.get("path"))
                app.cancel()
                left = True
            try:
                await app
            except asyncio.CancelledError:
                if not (left and app.cancelled()):
                    raise
        finally:
            if not app.done():
                app.cancel()
            gone.cancel()

    async def _run(self, scope, receive, send, server_receive) -> None:
        """The app; a response given up on a client that reads nothing ends here, its connection
        closed at once (`_abort`; else the server closes a response it did not complete)."""
        try:
            await self.app(scope, receive, send)
        except ClientNotReading:
            log.info("a client read nothing for %g s: its response to %s %s is given up",
                     self.limits.write_timeout_s, scope.get("method"), scope.get("path"))
            if _abort(server_receive):
                await asyncio.sleep(0)  # the server learns the connection is lost before the app returns

    def _timed_send(self, send, receive):
        """`send`, each call within `write_timeout_s` (ClientNotReading beyond); a stream's buffers
        made small as it starts (`_small_buffers`: the server's transport is found on `receive`)."""
        limit = self.limits.write_timeout_s

        async def timed(message):
            if message["type"] == "http.response.start" and _streams(message):
                _small_buffers(receive)
            try:
                await asyncio.wait_for(send(message), limit)
            except TimeoutError:
                raise ClientNotReading() from None

        return timed


class _TooLarge(Exception):
    pass


_GONE = object()  # `parts`' last entry when the client went away


def _streams(start: dict) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.get("headers", []))


def _transport(receive):
    """The connection's transport, where the server's `receive` shows it (uvicorn's does), else None."""
    return getattr(getattr(receive, "__self__", None), "transport", None)


def _abort(receive) -> bool:
    """Close the connection at once, its unsent bytes dropped (a client that reads nothing would
    keep a graceful close waiting): whether it could be."""
    transport = _transport(receive)
    if transport is None:
        return False
    transport.abort()
    return True


def _small_buffers(receive) -> None:
    """A stream's socket send buffer and its transport's high-water mark at `STREAM_BUFFER`, where
    the server's `receive` shows its transport (uvicorn's does): a client that reads nothing then
    blocks the stream's writes within tens of kilobytes. Elsewhere nothing changes."""
    transport = _transport(receive)
    if transport is None:
        return
    try:
        transport.set_write_buffer_limits(high=STREAM_BUFFER)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_BUFFER)
    except (AttributeError, OSError, ValueError):
        pass


async def _refuse(send, status: int, message: str, kind: str) -> None:
    """The refusal in the one error shape; the connection closes after it."""
    body = error_bytes(message, kind)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    try:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    except ClientNotReading:
        pass
