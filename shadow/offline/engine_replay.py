"""One engine and its shadow over that engine's requests: the read scheduler driven as the live
service drives it, the device's work one job at a time, and what an operator would have seen.

Events come at their times (a turn's start, first token and end, a prompt's ids reaching the
proxy, a label's answer, an ask, a probe); those that fall inside device work happen inside it,
and the device work they cause waits for it (`jobs`, first come first served): a prompt fed (a
restore first, if its session is on disk), a turn's end (its held ids fed, then the scheduler
told, then the cap settled: spills), an ask (its session read to its end, one forward, a
settle). Between jobs the scheduler is asked what to read, until the timeline's last event: in the idle window one chunk at a
time (each followed by a settle, as live), inside a decode stretch one share slice a decode round
apart; and, with a voice share, a turn's phrase at each of its status lines where its budget holds
one and the device is free (`limits.ReplayLimits`). The big model's timeline
is the ledger's: the shadow's work never moves it.
"""

from __future__ import annotations


import heapq
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from shadow.core.driving import batch_now, entry_depths, in_pieces, pieces_now, tell
from shadow.core.schedule import WARM_DEPTHS, Read, ReadScheduler, Wait, batch_sizes
from shadow.offline.costs import CostTable, ReadTime
from shadow.offline.modelled import ModelledSession, ModelledStore
from shadow.offline.prefixmodel import PrefixModel
from shadow.offline.ledger import Request
from shadow.offline.limits import LINE_EVERY_S, LINE_QUIET_S, ReplayLimits
from shadow.offline.timelines import readable, time_readable

START, FIRST, END, FEED, LABEL, ASK, PROBE, AHEAD = range(8)


@dataclass(frozen=True)
class TurnStart:
    """A turn start of a session with earlier turns: `behind` (= its lag) the ids its engine held
    before the turn (the previous request's prompt and output so far; while a prediction of the
    next prompt stands, the prediction's) not read by this shadow; `wait_s` the reading an ask
    would wait for then (restore and chunks, from the cost table); `to_prompt` the ids it must
    still read to stand at the start of the new prompt that was known before it came (its prefix
    shared with the ids held), ids read past that prefix and so read again after the rollback
    included."""

    session: str
    start: float
    behind: int
    fresh: bool
    engine: int = 0
    wait_s: float = 0.0
    to_prompt: int = 0


class Answered(NamedTuple):
    """An ask answered: its arrival, the seconds until its answer, of them the wait for the device
    (`queued_s`: until its job began, as live's `device_wait_ms`), and its kind (None: a Poisson ask)."""

    arrival: float
    wait_s: float
    queued_s: float
    kind: str | None = None


@dataclass(frozen=True)
class Probe:
    """A session looked at a random time: its lag (ids its engine holds now, not read) and the
    reading an ask would wait for."""

    time: float
    session: str
    lag: int
    wait_s: float
    engine: int = 0


@dataclass(frozen=True)
class ToFresh:
    """A turn's time from its start until the shadow had read its prompt to the prompt's last grid
    line; `censored`: not fresh before the session's next turn or the end (then `seconds` is the
    time until that)."""

    session: str
    start: float
    seconds: float
    censored: bool
    engine: int = 0


@dataclass
class Flight:
    """A batched read of the share under way, read in pieces between rounds: its read, entries
    (a session an entry, a run's consecutive: `driving.batch_now`), cost in all, and the pieces
    run so far."""

    read: Read
    batch: list[ModelledSession]
    cost: float
    ran: int = 0


@dataclass
class Tally:
    """What one engine's shadow did."""

    chunks_idle: int = 0
    chunks_share: int = 0
    chunks_ask: int = 0
    ids_reread: int = 0
    rollbacks: int = 0
    predictions: int = 0  # next prompts predicted at a turn's end (`ReplayLimits.predict`)
    predictions_missed: int = 0  # of those, the ones the next prompt sent back
    share_s: float = 0.0
    share_charged_s: float = 0.0  # what the share's reads charged (`ReadScheduler.charged`: at most share_s)
    longest_slice_s: float = 0.0
    voice_s: float = 0.0
    phrases: int = 0
    asks: list[Answered] = field(default_factory=list)
    left: list[tuple[float, str, bool]] = field(default_factory=list)  # (when, session, spilled: state kept) past the cap
    restores_ahead: int = 0  # restores started at a request's arrival, beside the reads


class EngineReplay:
    """One engine of the fleet. `requests`: (index, request) of this engine; `order[i]`: request i's
    rank by start (the live service's turn ids); `before[i]`, `next_start[i]`: the session's ids known
    at i's start from its previous request (None: its first), the start of its next request (inf).
    `probes`: (time, session) to look at; `asks`: (time, session[, kind]) of asks. The grid's rules, the
    entries of a batch and its pieces are `core.driving`'s, as live."""

    def __init__(self, engine: int, requests: list[tuple[int, Request]], order: Sequence[int],
                 before: Sequence[int | None], next_start: Sequence[float], sched: ReadScheduler, *,
                 costs: CostTable, limits: ReplayLimits, use_share: bool, probes: Sequence[tuple[float, str]] = (),
                 asks: Sequence[tuple] = ()):
        self.engine, self.sched, self.costs, self.limits, self.use_share = engine, sched, costs, limits, use_share
        self.grid = g = sched.grid
        self.order, self.before, self.next_start = order, before, next_start
        scale = costs.ask_chunk_scale  # what an ask would wait for: its chunks at the asks' cost
        self.read_time = ReadTime(costs.chunk if scale == 1 else (lambda depth: costs.chunk(depth) * scale), g)
        for depth in WARM_DEPTHS:  # as live: measured at load
            sched.costs.warm(depth, costs.chunk(depth))
            for size in batch_sizes(sched.rule.batch):
                sched.warm_batch(size, depth, costs.batch_s([depth] * size))
        self.store = ModelledStore(g, costs, size=limits.state, cap=limits.cap_bytes,
                                  disk=limits.disk, host_cap=limits.host_cap_bytes,
                                  draws=random.Random(f"host {limits.seed} {engine}"))  # from `costs.host_rates`
        self.req = dict(requests)
        self.heap: list[tuple] = []
        for i, r in requests:
            self._at(r.start, START, i)
            self._at(r.first_token, FIRST, i)
            self._at(r.end, END, i)
            if limits.prompt_at_first_event and limits.ids != "engine":
                known = r.start + costs.tokenize_s(r.prompt_tokens)
                self._at(max(r.first_token, known), FEED, i)
        for t, s in probes:
            self._at(t, PROBE, s)
        for t, s, *kind in asks:
            self._at(t, ASK, (s, kind[0] if kind else None))
        self.jobs: deque[tuple] = deque()
        self.decoding: dict[int, Request] = {}  # requests whose response is streaming
        self.latest: dict[str, int] = {}  # session -> the rank of the newest turn that fed its prompt
        self.current: dict[str, int] = {}  # session -> its newest request started here
        self.fed_prompt: set[int] = set()
        self.holding: set[str] = set()  # sessions holding what their next prompt will not keep (a prediction)
        self.known_next: dict[str, int | None] = {}  # session -> its next prompt's ids known at its last turn's end
        self.predicted: dict[str, tuple[int, int]] = {}  # session -> its standing prediction: (ids the next prompt holds, its ids)
        self.out_fed: dict[int, int] = {}  # request -> output ids fed
        self.fed: dict[str, int] = {}  # session -> ids the shadow was told of (kept through a drop)
        self.voice_used: dict[int, float] = {}
        self.line_at: dict[int, float] = {}  # decoding request -> when its next status line is due
        self.pending_fresh: dict[str, tuple[int, float]] = {}  # session -> (its turn, target line)
        self.next_round = -math.inf
        self.flight: Flight | None = None  # a share batch read in pieces between rounds
        self.tally = Tally()
        self.ask_draws = random.Random(f"asks {limits.seed} {engine}")  # the forwards drawn from `costs.ask_samples`
        if limits.prefix_cache_gib and limits.state is not None:  # the prefix cache, as live (`core.prefixcache`)
            self.store.prefix = PrefixModel(g, int(limits.prefix_cache_gib * 2**30), limits.state,
                                            limits.shared_prefix_tokens)
        # restores started at a request's arrival (`restore_ahead`): one at a time on their own
        # thread, beside the reads; session -> (when it is back, the tier it came from)
        self.io_free = -math.inf
        self.ahead: dict[str, tuple[float, str]] = {}
        self.starts: list[TurnStart] = []
        self.probes: list[Probe] = []
        self.to_fresh: list[ToFresh] = []

    def _at(self, t: float, kind: int, what) -> None:
        heapq.heappush(self.heap, (t, kind, len(self.heap), what))

    # what the shadow holds ----------------------------------------------------------------

    def _position(self, s: str) -> int:
        """The session's read position here: resident, in the host tier, on disk, or 0 (gone, or never seen)."""
        h = self.store.find(s)
        return h.committed if h is not None else 0

    def wait_s(self, s: str) -> float:
        """Seconds of device work an ask about `s` would wait for now: its move back if it is in the
        host tier, or its restore if it is on disk, then the chunks from its read position to the
        grid line of the ids the shadow was told of."""
        restore = self.store.back_s(s)
        line = self.fed.get(s, 0) // self.grid
        return restore + self.read_time(self._position(s) // self.grid, line)

    def _lag(self, s: str, t: float) -> int:
        i = self.current.get(s)
        return 0 if i is None else max(0, self._held(s, readable(self.req[i], t)) - self._position(s))

    def _to_prompt(self, s: str, r: Request) -> int:
        """Ids `s` must read, when request r arrives, to stand at the part of r's prompt known before
        it came (where the ledger says what the template predicted, that prediction's part, whether
        the shadow predicted or not; else the part shared with the previous prompt and output):
        from its read position, or, where it read past that part, from the newest checkpoint at or
        below it (the rollback)."""
        known = self.known_next.get(s)
        shared = known if known is not None else r.prompt_tokens - r.new_prompt_tokens
        h = self.store.find(s)
        position = h.committed if h is not None else 0
        if position <= shared:
            return shared - position
        return shared - max((c for c in h.checkpoint_positions if c <= shared), default=0)

    def _held(self, s: str, engine_ids: int) -> int:
        """The ids the shadow holds of `s` to be fresh on: the engine's (`engine_ids`), or, while a
        prediction of its next prompt stands, that prediction's (the ids a turn-start ask reads, as live)."""
        predicted = self.predicted.get(s)
        return engine_ids if predicted is None else predicted[1]

    def _tell(self, s: str, t: float) -> None:
        tell(self.sched, s, self.store.peek(s), t)
        self._check_fresh(s, t)

    def _check_fresh(self, s: str, t: float) -> None:
        due = self.pending_fresh.get(s)
        if due is None:
            return
        i, line = due
        if i in self.fed_prompt and self._position(s) >= line and self.store.holds(s):
            del self.pending_fresh[s]
            self.to_fresh.append(ToFresh(s, self.req[i].start, t - self.req[i].start, False, self.engine))

    def _censor(self, s: str, t: float) -> None:
        due = self.pending_fresh.pop(s, None)
        if due is not None:
            r = self.req[due[0]]
            self.to_fresh.append(ToFresh(s, r.start, t - r.start, True, self.engine))

    # events -------------------------------------------------------------------------------

    def _events(self, t: float, inclusive: bool, late: bool = False) -> None:
        """Every event before t (or at it): at its own time, or with `late` at t (the service's
        lock was held meanwhile: what the scheduler is told waits for it)."""
        heap = self.heap
        while heap and (heap[0][0] <= t if inclusive else heap[0][0] < t):
            when, kind, _, what = heapq.heappop(heap)
            self._handle(t if late else when, kind, what, when)

    def _handle(self, t: float, kind: int, what, when: float) -> None:
        if kind == PROBE:
            self.probes.append(Probe(when, what, self._lag(what, when), self.wait_s(what), self.engine))
            return
        if kind == ASK:
            self.jobs.append(("ask", what[0], t, what[1]))
            return
        if kind == LABEL:
            self.jobs.append(("end", what))
            return
        if kind == AHEAD:  # the session a prompt waited for is back
            self.jobs.append(("prompt", what))
            return
        i, r = what, self.req[what]
        s = r.session
        if kind == START:
            if self.before[i] is not None:
                behind = max(0, self._held(s, self.before[i]) - self._position(s))
                self.starts.append(TurnStart(s, r.start, behind, behind < self.grid, self.engine, self.wait_s(s),
                                             self._to_prompt(s, r)))
            self._censor(s, r.start)
            self.current[s] = i
            self.pending_fresh[s] = (i, r.prompt_tokens // self.grid * self.grid)
            self.sched.turn_started(i, s, t)
            if self.limits.restore_ahead:
                self._restore_ahead(s, when)
            if not self.limits.prompt_at_first_event:
                self.jobs.append(("prompt", i))
        elif kind == FIRST:
            self.sched.first_token(i, t)
            if r.end > r.first_token:
                self.decoding[i] = r
            if self.limits.ids == "engine":
                self.jobs.append(("prompt", i))
        elif kind == FEED:
            self.jobs.append(("prompt", i))
        else:
            self.decoding.pop(i, None)
            self.jobs.append(("finish", i))

    # device work --------------------------------------------------------------------------

    def _busy(self, t: float, seconds: float, locked: bool = False) -> float:
        """The device works `seconds` from t; what happens meanwhile happens then, or, `locked`
        (a restore or spill: the store is worked on under the service's lock), is told to the
        scheduler at the end. Returns the end."""
        end = t + seconds
        self._events(end, inclusive=False, late=locked)
        return end

    def _job(self, job: tuple, t: float) -> float:
        kind = job[0]
        if kind == "prompt":
            return self._feed_prompt(job[1], t)
        if kind == "finish":
            i = job[1]
            t = self._feed_output(i, t, at_end=True)
            r = self.req[i]
            self.known_next[r.session] = r.predicted_confirmed if r.predicted_tokens else None
            t = self._predict(i, t)
            if self.limits.proxy and self.limits.label_s > 0:
                self._at(t + self.limits.label_s, LABEL, i)
                return t
            return self._end_turn(i, t)
        if kind == "end":
            return self._end_turn(job[1], t)
        return self._ask(job[1], job[2], t, job[3])

    def _get(self, s: str, t: float, locked: bool = True, ahead: bool = False):
        """The session, restored if on disk: under the service's lock, or (`locked` False: a
        prompt's feed, which reads the file before it takes the lock) with events at their times;
        `ahead`: brought back already, beside the reads (the device spends nothing on it)."""
        h, seconds = self.store.get(s)
        if seconds and not ahead:
            t = self._busy(t, seconds, locked=locked)
        return h, t

    def _restore_ahead(self, s: str, t: float) -> None:
        """A request for `s` arrives at t: a session in the host tier or on disk starts coming back
        on the restores' thread, after the ones before it (as `server.restores` does)."""
        where = self.store.where(s)
        if where not in ("host", "disk"):
            return
        start = max(t, self.io_free)
        self.io_free = start + self.store.move_back_s(s)
        self.ahead[s] = (self.io_free, where)
        self.tally.restores_ahead += 1

    def _feed_prompt(self, i: int, t: float) -> float:
        r, s = self.req[i], self.req[i].session
        if self.latest.get(s, -1) > self.order[i]:
            return t  # a newer turn of the session fed its prompt first: this one came too late
        back = self.ahead.get(s)
        if back is not None and back[0] > t:
            self._at(back[0], AHEAD, i)  # still coming back: the device reads on meanwhile
            return t
        self.latest[s] = self.order[i]
        back = self.ahead.pop(s, None)
        h, t = self._get(s, t, locked=False, ahead=back is not None and self.store.where(s) == back[1])
        predicted = self.predicted.pop(s, None)  # the ids the next prompt shares with a prediction, else the ledger's
        shared = predicted[0] if predicted is not None else r.prompt_tokens - r.new_prompt_tokens
        feed = self.store.feed_prompt(h, r.prompt_tokens, shared)
        h.hold = r.prompt_tokens if self._predicts(r) else None
        if (predicted is not None or s in self.holding) and feed.rolled_back_to is not None:
            self.tally.predictions_missed += 1
        self.holding.discard(s)
        if feed.cached:  # started from the prefix cache: its copies charged as a host tier's move (an upper bound)
            t = self._busy(t, self.costs.host_s(self.store.prefix.start_bytes(feed.cached)))
        if feed.rolled_back_to is not None:
            self.tally.rollbacks += 1
            self.tally.ids_reread += feed.reread
        self.fed_prompt.add(i)
        self.out_fed[i] = 0
        self.fed[s] = r.prompt_tokens
        self._tell(s, t)
        return t

    def _output_seen(self, i: int, t: float, at_end: bool) -> int:
        r = self.req[i]
        if self.limits.ids == "none" or not r.output_seen:  # the next prompt brings it
            return 0
        if at_end:
            return r.output_tokens
        if not self.limits.output_streamed:
            return 0
        return readable(r, t) - r.prompt_tokens

    def _feed_output(self, i: int, t: float, at_end: bool = False) -> float:
        """Output ids of request i the shadow sees by now, fed (its session restored if on disk; not
        fed if its session was dropped without a disk: the next prompt brings them)."""
        s = self.req[i].session
        if i not in self.fed_prompt or self.latest.get(s) != self.order[i]:
            return t
        n = self._output_seen(i, t, at_end) - self.out_fed[i]
        if n <= 0 or not self.store.holds(s):
            return t
        h = self.store.peek(s)  # resident: not touched (live peeks first)
        if h is None:
            h, t = self._get(s, t)
        h.ids += n
        self.out_fed[i] += n
        self.fed[s] = self.fed.get(s, 0) + n
        self._tell(s, t)
        return t

    def _predicts(self, r: Request) -> bool:
        """Whether the proxy predicts this request's next prompt: on, and the ledger says what it
        predicts (`predicted_tokens`, from the big model's template)."""
        return self.limits.proxy and self.limits.predict and r.predicted_tokens > 0

    def _predict(self, i: int, t: float) -> float:
        """A turn's end, its output fed: as `ShadowService.predict`, the session reads on up to what
        the next prompt keeps of its ids (`predicted_kept`) and holds the rest, or, `read_ahead`,
        takes the next prompt's start as predicted; skipped where that would send back rows of
        the prompt read (the hold let go)."""
        r, s = self.req[i], self.req[i].session
        h = self.store.peek(s)
        if h is None or not self._predicts(r) or i not in self.fed_prompt or self.latest.get(s) != self.order[i]:
            return t
        held, h.hold = h.hold is not None, None
        if r.predicted_kept >= min(h.committed, r.prompt_tokens // self.grid * self.grid):
            if self.limits.read_ahead:
                feed = self.store.feed_prompt(h, r.predicted_tokens, r.predicted_kept)
                if feed.rolled_back_to is not None:  # an output read as it came (its hold let go)
                    self.tally.rollbacks += 1
                    self.tally.ids_reread += feed.reread
                self.predicted[s] = (r.predicted_confirmed, r.predicted_tokens)
                self.tally.predictions += 1
            elif held:
                h.hold = max(r.predicted_kept, h.committed)
                self.holding.add(s)
                self.tally.predictions += 1
        self._tell(s, t)
        return t

    def _end_turn(self, i: int, t: float) -> float:
        self.sched.turn_ended(i, t)
        if i in self.fed_prompt:
            t = self._settle(self.req[i].session, t)
        return t

    def _settle(self, keep: str | None, t: float) -> float:
        gone, seconds = self.store.settle(keep)
        self.tally.left += [(t, s, (self.store.find(s) or ModelledSession(s)).committed > 0) for s in gone]
        if seconds:
            t = self._busy(t, seconds, locked=True)
        for s in gone:
            self._tell(s, t)
        return t

    def _chunks(self, read: Read, t: float, scale: float = 1.0) -> tuple[int, float]:
        """Read `read.chunks` chunks of its session, one after another, each at `scale` times its
        cost: (chunks read, end)."""
        h = self.store.peek(read.session)
        done = 0
        for k in range(read.chunks):
            if h is None or h.committed != read.depth + k * self.grid or h.committed + self.grid > h.readable:
                break
            t = self._busy(t, self.costs.chunk(h.committed) * scale)
            self.store.advance(h)
            done += 1
        return done, t

    def _batch_cost(self, batch: list[ModelledSession]) -> float:
        """A batched read's seconds: each entry at its depth, a run's as a run's (`BatchTable`)."""
        counts: dict[str, int] = {}
        for h in batch:
            counts[h.name] = counts.get(h.name, 0) + 1
        depths = [d for _, d in entry_depths(batch, self.grid)]
        return self.costs.batch_s(depths, [counts[h.name] > 1 for h in batch])

    # a batched read of the share in pieces (`BandwidthRule.batch_read_s`) ----------------------

    def _begin_flight(self, read: Read, batch: list[ModelledSession], t: float) -> float:
        """A share batch estimated past `batch_s`: read in pieces between rounds (as `Reading.share`),
        its first ones now. Returns the device's time after them."""
        self.flight = Flight(read, batch, self._batch_cost(batch))
        return self._fly(t)

    def _fly(self, t: float, every: bool = False) -> float:
        """The batch under way: the next pieces (`driving.pieces_now` at the pieces' modelled time;
        `every`: all that are left, as anything else on the device finishes it first); over, its
        sessions move on and the scheduler is told."""
        f = self.flight
        pieces = self.limits.pieces
        left = pieces - f.ran
        n = left if every else pieces_now(self.sched.rule.batch_s, f.cost / pieces if f.ran else None, left)
        start, t = t, self._busy(t, f.cost * n / pieces)
        f.ran += n
        self.tally.share_s += t - start
        if not every:  # a gap between two rounds (the rest, read out by other work, is that work's)
            self.tally.longest_slice_s = max(self.tally.longest_slice_s, t - start)
        if f.ran < pieces:
            return t
        self.flight = None
        for h in f.batch:
            self.store.advance(h)
        self.tally.chunks_share += len(f.batch)
        self.tally.share_charged_s += self.sched.read_done(f.read, len(f.batch), f.cost, t)
        for name in dict.fromkeys(h.name for h in f.batch):
            self._tell(name, t)
        return t

    def _land(self, t: float) -> float:
        """Anything else that takes the device finishes the batch under way first."""
        return self._fly(t, every=True) if self.flight is not None else t

    def _read(self, read: Read, t: float) -> float:
        """A read the scheduler chose, made as `Reading.read` and `Reading.share` make it: a batch's
        entries still readable (`driving.batch_now`) in one forward, or, a share batch estimated
        past `batch_s` (`driving.in_pieces`), in pieces between rounds; a batch of one entry, or no
        batch, as its chunks one after another. Then `read_done`, its sessions told, and after an
        idle read a settle."""
        start = t
        batch: list[ModelledSession] = []
        if read.others:
            pieces = in_pieces(read, self.sched.rule.batch_s)
            read, batch = batch_now(read, self.store.peek(read.session), self.store.peek, self.grid)
            if pieces and len(batch) > 1:
                return self._begin_flight(read, batch, t)
        if len(batch) > 1:
            t = self._busy(t, self._batch_cost(batch))
            for h in batch:
                self.store.advance(h)
            done = len(batch)
        else:
            done, t = self._chunks(read, t)
        if read.window == "share":
            self.tally.chunks_share += done
            self.tally.share_s += t - start
            self.tally.longest_slice_s = max(self.tally.longest_slice_s, t - start)
        else:
            self.tally.chunks_idle += done
        charged = self.sched.read_done(read, done, t - start, t)
        if read.window == "share":
            self.tally.share_charged_s += charged
        for name in dict.fromkeys((read.session, *(name for name, _ in read.others))):
            self._tell(name, t)
        if read.window == "idle":
            t = self._settle(read.session, t)
        return t

    def _ask(self, s: str, arrived: float, t: float, kind: str | None = None, timeout_s: float = 10.0) -> float:
        """As `Asking.ask` on the device: the session first while it is read to its end (within the
        ask's timeout), one forward of its tail and the question in a fork, then a settle (which
        the modelled store charges nothing: live, the answer waits for it)."""
        began = t
        self.sched.question(s, t)
        h, t = self._get(s, t)
        self._tell(s, t)
        while t - arrived < timeout_s and h.committed + self.grid <= h.readable:
            read = Read(s, 1, "ask", h.committed, self.sched.costs.estimate(h.committed))
            start = t
            done, t = self._chunks(read, t, self.costs.ask_chunk_scale)
            self.tally.chunks_ask += done
            self.sched.read_done(read, done, t - start, t)
            self._tell(s, t)
        self.store.fork(h, h.ids - h.committed + self.limits.ask_tokens)
        samples = self.costs.ask_samples  # a live run's forwards, one drawn an ask; else the one cost
        t = self._busy(t, self.ask_draws.choice(samples) if samples else self.costs.ask_s)
        self.sched.answered(s, t)
        self.tally.asks.append(Answered(arrived, t - arrived, began - arrived, kind))
        return self._settle(s, t)

    def _phrase(self, t: float) -> float:
        """The voice at a decoding turn's status line that is due: a phrase where the turn's budget
        holds one (the line goes out without one otherwise)."""
        cost = self.costs.phrase_s
        for i, r in self.decoding.items():
            line = self.line_at.setdefault(i, r.first_token + LINE_QUIET_S)
            if line > t or i not in self.fed_prompt:
                continue
            self.line_at[i] = t + LINE_EVERY_S
            h = self.store.peek(r.session)
            if h is not None and h.hold is not None and self.limits.hold_max is not None \
                    and h.ids - h.committed > self.limits.hold_max:
                h.hold = None  # as live: the phrase needs the output read, so its hold is let go
                self._tell(r.session, t)
            used = self.voice_used.get(i, 0.0)
            if self.limits.voice_share * max(0.0, t - r.first_token) - used >= cost - 1e-9:
                t = self._land(t)  # a phrase's fork finishes the batch under way first
                self.voice_used[i] = used + cost
                self.tally.voice_s += cost
                self.tally.phrases += 1
                return self._busy(t, cost)
        return t

    # the loop -----------------------------------------------------------------------------

    def _round_s(self) -> float:
        return min(((r.end - r.first_token) / r.output_tokens for r in self.decoding.values() if r.output_tokens),
                   default=0.0)

    def run(self) -> None:
        t, sched = 0.0, self.sched
        while True:
            self._events(t, inclusive=True)
            if self.jobs:
                t = self._land(t)
                t = self._job(self.jobs.popleft(), t)
                continue
            if not self.heap:  # every event handled: what the shadow reads after the timeline counts for none
                break
            for i in list(self.decoding):  # the output streamed so far
                t2 = self._feed_output(i, t)
                if t2 != t:  # a restore took the device: look again
                    t = t2
                    break
            else:
                between = self.use_share and bool(self.decoding) and t >= self.next_round
                if self.flight is not None and (between or not sched.busy):
                    t = self._fly(t, every=not between)  # a round's pieces, or (the engine idle) the rest
                    self.next_round = t + self._round_s()
                    continue
                decision = Wait(math.inf) if self.flight is not None else sched.next_read(t, between_rounds=between)
                if isinstance(decision, Read):
                    t = self._read(decision, t)
                    if decision.window == "share":
                        self.next_round = t + self._round_s()
                    continue
                if self.limits.voice_share > 0 and self.decoding:  # a status line due: the voice may speak
                    t2 = self._phrase(t)
                    if t2 != t:
                        t = t2
                        continue
                wake = [decision.until]
                if self.heap:
                    wake.append(self.heap[0][0])
                if self.use_share and self.decoding and self.next_round > t:
                    wake.append(self.next_round)
                if self.limits.voice_share > 0:  # a decoding turn's next status line
                    wake += [self.line_at.get(i, r.first_token + LINE_QUIET_S) for i, r in self.decoding.items()
                             if i in self.fed_prompt]
                if self.limits.output_streamed:
                    for i, r in self.decoding.items():  # the next whole chunk of a decoding session's output
                        if i in self.fed_prompt:
                            wake.append(time_readable(r, (readable(r, t) // self.grid + 1) * self.grid))
                nxt = min(wake)
                if nxt == math.inf:
                    break
                t = max(nxt, math.nextafter(t, math.inf))
        for s in list(self.pending_fresh):
            self._censor(s, t)
