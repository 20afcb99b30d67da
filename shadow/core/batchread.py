"""A batched read under way, a piece of the forward at a time (`Reader.begin_batch`).

Between two pieces its sessions are half read; the reader keeps it open (`Reader.open`) and
finishes it before anything else touches a session (`Reader.settle`).
"""

from __future__ import annotations

import time
from collections.abc import Generator

import torch

from shadow.model.layout import Layout
from shadow.model.state import ModelState


class BatchRead:
    """A batched read under way (`Reader.begin_batch`), a piece of the forward at a time: `step`
    runs pieces, device synchronised, and counts their seconds (`seconds`, with its setup, whoever
    ran them: a `Reader.settle` too); `over` once every piece ran and the reader took its
    checkpoints. `reader` is the `core.reader.Reader` that began it, `sessions` its entries'
    sessions in batch order."""

    def __init__(self, reader, sessions: list, layout: Layout,
                 steps: Generator[None, None, object], pieces: int):
        self.reader, self.sessions, self.layout, self._steps = reader, sessions, layout, steps
        self.pieces = pieces  # pieces in all (`step` runs them in order)
        self.ran = 0
        self.seconds = 0.0
        self.over = False

    @property
    def chunks(self) -> int:
        return len(self.sessions)

    def step(self, pieces: int = 1) -> bool:
        """Run up to `pieces` more pieces (at least one), device synchronised before and after; True
        once the read is over."""
        if self.over:
            return True
        self.reader.synchronize()
        start = time.perf_counter()
        try:
            for _ in range(max(1, pieces)):
                try:
                    next(self._steps)
                except StopIteration:
                    self.over = True
                    break
                self.ran += 1
        except BaseException:
            self.over = True  # a failed forward leaves nothing open
            if self.reader.open is self:
                self.reader.open = None
            raise
        self.reader.synchronize()
        self.seconds += time.perf_counter() - start
        if self.over:
            self.ran = self.pieces
            self.reader._batch_done(self)
        return self.over

    def finish(self) -> None:
        """Run every piece left."""
        while not self.step(self.pieces):
            pass


def at_once(forward_batch, ids: torch.Tensor, states: list[ModelState]) -> Generator[None, None, torch.Tensor]:
    """A forward with no pieces as steps: all of it at the first."""
    return forward_batch(ids, states)
    yield  # noqa: unreachable - makes this a generator
