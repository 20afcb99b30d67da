"""What the service's parts share: its settings, the device thread, the state lock, the clock, the
turn table, the counters, the journal and the switch. One object, handed to each part, so no part
takes a long list of the same things and none patches another after it is built."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from shadow.core.turns import TurnTable
from shadow.offline.journal import Journal
from shadow.server.counters import Counters
from shadow.server.device import DeviceThread
from shadow.server.settings import ServeSettings


@dataclass
class Switch:
    """Off, the shadow feeds and reads nothing, and the voice says nothing (A/B runs)."""

    shadow: bool = True
    voice: bool = True


@dataclass
class Shared:
    settings: ServeSettings
    clock: Callable[[], float]
    device: DeviceThread = field(default_factory=DeviceThread)
    lock: threading.Lock = field(default_factory=threading.Lock)  # sessions, turns, counters, the scheduler
    turns: TurnTable = field(default_factory=TurnTable)
    counters: Counters = field(default_factory=Counters)
    switch: Switch = field(default_factory=Switch)
    journal: Journal = None  # type: ignore[assignment]  (made from settings.journal when not given)

    def __post_init__(self) -> None:
        self.switch.shadow = self.switch.voice = self.settings.shadow_on
        if self.journal is None:
            self.journal = Journal(self.settings.journal, self.counters.last_answers)
