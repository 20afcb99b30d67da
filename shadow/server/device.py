"""One thread owns the device: every piece of model work of the service runs on it, in order.

A request's turn, the idle reader's chunks, asks and spills are jobs handed to this thread; the
caller waits for its job's result. Jobs never overlap, so the device needs no lock, and all model
work comes from one OS thread (on a CPU, torch's thread pool then serves one caller instead of
one per thread, which two callers on few cores make contend). A job that hands in another job
runs it in place.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import TypeVar

from shadow.offline.metrics import pct

T = TypeVar("T")
# the kinds of job the service hands in (a metric's labels from the start); others are counted as they come
KINDS = ("reader", "turn", "end turn", "ask", "settle", "predict", "label", "voice", "health", "load", "save", "unload",
         "stop", "hold")


class JobTimes:
    """How long the device thread's jobs took, by kind: each kind's count, seconds and longest
    since start, and its last `keep` jobs' seconds for their median and p99 (nearest rank).
    `add` is O(1); `status` copies under the same short lock and sorts outside it."""

    def __init__(self, keep: int = 2048):
        self._keep = keep
        self._lock = threading.Lock()
        self._kinds: dict[str, list] = {}  # kind -> [count, seconds, longest, deque of the last seconds]

    def add(self, kind: str, seconds: float) -> None:
        with self._lock:
            k = self._kinds.get(kind)
            if k is None:
                k = self._kinds[kind] = [0, 0.0, 0.0, deque(maxlen=self._keep)]
            k[0] += 1
            k[1] += seconds
            k[2] = max(k[2], seconds)
            k[3].append(seconds)

    def status(self) -> dict[str, dict]:
        """{kind: {count, seconds, mean_ms, p50_ms, p99_ms (of the last jobs kept), max_ms}}."""
        with self._lock:
            kinds = {kind: (n, total, longest, list(recent)) for kind, (n, total, longest, recent) in self._kinds.items()}
        return {kind: {"count": n, "seconds": round(total, 6), "mean_ms": round(total / n * 1000, 3),
                       "p50_ms": round(pct(recent, 50) * 1000, 3), "p99_ms": round(pct(recent, 99) * 1000, 3),
                       "max_ms": round(longest * 1000, 3)}
                for kind, (n, total, longest, recent) in sorted(kinds.items())}


class DeviceThread:
    def __init__(self, name: str = "shadow-device"):
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0  # jobs handed in and not finished
        self.running: str | None = None  # the kind of the job running ("reader", "turn", "ask", ...)
        self.times = JobTimes()  # how long each kind of job took (a job run in place counts in its caller's)
        self.closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, kind, future = job
            self.running = kind
            try:
                if future.set_running_or_notify_cancel():
                    began = time.perf_counter()
                    try:
                        result, error = fn(), None
                    except BaseException as e:  # the caller gets it
                        result, error = None, e
                    self.times.add(kind, time.perf_counter() - began)  # counted before the caller has its result
                    if error is None:
                        future.set_result(result)
                    else:
                        future.set_exception(error)
            finally:
                self.running = None
                with self._lock:
                    self._pending -= 1

    def here(self) -> bool:
        """True on the device thread itself."""
        return threading.current_thread() is self._thread

    def submit(self, fn: Callable[[], T], kind: str = "job") -> Future:
        """Queue fn; its Future holds the result (or the exception)."""
        future: Future = Future()
        with self._lock:
            self._check_open()
            self._pending += 1
            self._jobs.put((fn, kind, future))
        return future

    def run(self, fn: Callable[[], T], kind: str = "job") -> T:
        """fn's result, computed on the device thread after the jobs queued before it."""
        if self.here():
            return fn()
        return self.submit(fn, kind).result()

    def run_if_idle(self, fn: Callable[[], T], kind: str = "job") -> tuple[bool, T | None]:
        """(True, fn's result) when nothing runs or waits on the device; (False, None) at once
        otherwise (a caller that must not wait, e.g. a stream being passed through)."""
        if self.here():
            return True, fn()
        future: Future = Future()
        with self._lock:
            self._check_open()
            if self._pending:
                return False, None
            self._pending += 1
            self._jobs.put((fn, kind, future))
        return True, future.result()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the device thread has stopped")

    def queued(self) -> int:
        """Jobs handed in that wait behind the one running (O(1), no lock: a job that holds the
        device long asks it between its steps, and gives way when another waits)."""
        return max(0, self._pending - (self.running is not None))

    def idle(self) -> bool:
        with self._lock:
            return self._pending == 0

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Keep the device thread waiting while the caller's block runs (no job runs meanwhile)."""
        if self.here():
            yield
            return
        started, done = threading.Event(), threading.Event()

        def wait() -> None:
            started.set()
            done.wait()

        future = self.submit(wait, "hold")
        started.wait()
        try:
            yield
        finally:
            done.set()
            future.result()

    def close(self, timeout: float = 30.0) -> None:
        """Finish the jobs handed in, then end the thread; jobs handed in later are refused."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._jobs.put(None)
        if not self.here():
            self._thread.join(timeout)
