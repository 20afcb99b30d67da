"""One proxied request's own record (`ProxiedTurn`): the served turn, the client's body, what the
proxy asked of the engine, the prompt ids sought beside it, its status lines (`Lines`, kept up to
date with what the engine and the shadow know of its prompt) and what of the engine's reply waits
for the shadow (`ProxiedTurn.take_shown`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from shadow.engines.dialects import Prompt
from shadow.server.http.channels import Channel, LineWriter
from shadow.server.http.deadlines import Deadlines
from shadow.server.http.lines import TurnStatus
from shadow.server.load import EngineLoad
from shadow.server.turn import ServedTurn


def known(before: Future) -> Prompt | None:
    """The prompt the dialect found before the response, if it is there already (never waits)."""
    if before.done() and not before.cancelled() and before.exception() is None:
        return before.result()
    return None


@dataclass(eq=False)
class ProxiedTurn:
    """One request through the proxy, made in `Proxy.forward` and ended once: everything its
    relay, its hand-overs to the shadow and its end need, in one place."""

    turn: ServedTurn  # the service's record (its `shown` part is the proxy's)
    body: dict  # the client's request, as it came
    chat: bool  # a chat completion (else a completion)
    session: str | None  # the session it reads into, where known when it was sent
    before: Future  # the prompt ids the dialect knows before the response, sought beside it
    label: Callable[[], tuple[str | None, str | None]] | None = None  # asks the engine for a standing label
    lines: "Lines | None" = None  # its status lines (a streamed chat with a channel on)
    added: frozenset = frozenset()  # the fields the proxy added to the client's request
    deadlines: "Deadlines | None" = None  # the engine's time limits on it (`deadlines`), from when it went out
    feeding: asyncio.Task | None = None  # its latest hand-over to the shadow beside the stream

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    def take_shown(self, max_prompt_tokens: int | None) -> None:
        """What the engine has shown of the turn so far (or the prompt known before its response)
        becomes what waits for the device: a prompt not fed yet, output ids not fed yet. A prompt
        longer than `max_prompt_tokens` is never taken."""
        shown = self.turn.shown
        if shown.reply.prompt_ids is not None:
            ids = shown.reply.prompt_ids
        else:
            prompt = known(self.before)
            ids = None if prompt is None else prompt.ids
        if ids is not None and (max_prompt_tokens is None or len(ids) <= max_prompt_tokens) \
                and shown.fed_prompt is None and shown.prompt_due is None:
            shown.prompt_due = list(ids)
        if shown.reply.shown_output:
            shown.output_due += shown.reply.output_ids[shown.fed_output + len(shown.output_due):]


class Lines(LineWriter):
    """A proxied turn's lines: the engine's events classified, and what the shadow knows of the
    prompt (the new ids the engine must read) taken in when it is known."""

    def __init__(self, channel: Channel, status: TurnStatus, load: EngineLoad, turn: ServedTurn, before: Future,
                 cached: Callable[[list[int]], int] | None):
        super().__init__(channel, status, load, turn)
        self.before, self.cached = before, cached
        self._known = False

    def refresh(self, now: float) -> None:
        prompt = None if self._known else known(self.before)
        if prompt is not None:
            ids = prompt.ids
            if ids is not None:
                cached = self.cached(ids) if self.cached else 0
                if self.turn.shown.engine_cached is not None:  # the prompt is fed (or being fed): its count from before
                    cached = self.turn.shown.engine_cached
                new = len(ids) - cached
                self.status.new_tokens = new
                self.load.set_new(self.turn, new)
            self._known = True
        super().refresh(now)

    def before_event(self, event: dict, reply, now: float) -> tuple[list, str | None]:
        """The lines due with this engine event (to go out before it), and the event's kind."""
        choices = event.get("choices") if isinstance(event.get("choices"), list) else []
        choice = choices[0] if choices and isinstance(choices[0], dict) else {}
        if self.like is None and "id" in event:
            self.like = event
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        kind = None
        # a piece of whitespace alone does not end the wait: an engine may send the generation
        # prompt's own newline as a first reasoning piece before it has read anything
        # (`transformers serve`'s reasoning parser does)
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning.strip():
            kind = "reasoning"
        elif delta.get("tool_calls"):
            kind = "tool"
        elif isinstance(delta.get("content"), str) and delta["content"].strip():
            kind = "content"
        tool = None
        if kind == "tool" and reply.tool_calls:
            last = reply.tool_calls[max(reply.tool_calls)]
            tool = (last.name, last.arguments)
        out = self.before_delta(now, kind, tool) if kind else []
        if choice.get("finish_reason") is not None:
            out += self.before_delta(now, "end")
        return out, kind
