"""Pinned host memory pinned ahead, off the device thread, for the host tier's copies.

Pinning host memory is slow (about 0.4 s for a 58k session's 0.88 GiB on an H100 host) and, done
where a move begins, stalls the thread that reads. A `PinnedPool` pins slabs on a thread of its
own, ahead of need, and hands out spans of them: a copy's tensors are carved from one span
(`take`), each aligned, so a move to host memory finds its memory pinned already. A span goes back
to the pool when the last tensor carved from it is freed (its memory is a buffer object the
tensors keep alive; the pool is told when that object dies), so the copy's owners (the host tier,
staging, a write behind, a restore) need not tell it.

The pool is bounded: its slabs never pass `limit` bytes, and it keeps at least `ahead` bytes free
where the limit allows (a slab pinned each time the free bytes fall below it, or a request went
unmet). A request the free spans cannot hold (the pool full, or no free run long enough) gets None: the caller pins on its own thread, as
before the pool, and the pool counts it (`fallbacks`). Slabs are kept until `close`.

Exactness is not the pool's concern: a span is memory, the copies into it are the tier's.
"""

from __future__ import annotations

import ctypes
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

ALIGN = 4096  # a span's offset and size in its slab: a page, so a span also suits direct I/O
SLAB_BYTES = 256 << 20


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class PoolStats:
    """What the pool holds and did: bytes pinned, free and lent, spans lent, requests it could not
    serve, and the seconds its thread spent pinning (none of them on the caller's thread)."""

    slabs: int
    pinned_bytes: int
    free_bytes: int
    lent_bytes: int
    spans_lent: int
    takes: int
    fallbacks: int
    pin_seconds: float
    error: str | None


class PinnedPool:
    """Host memory (pinned where `pin`) in slabs of `slab_bytes`, at most `limit` bytes in all,
    at least `ahead` bytes kept free by a thread of its own where the limit allows."""

    def __init__(self, limit: int, ahead: int, slab_bytes: int = SLAB_BYTES, pin: bool = True):
        if limit < 0 or ahead < 0 or slab_bytes <= 0:
            raise ValueError("a pinned pool's limit and ahead are >= 0 and its slab size > 0")
        self.limit, self.ahead, self.slab_bytes, self.pin = limit, min(ahead, limit), slab_bytes, pin
        self._slabs: list[torch.Tensor] = []
        self._free: list[list[tuple[int, int]]] = []  # per slab: (offset, size) runs, by offset, merged
        self._lent: dict[int, tuple[int, int, int]] = {}  # a span's id -> (slab, offset, size)
        self._next_id = 0
        self._pinned = 0  # bytes of the slabs' spans (each slab pins a page more, for alignment)
        self._unmet = 0  # the largest tensor a request could not place since the last slab
        self._takes = self._fallbacks = 0
        self._pin_seconds = 0.0
        self._error: str | None = None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._thread = threading.Thread(target=self._fill, name="shadow-pinned-pool", daemon=True)
        self._thread.start()

    # lending -----------------------------------------------------------------------------

    def take(self, specs: Sequence[tuple[torch.Size | tuple[int, ...], torch.dtype]]) -> list[torch.Tensor] | None:
        """Empty tensors of the given shapes and dtypes, each carved from a free span of its own, or
        None where the free spans cannot hold them all (none is taken; the caller allocates its
        own, and the pool pins more ahead). A span comes back to the pool when its tensor, and
        every view of it, is freed."""
        nbytes = [torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs]
        with self._lock:
            self._takes += 1
            spans = []
            for n in nbytes:
                found = self._best_fit(max(_aligned(n), ALIGN))
                if found is None:
                    for slab, offset, size in spans:
                        self._free_run(slab, offset, size)
                    self._fallbacks += 1
                    self._unmet = max(self._unmet, max(nbytes, default=0))
                    self._wake.notify()
                    return None
                spans.append(found)
            lent = []
            for slab, offset, size in spans:
                self._lent[self._next_id] = (slab, offset, size)
                lent.append((self._next_id, self._slabs[slab].data_ptr() + offset))
                self._next_id += 1
            if self._free_bytes() < self.ahead:
                self._wake.notify()
        tensors = []
        for (shape, dtype), n, (span_id, address) in zip(specs, nbytes, lent):
            holder = (ctypes.c_char * max(n, 1)).from_address(address)
            weakref.finalize(holder, self._give_back, span_id)
            tensors.append(torch.frombuffer(holder, dtype=torch.uint8)[:n].view(dtype).view(shape))
        return tensors

    def _best_fit(self, size: int) -> tuple[int, int, int] | None:
        """(slab, offset, size) of `size` bytes taken from the start of the shortest free run that
        holds them; None if none does."""
        best = None
        for s, runs in enumerate(self._free):
            for i, (offset, run) in enumerate(runs):
                if run >= size and (best is None or run < best[3]):
                    best = (s, i, offset, run)
        if best is None:
            return None
        s, i, offset, run = best
        if run == size:
            del self._free[s][i]
        else:
            self._free[s][i] = (offset + size, run - size)
        return s, offset, size

    def _free_run(self, slab: int, offset: int, size: int) -> None:
        """Bytes [offset, offset + size) of `slab` free again, merged with their free neighbours."""
        runs = self._free[slab]
        runs.append((offset, size))
        runs.sort()
        merged: list[tuple[int, int]] = []
        for o, n in runs:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((o, n))
        self._free[slab] = merged

    def _give_back(self, span_id: int) -> None:
        with self._lock:
            self._free_run(*self._lent.pop(span_id))

    # filling ahead -------------------------------------------------------------------------

    def _free_bytes(self) -> int:
        return sum(n for runs in self._free for _, n in runs)

    def _wants_slab(self) -> int:
        """Bytes of the next slab to pin, 0 for none: one of `slab_bytes` (or of the largest tensor
        a request could not place, if larger) while the free bytes are below `ahead` or a request
        went unmet, within the limit."""
        if self._error is not None or not (self._free_bytes() < self.ahead or self._unmet):
            return 0
        size = _aligned(max(self.slab_bytes, self._unmet))
        if self._pinned + size > self.limit:
            self._unmet = 0  # no room: the caller's own pins serve those requests
            return 0
        return size

    def _fill(self) -> None:
        """The pool's thread: pin a slab whenever one is wanted; on an error, stop pinning (the
        error in `stats`, requests no span fits fall back to the caller)."""
        while True:
            with self._lock:
                while not self._closed and not (nbytes := self._wants_slab()):
                    self._wake.wait()
                if self._closed:
                    return
                self._unmet = 0
            start = time.perf_counter()
            try:  # a page more, so that its spans start on page boundaries
                slab = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=self.pin)
            except Exception as e:  # noqa: BLE001 - reported in stats; the pool stops growing
                with self._lock:
                    self._error = f"{type(e).__name__}: {e}"
                return
            with self._lock:
                self._pin_seconds += time.perf_counter() - start
                self._slabs.append(slab)
                self._free.append([(-slab.data_ptr() % ALIGN, nbytes)])
                self._pinned += nbytes

    def wait_filled(self, timeout: float = 60.0) -> bool:
        """Block until the pool wants no slab (its `ahead` free, or its limit reached); False on
        timeout or when its thread stopped on an error. For tests and measurements."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                if self._error is not None:
                    return False
                if not self._wants_slab():
                    return True
            time.sleep(0.005)
        return False

    def close(self) -> None:
        """Stop the thread; the slabs are let go once every span lent from them is freed."""
        with self._lock:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=5)

    def stats(self) -> PoolStats:
        with self._lock:
            pinned, free = self._pinned, self._free_bytes()
            return PoolStats(len(self._slabs), pinned, free, pinned - free, len(self._lent), self._takes,
                             self._fallbacks, round(self._pin_seconds, 4), self._error)
