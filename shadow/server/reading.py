"""Read driving: the live service's side of the one read scheduler (`shadow.core.schedule`).

Everything the live shadow reads is decided by a `ReadScheduler` and reported back to it, as its
module docstring says a live caller does, always under the service's lock (the scheduler is not
thread-safe; reading itself runs outside the lock, on the device thread):

- at load (`warm`): one chunk of a scratch session read and left out (the first chunk after a
  load pays for caches, graphs and the allocator), then one chunk at each of a few depths, device
  synchronised, each warming the cost estimate of its depth; so no chunk is ever read inside a
  stream just to measure it;
- turns (`turn_started`, `turn_session` once a proxy finds the session, `first_token`,
  `turn_ended`; the scheduler keeps them in the service's one turn table) and requests waiting
  for the device (`waiting`);
- every change to a session (`sync`: after each feed, output, rollback and read, and after every
  spill and restore, which `get` and `settle` do);
- questions (`Questions`): a standing question holds its session at its line (`hold`), an ask
  puts its session first while it reads (`asking`);
- the idle thread: at each poll tick, while the engine is idle and a session has a whole chunk,
  it hands the device one job per chunk, which asks `next_read(now)` right before the chunk; a
  request that comes waits for at most one chunk;
- between two rounds of the engine or two streamed deltas, `share` asks
  `next_read(now, between_rounds=True)`; the chunks it names may be of another session than the
  turn's;
- every read (idle, share or ask) reports `read_done` with its device-synchronised seconds.

The idle thread never dies: a failed round is counted, logged and shown (`idle_status`), and the
next round goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol
from contextlib import contextmanager

import torch

from shadow.core.driving import batch_now, in_pieces, pieces_now, tell
from shadow.core.reader import BatchRead, Reader, Session
from shadow.core.schedule import WARM_DEPTHS, Read, ReadScheduler, Wait, batch_sizes
from shadow.core.store import Restored
from shadow.server.host import ModelHost, Shadow
from shadow.server.shared import Shared
from shadow.server.timings import DEVICE_SECONDS, Freshness, Histogram

log = logging.getLogger("shadow.serve")


def settle_device(reader: Reader) -> float:
    """`reader.synchronize()`, and the seconds it waited (0 off a GPU, where nothing runs ahead
    of the host)."""
    start = time.perf_counter()
    reader.synchronize()
    return time.perf_counter() - start


def scratch_read_s(reader: Reader, depth: int, clock: Callable[[], float], sessions: int = 1) -> float:
    """Seconds of one read of a chunk whose first row sits at `depth`, of each of `sessions`
    scratch sessions set `depth` rows deep (one: `Reader.advance`; more: one batched forward,
    `Reader.advance_batch`). Their rows are zeros: a chunk's cost depends on its depth and shape,
    not on the values. Device synchronised before and after."""
    grid = reader.grid
    scratch = [reader.new_session(f"(warm {k})") for k in range(sessions)]
    for s in scratch:
        for layer in s.state.attention:
            layer.reserve(depth + grid)
        s.state.length = depth
        s.ids = [0] * (depth + grid)
    reader.synchronize()
    start = clock()
    reader.advance_batch(scratch)
    reader.synchronize()
    return clock() - start


def measure_chunks(reader: Reader, clock: Callable[[], float], depths: Sequence[int] = WARM_DEPTHS,
                   sizes: Sequence[int] = ()) -> tuple[list[tuple[int, float]], list[tuple[int, int, float]]]:
    """(depth, seconds of one chunk) at each depth, and (size, depth, seconds of one batched read)
    for each batch size in `sizes` at each depth; a first read of each size is made before and
    left out (a batch size's graphs are captured there)."""
    chunks, batches = [], []
    for size in (1, *sizes):
        scratch_read_s(reader, 0, clock, size)
        times = [(depth, scratch_read_s(reader, depth, clock, size)) for depth in depths]
        if size == 1:
            chunks = times
        else:
            batches += [(size, depth, seconds) for depth, seconds in times]
        if reader.model.device.type == "cuda":
            torch.cuda.empty_cache()  # the scratch rows are not the sessions' memory
    return chunks, batches


@dataclasses.dataclass
class InFlight:
    """A batched read of the share under way: what `Reading._report` tells when it is over."""

    shadow: Shadow
    read: Read
    batch: list[Session]
    lines: dict
    batch_read: BatchRead


class Answers(Protocol):
    """Standing questions, as the reader sees them (`standing.Standing`)."""

    def line(self, name: str, grid: int) -> int | None:
        """The grid line a question holds `name` at (None: none)."""

    def answer_if_ready(self, shadow: Shadow, session: Session) -> None:
        """Answer `name`'s question if the reader sits at its line."""


class Questions:
    """Which sessions a question waits on, told to the scheduler: a standing question holds its
    session at its line (`hold`), an ask puts its session first while it reads (`asking`). The
    caller holds the service's lock around `hold`; `asking` takes it itself."""

    def __init__(self, sched: ReadScheduler, shared: Shared):
        self.sched, self.shared = sched, shared
        self._holds: dict[str, int] = {}  # session -> the line a standing question holds it at
        self._asks: dict[str, int] = {}  # session -> asks reading it now

    def hold(self, name: str, line: int | None) -> None:
        """A standing question holds `name` at `line` (None: released)."""
        if line is None:
            self._holds.pop(name, None)
        else:
            self._holds[name] = line
        self.tell(name)

    @contextmanager
    def asking(self, name: str) -> Iterator[None]:
        """An ask's session comes first while the ask reads it."""
        with self.shared.lock:
            self._asks[name] = self._asks.get(name, 0) + 1
            self.tell(name)
        try:
            yield
        finally:
            with self.shared.lock:
                self._asks[name] -= 1
                if not self._asks[name]:
                    del self._asks[name]
                self.tell(name)

    def waiting(self, name: str) -> bool:
        return name in self._holds or name in self._asks

    def names(self) -> list[str]:
        return sorted(set(self._holds) | set(self._asks))

    def tell(self, name: str) -> None:
        """Tell the scheduler whether a question waits on `name`."""
        now = self.shared.clock()
        if self.waiting(name):
            self.sched.question(name, now, stop=self._holds.get(name))
        else:
            self.sched.answered(name, now)


class Reading:
    """Drives `sched` for the service: every read, the idle thread, the share between rounds, an
    ask's reads. `answers` are the standing questions (a read stops at a question's line, and the
    question is answered there); `after_round()` runs after each idle round (the unload check)."""

    def __init__(self, shared: Shared, host: ModelHost, sched: ReadScheduler, questions: Questions,
                 answers: Answers, after_round: Callable[[], None] = lambda: None):
        self.shared, self.host, self.sched, self.questions = shared, host, sched, questions
        self.answers, self.after_round = answers, after_round
        self.device, self.lock, self.clock, self.counters = shared.device, shared.lock, shared.clock, shared.counters
        self.warm_depths = WARM_DEPTHS
        self.last: Read | Wait | None = None  # the scheduler's last answer
        self.stop_event = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shadow-idle", daemon=True)
        self.in_flight: InFlight | None = None  # a batched read in the share, read a piece a round (device thread)
        self.state = "not started"
        self.rounds = 0
        self.last_read_at: float | None = None
        self.chunk_seconds = {w: Histogram(DEVICE_SECONDS) for w in ("idle", "share", "ask")}  # a chunk's, each read
        self.fresh = Freshness()  # each turn's time to fresh

    def enabled(self) -> bool:
        return self.shared.switch.shadow

    # load ------------------------------------------------------------------------------------

    def warm(self, shadow: Shadow) -> None:
        """At load, on the loading thread: the scheduler takes the shadow's grid and its chunk costs
        measured on a scratch session, and with batches on each batch size's (`measure_chunks`),
        after the kernels' compiles for every depth a chunk, an ask or a fork may read at are done
        (`Reader.warm_kernels`)."""
        shadow.reader.warm_kernels()
        measured, batched = measure_chunks(shadow.reader, self.clock, self.warm_depths,
                                           batch_sizes(self.sched.rule.batch))
        with self.lock:
            self.sched.grid = shadow.grid
            for depth, seconds in measured:
                self.sched.costs.warm(depth, seconds)
            for size, depth, seconds in batched:
                self.sched.warm_batch(size, depth, seconds)
            self.sched.keep_alone(measured, batched)  # what `--share-charge alone` charges a share read at most
            self.sched.changes += 1

    # sessions (the caller holds the lock) ----------------------------------------------------

    def sync(self, shadow: Shadow, name: str) -> None:
        """Tell the scheduler a session's true state: its read position and ids while resident,
        else that it is not (spilled sessions wait on disk for their next turn)."""
        s = shadow.store.peek(name)
        self.fresh.reached(name, None if s is None else s.committed, self.clock())
        if tell(self.sched, name, s, self.clock()) and s is not None and self.questions.waiting(name):
            self.questions.tell(name)

    def get(self, shadow: Shadow, name: str, ahead: Restored | None = None) -> Session:
        """The session, resident (restored from disk or new, `ahead` its file read before the
        lock: `SessionStore.restore_ahead`), told to the scheduler."""
        session = shadow.store.get(name, ahead)
        self.sync(shadow, name)
        return session

    def settle(self, shadow: Shadow, keep: str | None) -> None:
        """Enforce the store's cap; the sessions it spilled are told as not resident."""
        shadow.store.settle(keep=keep)
        self.spilled(shadow)

    def spilled(self, shadow: Shadow | None) -> None:
        """Tell the scheduler which sessions left memory (every one, with no shadow)."""
        now = self.clock()
        for name, told in list(self.sched.sessions.items()):
            if told.resident and (shadow is None or shadow.store.peek(name) is None):
                tell(self.sched, name, None, now)

    # turns and requests (the caller holds the lock) -------------------------------------------

    def waiting(self, n: int) -> None:
        self.sched.waiting(n, self.clock())

    # reading (on the device thread, without the lock) ----------------------------------------

    def read(self, shadow: Shadow, session: Session, read: Read) -> tuple[int, float]:
        """Read `read.chunks` whole chunks of `session` (fewer at a standing question's line), or,
        for a batch, its entries still readable (`_entries`: as many as make a graphed batch size)
        in one forward; device synchronised before and after; report `read_done` and the sessions'
        true state; answer a question a read reached. Returns (chunks read, seconds)."""
        read, batch, lines, chunks = self._prepare(shadow, session, read)
        shadow.reader.synchronize()
        start = self.clock()
        if chunks <= 0 or not batch:
            done = 0
        elif len(batch) > 1:
            done = shadow.reader.advance_batch(batch)
        else:
            done = shadow.reader.advance(session, max_chunks=chunks)
        shadow.reader.synchronize()
        seconds = self.clock() - start
        self._report(shadow, read, batch, lines, done, seconds)
        return done, seconds

    def _prepare(self, shadow: Shadow, session: Session, read: Read) -> tuple[Read, list[Session], dict, int]:
        """(the read as it can be made now, its entries, the standing questions' lines of its
        sessions, the chunks of `session` to read when it is no batch)."""
        grid = shadow.grid
        with self.lock:
            batch = [session]
            if read.others:
                read, batch = batch_now(read, session, shadow.store.peek, grid,
                                        lambda name: self.answers.line(name, grid))
            lines = {name: self.answers.line(name, grid) for name in dict.fromkeys(s.name for s in batch)}
        line = lines.get(session.name)
        chunks = read.chunks if line is None else min(read.chunks, max(0, (line - session.committed) // grid))
        return read, batch, lines, chunks

    def _report(self, shadow: Shadow, read: Read, batch: list[Session], lines: dict, done: int, seconds: float) -> None:
        """A read is over: `read_done` (its chunks, seconds), the sessions' true state, the counters;
        a question a read reached answered."""
        end = self.clock()
        with self.lock:
            charged = self.sched.read_done(read, done, seconds, end)
            for name in lines:
                self.sync(shadow, name)
            c = self.counters
            if done:
                c.last_chunk_ms = seconds * 1000 / done
                self.chunk_seconds.get(read.window, self.chunk_seconds["ask"]).observe(seconds / done)
                self.last_read_at = end
            if done and len(batch) > 1 and read.window in c.batched_reads:
                c.batched_reads[read.window] += 1
            if read.window == "idle":
                c.chunks_idle += done
                c.idle_s += seconds
            elif read.window == "share":
                c.chunks_share += done
                c.share_s += charged
                c.share_read_s += seconds
            else:
                c.chunks_ask += done
                c.ask_s += seconds
        for name, line in lines.items():
            if line is not None:
                s = shadow.store.peek(name)
                if s is not None:
                    self.answers.answer_if_ready(shadow, s)

    def _decided(self, shadow: Shadow, decision: Read | Wait) -> Session | None:
        """The session a Read names, resident (the caller holds the lock); None for a Wait, or if
        the session left memory unseen (told now)."""
        self.last = decision
        if not isinstance(decision, Read):
            return None
        session = shadow.store.peek(decision.session)
        if session is None:
            self.sync(shadow, decision.session)
        return session

    def idle_once(self, at: float | None = None) -> Read | Wait:
        """One look of the idle window, as a device job: `next_read` (at `at`, the poll tick the
        caller woke for, else now) and, for a Read, its one chunk; the cap enforced after it."""

        def job() -> Read | Wait:
            self.finish_in_flight()  # a batch begun in the share, the engine idle since: read it out first
            with self.lock:
                shadow = self.host.shadow
                if shadow is None or not self.enabled():
                    return Wait(math.inf)
                decision = self.sched.next_read(self.clock() if at is None else at)
                session = self._decided(shadow, decision)
                if session is None:
                    return decision if isinstance(decision, Wait) else Wait(self.clock())
            self.read(shadow, session, decision)
            with self.lock:
                self.settle(shadow, keep=decision.session)
            return decision

        return self.device.run(job, "reader")

    def share(self) -> tuple[int, float, float]:
        """Between two rounds of the engine (or two streamed deltas), on the device thread: the
        chunks the scheduler grants the engine's share now, of whichever session it picks. O(1) while the
        scheduler's last answer between rounds still holds (`between_rounds_due`). Before a read
        the device finishes what is queued on it (the embedded engine's next round, launched
        before its token was handed out): that wait is the engine's, not the read's. A batched read
        estimated past `batch_s` is read in pieces, as many a round as fit `batch_s` (`_piece`),
        and no other read begins until it is over. Returns (chunks read, their seconds,
        seconds waited for the device first); a piece's chunks count when its read is over."""
        sched = self.sched
        if self.in_flight is not None:
            return self._piece()
        if not sched.between_rounds_due(self.clock()):  # nothing changed, and not yet due: no lock, no look
            return 0, 0.0, 0.0
        with self.lock:
            shadow = self.host.shadow
            if shadow is None or not self.enabled() or not sched.busy:
                return 0, 0.0, 0.0
            decision = sched.next_read(self.clock(), between_rounds=True)
            session = self._decided(shadow, decision)
        if session is None:
            return 0, 0.0, 0.0
        waited = settle_device(shadow.reader)
        if in_pieces(decision, sched.rule.batch_s):
            read, batch, lines, _ = self._prepare(shadow, session, decision)
            if len(batch) > 1:
                self.in_flight = InFlight(shadow, read, batch, lines, shadow.reader.begin_batch(batch))
                done, seconds, _ = self._piece()
                return done, seconds, waited
            return (*self.read(shadow, session, read), waited)
        return (*self.read(shadow, session, decision), waited)

    def _piece(self) -> tuple[int, float, float]:
        """The next pieces of the batched read under way (`driving.pieces_now`: one in the round it
        begins, with the read's setup, then as many as fit `batch_s` at the seconds its pieces
        have taken so far); reported once it is over (whoever finished it: a feed, a fork or a
        settle of the reader finishes it first). Returns (chunks, seconds, 0) like `share`."""
        flight = self.in_flight
        assert flight is not None
        read = flight.batch_read
        before = read.seconds
        if not read.over:
            read.step(pieces_now(self.sched.rule.batch_s, read.seconds / read.ran if read.ran else None,
                                 read.pieces - read.ran))
            with self.lock:
                self.counters.read_pieces += 1
        seconds = read.seconds - before
        if not read.over:
            return 0, seconds, 0.0
        return self.collect(), seconds, 0.0

    def collect(self) -> int:
        """Report the batched read under way if it is over (read to its end by this reader or by
        anything that settled the reader first); the chunks it read (0: none over)."""
        flight = self.in_flight
        if flight is None or not flight.batch_read.over:
            return 0
        self.in_flight = None
        done = flight.batch_read.chunks
        self._report(flight.shadow, flight.read, flight.batch, flight.lines, done, flight.batch_read.seconds)
        return done

    def finish_in_flight(self) -> None:
        """Read the batched read under way to its end and report it (outside the share's rounds:
        the idle window, an ask, a stop)."""
        if self.in_flight is not None:
            self.in_flight.batch_read.finish()
            self.collect()

    def let_hold_go(self, shadow: Shadow, session: Session, limit: int) -> bool:
        """A held output (`Session.hold`) that leaves more than `limit` ids unread is let go, to be
        read as it comes, when a fork must read the session (an ask, a phrase): counted. The caller
        holds the lock."""
        if session.hold is None or len(session.ids) - session.committed <= limit:
            return False
        session.hold = None
        self.shared.counters.predictions["holds_released"] += 1
        self.sync(shadow, session.name)
        return True

    def read_to_end(self, shadow: Shadow, name: str, timeout_s: float, started: float) -> tuple[Session, int, int]:
        """For an ask, on the device thread: read `name` to its last whole chunk, a chunk at a time
        (answering standing questions on the way), until timeout_s after `started`; returns
        (session, ids unread before, chunks read). A held output past what the ask may read in one
        fork is let go first (`let_hold_go`)."""
        self.finish_in_flight()
        with self.lock:
            s = self.get(shadow, name)
            self.let_hold_go(shadow, s, self.shared.settings.limits.max_ask_tail)
            behind = len(s.ids) - s.committed
        read = 0
        while self.clock() - started < timeout_s:
            with self.lock:
                held = self.answers.line(name, shadow.grid) is not None
                estimate = self.sched.costs.estimate(s.committed)
            if self.read(shadow, s, Read(name, 1, "ask", s.committed, estimate))[0]:
                read += 1
                continue
            with self.lock:
                answered = held and self.answers.line(name, shadow.grid) is None
            if not answered:  # nothing read, nothing answered
                break
        return s, behind, read

    # the idle thread -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """The idle thread ends after its chunk in flight."""
        self.stop_event.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        """One poll round after another until the stop. A round that fails (a spill's disk, a bug)
        is logged and counted, and the next round goes on: the thread never dies."""
        while not self.stop_event.is_set():
            try:
                self._round()
            except Exception as e:  # noqa: BLE001 - kept, counted, shown; the reader goes on
                with self.lock:
                    self.counters.idle_errors += 1
                    self.counters.idle_last_error = f"{type(e).__name__}: {e}"
                self.state = "error"
                log.exception("an idle round failed; the idle reader goes on")
                self.stop_event.wait(1.0)
        self.state = "stopped"

    def _round(self) -> None:
        """Sleep to the next poll tick, then one device job per chunk while the scheduler reads
        (its burst begins at the tick woken for)."""
        rule = self.sched.rule
        now = self.clock()
        tick = rule.next_poll(now + 1e-6)
        self.stop_event.wait(max(0.0, tick - now))
        at = tick if self.clock() - tick < rule.poll_s else None
        while not self.stop_event.is_set() and self._may_read():
            decision = self.idle_once(at)
            at = None
            if not isinstance(decision, Read):
                self.state = "between bursts" if decision.until < math.inf else "caught up"
                break
        self.rounds += 1
        self.after_round()

    def _may_read(self) -> bool:
        """Whether an idle look could read now (no device job spent otherwise); sets `state`."""
        with self.lock:
            if not self.enabled():
                self.state = "off"
            elif self.host.shadow is None:
                self.state = "no shadow"
            elif self.sched.busy:
                self.state = "engine busy"
            elif not self.sched.has_backlog():
                self.state = "caught up"
            elif not self.device.idle():
                self.state = "device busy"
            else:
                self.state = "reading"
                return True
            return False

    # status (the caller holds the lock) ------------------------------------------------------

    def status(self) -> dict:
        """The scheduler's estimates (ms a chunk by the depth of its first row; with batches, ms of a
        batched read by batch size, then depth), the share the engine's decode stretch holds now,
        and what it knows of the engine."""
        now = self.clock()
        sched = self.sched
        return {
            "chunk_ms_by_depth": _ms_by_depth(sched.costs),
            "batch_ms_by_depth": {str(b): _ms_by_depth(costs) for b, costs in sorted(sched.batch_costs.items())},
            # what a share read is charged (`--share-charge`), and at most under alone (the costs kept at load)
            "charge": sched.rule.charge,
            "charge_ms_by_depth": None if sched.alone is None else _ms_by_depth(sched.alone[0]),
            "charge_batch_ms_by_depth": None if sched.alone is None else
            {str(b): _ms_by_depth(costs) for b, costs in sorted(sched.alone[1].items())},
            "share_left_s": round(sched.share_left(now), 6), "share_used_s": round(sched.share_used, 6),
            "decoding": sched.decoding, "busy": sched.busy, "backlog": sched.has_backlog(),
            "questions": self.questions.names(),
            "bookkeeping_us": self.counters.rounds.summary(),
            "known_costs": None if self.shared.settings.read_costs is None else self.shared.settings.read_costs.label,
            "last_decision": None if self.last is None else type(self.last).__name__.lower(),
            "priorities": sched.priorities.label,
            "in_flight": self._in_flight_status(),
        }

    def _in_flight_status(self) -> dict | None:
        """The batched read of the share under way (read a piece a round), or None."""
        flight = self.in_flight
        if flight is None:
            return None
        return {"chunks": flight.batch_read.chunks, "pieces": flight.batch_read.pieces,
                "pieces_read": flight.batch_read.ran, "sessions": list(flight.lines)}

    def idle_status(self) -> dict:
        c = self.counters
        alive = self._thread.is_alive()
        dead = "stopped" if self.stop_event.is_set() else "dead" if self._thread.ident else "not started"
        return {"alive": alive, "state": self.state if alive else dead,
                "rounds": self.rounds, "errors": c.idle_errors, "last_error": c.idle_last_error,
                "last_read_s_ago": None if self.last_read_at is None else round(self.clock() - self.last_read_at, 3)}


def _ms_by_depth(costs) -> dict[str, float]:
    """A `ChunkCosts` table as status shows it: ms by the depth of each bucket's first row."""
    return {str(d): round(seconds * 1000, 3) for d, seconds in costs.table().items()}
