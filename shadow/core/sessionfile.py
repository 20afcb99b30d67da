"""One session in one file: its ids (pending tail included), KV rows up to the committed length,
GDN conv and recurrent state, checkpoints, and metadata. The bytes are `sessionformat`'s (a plain
safetensors file; format 3 written, formats 2 and 3 read); the I/O is `blockio`'s.

A restore reads the header first: its digest verified, every field validated (positions on the
grid, counters non-negative integers), its keyed digest checked when the reader has a key, and
every tensor's name, dtype and shape those of the model's state at the committed length. Then
the data, in blocks: a format-3 block is checked against its digest (in the verified header) on a
pool thread as soon as it is read, and only then copied, from pinned memory and without waiting,
straight into the fresh state's own tensors (no second copy). So nothing unverified reaches the
state, and the ids are checked against the model's vocabulary before anything is returned.
A format-2 file has one digest over all its data: its blocks are copied as they are read and the
digest is checked at the end; on a mismatch it raises, and the state it was reading into (a
fresh one, the caller's) is never returned. Anything wrong raises a `SessionFileError` that says
why, and nothing else is raised for a bad file.

A write takes the tensors from the state in blocks (each copied into a pinned block, hashed and
written by the pool, O_DIRECT where the file system takes it), then writes the header with the
block digests at the start, fsyncs, renames, and fsyncs the folder: a killed writer leaves the old
file or the new one. Files are created mode 0600.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import secrets
import stat
from contextlib import suppress
from pathlib import Path

import torch

from shadow.core import blockio
from shadow.core.reader import MAX_CHECKPOINTS, Session
from shadow.core.sessionformat import (  # noqa: F401 - the file's names, offered from here
    BLOCK_BYTES, DATA_MISMATCH, FORMAT, MARKER, MAX_HEADER, VERSION, Header, Identity, Layout, SessionFileError,
    Span, check_identity, header_bytes, header_length, layout, parse,
)
from shadow.model.state import DeltaSnapshot, ModelState

SUFFIX = ".safetensors"
FILE_MODE = 0o600
DIRECT = True  # O_DIRECT where the file system takes it (False: through the page cache)


def session_file_name(name: str) -> str:
    """The file a session `name` is kept in: sha256(name)[:32] + SUFFIX."""
    return hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32] + SUFFIX


def session_tensors(session: Session) -> dict[str, torch.Tensor]:
    """Every tensor a file holds, by name: the ids (a CPU int64 tensor), then the state's and its
    checkpoints' tensors as the state names them (`ModelState.tensors`, `snapshot_tensors`), as
    views of the session's own memory (no copy)."""
    out = {"ids": torch.tensor(session.ids, dtype=torch.int64)}
    out.update(session.state.tensors())
    out.update(session.state.snapshot_tensors(session.checkpoints))
    return out


def file_bytes(session: Session) -> int:
    """About the size of the file `session` would be written to (the header taken as one block
    of alignment): what a restore of it would read."""
    return (8 * len(session.ids) + session.state.nbytes() + sum(c.nbytes() for c in session.checkpoints)
            + blockio.ALIGN)


# writing --------------------------------------------------------------------------------------


def write_session(path: Path, session: Session, identity: Identity, last_use: float, model: str = "", *,
                  key: bytes | None = None, block_bytes: int | None = None, direct: bool | None = None,
                  workers: int | None = None, checks: dict | None = None) -> int:
    """Write atomically (temporary file, fsync, rename, fsync of the folder), mode 0600, its
    keyed digest made with `key` (None: zeros), digested in blocks of `block_bytes` (None: this
    module's BLOCK_BYTES); returns the bytes written. Raises OSError when
    the disk refuses (the old file, if any, is left as it was). `checks`: what the service knows of
    the session's ids against the engine (a JSON object), carried as it is (`Header.checks`)."""
    last_use = float(last_use) if math.isfinite(last_use) and last_use >= 0 else 0.0
    meta = {
        "name": session.name, "model": model, "weights_hash": identity.weights_hash, "grid": str(identity.grid),
        "arithmetic": identity.arithmetic, "committed": str(session.committed), "tokens": str(len(session.ids)),
        "last_use": repr(last_use), "rollbacks": str(session.rollbacks), "ids_reread": str(session.ids_reread),
        "checkpoints": json.dumps([c.position for c in session.checkpoints]), "marks": json.dumps(session.marks),
    }
    if checks is not None:
        meta["checks"] = json.dumps(checks, separators=(",", ":"))
    sources = session_tensors(session)
    lay = layout({k: (v.dtype, tuple(v.shape)) for k, v in sources.items()}, meta, block_bytes or BLOCK_BYTES)
    return _write_atomic(Path(path), lay, _Tiles(lay.spans, sources), key, DIRECT if direct is None else direct, workers)


def _write_atomic(path: Path, lay: Layout, tiles: _Tiles, key: bytes | None, direct: bool, workers: int | None) -> int:
    """The data first, in blocks (hashed and written by the pool), then the header with the
    blocks' digests at the start; fsync, rename, fsync of the folder."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        try:
            os.fchmod(fd, FILE_MODE)  # whatever the umask

            def fill(i: int, block: torch.Tensor):
                lo = i * lay.block_bytes
                return tiles.move(lo, lo + block.numel(), block, into_block=True)

            digests = blockio.write_blocks(fd, lay.start, lay.data_bytes, lay.block_bytes, fill,
                                           pinned=tiles.cuda is not None, workers=workers, direct=direct)
            blockio.pwrite_all(fd, memoryview(header_bytes(lay, digests, key)), 0)
            os.ftruncate(fd, lay.start + lay.data_bytes)  # a last block written padded to alignment
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)
    return lay.start + lay.data_bytes


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable; a file system that cannot fsync a folder (EINVAL, ENOTSUP) has
    nothing more to offer, any other error is the write's failure."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


# reading --------------------------------------------------------------------------------------


def read_header(path: Path, key: bytes | None = None) -> dict[str, str]:
    """The file's metadata, its header digest verified (and its keyed digest, with a key) and every
    field validated (the tensors are not read); SessionFileError when it must not be used."""
    return read_fields(path, key).meta


def read_fields(path: Path, key: bytes | None = None) -> Header:
    """The file's header, verified and validated, typed; the tensors are not read."""
    with _opened(path) as (fd, size):
        return _header_of(fd, size, key)[0]


def read_ids(path: Path, key: bytes | None = None) -> tuple[str, list[int]]:
    """A file's session name and ids, every byte verified (no model needed)."""
    with _opened(path) as (fd, size):
        header, spans = _header_of(fd, size, key)
        _ids_span(header, spans)
        ids = torch.empty(header.tokens, dtype=torch.int64)
        _read_data(fd, header, _Tiles(spans, {"ids": ids}), DIRECT, None)
    return header.name, _id_values(ids, None)


def read_session(path: Path, identity: Identity, model_state: ModelState, max_checkpoints: int = MAX_CHECKPOINTS, *,
                 key: bytes | None = None, direct: bool | None = None, workers: int | None = None) -> Session:
    """Load a session into `model_state` (a fresh state of the reader's model, on its device): the
    header verified and validated against the model first, then the data read in blocks straight
    into the state's own tensors, each format-3 block verified before it is copied (a format-2
    file's one digest checked at the end). On any failure it raises SessionFileError and the state
    is left half-filled: the caller discards it."""
    with _opened(path) as (fd, size):
        header, spans = _header_of(fd, size, key)
        check_identity(header, identity)
        _fit(header, spans, model_state, max_checkpoints)
        try:
            ids = torch.empty(header.tokens, dtype=torch.int64)
            targets, checkpoints = _targets(header, model_state)
        except (RuntimeError, MemoryError):
            raise SessionFileError(f"too large to read into memory ({size} bytes)") from None
        _read_data(fd, header, _Tiles(spans, {"ids": ids, **targets}), DIRECT if direct is None else direct, workers)
    return Session(
        name=header.name, state=model_state, ids=_id_values(ids, model_state.config.vocab_size),
        checkpoints=checkpoints, marks=list(header.marks), rollbacks=header.rollbacks, ids_reread=header.ids_reread,
    )


def _header_of(fd: int, size: int, key: bytes | None) -> tuple[Header, dict[str, Span]]:
    """The verified, validated header and each tensor's (dtype, shape, begin, end)."""
    prefix = _pread(fd, 8, 0)
    n = header_length(prefix, size)
    return parse(prefix, _pread(fd, n, 8), size, key)


def _read_data(fd: int, header: Header, tiles: _Tiles, direct: bool, workers: int | None) -> None:
    """Read the data into `tiles`, every byte verified: format 3 block by block before each copy,
    format 2 as a whole at the end (raising after the copies)."""
    total = tiles.data_bytes
    pinned = tiles.cuda is not None

    def deliver(i: int, block: torch.Tensor, view: memoryview, size: int):
        lo = i * size
        return tiles.move(lo, lo + len(view), block, into_block=False)

    try:
        if header.version >= 3:
            count, size = len(header.blocks), header.block_bytes

            def check(i: int, view: memoryview) -> None:
                if blockio.sha256(view) != header.blocks[i]:
                    raise SessionFileError(f"{DATA_MISMATCH} (block {i + 1} of {count} changed since the file was written)")

            blockio.read_blocks(fd, header.start, total, size, check, lambda i, b, v: deliver(i, b, v, size),
                                pinned=pinned, workers=workers, direct=direct)
        else:
            sha = hashlib.sha256()

            def hashed(i: int, block: torch.Tensor, view: memoryview):
                sha.update(view)
                return deliver(i, block, view, BLOCK_BYTES)

            blockio.read_blocks(fd, header.start, total, BLOCK_BYTES, lambda i, v: None, hashed,
                                pinned=pinned, workers=workers, direct=False)
            if sha.hexdigest() != header.data_sha256:
                raise SessionFileError(f"{DATA_MISMATCH} (a tensor's bytes changed since the file was written)")
    except blockio.ShortRead as e:
        raise SessionFileError(f"truncated while reading ({e.offset} of {header.start + total} bytes)") from None


class _Tiles:
    """Where each byte of a file's data comes from or goes to: contiguous uint8 pieces of tensors
    (a KV tensor cut to its valid rows is one piece per head), by their offset in the data. A
    tensor not given (`read_ids` wants only the ids) is read and verified but copied nowhere."""

    def __init__(self, spans: dict[str, Span], tensors: dict[str, torch.Tensor]):
        pieces = []
        for name, (_, _, begin, end) in spans.items():
            if name not in tensors:
                continue
            at = begin
            for piece in _pieces(tensors[name]):
                pieces.append((at, at + piece.numel(), piece))
                at += piece.numel()
            if at != end:
                raise RuntimeError(f"{name} holds {at - begin} bytes, its span {end - begin}")
        self.pieces = sorted(pieces, key=lambda p: p[0])
        self.data_bytes = max((e for _, _, b, e in spans.values()), default=0)
        self.cuda = next((p.device for _, _, p in self.pieces if p.is_cuda), None)
        self._next = 0

    def move(self, lo: int, hi: int, block: torch.Tensor, into_block: bool):
        """Copy data bytes [lo, hi) between `block` and their tensors (blocks come in order);
        returns a CUDA event recorded after the copies when any was to or from the device."""
        j = self._next
        while j < len(self.pieces) and self.pieces[j][1] <= lo:
            j += 1
        self._next = j
        device = False
        while j < len(self.pieces) and self.pieces[j][0] < hi:
            begin, end, piece = self.pieces[j]
            a, z = max(lo, begin), min(hi, end)
            if into_block:
                block[a - lo : z - lo].copy_(piece[a - begin : z - begin], non_blocking=True)
            else:
                piece[a - begin : z - begin].copy_(block[a - lo : z - lo], non_blocking=True)
            device = device or piece.is_cuda
            j += 1
        if not device:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.cuda))
        return event


def _pieces(t: torch.Tensor) -> list[torch.Tensor]:
    """`t`'s bytes in row-major order as contiguous uint8 views of its own memory."""
    if t.numel() == 0:
        return []
    if t.is_contiguous():
        return [t.reshape(-1).view(torch.uint8)]
    return [p for sub in t.unbind(0) for p in _pieces(sub)]


def _targets(header: Header, state: ModelState) -> tuple[dict[str, torch.Tensor], list[DeltaSnapshot]]:
    """The fresh state made ready for the committed length (its KV buffers hold the rows, its
    checkpoints allocated), and its own tensors by the names a file uses: what the data is read
    straight into. The names, dtypes and shapes are checked against the state's `expected`."""
    for layer in state.attention:
        layer.reserve(header.committed)
    state.length = header.committed
    checkpoints = []
    for position in header.checkpoints:
        snap = state.snapshot()
        snap.position = position
        checkpoints.append(snap)
    out = state.tensors() | state.snapshot_tensors(checkpoints)
    want = state.expected(header.committed) | state.expected_snapshots(len(checkpoints))
    if {k: (v.dtype, tuple(v.shape)) for k, v in out.items()} != want:
        raise RuntimeError("the state's tensors differ from its expected layout")
    return out, checkpoints


class _opened:
    """A regular file opened for reading without following a symbolic link: (fd, size)."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> tuple[int, int]:
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise SessionFileError(f"cannot be opened ({_os_reason(e)})") from None
        try:
            st = os.fstat(self.fd)
        except OSError as e:
            os.close(self.fd)
            raise SessionFileError(f"cannot be read ({_os_reason(e)})") from None
        if not stat.S_ISREG(st.st_mode):
            os.close(self.fd)
            raise SessionFileError("not a regular file")
        return self.fd, st.st_size

    def __exit__(self, kind, value, tb) -> None:
        os.close(self.fd)
        if isinstance(value, OSError):
            raise SessionFileError(f"cannot be read ({_os_reason(value)})") from None


def _os_reason(e: OSError) -> str:
    return f"{type(e).__name__}: {e.strerror or e}"


def _pread(fd: int, n: int, offset: int) -> bytes:
    out = b""
    while len(out) < n:
        step = os.pread(fd, n - len(out), offset + len(out))
        if not step:
            raise SessionFileError(f"truncated (ends at byte {offset + len(out)})")
        out += step
    return out


# validation against the model ------------------------------------------------------------------


def _ids_span(header: Header, spans: dict[str, Span]) -> None:
    """The ids must be int64 [tokens]."""
    dtype, shape = spans["ids"][:2] if "ids" in spans else (None, None)
    if dtype != torch.int64 or shape != (header.tokens,):
        got = "missing" if dtype is None else f"{str(dtype).removeprefix('torch.')} {list(shape)}"
        raise SessionFileError(f"ids are {got}, expected int64 [{header.tokens}]")


def _id_values(ids: torch.Tensor, vocab: int | None) -> list[int]:
    """The ids as a list, each within [0, vocab) (only non-negative when no vocabulary is given)."""
    if ids.numel() and (int(ids.min()) < 0 or (vocab is not None and int(ids.max()) >= vocab)):
        raise SessionFileError(f"ids outside the vocabulary (0 .. {vocab})")
    return ids.tolist()


def _fit(header: Header, spans: dict[str, Span], state: ModelState, max_checkpoints: int) -> None:
    """Check every tensor's name, dtype and shape against a fresh state of the model at the
    committed length (the ids' values are checked once their bytes are verified)."""
    if len(header.checkpoints) > max_checkpoints:
        raise SessionFileError(f"{len(header.checkpoints)} checkpoints, this reader keeps {max_checkpoints}")
    _ids_span(header, spans)
    want = state.expected(header.committed) | state.expected_snapshots(len(header.checkpoints))
    names = set(spans) - {"ids"}
    if names != set(want):
        extra, missing = sorted(names - set(want)), sorted(set(want) - names)
        raise SessionFileError(f"tensors do not fit this model (unexpected {extra[:3]}, missing {missing[:3]})")
    for name, (dtype, shape) in want.items():
        got_dtype, got_shape = spans[name][:2]
        if got_dtype != dtype or tuple(got_shape) != shape:
            raise SessionFileError(f"{name} is {str(got_dtype).removeprefix('torch.')} {list(got_shape)}, "
                                   f"this model needs {str(dtype).removeprefix('torch.')} {list(shape)}")
