"""The voice: the engine writes the facts of a status line; the small model writes
only a short phrase after them, from the shadow's exact state of the session: a fork (the
session's unread tail, the newest text not yet in the session, a question), a few greedy
tokens, the session left bit-equal. Every phrase passes `checks.check` before it is said.

Its time is rationed like the shadow's: a share (default 3 %) of the time since the turn's first
token, a phrase costing at most 150 ms (`slice_s`); one the measured cost says would not fit is
not tried. A phrase is written whole where the device is free (between a proxied turn's deltas),
or one forward at a time between the embedded engine's rounds (`phrase_steps`), so a gap in a
stream holds one of its forwards (the rest of it at once where the rounds give the device to
another job mid-phrase). The cost, by the ids the fork
prefills, is measured at load (`warm`: one-time set-up left out) and moved by every phrase; an
estimate over the slice is tried again once `retry_s` has passed since the last measure, so one
slow phrase never silences the voice for good.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass

from shadow.text.chat import render_question
from shadow.core.reader import Reader, Session, drain
from shadow.text.tokenizer import Tokenizer
from shadow.voice.checks import check

SLICE_S = 0.15  # the most a phrase may cost

QUESTIONS = {
    "en": {
        "thinking": "In at most eight plain words, what is the reasoning above working on right now?",
        "decided": "In at most eight plain words, what did the reasoning above decide?",
        "writing": "In at most eight plain words, what is the file being written above for?",
    },
    "de": {
        "thinking": "In höchstens acht einfachen Worten: woran arbeitet das Denken oben gerade?",
        "decided": "In höchstens acht einfachen Worten: was hat das Denken oben entschieden?",
        "writing": "In höchstens acht einfachen Worten: wofür ist die Datei, die oben geschrieben wird?",
    },
}
NO_THINKING = "<think>\n\n</think>\n\n"  # the answer starts at once (Qwen3.5's template with thinking off)


@dataclass(frozen=True)
class Phrase:
    text: str | None  # what is said after the line's facts, None when nothing is
    raw: str  # what the small model wrote
    reason: str | None  # why it is not said (a check's reason), None when it is
    seconds: float
    tokens: int


@dataclass
class VoiceBudget:
    """A turn's voice time: `share` of the time since its first token, in slices of at most `slice_s`."""

    share: float = 0.03
    slice_s: float = SLICE_S
    used_s: float = 0.0

    def allows(self, first_token: float | None, now: float, cost_s: float | None) -> bool:
        if first_token is None:
            return False
        budget = self.share * max(0.0, now - first_token) - self.used_s
        need = cost_s if cost_s is not None else self.slice_s  # unmeasured: a whole slice must be there
        return need <= self.slice_s and need <= budget


@dataclass
class PhraseCost:
    """A phrase's expected seconds by the ids its fork prefills (the unread tail, the newest text,
    the question): a line through two points measured at load, times a scale that every phrase
    since moves toward what it measured."""

    base_s: float
    per_id_s: float
    scale: float = 1.0

    @classmethod
    def through(cls, short: tuple[int, float], long: tuple[int, float]) -> PhraseCost:
        (n0, s0), (n1, s1) = short, long
        per_id = max(0.0, (s1 - s0) / (n1 - n0)) if n1 > n0 else 0.0
        return cls(max(0.0, s0 - per_id * n0), per_id)

    def line(self, n: int) -> float:
        return self.base_s + self.per_id_s * n

    def __call__(self, n: int) -> float:
        return self.scale * self.line(n)

    def update(self, n: int, seconds: float) -> None:
        if self.line(n) > 0:
            self.scale = 0.7 * self.scale + 0.3 * seconds / self.line(n)


class Voice:
    """Phrases from a reader's sessions. `phrase` runs on the device (it forks the session). With
    `own_model` (`--voice-model`: a checkpoint other than the shadow's), the voice cannot fork the
    shadow's state: it reads the session's newest `window` ids afresh with its own model."""

    def __init__(self, reader: Reader, tokenizer: Tokenizer, *, max_tokens: int = 12, window: int = 2048,
                 max_tail: int | None = None, own_model: bool = False, slice_s: float = SLICE_S,
                 retry_s: float = 60.0, clock=time.monotonic):
        self.reader, self.tokenizer, self.own_model = reader, tokenizer, own_model
        self.max_tokens, self.window = max_tokens, window
        self.max_tail = max_tail if max_tail is not None else 2 * reader.grid  # unread ids a phrase may prefill
        self.slice_s, self.retry_s, self.clock = slice_s, retry_s, clock
        self.cost: PhraseCost | None = None  # measured at load (`warm`), moved by every phrase
        self.measured_at: float | None = None
        self.eos = reader.model.config.eos_token_id
        self.newline = set(tokenizer.encode("\n"))
        self.question_ids = len(self.question("thinking", "en"))

    def prefill(self, session: Session | None, extra: int = 0) -> int:
        """The ids a phrase about `session` (None: not resident, so the most a phrase may take)
        with `extra` newest ids would prefill."""
        if self.own_model:  # a window of the newest ids, read afresh
            tail = self.window if session is None else min(len(session.ids) + extra, self.window)
        else:
            tail = self.max_tail if session is None else len(session.ids) - session.committed + extra
        return tail + self.question_ids

    def estimate(self, n: int) -> float | None:
        """The seconds a phrase prefilling `n` ids is expected to take: None (a whole slice must be
        there) where it is unmeasured, or over the slice and measured more than `retry_s` ago."""
        if self.cost is None:
            return None
        seconds = self.cost(n)
        if seconds > self.slice_s and self.measured_at is not None and self.clock() - self.measured_at > self.retry_s:
            return None
        return seconds

    def warm(self) -> PhraseCost:
        """At load, on the device: phrases on a scratch session, one with nothing unread and one
        with the longest tail a phrase may prefill, after a first that sets up what runs once
        (kernels at every depth: `Reader.warm_kernels`; a graph for every row count a fork reads in:
        `Reader.fork_cover`): the line of the phrase cost through the two."""
        self.reader.warm_kernels()  # no compile at a new depth mid-phrase (the shadow's own reader: done already)
        filler = self.question("thinking", "en")
        points = []
        cover = max(0, self.reader.fork_cover() - self.question_ids)
        for tail in (cover, 0, self.window if self.own_model else self.max_tail):
            scratch = self.reader.new_session("(voice warm)")
            scratch.ids = (filler * (tail // len(filler) + 1))[:tail]
            seconds = self._write(scratch, "thinking", (), "en")[1]
            points.append((self.prefill(scratch), seconds))
        self.cost, self.measured_at = PhraseCost.through(points[1], points[2]), self.clock()
        return self.cost

    def question(self, kind: str, lang: str) -> list[int]:
        text = QUESTIONS.get(lang, QUESTIONS["en"])[kind]
        return self.tokenizer.encode(render_question(text) + NO_THINKING)

    def fits(self, session: Session, extra: Sequence[int]) -> bool:
        if self.own_model:
            return True  # it reads a window of at most `window` ids, whatever the session's backlog
        return len(session.ids) - session.committed + len(extra) <= self.max_tail

    def phrase(self, session: Session, kind: str, extra: Sequence[int] = (), recent: Sequence[str] = (),
               lang: str = "en") -> Phrase:
        """A phrase of `kind` (thinking, decided, writing) about the session and `extra` (the
        newest ids the session does not hold yet), checked against what the fork read."""
        return drain(self.phrase_steps(session, kind, extra, recent, lang))

    def phrase_steps(self, session: Session, kind: str, extra: Sequence[int] = (), recent: Sequence[str] = (),
                     lang: str = "en") -> Generator[None, None, Phrase]:
        """`phrase` one forward at a time (`Reader.decode_steps`: the same rules hold until it is
        over); its seconds are its steps', not the time between them."""
        n = self.prefill(session, len(extra))
        read = self.tokenizer.decode((list(session.ids) + list(extra))[-self.window:])
        ids, seconds = yield from self._write_steps(session, kind, extra, lang)
        if self.cost is None:
            self.cost = PhraseCost(seconds, 0.0)  # not warmed: one measure, the same for every length
        else:
            self.cost.update(n, seconds)
        self.measured_at = self.clock()
        raw = self.tokenizer.decode([i for i in ids if i != self.eos and i not in self.newline]).strip()
        reason = check(raw, read, QUESTIONS.get(lang, QUESTIONS["en"]).values(), recent, lang)
        return Phrase(raw if reason is None else None, raw, reason, seconds, len(ids))

    def _write(self, session: Session, kind: str, extra: Sequence[int], lang: str) -> tuple[list[int], float]:
        """The fork's greedy ids and the seconds they took."""
        return drain(self._write_steps(session, kind, extra, lang))

    def _write_steps(self, session: Session, kind: str, extra: Sequence[int],
                     lang: str) -> Generator[None, None, tuple[list[int], float]]:
        """`_write` one forward at a time; the seconds are the steps' own."""
        seconds, start = 0.0, time.perf_counter()
        if self.own_model:  # a window of the newest ids, read afresh by the voice's own model
            window = (list(session.ids) + list(extra))[-self.window:]
            scratch = self.reader.new_session("voice")
            scratch.ids = window
            session, extra = scratch, []
        steps = self.reader.decode_steps(session, list(extra) + self.question(kind, lang), self.max_tokens,
                                         stop=[self.eos, *self.newline])
        try:
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    return done.value, seconds + time.perf_counter() - start
                self.reader.synchronize()  # the step's forward done: its time, not only its launch
                seconds += time.perf_counter() - start
                yield
                start = time.perf_counter()
        finally:
            steps.close()  # closed early: the fork is undone now
