"""A stream's events, from the device side to the one coroutine that relays them: any thread
`put`s, the relay awaits `get` on its event loop, and no thread waits on its behalf."""

from __future__ import annotations

import asyncio


class Events:
    """Made on the event loop whose coroutine reads it. `put` is safe from any thread, and an event
    put after the loop has closed (its client gone, the server stopping) is dropped, never raised."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, event: tuple) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody reads this stream any more
            pass

    async def get(self, timeout_s: float) -> tuple | None:
        """The next event, or None when none comes within `timeout_s`."""
        try:
            return await asyncio.wait_for(self._queue.get(), timeout_s)
        except asyncio.TimeoutError:
            return None

    def get_nowait(self) -> tuple | None:
        """An event already here, or None."""
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None
