"""Where a status line goes in a streamed chat response, by client.

- `reasoning`: inside the reasoning the client renders (a `reasoning_content` delta);
- `content`: a content delta of its own;
- `inline` (opencode): each line opens a reasoning part of its own, titled by the line: an empty
  `tool_calls` delta ends the open reasoning part (opencode's provider does so), then the line as
  a reasoning delta; before the model's own reasoning goes on, another empty `tool_calls` delta;
- Open WebUI: every line said before the first generated token is a status event
  (`{"event": {"type": "status", "data": {"description", "done"}}}`), the line under the model's
  name, and the last one, at the first token, says what the wait was (`done: true`), so its
  "Thought for N seconds" counts only the model's own thinking. Later lines take the channel.

Client kinds are recognised from headers: `X-OpenWebUI-Chat-Id` (Open WebUI), a `User-Agent`
starting `opencode/` or an `x-session-affinity` header (opencode).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from shadow.server.http.lines import Line, TurnStatus
from shadow.server.load import EngineLoad
from shadow.server.turn import ServedTurn
from shadow.text.framing import frame, frame_title


def client_kind(headers) -> str:
    get = (lambda k: headers.get(k)) if hasattr(headers, "get") else (lambda k: None)
    if get("x-openwebui-chat-id") is not None:
        return "openwebui"
    if (get("user-agent") or "").startswith("opencode/") or get("x-session-affinity") is not None:
        return "opencode"
    return "other"


@dataclass(frozen=True)
class Channel:
    name: str  # reasoning, content, inline, off
    status_events: bool = False  # Open WebUI: lines before the first token as status events

    @property
    def on(self) -> bool:
        return self.name != "off" or self.status_events

    def events(self, line: Line, like: dict | None) -> list[dict]:
        """The SSE events (JSON objects) that carry `line`; `like` is an engine chunk to copy
        `id`, `created` and `model` from."""
        if self.status_events and (line.before_first_token or line.kind == "waited"):
            return [{"event": {"type": "status", "data": {"description": line.text, "done": line.kind == "waited"}}}]
        if line.kind == "waited" or self.name == "off":
            return []
        if self.name == "reasoning":
            return [chunk(like, {"reasoning_content": frame(line.text)})]
        if self.name == "content":
            return [chunk(like, {"content": frame(line.text)})]
        return [chunk(like, {"tool_calls": []}), chunk(like, {"reasoning_content": frame_title(line.text)})]

    def resume(self, like: dict | None) -> list[dict]:
        """Before the model's own reasoning goes on after a line: inline closes the line's part."""
        return [chunk(like, {"tool_calls": []})] if self.name == "inline" else []


def chunk(like: dict | None, delta: dict) -> dict:
    like = like or {}
    return {"id": like.get("id", "status"), "object": "chat.completion.chunk",
            "created": like.get("created", int(time.time())), "model": like.get("model", ""),
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def choose(setting: str, headers) -> Channel:
    """The channel for one request: `setting` is serve's `--status-channel`. `auto` gives Open
    WebUI status events then reasoning, opencode `inline`, and other clients no lines."""
    kind = client_kind(headers)
    if setting == "off":
        return Channel("off")
    if setting == "auto":
        return {"openwebui": Channel("reasoning", True), "opencode": Channel("inline")}.get(kind, Channel("off"))
    return Channel(setting, kind == "openwebui")


class LineWriter:
    """A turn's status lines on their way into its stream: its `TurnStatus` kept up to date with
    the engine's load; the lines due (`due`, `before_delta`) as `Line`s, which the caller may give
    the voice's phrases before `encode` turns them into its channel's SSE events (bytes). The
    inline channel closes a line's reasoning part before the model's own reasoning goes on
    (`resume`)."""

    def __init__(self, channel: Channel, status: TurnStatus, load: EngineLoad, turn: ServedTurn):
        self.channel, self.status, self.load, self.turn = channel, status, load, turn
        self.like: dict | None = None  # an engine chunk: its id, created, model
        self.open_part = False  # inline: a line's reasoning part is open

    def refresh(self, now: float) -> None:
        self.status.rate = self.load.rate
        self.status.ahead = self.load.ahead(self.turn, now)

    def due(self, now: float) -> list[Line]:
        """Lines due now (between events, and while the engine is silent)."""
        self.refresh(now)
        return self.status.tick(now)

    def before_delta(self, now: float, kind: str, tool: tuple[str, str] | None = None) -> list[Line]:
        """The lines due with a delta of `kind` (reasoning, content, tool, end), to go out before it."""
        self.refresh(now)
        if kind != "end":
            self.load.first_token(self.turn, now)
        return self.status.on_delta(now, kind, tool)

    def encode(self, lines: list[Line]) -> list[bytes]:
        out = []
        for line in lines:
            if line.needs_phrase and not (line.phrase and line.phrase.get("said")):
                continue  # a line that is only worth its phrase
            events = self.channel.events(line, self.like)
            out += [b"data: " + json.dumps(e, ensure_ascii=False).encode() + b"\n\n" for e in events]
            if events and self.channel.name == "inline" and "choices" in events[-1]:
                self.open_part = True
        return out

    def resume(self, kind: str) -> list[bytes]:
        """Before a model's reasoning delta: close the part an inline line opened."""
        if kind != "reasoning" or not self.open_part:
            return []
        self.open_part = False
        return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in self.channel.resume(self.like)]
