"""The shadow's sessions as the ledger replay models them, without tensors: the ids each holds, its
read position, KV capacity, checkpoints and marks (the reader's rules, `core.driving`, kept on counts), and
whether it is resident, in the host tier, on disk or gone (the store's rules, `core.store.SessionStore`,
through `core.residency`): the same sessions leave memory at the same settles as live, and each
move to or from the host tier, restore, spill and drop costs what the cost table says."""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from shadow.core import driving
from shadow.core.driving import Feed
from shadow.core.reader import MAX_CHECKPOINTS
from shadow.core.residency import Settle, StateSize
from shadow.offline.costs import CostTable


@dataclass
class ModelledSession:
    """One modelled session: ids held (`ids`), read position (`committed`, a grid multiple), KV rows
    its buffers have room for, checkpoint positions (oldest first) and marks (grid lines where a
    checkpoint is still wanted): a `driving.GridSession`."""

    name: str
    ids: int = 0
    committed: int = 0
    capacity: int = 0
    checkpoints: list[int] = field(default_factory=list)
    marks: list[int] = field(default_factory=list)
    prefix: Any = field(default=None, repr=False)  # where it stands in the modelled prefix cache (`prefixcache.Walk`)
    hold: int | None = None  # ids from here on wait out of reading (an output held for its re-render)

    @property
    def known(self) -> int:
        return self.ids

    @property
    def readable(self) -> int:
        return self.ids if self.hold is None else min(self.ids, self.hold)

    @property
    def checkpoint_positions(self) -> list[int]:
        return self.checkpoints


@dataclass
class StoreCounts:
    spills: int = 0
    restores: int = 0
    drops: int = 0
    restore_s: float = 0.0
    spill_s: float = 0.0
    to_host: int = 0
    from_host: int = 0
    host_to_disk: int = 0
    host_s: float = 0.0  # seconds of moves to and from the host tier


class ModelledStore:
    """One shadow's sessions: resident ones in least-recently-used order under `cap` bytes (None: no
    cap), then a host tier of `host_cap` bytes (None or 0: none), with or without a `disk`: a
    session leaves for the fastest tier with room and is dropped only without a disk, as live. It keeps the modelled states for the grid's rules
    (`driving.StateKeeper`)."""

    def __init__(self, grid: int, costs: CostTable, *,
                 size: StateSize | None = None, cap: int | None = None, disk: bool = False,
                 host_cap: int | None = None, max_checkpoints: int = MAX_CHECKPOINTS,
                 draws: random.Random | None = None):
        if cap is not None and size is None:
            raise ValueError("a cap needs the sessions' state sizes")
        self.grid, self.size, self.cap, self.disk, self.costs = grid, size, cap, disk, costs
        self.max_checkpoints = max_checkpoints
        self.draws = draws or random.Random("host")  # a move back's speed, where `costs.host_rates` are given
        self.resident: OrderedDict[str, ModelledSession] = OrderedDict()
        self.files: dict[str, ModelledSession] = {}  # on disk: spilled, or dropped with its ids (committed 0)
        self.host_cap = host_cap or None
        self.host: OrderedDict[str, ModelledSession] = OrderedDict()  # the host tier, least recently moved in first
        self.host_used = 0  # bytes of the copies in the host tier (each counted as it moved in)
        self.counts = StoreCounts()
        self.prefix = None  # the modelled prefix cache (`offline.prefixmodel.PrefixModel`), if any

    # the store --------------------------------------------------------------------------

    def peek(self, name: str) -> ModelledSession | None:
        return self.resident.get(name)

    def find(self, name: str) -> ModelledSession | None:
        """The session wherever the store keeps it (resident, in the host tier, on disk), untouched."""
        return self.resident.get(name) or self.host.get(name) or self.files.get(name)

    def where(self, name: str) -> str | None:
        """The tier that holds `name`: "device", "host", "disk", or None (gone, or never seen)."""
        if name in self.resident:
            return "device"
        return "host" if name in self.host else "disk" if name in self.files else None

    def back_s(self, name: str) -> float:
        """Seconds of bringing `name` back onto the device now, by estimate: a move from the host
        tier (at `host_gib_s`) or a restore from disk (0 when it is resident, gone or new)."""
        if name in self.host:
            return self.costs.host_s(self.host_bytes(self.host[name]))
        f = None if name in self.resident else self.files.get(name)
        return self.costs.restore_s(self._file_bytes(f)) if f is not None else 0.0

    def move_back_s(self, name: str) -> float:
        """Seconds the move back of `name` takes when it is made: as `back_s`, but a move from the
        host tier at a speed drawn from the live run's (`CostTable.host_back_s`)."""
        if name in self.host:
            return self.costs.host_back_s(self.host_bytes(self.host[name]), self.draws)
        return self.back_s(name)

    def holds(self, name: str) -> bool:
        """Resident, in the host tier, or a file of it on disk (a session dropped without a disk is gone)."""
        return name in self.resident or name in self.host or name in self.files

    def get(self, name: str) -> tuple[ModelledSession, float]:
        """(the session, resident and most recently used, seconds its restore took): as it was,
        restored from disk, or new."""
        h, seconds = self.resident.get(name), 0.0
        if h is None and name in self.host:
            h = self.host.pop(name)
            self.host_used -= self.host_bytes(h)  # its size as it moved in: nothing changes it in the tier
            h.capacity = self.size.capacity(h.committed) if self.size else 0  # a fresh state's buffers, as live
            seconds = self.costs.host_back_s(self.host_bytes(h), self.draws)
            self.counts.from_host += 1
            self.counts.host_s += seconds
            self.resident[name] = h
        if h is None:
            f = self.files.pop(name, None)
            if f is not None:
                nbytes = self._file_bytes(f)
                seconds = self.costs.restore_s(nbytes)
                self.counts.restores += 1
                self.counts.restore_s += seconds
                h = ModelledSession(name, f.ids, f.committed, self.size.capacity(f.committed) if self.size else 0,
                         list(f.checkpoints), list(f.marks))
            else:
                h = ModelledSession(name)
            self.resident[name] = h
        self.resident.move_to_end(name)
        return h, seconds

    def settle(self, keep: str | None) -> tuple[list[str], float]:
        """Spill or drop least recently used sessions until the rest fit the cap (`keep` stays):
        (the sessions that left, seconds of device time: none, as live, where each leaves by a copy
        on a stream of its own and its file is written behind; the moves and writes are counted)."""
        if self.cap is None:
            return [], 0.0
        plan = Settle([(n, self.bytes(h)) for n, h in self.resident.items()], self.cap, keep)
        out = []
        for name, nbytes in plan:
            self._evict(self.resident[name])
            out.append(name)
            plan.left(nbytes)
        return out, 0.0

    def _evict(self, h: ModelledSession) -> float:
        del self.resident[h.name]
        moved = self._to_host(h)
        if moved is not None:
            return moved
        return self._leave(h)

    def _to_host(self, h: ModelledSession) -> float | None:
        """Seconds of moving `h` into the host tier, its oldest copies leaving first (as the store
        does: their files were written behind, so they leave for disk at no device time); None
        where there is no tier or `h` alone is past its cap."""
        if self.host_cap is None or self.host_bytes(h) > self.host_cap:
            return None
        seconds, need = 0.0, self.host_bytes(h)
        while self.host_used + need > self.host_cap:
            _, oldest = self.host.popitem(last=False)
            self.host_used -= self.host_bytes(oldest)
            if self.disk:
                self.counts.host_to_disk += 1
            self._leave(oldest)  # its file was written behind, on a thread of its own: no device time
        moved = self.costs.host_s(need)
        self.counts.to_host += 1
        self.counts.host_s += moved
        self.host[h.name] = h
        self.host_used += need
        return seconds + moved

    def _leave(self, h: ModelledSession) -> float:
        """`h` leaves memory: spilled with a disk, dropped without; the seconds of its write."""
        if not self.disk:
            self.counts.drops += 1
            return 0.0
        self.files[h.name] = h
        seconds = self.costs.spill_s(self._file_bytes(h))
        self.counts.spill_s += seconds
        self.counts.spills += 1
        return seconds

    def host_bytes(self, h: ModelledSession) -> int:
        return self.size.host(h.committed, h.ids, len(h.checkpoints)) if self.size else 0

    def bytes(self, h: ModelledSession) -> int:
        return self.size.resident(h.capacity, len(h.checkpoints)) if self.size else 0

    def _file_bytes(self, h: ModelledSession) -> int:
        return self.size.file(h.committed, h.ids, len(h.checkpoints)) if self.size else 0

    # the reader -------------------------------------------------------------------------

    def feed_prompt(self, h: ModelledSession, tokens: int, shared: int) -> Feed:
        """A prompt of `tokens` ids sharing `shared` with what the session's engine holds, fed as the
        reader feeds one (`driving.feed_prompt`)."""
        new = h.ids == 0
        feed = driving.feed_prompt(self, h, min(h.ids, shared, tokens), tokens)
        h.ids = tokens
        if self.prefix is not None:  # reading from the start: from its deepest cached line, as live
            feed = self.prefix.fed(self, h, feed, new)
        return feed

    def take_checkpoint(self, h: ModelledSession) -> int:
        return h.committed

    def return_to(self, h: ModelledSession, checkpoint: int | None) -> None:
        h.committed = 0 if checkpoint is None else checkpoint
        if checkpoint is None:
            h.capacity = 0  # a new state

    def line_passed(self, h: ModelledSession) -> None:
        """The session's reads stopped at a grid line: offered to the modelled prefix cache, if any."""
        if self.prefix is not None:
            self.prefix.offer(h)

    def advance(self, h: ModelledSession) -> None:
        """One chunk read."""
        h.committed += self.grid
        if self.size is not None:
            h.capacity = max(h.capacity, self.size.capacity(h.committed))
        driving.chunks_read(self, h)

    def fork(self, h: ModelledSession, rows: int) -> None:
        """An ask's fork read `rows` rows above the read position (the KV buffers grow for them)."""
        if self.size is not None:
            h.capacity = max(h.capacity, self.size.capacity(h.committed + rows))
