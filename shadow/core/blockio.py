"""Block I/O for session files: a file's data read or written in large aligned blocks, several in
flight at once on a pool of threads that also computes each block's digest (`os.preadv`,
`os.pwrite` and hashlib let go of the GIL), while the caller's thread moves the bytes between the
blocks and their tensors: a copy to or from the device per block, from pinned host memory and
without waiting (a CUDA event tells the pool when a block's buffer is free again).

- Buffers are page-aligned host memory, pinned when a CUDA device is involved, a ring of
  `workers + SPARE` blocks reused as they free: memory in use stays bounded whatever the file's
  size (about 128 MiB with 8 MiB blocks and 12 threads).
- O_DIRECT (the page cache bypassed) where the file system takes it and the offsets allow
  (data starting at a multiple of `ALIGN`, blocks of a multiple of `ALIGN`); a file system that
  refuses it is read and written through the page cache instead, with the same bytes.
- The pool lives for one call: no thread outlives a read or a write.

GPUDirect Storage (kvikio / cuFile) would read a file straight into device memory; `gds_status`
says whether it could run here. Session files do not use it: every byte must be hashed on the
host before any of it is used, so the bytes cross to the host either way (see docs/STORE.md).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

ALIGN = 4096  # offsets, lengths and buffers of O_DIRECT I/O are multiples of this
O_DIRECT = getattr(os, "O_DIRECT", 0)
MAX_WORKERS = 12
SPARE = 4  # buffers beyond one a thread: blocks whose copies are still in flight


class ShortRead(Exception):
    """The file ended before a block did: `offset` is where it ended."""

    def __init__(self, offset: int):
        super().__init__(f"ends at byte {offset}")
        self.offset = offset


def default_workers() -> int:
    """Threads of a read or write: one per core, at most MAX_WORKERS."""
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


def round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def sha256(view: memoryview) -> bytes:
    """The SHA-256 of one block (the session file's block digest)."""
    return hashlib.sha256(view).digest()


class Buffers:
    """`count` host blocks of `size` bytes each, page-aligned, pinned when `pinned`: `tensors[i]`
    (uint8) and `views[i]` (a memoryview of the same bytes, for os and hashlib)."""

    def __init__(self, count: int, size: int, pinned: bool):
        base = torch.empty(count * size, dtype=torch.uint8, pin_memory=pinned)  # pinned memory is page-aligned
        if base.data_ptr() % ALIGN:
            base = torch.empty(count * size + ALIGN, dtype=torch.uint8, pin_memory=pinned)
        skip = -base.data_ptr() % ALIGN
        self._base = base  # keeps the memory alive
        self.tensors = [base[skip + i * size : skip + (i + 1) * size] for i in range(count)]
        self.views = [memoryview(t.numpy()) for t in self.tensors]


def set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for `fd`; whether it is on now (False where the system refuses)."""
    if not O_DIRECT:
        return False
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | O_DIRECT if on else flags & ~O_DIRECT)
        return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT)
    except OSError:
        return False


def direct_supported(folder: Path) -> bool:
    """Whether files in `folder` take O_DIRECT (a probe file is made and removed)."""
    probe = Path(folder) / f".direct-probe.{os.getpid()}.tmp"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        return set_direct(fd, True)
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def _is_direct(fd: int) -> bool:
    try:
        return bool(O_DIRECT and fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT)
    except OSError:
        return False


def pread_into(fd: int, view: memoryview, offset: int, n: int) -> int:
    """Read up to `n` bytes at `offset` into `view` (whole aligned requests under O_DIRECT: `view`
    holds `round_up(n)` bytes); returns the bytes read, fewer only at the end of the file. A
    request the file system refuses under O_DIRECT (EINVAL) turns O_DIRECT off and is read again."""
    got = 0
    while got < n:
        ask = round_up(n) if _is_direct(fd) and got % ALIGN == 0 else n
        try:
            step = os.preadv(fd, [view[got:ask]], offset + got)
        except OSError as e:
            if e.errno == errno.EINVAL and _is_direct(fd):
                set_direct(fd, False)
                continue
            raise
        if step == 0:
            break
        got += step
    return min(got, n)


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of `view` at `offset` (os.pwrite may write less than asked). A write refused
    under O_DIRECT (EINVAL) turns O_DIRECT off and is written again."""
    done = 0
    while done < len(view):
        try:
            done += os.pwrite(fd, view[done:], offset + done)
        except OSError as e:
            if e.errno == errno.EINVAL and _is_direct(fd):
                set_direct(fd, False)
                continue
            raise


def read_blocks(
    fd: int, start: int, total: int, block: int,
    check: Callable[[int, memoryview], None],
    deliver: Callable[[int, torch.Tensor, memoryview], object | None],
    *, pinned: bool = False, workers: int | None = None, direct: bool = True,
) -> None:
    """Read bytes [start, start + total) of `fd` in blocks of `block` bytes (a multiple of ALIGN).
    For block i a pool thread reads it into a free buffer and calls `check(i, bytes)`, which
    raises to refuse it; then the caller's thread calls `deliver(i, tensor, bytes)` for each block
    in order, and the buffer is read into again once the event `deliver` returns has completed.
    Raises ShortRead where the file ends early, and whatever `check` or the reads raise; every
    thread has stopped and every copy from the buffers has completed when it returns or raises."""
    if total <= 0:
        return
    count = -(-total // block)
    workers = workers or default_workers()
    slots = min(count, workers + SPARE)
    buffers = Buffers(slots, block, pinned)
    if direct and start % ALIGN == 0 and block % ALIGN == 0:
        set_direct(fd, True)
    events: list[object | None] = [None] * slots

    def read(i: int) -> int:
        s = i % slots
        if events[s] is not None:
            events[s].synchronize()
        n = min(block, total - i * block)
        got = pread_into(fd, buffers.views[s], start + i * block, n)
        if got < n:
            raise ShortRead(start + i * block + got)
        check(i, buffers.views[s][:n])
        return n

    try:
        _pipeline(count, slots, workers, read, lambda i, n: events.__setitem__(
            i % slots, deliver(i, buffers.tensors[i % slots][:n], buffers.views[i % slots][:n])))
    finally:
        _wait(events)
        set_direct(fd, False)


def write_blocks(
    fd: int, start: int, total: int, block: int,
    fill: Callable[[int, torch.Tensor], object | None],
    *, pinned: bool = False, workers: int | None = None, direct: bool = True,
) -> list[bytes]:
    """Write `total` bytes at `start` of `fd` in blocks of `block` bytes: the caller's thread has
    `fill(i, tensor)` put block i's bytes into a free buffer (returning the event of its copies,
    or None), then a pool thread waits for it, computes the block's SHA-256 and writes it. Under
    O_DIRECT the last block is written padded with zeros to ALIGN: the caller truncates the file.
    Returns the blocks' digests in order; raises what a write raises, every thread stopped."""
    if total <= 0:
        return []
    count = -(-total // block)
    workers = workers or default_workers()
    slots = min(count, workers + SPARE)
    buffers = Buffers(slots, block, pinned)
    if direct and start % ALIGN == 0 and block % ALIGN == 0:
        set_direct(fd, True)
    digests: list[bytes] = [b""] * count
    events: list[object | None] = [None] * slots

    def write(i: int) -> int:
        s, n = i % slots, min(block, total - i * block)
        if events[s] is not None:
            events[s].synchronize()
        view = buffers.views[s]
        digests[i] = sha256(view[:n])
        pwrite_all(fd, view[: round_up(n) if _is_direct(fd) else n], start + i * block)
        return n

    def before(i: int) -> None:  # the caller's thread, in order, once block i's buffer is free
        s, n = i % slots, min(block, total - i * block)
        events[s] = fill(i, buffers.tensors[s][:n])
        if n % ALIGN:
            buffers.tensors[s][n : round_up(n)].zero_()

    try:
        _pipeline(count, slots, workers, write, None, before)
    finally:
        _wait(events)
        set_direct(fd, False)
    return digests


def _pipeline(count: int, slots: int, workers: int, work: Callable[[int], int],
              after: Callable[[int, int], None] | None, before: Callable[[int], None] | None = None) -> None:
    """Run `work(i)` for i in 0..count on a pool, at most `slots` in flight; `before(i)` runs on
    the caller's thread before block i is submitted (once block i - slots is done), `after(i, n)`
    on the caller's thread once block i is done, in order. The first failure is raised after
    every submitted piece has stopped."""
    futures: dict[int, Future] = {}
    with ThreadPoolExecutor(workers, thread_name_prefix="session-io") as pool:
        try:
            for i in range(count):
                if i >= slots:
                    done = i - slots
                    n = futures.pop(done).result()
                    if after:
                        after(done, n)
                if before:
                    before(i)
                futures[i] = pool.submit(work, i)
            for done in sorted(futures):
                n = futures.pop(done).result()
                if after:
                    after(done, n)
        finally:
            for f in futures.values():
                f.cancel()


def _wait(events: list[object | None]) -> None:
    for event in events:
        if event is not None:
            event.synchronize()


def gds_status() -> tuple[bool, str]:
    """Whether GPUDirect Storage could run here (kvikio importable, cuFile's driver present), and why not."""
    try:
        import kvikio  # optional, never a dependency
    except Exception as e:  # noqa: BLE001 - any failure to import means not available
        return False, f"kvikio is not importable ({type(e).__name__})"
    try:
        if not kvikio.DriverProperties().is_gds_available:
            return False, "kvikio is importable, cuFile's GPUDirect driver is not available (compatibility mode)"
    except Exception as e:  # noqa: BLE001 - a kvikio without the driver's properties, or no GPU
        return False, f"kvikio is importable, cuFile's state is unknown ({type(e).__name__}: {str(e)[:80]})"
    return True, "kvikio with cuFile's GPUDirect driver"
