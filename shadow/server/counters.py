"""The live service's counters: one plain object its parts add to (under the service's lock) and
`status` shows."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class Counters:
    requests: int = 0
    chunks_idle: int = 0
    chunks_share: int = 0
    share_s: float = 0.0  # seconds of reading charged to shares (inside the engine's decodes)
    chunks_ask: int = 0
    max_wait_on_reader_ms: float = 0.0  # the longest a request waited behind a reader chunk
    last_chunk_ms: float = 0.0  # the last read's seconds per chunk (the estimates are the scheduler's)
    asks: int = 0
    standing_answered: int = 0
    standing_replaced: int = 0  # a newer turn came before the reader reached the older point
    unloads: int = 0  # times the model was unloaded after an idle burst (sessions parked on disk)
    idle_errors: int = 0  # idle rounds that failed (the reader went on)
    idle_last_error: str | None = None
    last_answers: deque = field(default_factory=lambda: deque(maxlen=20))
