"""The checks a voice phrase passes before it is said. Pure functions.

A phrase is said only if: it is short plain words; every file name and number in it is in the
text the small model read, and so are most of its content words; it speaks of the work, not of
itself (no first person); it carries no markup; it is not a copy of an example the question
showed; it is not like any of the last four lines said; and it is in the user's language
(English or German). `check` returns None for a phrase that passes, else the first rule it
breaks (`REASONS`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

REASONS = ("empty", "too long", "markup", "first person", "unread name", "unread number", "unread words",
           "example", "repeat", "language")
MAX_WORDS, MAX_CHARS = 14, 100

_NAME = re.compile(r"[A-Za-z0-9_./-]*[A-Za-z0-9_-]\.[A-Za-z][A-Za-z0-9]{0,5}\b")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_WORD = re.compile(r"[A-Za-zÄÖÜäöüß][A-Za-zÄÖÜäöüß'-]*")
_MARKUP = re.compile(r"[*_#`<>\[\]{}|\\~]|https?://|\u2063")
FIRST_PERSON = frozenset({
    "i", "i'm", "i've", "i'll", "i'd", "me", "my", "mine", "myself", "we", "we're", "we've", "we'll", "us", "our",
    "ours", "ourselves", "ich", "mich", "mir", "mein", "meine", "meinen", "meinem", "meiner", "wir", "uns", "unser",
    "unsere", "unseren"})
EN = frozenset({"the", "a", "an", "and", "or", "of", "to", "in", "on", "for", "with", "is", "are", "it", "this",
                "that", "from", "by", "as", "at", "be", "not", "into", "its", "then", "which", "how", "what"})
DE = frozenset({"der", "die", "das", "und", "oder", "ein", "eine", "einen", "zu", "im", "in", "auf", "für", "mit",
                "ist", "sind", "es", "nicht", "von", "den", "dem", "des", "wie", "was", "als", "aus", "bei", "noch"})
STOP = EN | DE | FIRST_PERSON


def words(text: str) -> list[str]:
    return [w.lower().strip("'-") for w in _WORD.findall(text)]


def content_words(text: str) -> list[str]:
    return [w for w in words(text) if len(w) >= 4 and w not in STOP]


def language(text: str) -> str | None:
    """'en', 'de', or None when the text's function words do not tell."""
    ws = words(text)
    en, de = sum(w in EN for w in ws), sum(w in DE for w in ws) + sum(c in "äöüß" for c in text.lower())
    if en == de:
        return None
    return "en" if en > de else "de"


def _similar(a: str, b: str) -> bool:
    x, y = set(words(a)), set(words(b))
    if not x or not y:
        return False
    return len(x & y) / len(x | y) >= 0.6


def _normal(text: str) -> str:
    return " ".join(words(text))


def check(phrase: str, read: str, examples: Sequence[str] = (), recent: Sequence[str] = (),
          user_language: str | None = None, content_share: float = 0.6) -> str | None:
    """None when `phrase` may be said; else the first reason it may not. `read`: the text the small
    model read (its window of the session); `examples`: examples its question showed; `recent`:
    the lines said before (the last four are compared); `user_language`: 'en' or 'de' (None: either)."""
    p = phrase.strip()
    if not p or not words(p):
        return "empty"
    if len(p) > MAX_CHARS or len(words(p)) > MAX_WORDS or "\n" in p:
        return "too long"
    if _MARKUP.search(p):
        return "markup"
    if any(w in FIRST_PERSON for w in words(p)):
        return "first person"
    text = read.lower()
    if any(name.lower() not in text for name in _NAME.findall(p)):
        return "unread name"
    if any(number not in read for number in _NUMBER.findall(p)):
        return "unread number"
    cw = content_words(p)
    known = set(content_words(read))
    if cw and sum(w in known for w in cw) < content_share * len(cw):
        return "unread words"
    if any(_normal(p) == _normal(e) for e in examples):
        return "example"
    if any(_similar(p, line) for line in list(recent)[-4:]):
        return "repeat"
    if user_language is not None:
        said = language(p)
        if said is not None and said != user_language:
            return "language"
    return None


def request_language(body: dict) -> str:
    """The language of a chat request's last user message: 'de' or 'en' (the voice speaks it)."""
    for m in reversed(body.get("messages") or []):
        if isinstance(m, dict) and m.get("role") == "user":
            content = m.get("content")
            text = content if isinstance(content, str) else " ".join(
                p.get("text", "") for p in content or [] if isinstance(p, dict) and isinstance(p.get("text"), str))
            return language(text) or "en"
    return "en"
