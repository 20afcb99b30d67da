"""A proxied turn's status lines (`Lines`), kept up to date with what the engine and the shadow
know of its prompt; and `take`, which moves what the engine has shown of a turn so far onto the
turn's record for the device (`ShadowService.feed_held`)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from shadow.server.http.channels import Channel, LineWriter
from shadow.server.http.lines import TurnStatus
from shadow.server.load import EngineLoad
from shadow.server.turn import ServedTurn


def take(turn: ServedTurn, before: Future, max_prompt_tokens: int | None) -> None:
    """What the engine has shown of the turn so far (or the prompt known before its response)
    becomes what the turn holds for the device: a prompt not fed yet, output ids not fed yet."""
    if turn.reply.prompt_ids is not None:
        ids = turn.reply.prompt_ids
    elif before.done() and not before.cancelled() and before.exception() is None:
        ids = before.result().ids
    else:
        ids = None
    if ids is not None and (max_prompt_tokens is None or len(ids) <= max_prompt_tokens) \
            and turn.fed_prompt is None and turn.prompt_due is None:
        turn.prompt_due = list(ids)
    if turn.reply.shown_output:
        turn.held += turn.reply.output_ids[turn.fed_output + len(turn.held):]


class Lines(LineWriter):
    """A proxied turn's lines: the engine's events classified, and what the shadow knows of the
    prompt (the new ids the engine must read) taken in when it is known."""

    def __init__(self, channel: Channel, status: TurnStatus, load: EngineLoad, turn: ServedTurn, before: Future,
                 cached: Callable[[list[int]], int] | None):
        super().__init__(channel, status, load, turn)
        self.before, self.cached = before, cached
        self._known = False

    def refresh(self, now: float) -> None:
        if not self._known and self.before.done() and not self.before.cancelled() and self.before.exception() is None:
            ids = self.before.result().ids
            if ids is not None:
                held = self.cached(ids) if self.cached else 0
                if self.turn.engine_held is not None:  # the prompt is fed (or being fed): its count from before
                    held = self.turn.engine_held
                new = len(ids) - held
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
