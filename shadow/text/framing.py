"""Framed status lines: how a line the server says in a client's stream is marked, so that it is
found exactly and taken out of whatever the client sends back (`strip_request`), before the
engine, the shadow or any template sees the request. A session whose client echoes the lines
then reads exactly the ids of the same session without them.
"""

from __future__ import annotations

import json
import re

MARK = "\u2063"  # INVISIBLE SEPARATOR: frames a line so it is found exactly, and never in model text
FRAMED = re.compile(r"(?:\*\*)?" + MARK + r"› [^" + MARK + r"\n]*" + MARK + r"(?:\*\*)?\n?")


def clean(text: str) -> str:
    """A line's text: one line, no frame marks."""
    return " ".join(text.replace(MARK, "").split())


def frame(text: str) -> str:
    """A line as it goes into reasoning or content: `› text` between marks, then a newline."""
    return f"{MARK}› {clean(text)}{MARK}\n"


def frame_title(text: str) -> str:
    """A line as the title of an opencode reasoning part (bold), framed the same way."""
    return f"**{MARK}› {clean(text)}{MARK}**"


def strip_lines(text: str) -> str:
    return FRAMED.sub("", text) if MARK in text else text


def strip_request(body: dict) -> tuple[dict, int]:
    """The request with every framed line taken out of its messages' text (content as text or
    parts, reasoning_content, reasoning), and how many were taken; the body is not modified."""
    messages = body.get("messages")
    if not isinstance(messages, list) or MARK not in json.dumps(messages, ensure_ascii=False):
        return body, 0
    count = 0

    def strip(value):
        nonlocal count
        if isinstance(value, str):
            count += len(FRAMED.findall(value))
            return strip_lines(value)
        if isinstance(value, list):
            return [strip_part(p) for p in value]
        return value

    def strip_part(part):
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            return {**part, "text": strip(part["text"])}
        return part

    out = []
    for m in messages:
        if isinstance(m, dict):
            m = dict(m)
            for key in ("content", "reasoning_content", "reasoning"):
                if key in m:
                    m[key] = strip(m[key])
        out.append(m)
    return {**body, "messages": out}, count
