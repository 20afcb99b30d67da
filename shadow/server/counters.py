"""The live service's counters: one plain object its parts add to (under the service's lock) and
`status` shows; the bookkeeping time of the rounds (`RoundTimes`), and the streams' long gaps
(`gaps.LongGaps`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shadow.server.gaps import LongGaps
from shadow.server.timings import ROUND_SECONDS, Histogram


PREDICTION_COUNTS = ("made", "confirmed", "missed", "skipped", "ids_not_read_twice", "holds_released")
TURN_START_STATES = ("fresh", "behind", "new")


@dataclass
class Counters:
    requests: int = 0
    chunks_idle: int = 0
    chunks_share: int = 0
    share_s: float = 0.0  # seconds of reading charged to shares (inside the engine's decodes; `--share-charge`)
    share_read_s: float = 0.0  # the share's reads' own device-synchronised seconds
    voice_s: float = 0.0  # seconds of voice phrases charged to turns' voice budgets
    idle_s: float = 0.0  # seconds read in the idle window
    ask_s: float = 0.0  # seconds read for asks
    chunks_ask: int = 0
    batched_reads: dict = field(default_factory=lambda: {"idle": 0, "share": 0})  # reads of several chunks, by window
    read_pieces: int = 0  # slices of a batched read in the share read between two rounds (`--batch-read-ms`)
    rollbacks: int = 0  # prompts that went back to a checkpoint (or the start), every session
    ids_reread: int = 0  # ids those rollbacks read again
    # next prompts predicted at a proxied turn's end (`ShadowService.predict`): made, confirmed or
    # missed by the prompt that came, skipped (none, or one that differed from the prompt's rows read),
    # the ids a confirmed one kept from being read twice, and the holds let go (an output past what a
    # fork may read, read as it came)
    predictions: dict = field(default_factory=lambda: dict.fromkeys(PREDICTION_COUNTS, 0))
    upstream_errors: dict = field(default_factory=dict)  # kind -> count (proxy mode)
    # turns by what their session's shadow held when they named it (at the request's arrival where it
    # named its session, else when its prompt did): `fresh` under a chunk unread (a held output
    # counted), `behind` a chunk or more, `new` a session the store did not hold
    turn_starts: dict = field(default_factory=lambda: dict.fromkeys(TURN_START_STATES, 0))
    # each turn's prompt and output by their state (idcheck.PART_STATES): verified, unverified,
    # mismatched, not_read
    turn_parts: dict = field(default_factory=lambda: {p: {"verified": 0, "unverified": 0, "mismatched": 0,
                                                          "not_read": 0} for p in ("prompt", "output")})
    status_lines: dict = field(default_factory=dict)  # kind -> lines shown
    voice_said: int = 0
    voice_refused: dict = field(default_factory=dict)  # reason -> phrases written and not said
    max_wait_on_reader_ms: float = 0.0  # the longest a request waited behind a reader chunk
    last_chunk_ms: float = 0.0  # the last read's seconds per chunk (the estimates are the scheduler's)
    asks: int = 0
    standing_answered: int = 0
    standing_replaced: int = 0  # a newer turn came before the reader reached the older point
    unloads: int = 0  # times the model was unloaded after an idle burst (sessions parked on disk)
    idle_errors: int = 0  # the reader's work that failed, an idle round or a settle after an ask (it went on)
    idle_last_error: str | None = None
    last_answers: deque = field(default_factory=lambda: deque(maxlen=20))
    rounds: "RoundTimes" = field(default_factory=lambda: RoundTimes())
    gaps: LongGaps = field(default_factory=LongGaps)  # the streams' long gaps, placed and taken apart


class RoundTimes:
    """What the shadow's own bookkeeping costs between two rounds of the engine (or two streamed
    deltas): the seconds of each of the last `keep` rounds, not counting the chunks read and the
    phrases written (those are charged to the shares); every round is counted in `seconds` too (a
    histogram, the metrics'). `add` takes no lock but the histogram's."""

    def __init__(self, keep: int = 4096):
        self._last: deque[float] = deque(maxlen=keep)
        self.rounds = 0
        self.seconds = Histogram(ROUND_SECONDS)

    def add(self, seconds: float) -> None:
        self._last.append(max(0.0, seconds))
        self.rounds += 1
        self.seconds.observe(max(0.0, seconds))

    def summary(self) -> dict:
        """p50 and p99 in microseconds over the rounds kept, and the rounds counted."""
        last = sorted(self._last)
        if not last:
            return {"p50": None, "p99": None, "rounds": self.rounds}
        pick = lambda q: round(last[min(len(last) - 1, int(q * len(last)))] * 1e6, 2)  # noqa: E731
        return {"p50": pick(0.5), "p99": pick(0.99), "rounds": self.rounds}
