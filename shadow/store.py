"""Many sessions in bounded memory: a resident cap with least-recently-used spill to disk.

Past the cap (GiB of allocated state, checkpoints included) the least recently used sessions go
to disk, one file each (`sessionfile`), and come back bit for bit when asked for. Without a disk
folder they are dropped and read again from the start by whoever feeds them next. Files older
than `max_age_s` or past the disk cap (oldest first) are removed. A bad file is reported once
(logged, counted, renamed `*.rejected`) and the session starts over; nothing is served from it.
The clock is injected, so the same code runs live and in tests.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shadow.reader import Reader, Session
from shadow.sessionfile import (
    SUFFIX, Identity, SessionFileError, arithmetic_of, check_identity, read_header, read_session, write_session,
)

log = logging.getLogger("shadow.store")
GIB = 1 << 30
REJECTED = ".rejected"


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

    @property
    def restore_gib_per_s(self) -> float | None:
        return self.bytes_restored / GIB / self.restore_seconds if self.restore_seconds else None


def session_bytes(session: Session) -> int:
    return session.state.allocated_bytes() + sum(c.nbytes() for c in session.checkpoints)


class SessionStore:
    """Sessions by name. `get` returns a resident session (restored or new); after working on it,
    `settle(keep=name)` enforces the cap. `close()` writes every resident session (a planned stop)."""

    def __init__(
        self, reader: Reader, weights_hash: str, *, cap_gib: float | None = 4.0, disk: Path | None = None,
        disk_cap_gib: float = 64.0, max_age_s: float = 48 * 3600, model: str = "",
        clock: Callable[[], float] = time.time,
    ):
        self.reader = reader
        self.identity = Identity(weights_hash, reader.grid, arithmetic_of(reader.model))
        self.cap = None if cap_gib is None else int(cap_gib * GIB)  # None: no cap
        self.disk = Path(disk) if disk else None
        self.disk_cap = int(disk_cap_gib * GIB)
        self.max_age_s = max_age_s
        self.model = model
        self.clock = clock
        self.counters = StoreCounters()
        self._resident: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._last_use: dict[str, float] = {}
        if self.disk:
            self.disk.mkdir(parents=True, exist_ok=True)
            for stale in self.disk.glob(f".*{SUFFIX}.*.tmp"):  # a writer killed mid-write
                stale.unlink(missing_ok=True)
            self.sweep()

    # sessions ---------------------------------------------------------------------------

    def get(self, name: str) -> Session:
        """The session `name`, resident and most recently used: as it was, restored from disk, or new."""
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
        on_disk = [self._header_name(p) for p in self._files()] if self.disk else []
        return sorted(set(self._resident) | {n for n in on_disk if n})

    def settle(self, keep: str | None = None) -> None:
        """Spill (or drop) least recently used sessions until resident bytes fit the cap; `keep`
        stays resident even when it alone is over the cap."""
        if self.cap is None:
            return
        total = self.resident_bytes()
        for name in list(self._resident):
            if total <= self.cap:
                break
            if name != keep:
                total -= session_bytes(self._resident[name])
                self._evict(name)

    def close(self) -> None:
        """A planned stop: write every resident session (without a disk, nothing to do)."""
        if self.disk:
            for name in list(self._resident):
                self._write(self._resident[name])

    def resident_bytes(self) -> int:
        return sum(session_bytes(s) for s in self._resident.values())

    # disk -------------------------------------------------------------------------------

    def path_of(self, name: str) -> Path:
        assert self.disk is not None
        return self.disk / (hashlib.sha256(name.encode()).hexdigest()[:32] + SUFFIX)

    def _evict(self, name: str) -> None:
        session = self._resident.pop(name)
        if self.disk:
            self._write(session)
            self.counters.spills += 1
            self.sweep(protect=self.path_of(name))
        else:
            self.counters.drops += 1

    def _write(self, session: Session) -> None:
        written = write_session(
            self.path_of(session.name), session, self.identity,
            self._last_use.get(session.name, self.clock()), self.model,
        )
        self.counters.bytes_written += written

    def _restore(self, name: str) -> Session | None:
        if not self.disk:
            return None
        path = self.path_of(name)
        if not path.exists():
            return None
        start = time.perf_counter()
        try:
            session = read_session(path, self.identity, self.reader.model.new_state())
        except SessionFileError as e:
            self._reject(path, str(e))
            return None
        if session.name != name:
            self._reject(path, f"holds session {session.name!r}, not {name!r}")
            return None
        if self.reader.model.device.type == "cuda":
            import torch

            torch.cuda.synchronize()
        self.counters.restore_seconds += time.perf_counter() - start
        self.counters.bytes_restored += path.stat().st_size
        self.counters.restores += 1
        return session

    def _reject(self, path: Path, reason: str) -> None:
        """Report a bad file once and move it aside; the session will be read again from its ids."""
        log.warning("session file %s refused: %s; the session is read again", path.name, reason)
        self.counters.rejected.append((path.name, reason))
        path.replace(path.with_name(path.name + REJECTED))

    def _files(self) -> list[Path]:
        return sorted(self.disk.glob(f"*{SUFFIX}")) if self.disk else []

    def sweep(self, protect: Path | None = None) -> None:
        """Remove files (rejected ones too) older than max_age_s, then the oldest past the disk cap."""
        if not self.disk:
            return
        now = self.clock()
        files = [p for p in self.disk.iterdir() if p.name.endswith((SUFFIX, SUFFIX + REJECTED))]
        aged = sorted(files, key=lambda p: p.stat().st_mtime)
        keep = []
        for p in aged:
            if now - p.stat().st_mtime > self.max_age_s and p != protect:
                p.unlink(missing_ok=True)
                self.counters.removed += 1
            else:
                keep.append(p)
        total = sum(p.stat().st_size for p in keep)
        for p in keep:
            if total <= self.disk_cap:
                break
            if p != protect:
                total -= p.stat().st_size
                p.unlink(missing_ok=True)
                self.counters.removed += 1

    def _header_name(self, path: Path) -> str | None:
        try:
            return read_header(path).get("name")
        except SessionFileError:
            return None

    # status -----------------------------------------------------------------------------

    def totals(self) -> dict[str, int | None]:
        """Resident and disk bytes against their caps, and session counts."""
        files = self._files()
        return {
            "resident_bytes": self.resident_bytes(), "cap_bytes": self.cap,
            "disk_bytes": sum(p.stat().st_size for p in files), "disk_cap_bytes": self.disk_cap if self.disk else None,
            "resident_sessions": len(self._resident), "files": len(files),
        }

    def status(self) -> list[SessionRow]:
        """Every session: resident ones from memory, spilled ones from their file headers."""
        rows = [
            SessionRow(s.name, s.committed, s.pending, session_bytes(s), len(s.checkpoints), True,
                       self._last_use.get(s.name, 0.0))
            for s in self._resident.values()
        ]
        for path in self._files():
            try:
                meta = read_header(path)
            except SessionFileError:
                continue
            if meta["name"] in self._resident:
                continue
            rows.append(SessionRow(
                meta["name"], int(meta["committed"]), int(meta["tokens"]) - int(meta["committed"]),
                path.stat().st_size, len(json.loads(meta["checkpoints"])), False,
                float(meta["last_use"]),
            ))
        return sorted(rows, key=lambda r: r.name)


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
    """Check every file in a store folder. With a reader and weights hash, each file is read in
    full (identity, shapes, checksums); without, only its header is checked."""
    now = time.time() if now is None else now
    rows = []
    for path in sorted(Path(folder).iterdir()):
        if not path.name.endswith((SUFFIX, SUFFIX + REJECTED)) or path.name.startswith("."):
            continue
        size, age = path.stat().st_size, now - path.stat().st_mtime
        meta = {}
        try:
            if path.name.endswith(REJECTED):
                raise SessionFileError("rejected earlier")
            meta = read_header(path)
            if reader is not None and weights_hash is not None:
                identity = Identity(weights_hash, reader.grid, arithmetic_of(reader.model))
                check_identity(meta, identity)
                read_session(path, identity, reader.model.new_state())
            valid, reason = True, "ok" if reader is not None else "header ok"
        except SessionFileError as e:
            valid, reason = False, str(e)
        tokens = int(meta["tokens"]) if "tokens" in meta else None
        rows.append(FileRow(path.name, meta.get("name"), tokens, size, age, valid, reason))
    return rows
