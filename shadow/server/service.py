"""The live shadow: turns and sessions. Each served request is one `ServedTurn` in the one turn
table, from its first byte to its end; its prompt and output ids are fed to the session it is
read into (named once, when its prompt ids are first known), every read is the read scheduler's
(`reading.Reading`), and each turn's check against the engine is kept per session.

The parts, one concern each, share one `Shared` (settings, device thread, lock, clock, turn table,
counters, journal, switch):

- `host.ModelHost`: the shadow (reader and store), given at once or loaded in the background;
- `reading.Reading` and `reading.Questions`: everything the shadow reads, the idle thread, the
  share between rounds, the sessions a question waits on;
- `standing.Standing`: standing questions, held at their line and answered there;
- `naming.SessionNames`: which store name a prompt is read into;
- `asking.Asking`: asks and summaries;
- `voicing.Voicing`: the voice's phrases.

One thread owns the device (`DeviceThread`): turns (or, behind a proxy, the feeding of the
shadow), chunks, asks, loads and spills run on it one at a time. The lock guards sessions, turns,
counters and the scheduler.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from shadow.core.driving import reread_without_hold
from shadow.core.prefixcache import cache_for
from shadow.core.reader import common_prefix
from shadow.core.schedule import ReadScheduler
from shadow.core.store import SessionStore
from shadow.engines.idcheck import SessionChecks, TurnCheck, TurnIds
from shadow.errors import ShadowInputError, ShadowNotExact, ShadowUnavailable
from shadow.model.config import ModelConfig
from shadow.server import gcpauses
from shadow.server.asking import Asking
from shadow.server.host import Loader, ModelHost, Shadow
from shadow.server.load import EngineLoad
from shadow.server.naming import SessionNames
from shadow.server.reading import Questions, Reading
from shadow.server.restores import RestoresAhead
from shadow.server.settings import ServeSettings
from shadow.server.shared import Shared
from shadow.server.standing import Standing, StandingQuestion
from shadow.server.timings import ServiceTimes
from shadow.server.turn import Fed, Rounds, ServedTurn, Shown
from shadow.server.voicing import VoiceParts, Voicing
from shadow.voice.voice import VoiceBudget

T = TypeVar("T")
log = logging.getLogger("shadow.serve")
RESOLVE_POLL_S = 0.01  # how often an ask about a session whose first turn is under way looks again


class ShadowService:
    """The live shadow for `settings`. `source` is the shadow (reader and store) itself, ready at
    once, or a function that loads it on the device thread after `start`, while requests pass
    through (proxy mode); until then nothing is fed and asks wait for it. Either way the read
    scheduler's estimates are measured at load. With a loader, a disk and
    `settings.store.unload_slack_gib`, an idle burst that leaves more than that free in the
    device's memory pool (`pool_free`, by default CUDA's reserved minus allocated bytes) parks
    every session on disk and lets the model go; the next turn or ask loads it again."""

    def __init__(self, settings: ServeSettings, source: Shadow | Loader, config: ModelConfig, *,
                 standing: StandingQuestion | None = None, voice: VoiceParts | None = None,
                 clock: Callable[[], float] = time.monotonic, pool_free: Callable[[], int] | None = None):
        self.settings, self.config = settings, config
        self.shared = shared = Shared(settings, clock)
        self.device, self.state_lock, self.clock = shared.device, shared.lock, clock
        self.turns, self.counters = shared.turns, shared.counters
        self.timings = ServiceTimes()  # each turn's time to its first token, each spill's and restore's seconds
        self.sched = ReadScheduler(settings.schedule, settings.model.grid, priorities=settings.priorities,
                                   turns=shared.turns)
        if settings.read_costs is not None:  # the load's own measurements replace them where it measures
            self.sched.warm_known(settings.read_costs)
        self.questions = Questions(self.sched, shared)
        self.answers = Standing(shared, standing, self.questions.hold)
        self.host = ModelHost(shared.device, source, on_load=self._on_load)
        self.reading = Reading(shared, self.host, self.sched, self.questions, self.answers, self._after_idle_round)
        self.voicing = Voicing(shared, self.host, self.reading, voice)
        self.asking = Asking(shared, self.host, self.reading, self.questions, config.vocab_size, self.resolve)
        self.names = SessionNames(settings.sessions.prefix_match, settings.sessions.max_branches)
        self.load = EngineLoad(shared.turns, settings.status.engine_slots)
        self.checks: dict[str, SessionChecks] = {}  # store name -> its turns' checks against the engine
        self._latest: dict[str, int] = {}  # store name -> the newest turn that fed its prompt
        # store name -> output ids its latest turn's engine produced and the shadow was never fed (an
        # engine that shows none: the next prompt brings them); a turn start counts them unread
        self._never_fed: dict[str, int] = {}
        self._cached_start: dict[int, int] = {}  # turn -> the grid line its session started at from the prefix cache
        self._predicted: dict[str, int] = {}  # store name -> ids its prediction keeps from a second read
        self._prediction_of: dict[int, dict] = {}  # turn id -> what its prompt found of a prediction (journaled)
        self._next_turn = 0
        self._overdue_told: set[int] = set()  # turns the watchdog has logged as overdue
        self.waiting = 0
        self.engine: dict | None = None  # proxy mode: the engine's dialect and id sources
        self.unsaved: list[tuple[str, str]] = []  # after `stop`: sessions it could not write, and why
        self.ahead = RestoresAhead() if settings.store.restore_ahead else None
        slack = settings.store.unload_slack_gib
        self.unload_slack = None if slack is None else int(slack * 2**30)  # None: never unload
        self._pool_free = pool_free or self.host.pool_free
        self.host.begin()

    def _on_load(self, shadow: Shadow) -> None:
        """On the loading thread, before the shadow is handed out: the scheduler's estimates, the voice."""
        self.reading.warm(shadow)
        self.voicing.on_load(shadow)
        shadow.store.timed = self.timings.stored
        shadow.store.annotate = self._checks_record
        if self.settings.prefix.on and shadow.reader.prefix_cache is None:  # a fresh one at each load
            shadow.reader.prefix_cache = cache_for(shadow.reader.model, shadow.grid, self.settings.prefix.gib)
        self._restore_checks(shadow)

    def _checks_record(self, name: str) -> dict | None:
        """What a session's file carries of its checks (the store calls it at each write)."""
        checks = self.checks.get(name)
        return None if checks is None else checks.record()

    def _restore_checks(self, shadow: Shadow) -> None:
        """The checks the store's files carry, for the sessions this service has none of (after a
        restart): a session is as exact as it was when written."""
        records = shadow.store.records()
        with self.state_lock:
            for name, (record, tokens) in records.items():
                if name in self.checks:
                    continue
                try:
                    self.checks[name] = SessionChecks.from_record(record, tokens)
                except ValueError:
                    log.warning("session %r: its file's record of checks is not one; it is not exact", name)

    # what the parts hold, for status and tests ----------------------------------------------

    @property
    def ready(self):
        return self.host.ready

    @property
    def reader(self):
        shadow = self.host.shadow
        return None if shadow is None else shadow.reader

    @property
    def store(self) -> SessionStore | None:
        shadow = self.host.shadow
        return None if shadow is None else shadow.store

    @property
    def standing(self) -> StandingQuestion | None:
        return self.answers.question

    @property
    def pending(self):
        """Standing questions waiting for the reader, by session."""
        return self.answers.pending

    # lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self.host.start_load()
        self.reading.start()

    def save_idle(self) -> list[tuple[str, str]]:
        """The first step of a stop: write every session no turn is in flight for (the store's
        `save`), on the device between reads; reading goes on. Returns those it could not write."""
        def save() -> list[tuple[str, str]]:
            self.reading.finish_in_flight()
            with self.state_lock:
                shadow = self.host.shadow
                if shadow is None:
                    return []
                in_turn = {t.session or t.requested for t in self.turns} - {None}
                return shadow.store.save(skip=in_turn)

        failed = self.device.run(save, "save")
        if failed:
            log.warning("stopping: %d idle session(s) not written yet: %s", len(failed),
                        ", ".join(name for name, _ in failed))
        return failed

    def stop(self) -> None:
        """A planned stop: the idle reader ends after its chunk in flight; sessions go to disk
        (those whose file already holds them are not written again). `unsaved` then lists those
        that could not be written, with why."""
        self.reading.stop()

        def close() -> tuple[SessionStore | None, int, list[tuple[str, str]]]:
            self.reading.finish_in_flight()
            with self.state_lock:
                shadow = self.host.shadow
                if shadow is None:
                    return None, 0, []
                n = len(shadow.store.names()) if shadow.store.disk is not None else 0
                return shadow.store, n, shadow.store.close()

        if self.ahead is not None:
            self.ahead.close()
        store, held, failed = self.device.run(close, "stop")
        self.device.close()
        self.unsaved = failed
        if store is not None and store.disk is not None:
            log.info("stopped: %d session(s) on disk in %s", held - len(failed), store.disk)
        else:
            log.info("stopped (no --disk: sessions are not kept)")
        for name, reason in failed:
            log.error("stopped: session %s could not be written: %s", name, reason)

    def busy(self) -> bool:
        return bool(self.turns) or self.waiting > 0

    def embedded_in_flight(self) -> int:
        """The embedded generator's turns generating or waiting to."""
        with self.state_lock:
            return sum(t.embedded for t in self.turns)

    def switch(self, on: bool, voice: bool | None = None) -> dict:
        """Turn the shadow (and the voice: as the shadow unless given) off or on. Off, it feeds and
        reads nothing; switched back on, its share starts afresh (`ReadScheduler.restart_stretch`)."""
        switch = self.shared.switch
        with self.state_lock:
            if on and not switch.shadow:
                self.sched.restart_stretch(self.clock())
            switch.shadow = on
            switch.voice = on if voice is None else voice
            return {"on": switch.shadow, "voice": switch.voice}

    def count_upstream_error(self, kind: str) -> None:
        """One more error of the engine behind the proxy, of `kind` (unreachable, status_4xx,
        status_5xx, broke_off, timeout: past a time limit, refused_added_fields)."""
        with self.state_lock:
            errors = self.counters.upstream_errors
            errors[kind] = errors.get(kind, 0) + 1

    # turns ------------------------------------------------------------------------------

    def begin_turn(self, requested: str | None = None, reference: str | None = None, *,
                   embedded: bool = False) -> ServedTurn:
        """A request arrives (the engine is busy: the idle window stops): its record, in the turn
        table until `end_turn`. `requested`: the session name it gave (None: found when its
        prompt ids are known); `reference`: its standing question's label, if sent; `embedded`:
        the embedded generator's turn (its rounds hold the device), else a proxied one."""
        shadow = self.host.shadow
        if shadow is None and self.shared.switch.shadow and self.host.load_error is None:
            self.host.start_load()  # let go after an idle burst: it loads while the engine reads the prompt
        with self.state_lock:
            self._next_turn += 1
            turn = ServedTurn(self._next_turn, self.clock(), requested=requested, reference=reference,
                              voice=VoiceBudget(self.settings.voice.share),
                              rounds=Rounds() if embedded else None, shown=None if embedded else Shown())
            self.turns.add(turn)
            self.counters.requests += 1
            self.sched.turn_started(turn.id, None, turn.started)
            if requested is not None:
                self._note_start(turn, requested)
            if requested is not None and shadow is not None and self.ahead is not None and self.shared.switch.shadow:
                turn.restoring = self.ahead.start(shadow.store, requested)  # beside the engine's prefill
        return turn

    def _note_start(self, turn: ServedTurn, name: str) -> None:
        """What the turn's session held unread when the turn named it (`turn.unread_at_start`), counted
        in `counters.turn_starts` (the replay's turn starts fresh, live): fresh under a chunk, a
        held output and the engine's output not fed yet (`_output_not_fed`) counted. A turn names
        its session once; the caller holds the lock."""
        shadow = self.host.shadow
        if shadow is None or not self.shared.switch.shadow:
            return
        unread = shadow.store.unread(name)
        if unread is not None:
            unread += self._output_not_fed(name, turn)
        turn.unread_at_start = unread
        state = "new" if unread is None else "fresh" if unread < shadow.grid else "behind"
        self.counters.turn_starts[state] += 1

    def _output_not_fed(self, name: str, turn: ServedTurn) -> int:
        """Output ids the engine has produced for session `name` that the shadow has not been fed: of
        proxied turns other than `turn` still in the table (a response that is over but whose end
        still waits for the device, which feeds its output; an engine that shows output ids only at
        the end), and of its latest ended turn, those never fed (`_never_fed`). The engine holds
        them, so a turn start counts them unread. The caller holds the lock."""
        ending = (t for t in self.turns if t is not turn and t.shown is not None and (t.session or t.requested) == name)
        return self._never_fed.get(name, 0) + sum(map(_not_fed, ending))

    def name_turn(self, turn: ServedTurn, prompt: Sequence[int]) -> str:
        """The store name the turn's prompt is read into, chosen once (the first time its prompt
        ids are known: `SessionNames.choose`) and told to the scheduler."""
        with self.state_lock:
            if turn.session is None:
                shadow = self.host.shadow
                name = self.names.choose(turn.requested, prompt, None if shadow is None else shadow.store,
                                         self.settings.model.grid if shadow is None else shadow.grid)
                if turn.requested is None:
                    self._note_start(turn, name)
                self.sched.turn_session(turn.id, name, self.clock())
            return turn.session

    def run_request(self, fn: Callable[[], T]) -> T:
        """Run a request's device work (a turn, the feeding of a proxied one) on the device; while
        it waits it counts as waiting (the idle reader stops), and how long it waited behind the
        reader is recorded."""
        with self.state_lock:
            self.waiting += 1
            self.reading.waiting(self.waiting)
            behind_reader = self.device.running == "reader"
        start = self.clock()

        def job() -> T:
            waited = (self.clock() - start) * 1000
            with self.state_lock:
                self.waiting -= 1
                self.reading.waiting(self.waiting)
                if behind_reader:
                    self.counters.max_wait_on_reader_ms = max(self.counters.max_wait_on_reader_ms, waited)
            return fn()

        return self.device.run(job, "turn")

    def set_prompt(self, turn: ServedTurn, prompt_ids: Sequence[int]) -> None:
        """On the device thread: feed the turn's prompt (rolling back where it differs from what
        the session held); a shadow an idle burst let go is loaded again first; a spilled session is
        read from disk without the state lock held. Ids outside the vocabulary are refused
        (ShadowInputError) before anything changes."""
        shadow = self.host.loaded() if self.shared.switch.shadow else None
        if shadow is None:  # no shadow (it failed to load), or switched off
            return
        ids = shadow.reader.check_ids(prompt_ids)
        name = self.name_turn(turn, ids)
        if self._latest.get(name, 0) > turn.id:
            return  # a newer turn of this session has fed already (only this thread feeds prompts)
        # a session in the host tier or on disk is brought back before the lock (ahead of its prompt
        # since the request came, when it named its session): no other request or status call waits on it
        ahead = self._ahead(turn, shadow, name)
        self.reading.finish_in_flight()  # a batch read in pieces ends before a prompt may roll back: not under the lock
        with self.state_lock:
            if self._latest.get(name, 0) > turn.id:
                return  # a newer turn of this session has fed already: this one came too late
            self._latest[name] = turn.id
            self._never_fed.pop(name, None)  # this prompt holds them
            session = self.reading.get(shadow, name, ahead)
            if ahead is not None and turn.restoring is not None:
                self.ahead.taken(ahead, session is ahead.session)
            turn.restoring = None
            behind = len(session.ids) - session.committed
            known = len(session.ids)
            feed = shadow.reader.feed_prompt(session, ids, hold_output=turn.hold_output)
            self.reading.fresh.due(name, turn.started, len(ids) // shadow.grid * shadow.grid)
            if feed.rolled_back_to is not None:
                self.counters.rollbacks += 1
                self.counters.ids_reread += feed.reread
            self._prediction_checked(name, feed, turn.id)
            self.checks.setdefault(name, SessionChecks()).replaced(known if feed.first_diff is None else feed.first_diff)
            turn.fed = Fed(prompt=True, prompt_len=len(ids))
            if feed.cached:
                self._cached_start[turn.id] = feed.cached
            self.names.touch(name)
            self.reading.sync(shadow, name)
            self.answers.register(shadow, session, ids, turn.reference, behind, turn.id)
        self.answers.answer_if_ready(shadow, session)

    def predict(self, turn: ServedTurn, ids: Sequence[int] | None) -> None:
        """A proxied turn's end, after its output was fed: `ids`, the next prompt's start as the
        template will render it, say how much of the session's ids the next prompt keeps. The
        session keeps the ids it was served (asks about it stay exact) and reads on up to where the
        prediction differs from them: the output past that stays held, unread, until the next
        prompt comes. With `--read-ahead` the session takes the prediction's ids instead and reads
        them before that prompt (`Reader.predict`; unverified until it comes). Not taken (counted as
        skipped, the hold lifted) when there is none or it differs from the prompt's rows read: the
        engine read other ids than the template renders. An output whose hold was let go
        (`Reading.let_hold_go`: a phrase or an ask needed it read) was read as it came: a read ahead
        then sends those rows back."""
        shadow = self.host.shadow
        if not turn.hold_output or shadow is None or not self.shared.switch.shadow or not turn.fed.prompt:
            return

        def job() -> None:
            with self.state_lock:
                name = turn.session
                session = shadow.store.peek(name)
                if session is None or self._latest.get(name) != turn.id:
                    return
                wanted = self._valid_ids(shadow, ids)
                same = common_prefix(session.ids, wanted) if wanted else -1
                counts = self.counters.predictions
                prompt_line = turn.fed.prompt_len // shadow.grid * shadow.grid
                if wanted is None or same < min(session.committed, prompt_line):
                    session.hold = None
                    counts["skipped"] += 1
                else:
                    held = session.hold is not None
                    if held or self.settings.engine.read_ahead:  # its next prompt confirms it or not
                        self._predicted[name] = reread_without_hold(session, same, shadow.grid) if held else 0
                    if self.settings.engine.read_ahead:
                        fed = shadow.reader.predict(session, wanted)
                        if fed.rolled_back_to is not None:  # an output read as it came (its hold let go)
                            self.counters.rollbacks += 1
                            self.counters.ids_reread += fed.reread
                        self.checks.setdefault(name, SessionChecks()).predicted_past(same)
                    elif held:
                        shadow.reader.hold_past(session, wanted)  # the part the next prompt keeps is read on
                    counts["made"] += 1
                turn.hold_output = False  # the hold is the prediction's now: the turn's end leaves it
                self.reading.sync(shadow, name)

        self.device.run(job, "predict")

    @staticmethod
    def _valid_ids(shadow: Shadow, ids: Sequence[int] | None) -> list[int] | None:
        if not ids:
            return None
        try:
            return shadow.reader.check_ids(ids)
        except ShadowInputError:
            return None

    def _prediction_checked(self, name: str, feed, turn: int) -> None:
        """A prompt came after a prediction for its session: confirmed, or missed (it sent the
        session back); counted, and kept for the turn's journal line."""
        avoided = self._predicted.pop(name, None)
        if avoided is None:
            return
        counts = self.counters.predictions
        if feed.rolled_back_to is None:
            counts["confirmed"] += 1
            counts["ids_not_read_twice"] += avoided
            self._prediction_of[turn] = {"outcome": "confirmed", "ids_not_read_twice": avoided}
        else:
            counts["missed"] += 1
            self._prediction_of[turn] = {"outcome": "missed", "ids_not_read_twice": 0}

    def _ahead(self, turn: ServedTurn, shadow: Shadow, name: str):
        """What was brought back of `name` since the turn's request came (waiting for the rest of
        it), else its host copy or file brought back now."""
        if turn.restoring is not None:
            ahead = self.ahead.take(turn.restoring, name)
            if ahead is not None:
                return ahead
        return shadow.store.restore_ahead(name)

    def first_token(self, turn: ServedTurn) -> None:
        """The turn's first output token: its decode starts, and with it the share."""
        with self.state_lock:
            if turn.id in self.turns:
                self.sched.first_token(turn.id, self.clock())
                self.timings.first_token.observe(self.clock() - turn.started)

    def add_output(self, turn: ServedTurn, ids: Sequence[int]) -> None:
        """On the device thread: append output ids, unless a newer turn of the session has fed its
        prompt since (that prompt holds this answer already, re-rendered), or the session was
        dropped past the cap without a disk (its ids are gone: the next prompt brings them all).
        O(len(ids)): the scheduler is told only when the session's whole chunks change (its
        decisions are by whole chunks)."""
        shadow = self.host.shadow
        if shadow is None or not self.shared.switch.shadow or not turn.fed.prompt:
            return
        with self.state_lock:
            name = turn.session
            if self._latest.get(name) != turn.id or not shadow.store.holds(name):
                return
            session = shadow.store.peek(name) or self.reading.get(shadow, name)  # spilled meanwhile: restored
            before = len(session.ids) - session.committed
            shadow.reader.feed_output(session, ids)  # checked before any change
            turn.fed.output_len += len(ids)
            grid = shadow.grid
            if (len(session.ids) - session.committed) // grid != before // grid:
                self.reading.sync(shadow, name)

    def between_rounds(self, turn: ServedTurn, output_ids: Sequence[int] = ()) -> int:
        """Between two rounds of the embedded generator, on the device thread: the new output ids
        fed, the share's slice read (none while a phrase is being written: its fork is open on a
        session), a step of the voice's phrase; what this costs beyond the chunks and phrases
        (which their budgets are charged) is timed (`counters.rounds`). Returns the chunks read."""
        start, read_before, voice_before, wait_before = (time.perf_counter(), turn.share_used, turn.voice.used_s,
                                                         turn.engine_wait_s)
        if output_ids:
            self.add_output(turn, output_ids)
        done = 0 if turn.rounds.phrase is not None else self.share_slice(turn)  # no read while a phrase's fork is open
        self.voicing.serve_phrases(turn)
        spent = time.perf_counter() - start
        self.counters.rounds.add(spent - (turn.share_used - read_before) - (turn.voice.used_s - voice_before)
                                 - (turn.engine_wait_s - wait_before))
        return done

    def share_slice(self, turn: ServedTurn) -> int:
        """Between two of the engine's rounds (or streamed deltas) of this turn, on the device
        thread: the chunks the scheduler grants the engine's share now (of whichever session it
        picks), their seconds charged to the turn. Returns the chunks read."""
        if turn.id not in self.turns:
            return 0
        done, seconds, waited = self.reading.share()
        with self.state_lock:
            turn.share_used += seconds
            turn.engine_wait_s += waited
        return done

    def feed_due(self, turn: ServedTurn, *, wait: bool, share: bool) -> bool:
        """Proxy mode: hand the shadow what of the turn waits for it (`turn.shown`: a prompt known
        and not fed, output ids not fed) and, with `share`, a share slice (between two deltas).
        With `wait` False nothing happens while the device is busy (False returns: it still
        waits); with `wait` the call queues for the device. Ids the shadow cannot take are skipped
        and logged."""
        shown = turn.shown
        prompt, output = shown.prompt_due, list(shown.output_due)
        if prompt is None and not output and not share:
            return True
        if prompt is not None and turn.restoring is not None and not turn.restoring.done():
            if not wait:
                return False  # its session is still coming back: the device goes on reading meanwhile
            concurrent.futures.wait([turn.restoring])
        start, read_before = time.perf_counter(), turn.share_used

        def feed() -> None:
            try:
                if prompt is not None:
                    if shown.engine_cached is None:  # counted before the session takes it in
                        shown.engine_cached = self.cached_prefix(turn.requested or turn.session, prompt)
                    self.set_prompt(turn, prompt)
                if output:
                    self.add_output(turn, output)
                if share:
                    self.share_slice(turn)
            except ShadowInputError as e:
                log.warning("the shadow skipped ids of turn %s: %s", turn.id, e,
                            extra={"session": turn.session, "turn": turn.id})

        if wait:
            self.run_request(feed)
        elif not self.device.run_if_idle(feed, "turn")[0]:
            return False
        if share and not wait:  # between two deltas: the bookkeeping, beyond the chunks read
            self.counters.rounds.add(time.perf_counter() - start - (turn.share_used - read_before))
        if prompt is not None:
            shown.fed_prompt, shown.prompt_due = prompt, None
        shown.fed_output += len(output)
        del shown.output_due[:len(output)]
        return True

    def end_turn(self, turn: ServedTurn) -> None:
        """The request is over; sessions past the cap spill, on the device (a spill reads session
        tensors, which nothing may change meanwhile)."""

        def end(settle: bool = True) -> None:
            with self.state_lock:
                if turn.id not in self.turns:
                    return
                self._overdue_told.discard(turn.id)
                self._cached_start.pop(turn.id, None)
                self._prediction_of.pop(turn.id, None)  # a turn ended without its journal line
                self.sched.turn_ended(turn.id, self.clock())
                if turn.shown is not None and turn.session is not None and self._latest.get(turn.session) == turn.id:
                    if _not_fed(turn):
                        self._never_fed[turn.session] = _not_fed(turn)
                    else:
                        self._never_fed.pop(turn.session, None)
                shadow = self.host.shadow
                if turn.hold_output and shadow is not None:
                    self._release_hold(shadow, turn)
                if settle and turn.fed.prompt and shadow is not None:
                    self.reading.settle(shadow, keep=turn.session)

        try:
            self.device.run(end, "end turn")
        except RuntimeError:
            if not self.device.closed:
                raise
            end(settle=False)  # the device has stopped (a stop, or its thread died): the turn still leaves the table

    def _release_hold(self, shadow: Shadow, turn: ServedTurn) -> None:
        """A turn that ends without a prediction (an error, a client gone) reads its output as it came."""
        session = shadow.store.peek(turn.session) if turn.session else None
        if session is not None and session.hold is not None and self._latest.get(turn.session) == turn.id:
            session.hold = None
            self.reading.sync(shadow, turn.session)

    # sessions -----------------------------------------------------------------------------

    def cached_prefix(self, requested: str | None, prompt: Sequence[int]) -> int:
        """How many of a prompt's ids the session (or one of its branches) held already: what an
        engine with a prefix cache holds for it, so the rest is what it must read."""
        with self.state_lock:
            shadow = self.host.shadow
            if requested is None or shadow is None:
                return 0
            held = (shadow.store.peek(name) for name in self.names.family(requested))
            return max((common_prefix(s.ids, prompt) for s in held if s is not None), default=0)

    def main_branch(self, session: str) -> str:
        """The store name an ask about `session` reads: of the session and its side branches, the
        one holding the most ids (the conversation, not a title request beside it)."""
        with self.state_lock:
            names = self.names.family(session)
            return session if len(names) == 1 else max(names, key=self._length)

    def known(self, session: str) -> bool:
        """A session some turn was read into or checked for (its prompt may have been unreadable),
        or one the store holds."""
        with self.state_lock:
            shadow = self.host.shadow
            return session in self.names.recent or session in self.checks or (
                shadow is not None and session in shadow.store.names())

    def _turn_names(self, session: str) -> bool:
        """Whether a turn in the table (in flight, or its end not yet fed) names `session`."""
        with self.state_lock:
            return any(session in (t.requested, t.session) for t in self.turns)

    def _length(self, name: str) -> int:
        """Ids the session holds (resident, or by its file's header); the caller holds the lock."""
        shadow = self.host.shadow
        if shadow is None:
            return 0
        s = shadow.store.peek(name)
        if s is not None:
            return len(s.ids)
        row = next((r for r in shadow.store.status() if r.name == name), None)
        return row.committed + row.pending if row is not None else 0

    # each session's checks against the engine ---------------------------------------------

    def record_turn(self, turn: ServedTurn, check: TurnCheck, ids: TurnIds | None = None,
                    lines: list[dict] | None = None) -> None:
        """A turn's check against the engine, as the shadow holds it (a part it did not read is
        `not_read`: `TurnCheck.as_read`): counted for its session and in `counters.turn_parts`,
        journaled (with the status lines the client was shown, each with its kind and time), and
        a session's first mismatch logged once."""
        with self.state_lock:
            name = turn.session or turn.requested or "(no session)"
            fed = turn.fed
            check = check.as_read(fed.prompt, fed.prompt and fed.output_len > 0, self._why_unread(turn))
            checks = self.checks.setdefault(name, SessionChecks())
            latest = fed.prompt and self._latest.get(name) == turn.id
            first = checks.add(turn.id, check, fed.prompt_len, fed.output_len, latest)
            parts = self.counters.turn_parts
            parts["prompt"][check.prompt_check] += 1
            parts["output"][check.output_check] += 1
            self._count_lines(lines or [])
            record = {"kind": "turn", "session": name, "turn": turn.id, **check.as_dict(),
                      "prompt_ids": None if ids is None or ids.prompt is None else len(ids.prompt),
                      "output_ids": None if ids is None else len(ids.output),
                      "notes": [] if ids is None else ids.notes,
                      "prefix_cache_line": self._cached_start.pop(turn.id, 0),
                      "prediction": self._prediction_of.pop(turn.id, None), "unread_at_start": turn.unread_at_start,
                      "time": time.time()}
            if lines:
                record["status_lines"] = lines
            self.shared.journal.write(record)
        if first:
            log.warning("session %s: turn %s does not match the engine (%s); the session is not exact from here on",
                        name, turn.id, "; ".join(check.reasons), extra={"session": name, "turn": turn.id})

    def _why_unread(self, turn: ServedTurn) -> str:
        """Why the shadow holds none of a part whose ids were known (the caller holds the lock)."""
        if not self.shared.switch.shadow:
            return "the shadow is switched off"
        if self.host.shadow is None:
            return "the shadow is not loaded" + (f" ({self.host.load_error})" if self.host.load_error else "")
        if turn.session is not None and self._latest.get(turn.session, turn.id) != turn.id:
            return "a newer turn of the session was read first"
        if turn.client_gone:
            return "the request was cancelled"
        return "the shadow could not take its ids (logged)"

    def _count_lines(self, lines: list[dict]) -> None:
        """Count the status lines a client was shown and the voice's phrases (the caller holds the lock)."""
        c = self.counters
        for line in lines:
            c.status_lines[line["kind"]] = c.status_lines.get(line["kind"], 0) + 1
            phrase = line.get("phrase")
            if phrase:
                if phrase.get("said"):
                    c.voice_said += 1
                else:
                    reason = phrase.get("reason") or "unknown"
                    c.voice_refused[reason] = c.voice_refused.get(reason, 0) + 1

    def journal_lines(self, turn: ServedTurn, lines: list[dict]) -> None:
        """The status lines a turn's client was shown, each with its kind, time and voice phrase
        (the embedded engine's turns: their check is journaled before their stream ends)."""
        if lines:
            with self.state_lock:
                self._count_lines(lines)
                self.shared.journal.write({"kind": "status_lines", "session": turn.session, "turn": turn.id,
                                           "status_lines": lines, "time": time.time()})

    def exactness(self, session: str) -> dict:
        """What the session's answers say of its ids: exact (every id it holds verified against the
        engine) or why not, and its checks (`SessionChecks.as_dict`: turns, and prompts and outputs
        by state). Known for every session a turn was checked for, even one that holds no ids."""
        with self.state_lock:
            checks = self.checks.get(session, SessionChecks())
            length = self._length(session)
            return {"exact": checks.exact(length), "why_not": checks.why_not(length),
                    "id_checks": checks.as_dict(length)}

    # standing questions -------------------------------------------------------------------

    def wants_label(self, turn: ServedTurn) -> bool:
        """Whether this turn's standing question waits for a label from the upstream model."""
        with self.state_lock:
            return self.answers.wants_label(turn.id)

    def upstream_label(self, turn: ServedTurn, label: str | None, answer: str | None) -> None:
        """The upstream model's answer to the turn's standing question (`label` when it is one of
        the choices, else None): it becomes the reference of the shadow's answer, which is then
        journaled (at once if the shadow answered already)."""
        self.device.run(lambda: self.answers.attach_label(turn.id, label, answer), "label")

    # questions --------------------------------------------------------------------------

    def resolve(self, session: str, timeout_s: float) -> tuple[str, dict]:
        """The store name an ask about `session` reads and its exactness (refused when required).
        A session whose first turn is under way (named by a request, its prompt not yet read) is
        waited for, within timeout_s: unavailable past it; one no turn named is unknown."""
        started = self.clock()
        self.host.wait_ready(timeout_s)
        while not self.known(session):
            if not self._turn_names(session):
                raise ShadowInputError(f"unknown session {session!r}")
            if self.clock() - started >= timeout_s:
                raise ShadowUnavailable(f"session {session!r} has its first turn under way and not yet read: "
                                        "ask again, or with a longer timeout_s")
            time.sleep(RESOLVE_POLL_S)
        name = self.main_branch(session)
        exact = self.exactness(name)
        if self.settings.require_exact and not exact["exact"]:
            refusal = ShadowNotExact(f"session {name!r} is not exact: {exact['why_not']}")
            refusal.exactness = exact  # the 409 carries exact and why_not too
            raise refusal
        return name, exact

    def ask(self, session: str, question: Sequence[int], choices: Sequence[int], labels: Sequence[str],
            timeout_s: float = 10.0, reference: str | None = None, *, fresh: bool | None = None) -> dict:
        """Read the session up to the question's insertion point (its last id, within timeout_s),
        then one forward of the pending tail and the question in a fork: the letters' softmax
        (`Asking.ask`)."""
        return self.asking.ask(session, question, choices, labels, timeout_s, reference, fresh=fresh)

    def summarize(self, session: str, prompt: Sequence[int], max_tokens: int, timeout_s: float = 10.0) -> dict:
        """Read the session to its end (within timeout_s), then decode greedily from a fork over the
        pending tail and `prompt` (a summary of the session); the session is left as it was."""
        return self.asking.summarize(session, prompt, max_tokens, timeout_s)

    # the idle window's unload -------------------------------------------------------------

    def _after_idle_round(self) -> None:
        if self.unload_slack is not None and self.host.can_unload and not self.busy() and self.device.idle():
            self.device.run(self._unload_if_slack, "unload")

    def _unload_if_slack(self) -> None:
        """On the device, after an idle burst with nothing left to read: when more than the slack
        sits free in the pool, park every session on disk and let the model go; the next turn or
        ask loads it again and reads on from disk."""
        shadow = self.host.shadow
        if (shadow is None or shadow.store.disk is None or self.busy() or self.pending
                or self._pool_free() <= self.unload_slack):
            return
        self.reading.finish_in_flight()
        with self.state_lock:
            if self.sched.has_backlog() or shadow.store.close():  # a session not written stays: no unload
                return
            self.reading.spilled(None)
            self.counters.unloads += 1
        self.host.unload()

    # status -----------------------------------------------------------------------------

    def _overdue(self) -> list[dict]:
        """The watchdog: turns in flight longer than the engine's timeout (`engine.timeout_s`),
        each logged once. Every turn ends in a `finally`, so one here is a turn that cannot end
        (or a response that legitimately streams that long); the caller holds the lock."""
        limit, now = self.settings.engine.timeout_s, self.clock()
        out = []
        for turn in self.turns:
            age = now - turn.started
            if age <= limit:
                continue
            out.append({"turn": turn.id, "session": turn.session or turn.requested, "age_s": round(age, 1),
                        "answered": turn.answered, "embedded": turn.embedded})
            if turn.id not in self._overdue_told:
                self._overdue_told.add(turn.id)
                log.warning("turn %s has been in flight for %.0f s, longer than the engine's timeout (%g s)", turn.id,
                            age, limit, extra={"session": turn.session, "turn": turn.id})
        return out

    def status(self) -> dict:
        jobs = self.device.times.status()  # sorted outside the state lock, which the rounds take
        with self.state_lock:
            c = self.counters
            shadow = self.host.shadow
            ready = shadow is not None
            sessions = []
            for r in shadow.store.status() if ready else []:
                s = shadow.store.peek(r.name)
                sessions.append(vars(r) | {"rollbacks": None if s is None else s.rollbacks,
                                           "id_checks": self.checks.get(r.name, SessionChecks()).as_dict(
                                               r.committed + r.pending)})
            return {
                "ready": ready, "load_error": self.host.load_error, "engine": self.engine,
                "grid": shadow.grid if ready else None, "weights": self.host.weights,
                "enabled": self.shared.switch.shadow, "voice": self.shared.switch.voice,
                "sessions": sessions,
                "branches": {k: list(v) for k, v in self.names.branches.items() if v},
                "store": shadow.store.totals() if ready else None,
                "prefix_cache": shadow.reader.prefix_cache.status()
                if ready and shadow.reader.prefix_cache is not None else None,
                "restores_ahead": self.ahead.counts.as_dict() if self.ahead is not None else None,
                "turns_in_flight": len(self.turns), "waiting": self.waiting,
                "overdue_turns": self._overdue(),
                "counters": {
                    "requests": c.requests, "chunks_idle": c.chunks_idle, "chunks_share": c.chunks_share,
                    "share_s": round(c.share_s, 6), "share_read_s": round(c.share_read_s, 6), "voice_s": round(c.voice_s, 6),
                    "decode_s": round(self.sched.decoded_s(self.clock()), 6),
                    "chunks_ask": c.chunks_ask, "batched_reads": dict(c.batched_reads), "read_pieces": c.read_pieces, "asks": c.asks, "last_chunk_ms": round(c.last_chunk_ms, 3),
                    "idle_s": round(c.idle_s, 6), "ask_s": round(c.ask_s, 6),
                    "rollbacks": c.rollbacks, "ids_reread": c.ids_reread, "predictions": dict(c.predictions),
                    "turn_starts": dict(c.turn_starts),
                    "upstream_errors": dict(c.upstream_errors),
                    "turn_parts": {p: dict(v) for p, v in c.turn_parts.items()},
                    "status_lines": dict(c.status_lines), "voice_said": c.voice_said,
                    "voice_refused": dict(c.voice_refused),
                    "standing_answered": c.standing_answered, "standing_replaced": c.standing_replaced,
                    "standing_pending": len(self.pending), "unloads": c.unloads,
                    "max_wait_on_reader_ms": round(c.max_wait_on_reader_ms, 3),
                },
                "reading": self.reading.status(),
                "idle_reader": self.reading.idle_status(),
                "last_answers": list(c.last_answers),
                "gc": None if gcpauses.installed() is None else gcpauses.installed().status(),
                "gaps": c.gaps.status(),
                "device_jobs": jobs,
            }


def _not_fed(turn: ServedTurn) -> int:
    """Output ids the engine produced for a proxied turn that the shadow has not been fed."""
    return max(0, turn.shown.reply.output_count() - turn.shown.fed_output)
