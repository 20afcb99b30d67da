"""Python's garbage collector in a long-running server. A full collection walks every object the
process holds; after a load (torch, the tokenizer's tables, the models' modules: a few hundred
thousand objects) that takes tens of milliseconds on a fast host and more on a slow one, and it
runs on whichever thread allocated last: a stall in every stream. `freeze` moves what exists
now out of its reach (the load's objects live as long as the process); `GcPauses` times every
collection by generation, for status, and keeps when the long ones came."""

from __future__ import annotations

import gc
import threading
import time


class GcPauses:
    """Collections counted and timed by generation (0, 1, 2), from `gc.callbacks`."""

    LONG_MS = 5.0  # a pause this long is kept with its time (the last `KEEP` of them)
    KEEP = 32

    def __init__(self):
        self.collections = [0, 0, 0]
        self.longest_ms = [0.0, 0.0, 0.0]
        self.total_s = 0.0
        # (wall-clock end, generation, ms): a tuple replaced whole at each long pause, never changed in
        # place, so a reader iterating it while a collection runs (and appends) keeps its own
        self.long: tuple = ()
        self._started = threading.local()  # a collection runs on the thread that triggered it

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started.at = time.perf_counter()
            return
        start = getattr(self._started, "at", None)
        if start is None:
            return
        self._started.at = None
        seconds = time.perf_counter() - start
        g = min(2, int(info.get("generation", 2)))
        self.collections[g] += 1
        self.longest_ms[g] = max(self.longest_ms[g], 1000 * seconds)
        self.total_s += seconds
        if 1000 * seconds >= self.LONG_MS:
            self.long = (*self.long, (time.time(), g, 1000 * seconds))[-self.KEEP:]

    def status(self) -> dict:
        """Counts and longest pauses by generation, and the last long pauses with when they ended
        (seconds since the epoch: to set beside a client's stall). A collection may run while the
        answer is built (it allocates): the long pauses read here are the tuple of that moment."""
        long = self.long
        return {"collections": list(self.collections), "longest_ms": [round(x, 3) for x in self.longest_ms],
                "total_s": round(self.total_s, 6), "frozen": gc.get_freeze_count(),
                "long_pauses": [{"at": round(at, 3), "generation": g, "ms": round(ms, 3)} for at, g, ms in long]}


_pauses: GcPauses | None = None
_lock = threading.Lock()


def install() -> GcPauses:
    """The process's collection timer, registered once."""
    global _pauses
    with _lock:
        if _pauses is None:
            _pauses = GcPauses()
            gc.callbacks.append(_pauses)
        return _pauses


def installed() -> GcPauses | None:
    return _pauses


def collected_s() -> float:
    """Seconds the process's collections have taken so far (0 while no timer is installed)."""
    return 0.0 if _pauses is None else _pauses.total_s


_froze = False  # the process froze once (a server's choice): loads freeze again, unloads thaw


def freeze() -> int:
    """Collect what is garbage now, then freeze every object left (never collected again, never
    walked by a collection); the objects frozen."""
    global _froze
    gc.collect()
    gc.freeze()
    _froze = True
    return gc.get_freeze_count()


def refreeze() -> int | None:
    """After a load that ran once the process froze (a model loaded in the background after the
    server listened): freeze again, so the model's objects, its kernels' caches among them, leave
    the collector's walks too; the objects frozen. None (nothing done) in a process that never froze."""
    return freeze() if _froze else None


def thaw() -> None:
    """Before an unload in a process that froze: every frozen object back in the collector's reach,
    so what the unload lets go is collected even where it holds cycles (freed device memory)."""
    if _froze:
        gc.unfreeze()
