"""Files written behind: host copies of sessions written to disk by a thread of their own, so
that no write waits where the store runs (between the shadow's reads): the host tier's copies as
they move in (a copy leaving the tier for disk later needs no write), and the copies of sessions
that leave the device straight for disk.

A job is one session's host copy (tensors nothing changes any more) with what its file carries;
a newer job of the same session replaces one not begun. `drop(name)` drops a job not begun;
`cancel(name)` also waits for one being written, so a write of the same session on the store's
own thread always lands after it. What was written, or why not, is collected by the store on its thread (`done`);
a file is whole or absent at every moment (`sessionfile.write_session` writes a temporary file and
renames it), so a process killed mid-write loses only the job in flight, never a file it had
written. The thread catches every error of a write and reports it; it ends at `close`."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shadow.core.reader import Session


@dataclass(frozen=True)
class Job:
    copy: Session  # the host copy to write
    checks: dict | None  # the caller's record the file carries
    last_use: float


@dataclass(frozen=True)
class Written:
    """A job's outcome: what `write` returned and the seconds it took, or the error that stopped it."""

    name: str
    job: Job
    result: Any
    seconds: float
    error: Exception | None = None


class WriteBehind:
    """One thread running `write(job)` (raising where the disk refuses) for the jobs submitted,
    oldest first."""

    def __init__(self, write: Callable[[Job], Any]):
        self._write = write
        self._cond = threading.Condition()
        self._queue: OrderedDict[str, Job] = OrderedDict()
        self._busy: tuple[str, Job] | None = None
        self._done: list[Written] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="shadow-write-behind", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the write-behind thread is closed")
            self._queue.pop(job.copy.name, None)
            self._queue[job.copy.name] = job
            self._cond.notify_all()

    def drop(self, name: str) -> Job | None:
        """Drop `name`'s job not begun (without waiting for one being written); the job dropped."""
        with self._cond:
            job = self._queue.pop(name, None)
            self._cond.notify_all()
            return job

    def current(self, name: str) -> Job | None:
        """`name`'s job queued or being written (None where there is none)."""
        with self._cond:
            if self._busy is not None and self._busy[0] == name:
                return self._busy[1]
            return self._queue.get(name)

    def cancel(self, name: str) -> None:
        """Drop `name`'s job not begun; wait for one being written."""
        with self._cond:
            self._queue.pop(name, None)
            while self._busy is not None and self._busy[0] == name:
                self._cond.wait()

    def flush(self) -> None:
        """Wait until every job submitted is written (or failed)."""
        with self._cond:
            while self._queue or self._busy is not None:
                self._cond.wait()

    def done(self) -> list[Written]:
        """The outcomes since the last call, in the order they ended."""
        with self._cond:
            out, self._done = self._done, []
            return out

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + (self._busy is not None)

    def close(self) -> None:
        """Write what is queued, then end the thread."""
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                name, job = self._queue.popitem(last=False)
                self._busy = (name, job)
            start = time.perf_counter()
            try:
                written = Written(name, job, self._write(job), time.perf_counter() - start)
            except Exception as e:  # noqa: BLE001 - reported to the store, which logs and counts it
                written = Written(name, job, 0, time.perf_counter() - start, e)
            with self._cond:
                self._done.append(written)
                self._busy = None
                self._cond.notify_all()
