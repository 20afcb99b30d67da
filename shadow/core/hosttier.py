"""The host-memory tier: sessions past the device cap kept in host memory, bit for bit.

A session moved out keeps every tensor of its state (KV rows up to its committed length, the GDN
conv and recurrent state) and of its checkpoints as a host copy of the same dtype and shape,
pinned where the model is on a GPU (torch's caching host allocator keeps freed pinned blocks for
the next move, so a pin is paid once per size, not per move), with its ids and counters. Moved
back, the copies are loaded into a fresh state on the model's device: the same bytes, so the
session is the one that left. No format stands between the two: nothing is encoded or hashed.

The tier is bounded by bytes; which copies leave it, and for where, is the store's decision
(`store.SessionStore`). A host copy has the shape of a `Session` the session file writer takes
(`HostState` answers `tensors`, `snapshot_tensors` and `length`), so a copy is written to disk
without going back to the device.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from shadow.core.reader import Session
from shadow.model.state import AttentionState, DeltaSnapshot, ModelState, snapshot_tensors


@dataclass
class HostState:
    """A session state's tensors in host memory, by the names `ModelState.tensors` gives them."""

    tensors_by_name: dict[str, torch.Tensor]
    length: int

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.tensors_by_name

    def snapshot_tensors(self, snaps: list[DeltaSnapshot]) -> dict[str, torch.Tensor]:
        return snapshot_tensors(snaps)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors_by_name.values())


def host_bytes(session: Session) -> int:
    """Bytes a session takes in the host tier: its valid state, checkpoints and ids."""
    return session.state.nbytes() + sum(c.nbytes() for c in session.checkpoints) + 8 * len(session.ids)


def _to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    out.copy_(t, non_blocking=pin)
    return out


def to_host(session: Session) -> Session:
    """A host copy of `session` (its tensors pinned when they are on a GPU), complete when this
    returns; the session itself is left as it was."""
    device = session.state.device
    pin = device.type == "cuda"
    state = HostState({k: _to_host(v, pin) for k, v in session.state.tensors().items()}, session.state.length)
    checkpoints = [DeltaSnapshot(c.position, _to_host(c.conv, pin), _to_host(c.recurrent, pin))
                   for c in session.checkpoints]
    if pin:
        torch.cuda.current_stream(device).synchronize()  # the copies are done before the device rows may go
    return Session(session.name, state, ids=list(session.ids), checkpoints=checkpoints, marks=list(session.marks),
                   rollbacks=session.rollbacks, ids_reread=session.ids_reread)


def from_host(copy: Session, state: ModelState) -> Session:
    """The session `copy` holds, loaded into `state` (a fresh state of the model, on its device):
    each host tensor copied once, straight into the state's own buffers."""
    host, length = copy.state.tensors(), copy.state.length
    for i, layer in enumerate(state.layers):
        if isinstance(layer, AttentionState):
            layer.reserve(length)
            layer.k[:, :length].copy_(host[f"layers.{i}.k"], non_blocking=True)
            layer.v[:, :length].copy_(host[f"layers.{i}.v"], non_blocking=True)
        else:
            layer.conv.copy_(host[f"layers.{i}.conv"], non_blocking=True)
            layer.recurrent.copy_(host[f"layers.{i}.recurrent"], non_blocking=True)
    state.length = length
    device = state.device
    checkpoints = [DeltaSnapshot(c.position, c.conv.to(device, non_blocking=True),
                                 c.recurrent.to(device, non_blocking=True)) for c in copy.checkpoints]
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return Session(copy.name, state, ids=list(copy.ids), checkpoints=checkpoints, marks=list(copy.marks),
                   rollbacks=copy.rollbacks, ids_reread=copy.ids_reread)


class HostTier:
    """Host copies of sessions by name, least recently moved in first, within `cap` bytes."""

    def __init__(self, cap: int):
        self.cap = cap
        self._copies: OrderedDict[str, Session] = OrderedDict()
        self._bytes: dict[str, int] = {}
        self._used = 0  # the sum of `_bytes`, kept as copies come and go

    def __contains__(self, name: str) -> bool:
        return name in self._copies

    def __len__(self) -> int:
        return len(self._copies)

    def names(self) -> list[str]:
        return list(self._copies)

    def copies(self) -> list[Session]:
        """The copies, least recently moved in first."""
        return list(self._copies.values())

    def used(self) -> int:
        return self._used

    def fits(self, nbytes: int) -> bool:
        """Whether a copy of `nbytes` could be held at all (with every other copy gone)."""
        return nbytes <= self.cap

    def room(self) -> int:
        return self.cap - self.used()

    def oldest(self) -> Session | None:
        return next(iter(self._copies.values()), None)

    def put(self, copy: Session, nbytes: int) -> None:
        """Hold `copy` (of `nbytes`, `host_bytes`), newest; one of the same name is replaced."""
        self.take(copy.name)
        self._copies[copy.name] = copy
        self._bytes[copy.name] = nbytes
        self._used += nbytes

    def take(self, name: str) -> Session | None:
        """The copy of `name`, out of the tier (None where it holds none)."""
        self._used -= self._bytes.pop(name, 0)
        return self._copies.pop(name, None)

    def peek(self, name: str) -> Session | None:
        return self._copies.get(name)

    def nbytes(self, name: str) -> int:
        return self._bytes[name]
