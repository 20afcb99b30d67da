"""The grid's reading rules, once: for the live reader and for the replay's model of it.

A session is read in whole chunks of `grid` ids from its committed length; a checkpoint is taken
at each mark its reads reach; a prompt that differs from the ids it holds sends it back to the
newest checkpoint at or below the difference. These rules are written here against two small
protocols: `GridSession` (what they need of a session) and `StateKeeper` (whoever holds the
sessions' states: `core.reader.Reader` with tensors, `offline.modelled.ModelledStore` as counts). The
live service (`server.reading`) and the ledger replay (`offline.engine_replay`) choose a batch's
entries, read a batch in pieces and tell the scheduler through the same functions, so the replay
reads what live reads by construction; only the work differs (a forward live, a modelled cost
replayed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from shadow.core.schedule import Read, ReadScheduler, graphed_batch


class GridSession(Protocol):
    """What the rules need of a session: its name, the ids it holds (`known`), its read position
    (`committed`, a grid multiple), its checkpoints (oldest first, at `checkpoint_positions`) and
    its marks (rising grid lines above `committed` where a checkpoint is still wanted) and its
    `hold` (None, or the id from which what is fed waits out of reading: an output held for its
    re-render)."""

    name: str
    marks: list[int]
    checkpoints: list[Any]
    hold: int | None

    @property
    def committed(self) -> int: ...

    @property
    def known(self) -> int: ...

    @property
    def readable(self) -> int:
        """Ids that may be read now (`known`, or fewer while an output is held out of reading)."""

    @property
    def checkpoint_positions(self) -> list[int]: ...


S = TypeVar("S", bound=GridSession)


class StateKeeper(Protocol):
    """Whoever holds the sessions' states: the grid, how many checkpoints a session keeps, and
    the two things done to a state."""

    grid: int
    max_checkpoints: int

    def take_checkpoint(self, session: Any) -> Any:
        """A checkpoint of the session's state at its committed length (not yet kept)."""

    def return_to(self, session: Any, checkpoint: Any | None) -> None:
        """The session's state as it was at `checkpoint` (None: a new, empty state)."""

    def line_passed(self, session: Any) -> None:
        """The session's reads stopped at a grid line (its committed length): the prefix cache's turn."""


@dataclass(frozen=True)
class Feed:
    """What feeding a prompt did: the first id that differed from what was known, and where reading resumes."""

    first_diff: int | None
    rolled_back_to: int | None
    reread: int
    cached: int = 0  # the grid line it started at from the prefix cache (0: none)


# a session's state ------------------------------------------------------------------------

def feed_prompt(keeper: StateKeeper, session: GridSession, same: int, length: int) -> Feed:
    """A turn's prompt of `length` ids whose first `same` are the session's. Where it differs from
    the ids held (`same` below `known`), go back to the newest checkpoint at or below `same` (or
    to the start) and drop the marks above it; mark a checkpoint at the last grid line at or
    below the prompt's end. The caller then makes the prompt the session's ids: those past the
    committed length wait to be read."""
    feed = Feed(None, None, 0)
    if same < session.known:
        feed = Feed(same, None, 0)
        if same < session.committed:
            feed = _roll_back(keeper, session, same)
        session.marks = [m for m in session.marks if m <= same]
    mark(keeper, session, length // keeper.grid * keeper.grid)
    return feed


def _roll_back(keeper: StateKeeper, session: GridSession, first_diff: int) -> Feed:
    kept = [c for c, at in zip(session.checkpoints, session.checkpoint_positions) if at <= first_diff]
    old = session.committed
    keeper.return_to(session, kept[-1] if kept else None)
    session.checkpoints = kept
    return Feed(first_diff, session.committed, old - session.committed)


def mark(keeper: StateKeeper, session: GridSession, line: int) -> None:
    """Want a checkpoint at grid line `line`: taken now if the session sits there, else when its
    reads reach it (`chunks_read`); nothing at 0, or where one is wanted or taken already."""
    if line <= 0 or line in session.marks or line in session.checkpoint_positions:
        return
    if line == session.committed:
        checkpoint(keeper, session)
    elif line > session.committed:
        session.marks = sorted([*session.marks, line])


def checkpoint(keeper: StateKeeper, session: GridSession) -> None:
    """A checkpoint at the committed length kept, the oldest past `max_checkpoints` let go."""
    session.checkpoints.append(keeper.take_checkpoint(session))
    del session.checkpoints[: -keeper.max_checkpoints]


def chunks_read(keeper: StateKeeper, session: GridSession) -> None:
    """After the session's chunks were read (one, or a batch's run of them): the checkpoint at
    its next mark, if the reads reached it; then the line offered to the prefix cache."""
    if session.marks and session.marks[0] == session.committed:
        session.marks.pop(0)
        checkpoint(keeper, session)
    keeper.line_passed(session)


def reread_without_hold(session: GridSession, same: int, grid: int) -> int:
    """Ids a reader that had read the session's held output as it came would read again once a
    prompt keeping only its first `same` ids came: its whole chunks past the newest checkpoint at
    or below `same` (none when `same` reaches past them)."""
    read = session.known // grid * grid
    if same >= read:
        return 0
    return read - max((p for p in session.checkpoint_positions if p <= same), default=0)


def run_limit(session: GridSession, grid: int) -> int:
    """Whole chunks one run of a batch may read of `session` now: up to its ids' last whole chunk
    and its next mark (a checkpoint is taken between two chunks, never inside a forward)."""
    end = session.readable
    if session.marks:
        end = min(end, session.marks[0])
    return max(0, (end - session.committed) // grid)


# batches ----------------------------------------------------------------------------------

def entry_depths(batch: Sequence[GridSession], grid: int) -> list[tuple[str, int]]:
    """(session, read position) of each entry of a batch: a run's k-th entry k chunks on."""
    taken: dict[str, int] = {}
    out = []
    for s in batch:
        k = taken.get(s.name, 0)
        taken[s.name] = k + 1
        out.append((s.name, s.committed + k * grid))
    return out


def batch_now(read: Read, first: S | None, find: Callable[[str], S | None], grid: int,
              stop_line: Callable[[str], int | None] = lambda name: None) -> tuple[Read, list[S]]:
    """A batched read as it can be made now: (the read, its entries still readable, in its order).
    The first entry is `first` (the read's session as the caller holds it), the others' sessions
    are `find(name)` (None: not resident). Each entry is its session's next chunk after the
    entries of it before (a run), within `run_limit` and short of `stop_line(name)` (a standing
    question's line; None: none); none if the first cannot be read; cut to a graphed size. The
    read names only the entries taken."""
    out: list[S] = []
    taken: dict[str, int] = {}
    for n, (name, depth) in enumerate(((read.session, read.depth), *read.others)):
        s = first if n == 0 else find(name)
        k = taken.get(name, 0)
        line = stop_line(name)
        if s is None or s.committed + k * grid != depth or k >= run_limit(s, grid) \
                or (line is not None and depth + grid > line) or (k and out[-1] is not s):
            if not out:
                break
            continue
        taken[name] = k + 1
        out.append(s)
    out = out[: graphed_batch(len(out))]
    if len(out) - 1 != len(read.others):
        read = dataclasses.replace(read, others=tuple(entry_depths(out, grid)[1:]))
    return read, out


def in_pieces(read: Read, batch_s: float) -> bool:
    """Whether a read is a batch of the share estimated past `batch_s`: read a piece at a time,
    between rounds, rather than at once."""
    return read.window == "share" and bool(read.others) and read.estimate_s is not None \
        and read.estimate_s > batch_s + 1e-9


def pieces_now(batch_s: float, per_piece_s: float | None, left: int) -> int:
    """Pieces of a batched read under way to run in this round, of the `left` to run: one in the
    round it begins (`per_piece_s` None: none ran yet), then as many as fit `batch_s` at the
    seconds a piece took so far (at least one; all, where pieces take no time)."""
    if per_piece_s is None:
        return min(1, left)
    if per_piece_s <= 0:
        return left
    return min(left, max(1, int(batch_s / per_piece_s)))


# the scheduler --------------------------------------------------------------------------------

def tell(sched: ReadScheduler, name: str, session: GridSession | None, now: float) -> bool:
    """Tell the scheduler a session's true state: its read position, ids that may be read, next
    mark and whether what is fed to it now is held out of reading (its stream brings no chunks: a
    batch does not wait for them) while it is resident (`session`), else that it is not (a session
    on disk waits for its next turn). Returns whether the scheduler had not known the session
    before."""
    told = sched.sessions.get(name)
    if session is not None:
        sched.update(name, session.committed, session.readable, now, mark=session.marks[0] if session.marks else None,
                     held=session.hold is not None)
    elif told is not None and told.resident:
        sched.update(name, told.committed, told.known, now, resident=False, held=told.held)
    return told is None
