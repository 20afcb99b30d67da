"""Which of a batched forward's entries belong to which session.

A batched forward reads B entries of T rows each, stacked. An entry is one chunk of one session;
a session may hold several consecutive entries (its next chunks, in order), which its GDN layers
must read as one sequence: the second starts from the state the first leaves. A layout names the
runs: `runs[j]` consecutive entries of session j, in batch order.

Slots: a batched forward keeps one GDN state slot per entry. A run's state lives in the slot of
its first entry (its *home*); the slots of the entries that continue a run are spare. Kernels
that take a whole batch in one call read the layout as device tensors (`LayoutTensors`), so one
CUDA graph per batch size serves every layout: only the tensors' values change between reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class Layout:
    """Runs of consecutive entries, one a session, in batch order (every run at least 1)."""

    runs: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.runs or any(n < 1 for n in self.runs):
            raise ValueError(f"a layout's runs are positive counts of entries, got {self.runs}")

    @classmethod
    def alone(cls, b: int) -> Layout:
        """Every entry its own session."""
        return cls((1,) * b)

    @classmethod
    def of(cls, items: Sequence[object]) -> Layout:
        """The runs of identical objects (by identity) in `items`; an object may appear only in
        one run (a session's entries are consecutive)."""
        runs: list[int] = []
        seen: set[int] = set()
        last = None
        for item in items:
            if runs and item is last:
                runs[-1] += 1
                continue
            if id(item) in seen:
                raise ValueError("a session's entries in a batch must be consecutive")
            seen.add(id(item))
            runs.append(1)
            last = item
        return cls(tuple(runs))

    @property
    def entries(self) -> int:
        return sum(self.runs)

    @property
    def mixed(self) -> bool:
        """Whether some session holds more than one entry."""
        return any(n > 1 for n in self.runs)

    @cached_property
    def home(self) -> tuple[int, ...]:
        """For each entry, the slot its session's state lives in (its run's first entry)."""
        out: list[int] = []
        for first, n in self.firsts_and_runs:
            out += [first] * n
        return tuple(out)

    @cached_property
    def firsts_and_runs(self) -> tuple[tuple[int, int], ...]:
        """(first entry, entries) of each run."""
        out, first = [], 0
        for n in self.runs:
            out.append((first, n))
            first += n
        return tuple(out)

    def offsets(self, t: int) -> list[int]:
        """Each entry's row offset inside its session's read: 0, t, 2t ... along a run."""
        return [k * t for n in self.runs for k in range(n)]


class LayoutTensors:
    """A layout of `b` entries as fixed-shape device tensors (filled in place by `set`), for
    kernels that take the whole batch in one call and for CUDA graphs that replay them:

    - `cu_seqlens` [b+1] (int64): row bounds of b sequences over the b*t stacked rows: each run
      one sequence, then empty ones up to b;
    - `chunk_offsets` [b+1] (int64): the same bounds in chunks of `block` rows;
    - `start_slot` [b]: the slot sequence j starts from and ends in (a run's home; an empty
      sequence, one of the spare slots, so that every slot is some sequence's, once);
    - `last_entry` [b]: sequence j's last entry (an empty one: its slot's own entry);
    - `continues` [b, 1, 1] (0 or 1): whether entry e continues the entry before it."""

    def __init__(self, b: int, t: int, device: torch.device, block: int = 64):
        self.b, self.t, self.block = b, t, block
        self.layout = Layout.alone(b)
        self._packed = torch.zeros(5 * b + 2, dtype=torch.long, device=device)  # one copy a read
        views = self._packed.split([b + 1, b + 1, b, b, b])
        self.cu_seqlens, self.chunk_offsets, self.start_slot, self.last_entry = views[:4]
        self.continues = views[4].view(b, 1, 1)  # 0 or 1
        self.set(self.layout)

    def set(self, layout: Layout) -> None:
        """Take `layout`'s values (same entry count), copied without waiting for the device."""
        if layout.entries != self.b:
            raise ValueError(f"a layout of {layout.entries} entries for a batch of {self.b}")
        self.layout = layout
        values = layout_values(layout, self.t, self.block)
        source = torch.tensor([x for name in FIELDS for x in values[name]], dtype=torch.long)
        if self._packed.device.type == "cuda":
            source = source.pin_memory()
        self._packed.copy_(source, non_blocking=True)


FIELDS = ("cu_seqlens", "chunk_offsets", "start_slot", "last_entry", "continues")


def layout_values(layout: Layout, t: int, block: int = 64) -> dict[str, list]:
    """`LayoutTensors`' values for `layout` with `t` rows an entry (host lists)."""
    b = layout.entries
    firsts = [first for first, _ in layout.firsts_and_runs]
    spare = [e for e in range(b) if e not in set(firsts)]
    bounds = [0]
    for n in layout.runs:
        bounds.append(bounds[-1] + n * t)
    bounds += [bounds[-1]] * (b - len(layout.runs))
    last = [first + n - 1 for first, n in layout.firsts_and_runs] + spare
    return {
        "cu_seqlens": bounds,
        "chunk_offsets": [x // block for x in bounds],
        "start_slot": firsts + spare,
        "last_entry": last,
        "continues": [int(e not in set(firsts)) for e in range(b)],
    }
