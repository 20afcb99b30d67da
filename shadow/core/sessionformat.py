"""The bytes of a session file: its header's layout, its digests (and the keyed one), and every
check a header passes before any byte of the file is used. No I/O here (`sessionfile` reads and
writes).

Format 3 (written): an 8-byte little-endian header length N, N bytes of JSON header (the metadata
first, then each tensor's dtype, shape and offsets; padded with spaces so the data starts at a
multiple of 4096 bytes), then the tensors back to back, 8-byte types first. The data is covered
in blocks of `block_bytes`: `blocks_sha256` holds each block's SHA-256, in order (64 hex digits
each), inside the header; `header_sha256` is the SHA-256 of the length and the header with its
own 64 digits read as zeros; `header_hmac` is the HMAC-SHA256, under the store's key, of the
SHA-256 of the length and the header with both `header_sha256` and `header_hmac` read as zeros
(64 zeros when written without a key). So every byte of the file is covered by a digest, a block
can be verified on its own as soon as it is read, and with a key no one without it can make a
file the store accepts.

Format 2 (read, never written): the same plain safetensors file with the header padded to 8
bytes, one `data_sha256` over all the tensor bytes, no block digests, no keyed digest.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
from dataclasses import dataclass, replace

import torch

FORMAT = "shadow-session"
VERSION = 3
READS = (2, 3)  # the versions this build reads
MARKER = b'"format":"shadow-session"'  # in the header of every session file, of any version
MAX_HEADER = 1 << 24
ALIGN = 4096  # a format-3 file's data starts at a multiple of this
BLOCK_BYTES = 8 << 20  # the block a format-3 file is digested in (and read and written in)
MIN_BLOCK, MAX_BLOCK = ALIGN, 64 << 20
DTYPES = {  # what a header may name (the model decides what fits)
    "I64": torch.int64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ZEROS = "0" * 64
_SHA_SLOT = b'"header_sha256":"'
_HMAC_SLOT = b'"header_hmac":"'
_BLOCKS_SLOT = b'"blocks_sha256":"'
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX = re.compile(r"(?:[0-9a-f]{64})*")
_COUNT = re.compile(r"0|[1-9][0-9]{0,17}")
COMMON = frozenset({
    "format", "version", "name", "model", "weights_hash", "grid", "arithmetic", "committed", "tokens",
    "last_use", "rollbacks", "ids_reread", "checkpoints", "marks", "header_sha256",
})
KEYS = {2: COMMON | {"data_sha256"}, 3: COMMON | {"block_bytes", "blocks_sha256", "header_hmac"}}
OPTIONAL = {2: frozenset(), 3: frozenset({"checks"})}  # fields a file may carry (`Header.checks`)
DATA_MISMATCH = "data digest mismatch"


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
    """A file's metadata, its digest verified (and its keyed digest, when the reader has a key)
    and every field validated; `meta` is the raw text. `start` is where the data begins; format 3
    has `block_bytes` and `blocks` (each block's SHA-256), format 2 `data_sha256`."""

    version: int
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
    start: int = 0
    checks: dict | None = None  # the service's record of the session's ids against the engine, as written
    block_bytes: int = 0
    blocks: tuple[bytes, ...] = ()
    data_sha256: str = ""


Span = tuple[torch.dtype, tuple[int, ...], int, int]  # dtype, shape, begin, end (in the data)


def key_bytes(key: str | bytes | None) -> bytes | None:
    """The store's key as bytes (None: no key); an empty key is refused."""
    if key is None:
        return None
    out = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    if not out:
        raise ValueError("the store's key is empty")
    return out


# writing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """A format-3 file before its digests are known: tensor names in file order, each one's span,
    the header text with zeros for every digest (its length does not depend on them), where the
    data starts, its size, the block size."""

    order: tuple[str, ...]
    spans: dict[str, Span]
    text: bytes
    start: int
    data_bytes: int
    block_bytes: int

    @property
    def blocks(self) -> int:
        return -(-self.data_bytes // self.block_bytes)


def layout(tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]], meta: dict[str, str],
           block_bytes: int = BLOCK_BYTES) -> Layout:
    """The layout of a file holding `tensors` (name: dtype, shape), 8-byte types first (each
    tensor aligned to its type), with `meta` (every field but the format's own and the digests)."""
    if block_bytes % ALIGN or not MIN_BLOCK <= block_bytes <= MAX_BLOCK:
        raise ValueError(f"block_bytes {block_bytes} is not a multiple of {ALIGN} in [{MIN_BLOCK}, {MAX_BLOCK}]")
    order = sorted(tensors, key=lambda k: -tensors[k][0].itemsize)  # stable
    spans, entries, offset = {}, {}, 0
    for name in order:
        dtype, shape = tensors[name]
        size = math.prod(shape) * dtype.itemsize
        spans[name] = (dtype, tuple(shape), offset, offset + size)
        entries[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    count = -(-offset // block_bytes)
    full = {"format": FORMAT, "version": str(VERSION), **meta, "block_bytes": str(block_bytes),
            "blocks_sha256": ZEROS * count, "header_hmac": ZEROS, "header_sha256": ZEROS}
    text = json.dumps({"__metadata__": full, **entries}, separators=(",", ":"), ensure_ascii=True).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)
    return Layout(tuple(order), spans, text, 8 + len(text), offset, block_bytes)


def header_bytes(lay: Layout, blocks: list[bytes], key: bytes | None) -> bytes:
    """The length and header of `lay` with its block digests, its keyed digest (under `key`, or
    zeros) and its own digest filled in: exactly `lay.start` bytes."""
    if len(blocks) != lay.blocks:
        raise ValueError(f"{len(blocks)} block digests for {lay.blocks} blocks")
    text = _fill(lay.text, _BLOCKS_SLOT, "".join(b.hex() for b in blocks).encode())
    prefix = len(text).to_bytes(8, "little")
    if key is not None:
        text = _fill(text, _HMAC_SLOT, _keyed(key, prefix + text))
    return prefix + _fill(text, _SHA_SLOT, hashlib.sha256(prefix + text).hexdigest().encode())


def _fill(text: bytes, slot: bytes, value: bytes) -> bytes:
    at = text.index(slot) + len(slot)
    return text[:at] + value + text[at + len(value):]


def _keyed(key: bytes, zeroed: bytes) -> bytes:
    """HMAC-SHA256 under `key` of the SHA-256 of the length and header with both digests as zeros."""
    return hmac.new(key, hashlib.sha256(zeroed).digest(), "sha256").hexdigest().encode()


# reading ----------------------------------------------------------------------------------


def header_length(prefix: bytes, size: int) -> int:
    """N from the first 8 bytes of a file of `size` bytes; refused unless it could be a header."""
    if size < 8 or len(prefix) < 8:
        raise SessionFileError(f"truncated ({size} bytes)")
    n = int.from_bytes(prefix, "little")
    if not 2 <= n <= min(MAX_HEADER, size - 8):
        raise SessionFileError(f"truncated or not safetensors (header length {n}, file {size} bytes)")
    return n


def parse(prefix: bytes, raw: bytes, size: int, key: bytes | None = None) -> tuple[Header, dict[str, Span]]:
    """Verify the header digest, parse the header strictly, check the keyed digest when there is a
    key, and validate every field and the tensors' spans: (header, spans)."""
    if raw.count(_SHA_SLOT) != 1:
        raise SessionFileError(_undigested(raw))
    if hashlib.sha256(prefix + _zeroed(raw, _SHA_SLOT)).hexdigest().encode() != _slot(raw, _SHA_SLOT):
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
        version = {str(v): v for v in READS}.get(meta.get("version"))
        if version is None:
            raise SessionFileError(f"format version {meta.get('version')!r}, this build reads {_reads()}")
        if not KEYS[version] <= set(meta) <= KEYS[version] | OPTIONAL[version]:
            known = KEYS[version] | OPTIONAL[version]
            missing, unknown = sorted(KEYS[version] - set(meta)), sorted(set(meta) - known)[:5]
            raise SessionFileError(f"metadata fields differ (missing {missing}, unknown {unknown})")
        if key is not None:
            _check_key(prefix, raw, meta, version, key)
        start = 8 + len(raw)
        header = _fields(meta, version, start)
        spans = _spans(obj, size - start)
        if version >= 3:
            header = replace(header, **_blocks(meta, start, size - start))
    except SessionFileError:
        raise
    except Exception as e:  # JSON or text that no check foresaw: refused all the same
        raise SessionFileError(f"unreadable header ({type(e).__name__}: {str(e)[:120]})") from None
    return header, spans


def _reads() -> str:
    return " and ".join(str(v) for v in READS)


def _slot(raw: bytes, slot: bytes) -> bytes:
    at = raw.index(slot) + len(slot)
    return raw[at : at + 64]


def _zeroed(raw: bytes, *slots: bytes) -> bytes:
    for slot in slots:
        at = raw.index(slot) + len(slot)
        raw = raw[:at] + ZEROS.encode() + raw[at + 64 :]
    return raw


def _check_key(prefix: bytes, raw: bytes, meta: dict[str, str], version: int, key: bytes) -> None:
    """With a key, only a file whose keyed digest was made with that key is read."""
    if version < 3:
        raise SessionFileError(f"format version {version} has no keyed digest; this store has a key")
    if raw.count(_HMAC_SLOT) != 1 or meta["header_hmac"] == ZEROS:
        raise SessionFileError("written without a key (no keyed digest); this store has a key")
    want = _keyed(key, prefix + _zeroed(raw, _SHA_SLOT, _HMAC_SLOT))
    if not hmac.compare_digest(want, _slot(raw, _HMAC_SLOT)):
        raise SessionFileError("keyed digest mismatch (not written with this store's key)")


def _undigested(raw: bytes) -> str:
    """Why a header without exactly one digest is refused: an older build's file, another format, or damage."""
    try:
        meta = json.loads(raw.decode("utf-8")).get("__metadata__") or {}
        fmt, version = meta.get("format"), meta.get("version")
    except Exception:
        return "unreadable header (no digest, not JSON)"
    if fmt != FORMAT:
        return f"not a shadow session file (format {fmt!r})"
    if version not in {str(v) for v in READS}:
        return f"format version {version!r}, this build reads {_reads()}"
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


def _fields(meta: dict[str, str], version: int, start: int) -> Header:
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
    for key in ("data_sha256", "header_sha256", "header_hmac"):
        if key in meta and not _HEX64.fullmatch(meta[key]):
            raise SessionFileError(f"{key} is not a SHA-256 digest")
    return Header(
        version=version, name=meta["name"], model=meta["model"], weights_hash=meta["weights_hash"], grid=grid,
        arithmetic=meta["arithmetic"], committed=committed, tokens=tokens, last_use=last_use,
        rollbacks=_count(meta, "rollbacks"), ids_reread=_count(meta, "ids_reread"),
        checkpoints=_positions(meta, "checkpoints", grid, 0, committed),
        marks=_positions(meta, "marks", grid, committed, tokens), meta=dict(meta), start=start,
        data_sha256=meta.get("data_sha256", ""), checks=_checks(meta),
    )


def _checks(meta: dict[str, str]) -> dict | None:
    """The optional `checks` field: a JSON object (its meaning is the service's), else None."""
    if "checks" not in meta:
        return None
    try:
        value = json.loads(meta["checks"])
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise SessionFileError(f"checks is {meta['checks'][:40]!r}, not a JSON object")
    return value


def _blocks(meta: dict[str, str], start: int, data_bytes: int) -> dict:
    """A format-3 file's block size and block digests (its spans checked: `data_bytes` is what they
    tile): aligned data, one digest per block."""
    if start % ALIGN:
        raise SessionFileError(f"the data starts at byte {start}, not at a multiple of {ALIGN}")
    block = _count(meta, "block_bytes")
    if block % ALIGN or not MIN_BLOCK <= block <= MAX_BLOCK:
        raise SessionFileError(f"block_bytes {block} is not a multiple of {ALIGN} in [{MIN_BLOCK}, {MAX_BLOCK}]")
    text = meta["blocks_sha256"]
    if not _HEX.fullmatch(text):
        raise SessionFileError("blocks_sha256 is not a list of SHA-256 digests")
    count = -(-data_bytes // block)
    if len(text) != 64 * count:
        raise SessionFileError(f"{len(text) // 64} block digests for {count} blocks of data")
    return {"block_bytes": block, "blocks": tuple(bytes.fromhex(text[i : i + 64]) for i in range(0, len(text), 64))}


def _spans(entries: dict, data_bytes: int) -> dict[str, Span]:
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


def check_identity(meta: dict[str, str] | Header, identity: Identity) -> None:
    """SessionFileError unless the file was written by the same weights, grid and arithmetic."""
    meta = meta.meta if isinstance(meta, Header) else meta
    if meta.get("weights_hash") != identity.weights_hash:
        raise SessionFileError(f"another model (weights {str(meta.get('weights_hash', '?'))[:12]}…)")
    if meta.get("grid") != str(identity.grid):
        raise SessionFileError(f"another grid ({meta.get('grid')}, this reader uses {identity.grid})")
    if meta.get("arithmetic", "") != identity.arithmetic:
        raise SessionFileError(f"other kernels ({meta.get('arithmetic')!r}, this reader computes with {identity.arithmetic!r})")
