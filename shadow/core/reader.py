"""Exact grid reading of sessions: the pending tail, prompt-end checkpoints, rollback and forks.

The contract: a session's state advances only in whole chunks of `grid`
rows at absolute positions k * grid, so after any number of turns, rollbacks and forks it equals
a fresh prefill of the same ids on the same grid, bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from shadow.errors import ShadowInputError
from shadow.core.batchread import BatchRead, at_once
from shadow.core import driving
from shadow.core.driving import Feed
from shadow.core.prefixcache import PrefixCache, Walk
from shadow.model.checkpoint import LoadedModel
from shadow.model.layout import Layout
from shadow.model.qwen35 import Qwen35
from shadow.model.runtime import BATCHES, FORK_SIZES, forward_for, load_model, warm_kernels
from shadow.model.state import DeltaSnapshot, ModelState

T = TypeVar("T")

MAX_CHECKPOINTS = 6


@dataclass
class Session:
    """One session: every id it holds, the state of the committed rows, its checkpoints (a
    `driving.GridSession`)."""

    name: str
    state: ModelState
    ids: list[int] = field(default_factory=list)
    checkpoints: list[DeltaSnapshot] = field(default_factory=list)  # oldest first, positions rising
    marks: list[int] = field(default_factory=list)  # grid lines where a checkpoint is still wanted
    rollbacks: int = 0
    ids_reread: int = 0
    prefix: Walk | None = field(default=None, repr=False)  # where it stands in the reader's prefix cache
    hold: int | None = None  # ids from here on wait out of reading (an output the next prompt re-renders)

    @property
    def committed(self) -> int:
        """C: rows read into the state, always a multiple of the grid; while a fork is open on the
        state, the length it began at (its rows are not read)."""
        base = self.state.fork_base
        return self.state.length if base is None else base

    @property
    def pending(self) -> int:
        """Ids past C, waiting for a whole chunk (or more, if the reader is behind)."""
        return len(self.ids) - self.committed

    @property
    def known(self) -> int:
        """Ids held, read or not."""
        return len(self.ids)

    @property
    def readable(self) -> int:
        """Ids that may be read: all held, or those below `hold`."""
        return len(self.ids) if self.hold is None else min(len(self.ids), self.hold)

    @property
    def checkpoint_positions(self) -> list[int]:
        return [c.position for c in self.checkpoints]


def _not_forked(session: Session) -> None:
    if session.state.fork_base is not None:
        raise ValueError(f"session {session.name!r} has a fork open on its state: it cannot be read until the fork closes")


class Reader:
    """Reads sessions on a fixed grid with one model. Holds no session state of its own."""

    def __init__(
        self, model: Qwen35, grid: int = 512, max_checkpoints: int = MAX_CHECKPOINTS,
        forward: Callable[[torch.Tensor, ModelState], torch.Tensor] | None = None,
    ):
        """`forward` runs the model on a state (default: the model itself; on CUDA a
        `PiecewiseForward`, whose `sizes` are the row counts it has graphs for)."""
        check_grid(grid)
        self.model = model
        self.grid = grid
        self.max_checkpoints = max_checkpoints
        self.forward = forward or model
        self.open: BatchRead | None = None  # a batched read under way (`begin_batch`)
        self.prefix_cache: PrefixCache | None = None  # grid-line states shared by sessions (`core.prefixcache`)

    def new_session(self, name: str) -> Session:
        return Session(name=name, state=self.model.new_state())

    # feeding ---------------------------------------------------------------------------

    def feed_prompt(self, session: Session, ids: Sequence[int], hold_output: bool = False) -> Feed:
        """A turn's whole prompt. Where it differs from the ids known, go back to the newest
        checkpoint at or below the first difference (or to the start); mark a checkpoint at the
        last grid line at or below the prompt's end (`driving.feed_prompt`). `hold_output`: the
        output fed after it waits out of reading (`Session.hold`; asks still see it, from a fork)
        until `hold_past` or `predict` says what the next prompt keeps of it, or that prompt comes."""
        ids = self.check_ids(ids)
        self.settle()
        new = not session.ids
        feed = driving.feed_prompt(self, session, common_prefix(session.ids, ids), len(ids))
        session.ids = list(ids)
        if self.prefix_cache is not None:  # reading from the start: from its deepest cached line
            feed = self.prefix_cache.fed(self, session, feed, new)
        session.hold = len(ids) if hold_output else None
        if feed.rolled_back_to is not None:
            session.rollbacks += 1
            session.ids_reread += feed.reread
        return feed

    def feed_output(self, session: Session, ids: Sequence[int]) -> None:
        """Ids the big model generated after the last prompt; appended as they are."""
        session.ids.extend(self.check_ids(ids))

    def hold_past(self, session: Session, ids: Sequence[int]) -> int:
        """The start of the session's next prompt as the big model's template will render it: the
        session keeps its ids and may read on up to where `ids` differ from them (never below what
        it has read); the rest stays held until that prompt comes. Returns where they differ."""
        same = common_prefix(session.ids, ids)
        session.hold = max(same, session.committed)
        return same

    def predict(self, session: Session, ids: Sequence[int]) -> Feed:
        """The start of the session's next prompt as the big model's template will render it (the
        turn's prompt, its output re-rendered, the next message's opening), taken as its ids
        before that prompt comes, and the hold on its output lifted: fed as a prompt, so ids that
        differ from the output held are replaced without a read (the output was held), and the next
        prompt confirms the prediction (nothing read again) or sends the session back as any
        prompt does."""
        feed = self.feed_prompt(session, ids)
        session.hold = None
        return feed

    def take_checkpoint(self, session: Session) -> DeltaSnapshot:
        """A snapshot of the session's state at its committed length (`driving.StateKeeper`)."""
        return session.state.snapshot()

    def return_to(self, session: Session, checkpoint: DeltaSnapshot | None) -> None:
        """The session's state restored to `checkpoint` (None: a new state)."""
        if checkpoint is not None:
            session.state.restore(checkpoint)
        else:
            session.state = self.model.new_state()

    def line_passed(self, session: Session) -> None:
        """The session's reads stopped at a grid line: offered to the prefix cache, if there is one."""
        if self.prefix_cache is not None:
            self.prefix_cache.offer(session)

    # reading ---------------------------------------------------------------------------

    def advance(
        self, session: Session, max_chunks: int | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> int:
        """Read whole grid chunks from C while ids allow; stop early at max_chunks or when
        should_stop() says so (it is asked before every chunk). Returns the chunks read. A session
        with a fork open on its state is refused (ValueError): nothing else reads it meanwhile."""
        self.settle()
        _not_forked(session)
        done = 0
        while session.committed + self.grid <= session.readable:
            if (max_chunks is not None and done >= max_chunks) or (should_stop and should_stop()):
                break
            start = session.committed
            self.forward(self._ids(session.ids[start : start + self.grid]), session.state)
            done += 1
            driving.chunks_read(self, session)
        return done

    def advance_batch(self, sessions: Sequence[Session]) -> int:
        """B entries in one forward (their rows stacked: `forward_batch`): each entry a whole chunk
        of its session, a session named by consecutive entries read that many chunks on (its
        next chunks, as a run); each session's state comes out as `advance` of its chunks alone
        would leave it, bit for bit (tested at the shapes the kernel sets run). A session appears
        in one run only, and a run ends at or before its next checkpoint line (`run_limit`).
        Returns the chunks read."""
        if len(sessions) <= 1:
            self._check_batch(sessions)
            return self.advance(sessions[0], max_chunks=1) if sessions else 0
        read = self.begin_batch(sessions)
        read.finish()
        return read.chunks

    def begin_batch(self, sessions: Sequence[Session]) -> BatchRead:
        """`advance_batch` begun, to be read a piece at a time (`BatchRead.step`): until it is over
        its sessions are half read. It stays open on the reader: any other read, feed of a prompt,
        fork or prefill finishes it first (`settle`), so nothing ever sees a half-read state;
        ids fed as output meanwhile wait past it (they only append)."""
        if not sessions:
            raise ValueError("a batch needs at least one entry")
        self.settle()
        start = time.perf_counter()
        layout = self._check_batch(sessions)
        ids = []
        for first, n in layout.firsts_and_runs:
            s = sessions[first]
            ids += s.ids[s.committed : s.committed + n * self.grid]
        states = [s.state for s in sessions]
        passes = getattr(self.forward, "passes", None)
        pieces = getattr(self.forward, "pieces", 1) if passes is not None else 1
        if passes is not None:
            steps = passes(self._ids(ids), states)
        else:
            forward_batch = getattr(self.forward, "forward_batch", None) or self.model.forward_batch
            steps = at_once(forward_batch, self._ids(ids), states)
        self.open = BatchRead(self, list(sessions), layout, steps, pieces)
        self.open.seconds = time.perf_counter() - start  # its setup on the host is its time too
        return self.open

    def settle(self) -> None:
        """Finish the batched read under way, if one is (`begin_batch`)."""
        if self.open is not None:
            self.open.finish()

    def _batch_done(self, read: BatchRead) -> None:
        """A batched read is over: its sessions' checkpoints at the lines their runs reached."""
        if self.open is read:
            self.open = None
        for first, _ in read.layout.firsts_and_runs:
            driving.chunks_read(self, read.sessions[first])

    def run_limit(self, session: Session) -> int:
        """Whole chunks one run of a batch may read of `session` now: up to its ids' last whole
        chunk and its next checkpoint line (a checkpoint is taken between two chunks, never inside
        a forward)."""
        return driving.run_limit(session, self.grid)

    def _check_batch(self, sessions: Sequence[Session]) -> Layout | None:
        if not sessions:
            return None
        try:
            layout = Layout.of(sessions)
        except ValueError:
            raise ValueError("a session's entries in a batch must be consecutive") from None
        for first, n in layout.firsts_and_runs:
            s = sessions[first]
            _not_forked(s)
            if s.committed + self.grid > s.readable:
                raise ValueError(f"session {s.name!r} in the batch has no whole chunk to read")
            if n > self.run_limit(s):
                raise ValueError(f"session {s.name!r} has {self.run_limit(s)} chunk(s) to read in one run, not {n}")
        return layout

    def prefill(self, ids: Sequence[int], chunk: int | None = None) -> ModelState:
        """A fresh state of all `ids`, read in chunks of `chunk` rows (default: the grid), the last
        chunk possibly shorter. With the default and len(ids) a grid multiple, this is the state
        the contract compares a session against."""
        ids = self.check_ids(ids)
        self.settle()
        chunk = chunk or self.grid
        state = self.model.new_state()
        for start in range(0, len(ids), chunk):
            self.forward(self._ids(ids[start : start + chunk]), state)
        return state

    def _ids(self, ids: list[int]) -> torch.Tensor:
        """ids as a tensor on the model's device, copied without waiting for the device."""
        tensor = torch.tensor(ids, dtype=torch.long)
        if self.model.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.model.device, non_blocking=True)

    def synchronize(self) -> None:
        """Wait until the device has done what is queued on it (nothing to wait for off a GPU)."""
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    # forks -------------------------------------------------------------------------------

    @contextmanager
    def fork(self, state: ModelState):
        """Run anything on top of `state`; afterwards its GDN state and length are as before, bit for bit.
        Meanwhile `state.fork_base` holds the length it began at (the outermost fork's), so that
        `Session.committed`, read by other threads, never counts the fork's rows."""
        self.settle()
        snap = state.snapshot()
        outer = state.fork_base
        if outer is None:
            state.fork_base = state.length
        try:
            yield state
        finally:
            state.restore(snap)  # the length back to the base before the base is let go
            state.fork_base = outer

    def next_logits(self, session: Session, question: Sequence[int], end: int | None = None) -> torch.Tensor:
        """Float32 logits [vocab] after the pending tail (up to `end`, default all ids) and
        `question`, from a fork. `end` must not be below the committed length."""
        question = self.check_ids(question)
        if not question:
            raise ShadowInputError("the question has no ids")
        end = len(session.ids) if end is None else end
        if not session.committed <= end <= len(session.ids):
            raise ShadowInputError(f"cannot ask at {end}: the session has read {session.committed} of {len(session.ids)} ids")
        tail = session.ids[session.committed : end]
        with self.fork(session.state) as state:
            hidden = self._fork_read(tail + question, state)
            return self.model.logits(hidden[-1:])[0]

    def ask(self, session: Session, question: Sequence[int], choices: Sequence[int], end: int | None = None) -> torch.Tensor:
        """Each choice is one token (a letter); returns their softmax [len(choices)] after the
        question, asked at `end` (default: after every id the session holds)."""
        choices = self.check_ids(choices)
        if not choices:
            raise ShadowInputError("choices are empty")
        if len(set(choices)) != len(choices):
            raise ShadowInputError("choices repeat a token")
        logits = self.next_logits(session, question, end)
        return torch.softmax(logits[torch.tensor(choices, device=logits.device)], dim=-1)

    def decode(
        self, session: Session, prompt: Sequence[int], max_new_tokens: int,
        stop: Sequence[int] = (),
    ) -> list[int]:
        """Greedy decode from a fork over the pending tail and `prompt`; the session is left as it was."""
        return drain(self.decode_steps(session, prompt, max_new_tokens, stop))

    def decode_steps(
        self, session: Session, prompt: Sequence[int], max_new_tokens: int,
        stop: Sequence[int] = (),
    ) -> Generator[None, None, list[int]]:
        """`decode` one forward at a time: the pending tail and `prompt` are read in `fork_pieces`
        (graphed row counts where the forward has them), yielding after each piece and after each
        token but the last, and it returns the ids. Until it is over the fork is open on the
        session's state: nothing else may read or fork the session (closing it early undoes the
        fork too)."""
        ids = session.ids[session.committed :] + self.check_ids(prompt)
        if not ids:
            raise ShadowInputError("nothing to decode from: no pending ids and no prompt")
        out: list[int] = []
        with self.fork(session.state) as state:
            lo = 0
            for size in self.fork_pieces(len(ids)):
                if lo:
                    yield
                hidden = self.forward(self._ids(ids[lo : lo + size]), state)
                lo += size
            while len(out) < max_new_tokens:
                yield
                token = int(self.model.logits(hidden[-1:])[0].argmax())
                out.append(token)
                if token in stop or len(out) == max_new_tokens:
                    break
                hidden = self.forward(self._ids([token]), state)
        return out

    def fork_pieces(self, n: int) -> list[int]:
        """The row counts in which a fork reads `n` ids without padding: the largest graphed size
        that fits, again and again, and a remainder below every graphed size in one ungraphed
        piece (no graphed sizes: all `n` in one)."""
        sizes = sorted(getattr(self.forward, "sizes", ()), reverse=True)
        pieces = []
        while n > 0:
            size = next((s for s in sizes if s <= n), n)
            pieces.append(size)
            n -= size
        return pieces

    def warm_kernels(self) -> int:
        """The kernels' first-call compiles for every row count the forward has graphs for, at any
        depth, done now (`runtime.warm_kernels`: on a GPU only); the launches it made."""
        return warm_kernels(self.model, getattr(self.forward, "sizes", ()))

    def fork_cover(self) -> int:
        """Ids whose `fork_pieces` are every graphed size once (what warms all of them up)."""
        return sum(set(getattr(self.forward, "sizes", ())))

    def _fork_read(self, ids: list[int], state: ModelState) -> torch.Tensor:
        """Hidden rows of `ids` read on top of `state` inside a fork. With a graphed forward, in
        grid-sized pieces, the last one padded at its end to a graphed size (only the last row's
        logits are used: causal rows never see the padding after them)."""
        sizes = sorted(getattr(self.forward, "sizes", ()))
        if not sizes:
            return self.forward(self._ids(ids), state)
        hidden = []
        for lo in range(0, len(ids), self.grid):
            piece = ids[lo : lo + self.grid]
            fit = next((s for s in sizes if s >= len(piece)), len(piece))
            hidden.append(self.forward(self._ids(piece + [0] * (fit - len(piece))), state)[: len(piece)])
        return torch.cat(hidden)

    # input checks ------------------------------------------------------------------------

    def check_ids(self, ids: Sequence[int]) -> list[int]:
        out = [int(i) for i in ids]
        vocab = self.model.config.vocab_size
        bad = next((i for i in out if not 0 <= i < vocab), None)
        if bad is not None:
            raise ShadowInputError(f"token id {bad} is outside the vocabulary (0 .. {vocab - 1})")
        return out


def drain(steps: Generator[None, None, T]) -> T:
    """Run a generator of steps to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def open_reader(
    model: str, *, grid: int = 512, device: str = "cpu", dtype=None, kernels: str = "auto",
    seed: int = 0, graphs: bool = True,
) -> tuple[LoadedModel, Reader]:
    """A loaded model and a Reader on it: on CUDA the forward is piecewise-graphed for the grid
    and the fork sizes (`runtime.forward_for`); on the CPU it is the plain forward."""
    check_grid(grid)
    loaded = load_model(model, dtype=dtype, device=device, kernels=kernels, seed=seed)
    return loaded, reader_for(loaded, grid, graphs)


def reader_for(loaded: LoadedModel, grid: int, graphs: bool = True) -> Reader:
    """A Reader on `loaded` for `grid`, graphed for the grid and the fork sizes on a GPU."""
    check_grid(grid)
    return Reader(loaded.model, grid, forward=forward_for(loaded.model, {grid, *FORK_SIZES}, graphs, BATCHES))


def check_grid(grid: int) -> int:
    if not isinstance(grid, int) or grid <= 0 or grid % 64:
        raise ShadowInputError(f"grid must be a positive multiple of 64, got {grid}")
    return grid


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix: a binary search over slice comparisons (each done in
    C), so long sessions compare fast."""
    a, b = list(a), list(b)
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
