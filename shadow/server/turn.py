"""One served turn's record, from the request's first byte to its end.

Every turn has what the read scheduler decides by (`core.turns.Turn`: its session, its first
token), where it is in its life (`Phase`), what the shadow was fed of it (`Fed`), its voice budget
and what the status lines need of the engine's load. What one mode alone needs hangs off it: the
embedded generator's rounds (`Rounds`), or what a proxied engine showed and what of it still waits
for the device (`Shown`). The record lives in the one `TurnTable` the scheduler, the service and
the HTTP side share, and is changed under the service's lock.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from shadow.core.turns import Turn
from shadow.engines.reply import Reply
from shadow.voice.voice import VoiceBudget


class Phase(enum.IntEnum):
    """Where a turn is in its life; it only moves forward (`ServedTurn.reach`)."""

    SENT = 1  # begun: the engine (or the embedded generator) is on it
    ANSWERED = 2  # the response is over, whatever the shadow still does with the turn
    ENDING = 3  # its end is under way: checked against the engine and ended once


@dataclass
class Fed:
    """What the shadow was fed of a turn."""

    prompt: bool = False  # its prompt was fed (it is the session's latest unless a newer turn's came)
    prompt_len: int = 0
    output_len: int = 0  # output ids fed after the prompt


@dataclass
class Rounds:
    """The embedded generator's turn: its rounds hold the device, and phrases of the voice asked
    for by its stream are written between them, a step a round."""

    phrases: deque = field(default_factory=deque)  # (steps, request) waiting for a round
    over: bool = False  # its rounds are over: a phrase asked for now waits for none
    phrase: tuple | None = None  # (steps, request): the phrase being written


@dataclass
class Shown:
    """Proxy mode: what the engine showed of the turn (`reply`), what the shadow has been fed of it,
    and what is known but waits for the device (fed when the device is free)."""

    reply: Reply = field(default_factory=Reply)
    fed_prompt: list[int] | None = None
    prompt_due: list[int] | None = None  # known, not fed yet
    output_due: list[int] = field(default_factory=list)  # output ids known, not fed yet
    fed_output: int = 0
    # of its prompt's ids, those the session had read just before the prompt was fed (what the
    # engine's prefix cache holds for it): the status lines count the rest as the engine's work
    engine_cached: int | None = None
    # set while no hand-over to the shadow is in flight beside the stream (the turn's end waits for one)
    feed_idle: threading.Event = field(default_factory=lambda: _set(threading.Event()))

    def due(self) -> bool:
        """Whether anything known waits for the device."""
        return self.prompt_due is not None or bool(self.output_due)


@dataclass
class ServedTurn(Turn):
    requested: str | None = None  # the session name the request gave (None: found by prefix, or new)
    reference: str | None = None  # the standing question's reference label, when the request sent one
    phase: Phase = Phase.SENT
    client_gone: bool = False  # the client went away: the embedded generator stops at its next step
    fed: Fed = field(default_factory=Fed)
    share_used: float = 0.0  # seconds read in the share between this turn's rounds
    engine_wait_s: float = 0.0  # seconds its reads and phrases first waited for the engine's round in flight
    voice: VoiceBudget = field(default_factory=VoiceBudget)
    # the engine's load (status lines): when the engine got it, the ids it must read, its first piece
    sent: float | None = None
    new_tokens: int | None = None
    engine_first: float | None = None
    alone: bool = True  # nothing else was prefilling when it was sent (its rate is the engine's)
    notes: list[str] = field(default_factory=list)  # what happened to the request on its way
    rounds: Rounds | None = None  # embedded mode
    shown: Shown | None = None  # proxy mode
    restoring: Future | None = None  # its session coming back from the host tier or disk since the request came
    hold_output: bool = False  # proxy: its output waits out of reading until the next prompt is predicted
    # the ids its session's shadow held unread when the turn named it (`ShadowService.note_start`;
    # None: not named yet, or a session the store did not hold)
    unread_at_start: int | None = None

    @property
    def embedded(self) -> bool:
        return self.rounds is not None

    @property
    def answered(self) -> bool:
        return self.phase >= Phase.ANSWERED

    def reach(self, phase: Phase) -> bool:
        """Move forward to `phase`; False (and no change) where the turn is there or past it already."""
        if self.phase >= phase:
            return False
        self.phase = phase
        return True


def _set(event: threading.Event) -> threading.Event:
    event.set()
    return event
