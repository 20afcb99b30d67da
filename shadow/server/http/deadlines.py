"""The engine's time limits on one proxied request (`settings.EngineSettings`): its first byte of
body within `first_byte_timeout_s` of the request going out (the response's headers, then a
stream's first event, or a whole response's body), then no silence longer than `idle_timeout_s`
between two pieces. A limit passed is an `EngineTimeout` (an `httpx.TimeoutException`, so every
path that handles the engine's failures handles it): the request's connection is closed, the
client gets a 504 (or, on a stream begun, an error event) and the turn ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import httpx

T = TypeVar("T")


class EngineTimeout(httpx.TimeoutException):
    """The engine sent nothing within a limit."""


class Deadlines:
    """One request's limits, counted from `start` (the event loop's clock) when it went out."""

    def __init__(self, first_byte_s: float, idle_s: float, start: float | None = None):
        self.first_byte_s, self.idle_s = first_byte_s, idle_s
        self.start = asyncio.get_running_loop().time() if start is None else start
        self.first = True  # no byte of the body has come yet

    def left(self) -> float:
        """Seconds the engine has for what comes next: the first byte's limit, then the idle limit."""
        if self.first:
            return max(0.0, self.start + self.first_byte_s - asyncio.get_running_loop().time())
        return self.idle_s

    def _timeout(self) -> EngineTimeout:
        if self.first:
            return EngineTimeout(f"the engine sent nothing within {self.first_byte_s:g} s of the request")
        return EngineTimeout(f"the engine sent nothing for {self.idle_s:g} s")

    async def within(self, waiting: Awaitable[T]) -> T:
        """`waiting` (the response's headers), within the first byte's limit."""
        try:
            return await asyncio.wait_for(waiting, self.left())
        except TimeoutError:
            raise self._timeout() from None

    async def pieces(self, upstream: httpx.Response) -> AsyncIterator[bytes]:
        """The response's body, piece by piece, each within its limit."""
        body = upstream.aiter_bytes().__aiter__()
        while True:
            try:
                piece = await asyncio.wait_for(body.__anext__(), self.left())
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise self._timeout() from None
            if piece:
                self.first = False
            yield piece

    async def read(self, upstream: httpx.Response) -> bytes:
        """The whole body, within the limits."""
        return b"".join([piece async for piece in self.pieces(upstream)])
