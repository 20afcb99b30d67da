"""The voice in the live service: made at load (its cost measured on a scratch session), asked for
a phrase after a status line, and run where the device allows: whole at once where it is free
(proxy mode), else one forward between each two of the turn's own rounds (embedded), charged to
the turn's voice budget step by step. A voice that fails is logged and the line goes out with its
facts alone."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Generator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from shadow.core.reader import Reader, drain
from shadow.server.host import ModelHost, Shadow
from shadow.server.reading import Reading, settle_device
from shadow.server.shared import Shared
from shadow.server.turn import ServedTurn
from shadow.text.tokenizer import Tokenizer
from shadow.voice.voice import Phrase, Voice

log = logging.getLogger("shadow.serve")


def voice_failed(turn: ServedTurn, kind: str) -> None:
    """Log the exception being handled: the voice failed, and the line goes out with its facts alone."""
    log.exception("turn %s: the voice failed; its %s line goes out without a phrase", turn.id, kind)


@dataclass(frozen=True)
class VoiceParts:
    """What the voice is made of: the tokenizer it writes with, and a model of its own (`reader`,
    reading a window of each session afresh; None: it forks the shadow's own state)."""

    tokenizer: Tokenizer
    reader: Reader | None = None


class Voicing:
    def __init__(self, shared: Shared, host: ModelHost, reading: Reading, parts: VoiceParts | None):
        self.shared, self.host, self.reading, self.parts = shared, host, reading, parts
        self.voice: Voice | None = None

    def on_load(self, shadow: Shadow) -> None:
        """On the loading thread, before the shadow is handed out: the voice, its cost measured."""
        parts = self.parts
        if parts is None:
            self.voice = None
            return
        self.voice = Voice(parts.reader, parts.tokenizer, own_model=True) if parts.reader is not None \
            else Voice(shadow.reader, parts.tokenizer)
        try:
            self.voice.warm()
        except Exception:  # noqa: BLE001 - unmeasured, a phrase asks for a whole slice
            log.exception("the voice's cost could not be measured at load; it is measured by its first phrase")

    def request(self, turn: ServedTurn, kind: str, extra: Sequence[int] = (), recent: Sequence[str] = (),
                lang: str = "en") -> Future | None:
        """A voice phrase for a status line of this turn, begun if the turn's voice budget holds
        one: written at once where the device is free (proxy mode; the future comes back done),
        else queued for the turn's own rounds to write a forward between each two (embedded; the
        future is answered when it is written, or cancelled by `drop_waiting`). Its result is the
        Phrase, or None where it could not be written; an exception where the voice failed. None:
        nothing tried. It never raises."""
        shared = self.shared
        with shared.lock:
            voice, shadow = self.voice, self.host.shadow
            if (voice is None or shadow is None or not shared.switch.shadow or not shared.switch.voice
                    or turn.session is None or not turn.fed.prompt):
                return None
            session = shadow.store.peek(turn.session)
            if session is not None and not voice.own_model and not voice.fits(session, extra):
                self.reading.let_hold_go(shadow, session, voice.max_tail)  # read on, for the phrases after this one
            cost = voice.estimate(voice.prefill(session, len(extra)))
            if not turn.voice.allows(turn.first_token, shared.clock(), cost):
                return None
        steps = lambda: self._write_steps(voice, turn, kind, extra, recent, lang)  # noqa: E731
        request: Future = Future()
        try:
            ran, result = shared.device.run_if_idle(lambda: self._run_whole(turn, steps()), "voice")
            if ran:
                request.set_result(result)
                return request
            if turn.embedded:  # the turn's own rounds hold the device: it serves phrases between them
                with shared.lock:
                    if turn.rounds.over:  # and none is left to serve it (the device is another's)
                        return None
                    turn.rounds.phrases.append((steps, request))
                return request
        except Exception:  # noqa: BLE001 - the line goes out with its facts alone
            voice_failed(turn, kind)
        return None

    def phrase(self, turn: ServedTurn, kind: str, extra: Sequence[int] = (), recent: Sequence[str] = (),
               lang: str = "en", wait_s: float = 0.3) -> Phrase | None:
        """`request`, waited for: at most `wait_s` for it to start (one that started is waited for
        and kept: its time is spent). None: nothing tried, or the voice failed (logged)."""
        request = self.request(turn, kind, extra, recent, lang)
        if request is None:
            return None
        try:
            try:
                return request.result(timeout=wait_s)
            except FutureTimeout:
                return None if request.cancel() else request.result()
        except Exception:  # noqa: BLE001 - the line goes out with its facts alone
            voice_failed(turn, kind)
        return None

    def drop_waiting(self, turn: ServedTurn) -> None:
        """The turn's rounds are over: phrases it asked for and never began are cancelled (their
        streams go on without them), and one asked for from now on is written only where the
        device is free (`request`), never queued for rounds that will not come."""
        with self.shared.lock:
            rounds = turn.rounds
            rounds.over = True
            waiting, rounds.phrases = list(rounds.phrases), deque()
        for _, request in waiting:
            request.cancel()

    def serve_phrases(self, turn: ServedTurn) -> None:
        """Between two rounds of a turn, on the device: one step of the phrase being written (its
        fork's prefill, or one token), the next phrase its stream asked for begun when none is."""
        rounds = turn.rounds
        while rounds.phrase is None and rounds.phrases:
            steps, request = rounds.phrases.popleft()
            if request.set_running_or_notify_cancel():
                rounds.phrase = (steps(), request)
        if rounds.phrase is not None:
            self._step(turn)

    def finish_phrases(self, turn: ServedTurn) -> None:
        """Before a turn's rounds give up the device, or end: the phrase being written run to its
        end, so that no fork is open while another job runs."""
        while turn.rounds.phrase is not None:
            self._step(turn)

    def _step(self, turn: ServedTurn) -> None:
        """One step of `turn.rounds.phrase`, once the device has done the engine's round in flight (that
        wait is the engine's); its time, device synchronised, charged to the turn's voice budget.
        At its end the stream waiting on it is answered (its phrase, or the voice's error)."""
        rounds = turn.rounds
        steps, request = rounds.phrase
        wait, start = 0.0, time.perf_counter()
        try:
            wait = self._settle()
            start = time.perf_counter()
            next(steps)
            self._settle()
            self._charge(turn, time.perf_counter() - start, wait)
            return
        except StopIteration as done:
            rounds.phrase = None
            request.set_result(done.value)
        except BaseException as e:  # the stream waiting on it is answered; the fork is closed (undone)
            rounds.phrase = None
            try:
                steps.close()
            finally:
                request.set_exception(e)
            if not isinstance(e, Exception):
                raise
        self._charge(turn, time.perf_counter() - start, wait)

    def _run_whole(self, turn: ServedTurn, steps) -> Phrase | None:
        """A phrase's steps one after another (the device is free: nothing waits between them)."""
        start = time.perf_counter()
        try:
            return drain(steps)
        finally:
            self._settle()
            self._charge(turn, time.perf_counter() - start, 0.0)

    def _settle(self) -> float:
        shadow = self.host.shadow
        return 0.0 if shadow is None else settle_device(shadow.reader)

    def _charge(self, turn: ServedTurn, seconds: float, waited: float) -> None:
        turn.voice.used_s += seconds
        turn.engine_wait_s += waited
        with self.shared.lock:
            self.shared.counters.voice_s += seconds

    def _write_steps(self, voice: Voice, turn: ServedTurn, kind: str, extra, recent,
                     lang) -> Generator[None, None, Phrase | None]:
        """The phrase, one forward at a time (`Voice.phrase_steps`); None where it cannot be written."""
        shadow = self.host.shadow
        if shadow is None:
            return None
        with self.shared.lock:
            session = self.reading.get(shadow, turn.session)
        if not voice.fits(session, extra):
            return None
        return (yield from voice.phrase_steps(session, kind, extra, recent, lang))
