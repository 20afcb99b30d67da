"""Many sessions in bounded memory: a resident cap with least-recently-used moves to host memory
and to disk.

Past the cap (GiB of allocated state, checkpoints included) the least recently used sessions go
to the host tier where one is set (`hosttier`: host copies of the same tensors, bounded by
`host_cap_gib`), and past the host tier's cap its oldest copies go to disk, one file each
(`sessionfile`); every tier gives a session back bit for bit when it is asked for. A session leaves
for the fastest tier with room and is dropped only where none holds it (no disk); status says
where each one is and why it left.

Moves beside the reads: a session leaving the device is copied to host memory on a CUDA stream
of its own (`hosttier.move_to_host`); its device rows are let go only once the copy's event has
completed, at a later settle or `get` (between reads), and until then it is "moving" (its rows
count as resident). A session bound for disk waits in host memory as such a copy ("staged",
within `stage_cap_gib`) while the write-behind thread (`writebehind`) writes its file, so the
store's thread never waits for a disk; one larger than the staging bound is written where the
store runs. A session asked for while it moves stays on the device; one asked for while its
copy waits for its write comes back from the copy. A write that fails (disk full, I/O error)
keeps the copy in host memory (or the session resident, for a write the store made itself),
counts it, and a later settle tries again; a full disk lets no session leave for disk until then.
Without a disk folder sessions past the cap are dropped and read again from the start by
whoever feeds them next. Without CUDA the copies are plain, whole as the move begins.

The folder may hold anything else: the store touches only its own files (named
`<32 hex>.safetensors`, with the session marker in their header), never follows a symbolic link,
and skips what it cannot read. Its files older than `max_age_s` or past the disk cap (oldest
first) are removed. A bad file is reported once (logged, counted, renamed `*.rejected`) and the
session starts over; nothing is served from it, and no request or status call raises for it.
The clock is injected, so the same code runs live and in tests.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import stat
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from collections.abc import Callable, Container
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

from shadow.errors import ShadowInputError
from shadow.model.runtime import arithmetic
from shadow.core import blockio
from shadow.core.hosttier import HostTier, Move, from_host, host_bytes, move_to_host
from shadow.core.pinnedpool import PinnedPool
from shadow.core.reader import Reader, Session
from shadow.core.residency import GIB, PIN_AHEAD_GIB, RestoreRate, Settle
from shadow.core.sessionfile import (
    MARKER, MAX_HEADER, SUFFIX, Header, Identity, SessionFileError, read_fields, read_session,
    session_file_name, write_session,
)
from shadow.core.sessionformat import key_bytes
from shadow.core.writebehind import Job, WriteBehind

log = logging.getLogger("shadow.core.store")
REJECTED = ".rejected"
OWN_FILE = re.compile(r"[0-9a-f]{32}" + re.escape(SUFFIX) + f"(?:{re.escape(REJECTED)})?")
OWN_TMP = re.compile(r"\.[0-9a-f]{32}" + re.escape(SUFFIX) + r"\.(\d+)(?:\.[0-9a-f]+)?\.tmp")
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
RETRY_S = 10.0  # a failed spill is not tried again sooner (by the store's clock): a settle follows every chunk
STALE_TMP_S = 3600.0  # a temporary file this old is a killed writer's, whatever its pid
FOLDER_MODE = 0o700
RECENT_DROPS = 64  # dropped sessions whose reason totals() keeps
MEASURE_NAME = "shadow restore measurement"  # no client can name a session so (a space)
STAGE_CAP_GIB = 4.0  # host memory the copies waiting for their writes to disk may hold


@dataclass
class SessionRow:
    """One session as status reports it."""

    name: str
    committed: int
    pending: int  # ids known but not read yet: the backlog
    bytes: int
    checkpoints: int
    resident: bool
    last_use: float
    write_error: str | None = None  # why its last write failed (it stays resident until one succeeds)
    left_memory: str | None = None  # in the host tier or on disk: why it left the device
    tier: str = "device"  # where it is: "device" (resident), "host" or "disk"
    moving: str | None = None  # on its way: "to host memory" or "to disk" (its copy or its write in flight)


@dataclass
class StoreCounters:
    spills: int = 0
    restores: int = 0
    drops: int = 0  # every session that left memory unwritten: no tier could hold it (no disk)
    bytes_written: int = 0
    bytes_restored: int = 0
    restore_seconds: float = 0.0
    spill_seconds: float = 0.0
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)
    removed: int = 0  # files removed by retention
    write_failures: int = 0  # writes that failed; each session stayed resident
    last_error: str | None = None  # the last failed write or removal, with its reason
    to_host: int = 0  # sessions moved from the device to the host tier
    from_host: int = 0  # sessions moved back from the host tier
    host_to_disk: int = 0  # host copies written to disk to make room in the host tier
    bytes_to_host: int = 0
    bytes_from_host: int = 0
    to_host_seconds: float = 0.0
    from_host_seconds: float = 0.0
    written_behind: int = 0  # host copies written to disk by the write-behind thread
    moves_kept: int = 0  # sessions asked for while their copy out was in flight: they stayed on the device
    back_before_written: int = 0  # sessions back from the copy that waited for its write (counted in restores)
    stage_full: int = 0  # times a session stayed past the cap: the copies waiting for their writes held the bound
    staging_seconds: float = 0.0  # seconds the store's thread took to begin copies of sessions bound for disk

    @property
    def restore_gib_per_s(self) -> float | None:
        return self.bytes_restored / GIB / self.restore_seconds if self.restore_seconds else None

    @property
    def spill_gib_per_s(self) -> float | None:
        return self.bytes_written / GIB / self.spill_seconds if self.spill_seconds else None


def session_bytes(session: Session) -> int:
    return session.state.allocated_bytes() + sum(c.nbytes() for c in session.checkpoints)


class SessionStore:
    """Sessions by name. `get` returns a resident session (restored or new); after working on it,
    `settle(keep=name)` enforces the cap. `close()` writes every session held in memory, resident
    or in the host tier (a planned stop), and returns those it could not write."""

    def __init__(
        self, reader: Reader, weights_hash: str, *, cap_gib: float | None = 4.0, disk: Path | None = None,
        disk_cap_gib: float | None = 64.0, max_age_s: float = 48 * 3600, model: str = "",
        clock: Callable[[], float] = time.time, retry_s: float = RETRY_S, key: str | bytes | None = None,
        direct: bool = True, host_cap_gib: float | None = None, stage_cap_gib: float = STAGE_CAP_GIB,
        pin_ahead_gib: float = PIN_AHEAD_GIB,
    ):
        """`disk_cap_gib` bounds the store's own files in `disk` (None: no bound); a session whose
        spill failed is tried again at the first settle `retry_s` or more later. With `key`, files
        carry a keyed digest made with it and only files with that digest are read. `direct`: O_DIRECT file I/O where the file system takes it.
        `host_cap_gib`: the host tier's bound (None or 0: no host tier, sessions past the cap
        go to disk or are dropped). `stage_cap_gib`: the host memory the copies of sessions bound
        for disk may hold while they wait for their writes. `pin_ahead_gib`: on a GPU, the host
        memory kept pinned and free ahead of the next moves out (at or past the two bounds: all of
        it, pinned when the store starts)."""
        if not (math.isfinite(pin_ahead_gib) and pin_ahead_gib >= 0):
            raise ValueError(f"pin_ahead_gib is a finite number >= 0, not {pin_ahead_gib}")
        self.pin_ahead = int(pin_ahead_gib * GIB)
        self.reader = reader
        self.identity = Identity(weights_hash, reader.grid, arithmetic(reader.model))
        self.cap = None if cap_gib is None else int(cap_gib * GIB)  # None: no cap
        self.host = HostTier(int(host_cap_gib * GIB)) if host_cap_gib else None
        self.disk = Path(disk) if disk else None
        self.disk_cap = None if disk_cap_gib is None else int(disk_cap_gib * GIB)
        self.max_age_s = max_age_s
        self.model = model
        self.clock = clock
        self.counters = StoreCounters()
        self._resident: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._last_use: dict[str, float] = {}
        self._unwritten: dict[str, str] = {}  # resident sessions whose last write failed: the reason
        self._retry_at: dict[str, float] = {}  # when a failed spill may be tried again
        self.retry_s = retry_s
        self._refused: set[tuple[str, int, int, int]] = set()  # refused files that could not be moved aside
        try:
            self.key = key_bytes(key)
        except ValueError as e:
            raise ShadowInputError(str(e)) from None
        self.restore_rate = RestoreRate()
        self.direct = direct
        self._spilled_why: dict[str, str] = {}  # sessions on disk: why they were spilled, not dropped
        self.recent_drops: OrderedDict[str, str] = OrderedDict()  # dropped sessions: why (the last RECENT_DROPS)
        self.timed: Callable[[str, float], None] = lambda kind, seconds: None  # each "spill" and "restore", timed
        # the caller's record of a session (a JSON object, or None), written into its file: the
        # service sets it to its checks of the session's ids, so a restart knows what was exact
        self.annotate: Callable[[str], dict | None] | None = None
        self._saved: dict[str, tuple] = {}  # sessions whose file holds them as they were: `_version` then
        self.behind: WriteBehind | None = None  # writes host copies to disk (made with the first one)
        self.stage_cap = int(stage_cap_gib * GIB)
        self._moving: OrderedDict[str, Leaving] = OrderedDict()  # copies out in flight, oldest first
        self._letting_go: list[Leaving] = []  # moves of sessions gone meanwhile: their rows held until done
        self._kept: list[Move] = []  # moves let go for sessions kept on the device: their copies held until done
        self._staged: OrderedDict[str, Session] = OrderedDict()  # host copies bound for disk, not yet written
        self._staged_bytes: dict[str, int] = {}
        self._written: set[str] = set()  # host-tier copies whose file holds them
        self._disk_full_until = -math.inf  # a write behind found the disk full: nothing leaves for it before then
        self._stream = None  # the CUDA stream copies out run on (made with the first one)
        self.pinned = self._pinned_pool()  # host memory for copies out, pinned ahead (None off a GPU)
        self._header_cache: dict[str, tuple[tuple, Header | None]] = {}  # file name: (its stamp, its header)
        self._sweep_lock = threading.Lock()  # sweeps run where the store runs and on the write-behind thread
        if self.disk:
            _make_folder(self.disk)
            self.sweep()

    @cached_property
    def gds(self) -> tuple[bool, str]:
        """(whether GPUDirect Storage could run here, why or why not); restores do not use it (the
        digest is computed on the host, so the bytes cross to it either way)."""
        return blockio.gds_status()

    @property
    def gds_available(self) -> bool:
        return self.gds[0]

    # sessions ---------------------------------------------------------------------------

    def get(self, name: str, ahead: Restored | None = None) -> Session:
        """The session `name`, resident and most recently used: as it was (kept on the device where its
        copy out is in flight), moved back from host memory, restored from disk, or new. A bad file
        is refused (reported once) and the session starts over; a bad file never raises.
        `ahead`: what `restore_ahead` brought back, taken if its host copy or file is still the one
        it came from, or its copy left host memory because its file was written."""
        self._moves_done()
        session = self._resident.get(name)
        if session is None:
            session = self._keep_moving(name) or (self._adopt(name, ahead) if ahead is not None else None) \
                or self._from_host(name) or self._from_staged(name) or self._restore(name) \
                or self.reader.new_session(name)
            self._resident[name] = session
        self._resident.move_to_end(name)
        self._last_use[name] = self.clock()
        return session

    def peek(self, name: str) -> Session | None:
        """The session if it is resident, without touching its last use or restoring it."""
        return self._resident.get(name)

    def moving(self, name: str) -> bool:
        """Whether `name` is leaving the device, its copy out in flight (`get` keeps it where it is)."""
        return name in self._moving

    def holds(self, name: str) -> bool:
        """Whether the store keeps `name`: resident or moving, in host memory, or a file of it on disk
        (a session dropped without a disk is gone; `get` would start it over, empty)."""
        if name in self._resident or name in self._moving or name in self._staged \
                or (self.host is not None and name in self.host):
            return True
        return self._file_of(name) is not None

    def _file_of(self, name: str) -> tuple[Path, os.stat_result] | None:
        """`name`'s file in the disk folder and its `lstat`, where there is a disk and the file is a
        regular one (a link is not followed); None otherwise."""
        if not self.disk:
            return None
        path = self.path_of(name)
        try:
            st = path.lstat()
        except OSError:
            return None
        return (path, st) if stat.S_ISREG(st.st_mode) else None

    def unread(self, name: str) -> int | None:
        """The ids the store holds of session `name` and has not read (a held output counted), wherever
        it is; None where the store holds no such session (or only a file of it that is not valid).
        Moves nothing; reads at most the header of its own file, and that only where the file
        changed since it was last read (`_header`)."""
        session = self._resident.get(name) or (self._moving[name].move.session if name in self._moving else None) \
            or self._staged.get(name) or (self.host.peek(name) if self.host is not None else None)
        if session is not None:
            return session.pending
        found = self._file_of(name)
        header = self._header(*found) if found is not None else None
        return None if header is None or header.name != name else header.tokens - header.committed

    def names(self) -> list[str]:
        """Every session: resident or moving, in host memory, or on disk in a valid header."""
        on_disk = {h.name for _, h, _ in self._headers()}
        in_host = set(self.host.names()) if self.host is not None else set()
        return sorted(set(self._resident) | set(self._moving) | set(self._staged) | in_host | on_disk)

    def records(self) -> dict[str, tuple[dict, int]]:
        """Each session on disk whose file carries the caller's record (`annotate`): (the record,
        the ids the file holds), from the headers alone."""
        mine = self.identity
        return {h.name: (h.checks, h.tokens) for _, h, _ in self._headers() if h.checks is not None
                and (h.weights_hash, h.grid, h.arithmetic) == (mine.weights_hash, mine.grid, mine.arithmetic)}

    def settle(self, keep: str | None = None) -> None:
        """Spill (or drop) least recently used sessions until resident bytes fit the cap; `keep`
        stays resident even when it alone is over the cap. A session whose write fails stays
        resident (over the cap) and is tried again at a settle `retry_s` later; a full disk ends
        the settle. Moves out begun earlier whose copies are whole finish first (their device rows
        let go); a session moving counts as gone for the cap."""
        self._collect()
        self._moves_done()
        if self.cap is None:
            return
        self.reader.settle()  # no session leaves memory half read
        now = self.clock()
        self._retry_staged(now)
        waiting = {n for n, t in self._retry_at.items() if now < t}
        plan = Settle([(n, session_bytes(s)) for n, s in self._resident.items()], self.cap, keep, waiting)
        for name, size in plan:
            error = self._evict(name)
            if error is None:
                plan.left(size)
            elif error in DISK_FULL:
                break
        self._moves_done()  # without CUDA the copies just begun are whole: they take their places now

    def save(self, skip: Container[str] = ()) -> list[tuple[str, str]]:
        """Write every session held in memory (resident, in the host tier, or a copy waiting for its
        write) but those named in `skip`, passing over one whose file already holds it as it is now
        (without a disk, nothing to do). Moves in flight are waited for and the write-behind queue
        written first. Returns (session, reason) for each one it could not write; every session
        stays where it was (a copy whose write is done leaves host memory)."""
        if not self.disk:
            return []
        self.flush()  # what is in flight or queued is written first, and counted
        self.reader.settle()
        failed = []
        held = [*self._resident.items(), *((c.name, c) for c in (self.host.copies() if self.host else [])),
                *self._staged.items()]
        for name, session in held:
            if name in skip or self._saved.get(name) == self._version(session):
                continue
            if self._write(session) is not None:
                failed.append((name, self._unwritten[name]))
            elif self._staged.get(name) is session:
                self._unstage(name)
                self._last_use.pop(name, None)
        return failed

    def flush(self) -> None:
        """Wait for every move out in flight and every write behind queued, and take in their
        outcomes (a copy whose file is written leaves host memory)."""
        self._moves_done(wait=True)
        if self.behind is not None:
            self.behind.flush()
        self._collect()

    def close(self) -> list[tuple[str, str]]:
        """A planned stop: `save` every session; the write-behind thread ends (a later move to the
        host tier starts another), and the pinned pool pins no more."""
        failed = self.save()
        if self.behind is not None:
            self.behind.close()
            self._collect()
            self.behind = None
        if self.pinned is not None:
            self.pinned.close()
        return failed

    def _version(self, session: Session, record: dict | None = None) -> tuple:
        """What a file of `session` would hold, in brief: equal versions, equal files (but the
        last use). `record`: the caller's record of it, where already asked for."""
        if record is None and self.annotate is not None:
            record = self.annotate(session.name)
        return version_of(session, record)

    def _write_behind(self, copy: Session) -> None:
        """Queue `copy` (a host copy: moved into the host tier, or bound for disk) to be written to
        disk on the write-behind thread."""
        if self.behind is None:
            self.behind = WriteBehind(self._write_job)
        record = self.annotate(copy.name) if self.annotate is not None else None
        self.behind.submit(Job(copy, record, self._last_use.get(copy.name, self.clock())))

    def _write_job(self, job: Job) -> tuple[int, tuple]:
        """On the write-behind thread: `job`'s file, written whole (or raising), then the folder
        swept; (the bytes written, the version the file holds: its ids hashed here, not where the
        store runs)."""
        path = self.path_of(job.copy.name)
        written = write_session(path, job.copy, self.identity, job.last_use, self.model, key=self.key,
                                direct=self.direct, checks=job.checks)
        version = version_of(job.copy, job.checks)
        self.sweep(protect=path)
        return written, version

    def _collect(self) -> None:
        """Count what the write-behind thread wrote (its files now hold those versions; a copy that
        waited for its write leaves host memory) and log what it could not (a host-tier copy is
        written again when it leaves the tier, a copy bound for disk at a settle `retry_s` later)."""
        if self.behind is None:
            return
        for w in self.behind.done():
            name, copy = w.name, w.job.copy
            staged = self._staged.get(name) is copy
            c = self.counters
            if w.error is None:
                written, self._saved[name] = w.result
                c.written_behind += 1
                c.bytes_written += written
                c.spill_seconds += w.seconds
                self.timed("spill", w.seconds)
                if self.host is not None and self.host.peek(name) is copy:
                    self._written.add(name)
                if staged:
                    self._unstage(name)
                    self._last_use.pop(name, None)
                    self._unwritten.pop(name, None)
                    self._retry_at.pop(name, None)
                continue
            reason = f"{type(w.error).__name__}: {getattr(w.error, 'strerror', None) or w.error}"
            c.write_failures += 1
            c.last_error = f"writing session {name!r} behind: {reason}"
            if getattr(w.error, "errno", None) in DISK_FULL:
                self._disk_full_until = self.clock() + self.retry_s
            if not staged:
                log.warning("session %r not written behind (%s); it is written when it leaves host memory",
                            name, reason)
                continue
            self._unwritten[name] = reason
            self._retry_at[name] = self.clock() + self.retry_s
            log.warning("session %r not written (%s); its copy stays in host memory and is written again",
                        name, reason)

    def resident_bytes(self) -> int:
        """Bytes of the sessions on the device: resident, and moving (their rows held until their copy is whole)."""
        return sum(session_bytes(s) for s in self._resident.values()) + \
            sum(m.device_bytes for m in [*self._moving.values(), *self._letting_go])

    def host_bytes(self) -> int:
        return self.host.used() if self.host is not None else 0

    def staged_bytes(self) -> int:
        """Host bytes of the copies bound for disk: those waiting for their writes and those in flight."""
        return sum(self._staged_bytes.values()) + sum(m.nbytes for m in self._moving.values() if m.to == "disk")

    # moves out -------------------------------------------------------------------------

    def _side_stream(self):
        """The CUDA stream copies out run on (None without CUDA: plain copies)."""
        device = self.reader.model.device
        if device.type != "cuda":
            return None
        if self._stream is None:
            import torch

            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _pinned_pool(self) -> PinnedPool | None:
        """On a GPU with a host tier or a disk: the pool copies out take pinned memory from, within
        the host tier's and staging's bounds, `pin_ahead` bytes kept pinned ahead of need."""
        if self.reader.model.device.type != "cuda" or (self.host is None and not self.disk):
            return None
        limit = (self.host.cap if self.host is not None else 0) + (self.stage_cap if self.disk else 0)
        return PinnedPool(limit, self.pin_ahead) if limit else None

    def _quiet(self):
        """A block in which the pinned pool page-locks no slab (a restore's copies run in it)."""
        return self.pinned.quiet() if self.pinned is not None else nullcontext()

    def _begin_move(self, session: Session, to: str, nbytes: int) -> None:
        """`session` leaves the device: its copy to host memory begun beside the reads, its room
        (in the host tier, or in staging for disk) held until the copy is whole."""
        name = session.name
        start = time.perf_counter()
        move = move_to_host(session, self._side_stream(), self.pinned)
        seconds = time.perf_counter() - start
        self._moving[name] = Leaving(move, to, session_bytes(session), nbytes)
        del self._resident[name]
        if to == "host":
            self.host.reserve(name, nbytes)
            self.counters.to_host_seconds += seconds
        else:
            self.counters.staging_seconds += seconds

    def _retarget(self, name: str) -> bool:
        """`name`'s move into the host tier, still in flight, leaves the tier as its copy would: bound
        for disk (its copy to wait in staging for its write), or, without a disk, dropped (the copy
        let go once whole); False where staging is full."""
        leaving = self._moving[name]
        if not self.disk:
            self._dropped(name, "dropped: the host tier was full and there is no disk folder (--no-disk)")
            del self._moving[name]
            self._letting_go.append(leaving)
            self.host.take(name)
            return True
        if leaving.nbytes > self.stage_cap:  # too large to wait in staging: its copy finished and written here
            leaving.move.wait()
            if self._write(leaving.move.copy) is not None:
                return False
            del self._moving[name]
            self._letting_go.append(leaving)
            self.sweep(protect=self.path_of(name))
        elif not self._staging_room(leaving.nbytes):
            return False
        else:
            leaving.to = "disk"
        self.host.take(name)
        self.counters.spills += 1
        self.counters.host_to_disk += 1
        self._spilled_why[name] = "spilled: the host tier was full"
        return True

    def _moves_done(self, wait: bool = False) -> None:
        """Moves out whose copies are whole (all of them, waited for, with `wait`) finish: the copy
        takes its place in the host tier (its file queued to be written behind) or waits for its
        write in staging, and the device rows are let go."""
        for leaving in list(self._letting_go):
            if wait:
                leaving.move.wait()
            if leaving.move.done():
                self._letting_go.remove(leaving)
        for move in self._kept if wait else ():
            move.wait()
        self._kept = [m for m in self._kept if not m.done()]
        for name, leaving in list(self._moving.items()):
            if wait:
                leaving.move.wait()
            elif not leaving.move.done():
                continue
            del self._moving[name]
            copy = leaving.move.copy
            if leaving.to == "host":
                self.host.put(copy, leaving.nbytes)
                self._written.discard(name)
                if self.disk:
                    self._write_behind(copy)
            else:
                self._stage(copy, leaving.nbytes)

    def _keep_moving(self, name: str) -> Session | None:
        """`name` asked for while its copy out is in flight: it stays on the device (the copy let
        go, later work waiting for it), counted as back from the tier it was leaving for."""
        leaving = self._moving.pop(name, None)
        if leaving is None:
            return None
        leaving.move.keep()
        self._kept.append(leaving.move)  # its copy held until done: its host memory is still written
        c = self.counters
        if leaving.to == "host":
            self.host.take(name)  # its reservation let go
            c.from_host += 1
            c.bytes_from_host += leaving.nbytes
        else:
            c.restores += 1
            c.back_before_written += 1
        c.moves_kept += 1
        self._spilled_why.pop(name, None)
        return leaving.move.session if leaving.to == "host" else as_from_disk(leaving.move.session)

    def _stage(self, copy: Session, nbytes: int, submit: bool = True) -> None:
        """`copy` waits in host memory for its file (queued to be written behind, unless `submit` is
        False: its job is queued already)."""
        self._staged[copy.name] = copy
        self._staged_bytes[copy.name] = nbytes
        if submit:
            self._write_behind(copy)

    def _unstage(self, name: str) -> None:
        self._staged.pop(name, None)
        self._staged_bytes.pop(name, None)

    def _staging_room(self, nbytes: int) -> bool:
        """Whether a copy of `nbytes` bound for disk may wait in host memory now (else counted)."""
        if self.staged_bytes() + nbytes <= self.stage_cap:
            return True
        self.counters.stage_full += 1
        return False

    def _from_staged(self, name: str) -> Session | None:
        """`name` moved back from its copy waiting for its write (None where there is none)."""
        copy = self._staged.get(name)
        if copy is None:
            return None
        with self._quiet():
            session = from_host(copy, self.reader.model.new_state())
        self._back_from_staging(name)
        return as_from_disk(session)

    def _back_from_staging(self, name: str) -> None:
        """`name`'s copy bound for disk is back on the device: its job not begun dropped (one being
        written lands, and its file holds that copy), counted as a restore from the disk tier."""
        self._unstage(name)
        if self.behind is not None:
            self.behind.drop(name)
        self._unwritten.pop(name, None)
        self._retry_at.pop(name, None)
        self.counters.restores += 1
        self.counters.back_before_written += 1
        self._spilled_why.pop(name, None)

    def _retry_staged(self, now: float) -> None:
        """Copies bound for disk whose write failed are queued again `retry_s` after the failure."""
        for name, copy in list(self._staged.items()):
            if name in self._unwritten and now >= self._retry_at.get(name, now) and \
                    (self.behind is None or self.behind.current(name) is None):
                self._retry_at[name] = now + self.retry_s
                self._write_behind(copy)

    # disk -------------------------------------------------------------------------------

    def path_of(self, name: str) -> Path:
        assert self.disk is not None
        return self.disk / session_file_name(name)

    def _evict(self, name: str) -> int | None:
        """Move `name` to the host tier, or to disk (copied to host memory and written behind; one
        past the staging bound written here), or drop it; None when it left (or began to leave)
        the device, else an errno (0 if none): a write that failed, a disk found full, or the
        staging bound held by copies waiting for their writes."""
        session = self._resident[name]
        if self._to_host(session):
            return None
        why = "spilled: past the device cap" + (" and the host tier's" if self.host is not None else "")
        if not self.disk:
            self._dropped(name, "dropped: no tier had room (no disk folder: --no-disk); its next turn reads it again")
        elif self.clock() < self._disk_full_until:
            return errno.ENOSPC
        elif (nbytes := host_bytes(session)) <= self.stage_cap:
            if not self._staging_room(nbytes):
                return 0  # it stays, past the cap, until the writes queued land
            self._begin_move(session, "disk", nbytes)
            self.counters.spills += 1
            self._spilled_why[name] = why
            return None
        else:
            error = self._write(session)
            if error is not None:
                return error
            self.counters.spills += 1
            self._spilled_why[name] = why
            self.sweep(protect=self.path_of(name))
        del self._resident[name]
        self._last_use.pop(name, None)
        return None

    # the host tier ---------------------------------------------------------------------

    def _to_host(self, session: Session) -> bool:
        """Begin moving `session` into the host tier (`_begin_move`), its oldest copies first
        leaving for disk (or dropped, without a disk) to make room; False (and nothing moved)
        where there is no host tier, the session alone is past its cap, or room could not be made
        (a write failed, or staging is full)."""
        host = self.host
        if host is None:
            return False
        need = host_bytes(session)
        if not host.fits(need):
            return False
        while host.room() < need:
            oldest = host.oldest()
            if oldest is None or not self._host_out(oldest):
                return False
        self._begin_move(session, "host", need)
        c = self.counters
        c.to_host += 1
        c.bytes_to_host += need
        self._spilled_why[session.name] = "in host memory: past the device cap"
        return True

    def _host_out(self, name: str) -> bool:
        """The tier's copy of `name` leaves it for disk (spilled: at once where its file already
        holds it, else waiting in staging for its write behind; one past the staging bound written
        here) or, without a disk, is dropped; False where it cannot leave (its write failed, or
        staging is full): it stays in the tier. A move into the tier still in flight leaves as well
        (`_retarget`)."""
        if self.host.reserved(name):
            return self._retarget(name)
        copy = self.host.peek(name)
        if not self.disk:
            self._dropped(name, "dropped: the host tier was full and there is no disk folder (--no-disk)")
            self.host.take(name)
            self._written.discard(name)
            return True
        nbytes = self.host.nbytes(name)
        if name not in self._written:
            queued = self.behind is not None and (job := self.behind.current(name)) is not None and job.copy is copy
            if nbytes > self.stage_cap:
                if self.behind is not None:
                    self.behind.cancel(name)
                    self._collect()
                if self._saved.get(name) != self._version(copy) and self._write(copy) is not None:
                    return False
                self.sweep(protect=self.path_of(name))
            elif not self._staging_room(nbytes):
                return False
            else:
                self._stage(copy, nbytes, submit=not queued)
        self.host.take(name)
        self._written.discard(name)
        self.counters.spills += 1
        self.counters.host_to_disk += 1
        self._spilled_why[name] = "spilled: the host tier was full"
        return True

    def _from_host(self, name: str) -> Session | None:
        """`name` moved back from the host tier onto the device (None where the tier has no copy)."""
        if self.host is None or name not in self.host:
            return None
        start = time.perf_counter()
        with self._quiet():
            session = from_host(self.host.peek(name), self.reader.model.new_state())
        # only once it is back: a move that fails (out of device memory) keeps the copy
        self._host_moved_back(name, time.perf_counter() - start)
        return session

    def _host_moved_back(self, name: str, seconds: float) -> None:
        """`name`'s copy is back on the device: out of the tier, counted."""
        c = self.counters
        c.bytes_from_host += self.host.nbytes(name)
        self.host.take(name)
        self._written.discard(name)
        c.from_host_seconds += seconds
        c.from_host += 1
        self._spilled_why.pop(name, None)

    def _dropped(self, name: str, why: str) -> None:
        """`name` left memory unwritten (no tier held it; whoever feeds it next reads it again from
        the start): counted, its reason kept."""
        self.counters.drops += 1
        self.recent_drops.pop(name, None)
        self.recent_drops[name] = why
        while len(self.recent_drops) > RECENT_DROPS:
            self.recent_drops.popitem(last=False)
        self._spilled_why.pop(name, None)
        self._last_use.pop(name, None)
        log.info("session %r %s", name, why)

    def _write(self, session: Session) -> int | None:
        """Write `session`'s file; None when written and fsynced, else the errno (0 if none),
        counted and kept as the store's last error. A write-behind job of the same session not
        begun is dropped, and one being written is waited for: this write lands last."""
        if self.behind is not None:
            self.behind.cancel(session.name)
            self._collect()
        start = time.perf_counter()
        try:
            written = write_session(
                self.path_of(session.name), session, self.identity,
                self._last_use.get(session.name, self.clock()), self.model, key=self.key, direct=self.direct,
                checks=self.annotate(session.name) if self.annotate is not None else None,
            )
        except Exception as e:
            reason = f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}"
            self.counters.write_failures += 1
            self.counters.last_error = f"writing session {session.name!r}: {reason}"
            self._unwritten[session.name] = reason
            self._retry_at[session.name] = self.clock() + self.retry_s
            log.warning("session %r not written (%s); it stays in memory", session.name, reason)
            return getattr(e, "errno", None) or 0
        self._unwritten.pop(session.name, None)
        self._retry_at.pop(session.name, None)
        self._saved[session.name] = self._version(session)
        self.counters.bytes_written += written
        seconds = time.perf_counter() - start
        self.counters.spill_seconds += seconds
        self.timed("spill", seconds)
        return None

    def restore_ahead(self, name: str, stream=None) -> Restored | None:
        """`name` brought back onto the device without changing the store, so that the caller can
        do it before its lock or on another thread and hand it to `get`: copied from its host copy
        (in the tier, or waiting for its write), or its file read (and checked); None where there is nothing to bring back (resident, none,
        refused, or bad: `get` reports a bad one). `stream`: a CUDA stream the copies run on, beside
        the reads on the current one (the tensors are then marked as used by the current stream)."""
        if name in self._resident or name in self._moving:  # `get` keeps a moving one where it is
            return None
        copy = self.host.peek(name) if self.host is not None else None
        copy = copy if copy is not None else self._staged.get(name)
        if copy is not None:
            start = time.perf_counter()
            with self._quiet(), beside(stream) as done:
                session = from_host(copy, self.reader.model.new_state())
                done(session)
            return Restored(session, ("host", id(copy), 0, 0), time.perf_counter() - start, copy)
        if (found := self._file_of(name)) is None:
            return None
        path, st = found
        key = (path.name, st.st_ino, st.st_mtime_ns, st.st_size)
        if key in self._refused:
            return None
        start = time.perf_counter()
        with self._quiet(), beside(stream) as done:
            try:
                session = read_session(path, self.identity, self.reader.model.new_state(),
                                       self.reader.max_checkpoints, key=self.key, direct=self.direct)
            except SessionFileError:
                return None
            if session.name != name:
                return None
            self.reader.synchronize()
            done(session)
        return Restored(session, key, time.perf_counter() - start)

    def _adopt(self, name: str, ahead: Restored) -> Session | None:
        """`ahead`'s session, if its host copy or file is still the one it came from, or its copy
        left host memory because its file was written (`_written_since`); else None: bring it back
        again."""
        if ahead.copy is not None:
            if ahead.session.name != name:
                return None
            if self.host is not None and self.host.peek(name) is ahead.copy:
                self._host_moved_back(name, ahead.seconds)
                return ahead.session
            if self._staged.get(name) is ahead.copy:
                self._back_from_staging(name)
                return as_from_disk(ahead.session)
            if self._written_since(name, ahead.copy):
                self.counters.restores += 1
                self._spilled_why.pop(name, None)
                return as_from_disk(ahead.session)
            return None
        if not self.disk or (self.host is not None and name in self.host) or name in self._staged:
            return None  # a newer copy is in host memory
        path = self.path_of(name)
        try:
            st = path.lstat()
        except OSError:
            return None
        if (path.name, st.st_ino, st.st_mtime_ns, st.st_size) != ahead.key or ahead.session.name != name:
            return None
        self._restored(name, st.st_size, ahead.seconds)
        return ahead.session

    def _written_since(self, name: str, copy: Session) -> bool:
        """Whether `copy`, a host copy of `name` no longer in host memory, left it because its file
        was written: no newer copy is in the host tier or staging, and the file holds its version."""
        if (self.host is not None and name in self.host) or name in self._staged or not self.disk:
            return False
        self._collect()
        return self._saved.get(name) == self._version(copy) and self.path_of(name).is_file()

    def _restore(self, name: str) -> Session | None:
        if not self.disk:
            return None
        path = self.path_of(name)
        try:
            st = path.lstat()
        except OSError:  # no file (or no folder): a new session
            return None
        key = (path.name, st.st_ino, st.st_mtime_ns, st.st_size)
        if not stat.S_ISREG(st.st_mode) or key in self._refused:
            return None  # a link or folder at its name is not the store's; a refused file is not read twice
        start = time.perf_counter()
        try:
            with self._quiet():
                session = read_session(path, self.identity, self.reader.model.new_state(), self.reader.max_checkpoints,
                                       key=self.key, direct=self.direct)
            if session.name != name:
                raise SessionFileError(f"holds session {session.name!r}, not {name!r}")
        except SessionFileError as e:
            self._reject(path, key, str(e))
            return None
        self.reader.synchronize()
        self._restored(name, st.st_size, time.perf_counter() - start)
        return session

    def _restored(self, name: str, size: int, seconds: float) -> None:
        self.counters.restore_seconds += seconds
        self.timed("restore", seconds)
        self.counters.bytes_restored += size
        self.counters.restores += 1
        self.restore_rate.observe(size, seconds)
        self._spilled_why.pop(name, None)

    def measure_restore(self, gib: float = 0.25) -> float | None:
        """Measure the restore rate here (GiB/s) and take it as the store's estimate: a scratch
        session of about `gib` GiB of state is written to the folder, dropped from the page cache,
        read back onto the model's device, and removed. None without a disk or when the folder
        refuses (logged)."""
        if not self.disk:
            return None
        scratch = self.reader.new_session(MEASURE_NAME)
        state = scratch.state
        per_row = max(1, _state_bytes(state, 1) - _state_bytes(state, 0))
        grid = self.reader.grid
        rows = max(grid, int(gib * GIB - _state_bytes(state, 0)) // per_row // grid * grid)
        for layer in state.attention:
            layer.reserve(rows)
        state.length = rows
        scratch.ids = [0] * rows
        path = self.path_of(MEASURE_NAME)
        try:
            written = write_session(path, scratch, self.identity, 0.0, self.model, key=self.key, direct=self.direct)
            del scratch, state
            _drop_cached(path)
            start = time.perf_counter()
            read_session(path, self.identity, self.reader.model.new_state(), self.reader.max_checkpoints,
                         key=self.key, direct=self.direct)
            self.reader.synchronize()
            seconds = time.perf_counter() - start
        except (OSError, SessionFileError) as e:
            log.warning("restore rate not measured in %s: %s", self.disk, e)
            return None
        finally:
            self._remove(path)
        rate = written / GIB / seconds
        self.restore_rate.warm(rate)
        return rate

    def _reject(self, path: Path, key: tuple[str, int, int, int], reason: str) -> None:
        """Report a bad file once and move it aside; the session will be read again from its ids."""
        log.warning("session file %s refused: %s; the session is read again", path.name, reason)
        self.counters.rejected.append((path.name, reason))
        try:
            os.replace(path, path.with_name(path.name + REJECTED))
        except OSError as e:
            self._refused.add(key)
            self.counters.last_error = f"moving {path.name} aside: {e.strerror or e}"

    def _own(self) -> list[tuple[Path, os.stat_result]]:
        """The store's own regular files in its folder (sessions, rejected ones, temporary ones),
        by name only; links, folders and other names are never listed."""
        if not self.disk:
            return []
        return own_files(self.disk)

    def _headers(self) -> list[tuple[Path, Header, os.stat_result]]:
        """Every session file with a valid header whose session it is named for. A file's header is
        read again only where the file changed (its inode, size or modification time), so a status
        poll under the service's lock reads no unchanged file (a restore still verifies every byte)."""
        out, listed = [], set()
        for path, st in self._own():
            if not path.name.endswith(SUFFIX):
                continue
            listed.add(path.name)
            header = self._header(path, st)
            if header is not None and session_file_name(header.name) == path.name:
                out.append((path, header, st))
        for gone in self._header_cache.keys() - listed:  # files removed since: forgotten
            del self._header_cache[gone]
        return out

    def _header(self, path: Path, st: os.stat_result) -> Header | None:
        """`path`'s header (None: not a valid one), read only where the file changed (its inode,
        size or modification time in `st`) since it was last read."""
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._header_cache.get(path.name)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        try:
            header = read_fields(path, self.key)
        except SessionFileError:
            header = None
        self._header_cache[path.name] = (stamp, header)
        return header

    def sweep(self, protect: Path | None = None) -> None:
        """Remove the store's own files (rejected ones too; each must carry the session marker)
        older than max_age_s, then the oldest past the disk cap, and temporary files of killed
        writers. Never follows a link, never raises: what cannot be read or removed is skipped.
        One sweep at a time (the write-behind thread sweeps after each of its writes)."""
        if not self.disk:
            return
        with self._sweep_lock:
            self._sweep(protect)

    def _sweep(self, protect: Path | None) -> None:
        now = self.clock()
        files = []
        for path, st in self._own():
            if OWN_TMP.fullmatch(path.name):
                if _stale_tmp(path, st, time.time()):
                    self._remove(path)
            elif path != protect and _marked(path):
                files.append((st.st_mtime, path, st.st_size))
        files.sort()
        keep = []
        for mtime, path, size in files:
            if now - mtime > self.max_age_s and self._remove(path):
                self.counters.removed += 1
            else:
                keep.append((path, size))
        total = sum(size for _, size in keep)
        if protect is not None:
            try:
                total += protect.lstat().st_size
            except OSError:
                pass
        for path, size in keep:
            if self.disk_cap is None or total <= self.disk_cap:
                break
            if self._remove(path):
                total -= size
                self.counters.removed += 1

    def _remove(self, path: Path) -> bool:
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            self.counters.last_error = f"removing {path.name}: {e.strerror or e}"
            return False

    # status -----------------------------------------------------------------------------

    def totals(self) -> dict[str, int | str | None]:
        """Resident and disk bytes against their caps, session counts, failed writes and the last error."""
        files = [(p, st) for p, st in self._own() if p.name.endswith(SUFFIX)]
        return {
            "resident_bytes": self.resident_bytes(), "cap_bytes": self.cap,
            "disk_bytes": sum(st.st_size for _, st in files), "disk_cap_bytes": self.disk_cap if self.disk else None,
            "resident_sessions": len(self._resident), "files": len(files),
            "write_failures": self.counters.write_failures, "unwritten_sessions": len(self._unwritten),
            "files_refused": len(self.counters.rejected), "last_error": self.counters.last_error,
            "keyed": self.key is not None, "drops": self.counters.drops,
            "restore_estimate_gib_per_s": self.restore_rate.gib_per_s,
            "recent_drops": dict(self.recent_drops),
            "host_bytes": self.host_bytes(), "host_cap_bytes": self.host.cap if self.host is not None else None,
            "host_sessions": len(self.host) if self.host is not None else 0,
            "written_behind": self.counters.written_behind,
            "write_behind_queue": self.behind.pending() if self.behind is not None else 0,
            "moving_sessions": len(self._moving), "moving_bytes": sum(m.device_bytes for m in self._moving.values()),
            "staged_sessions": len(self._staged), "staged_bytes": self.staged_bytes(), "stage_cap_bytes": self.stage_cap,
            "pinned": asdict(self.pinned.stats()) if self.pinned is not None else None,
        }

    def status(self) -> list[SessionRow]:
        """Every session: resident and moving ones, the host tier's and the copies waiting for their
        writes from memory, spilled ones from their (valid) file headers. The writes behind that
        ended are taken in first (a copy whose file is written is on disk)."""
        self._collect()
        rows = [
            SessionRow(s.name, s.committed, s.pending, session_bytes(s), len(s.checkpoints), True,
                       self._last_use.get(s.name, 0.0), self._unwritten.get(s.name))
            for s in self._resident.values()
        ]
        for name, m in self._moving.items():
            s = m.move.session
            rows.append(SessionRow(name, s.committed, s.pending, m.device_bytes, len(s.checkpoints), True,
                                   self._last_use.get(name, 0.0), None, self._spilled_why.get(name),
                                   moving="to host memory" if m.to == "host" else "to disk"))
        for name, c in self._staged.items():
            rows.append(SessionRow(name, c.committed, c.pending, self._staged_bytes[name], len(c.checkpoints), False,
                                   self._last_use.get(name, 0.0), self._unwritten.get(name),
                                   self._spilled_why.get(name), tier="host", moving="to disk"))
        for c in self.host.copies() if self.host is not None else []:
            rows.append(SessionRow(c.name, c.committed, c.pending, self.host.nbytes(c.name), len(c.checkpoints), False,
                                   self._last_use.get(c.name, 0.0), self._unwritten.get(c.name),
                                   self._spilled_why.get(c.name), tier="host"))
        seen = {r.name for r in rows}
        for _, h, st in self._headers():
            if h.name not in seen:
                seen.add(h.name)
                rows.append(SessionRow(h.name, h.committed, h.tokens - h.committed, st.st_size,
                                       len(h.checkpoints), False, h.last_use, None, self._spilled_why.get(h.name),
                                       tier="disk"))
        return sorted(rows, key=lambda r: r.name)


@dataclass
class Leaving:
    """A session leaving the device: its `move` (the copy in flight), the tier it is bound for
    ("host" or "disk"), its device bytes (held until the copy is whole) and its copy's bytes."""

    move: Move
    to: str
    device_bytes: int
    nbytes: int


def as_from_disk(session: Session) -> Session:
    """`session`, back from the disk tier before its file was read (from its copy, or kept where it
    was), as its file would give it: no output held out of reading (a file carries no `hold`), so it
    reads on as a restored session does, live and in the replay alike."""
    session.hold = None
    return session


def version_of(session: Session, record: dict | None) -> tuple:
    """What a file of `session` carrying the caller's `record` would hold, in brief: equal versions,
    equal files (but the last use). Hashes every id (about 0.57 ms per 100k)."""
    return (hash(tuple(session.ids)), session.committed, session.rollbacks, session.ids_reread,
            tuple(c.position for c in session.checkpoints), tuple(session.marks), repr(record))


@dataclass(frozen=True)
class Restored:
    """A session brought back ahead of `SessionStore.get` (`restore_ahead`): the session, where it
    came from (its file's (name, inode, mtime, size) when read; for a host copy, the copy), and the
    seconds it took."""

    session: Session
    key: tuple
    seconds: float
    copy: Session | None = None


@contextmanager
def beside(stream):
    """Run the block's copies on `stream` (None: the current stream, as they are); the block calls
    the yielded function with the session it made, whose tensors are then synchronized and marked
    as used by the current stream, so the caching allocator never hands their memory out under a
    read still queued there."""
    if stream is None:
        yield lambda session: None
        return
    import torch

    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    made = []
    with torch.cuda.stream(stream):
        yield made.append
    stream.synchronize()
    for session in made:
        tensors = [*session.state.tensors().values(), *session.state.snapshot_tensors(session.checkpoints).values()]
        for t in tensors:
            t.record_stream(current)


def _make_folder(folder: Path) -> None:
    """The store's folder, created mode 0700 (its parents as the umask makes them); a folder that
    is already there keeps its mode, and one others can enter is logged."""
    try:
        folder.mkdir(parents=True, exist_ok=False, mode=FOLDER_MODE)
        os.chmod(folder, FOLDER_MODE)  # whatever the umask
    except FileExistsError:
        pass
    except OSError as e:
        raise ShadowInputError(f"cannot use {folder} as the store's folder ({e.strerror or e})") from None
    try:
        st = os.stat(folder)
    except OSError as e:
        raise ShadowInputError(f"cannot use {folder} as the store's folder ({e.strerror or e})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ShadowInputError(f"cannot use {folder} as the store's folder (not a folder)")
    if st.st_mode & 0o077:
        log.warning("the store's folder %s is open to others (mode %o): session files hold every session's "
                    "ids and state; chmod 700 it", folder, stat.S_IMODE(st.st_mode))




def _state_bytes(state, rows: int) -> int:
    """Bytes of a state's tensors at `rows` valid rows (`ModelState.expected`)."""
    return sum(dtype.itemsize * math.prod(shape) for dtype, shape in state.expected(rows).values())


def _drop_cached(path: Path) -> None:
    """Ask the kernel to drop a written (and fsynced) file's pages from the page cache."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass
    finally:
        os.close(fd)


def own_files(folder: Path) -> list[tuple[Path, os.stat_result]]:
    """Regular files in `folder` named as a store names its files (sessions, `.rejected`,
    temporary), sorted by name; never follows a link, skips what cannot be read."""
    out = []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if not (OWN_FILE.fullmatch(entry.name) or OWN_TMP.fullmatch(entry.name)):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    out.append((Path(entry.path), st))
    except OSError:
        return []
    return sorted(out, key=lambda x: x[0].name)


def _marked(path: Path) -> bool:
    """Whether a file carries the session marker in its header (read without following a link);
    a file that cannot be read is not the store's to remove."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        head = os.pread(fd, 8, 0)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        return MARKER in os.pread(fd, min(max(n, 0), MAX_HEADER, 1 << 20), 8)
    except OSError:
        return False
    finally:
        os.close(fd)


def _stale_tmp(path: Path, st: os.stat_result, now: float) -> bool:
    """A temporary file left by a writer that is gone (its pid no longer runs), or old."""
    if now - st.st_mtime > STALE_TMP_S:
        return True
    match = OWN_TMP.fullmatch(path.name)
    pid = int(match.group(1)) if match else 0
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


@dataclass
class FileRow:
    """One file of a store folder, as `shadow store` lists it."""

    file: str
    session: str | None
    tokens: int | None
    bytes: int
    age_s: float
    valid: bool
    reason: str


def check_folder(folder: Path, reader: Reader | None = None, weights_hash: str | None = None,
                 now: float | None = None, key: str | bytes | None = None) -> list[FileRow]:
    """Check every session file in a store folder (its own names only: links, folders and other
    files are not listed). With a reader and weights hash each file is read in full (identity,
    shapes, every byte); without, its header is verified and validated. With a key, only files
    whose keyed digest was made with it are valid. Raises ShadowInputError only when the folder
    itself cannot be listed (or the key is empty)."""
    now = time.time() if now is None else now
    try:
        key = key_bytes(key)
    except ValueError as e:
        raise ShadowInputError(str(e)) from None
    try:
        os.listdir(folder)
    except OSError as e:
        raise ShadowInputError(f"cannot list {folder} ({e.strerror or e})") from None
    rows = []
    for path, st in own_files(Path(folder)):
        if OWN_TMP.fullmatch(path.name):
            continue
        header = None
        try:
            if path.name.endswith(REJECTED):
                raise SessionFileError("rejected earlier")
            header = read_fields(path, key)
            if session_file_name(header.name) != path.name:
                raise SessionFileError(f"file name does not match its session {header.name!r}")
            if reader is not None and weights_hash is not None:
                identity = Identity(weights_hash, reader.grid, arithmetic(reader.model))
                read_session(path, identity, reader.model.new_state(), reader.max_checkpoints, key=key)
            valid, reason = True, "ok" if reader is not None else "header ok"
        except SessionFileError as e:
            valid, reason = False, str(e)
        rows.append(FileRow(path.name, header and header.name, header and header.tokens, st.st_size,
                            now - st.st_mtime, valid, reason))
    return rows
