"""The voice replayed on recorded sessions (what `shadow voice-replay` runs): each conversation is
read turn by turn as a live shadow would (prompts rendered with `shadow.text.chat`, read to their last
whole chunk); at each assistant turn that reasons, the voice writes a thinking phrase at a third
and at two thirds of the reasoning (its newest text not yet in the session, as in a stream) and a
decided phrase at its end, each on a fork of the session, and each is checked. Measured: the
latency of every phrase (one phrase, one slice), whether it fits a slice, and why phrases are
not said."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shadow.text.chat import render_output, render_prompt
from shadow.text.conversations import Conversation
from shadow.core.reader import Reader
from shadow.text.tokenizer import Tokenizer
from shadow.voice.checks import language
from shadow.voice.voice import Voice


@dataclass(frozen=True)
class Attempt:
    conversation: str
    turn: int
    kind: str
    at_tokens: int  # reasoning ids written when the phrase was asked for
    seconds: float
    tokens: int
    said: bool
    reason: str | None
    text: str


@dataclass
class VoiceReport:
    attempts: list[Attempt] = field(default_factory=list)
    slice_s: float = 0.15

    def summary(self) -> dict:
        by_kind = {}
        for kind in sorted({a.kind for a in self.attempts}):
            xs = [a for a in self.attempts if a.kind == kind]
            ms = sorted(a.seconds * 1000 for a in xs)
            by_kind[kind] = {
                "phrases": len(xs), "said": sum(a.said for a in xs),
                "said_pct": round(100 * sum(a.said for a in xs) / len(xs), 1),
                "median_ms": round(statistics.median(ms), 2), "p90_ms": round(ms[min(len(ms) - 1, int(0.9 * len(ms)))], 2),
                "fits_slice_pct": round(100 * sum(a.seconds <= self.slice_s for a in xs) / len(xs), 1),
            }
        reasons = Counter(a.reason for a in self.attempts if a.reason)
        n = len(self.attempts)
        return {"phrases": n, "said": sum(a.said for a in self.attempts),
                "said_pct": round(100 * sum(a.said for a in self.attempts) / n, 1) if n else 0.0,
                "median_ms": round(statistics.median(a.seconds * 1000 for a in self.attempts), 2) if n else None,
                "total_s": round(sum(a.seconds for a in self.attempts), 3),
                "by_kind": by_kind, "reasons": dict(reasons.most_common())}


def voice_replay(conversations: Sequence[Conversation], reader: Reader, tokenizer: Tokenizer,
                 min_reasoning_tokens: int = 32, max_turns: int | None = None, slice_s: float = 0.15,
                 *, progress: Callable[[Attempt], None] | None = None) -> VoiceReport:
    voice = Voice(reader, tokenizer, max_tail=10**9)  # offline: the tail is read before each phrase anyway
    report = VoiceReport(slice_s=slice_s)
    for conv in conversations:
        session = reader.new_session(conv.name)
        recent: list[str] = []
        turns = list(conv.requests())[: max_turns] if max_turns else list(conv.requests())
        for turn, (history, output) in enumerate(turns, start=1):
            reader.feed_prompt(session, tokenizer.encode(render_prompt(history)))
            reader.advance(session)  # the shadow is fresh at the turn's start (as it mostly is live)
            lang = _user_language(history)
            thought = tokenizer.encode("<think>\n" + (output.reasoning or ""))
            if output.reasoning and len(thought) >= min_reasoning_tokens:
                points = [("thinking", len(thought) // 3), ("thinking", 2 * len(thought) // 3),
                          ("decided", len(thought))]
                for kind, at in points:
                    phrase = voice.phrase(session, kind, thought[:at], recent, lang)
                    attempt = Attempt(conv.name, turn, kind, at, phrase.seconds, phrase.tokens, phrase.text is not None,
                                      phrase.reason, phrase.raw)
                    report.attempts.append(attempt)
                    if phrase.text:
                        recent.append(phrase.text)
                    if progress:
                        progress(attempt)
            reader.feed_output(session, tokenizer.encode(render_output(output)))
    return report


def _user_language(history) -> str:
    for m in reversed(history):
        if m.role == "user":
            return language(m.content) or "en"
    return "en"
