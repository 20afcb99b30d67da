"""Many sessions in bounded memory: a resident cap with least-recently-used spill to disk.

Past the cap (GiB of allocated state, checkpoints included) the least recently used sessions go
to disk, one file each (`sessionfile`), and come back bit for bit when asked for. A session leaves
memory only once its file is written and fsynced: a write that fails (disk full, I/O error) keeps
it resident, over the cap if it must, counts it, and a later settle tries again. Without a disk
folder sessions past the cap are dropped and read again from the start by whoever feeds them next.

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
import os
import re
import stat
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shadow.errors import ShadowInputError
from shadow.model.runtime import arithmetic
from shadow.core.reader import Reader, Session
from shadow.core.sessionfile import (
    MARKER, MAX_HEADER, SUFFIX, Header, Identity, SessionFileError, read_fields, read_session,
    session_file_name, write_session,
)

log = logging.getLogger("shadow.core.store")
GIB = 1 << 30
REJECTED = ".rejected"
OWN_FILE = re.compile(r"[0-9a-f]{32}" + re.escape(SUFFIX) + f"(?:{re.escape(REJECTED)})?")
OWN_TMP = re.compile(r"\.[0-9a-f]{32}" + re.escape(SUFFIX) + r"\.(\d+)(?:\.[0-9a-f]+)?\.tmp")
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
RETRY_S = 10.0  # a failed spill is not tried again sooner (by the store's clock): a settle follows every chunk
STALE_TMP_S = 3600.0  # a temporary file this old is a killed writer's, whatever its pid


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


@dataclass
class StoreCounters:
    spills: int = 0
    restores: int = 0
    drops: int = 0
    bytes_written: int = 0
    bytes_restored: int = 0
    restore_seconds: float = 0.0
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)
    removed: int = 0  # files removed by retention
    write_failures: int = 0  # writes that failed; each session stayed resident
    last_error: str | None = None  # the last failed write or removal, with its reason

    @property
    def restore_gib_per_s(self) -> float | None:
        return self.bytes_restored / GIB / self.restore_seconds if self.restore_seconds else None


def session_bytes(session: Session) -> int:
    return session.state.allocated_bytes() + sum(c.nbytes() for c in session.checkpoints)


class SessionStore:
    """Sessions by name. `get` returns a resident session (restored or new); after working on it,
    `settle(keep=name)` enforces the cap. `close()` writes every resident session (a planned stop)
    and returns those it could not write."""

    def __init__(
        self, reader: Reader, weights_hash: str, *, cap_gib: float | None = 4.0, disk: Path | None = None,
        disk_cap_gib: float | None = 64.0, max_age_s: float = 48 * 3600, model: str = "",
        clock: Callable[[], float] = time.time, retry_s: float = RETRY_S,
    ):
        """`disk_cap_gib` bounds the store's own files in `disk` (None: no bound); a session whose
        spill failed is tried again at the first settle `retry_s` or more later."""
        self.reader = reader
        self.identity = Identity(weights_hash, reader.grid, arithmetic(reader.model))
        self.cap = None if cap_gib is None else int(cap_gib * GIB)  # None: no cap
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
        if self.disk:
            try:
                self.disk.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ShadowInputError(f"cannot use {self.disk} as the store's folder ({e.strerror or e})") from None
            self.sweep()

    # sessions ---------------------------------------------------------------------------

    def get(self, name: str) -> Session:
        """The session `name`, resident and most recently used: as it was, restored from disk, or new.
        A bad file is refused (reported once) and the session starts over; a bad file never raises."""
        session = self._resident.get(name)
        if session is None:
            session = self._restore(name) or self.reader.new_session(name)
            self._resident[name] = session
        self._resident.move_to_end(name)
        self._last_use[name] = self.clock()
        return session

    def peek(self, name: str) -> Session | None:
        """The session if it is resident, without touching its last use or restoring it."""
        return self._resident.get(name)

    def names(self) -> list[str]:
        """Every session: resident, or on disk in a valid header."""
        on_disk = {h.name for _, h, _ in self._headers()}
        return sorted(set(self._resident) | on_disk)

    def settle(self, keep: str | None = None) -> None:
        """Spill (or drop) least recently used sessions until resident bytes fit the cap; `keep`
        stays resident even when it alone is over the cap. A session whose write fails stays
        resident (over the cap) and is tried again at a settle `retry_s` later; a full disk ends
        the settle."""
        if self.cap is None:
            return
        total = self.resident_bytes()
        now = self.clock()
        for name in list(self._resident):
            if total <= self.cap:
                break
            if name == keep or now < self._retry_at.get(name, now):
                continue
            size = session_bytes(self._resident[name])
            error = self._evict(name)
            if error is None:
                total -= size
            elif error in DISK_FULL:
                break

    def close(self) -> list[tuple[str, str]]:
        """A planned stop: write every resident session it can (without a disk, nothing to do).
        Returns (session, reason) for each one it could not write; those stay resident."""
        if not self.disk:
            return []
        failed = []
        for name, session in list(self._resident.items()):
            if self._write(session) is not None:
                failed.append((name, self._unwritten[name]))
        return failed

    def resident_bytes(self) -> int:
        return sum(session_bytes(s) for s in self._resident.values())

    # disk -------------------------------------------------------------------------------

    def path_of(self, name: str) -> Path:
        assert self.disk is not None
        return self.disk / session_file_name(name)

    def _evict(self, name: str) -> int | None:
        """Spill (or drop) `name`; None when it left memory, else the failed write's errno (0 if none)."""
        session = self._resident[name]
        if self.disk:
            error = self._write(session)
            if error is not None:
                return error
            self.counters.spills += 1
        else:
            self.counters.drops += 1
        del self._resident[name]
        self._last_use.pop(name, None)
        if self.disk:
            self.sweep(protect=self.path_of(name))
        return None

    def _write(self, session: Session) -> int | None:
        """Write `session`'s file; None when written and fsynced, else the errno (0 if none),
        counted and kept as the store's last error."""
        try:
            written = write_session(
                self.path_of(session.name), session, self.identity,
                self._last_use.get(session.name, self.clock()), self.model,
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
        self.counters.bytes_written += written
        return None

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
            session = read_session(path, self.identity, self.reader.model.new_state(), self.reader.max_checkpoints)
            if session.name != name:
                raise SessionFileError(f"holds session {session.name!r}, not {name!r}")
        except SessionFileError as e:
            self._reject(path, key, str(e))
            return None
        if self.reader.model.device.type == "cuda":
            import torch

            torch.cuda.synchronize()
        self.counters.restore_seconds += time.perf_counter() - start
        self.counters.bytes_restored += st.st_size
        self.counters.restores += 1
        return session

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
        """Every session file with a valid header whose session it is named for."""
        out = []
        for path, st in self._own():
            if not path.name.endswith(SUFFIX):
                continue
            try:
                header = read_fields(path)
            except SessionFileError:
                continue
            if session_file_name(header.name) == path.name:
                out.append((path, header, st))
        return out

    def sweep(self, protect: Path | None = None) -> None:
        """Remove the store's own files (rejected ones too; each must carry the session marker)
        older than max_age_s, then the oldest past the disk cap, and temporary files of killed
        writers. Never follows a link, never raises: what cannot be read or removed is skipped."""
        if not self.disk:
            return
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
        }

    def status(self) -> list[SessionRow]:
        """Every session: resident ones from memory, spilled ones from their (valid) file headers."""
        rows = [
            SessionRow(s.name, s.committed, s.pending, session_bytes(s), len(s.checkpoints), True,
                       self._last_use.get(s.name, 0.0), self._unwritten.get(s.name))
            for s in self._resident.values()
        ]
        seen = set(self._resident)
        for _, h, st in self._headers():
            if h.name not in seen:
                seen.add(h.name)
                rows.append(SessionRow(h.name, h.committed, h.tokens - h.committed, st.st_size,
                                       len(h.checkpoints), False, h.last_use))
        return sorted(rows, key=lambda r: r.name)


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
                 now: float | None = None) -> list[FileRow]:
    """Check every session file in a store folder (its own names only: links, folders and other
    files are not listed). With a reader and weights hash each file is read in full (identity,
    shapes, every byte); without, its header is verified and validated. Raises ShadowInputError
    only when the folder itself cannot be listed."""
    now = time.time() if now is None else now
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
            header = read_fields(path)
            if session_file_name(header.name) != path.name:
                raise SessionFileError(f"file name does not match its session {header.name!r}")
            if reader is not None and weights_hash is not None:
                identity = Identity(weights_hash, reader.grid, arithmetic(reader.model))
                read_session(path, identity, reader.model.new_state(), reader.max_checkpoints)
            valid, reason = True, "ok" if reader is not None else "header ok"
        except SessionFileError as e:
            valid, reason = False, str(e)
        rows.append(FileRow(path.name, header and header.name, header and header.tokens, st.st_size,
                            now - st.st_mtime, valid, reason))
    return rows
