"""A streamed response that always says when it is over: `on_close` runs once its ASGI call ends,
however it ends (the body sent, an error, the client gone while it streamed or before the first
byte, when the body's generator never started and so never ran its own `finally`); the body's
generator is closed first, so its `finally` has run by then if it started. `on_disconnect` runs
when the client goes away before the body was all sent (the embedded generator stops then)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
from fastapi.responses import StreamingResponse

log = logging.getLogger("shadow.serve")


class ClosingStream(StreamingResponse):
    def __init__(self, content, on_close: Callable[[], Awaitable[None]],
                 on_disconnect: Callable[[], None] | None = None, **options):
        super().__init__(content, **options)
        self.on_close, self.on_disconnect = on_close, on_disconnect

    async def listen_for_disconnect(self, receive) -> None:
        await super().listen_for_disconnect(receive)  # cancelled instead once the body is all sent
        if self.on_disconnect is not None:
            self.on_disconnect()

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # a request cancelled meanwhile still ends its turn
                close = getattr(self.body_iterator, "aclose", None)
                try:
                    if close is not None:
                        await close()
                except Exception:  # noqa: BLE001 - the generator's own end failed: the turn still ends
                    log.exception("a stream's generator failed as it closed")
                await self.on_close()
