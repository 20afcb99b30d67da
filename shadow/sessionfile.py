"""One session in one safetensors file: its ids (pending tail included), KV rows up to the
committed length, GDN conv and recurrent state, checkpoints, and metadata.

Writes are atomic: a temporary file in the same folder, fsync, rename, fsync of the folder, so a
killed writer leaves the old file or the new one. Every tensor carries a CRC-32 in the metadata;
a file that is torn, truncated, corrupt, of another format version, another model (weights hash)
or another grid is refused with the reason, never served.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shadow.reader import Session
from shadow.state import AttentionState, DeltaSnapshot, ModelState

FORMAT = "shadow-session"
VERSION = 1
SUFFIX = ".safetensors"


class SessionFileError(Exception):
    """A session file that must not be served; the message says why."""


@dataclass(frozen=True)
class Identity:
    """What a file must match to be read: the weights, the grid, and the arithmetic (kernel set
    and dtype: a state computed by other kernels would not continue bit for bit)."""

    weights_hash: str
    grid: int
    arithmetic: str = ""


def arithmetic_of(model) -> str:
    """The kernel set (with its revision, if any) and dtype a model computes with, e.g.
    'fla/bfloat16' or 'fla-triton.2/bfloat16'."""
    revision = f".{model.kernels.revision}" if model.kernels.revision else ""
    return f"{model.kernels.name}{revision}/{str(model.dtype).removeprefix('torch.')}"


def session_tensors(session: Session) -> dict[str, torch.Tensor]:
    """Every tensor a file holds, on the CPU, contiguous, each its own copy (a state's GDN tensors
    are views of one arena, and safetensors refuses tensors that share memory)."""
    out = {"ids": torch.tensor(session.ids, dtype=torch.int64)}
    out.update(session.state.tensors())
    for j, snap in enumerate(session.checkpoints):
        for i, (conv, rec) in enumerate(zip(snap.conv, snap.recurrent)):
            out[f"checkpoints.{j}.{i}.conv"] = conv
            out[f"checkpoints.{j}.{i}.recurrent"] = rec
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in out.items()}


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.view(torch.uint8).numpy().data) if t.numel() else 0


def write_session(path: Path, session: Session, identity: Identity, last_use: float, model: str = "") -> int:
    """Write atomically; returns the bytes written."""
    tensors = session_tensors(session)
    meta = {
        "format": FORMAT, "version": str(VERSION), "name": session.name, "model": model,
        "weights_hash": identity.weights_hash, "grid": str(identity.grid), "arithmetic": identity.arithmetic,
        "committed": str(session.committed), "tokens": str(len(session.ids)),
        "last_use": repr(last_use), "rollbacks": str(session.rollbacks), "ids_reread": str(session.ids_reread),
        "checkpoints": json.dumps([c.position for c in session.checkpoints]),
        "marks": json.dumps(session.marks),
        "crc32": json.dumps({k: _crc(v) for k, v in tensors.items()}),
    }
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, tmp, metadata=meta)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)
    return path.stat().st_size


def read_header(path: Path) -> dict[str, str]:
    """The file's metadata, checked for format and version; SessionFileError when unreadable."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # a torn or truncated header, not safetensors at all
        raise SessionFileError(f"unreadable ({type(e).__name__}: {str(e)[:120]})") from None
    if meta.get("format") != FORMAT:
        raise SessionFileError(f"not a shadow session file (format {meta.get('format')!r})")
    if meta.get("version") != str(VERSION):
        raise SessionFileError(f"format version {meta.get('version')!r}, this build reads {VERSION}")
    return meta


def check_identity(meta: dict[str, str], identity: Identity) -> None:
    if meta.get("weights_hash") != identity.weights_hash:
        raise SessionFileError(f"another model (weights {meta.get('weights_hash', '?')[:12]}…)")
    if meta.get("grid") != str(identity.grid):
        raise SessionFileError(f"another grid ({meta.get('grid')}, this reader uses {identity.grid})")
    if meta.get("arithmetic", "") != identity.arithmetic:
        raise SessionFileError(f"other kernels ({meta.get('arithmetic')!r}, this reader computes with {identity.arithmetic!r})")


def read_session(path: Path, identity: Identity, model_state: ModelState) -> Session:
    """Load a session into `model_state` (a fresh state of the reader's model, on its device).
    Every tensor is checked against its CRC-32 before anything is returned."""
    meta = read_header(path)
    check_identity(meta, identity)
    try:
        crcs = json.loads(meta["crc32"])
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        positions = json.loads(meta["checkpoints"])
        marks = json.loads(meta["marks"])
        committed = int(meta["committed"])
    except SessionFileError:
        raise
    except Exception as e:
        raise SessionFileError(f"unreadable ({type(e).__name__}: {str(e)[:120]})") from None
    if set(crcs) != set(tensors):
        raise SessionFileError("tensor list does not match its checksums")
    for name, t in tensors.items():
        if _crc(t) != crcs[name]:
            raise SessionFileError(f"checksum mismatch in {name}")
    return _session_from(meta["name"], tensors, positions, marks, committed, meta, model_state)


def _session_from(name, tensors, positions, marks, committed, meta, state: ModelState) -> Session:
    expected = set(state.tensors()) | {"ids"}
    names = {k for k in tensors if not k.startswith("checkpoints.")}
    if names != expected:
        raise SessionFileError("tensors do not fit this model")
    device = state.device
    for i, layer in enumerate(state.layers):
        if isinstance(layer, AttentionState):
            k, v = tensors[f"layers.{i}.k"], tensors[f"layers.{i}.v"]
            if k.shape[1] != committed or k.shape[0] != layer.k.shape[0] or k.dtype != layer.k.dtype:
                raise SessionFileError(f"layers.{i}.k has shape {tuple(k.shape)}, expected {committed} rows")
            layer.write(0, k.to(device, non_blocking=True), v.to(device, non_blocking=True))
        else:
            for part in ("conv", "recurrent"):
                src, dst = tensors[f"layers.{i}.{part}"], getattr(layer, part)
                if src.shape != dst.shape or src.dtype != dst.dtype:
                    raise SessionFileError(f"layers.{i}.{part} does not fit this model")
                dst.copy_(src, non_blocking=True)
    state.length = committed
    checkpoints = [
        DeltaSnapshot(p, _stacked(tensors, f"checkpoints.{j}", "conv", state.arena.conv),
                      _stacked(tensors, f"checkpoints.{j}", "recurrent", state.arena.recurrent))
        for j, p in enumerate(positions)
    ]
    return Session(
        name=name, state=state, ids=tensors["ids"].tolist(), checkpoints=checkpoints, marks=marks,
        rollbacks=int(meta.get("rollbacks", 0)), ids_reread=int(meta.get("ids_reread", 0)),
    )


def _stacked(tensors: dict[str, torch.Tensor], prefix: str, part: str, like: torch.Tensor) -> torch.Tensor:
    """A checkpoint's per-layer `part` tensors as one tensor shaped and typed like `like` (the
    state's arena tensor), on its device."""
    layers = [tensors.get(f"{prefix}.{i}.{part}") for i in range(like.shape[0])]
    if any(t is None or t.shape != like.shape[1:] or t.dtype != like.dtype for t in layers):
        raise SessionFileError(f"{prefix} does not fit this model")
    return torch.stack(layers).to(like.device)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
