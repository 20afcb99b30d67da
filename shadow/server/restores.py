"""Restores started when a request arrives: a session in the host tier or on disk is brought back
onto the device on a thread of its own (the copies on a CUDA stream of their own on a GPU), beside
the shadow's reads and the engine's prefill, and handed to the store when the turn's prompt is fed
(`SessionStore.get(name, ahead)`, which takes it only if its copy or file is still the one it came
from). The reads never wait for a restore; only the turn whose session it is does, and only for
what is left of it when its prompt comes."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from shadow.core.store import Restored, SessionStore

log = logging.getLogger("shadow.restores")


@dataclass
class AheadCounts:
    started: int = 0  # restores started at a request's arrival
    taken: int = 0  # of those, brought back in time and taken by the store
    missed: int = 0  # brought back but not taken (the session changed meanwhile), or failed
    waited_s: float = 0.0  # seconds turns' prompts waited for the rest of a restore
    seconds: float = 0.0  # seconds the restores took, on their own thread

    def as_dict(self) -> dict:
        return {"started": self.started, "taken": self.taken, "missed": self.missed,
                "waited_s": round(self.waited_s, 6), "seconds": round(self.seconds, 6)}


class RestoresAhead:
    """One thread that brings sessions back ahead of their prompts. `start(store, name)` begins one
    (None where there is nothing to bring back); `take(future)` is its result for the store, after
    waiting for what is left (None where it brought nothing or failed, which is logged)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shadow-restore")
        self._stream = None
        self._lock = threading.Lock()
        self.counts = AheadCounts()

    def start(self, store: SessionStore, name: str) -> Future | None:
        if store.peek(name) is not None or store.moving(name) or not store.holds(name):
            return None  # on the device (or still leaving it: `get` keeps it there), or held nowhere
        with self._lock:
            self.counts.started += 1
        return self._pool.submit(self._bring, store, name)

    def _bring(self, store: SessionStore, name: str) -> Restored | None:
        device = store.reader.model.device
        if device.type == "cuda" and self._stream is None:
            import torch

            self._stream = torch.cuda.Stream(device)
        ahead = store.restore_ahead(name, self._stream if device.type == "cuda" else None)
        if ahead is not None:
            with self._lock:
                self.counts.seconds += ahead.seconds
        return ahead

    def take(self, future: Future, name: str) -> Restored | None:
        start = time.perf_counter()
        try:
            ahead = future.result()
        except Exception:  # noqa: BLE001 - a failed restore is logged and the store restores as it would have
            log.exception("restoring session %r ahead of its prompt failed; it is restored when fed", name)
            ahead = None
        with self._lock:
            self.counts.waited_s += time.perf_counter() - start
            if ahead is None or ahead.session.name != name:
                self.counts.missed += 1
                return None
        return ahead

    def taken(self, ahead: Restored, took: bool) -> None:
        """Whether the store took `ahead` (else the session changed while it was brought back)."""
        with self._lock:
            if took:
                self.counts.taken += 1
            else:
                self.counts.missed += 1

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
