"""One proxied turn on its way: what the shadow was fed of it and what waits for the device
(`Turn`), and its status lines, kept up to date with what the engine and the shadow know
(`Lines`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future

from shadow.errors import ShadowInputError
from shadow.server.http.channels import Channel, LineWriter
from shadow.engines.reply import Reply
from shadow.server.service import ShadowService
from shadow.server.http.status import EngineLoad, TurnStatus

log = logging.getLogger("shadow.proxy")


class Turn:
    """One proxied turn: what the shadow was fed so far, and what waits for the device."""

    def __init__(self, service: ShadowService, turn_id: int):
        self.service, self.turn_id = service, turn_id
        self.reply = Reply()
        self.fed_prompt: list[int] | None = None
        self.prompt_due: list[int] | None = None  # known, not yet fed (the device was busy)
        self.fed_output = 0  # output ids fed so far
        self.held: list[int] = []  # output ids not fed yet
        self.notes: list[str] = []  # what happened to the request on its way (for the turn's record)

    def take_prompt(self, ids: list[int] | None) -> None:
        if ids is not None and self.fed_prompt is None and self.prompt_due is None:
            self.prompt_due = list(ids)

    def feed(self, wait: bool, share: bool) -> bool:
        """Hand the shadow what it can take now (a prompt, output ids, and between deltas a share
        slice); with wait False nothing happens while the device is busy."""
        prompt, output = self.prompt_due, self.held
        # a share slice may read any session (the scheduler picks), not only this turn's
        if prompt is None and not output and not share:
            return True
        if not _on_device(self.service, self.turn_id, prompt, output, share, wait):
            return False
        if prompt is not None:
            self.fed_prompt, self.prompt_due = prompt, None
        self.fed_output += len(output)
        self.held = []
        return True


def _on_device(service: ShadowService, turn_id: int, prompt, output, share: bool, wait: bool) -> bool:
    """Feed the shadow on the device thread. Ids it cannot take (outside its vocabulary) are
    skipped and logged. With wait False and the device busy, nothing is done and False returns."""

    def feed() -> None:
        try:
            if prompt is not None:
                service.set_prompt(turn_id, prompt)
            if output and service.has_prompt(turn_id):
                service.add_output(turn_id, output)
            if share:
                service.share_slice(turn_id)
        except ShadowInputError as e:
            log.warning("the shadow skipped ids of turn %s: %s", turn_id, e)

    if wait:
        service.run_request(feed)
        return True
    return service.device.run_if_idle(feed, "turn")[0]


class Lines(LineWriter):
    """A proxied turn's lines: the engine's events classified, and what the shadow knows of the
    prompt (the new ids the engine must read) taken in when it is known."""

    def __init__(self, channel: Channel, status: TurnStatus, load: EngineLoad, turn_id: int, before: Future,
                 cached: Callable[[list[int]], int] | None):
        super().__init__(channel, status, load, turn_id)
        self.before, self.cached = before, cached
        self._known = False

    def refresh(self, now: float) -> None:
        if not self._known and self.before.done() and not self.before.cancelled() and self.before.exception() is None:
            ids = self.before.result().ids
            if ids is not None:
                new = len(ids) - (self.cached(ids) if self.cached else 0)
                self.status.new_tokens = new
                self.load.set_new(self.turn_id, new)
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
