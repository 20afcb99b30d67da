"""Status lines: each step the server takes around a turn, as one short line of facts. Pure: no
I/O, no threads, the clock passed in.

    waiting: another request is running, position 1, about 40 s
    reading 20,745 tokens, about 18 s left
    thinking 25 s
    writing render.js, 211 lines so far
    checking the tool call
    Read 12,874 tokens in 14 s        (Open WebUI's last status event, at the first token)

Every line is framed (`text.framing`) so that the server finds it exactly and takes it out of
whatever a client sends back, before the engine, the shadow or any template sees the request.
Lines are never in `usage`.

`TurnStatus` follows one turn: told when it started, how many new ids the engine must read and at
what rate, how many requests are ahead, and each streamed delta, it says which lines are due.
No line for short work: none before the turn has waited `quiet_s` (1.5 s).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# the templates: facts and numbers only ---------------------------------------------------

def _about(seconds: float) -> str:
    return f"about {max(1, round(seconds))} s"


def waiting_line(position: int, eta_s: float | None) -> str:
    eta = f", {_about(eta_s)}" if eta_s is not None else ""
    return f"waiting: another request is running, position {position}{eta}"


def reading_line(tokens: int | None, eta_s: float | None, elapsed_s: float) -> str:
    """The engine reading the turn's new ids: with the measured rate, the time left; without it
    (the engine's first turn) or past it, the time so far."""
    if tokens is None:
        return f"reading the prompt, {round(elapsed_s)} s so far"
    if eta_s is None or eta_s < 1:  # not measured yet, or slower than measured: what is known
        return f"reading {tokens:,} tokens, {round(elapsed_s)} s so far"
    return f"reading {tokens:,} tokens, {_about(eta_s)} left"


def thinking_line(seconds: float) -> str:
    return f"thinking {round(seconds)} s"


def writing_line(action: str, target: str | None, lines: int | None) -> str:
    what = f"{action} {target}" if target else action
    return what + (f", {lines:,} lines so far" if lines is not None else "")


def checking_line() -> str:
    return "checking the tool call"


def waited_line(tokens: int | None, seconds: float) -> str:
    """Open WebUI's last status event, at the first token: what the wait was."""
    if tokens:
        return f"Read {tokens:,} tokens in {max(1, round(seconds))} s"
    return f"Waited {max(1, round(seconds))} s"


# the open tool call, read as the model writes it --------------------------------------------

WRITE_TOOLS = {"write": "writing", "edit": "editing", "create": "writing", "str_replace": "editing",
               "patch": "patching", "apply_patch": "patching", "bash": "running", "read": "reading"}
_TARGET = re.compile(r'"(?:filePath|file_path|path|filename|file|command)"\s*:\s*"((?:[^"\\]|\\.)*)"')
_CONTENT = re.compile(r'"(?:content|newString|new_string|new_str|text|patch)"\s*:\s*"((?:[^"\\]|\\.)*)')
# the same in Qwen3.5's own tool-call format: <parameter=path>\nvalue\n</parameter>
_TARGET_XML = re.compile(r"<parameter=(?:filePath|file_path|path|filename|file|command)>\n?([^\n<]*)")
_CONTENT_XML = re.compile(r"<parameter=(?:content|newString|new_string|new_str|text|patch)>\n?(.*)", re.S)


def tool_action(name: str, arguments: str) -> tuple[str, str | None, int | None]:
    """From a tool call's name and its arguments so far (a JSON string, maybe cut off): the
    action, its target (a file's base name, or a command's first word) and the lines written."""
    action = WRITE_TOOLS.get(name.lower().rsplit(".", 1)[-1], f"calling {name}" if name else "calling a tool")
    target = None
    m = _TARGET.search(arguments) or _TARGET_XML.search(arguments)
    if m:
        value = m.group(1).replace("\\/", "/").strip()
        target = value.split()[0][:60] if value and "command" in m.group(0) else value.rsplit("/", 1)[-1][:60]
    lines = None
    c = _CONTENT.search(arguments)
    if c:
        lines = c.group(1).count("\\n") + 1
    else:
        c = _CONTENT_XML.search(arguments)
        if c:
            lines = c.group(1).split("</parameter>")[0].count("\n") + 1
    return action, target or None, lines


# one turn ---------------------------------------------------------------------------------

@dataclass
class Line:
    kind: str  # waiting, reading, thinking, decided, writing, checking, waited
    text: str
    at: float
    before_first_token: bool
    needs_phrase: bool = False  # said only with the voice's phrase after it (decided)
    phrase: dict | None = None  # the voice's attempt: text said (or None), reason, seconds

    def with_phrase(self, text: str | None, record: dict) -> "Line":
        self.phrase = record
        if text:
            self.text = f"{self.text}: {text}"
        return self

    @property
    def takes_phrase(self) -> bool:
        return self.kind in ("thinking", "decided", "writing")


def said(lines: list[Line], started: float) -> list[dict]:
    """The lines a client was shown, as journal records (a line only worth its phrase, without
    one, was not shown)."""
    return [{"kind": x.kind, "text": x.text, "t": round(x.at - started, 3)} | ({"phrase": x.phrase} if x.phrase else {})
            for x in lines if not (x.needs_phrase and not (x.phrase and x.phrase.get("said")))]


@dataclass
class TurnStatus:
    """Which lines are due for one turn. `new_tokens`: ids the engine must read (None: unknown);
    `rate`: its measured prefill rate, tokens a second (None: not measured yet); `ahead`: the
    requests in flight to the engine before this one, each with its expected seconds left."""

    started: float
    new_tokens: int | None = None
    rate: float | None = None
    ahead: list[float] = field(default_factory=list)
    quiet_s: float = 1.5
    progress_every_s: float = 10.0
    thinking_from_s: float = 15.0
    thinking_every_s: float = 25.0
    decided_after_s: float = 10.0
    lines: list[Line] = field(default_factory=list)
    first_token: float | None = None
    _last_progress: float | None = None
    _thinking_since: float | None = None
    _next_thinking: float | None = None
    _tool_since: float | None = None
    _tool_said: float | None = None
    _tool: tuple[str, str] = ("", "")

    def _say(self, kind: str, text: str, now: float, needs_phrase: bool = False) -> Line:
        line = Line(kind, text, now, self.first_token is None, needs_phrase)
        self.lines.append(line)
        return line

    @property
    def said_before_first_token(self) -> bool:
        return any(line.before_first_token for line in self.lines)

    def until_due(self, now: float, most: float = 1.0) -> float:
        """Seconds from `now` until `tick` may have a line, at most `most`: how long a caller may
        wait for the engine before it ticks again (a fixed wait would say the first line late)."""
        times = []
        if self.first_token is None:
            first = self.started + self.quiet_s
            times.append(first if self._last_progress is None else max(first, self._last_progress + self.progress_every_s))
        else:
            if self._next_thinking is not None:
                times.append(self._next_thinking)
            if self._tool_since is not None:
                due = self._tool_since + self.quiet_s
                times.append(due if self._tool_said is None else max(due, self._tool_said + self.progress_every_s))
        return most if not times else min(most, max(0.01, min(times) - now))

    def tick(self, now: float) -> list[Line]:
        """Lines due at `now` (call it every second or so, and between deltas)."""
        out = []
        if self.first_token is None:
            waited = now - self.started
            due = self._last_progress is None or now - self._last_progress >= self.progress_every_s
            if waited >= self.quiet_s and due:
                self._last_progress = now
                if self.ahead:
                    eta = sum(self.ahead) + (self.new_tokens / self.rate if self.new_tokens and self.rate else 0)
                    out.append(self._say("waiting", waiting_line(len(self.ahead), eta if self.rate else None), now))
                else:
                    eta = None
                    if self.new_tokens is not None and self.rate:
                        eta = max(0.0, self.new_tokens / self.rate - waited)
                    out.append(self._say("reading", reading_line(self.new_tokens, eta, waited), now))
            return out
        if self._next_thinking is not None and now >= self._next_thinking:
            out.append(self._say("thinking", thinking_line(now - self._thinking_since), now))
            self._next_thinking += self.thinking_every_s
        if self._tool_since is not None and now - self._tool_since >= self.quiet_s and (
                self._tool_said is None or now - self._tool_said >= self.progress_every_s):
            self._tool_said = now
            out.append(self._say("writing", writing_line(*tool_action(*self._tool)), now))
        return out

    def on_first_token(self, now: float) -> list[Line]:
        """The engine's first generated token: the wait is over (one line saying what it was,
        where lines were said before it)."""
        if self.first_token is not None:
            return []
        said = self.said_before_first_token
        self.first_token = now
        if not said:
            return []
        return [self._say("waited", waited_line(self.new_tokens, now - self.started), now)]

    def on_delta(self, now: float, kind: str, tool: tuple[str, str] | None = None) -> list[Line]:
        """A streamed piece: `reasoning`, `content` or `tool` (with the open call's name and its
        arguments so far), or `end` (the turn's last event, with its finish reason as `tool`)."""
        out = self.on_first_token(now)
        if kind == "reasoning":
            if self._thinking_since is None:
                self._thinking_since = now
                self._next_thinking = now + self.thinking_from_s
        else:
            if self._next_thinking is not None and now - self._thinking_since >= self.decided_after_s:
                # a thought of at least 10 s is over: what it decided, if the voice can say it
                out.append(self._say("decided", f"thought {round(now - self._thinking_since)} s", now, True))
            self._next_thinking = None  # the thinking is over
        if kind == "tool" and tool is not None:
            if self._tool_since is None:
                self._tool_since = now
            self._tool = tool
        elif kind == "end":
            if self._tool_since is not None and now - self._tool_since >= self.quiet_s:
                out.append(self._say("checking", checking_line(), now))
            self._tool_since = None
        return out + self.tick(now)
