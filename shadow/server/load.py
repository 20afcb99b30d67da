"""The engine's load, for the status lines: which turns it is prefilling, and its measured prefill
rate. Kept on the turns' own records (`ServedTurn.sent`, `new_tokens`, `engine_first`, `alone`,
`answered`), read from the one turn table.

`slots`: how many requests the engine prefills at once (llama.cpp's `-np`; large for vLLM and
SGLang); a request with `slots` or more unfinished prefills before it waits. The rate is an
exponentially weighted mean of new ids over time to first token, from turns that had nothing
ahead of them.
"""

from __future__ import annotations

from shadow.core.turns import TurnTable
from shadow.server.turn import Phase, ServedTurn


class EngineLoad:
    def __init__(self, turns: TurnTable, slots: int = 1, weight: float = 0.3):
        self.turns, self.slots, self.weight = turns, max(1, slots), weight
        self.rate: float | None = None

    def sent(self, turn: ServedTurn, now: float, new_tokens: int | None = None) -> None:
        """The turn went to the engine now; `new_tokens`: ids it must read, when known."""
        turn.sent, turn.new_tokens = now, new_tokens
        turn.alone = not self._prefilling(turn)

    def set_new(self, turn: ServedTurn, new_tokens: int | None) -> None:
        turn.new_tokens = new_tokens

    def first_token(self, turn: ServedTurn, now: float) -> None:
        """The engine's first piece of the turn: its prefill is over (the rate is measured once)."""
        if turn.sent is None or turn.engine_first is not None:
            return
        turn.engine_first = now
        if turn.alone and turn.new_tokens and now > turn.sent:
            r = turn.new_tokens / (now - turn.sent)
            self.rate = r if self.rate is None else (1 - self.weight) * self.rate + self.weight * r

    def answered(self, turn: ServedTurn) -> None:
        """The engine's response is over (whatever the shadow still does with the turn)."""
        turn.reach(Phase.ANSWERED)

    def _prefilling(self, turn: ServedTurn) -> list[ServedTurn]:
        return [t for t in self.turns if t is not turn and isinstance(t, ServedTurn) and t.sent is not None
                and t.engine_first is None and not t.answered]

    def ahead(self, turn: ServedTurn, now: float) -> list[float]:
        """Seconds left of each earlier prefill this one waits behind (none while a slot is free)."""
        earlier = [t for t in self._prefilling(turn) if t.id < turn.id]
        if len(earlier) < self.slots:
            return []
        out = []
        for t in earlier:
            left = (t.new_tokens / self.rate - (now - t.sent)) if (t.new_tokens and self.rate) else 0.0
            out.append(max(0.0, left))
        return out
