# The session file module of the earlier version (format 2), frozen as it was at commit 2d74ece, for
# experiments/restore_speed.py to time the old way of spilling and restoring beside the new one in the
# same run. Not part of the library, never edited (the library reads format-2 files itself).
# --- shadow/core/sessionfile.py at 2d74ece, unchanged below ---
"""One session in one safetensors file: its ids (pending tail included), KV rows up to the
committed length, GDN conv and recurrent state, checkpoints, and metadata.

Layout (a plain safetensors file): an 8-byte little-endian header length N, N bytes of JSON
header (the metadata first, then each tensor's dtype, shape and offsets; padded with spaces to a
multiple of 8), then the tensors' bytes back to back, 8-byte types first so every tensor is
aligned. Every byte is covered by SHA-256: `data_sha256` over the tensor bytes, `header_sha256`
over the length and the header with its own 64 hex digits read as zeros. A listing checks the
header without reading the tensors. A restore checks the header and every field's type and range
(positions on the grid, shapes and dtypes those of the model's state at the committed length,
counters non-negative integers) before it reads the tensors, and the data digest and the ids
(within the model's vocabulary) before it returns anything.
Anything else is refused with a `SessionFileError` that says why: nothing wrong is ever served,
and nothing else is raised for a bad file.

Writes are atomic: a temporary file in the same folder, fsync, rename, fsync of the folder, so a
killed writer leaves the old file or the new one.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import queue
import re
import secrets
import stat
import threading
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import torch

from shadow.core.reader import MAX_CHECKPOINTS, Session
from shadow.model.state import DeltaSnapshot, ModelState

FORMAT = "shadow-session"
VERSION = 2
SUFFIX = ".safetensors"
MARKER = b'"format":"shadow-session"'  # in the header of every session file, of any version
MAX_HEADER = 1 << 24
DTYPES = {  # what a header may name (the model decides what fits)
    "I64": torch.int64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_SLOT = b'"header_sha256":"'
_ZEROS = b"0" * 64
_HEX64 = re.compile(r"[0-9a-f]{64}")
_COUNT = re.compile(r"0|[1-9][0-9]{0,17}")
KEYS = frozenset({
    "format", "version", "name", "model", "weights_hash", "grid", "arithmetic", "committed", "tokens",
    "last_use", "rollbacks", "ids_reread", "checkpoints", "marks", "data_sha256", "header_sha256",
})


class SessionFileError(Exception):
    """A session file that must not be served; the message says why."""


@dataclass(frozen=True)
class Identity:
    """What a file must match to be read: the weights, the grid, and the arithmetic (kernel set
    and dtype: a state computed by other kernels would not continue bit for bit)."""

    weights_hash: str
    grid: int
    arithmetic: str = ""


@dataclass(frozen=True)
class Header:
    """A file's metadata, its digest verified and every field validated; `meta` is the raw text."""

    name: str
    model: str
    weights_hash: str
    grid: int
    arithmetic: str
    committed: int
    tokens: int
    last_use: float
    rollbacks: int
    ids_reread: int
    checkpoints: tuple[int, ...]
    marks: tuple[int, ...]
    meta: dict[str, str]


def session_tensors(session: Session) -> dict[str, torch.Tensor]:
    """Every tensor a file holds, on the CPU, contiguous, each its own copy (a state's GDN tensors
    are views of one arena): the ids, then the state's and its checkpoints' tensors as the state
    names them (`ModelState.tensors`, `snapshot_tensors`)."""
    out = {"ids": torch.tensor(session.ids, dtype=torch.int64)}
    out.update(session.state.tensors())
    out.update(session.state.snapshot_tensors(session.checkpoints))
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in out.items()}


# writing --------------------------------------------------------------------------------------


def write_session(path: Path, session: Session, identity: Identity, last_use: float, model: str = "") -> int:
    """Write atomically (temporary file, fsync, rename, fsync of the folder); returns the bytes
    written. Raises OSError when the disk refuses (the old file, if any, is left as it was)."""
    last_use = float(last_use) if math.isfinite(last_use) and last_use >= 0 else 0.0
    meta = {
        "name": session.name, "model": model, "weights_hash": identity.weights_hash, "grid": str(identity.grid),
        "arithmetic": identity.arithmetic, "committed": str(session.committed), "tokens": str(len(session.ids)),
        "last_use": repr(last_use), "rollbacks": str(session.rollbacks), "ids_reread": str(session.ids_reread),
        "checkpoints": json.dumps([c.position for c in session.checkpoints]), "marks": json.dumps(session.marks),
    }
    return _write_atomic(Path(path), Encoded(session_tensors(session), meta))


class Encoded:
    """A file's pieces: `views`, each tensor's bytes (8-byte types first, so each is aligned), and
    `header(data_sha256)`, the length and header with both digests. The header's length does not
    depend on the digests, so the tensors can be written (and hashed) before it."""

    def __init__(self, tensors: dict[str, torch.Tensor], meta: dict[str, str]):
        order = sorted(tensors, key=lambda k: -tensors[k].element_size())  # stable
        self.views = [_raw(tensors[k]) for k in order]
        entries, offset = {}, 0
        for name, view in zip(order, self.views):
            t = tensors[name]
            entries[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(view)]}
            offset += len(view)
        meta = {"format": FORMAT, "version": str(VERSION), **meta, "data_sha256": _ZEROS.decode(), "header_sha256": _ZEROS.decode()}
        text = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":"), ensure_ascii=True).encode()
        self._text = text + b" " * (-len(text) % 8)
        self.data_bytes = offset

    @property
    def header_bytes(self) -> int:
        return 8 + len(self._text)

    def header(self, data_sha256: str) -> bytes:
        text = self._text.replace(b'"data_sha256":"' + _ZEROS, b'"data_sha256":"' + data_sha256.encode(), 1)
        prefix = len(text).to_bytes(8, "little")
        slot = text.index(_SLOT) + len(_SLOT)
        digest = hashlib.sha256(prefix + text).hexdigest().encode()
        return prefix + text[:slot] + digest + text[slot + 64 :]


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _write_all(fd: int, pieces: list[memoryview | bytes]) -> None:
    """Write every piece to `fd` at its current offset (os.write may write less than asked)."""
    for piece in pieces:
        view = memoryview(piece)
        while view:
            view = view[os.write(fd, view):]


def _write_atomic(path: Path, encoded: Encoded) -> int:
    """The tensors first (hashed in a thread while they are written), then the header at the start."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        try:
            data = hashlib.sha256()
            hasher = threading.Thread(target=lambda: [data.update(v) for v in encoded.views], daemon=True)
            hasher.start()
            try:
                os.lseek(fd, encoded.header_bytes, os.SEEK_SET)
                _write_all(fd, encoded.views)
            finally:
                hasher.join()
            os.lseek(fd, 0, os.SEEK_SET)
            _write_all(fd, [encoded.header(data.hexdigest())])
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)
    return encoded.header_bytes + encoded.data_bytes


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


def read_header(path: Path) -> dict[str, str]:
    """The file's metadata, its header digest verified and every field validated (the tensors are
    not read); SessionFileError when it must not be used."""
    return read_fields(path).meta


def read_fields(path: Path) -> Header:
    """The file's header, verified and validated, typed; the tensors are not read."""
    with _opened(path) as (fd, size):
        return _header_of(fd, size)[0]


def check_identity(meta: dict[str, str] | Header, identity: Identity) -> None:
    """SessionFileError unless the file was written by the same weights, grid and arithmetic."""
    meta = meta.meta if isinstance(meta, Header) else meta
    if meta.get("weights_hash") != identity.weights_hash:
        raise SessionFileError(f"another model (weights {str(meta.get('weights_hash', '?'))[:12]}…)")
    if meta.get("grid") != str(identity.grid):
        raise SessionFileError(f"another grid ({meta.get('grid')}, this reader uses {identity.grid})")
    if meta.get("arithmetic", "") != identity.arithmetic:
        raise SessionFileError(f"other kernels ({meta.get('arithmetic')!r}, this reader computes with {identity.arithmetic!r})")


def read_ids(path: Path) -> tuple[str, list[int]]:
    """A file's session name and ids, every byte verified (no model needed)."""
    sha = hashlib.sha256()
    with _opened(path) as (fd, size):
        header, spans, n = _header_of(fd, size)
        _ids_span(header, spans)
        tensors = _data(fd, size, n, spans, sha.update)
    if sha.hexdigest() != header.meta["data_sha256"]:
        raise SessionFileError(DATA_MISMATCH)
    return header.name, _id_values(tensors["ids"], None)


def read_session(path: Path, identity: Identity, model_state: ModelState, max_checkpoints: int = MAX_CHECKPOINTS) -> Session:
    """Load a session into `model_state` (a fresh state of the reader's model, on its device).
    The header is verified and every field validated against the model before the tensors are
    read; the data digest is computed (in a thread) block by block as the bytes are read and while
    they are copied into the fresh state, and checked before any id is read or the session
    returned: on a mismatch nothing is returned (the caller discards the state)."""
    digest = _Digest()
    try:
        with _opened(path) as (fd, size):
            header, spans, n = _header_of(fd, size)
            check_identity(header, identity)
            _fit(header, spans, model_state, max_checkpoints)
            tensors = _data(fd, size, n, spans, digest.add)
        checkpoints = _fill(header, tensors, model_state)
    finally:
        got = digest.hexdigest()
    if got != header.meta["data_sha256"]:
        raise SessionFileError(DATA_MISMATCH)
    ids = _id_values(tensors["ids"], model_state.config.vocab_size)
    return Session(
        name=header.name, state=model_state, ids=ids, checkpoints=checkpoints, marks=list(header.marks),
        rollbacks=header.rollbacks, ids_reread=header.ids_reread,
    )


DATA_MISMATCH = "data digest mismatch (a tensor's bytes changed since the file was written)"


def _header_of(fd: int, size: int) -> tuple[Header, dict[str, tuple], int]:
    """The verified, validated header, each tensor's (dtype, shape, begin, end), the header length."""
    prefix = _pread(fd, 8, 0)
    n = _header_length(prefix, size)
    header, spans = _parse(prefix, _pread(fd, n, 8), size)
    return header, spans, n


READ_BLOCK = 32 << 20  # bytes read (and handed to the digest) at a time


class _Digest:
    """SHA-256 of the blocks given to `add`, in order, computed on a thread of its own while more
    are read (hashlib lets go of the GIL). `hexdigest` waits for every block; a failure in the
    thread gives a digest that matches nothing."""

    def __init__(self):
        self._sha, self._blocks, self._failed = hashlib.sha256(), queue.SimpleQueue(), False
        self._thread = threading.Thread(target=self._run, name="session-digest", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while (block := self._blocks.get()) is not None:
                self._sha.update(block)
        except Exception:  # noqa: BLE001 - reported as a mismatch by hexdigest
            self._failed = True
            while self._blocks.get() is not None:
                pass

    def add(self, block: memoryview) -> None:
        self._blocks.put(block)

    def hexdigest(self) -> str:
        self._blocks.put(None)
        self._thread.join()
        return "failed" if self._failed else self._sha.hexdigest()


def _data(fd: int, size: int, n: int, spans: dict[str, tuple],
          on_block: Callable[[memoryview], None] = lambda block: None) -> dict[str, torch.Tensor]:
    """The tensors (views of one buffer in memory), not yet verified: each block of their bytes
    goes to `on_block` as it is read, and the caller checks `data_sha256` over them before it
    uses a value."""
    try:
        buf = torch.empty(size - 8 - n, dtype=torch.uint8)  # not zero-filled: every byte is read into it
    except (RuntimeError, MemoryError):
        raise SessionFileError(f"too large to read ({size} bytes)") from None
    view = memoryview(buf.numpy())
    got = 0
    while got < len(view):
        step = os.preadv(fd, [view[got:got + READ_BLOCK]], 8 + n + got)
        if step == 0:
            raise SessionFileError(f"truncated while reading ({8 + n + got} of {size} bytes)")
        on_block(view[got:got + step])
        got += step
    tensors = {}
    for name, (dtype, shape, begin, end) in spans.items():
        t = buf[begin:end]
        if t.data_ptr() % dtype.itemsize:
            t = t.clone()
        tensors[name] = t.view(dtype).reshape(shape)
    return tensors


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


def _header_length(prefix: bytes, size: int) -> int:
    if size < 8:
        raise SessionFileError(f"truncated ({size} bytes)")
    n = int.from_bytes(prefix, "little")
    if not 2 <= n <= min(MAX_HEADER, size - 8):
        raise SessionFileError(f"truncated or not safetensors (header length {n}, file {size} bytes)")
    return n


def _parse(prefix: bytes, raw: bytes, size: int) -> tuple[Header, dict[str, tuple]]:
    """Verify the header digest, then parse and validate every field; (header, tensor spans)."""
    if raw.count(_SLOT) != 1:
        raise SessionFileError(_undigested(raw))
    slot = raw.index(_SLOT) + len(_SLOT)
    digest = hashlib.sha256(prefix + raw[:slot] + _ZEROS + raw[slot + 64 :]).hexdigest().encode()
    if raw[slot : slot + 64] != digest:
        raise SessionFileError("header digest mismatch (the header changed since the file was written)")
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique)
        if not isinstance(obj, dict):
            raise SessionFileError("header is not a JSON object")
        meta = obj.pop("__metadata__", None)
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise SessionFileError("metadata missing or not text")
        if meta.get("format") != FORMAT:
            raise SessionFileError(f"not a shadow session file (format {meta.get('format')!r})")
        if meta.get("version") != str(VERSION):
            raise SessionFileError(f"format version {meta.get('version')!r}, this build reads {VERSION}")
        if set(meta) != KEYS:
            raise SessionFileError(f"metadata fields differ (missing {sorted(KEYS - set(meta))}, unknown {sorted(set(meta) - KEYS)[:5]})")
        header = _fields(meta)
        spans = _spans(obj, size - 8 - len(raw))
    except SessionFileError:
        raise
    except Exception as e:  # JSON or text that no check foresaw: refused all the same
        raise SessionFileError(f"unreadable header ({type(e).__name__}: {str(e)[:120]})") from None
    return header, spans


def _undigested(raw: bytes) -> str:
    """Why a header without exactly one digest is refused: an older build's file, another format, or damage."""
    try:
        meta = json.loads(raw.decode("utf-8")).get("__metadata__") or {}
        fmt, version = meta.get("format"), meta.get("version")
    except Exception:
        return "unreadable header (no digest, not JSON)"
    if fmt != FORMAT:
        return f"not a shadow session file (format {fmt!r})"
    if version != str(VERSION):
        return f"format version {version!r}, this build reads {VERSION}"
    return "header digest missing"


def _unique(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise SessionFileError("header repeats a key")
    return out


def _count(meta: dict[str, str], key: str) -> int:
    value = meta[key]
    if not _COUNT.fullmatch(value):
        raise SessionFileError(f"{key} is {value[:40]!r}, not a non-negative integer")
    return int(value)


def _positions(meta: dict[str, str], key: str, grid: int, lo: int, hi: int) -> tuple[int, ...]:
    """A JSON list of rising grid lines in (lo, hi]."""
    value = json.loads(meta[key])
    if not isinstance(value, list) or not all(type(p) is int for p in value):
        raise SessionFileError(f"{key} is {meta[key][:40]!r}, not a list of integers")
    if any(p % grid or not lo < p <= hi for p in value) or any(a >= b for a, b in zip(value, value[1:])):
        raise SessionFileError(f"{key} {value[:8]} are not rising grid lines in ({lo}, {hi}] (grid {grid})")
    return tuple(value)


def _fields(meta: dict[str, str]) -> Header:
    grid = _count(meta, "grid")
    committed, tokens = _count(meta, "committed"), _count(meta, "tokens")
    if grid == 0 or committed % grid:
        raise SessionFileError(f"committed length {committed} is off the grid ({grid})")
    if committed > tokens:
        raise SessionFileError(f"committed length {committed} exceeds the {tokens} ids held")
    try:
        last_use = float(meta["last_use"])
    except ValueError:
        raise SessionFileError(f"last_use is {meta['last_use'][:40]!r}, not a number") from None
    if not math.isfinite(last_use) or last_use < 0:
        raise SessionFileError(f"last_use is {last_use}")
    for key in ("data_sha256", "header_sha256"):
        if not _HEX64.fullmatch(meta[key]):
            raise SessionFileError(f"{key} is not a SHA-256 digest")
    return Header(
        name=meta["name"], model=meta["model"], weights_hash=meta["weights_hash"], grid=grid,
        arithmetic=meta["arithmetic"], committed=committed, tokens=tokens, last_use=last_use,
        rollbacks=_count(meta, "rollbacks"), ids_reread=_count(meta, "ids_reread"),
        checkpoints=_positions(meta, "checkpoints", grid, 0, committed),
        marks=_positions(meta, "marks", grid, committed, tokens), meta=dict(meta),
    )


def _spans(entries: dict, data_bytes: int) -> dict[str, tuple]:
    """Each tensor's (dtype, shape, begin, end), checked: known dtype, sizes that match the
    offsets, offsets that tile the data exactly."""
    spans = {}
    for name, e in entries.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise SessionFileError(f"tensor entry {name[:40]!r} is malformed")
        dtype, shape, offsets = DTYPES.get(e["dtype"]), e["shape"], e["data_offsets"]
        if dtype is None:
            raise SessionFileError(f"{name[:40]} has dtype {str(e['dtype'])[:10]!r}")
        if not isinstance(shape, list) or len(shape) > 8 or not all(type(d) is int and d >= 0 for d in shape):
            raise SessionFileError(f"{name[:40]} has shape {str(shape)[:40]}")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets):
            raise SessionFileError(f"{name[:40]} has offsets {str(offsets)[:40]}")
        if offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
            raise SessionFileError(f"{name[:40]}: offsets {offsets} do not hold shape {shape} of {e['dtype']}")
        spans[name] = (dtype, tuple(shape), *offsets)
    end = 0
    for _, _, begin, stop in sorted(spans.values(), key=lambda s: (s[2], s[3])):
        if begin != end:
            raise SessionFileError("tensor offsets overlap or leave a gap")
        end = stop
    if end != data_bytes:
        what = "truncated" if data_bytes < end else "bytes past the tensors"
        raise SessionFileError(f"{what} (tensors hold {end} bytes, the file {data_bytes} after its header)")
    return spans


# validation against the model ------------------------------------------------------------------


def _ids_span(header: Header, spans: dict[str, tuple]) -> None:
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


def _fit(header: Header, spans: dict[str, tuple], state: ModelState, max_checkpoints: int) -> None:
    """Check every tensor's name, dtype and shape against a fresh state of the model at the
    committed length (the ids' values are checked once the data digest is)."""
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


def _fill(header: Header, tensors: dict[str, torch.Tensor], state: ModelState) -> list[DeltaSnapshot]:
    """Copy the tensors into the fresh state; returns the checkpoints."""
    state.load(tensors, header.committed)
    return state.load_snapshots(tensors, list(header.checkpoints))


def session_file_name(name: str) -> str:
    """The file a session `name` is kept in: sha256(name)[:32] + SUFFIX."""
    return hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32] + SUFFIX
