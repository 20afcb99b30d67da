"""The turns in flight: one record a request, from its first byte to its end.

`TurnTable` is the one table of them. The read scheduler (`schedule.ReadScheduler`) keeps it and
writes the two facts it decides by (`Turn.session` once the turn's session is known, and
`Turn.first_token`); whoever serves the turns (the live service, the replay) adds its own record
before it tells the scheduler a turn started, and reads the same record everywhere else. Pure
bookkeeping: no tensors, no threads; a live caller holds its one lock around every call.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass


@dataclass
class Turn:
    """One request. `session` and `first_token` are the scheduler's to write (its `turn_started` /
    `turn_session` and `first_token`); a server keeps more about a turn on a subclass."""

    id: Hashable
    started: float
    session: str | None = None  # the session it is read into, once known
    first_token: float | None = None  # when its first output token came: it decodes from then

    @property
    def decoding(self) -> bool:
        return self.first_token is not None


class TurnTable:
    """The turns in flight by id."""

    def __init__(self) -> None:
        self._turns: dict[Hashable, Turn] = {}

    def add(self, turn: Turn) -> Turn:
        if turn.id in self._turns:
            raise ValueError(f"turn {turn.id!r} is in flight already")
        self._turns[turn.id] = turn
        return turn

    def get(self, turn_id: Hashable) -> Turn | None:
        return self._turns.get(turn_id)

    def __getitem__(self, turn_id: Hashable) -> Turn:
        return self._turns[turn_id]

    def pop(self, turn_id: Hashable) -> Turn:
        return self._turns.pop(turn_id)

    def __contains__(self, turn_id: object) -> bool:
        return turn_id in self._turns

    def __len__(self) -> int:
        return len(self._turns)

    def __bool__(self) -> bool:
        return bool(self._turns)

    def __iter__(self) -> Iterator[Turn]:
        return iter(list(self._turns.values()))
