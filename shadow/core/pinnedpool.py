"""Pinned host memory pinned ahead, off the device thread, for the host tier's copies.

Pinning host memory is slow (about 0.4 s for a 58k session's 0.88 GiB on an H100 host) and, done
where a move begins, stalls the thread that reads. A `PinnedPool` pins slabs on a thread of its
own, ahead of need, and hands out spans of them: each of a copy's tensors is carved from a
page-aligned span of its own (`take`, all or none, best fit), so a move to host memory finds its
memory pinned already. A span goes back to the pool when its tensor and every view of it are freed
(its memory is a buffer object the tensor keeps alive; the pool is told when that object dies), so
the copy's owners (the host tier, staging, a write behind, a restore) need not tell it.

The pool is bounded: its slabs never pass `limit` bytes, and it keeps at least `ahead` bytes free
where the limit allows (a slab pinned each time the free bytes fall below it, or a request went
unmet). A request the free spans cannot hold (the pool full, or no free run long enough) gets
None: the caller pins on its own thread, as before the pool, and the pool counts it
(`fallbacks`). Slabs are kept while the pool lives, and each while a span of it is lent. A span's
return is noted without a lock (a garbage collection may free a tensor on any thread, the pool's
lock held or not) and taken in at the pool's next call.

The pool begins no page-locking beside a copy to or from host memory it is told of (`beside`,
`quiet`): on a lent H100, a copy beside a register call waited for it (about 11 ms a 256 MiB
slab), and moves that ran while the pool registered slabs beside them were 5 to 16 times slower
than alone (docs/BENCHMARKS.md). Its thread maps a slab and makes its pages present (which holds
up no copy), then waits for such copies to finish, at most `QUIET_WAIT_S` a slab (then it pins
anyway: a pool starved of slabs sends copies to pin where they begin, which costs more), and
counts the wait (`quiet_seconds`). A register call already running when a copy begins is not
stopped: that copy waits for it (one slab's call at most).

Exactness is not the pool's concern: a span is memory, the copies into it are the tier's.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from shadow.core import cudart

ALIGN = 4096  # a span's offset and size in its slab: a page, so a span also suits direct I/O
SLAB_BYTES = 256 << 20
QUIET_WAIT_S = 1.0  # the longest the pool's thread holds a slab back for copies in flight
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: the pages made present by mmap itself


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class PoolStats:
    """What the pool holds and did: bytes pinned, free and lent, spans lent, requests it could not
    serve, the seconds its thread spent pinning (none of them on the caller's thread) and waiting
    for copies in flight before it pinned."""

    slabs: int
    pinned_bytes: int
    free_bytes: int
    lent_bytes: int
    spans_lent: int
    takes: int
    fallbacks: int
    pin_seconds: float
    quiet_seconds: float
    error: str | None


class Slab:
    """`nbytes` of anonymous memory, page-aligned, its pages made present when it is mapped
    (outside any CUDA call), then page-locked for the GPU where `pin` (`cudaHostRegister`, called
    without the GIL). Unlocked and unmapped when the slab is freed.

    Why not torch's pinned allocator: while a pool of its slabs (`cudaHostAlloc`) pinned 2 GiB on
    its thread, short synchronised GPU steps on another thread took 256 ms each, not 0.23 ms (a
    lent H100, `experiments/restore_speed.py`'s `steps_beside_pinning`). Made present first and
    registered, 2 GiB held those steps up by one register call at most (7.5 to 11.3 ms a 256 MiB
    slab; p99 0.24 ms); a copy beside a register call waits for it, which is why the pool begins
    none beside a copy (`experiments/pin_stall.py --beside copies`, docs/BENCHMARKS.md)."""

    def __init__(self, nbytes: int, pin: bool):
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
        if hasattr(mmap, "MADV_DONTFORK"):  # a forked child never shares (copies on write) pages the GPU writes to
            self._map.madvise(mmap.MADV_DONTFORK)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.pinned = False
        self._registered: list[int] = []  # the address once page-locked: what the finalizer unlocks
        done = weakref.finalize(self, _unmap, self._map, self._registered)
        done.atexit = False  # at exit the process's memory goes with it; no CUDA call while CUDA shuts down
        if pin:
            self.register()

    def register(self) -> None:
        """Page-lock the slab for the GPU (`cudaHostRegister`, without the GIL), once; raises on a
        CUDA error (the slab is then unmapped when it is freed)."""
        if not self.pinned:
            cudart.host_register(self.address, self.nbytes)
            self._registered.append(self.address)
            self.pinned = True


def _unmap(mapped: mmap.mmap, registered: list[int]) -> None:
    for address in registered:
        cudart.host_unregister(address)
    mapped.close()


class PinnedPool:
    """Host memory (pinned where `pin`) in slabs, at most `limit` bytes in all, at least `ahead`
    bytes kept free by a thread of its own where the limit allows."""

    def __init__(self, limit: int, ahead: int, slab_bytes: int = SLAB_BYTES, pin: bool = True):
        if limit < 0 or ahead < 0 or slab_bytes <= 0:
            raise ValueError("a pinned pool's limit and ahead are >= 0 and its slab size > 0")
        self.limit, self.ahead, self.slab_bytes, self.pin = limit, min(ahead, limit), _aligned(slab_bytes), pin
        self._slabs: list[Slab] = []
        self._free: list[list[tuple[int, int]]] = []  # per slab: (offset, size) runs, by offset, merged
        self._lent: dict[int, tuple[int, int, int]] = {}  # a span's id -> (slab, offset, size)
        self._returned: deque[int] = deque()  # spans whose tensors were freed, given back under the lock
        self._next_id = 0
        self._pinned = 0  # bytes of the slabs
        self._pinning = False  # the thread is pinning a slab now
        self._unmet = 0  # the largest tensor a request could not place since the last slab
        self._takes = self._fallbacks = 0
        self._pin_seconds = self._quiet_seconds = 0.0
        self._in_flight: deque = deque()  # copies to or from host memory in flight: anything with `query()`
        self._error: str | None = None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        # the thread holds the pool weakly: a pool nobody holds is let go, and its thread ends
        self._thread = threading.Thread(target=_fill, args=(weakref.ref(self), self._wake), name="shadow-pinned-pool",
                                        daemon=True)
        self._thread.start()

    # lending -----------------------------------------------------------------------------

    def take(self, specs: Sequence[tuple[torch.Size | tuple[int, ...], torch.dtype]]) -> list[torch.Tensor] | None:
        """Empty tensors of the given shapes and dtypes, each carved from a free span of its own, or
        None where the free spans cannot hold them all (none is taken; the caller allocates its
        own, and the pool pins more ahead). A span comes back to the pool when its tensor, and
        every view of it, is freed; its slab lives at least as long."""
        nbytes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs]
        with self._lock:
            self._collect()
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
                lent.append((self._next_id, self._slabs[slab], offset))
                self._next_id += 1
            if self._free_bytes() < self.ahead:
                self._wake.notify()
        tensors = []
        for (shape, dtype), n, (span_id, slab, offset) in zip(specs, nbytes, lent):
            holder = (ctypes.c_char * max(n, 1)).from_address(slab.address + offset)
            weakref.finalize(holder, _returned, self._returned, span_id, slab)  # the slab lives while the span does
            tensors.append(torch.frombuffer(holder, dtype=torch.uint8)[:n].view(dtype).view(shape))
        return tensors

    def _collect(self) -> None:
        """Spans whose tensors were freed, free again (under the lock)."""
        while self._returned:
            self._free_run(*self._lent.pop(self._returned.popleft()))

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

    # copies in flight ----------------------------------------------------------------------

    def beside(self, event) -> None:
        """A copy to or from host memory is in flight until `event.query()` (a CUDA event recorded
        after it): the pool pins no slab until then (at most `QUIET_WAIT_S`)."""
        with self._lock:
            self._in_flight.append(event)
            self._prune()

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """No slab is begun while the block runs (a copy the caller waits for; at most
        `QUIET_WAIT_S`)."""
        running = _Running()
        self.beside(running)
        try:
            yield
        finally:
            running.over = True

    def _prune(self) -> None:
        """Copies at the head that are done, let go (under the lock)."""
        while self._in_flight and self._in_flight[0].query():
            self._in_flight.popleft()

    def _wait_quiet(self) -> float | None:
        """On the pool's thread, before a slab is page-locked: wait while a copy is in flight, at
        most `QUIET_WAIT_S`; the seconds waited (counted where there was a wait), None when the
        pool was closed meanwhile."""
        start = time.perf_counter()
        while True:
            with self._lock:
                self._prune()
                waited = time.perf_counter() - start
                if self._closed:
                    return None
                if not self._in_flight or waited >= QUIET_WAIT_S:
                    if waited > 0.001:
                        self._quiet_seconds += waited
                    return waited
            time.sleep(0.002)

    # filling ahead -------------------------------------------------------------------------

    def _free_bytes(self) -> int:
        return sum(n for runs in self._free for _, n in runs)

    def _wanted(self) -> int:
        """Bytes of the next slab to pin, 0 for none: one large enough for the largest tensor a
        request could not place, else (while fewer than `ahead` bytes are free) one of
        `slab_bytes`, the first of them the limit has room for (room under the limit smaller than
        a slab stays unpinned)."""
        if self._error is not None or self._closed:
            return 0
        sizes = [max(self.slab_bytes, _aligned(self._unmet))] if self._unmet else []
        if self._free_bytes() < self.ahead:
            sizes.append(self.slab_bytes)
        return next((n for n in sizes if self._pinned + n <= self.limit), 0)

    def _pin(self, nbytes: int) -> None:
        """Pin a slab of `nbytes` (on the pool's thread) and add it to the free runs: mapped with
        its pages present (which holds up no copy), then page-locked once no copy is in flight
        (`_wait_quiet`); nothing is added where the pool was closed meanwhile."""
        start = time.perf_counter()
        try:
            slab = Slab(nbytes, pin=False)
            waited = self._wait_quiet()
            if waited is None:
                with self._lock:
                    self._pinning = False
                return
            if self.pin:
                slab.register()
        except Exception as e:  # noqa: BLE001 - reported in stats; the pool stops growing
            with self._lock:
                self._error, self._pinning = f"{type(e).__name__}: {e}", False
            return
        with self._lock:
            self._pin_seconds += time.perf_counter() - start - waited
            self._slabs.append(slab)
            self._free.append([(0, nbytes)])
            self._pinned += nbytes
            self._pinning = False

    def wait_filled(self, timeout: float = 60.0) -> bool:
        """Block until the pool wants no slab and pins none (its `ahead` free, or its limit
        reached); False on timeout or when its thread stopped on an error. For tests and
        measurements."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                self._collect()
                if self._error is not None:
                    return False
                if not self._pinning and not self._wanted():
                    return True
            time.sleep(0.005)
        return False

    def close(self) -> None:
        """Stop the thread: the pool pins no more (it still lends what it holds). Its slabs go with
        the pool, each one once no span of it is lent."""
        with self._lock:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=5)

    def stats(self) -> PoolStats:
        with self._lock:
            self._collect()
            pinned, free = self._pinned, self._free_bytes()
            return PoolStats(len(self._slabs), pinned, free, pinned - free, len(self._lent), self._takes,
                             self._fallbacks, round(self._pin_seconds, 4), round(self._quiet_seconds, 4), self._error)


class _Running:
    """A copy in flight for as long as a `quiet` block runs."""

    over = False

    def query(self) -> bool:
        return self.over


def _returned(returned: deque[int], span_id: int, slab: Slab) -> None:
    """A span's tensors are freed: noted without a lock (a collection may run this on any thread,
    the pool's lock held or not); `slab` is held until now so the span's memory lives as long."""
    returned.append(span_id)


def _fill(pool_ref: weakref.ref, wake: threading.Condition) -> None:
    """The pool's thread: pin a slab whenever one is wanted, until the pool is closed or let go;
    on an error, pin no more (the error in `stats`; requests the free spans cannot hold fall back
    to the caller)."""
    while True:
        pool = pool_ref()
        if pool is None:
            return
        with wake:
            pool._collect()
            if pool._closed:
                return
            nbytes = pool._wanted()
            if nbytes:
                pool._unmet, pool._pinning = 0, True
            else:
                del pool  # not held while waiting: a pool nobody else holds is let go
                wake.wait(timeout=1.0)
                continue
        pool._pin(nbytes)
        del pool
