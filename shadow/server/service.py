"""The live shadow: sessions fed from served turns, read under the one read scheduler, asked over HTTP.

`ShadowService` composes small parts, one concern each:

- `host.ModelHost`: the model, given at once or loaded in the background on the device thread;
  one `Model` handle (reader and store) a job takes once; unloaded after an idle burst;
- `reading.Reading`: drives `shadow.core.schedule.ReadScheduler` for everything the shadow reads (the
  idle thread, the share between rounds, asks), its estimates warmed at load;
- `standing.Standing`: standing questions, held at their line and answered there; the journal;
- `naming.SessionNames`: which store name a prompt is read into (side branches, prefix matching);
- `asking.Asking`: asks and summaries (a session read to its end, then one fork);

and keeps the turns, each session's checks against the engine, the voice, and status.
One thread owns the device (`DeviceThread`): turns (or, behind a proxy, the feeding of the
shadow), chunks, asks, loads and spills run on it one at a time. `state_lock` guards sessions,
turns, counters and the scheduler.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from shadow.errors import ShadowInputError, ShadowNotExact
from shadow.model.config import ModelConfig
from shadow.core.reader import Reader, common_prefix
from shadow.core.schedule import BandwidthRule, ReadScheduler
from shadow.server.asking import Asking
from shadow.server.counters import Counters
from shadow.server.device import DeviceThread
from shadow.server.host import Model, ModelHost
from shadow.engines.idcheck import SessionChecks, TurnCheck, TurnIds
from shadow.server.naming import SessionNames
from shadow.server.reading import WARM_DEPTHS, Reading
from shadow.offline.journal import Journal
from shadow.server.standing import Pending, Standing, StandingQuestion, load_standing
from shadow.core.store import SessionStore
from shadow.voice.voice import Phrase, Voice, VoiceBudget

__all__ = ["Counters", "Pending", "ShadowService", "StandingQuestion", "Turn", "load_standing"]

T = TypeVar("T")
log = logging.getLogger("shadow.serve")


@dataclass
class Turn:
    """One request being served: its session (the store's name: the session, or a side branch of
    it), the name the request gave (None: found by prefix or new), when it started, when its
    first token came."""

    session: str | None
    started: float
    requested: str | None = None
    prompt_len: int = 0  # ids of the prompt fed
    output_len: int = 0  # output ids fed after it
    first_token: float | None = None
    share_used: float = 0.0  # seconds read in the share between this turn's rounds
    voice: VoiceBudget = field(default_factory=VoiceBudget)
    phrases: deque = field(default_factory=deque)  # phrase requests waiting for this turn's rounds (embedded)
    embedded: bool = False  # the embedded engine's turn: it holds the device through its rounds
    prompt_fed: bool = False
    reference: str | None = None


class ShadowService:
    """The live shadow. With `reader` and `store` it is ready at once; with `load` instead (a
    function returning reader, store and the weights' label) it loads on the device thread as
    its first job after `start`, while requests pass through (proxy mode); until then nothing
    is fed, no session is matched by prefix, and asks wait for it. Either way the read
    scheduler's estimates are measured at load (`warm_depths`). With a loader, a disk and
    `unload_slack_bytes`, an idle burst that leaves more than that free in the device's memory
    pool (`pool_free`, by default CUDA's reserved minus allocated bytes) parks every session on
    disk and drops the model; the next turn or ask loads it again and reads on from disk."""

    def __init__(
        self, reader: Reader | None, store: SessionStore | None, rule: BandwidthRule = BandwidthRule(),
        journal: Path | None = None, weights: str = "", clock=time.monotonic,
        standing: StandingQuestion | None = None,
        load: Callable[[], tuple[Reader, SessionStore, str]] | None = None, config: ModelConfig | None = None,
        unload_slack_bytes: int | None = None, pool_free: Callable[[], int] | None = None,
        label_from_upstream: bool = False, prefix_match: bool = False, require_exact: bool = False,
        max_branches: int = 8, max_ask_tail: int | None = None, voice_tokenizer=None, voice_share: float = 0.03,
        voice_reader: Reader | None = None, warm_depths: Sequence[int] = WARM_DEPTHS,
    ):
        if (reader is None or store is None) and (load is None or config is None):
            raise ValueError("give a reader and a store, or a function that loads them and the model's config")
        self.config = reader.model.config if reader is not None else config
        self.rule, self.clock = rule, clock
        self.journal = Path(journal) if journal else None
        self.standing = standing
        self.enabled = True  # switched off, the shadow feeds and reads nothing (for A/B runs)
        self.voice_tokenizer = voice_tokenizer  # with it, the voice writes phrases after status lines
        self.voice_reader = voice_reader  # a model of its own for the voice (else the shadow's, forked)
        self.voice_share = voice_share
        self.voice: Voice | None = None
        self.voice_enabled = True  # switched off (A/B runs), no phrase is written
        self.unload_slack = unload_slack_bytes  # None: never unload
        self.label_from_upstream = label_from_upstream  # a turn with no label header: the proxy asks the engine
        self.require_exact = require_exact  # asks on sessions not verified against the engine answer 409
        self.engine: dict | None = None  # proxy mode: the engine's dialect and id sources
        # the GPU (or CPU): generator, reader, asks, loads, and any spill of a session to disk
        self.device = DeviceThread()
        self.state_lock = threading.Lock()  # sessions, turns, counters, the scheduler
        self.turns: dict[int, Turn] = {}
        self.waiting = 0
        self.counters = Counters()
        self.checks: dict[str, SessionChecks] = {}  # store name -> its turns' checks against the engine
        self._latest: dict[str, int] = {}  # store name -> the newest turn that fed its prompt
        self.names = SessionNames(prefix_match, max_branches)
        self.host = ModelHost(self.device, load, on_load=self._on_load)
        self.reading = Reading(ReadScheduler(rule, reader.grid if reader is not None else 512), self.host,
                               self.device, self.state_lock, clock, self.counters, lambda: self.enabled, warm_depths)
        self.answers = Standing(standing, Journal(self.journal, self.counters.last_answers), self.counters, clock,
                                self.state_lock, self.reading.hold, label_from_upstream)
        self.reading.stop_line = self.answers.line
        self.reading.after_read = self.answers.answer_if_ready
        self.reading.after_round = self._after_idle_round
        self.asking = Asking(self.host, self.reading, self.device, self.state_lock, clock, self.counters,
                             self.answers.journal, self.config.vocab_size, self._asked, max_ask_tail)
        self._pool_free = pool_free or self.host.pool_free
        if reader is not None and store is not None:
            self.host.use(reader, store, weights)

    def _on_load(self, model: Model) -> None:
        """On the loading thread, before the model is handed out: the scheduler's estimates, the
        voice (its cost measured on a scratch session)."""
        self.reading.warm(model)
        if self.voice_tokenizer is None:
            self.voice = None
        elif self.voice_reader is not None:  # --voice-model: its own model, reading a window of each session
            self.voice = Voice(self.voice_reader, self.voice_tokenizer, own_model=True)
        else:
            self.voice = Voice(model.reader, self.voice_tokenizer)
        if self.voice is not None:
            try:
                self.voice.warm()
            except Exception:  # noqa: BLE001 - unmeasured, a phrase asks for a whole slice
                log.exception("the voice's cost could not be measured at load; it is measured by its first phrase")

    # the parts' state, as attributes ------------------------------------------------------

    @property
    def ready(self) -> threading.Event:
        return self.host.ready

    @property
    def reader(self) -> Reader | None:
        model = self.host.model
        return None if model is None else model.reader

    @property
    def store(self) -> SessionStore | None:
        model = self.host.model
        return None if model is None else model.store

    @property
    def weights(self) -> str:
        return self.host.weights

    @property
    def load_error(self) -> str | None:
        return self.host.load_error

    @property
    def pending(self) -> dict[str, Pending]:
        """Standing questions waiting for the reader, by session."""
        return self.answers.pending

    @property
    def _stop(self) -> threading.Event:
        """Set, the idle reader stops (after its chunk in flight)."""
        return self.reading.stop_event

    # lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self.host.start_load()
        self.reading.start()

    def stop(self) -> None:
        """A planned stop: the idle reader ends after its chunk in flight; sessions go to disk."""
        self.reading.stop()

        def close() -> tuple[SessionStore | None, int, list[tuple[str, str]]]:
            with self.state_lock:
                model = self.host.model
                if model is None:
                    return None, 0, []
                n = len(model.store.names()) if model.store.disk is not None else 0
                return model.store, n, model.store.close()

        store, held, failed = self.device.run(close, "stop")
        self.device.close()
        if store is not None and store.disk is not None:
            log.info("stopped: %d session(s) on %s", held - len(failed), store.disk)
        for name, reason in failed:
            log.error("stopped: session %s could not be written: %s", name, reason)

    def busy(self) -> bool:
        return bool(self.turns) or self.waiting > 0

    # turns ------------------------------------------------------------------------------

    def run_request(self, fn: Callable[[], T]) -> T:
        """Run a request's device work (a turn, the feeding of a proxied one) on the device; while it
        waits it counts as waiting (the idle reader stops), and how long it waited behind the
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

    def begin_turn(self, turn_id: int, session: str | None, prompt_ids: Sequence[int] | None = None,
                   reference: str | None = None, requested: str | None = None) -> None:
        """A request starts (the engine is busy: the idle window stops). `session` is the store name
        when known (see `session_for`); else it is found when the prompt comes, from `requested`
        (the name the request gave, or None). With its prompt, the prompt is fed (rolling back
        where it differs), on the device thread. Checks ids before any change."""
        model = self.host.model
        ids = None if prompt_ids is None or model is None else model.reader.check_ids(prompt_ids)
        if model is None and self.enabled and self.host.load_error is None:
            self.host.start_load()  # let go after an idle burst: it loads while the engine reads the prompt
        with self.state_lock:
            self.turns[turn_id] = Turn(session, self.clock(), requested=requested, reference=reference,
                                       voice=VoiceBudget(self.voice_share))
            self.counters.requests += 1
            self.reading.turn_started(turn_id, session)
        if ids is not None:
            self.set_prompt(turn_id, ids)

    def set_prompt(self, turn_id: int, prompt_ids: Sequence[int]) -> None:
        """Feed a turn's prompt once known (a proxy learns it from the engine), on the device
        thread; a model an idle burst let go is loaded again first."""
        model = self.host.loaded() if self.enabled else None
        if model is None:  # no model (it failed to load), or switched off
            return
        ids = model.reader.check_ids(prompt_ids)
        turn = self.turns[turn_id]
        if turn.session is None:
            name = self.session_for(turn.requested, ids)
            with self.state_lock:
                turn.session = name
                self.reading.turn_session(turn_id, name)
        with self.state_lock:
            if self._latest.get(turn.session, 0) > turn_id:
                return  # a newer turn of this session has fed already: this one came too late
            self._latest[turn.session] = turn_id
            session = self.reading.get(model, turn.session)
            behind = len(session.ids) - session.committed
            known = len(session.ids)
            feed = model.reader.feed_prompt(session, ids)
            self.checks.setdefault(turn.session, SessionChecks()).replaced(
                known if feed.first_diff is None else feed.first_diff)
            turn.prompt_fed, turn.prompt_len, turn.output_len = True, len(ids), 0
            self.names.touch(turn.session)
            self.reading.sync(model, turn.session)
            self.answers.register(model, session, ids, turn.reference, behind, turn_id)
        self.answers.answer_if_ready(model, session)

    def has_prompt(self, turn_id: int) -> bool:
        with self.state_lock:
            return self.turns[turn_id].prompt_fed

    def first_token(self, turn_id: int) -> None:
        with self.state_lock:
            self.turns[turn_id].first_token = self.clock()
            self.reading.first_token(turn_id)

    def add_output(self, turn_id: int, ids: Sequence[int]) -> None:
        """Append output ids, unless a newer turn of the session has fed its prompt since (that
        prompt holds this answer already, re-rendered)."""
        model = self.host.model
        if not self.enabled or model is None or not self.has_prompt(turn_id):
            return
        with self.state_lock:
            turn = self.turns[turn_id]
            if self._latest.get(turn.session) != turn_id:
                return
            model.reader.feed_output(self.reading.get(model, turn.session), ids)
            turn.output_len += len(ids)
            self.reading.sync(model, turn.session)

    def share_slice(self, turn_id: int) -> int:
        """Between two of the engine's rounds (or streamed deltas) of this turn, on the device
        thread: the chunks the scheduler grants the engine's share now (of whichever session it
        picks: the turn's or another), their seconds charged to the turn. Returns the chunks read."""
        with self.state_lock:
            turn = self.turns.get(turn_id)
        if turn is None:
            return 0
        done, seconds = self.reading.share()
        with self.state_lock:
            turn.share_used += seconds
        return done

    def end_turn(self, turn_id: int) -> None:
        """The request is over; sessions past the cap spill, on the device (a spill reads session
        tensors, which nothing may change meanwhile)."""

        def end() -> None:
            with self.state_lock:
                turn = self.turns.pop(turn_id)
                self.reading.turn_ended(turn_id)
                model = self.host.model
                if turn.prompt_fed and model is not None:
                    self.reading.settle(model, keep=turn.session)

        self.device.run(end, "end turn")

    # sessions -----------------------------------------------------------------------------

    def session_for(self, requested: str | None, prompt: Sequence[int]) -> str:
        """The store name a prompt is read into (`SessionNames.choose`): the named session, the
        longest matching one (prefix matching on), a new `auto-N`, or a side branch `NAME~K`."""
        with self.state_lock:
            model = self.host.model
            return self.names.choose(requested, prompt, None if model is None else model.store,
                                     512 if model is None else model.grid)

    def cached_prefix(self, requested: str | None, prompt: Sequence[int]) -> int:
        """How many of a prompt's ids the session (or one of its branches) held already: what an
        engine with a prefix cache holds for it, so the rest is what it must read."""
        with self.state_lock:
            model = self.host.model
            if requested is None or model is None:
                return 0
            held = (model.store.peek(name) for name in self.names.family(requested))
            return max((common_prefix(s.ids, prompt) for s in held if s is not None), default=0)

    def main_branch(self, session: str) -> str:
        """The store name an ask about `session` reads: of the session and its side branches, the
        one holding the most ids (the conversation, not a title request beside it)."""
        with self.state_lock:
            names = self.names.family(session)
            return session if len(names) == 1 else max(names, key=self._length)

    def known(self, session: str) -> bool:
        with self.state_lock:
            model = self.host.model
            return session in self.names.recent or (model is not None and session in model.store.names())

    def _length(self, name: str) -> int:
        """Ids the session holds (resident, or by its file's header); the caller holds the lock."""
        model = self.host.model
        if model is None:
            return 0
        s = model.store.peek(name)
        if s is not None:
            return len(s.ids)
        row = next((r for r in model.store.status() if r.name == name), None)
        return row.committed + row.pending if row is not None else 0

    # each session's checks against the engine ---------------------------------------------

    def record_turn(self, turn_id: int, check: TurnCheck, ids: TurnIds | None = None,
                    lines: list[dict] | None = None) -> None:
        """A turn's check against the engine: counted for its session, journaled (with the status
        lines the client was shown, each with its kind and time), and a session's first mismatch
        logged once."""
        with self.state_lock:
            turn = self.turns.get(turn_id)
            name = (turn.session or turn.requested) if turn else None
            name = name or "(no session)"
            checks = self.checks.setdefault(name, SessionChecks())
            latest = turn is not None and turn.prompt_fed and self._latest.get(name) == turn_id
            first = checks.add(turn_id, check, turn.prompt_len if turn else 0, turn.output_len if turn else 0, latest)
            record = {"kind": "turn", "session": name, "turn": turn_id, **check.as_dict(),
                      "prompt_ids": None if ids is None or ids.prompt is None else len(ids.prompt),
                      "output_ids": None if ids is None else len(ids.output),
                      "notes": [] if ids is None else ids.notes, "time": time.time()}
            if lines:
                record["status_lines"] = lines
            self.answers.journal.write(record)
        if first:
            log.warning("session %s: turn %s does not match the engine (%s); the session is not exact from here on",
                        name, turn_id, "; ".join(check.reasons))

    def journal_lines(self, turn_id: int, session: str, lines: list[dict]) -> None:
        """The status lines a turn's client was shown, each with its kind, time and voice phrase
        (the embedded engine's turns: their check is journaled before their stream ends)."""
        if lines:
            with self.state_lock:
                self.answers.journal.write({"kind": "status_lines", "session": session, "turn": turn_id,
                                            "status_lines": lines, "time": time.time()})

    def exactness(self, session: str) -> dict:
        """What the session's answers say of its ids: exact (every turn verified) or why not."""
        with self.state_lock:
            checks = self.checks.get(session, SessionChecks())
            length = self._length(session)
            return {"exact": checks.exact(length), "why_not": checks.why_not(length),
                    "id_checks": checks.as_dict(length)}

    # standing questions -------------------------------------------------------------------

    def wants_label(self, turn_id: int) -> bool:
        """Whether this turn's standing question waits for a label from the upstream model."""
        with self.state_lock:
            return self.answers.wants_label(turn_id)

    def upstream_label(self, turn_id: int, label: str | None, answer: str | None) -> None:
        """The upstream model's answer to the turn's standing question (`label` when it is one of
        the choices, else None): it becomes the reference of the shadow's answer, which is then
        journaled (at once if the shadow answered already)."""
        self.device.run(lambda: self.answers.attach_label(turn_id, label, answer), "label")

    # the voice ---------------------------------------------------------------------------

    def voice_phrase(self, turn_id: int, kind: str, extra: Sequence[int] = (), recent: Sequence[str] = (),
                     lang: str = "en", wait_s: float = 0.3) -> Phrase | None:
        """A voice phrase for a status line of this turn, if the turn's voice budget holds one and
        the device can write it now: at once where the device is free (proxy mode), else between
        two of the turn's own rounds (embedded), waiting at most `wait_s` for it to start (one
        that started is waited for and kept: its time is spent). None: nothing tried, or the
        voice failed (logged); it never raises, so a stream goes on without its phrase."""
        with self.state_lock:
            turn, voice, model = self.turns.get(turn_id), self.voice, self.host.model
            if (voice is None or model is None or not self.enabled or not self.voice_enabled or turn is None
                    or turn.session is None or not turn.prompt_fed):
                return None
            cost = voice.estimate(voice.prefill(model.store.peek(turn.session), len(extra)))
            if not turn.voice.allows(turn.first_token, self.clock(), cost):
                return None
        job = lambda: self._phrase(voice, turn, kind, extra, recent, lang)  # noqa: E731
        try:
            ran, result = self.device.run_if_idle(job, "voice")
            if ran:
                return result
            if turn.embedded:  # the turn's own rounds hold the device: it serves phrases between them
                request = Future()
                turn.phrases.append((job, request))
                try:
                    return request.result(timeout=wait_s)
                except FutureTimeout:
                    return None if request.cancel() else request.result()
        except Exception:  # noqa: BLE001 - the line goes out with its facts alone
            log.exception("turn %s: the voice failed; its %s line goes out without a phrase", turn_id, kind)
        return None

    def serve_phrases(self, turn_id: int) -> None:
        """Between two rounds of a turn, on the device: write the phrases its stream asked for."""
        turn = self.turns.get(turn_id)
        while turn is not None and turn.phrases:
            job, request = turn.phrases.popleft()
            if request.set_running_or_notify_cancel():
                try:
                    request.set_result(job())
                except Exception as e:  # noqa: BLE001 - the stream gets no phrase; the turn goes on
                    request.set_exception(e)
                except BaseException as e:  # the stream waiting on it is answered before this goes on
                    request.set_exception(e)
                    raise

    def _phrase(self, voice: Voice, turn: Turn, kind: str, extra, recent, lang) -> Phrase | None:
        model = self.host.model
        if model is None:
            return None
        with self.state_lock:
            session = self.reading.get(model, turn.session)
        if not voice.fits(session, extra):
            return None
        phrase = voice.phrase(session, kind, extra, recent, lang)
        turn.voice.used_s += phrase.seconds
        return phrase

    # questions --------------------------------------------------------------------------

    def _asked(self, session: str, timeout_s: float) -> tuple[str, dict]:
        """The store name an ask about `session` reads and its exactness (refused when required)."""
        self.host.wait_ready(timeout_s)
        if not self.known(session):
            raise ShadowInputError(f"unknown session {session!r}")
        name = self.main_branch(session)
        exact = self.exactness(name)
        if self.require_exact and not exact["exact"]:
            raise ShadowNotExact(f"session {name!r} is not exact: {exact['why_not']}")
        return name, exact

    def ask(self, session: str, question: Sequence[int], choices: Sequence[int], labels: Sequence[str],
            timeout_s: float = 10.0, reference: str | None = None, fresh: bool | None = None) -> dict:
        """Read the session up to the question's insertion point (its last id, within timeout_s),
        then one forward of the pending tail and the question in a fork: the letters' softmax
        (`Asking.ask`)."""
        return self.asking.ask(session, question, choices, labels, timeout_s, reference, fresh)

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
        sits free in the pool, park every session on disk and let the model go (DESIGN 7); the
        next turn or ask loads it again and reads on from disk."""
        model = self.host.model
        if (model is None or model.store.disk is None or self.busy() or self.pending
                or self._pool_free() <= self.unload_slack):
            return
        with self.state_lock:
            if self.reading.sched.has_backlog() or model.store.close():  # a session not written stays: no unload
                return
            self.reading.spilled(None)
            self.counters.unloads += 1
        self.host.unload()

    # status -----------------------------------------------------------------------------

    def status(self) -> dict:
        with self.state_lock:
            c = self.counters
            model = self.host.model
            ready = model is not None
            sessions = []
            for r in model.store.status() if ready else []:
                s = model.store.peek(r.name)
                sessions.append(vars(r) | {"rollbacks": None if s is None else s.rollbacks,
                                           "id_checks": self.checks.get(r.name, SessionChecks()).as_dict(
                                               r.committed + r.pending)})
            return {
                "ready": ready, "load_error": self.load_error, "engine": self.engine,
                "grid": model.grid if ready else None, "weights": self.weights, "enabled": self.enabled,
                "voice": self.voice_enabled,
                "sessions": sessions,
                "branches": {k: list(v) for k, v in self.names.branches.items() if v},
                "store": model.store.totals() if ready else None,
                "turns_in_flight": len(self.turns), "waiting": self.waiting,
                "counters": {
                    "requests": c.requests, "chunks_idle": c.chunks_idle, "chunks_share": c.chunks_share,
                    "share_s": round(c.share_s, 6),
                    "chunks_ask": c.chunks_ask, "asks": c.asks, "last_chunk_ms": round(c.last_chunk_ms, 3),
                    "standing_answered": c.standing_answered, "standing_replaced": c.standing_replaced,
                    "standing_pending": len(self.pending), "unloads": c.unloads,
                    "max_wait_on_reader_ms": round(c.max_wait_on_reader_ms, 3),
                },
                "reading": self.reading.status(),
                "idle_reader": self.reading.idle_status(),
                "last_answers": list(c.last_answers),
            }
