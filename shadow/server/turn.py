"""One served turn's record, from the request's first byte to its end: what the read scheduler
decides by (`core.turns.Turn`: its session, its first token), what the service fed the shadow of
it, what its voice used, what the engine showed and what waits for the device (proxy mode), and
what the status lines need of the engine's load. It lives in the one `TurnTable` the scheduler,
the service and the HTTP side share; it is changed under the service's lock.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from shadow.core.turns import Turn
from shadow.engines.reply import Reply
from shadow.voice.voice import VoiceBudget


@dataclass
class ServedTurn(Turn):
    requested: str | None = None  # the session name the request gave (None: found by prefix, or new)
    reference: str | None = None  # the standing question's reference label, when the request sent one
    embedded: bool = False  # the embedded generator's turn: its rounds hold the device
    # what the shadow was fed of it
    prompt_fed: bool = False
    prompt_len: int = 0
    output_len: int = 0  # output ids fed after the prompt
    share_used: float = 0.0  # seconds read in the share between this turn's rounds
    engine_wait_s: float = 0.0  # seconds its reads and phrases first waited for the engine's round in flight
    voice: VoiceBudget = field(default_factory=VoiceBudget)
    phrases: deque = field(default_factory=deque)  # phrase requests waiting for the turn's rounds (embedded)
    rounds_over: bool = False  # its rounds are over (embedded): a phrase asked for now waits for none
    phrase: tuple | None = None  # (steps, request): the phrase being written between its rounds, a step a round
    # the engine's load (status lines): when the engine got it, the ids it must read, its first piece
    sent: float | None = None
    new_tokens: int | None = None
    engine_first: float | None = None
    alone: bool = True  # nothing else was prefilling when it was sent (its rate is the engine's)
    answered: bool = False  # the engine's response is over
    # proxy mode: what the engine showed, and what the shadow has been fed or still waits for
    reply: Reply = field(default_factory=Reply)
    fed_prompt: list[int] | None = None
    prompt_due: list[int] | None = None  # known, not yet fed (the device was busy)
    # of its prompt's ids, those the session held just before the prompt was fed (what the engine's
    # prefix cache holds for it): the status lines count the rest, even once the session holds them
    engine_held: int | None = None
    fed_output: int = 0
    held: list[int] = field(default_factory=list)  # output ids not fed yet
    # set while no hand-over to the shadow is in flight beside the stream (its end waits for one)
    feed_idle: threading.Event = field(default_factory=lambda: _set(threading.Event()))
    notes: list[str] = field(default_factory=list)  # what happened to the request on its way
    # its end
    cancelled: bool = False  # the client went away: the embedded generator stops at its next step
    finishing: bool = False  # its end is under way (the proxy checks and ends it once)
    overdue_logged: bool = False  # the watchdog has said it is in flight past the engine's timeout


def _set(event: threading.Event) -> threading.Event:
    event.set()
    return event
