"""The read scheduler: which session the shadow reads next, and how much.

`ReadScheduler` is pure: no tensors, no threads, no I/O, and every method takes `now` (seconds on
the caller's clock). The live service and the ledger replay (`shadow/replay.py`) drive the same
object, so replayed figures describe the code that runs. It is told:

- the sessions' backlogs (`update`: read position, ids known, resident or not), pending asks and
  standing questions (`question`, `answered`);
- the engine's activity (`turn_started`, `first_token`, `turn_ended`, `waiting`), kept in its
  `turns` (`turns.TurnTable`, shared with whoever serves the turns);
- what was read and how long it took (`read_done`), which feeds the per-depth cost estimates
  (`ChunkCosts`; `costs.warm` fills them before any turn);

and answers `next_read(now, between_rounds)`: a `Read` (a session and a number of whole chunks)
or a `Wait` (when to look again). The rule it applies (`BandwidthRule`):

- **Idle window**: no turn in flight and no request waiting: bursts begin at poll ticks (multiples
  of `poll_s`) and last at most `burst_s`; one chunk per `Read`, so the caller asks again before
  every chunk and a request that comes waits at most one chunk. The first chunk of a burst is read
  whatever its estimate (a chunk longer than a burst is still read, one a burst), so one slow
  chunk never stops reading.
- **Share**: while the engine decodes, between two of its rounds (`between_rounds=True`), the
  reader may use `share` of the time since the first token of the engine's current decode
  stretch (from a first token while no other turn decoded, to the moment no turn decodes), less
  what it used, in slices of at most `slice_chunks` whole chunks (one by default, so no gap
  between two rounds is longer than one chunk) whose estimated costs fit `slice_s`. One budget
  for the engine, however many turns it decodes at once. A session whose next chunk is estimated
  above `slice_s` is not read inside a turn; with no estimate at all the share reads nothing
  (nothing measures inside a stream).

`changes` counts every change that can move a decision (a session's whole chunks, residency or
rank, a turn event, a question, a read, the requests waiting); a `Wait(until)` answered between
rounds stays the answer while `changes` is the same and the clock is before `until`, so a caller
between every two rounds may skip asking (O(1) a round: `between_rounds_due`).

**Batches** (`BandwidthRule.batch` > 1; off by default): a one-chunk `Read` may name more chunks
(`others`), all read in one forward (`Reader.advance_batch`), in batches of 2, 4, 8 ... entries,
up to `batch` (the sizes a reader has CUDA graphs for). They are taken chunk by chunk in rank
order: the first session's next whole chunks (a run, read as one sequence), then the next
session's, and so on, a session's run ending at its next checkpoint line (`update(mark=...)`: a
checkpoint is taken between two chunks, never inside a forward). In the idle window a batch grows
while its estimated seconds stay within `batch_s` (the first chunk is read whatever its cost; a
request that comes waits for one read), and in the share while they stay within `batch_s` and the
slice: the budget then pays for the whole batch before it is read (a share slice holds one batched
read, at most `batch_s`, instead of one chunk). With `batch_read_s` above `batch_s`, a batched read
in the share may take up to `batch_read_s` in all: its caller reads it in pieces between rounds,
each round's about `batch_s` (no other read begins until it is done), so a batch of 8 at depth
costs the stream no longer a gap than one chunk. A batch's cost is estimated per batch size
(`batch_costs`, warmed at load by `warm_batch` and learned from its reads) at its deepest entry; a
size never measured is estimated as that many single chunks.

**Waiting for a fuller batch** (`batch_wait_s` > 0; off by default): a batch's chunks cost less
each the more there are, and when the share is the limit every millisecond should buy the most
tokens. So while the share is busy (its reads over the last `busy_window_s` used at least
`batch_busy` of the share of that window), a batch that could take more entries than are ready
waits for more chunks, up to `batch_wait_s` from its oldest backlog, unless the stretch's budget
holds `batch_bank_s` or more (enough to read at once); a share that is not busy reads at once. It
waits only where more chunks can come: some turn in flight whose output is read as it streams (its
session not `held`: `update(held=True)` says the ids fed past `known` wait out of reading, an
output held for its re-render) or whose prompt is still to come (a turn whose session is not named
yet, or was not told since the turn started: a turn's start clears its session's `held`). Where
every turn in flight is on a held session, no chunk can come before one of them ends (a new
request's prompt aside, which no wait foresees), so the batch reads at once.

Which session: among resident sessions with a whole chunk to read, by the `Priorities` steps in
order (each switchable): a pending ask or standing question first, then sessions with a turn in
flight, then by recency of their last turn start, then the oldest backlog (the longest since it
last had no whole chunk), then the order sessions were first seen. An extra step, off by
default, ranks by the fewest whole chunks to read (the session nearest to fresh) after the turns
in flight.

Driving it (a live caller, under its own lock; the replay does the same per engine, its estimate
warmed with its fixed chunk cost):

- at load: read a scratch session of a few chunks at a few depths and `costs.warm(depth, s)`
  each (device synchronised, the first chunk after a load left out), so no chunk is ever read
  inside a stream just to measure it;
- a request arrives: `turn_started(turn, session, now)` (session None while the caller does not
  know it yet, e.g. a proxy that finds it from the prompt's ids: `turn_session` names it then;
  and `waiting(n, now)` whenever the count of requests queued for the device changes); its prompt
  fed: `update(session, committed, known, now)`; a standing question registered:
  `question(session, now, stop=line)`;
- its first token: `first_token(turn, now)`;
- between two decode rounds or streamed deltas: `update` with the output ids fed, then
  `next_read(now, between_rounds=True)`; a `Read` is read (its `chunks` of its `session`, which
  may be another session than the turn's), then `read_done(read, chunks, seconds, now)` and
  `update` with the session's true state;
- the idle poller, on the device before every chunk: `next_read(now)`; a `Read` is one chunk,
  then `read_done` and `update`; a `Wait` says when a tick or nothing new can change the answer;
- the turn over: `turn_ended(turn, now)`; a session spilled to disk or loaded back: `update(...,
  resident=False/True)`; an ask: `question(session, now)`, its reads reported as
  `read_done(Read(session, k, "ask", depth, None), k, seconds, now)`, then `answered`.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, fields

from shadow.core.turns import Turn, TurnTable

EPS = 1e-9
WARM_DEPTHS = (0, 8192, 32768)  # context depths whose chunk cost a live reader measures at load


@dataclass(frozen=True)
class BandwidthRule:
    """The policy: poll period, idle burst length, in-turn share, the longest one slice may hold
    the device (seconds) and the most whole chunks it reads."""

    poll_s: float = 0.2
    burst_s: float = 2.0
    share: float = 0.02
    slice_s: float = 0.15
    slice_chunks: int = 1
    batch: int = 1  # chunks one read may take (1: no batches)
    batch_s: float = 0.010  # the longest a batched read may hold the device at once, by estimate (and slice_s)
    # the longest a batched read in the share may take in all, read in pieces of at most batch_s
    # between rounds (None: batch_s, one piece)
    batch_read_s: float | None = None
    batch_wait_s: float = 0.0  # while the share is busy, how long a batch short of `batch` waits for more chunks
    batch_busy: float = 0.4  # the share's use over the last busy_window_s, of its income there, that makes it busy
    busy_window_s: float = 10.0
    batch_bank_s: float = 4.0  # ... with less than this left in the stretch's budget (more: it can afford to read at once)
    # what a share read charges its stretch: "alone", the lesser of its device-synchronised seconds and its
    # cost as measured at load (`ReadScheduler.keep_alone`; beside an engine in another process, a read's
    # seconds hold the engine's own work on the GPU too); "wall", those seconds
    charge: str = "alone"

    @property
    def share_batch_s(self) -> float:
        """The longest a batched read in the share may take in all, by estimate."""
        return min(self.slice_s, self.batch_s if self.batch_read_s is None else self.batch_read_s)

    def next_poll(self, t: float) -> float:
        """The first poll tick at or after t (ticks at multiples of poll_s)."""
        return math.ceil(round(t / self.poll_s, 9)) * self.poll_s

    def burst_allows(self, burst_start: float, now: float, chunk_s: float) -> bool:
        """Whether one more chunk fits in the idle burst that began at burst_start."""
        return now + chunk_s <= burst_start + self.burst_s + 1e-12

    def share_budget(self, first_token: float, now: float, used: float) -> float:
        """Seconds the reader may still use inside a turn whose first token came at first_token."""
        return self.share * max(0.0, now - first_token) - used


STEPS = ("question", "running", "fewest", "recent", "oldest")


@dataclass(frozen=True)
class Priorities:
    """The order sessions are read in, step by step; a step switched off ranks every session equal.
    'all' is the four default steps; `fewest` is an extra step, off by default."""

    question: bool = True  # a pending ask or standing question first
    running: bool = True  # then sessions with a turn in flight
    fewest: bool = False  # then the fewest whole chunks to read first (the nearest to fresh)
    recent: bool = True  # then the most recent last turn first
    oldest: bool = True  # then the oldest backlog first

    @classmethod
    def parse(cls, spec: str) -> Priorities:
        """'all' (the four default steps), 'none', or steps joined by commas ('running,recent')."""
        spec = spec.strip().lower()
        if spec == "all":
            return cls()
        if spec == "none":
            return cls(**{step: False for step in STEPS})
        steps = {x.strip() for x in spec.split(",") if x.strip()}
        unknown = steps - set(STEPS)
        if unknown or not steps:
            raise ValueError(f"priorities are 'all', 'none' or steps among {', '.join(STEPS)} (got {spec!r})")
        return cls(**{step: step in steps for step in STEPS})

    @property
    def label(self) -> str:
        if self == Priorities():
            return "all"
        return ",".join(f.name for f in fields(self) if getattr(self, f.name)) or "none"


class ChunkCosts:
    """Seconds per chunk by context depth: one estimate per bucket of `bucket_tokens` (the depth of
    the chunk's first row), an exponentially weighted moving average (weight `alpha` on each new
    measurement). A measurement more than `outlier` times away from the estimate counts as
    `outlier` times, so one slow chunk moves an estimate by at most 1 + alpha * (outlier - 1)
    (1.9x by default) and the estimate decays back as normal chunks come. A bucket never measured
    is interpolated linearly between the nearest measured buckets below and above it, or takes the
    nearest one's; with none measured there is no estimate (None)."""

    def __init__(self, bucket_tokens: int = 8192, alpha: float = 0.3, outlier: float = 4.0):
        if bucket_tokens <= 0 or not 0 < alpha <= 1 or outlier < 1:
            raise ValueError("bucket_tokens > 0, 0 < alpha <= 1 and outlier >= 1")
        self.bucket_tokens, self.alpha, self.outlier = bucket_tokens, alpha, outlier
        self._est: dict[int, float] = {}
        self._keys: list[int] = []  # measured buckets, sorted

    def _set(self, bucket: int, seconds: float) -> None:
        if bucket not in self._est:
            bisect.insort(self._keys, bucket)
        self._est[bucket] = seconds

    def estimate(self, depth: int) -> float | None:
        """The estimated seconds of one chunk whose first row sits at `depth`."""
        b = depth // self.bucket_tokens
        if b in self._est:
            return self._est[b]
        if not self._keys:
            return None
        i = bisect.bisect_left(self._keys, b)
        if i == 0:
            return self._est[self._keys[0]]
        if i == len(self._keys):
            return self._est[self._keys[-1]]
        lo, hi = self._keys[i - 1], self._keys[i]
        return self._est[lo] + (self._est[hi] - self._est[lo]) * (b - lo) / (hi - lo)

    def observe(self, depth: int, seconds: float) -> None:
        """Fold one chunk's measured seconds (device synchronised) into its bucket's estimate; the
        first measurement of a bucket starts from the interpolated estimate when there is one."""
        if seconds < 0:
            return
        b = depth // self.bucket_tokens
        old = self._est.get(b, self.estimate(depth))
        if old is None or old <= 0:
            self._set(b, seconds)
            return
        x = min(max(seconds, old / self.outlier), old * self.outlier)
        self._set(b, old + self.alpha * (x - old))

    def warm(self, depth: int, seconds: float) -> None:
        """Set a bucket's estimate outright (a scratch read at load, or a replay's known rate)."""
        self._set(depth // self.bucket_tokens, max(0.0, seconds))

    def bounded(self, depth: int) -> float | None:
        """`estimate`, except past the deepest measured bucket: there the line through the two
        deepest (never below the deepest's own cost), and None with fewer than two measured; None
        for an estimate that is not above 0."""
        b = depth // self.bucket_tokens
        if not self._keys or (b > self._keys[-1] and len(self._keys) < 2):
            return None
        if b > self._keys[-1]:
            lo, hi = self._keys[-2], self._keys[-1]
            slope = (self._est[hi] - self._est[lo]) / (hi - lo)
            value = self._est[hi] + max(0.0, slope) * (b - hi)
        else:
            value = self.estimate(depth)
        return value if value is not None and value > 0 else None

    @property
    def known(self) -> bool:
        return bool(self._keys)

    def table(self) -> dict[int, float]:
        """Measured buckets: the depth of each bucket's first row -> seconds per chunk."""
        return {b * self.bucket_tokens: self._est[b] for b in self._keys}


def graphed_batch(n: int) -> int:
    """The largest batch of at most `n` sessions a reader has CUDA graphs for: 1, 2, 4, 8, ..."""
    return 1 << max(0, n.bit_length() - 1)


def batch_sizes(batch: int) -> list[int]:
    """The graphed batch sizes of 2 sessions or more that a rule with `batch` may read: 2, 4, ..."""
    return sorted({graphed_batch(n) for n in range(2, batch + 1)})


@dataclass(frozen=True)
class Read:
    """Read `chunks` whole chunks of `session` now, from read position `depth`; `window` is 'idle',
    'share' or 'ask'; `estimate_s` the chunks' estimated seconds (None: no estimate). `others`:
    more chunks, (session, its read position then), read in the same forward as `session`'s one
    chunk (a batch; `chunks` is 1 then): a session's chunks consecutive and in order (a run; the
    first session's next chunks come first)."""

    session: str
    chunks: int
    window: str
    depth: int
    estimate_s: float | None
    others: tuple[tuple[str, int], ...] = ()

    @property
    def batch(self) -> int:
        return 1 + len(self.others)


@dataclass(frozen=True)
class Wait:
    """Nothing to read now. `until`: the earliest time the answer may change if nothing else does
    (no update, turn event or question); inf when only such an event can change it. Asking again
    sooner is always safe (a live poller may just look at its next tick)."""

    until: float


@dataclass
class _Session:
    name: str
    order: int
    committed: int = 0
    known: int = 0
    resident: bool = True
    last_turn: float = -math.inf
    backlog_since: float | None = None  # when it last came to have a whole chunk to read
    question: bool = False
    stop: int | None = None  # a standing question's grid line: read no further until answered
    mark: int | None = None  # its next checkpoint line: a batch's run of it ends there
    held: bool = False  # ids fed past `known` wait out of reading (its stream brings no chunks)
    version: int = 0  # bumped whenever its rank changes: older heap entries are stale
    ranked_whole: int = -1  # its whole chunks when last ranked (the `fewest` step ranks by them)


@dataclass(frozen=True)
class KnownCosts:
    """Costs measured elsewhere (a `shadow read-rate --json` run) that a scheduler starts from:
    seconds of one chunk by depth, and of one batched read by (batch size, depth); `label` says
    where they came from. A live load's own measurements and every read after correct them."""

    chunks: tuple[tuple[int, float], ...] = ()
    batches: tuple[tuple[int, int, float], ...] = ()
    label: str = ""


class ReadScheduler:
    """The one read scheduler (see the module docstring). Not thread-safe: a live caller holds its
    own lock around every call. Turn ids are the caller's (any hashable); `turns` is the table of
    turns in flight (a caller that keeps its own records there adds them before `turn_started`)."""

    def __init__(self, rule: BandwidthRule = BandwidthRule(), grid: int = 512, costs: ChunkCosts | None = None,
                 priorities: Priorities = Priorities(), turns: TurnTable | None = None):
        self.rule, self.grid, self.priorities = rule, grid, priorities
        self.costs = costs if costs is not None else ChunkCosts()
        self.batch_costs: dict[int, ChunkCosts] = {}  # batch size -> seconds of a batched read by depth
        self.sessions: dict[str, _Session] = {}
        self._ready: set[str] = set()  # resident sessions with a whole chunk to read
        self._heap: list[tuple[tuple, int, str]] = []  # (rank, version, name) of ready sessions
        self._versions = 0  # one counter for all sessions, so a forgotten name's entries stay stale
        self._seen = 0
        self.turns = turns if turns is not None else TurnTable()
        self._running: dict[str, int] = {}  # session -> turns in flight
        self._decoding = 0
        self._waiting = 0
        self.stretch_start: float | None = None  # first token of the engine's current decode stretch
        self.share_used = 0.0  # seconds read inside the current stretch
        self._burst_start: float | None = None
        self._burst_chunks = 0
        self.changes = 0  # bumped by every change that can move a decision
        self.decode_s = 0.0  # seconds of decode stretches ended so far
        self._between: tuple[int, float] | None = None  # (changes, until) of the last between-rounds Wait
        self._share_reads: deque[tuple[float, float]] = deque()  # (end, seconds charged) of recent share reads
        self._share_used_recently = 0.0
        self.alone: tuple[ChunkCosts, dict[int, ChunkCosts]] | None = None  # costs kept at load (`keep_alone`)
        self._known: KnownCosts | None = None  # the costs `warm_known` started from

    # the sessions ----------------------------------------------------------------------------

    def update(self, name: str, committed: int, known: int, now: float, *, resident: bool = True,
               mark: int | None = None, held: bool = False) -> None:
        """A session's read position (`committed`, a grid multiple), the ids known for it (read or
        not), whether its state is resident (spilled sessions are not read until fed again), its
        next checkpoint line past `committed` (None: none), where a batch's run of it ends, and
        whether ids fed to it from now wait out of reading (`held`: an output held for its
        re-render, so its stream brings the reader no chunks; a batch does not wait for them)."""
        s = self.sessions.get(name)
        if s is None:
            self._seen += 1
            s = self.sessions[name] = _Session(name, self._seen)
            self.changes += 1
        before = (s.committed, s.resident, self._whole(s), s.mark, s.held)
        s.committed, s.known, s.resident, s.mark, s.held = committed, known, resident, mark, held
        if (s.committed, s.resident, self._whole(s), s.mark, s.held) != before:
            self.changes += 1
        self._refresh(s, now)

    def forget(self, name: str) -> None:
        self.sessions.pop(name, None)
        self._ready.discard(name)
        self.changes += 1

    def question(self, name: str, now: float, stop: int | None = None) -> None:
        """A pending ask or standing question on `name` (read it first). `stop`: the grid line the
        reader must not pass before the question is answered (a standing question's insertion
        point, rounded down to the grid): the session's whole chunks end there, and at the line it
        has none until `answered`; None reads on."""
        s = self.sessions.get(name)
        if s is not None:
            s.question, s.stop = True, stop
            self.changes += 1
            self._refresh(s, now, rerank=True)

    def answered(self, name: str, now: float) -> None:
        s = self.sessions.get(name)
        if s is not None:
            s.question, s.stop = False, None
            self.changes += 1
            self._refresh(s, now, rerank=True)

    def has_backlog(self) -> bool:
        """Whether some resident session has a whole chunk to read (an idle burst would read)."""
        return bool(self._ready)

    def whole_chunks(self, name: str) -> int:
        """Whole chunks the reader may read of `name` now (0 if unknown, or held at a question)."""
        s = self.sessions.get(name)
        return 0 if s is None else self._whole(s)

    def _whole(self, s: _Session) -> int:
        n = max(0, (s.known - s.committed) // self.grid)
        if s.stop is not None and s.committed <= s.stop:  # held at the line until answered
            n = min(n, (s.stop - s.committed) // self.grid)
        return n

    def _run_chunks(self, s: _Session) -> int:
        """Whole chunks one run of a batch may take of `s`: up to its next checkpoint line."""
        n = self._whole(s)
        if s.mark is not None and s.mark > s.committed:
            n = min(n, (s.mark - s.committed) // self.grid)
        return n

    def _refresh(self, s: _Session, now: float, rerank: bool = False) -> None:
        """Keep `_ready` and the rank heap in step with the session's backlog."""
        whole = self._whole(s)
        ready = s.resident and whole > 0
        if self.priorities.fewest and whole != s.ranked_whole:
            rerank = True
        if whole > 0:
            if s.backlog_since is None:
                s.backlog_since, rerank = now, True
        else:
            s.backlog_since = None
        if ready and (rerank or s.name not in self._ready):
            self._ready.add(s.name)
            self._versions += 1
            s.version, s.ranked_whole = self._versions, whole
            heapq.heappush(self._heap, (self._key(s), s.version, s.name))
            if len(self._heap) > 4 * len(self._ready) + 64:  # drop stale entries
                self._heap = [e for e in self._heap if self._current(e)]
                heapq.heapify(self._heap)
        elif not ready:
            self._ready.discard(s.name)

    def _current(self, entry: tuple[tuple, int, str]) -> bool:
        s = self.sessions.get(entry[2])
        return s is not None and s.version == entry[1] and s.name in self._ready

    # the engine ------------------------------------------------------------------------------

    def turn_started(self, turn: Hashable, session: str | None, now: float) -> None:
        """A request arrived for `session` (the engine is busy from now until its turn ends).
        `session` None: not known yet (a proxy finds it from the prompt's ids); `turn_session`
        names it when it is. The turn's record is the caller's if it added one to `turns`."""
        record = self.turns.get(turn) or self.turns.add(Turn(turn, now))
        record.session, record.first_token = None, None
        self.changes += 1
        if session is not None:
            self.turn_session(turn, session, now)
        self._burst_start = None

    def turn_session(self, turn: Hashable, session: str, now: float) -> None:
        """Name the session of a turn started without one (its last turn counts from now)."""
        record = self.turns[turn]
        if record.session is None:
            record.session = session
            self.changes += 1
            self._run(session, now)

    def _run(self, session: str, now: float) -> None:
        self._running[session] = self._running.get(session, 0) + 1
        s = self.sessions.get(session)
        if s is None:
            self.update(session, 0, 0, now)
            s = self.sessions[session]
        s.last_turn = now
        s.held = False  # its prompt is still to be fed: told again with it
        self._refresh(s, now, rerank=True)

    def first_token(self, turn: Hashable, now: float) -> None:
        """The turn's first output token: it decodes from now; a stretch starts if none decoded."""
        record = self.turns[turn]
        if record.decoding:
            return
        record.first_token = now
        self.changes += 1
        if self._decoding == 0:
            self.stretch_start, self.share_used = now, 0.0
        self._decoding += 1

    def turn_ended(self, turn: Hashable, now: float) -> None:
        record = self.turns.pop(turn)
        self.changes += 1
        if record.session is not None:
            self._stop_running(record.session, now)
        if record.decoding:
            self._decoding -= 1
            if self._decoding == 0:
                self.decode_s += max(0.0, now - self.stretch_start)
                self.stretch_start, self.share_used = None, 0.0

    def restart_stretch(self, now: float) -> None:
        """Start the current decode stretch's share afresh at `now` (its budget 0, its seconds kept in
        `decode_s`): a shadow switched back on reads at its share from then on, not also the share of
        the time it was off."""
        if self.stretch_start is not None:
            self.decode_s += max(0.0, now - self.stretch_start)
            self.stretch_start, self.share_used = now, 0.0
            self.changes += 1

    def _stop_running(self, session: str, now: float) -> None:
        self._running[session] -= 1
        if not self._running[session]:
            del self._running[session]
            if session in self.sessions:
                self._refresh(self.sessions[session], now, rerank=True)

    def waiting(self, n: int, now: float) -> None:
        """Requests waiting for the engine (or, embedded, for the device) besides the turns told."""
        if n != self._waiting:
            self.changes += 1
        self._waiting = n
        if n:
            self._burst_start = None

    @property
    def busy(self) -> bool:
        return bool(self.turns) or self._waiting > 0

    @property
    def decoding(self) -> int:
        return self._decoding

    def decoded_s(self, now: float) -> float:
        """Seconds the engine has decoded so far: ended stretches and the current one."""
        return self.decode_s + (0.0 if self.stretch_start is None else max(0.0, now - self.stretch_start))

    def between_rounds_due(self, now: float) -> bool:
        """Whether `next_read(now, between_rounds=True)` could answer anything but the Wait it
        answered last: False while nothing changed and its `until` has not come (O(1))."""
        last = self._between
        return last is None or last[0] != self.changes or now >= last[1]

    def share_left(self, now: float) -> float:
        """Seconds of share the current decode stretch holds now (0 outside a stretch)."""
        if self.stretch_start is None:
            return 0.0
        return self.rule.share_budget(self.stretch_start, now, self.share_used)

    # decisions -------------------------------------------------------------------------------

    def _key(self, s: _Session) -> tuple:
        p = self.priorities
        return (
            -1 if p.question and s.question else 0,
            -1 if p.running and s.name in self._running else 0,
            self._whole(s) if p.fewest else 0,
            -s.last_turn if p.recent else 0.0,
            s.backlog_since if p.oldest and s.backlog_since is not None else 0.0,
            s.order,
        )

    def _pick(self, fits=None) -> _Session | None:
        """The first ready session in rank order (that `fits`, when given)."""
        found = self._ranked(1, fits)
        return found[0] if found else None

    def _ranked(self, n: int, fits=None) -> list[_Session]:
        """The first `n` ready sessions in rank order (that `fits`, when given); the heap is left
        as it was (less stale entries)."""
        heap, taken, found = self._heap, [], []
        while heap and len(found) < n:
            entry = heapq.heappop(heap)
            if not self._current(entry):
                continue
            taken.append(entry)
            s = self.sessions[entry[2]]
            if fits is None or fits(s):
                found.append(s)
        for entry in taken:
            heapq.heappush(heap, entry)
        return found

    def warm_known(self, known: KnownCosts) -> None:
        """Start from `known`: each chunk cost at its depth, and each batched read's of a size this
        rule may read (`batch_sizes`); later warms and reads replace them bucket by bucket."""
        self._known = known
        for depth, seconds in known.chunks:
            self.costs.warm(depth, seconds)
        sizes = set(batch_sizes(self.rule.batch))
        for size, depth, seconds in known.batches:
            if size in sizes:
                self.warm_batch(size, depth, seconds)
        self.changes += 1

    def warm_batch(self, size: int, depth: int, seconds: float) -> None:
        """Set the estimate of a batched read of `size` sessions' chunks at `depth` outright (a
        scratch batch read at load, or a replay's known rate)."""
        self.batch_costs.setdefault(size, ChunkCosts(self.costs.bucket_tokens)).warm(depth, seconds)
        self.changes += 1

    def batch_estimate(self, depths: list[int]) -> float | None:
        """Estimated seconds of one read of one chunk at each of `depths`, together: the batch size's
        own estimate at the deepest, else that many single chunks."""
        if len(depths) == 1:
            return self.costs.estimate(depths[0])
        own = self.batch_costs.get(len(depths))
        est = own.estimate(max(depths)) if own is not None else None
        if est is not None:
            return est
        singles = [self.costs.estimate(d) for d in depths]
        return None if any(x is None for x in singles) else sum(singles)

    def _batch(self, first: _Session, limit_s: float, fits=None) -> tuple[tuple[tuple[str, int], ...], float | None, bool]:
        """More chunks to read with `first`'s next one, chunk by chunk in rank order (the rest of
        `first`'s run, then the next session's run, ...), while the batch's estimate stays within
        `limit_s`, cut to a graphed size: (others, the batch's estimate, whether it is full: no
        more entries would fit, for the size or the bound, rather than no more chunks to take)."""
        est = self.batch_estimate([first.committed])
        if self.rule.batch <= 1:
            return (), est, True
        entries: list[tuple[str, int]] = []
        depths = [first.committed]
        sessions = [first] + [s for s in self._ranked(self.rule.batch, fits) if s is not first]
        full = False
        for s in sessions:
            for k in range(1 if s is first else 0, self._run_chunks(s)):
                depth = s.committed + k * self.grid
                total = None if len(entries) + 1 >= self.rule.batch else self.batch_estimate([*depths, depth])
                if total is None or total > limit_s + 1e-12:
                    full = True
                    break
                entries.append((s.name, depth))
                depths.append(depth)
                est = total
            if full:
                break
        full = full or len(entries) + 1 >= self.rule.batch
        size = graphed_batch(len(entries) + 1)
        if size != len(entries) + 1:
            entries = entries[: size - 1]
            est = self.batch_estimate(depths[:size])
        return tuple(entries), est, full

    def next_read(self, now: float, between_rounds: bool = False) -> Read | Wait:
        """What to read now. Idle engine: one chunk of the first session in priority order, inside
        a burst that began at a poll tick. Busy engine: nothing, unless `between_rounds` (the
        caller sits between two decode rounds, or two streamed deltas) in a decode stretch with
        share left: the chunks of one session that fit min(share left, slice_s). The caller reads
        them (whole chunks, device synchronised) and reports with `read_done`."""
        if not self.busy:
            return self._idle(now)
        self._burst_start = None
        if not between_rounds or self.stretch_start is None or self.rule.share <= 0:
            return Wait(math.inf)
        decision = self._share(now)
        self._between = (self.changes, decision.until) if isinstance(decision, Wait) else None
        return decision

    def _idle(self, now: float) -> Read | Wait:
        s = self._pick()
        if s is None:
            self._burst_start = None
            return Wait(math.inf)
        est = self.costs.estimate(s.committed)
        if self._burst_start is not None and self._burst_chunks > 0 and (
                est is None or not self.rule.burst_allows(self._burst_start, now, est)):
            self._burst_start = None  # time is up: the next burst begins at the next tick
        if self._burst_start is None:
            tick = self.rule.next_poll(now)
            if tick > now + EPS:
                return Wait(tick)
            self._burst_start, self._burst_chunks = now, 0  # a burst's first chunk is read whatever its cost
        others, batch_est, _ = self._batch(s, self.rule.batch_s)
        return Read(s.name, 1, "idle", s.committed, batch_est if others else est, others)

    def _share(self, now: float) -> Read | Wait:
        cap = self.rule.slice_s + 1e-12

        def fits(s: _Session) -> bool:
            est = self.costs.estimate(s.committed)
            return est is not None and est <= cap

        s = self._pick(fits)
        if s is None:
            return Wait(math.inf)
        budget = self.share_left(now)
        room = min(budget, self.rule.slice_s) + 1e-12
        chunks, total = 0, 0.0
        for j in range(min(self._whole(s), max(1, self.rule.slice_chunks))):
            est = self.costs.estimate(s.committed + j * self.grid)
            if est is None or total + est > room:
                break
            chunks, total = chunks + 1, total + est
        if chunks <= 1 and self.rule.batch > 1:
            batch = self._share_batch(s, now, budget, fits)
            if batch is not None:
                return batch
        if chunks:
            return Read(s.name, chunks, "share", s.committed, total)
        first = self.costs.estimate(s.committed)
        ready = self.stretch_start + (self.share_used + first) / self.rule.share
        return Wait(max(ready, now + EPS))

    def _share_batch(self, first: _Session, now: float, budget: float, fits) -> Read | Wait | None:
        """With batches on, in the share: `first`'s chunk and the next ones (`_batch`) while the
        batch's estimate stays within `share_batch_s`, read when the budget pays for the whole
        batch and waited for until then. While the share is busy (`share_busy`), a batch that is not
        full waits up to `batch_wait_s` from its oldest backlog for more chunks, where more can come
        (`chunks_may_come`). None where no batch forms (and none is waited for)."""
        others, est, full = self._batch(first, self.rule.share_batch_s, fits)
        if est is None:
            return None
        if not full and self.rule.batch_wait_s > 0 and self.share_busy(now) and self.chunks_may_come():
            names = {first.name, *(name for name, _ in others)}
            since = min((self.sessions[n].backlog_since for n in names if self.sessions[n].backlog_since is not None),
                        default=now)
            if now + EPS < since + self.rule.batch_wait_s:
                return Wait(since + self.rule.batch_wait_s)
        if not others:
            return None
        if est <= budget + 1e-12:
            return Read(first.name, 1, "share", first.committed, est, others)
        return Wait(max(self.stretch_start + (self.share_used + est) / self.rule.share, now + EPS))

    def chunks_may_come(self) -> bool:
        """Whether a turn in flight may bring the reader more chunks: one whose session is not
        named yet (its prompt is still to come), or is not `held` (its output is read as it
        streams, or its prompt is still to be fed). O(sessions with a turn in flight)."""
        if len(self.turns) > sum(self._running.values()):
            return True
        for name in self._running:
            s = self.sessions.get(name)
            if s is None or not s.held:
                return True
        return False

    def share_busy(self, now: float) -> bool:
        """Whether the share is busy: its reads over the last `busy_window_s` used at least
        `batch_busy` of the share of that window, and the stretch's budget holds less than
        `batch_bank_s` (amortised O(1))."""
        window, reads = self.rule.busy_window_s, self._share_reads
        while reads and reads[0][0] < now - window:
            self._share_used_recently -= reads.popleft()[1]
        return self._share_used_recently >= self.rule.batch_busy * self.rule.share * window - 1e-12 \
            and self.share_left(now) < self.rule.batch_bank_s

    def keep_alone(self, chunks: list[tuple[int, float]], batches: list[tuple[int, int, float]] = ()) -> None:
        """Keep, as the costs a share read is charged at most under `charge="alone"`, the costs
        measured at load (`chunks`: (depth, seconds) of one chunk; `batches`: (size, depth, seconds)
        of a batched read) over the known costs the scheduler started from (`warm_known`); never the
        estimates its reads taught it."""
        costs, by_size = ChunkCosts(self.costs.bucket_tokens), {}
        known = self._known if self._known is not None else KnownCosts((), ())
        for depth, seconds in (*known.chunks, *chunks):
            costs.warm(depth, seconds)
        for size, depth, seconds in (*known.batches, *batches):
            by_size.setdefault(size, ChunkCosts(self.costs.bucket_tokens)).warm(depth, seconds)
        self.alone = (costs, by_size)

    def charged(self, read: Read, chunks: int, seconds: float) -> float:
        """What a share read of `chunks` chunks that took `seconds` charges its stretch: `seconds`;
        under `charge="alone"` the lesser of them and its cost kept at load (a batch: its size's cost
        at its deepest entry, else its entries' chunk costs; past the deepest depth kept, the line
        through the two deepest: `ChunkCosts.bounded`), where that cost is known."""
        if self.rule.charge != "alone" or self.alone is None or chunks <= 0:
            return seconds
        costs, batches = self.alone
        if read.others:
            depths = [read.depth, *(d for _, d in read.others)]
            own = batches.get(read.batch)
            estimate = own.bounded(max(depths)) if own is not None else None
            parts = [costs.bounded(d) for d in depths] if estimate is None else [estimate]
        else:
            parts = [costs.bounded(read.depth + k * self.grid) for k in range(chunks)]
        if any(p is None for p in parts):
            return seconds
        return min(seconds, sum(parts))

    def read_done(self, read: Read, chunks: int, seconds: float, now: float) -> float:
        """`chunks` of `read` were read in `seconds` (device synchronised), ending at `now`. Moves the
        session's read position (unless an `update` moved it meanwhile), refreshes the cost
        estimate at that depth, and charges a share read to the stretch's budget (`charged`).
        Returns the seconds charged (0 for a read outside the share)."""
        charge = self.charged(read, chunks, seconds) if read.window == "share" else 0.0
        s = self.sessions.get(read.session)
        self.changes += 1
        if chunks > 0 and read.others:  # a batch: its entries' chunks, read together, in order
            costs = self.batch_costs.setdefault(read.batch, ChunkCosts(self.costs.bucket_tokens))
            costs.observe(max(read.depth, *(d for _, d in read.others)), seconds)
            for name, depth in ((read.session, read.depth), *read.others):
                other = self.sessions.get(name)
                if other is not None:
                    if other.committed == depth:
                        other.committed += self.grid
                    self._refresh(other, now)
        elif chunks > 0:
            self.costs.observe(read.depth + (chunks - 1) * self.grid // 2, seconds / chunks)
            if s is not None and s.committed == read.depth:
                s.committed += chunks * self.grid
        if read.window == "share" and self.stretch_start is not None:
            self.share_used += charge
        if read.window == "share":
            self._share_reads.append((now, charge))
            self._share_used_recently += charge
        if read.window == "idle" and self._burst_start is not None:
            self._burst_chunks += 1
        if s is not None:
            self._refresh(s, now)
        return charge
