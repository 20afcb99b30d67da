"""The host-memory tier: sessions past the device cap kept in host memory, bit for bit.

A session moved out keeps every tensor of its state (KV rows up to its committed length, the GDN
conv and recurrent state) and of its checkpoints as a host copy of the same dtype and shape,
pinned where the model is on a GPU (from a `pinnedpool.PinnedPool` pinned ahead on a thread of its
own where the store has one and it has room, so such a move pins nothing where it begins; else
pinned there), with its ids and counters. Moved
back, the copies are loaded into a fresh state on the model's device: the same bytes, so the
session is the one that left. No format stands between the two: nothing is encoded or hashed.

The tier is bounded by bytes; which copies leave it, and for where, is the store's decision
(`store.SessionStore`). A host copy has the shape of a `Session` the session file writer takes
(`HostState` answers `tensors`, `snapshot_tensors` and `length`), so a copy is written to disk
without going back to the device.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from shadow.core.pinnedpool import PinnedPool
from shadow.core.reader import Session
from shadow.model.state import AttentionState, DeltaSnapshot, ModelState, snapshot_tensors


@dataclass
class HostState:
    """A session state's tensors in host memory, by the names `ModelState.tensors` gives them."""

    tensors_by_name: dict[str, torch.Tensor]
    length: int
    fork_base = None  # never forked: a state in host memory is not read (`ModelState.fork_base`)

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.tensors_by_name

    def snapshot_tensors(self, snaps: list[DeltaSnapshot]) -> dict[str, torch.Tensor]:
        return snapshot_tensors(snaps)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors_by_name.values())


def host_bytes(session: Session) -> int:
    """Bytes a session takes in the host tier: its valid state, checkpoints and ids."""
    return session.state.nbytes() + sum(c.nbytes() for c in session.checkpoints) + 8 * len(session.ids)


def _empty_like(sources: list[torch.Tensor], pin: bool, pool: PinnedPool | None) -> list[torch.Tensor]:
    """Host tensors shaped like `sources`: from `pool` where it holds them all, else allocated here
    (pinned where `pin`)."""
    specs = [(t.shape, t.dtype) for t in sources]
    made = pool.take(specs) if pool is not None else None
    return made if made is not None else [torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)
                                          for shape, dtype in specs]


def _copy(session: Session, pin: bool, pool: PinnedPool | None = None) -> Session:
    """`session`'s host copy, its copies queued on the current stream (whole once it is done); its
    other fields (counters, marks, a held output) as they are."""
    named = session.state.tensors()
    sources = [*named.values()] + [t for c in session.checkpoints for t in (c.conv, c.recurrent)]
    copies = _empty_like(sources, pin, pool)
    for out, source in zip(copies, sources):
        out.copy_(source, non_blocking=pin)
    state = HostState(dict(zip(named, copies)), session.state.length)
    rest = iter(copies[len(named):])
    checkpoints = [DeltaSnapshot(c.position, next(rest), next(rest)) for c in session.checkpoints]
    return replace(session, state=state, ids=list(session.ids), checkpoints=checkpoints, marks=list(session.marks))


def to_host(session: Session) -> Session:
    """A host copy of `session` (its tensors pinned when they are on a GPU), complete when this
    returns; the session itself is left as it was."""
    move = move_to_host(session)
    move.wait()
    return move.copy


@dataclass
class Move:
    """A session on its way to host memory: `copy` is whole once `done()`; until then `session`'s
    device rows are read by the copy and stay where they are. `keep()`: the session stays on the
    device after all (work queued later on the current stream waits for the copy, so nothing writes
    the rows it still reads; the copy is then let go). Without CUDA (`event` None) the copy was made
    whole when the move began."""

    session: Session
    copy: Session
    event: torch.cuda.Event | None = None

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def keep(self) -> None:
        if isinstance(self.event, torch.cuda.Event):
            torch.cuda.current_stream(self.session.state.device).wait_event(self.event)


def move_to_host(session: Session, stream: torch.cuda.Stream | None = None, pool: PinnedPool | None = None) -> Move:
    """Begin copying `session` to host memory (pinned on a GPU: from `pool` where it has the room,
    else pinned here). On a GPU the copies run on `stream` (None: the current stream) after every
    piece of work already queued on the current one, and the move's event is recorded after them:
    the caller's thread does not wait for them, and `pool` page-locks no slab until they are done. On
    the CPU the copy is plain (into `pool`'s memory where given), whole when this returns."""
    device = session.state.device
    if device.type != "cuda":
        return Move(session, _copy(session, pin=False, pool=pool))
    current = torch.cuda.current_stream(device)
    stream = current if stream is None else stream
    stream.wait_stream(current)  # the copy reads the rows as every write queued before it left them
    with pool.quiet() if pool is not None else nullcontext(), torch.cuda.stream(stream):
        copy = _copy(session, pin=True, pool=pool)
        event = torch.cuda.Event()
        event.record(stream)
        if pool is not None:
            pool.beside(event)  # the pool pins nothing until the copy is whole (nor since it lent the memory)
    return Move(session, copy, event)


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
    return replace(copy, state=state, ids=list(copy.ids), checkpoints=checkpoints, marks=list(copy.marks))


class HostTier:
    """Host copies of sessions by name, least recently moved in first, within `cap` bytes. A move in
    flight holds its room and its place in that order (`reserve`) until its copy is `put`."""

    def __init__(self, cap: int):
        self.cap = cap
        self._copies: OrderedDict[str, Session | None] = OrderedDict()  # None: a move in flight
        self._bytes: dict[str, int] = {}
        self._used = 0  # the sum of `_bytes`, kept as copies come and go

    def __contains__(self, name: str) -> bool:
        return self._copies.get(name) is not None

    def __len__(self) -> int:
        return sum(c is not None for c in self._copies.values())

    def names(self) -> list[str]:
        return [n for n, c in self._copies.items() if c is not None]

    def copies(self) -> list[Session]:
        """The copies, least recently moved in first."""
        return [c for c in self._copies.values() if c is not None]

    def used(self) -> int:
        return self._used

    def fits(self, nbytes: int) -> bool:
        """Whether a copy of `nbytes` could be held at all (with every other copy gone)."""
        return nbytes <= self.cap

    def room(self) -> int:
        return self.cap - self.used()

    def oldest(self) -> str | None:
        """The name least recently moved in (a copy, or a move in flight), None where the tier is empty."""
        return next(iter(self._copies), None)

    def reserved(self, name: str) -> bool:
        """Whether `name`'s move into the tier is in flight (its room held, its copy not yet whole)."""
        return name in self._copies and self._copies[name] is None

    def reserve(self, name: str, nbytes: int) -> None:
        """Hold `nbytes` of room for `name`'s move in flight, newest."""
        self.take(name)
        self._copies[name] = None
        self._bytes[name] = nbytes
        self._used += nbytes

    def put(self, copy: Session, nbytes: int) -> None:
        """Hold `copy` (of `nbytes`, `host_bytes`): in its reservation's place, else newest (one of
        the same name is replaced)."""
        if self.reserved(copy.name):
            self._used += nbytes - self._bytes[copy.name]
            self._copies[copy.name] = copy
            self._bytes[copy.name] = nbytes
            return
        self.take(copy.name)
        self._copies[copy.name] = copy
        self._bytes[copy.name] = nbytes
        self._used += nbytes

    def take(self, name: str) -> Session | None:
        """The copy of `name`, out of the tier (None where it holds none; a reservation is let go)."""
        self._used -= self._bytes.pop(name, 0)
        return self._copies.pop(name, None)

    def peek(self, name: str) -> Session | None:
        return self._copies.get(name)

    def nbytes(self, name: str) -> int:
        return self._bytes[name]
