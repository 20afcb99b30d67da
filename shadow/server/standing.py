"""Standing questions (a router in shadow mode).

A standing question is asked of the shadow at every qualifying turn's insertion point (the
prompt's last <|im_end|>): registered when the turn's prompt is fed, it holds the session's reader
at the insertion point's grid line (`hold`: the read scheduler reads it first and no further),
and is answered when the reader sits there, by one forward of the question in a fork; the answer
is journaled beside the turn's reference label (a request header, or, opt-in, the upstream
model's answer, which may come after the shadow's). Nothing of the turn changes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shadow.engines.jsonlimits import collection_paused
from shadow.errors import ShadowInputError
from shadow.core.reader import Session
from shadow.offline.journal import ids_crc
from shadow.server.host import Shadow
from shadow.server.shared import Shared


@dataclass(frozen=True)
class StandingQuestion:
    """A question asked of the shadow at every qualifying turn's insertion point (the prompt's last
    <|im_end|>), answered when the reader reaches it, journaled beside the turn's reference label
    (a request header). Nothing of the turn changes."""

    name: str
    question_ids: tuple[int, ...]
    choice_ids: tuple[int, ...]
    labels: tuple[str, ...]
    min_prompt_tokens: int = 8192
    label_header: str = "x-shadow-label"
    text: str = ""  # as written in the file (what the upstream model is asked, when it labels)


def load_standing(path: Path, tokenizer) -> StandingQuestion:
    """A standing question from a JSON file {name, text, choices, min_prompt_tokens, label_header}."""
    try:
        with collection_paused():  # a deep file recurses to Python's limit
            doc = json.loads(Path(path).read_text())
        if not isinstance(doc, dict) or not isinstance(doc.get("choices"), list) or not isinstance(doc.get("text"), str):
            raise ValueError("it needs an object with 'text' (a string) and 'choices' (a list)")
        labels = tuple(str(c) for c in doc["choices"])
        if len(labels) < 2 or len(set(labels)) != len(labels) or not all(labels) or not doc["text"].strip():
            raise ValueError("its choices must be two or more, distinct and not empty, and its text not empty")
        choice_ids = tuple(tokenizer.single_token(c) for c in labels)
        if len(set(choice_ids)) != len(choice_ids):
            raise ValueError("two choices are the same token")
        return StandingQuestion(
            name=str(doc.get("name", Path(path).stem)), question_ids=tuple(tokenizer.encode(doc["text"])),
            choice_ids=choice_ids, labels=labels,
            min_prompt_tokens=int(doc.get("min_prompt_tokens", 8192)),
            label_header=str(doc.get("label_header", "x-shadow-label")).lower(), text=str(doc["text"]),
        )
    except (OSError, UnicodeDecodeError, RecursionError, KeyError, TypeError, ValueError) as e:
        raise ShadowInputError(f"{path}: not a standing question file ({type(e).__name__}: {e})") from None


@dataclass
class Pending:
    session: str
    insertion: int
    reference: str | None
    behind: int  # ids of the session not read when the turn began
    registered: float
    turn_id: int | None = None
    label_wanted: bool = False  # the upstream model is being asked for the reference label
    reference_source: str | None = None  # "header" or "upstream"
    upstream_answer: str | None = None


class Standing:
    """The pending standing questions, one a session (a newer turn's replaces an older one). Every
    change of what holds a session goes to `hold(name, line)` (line None: released). Registering
    and answering run on the device thread; `lock` is the service's state lock."""

    def __init__(self, shared: Shared, question: StandingQuestion | None, hold: Callable[[str, int | None], None]):
        self.question, self.hold = question, hold
        self.journal, self.counters, self.clock, self.lock = shared.journal, shared.counters, shared.clock, shared.lock
        self.label_from_upstream = shared.settings.engine.label_from_upstream
        self.pending: dict[str, Pending] = {}
        self._awaiting_label: dict[int, dict] = {}  # turn id -> an answer waiting for its label

    def line(self, name: str, grid: int) -> int | None:
        """The grid line the reader holds `name` at (None: no question pending)."""
        p = self.pending.get(name)
        return None if p is None else p.insertion // grid * grid

    def register(self, shadow: Shadow, session: Session, prompt: list[int], reference: str | None, behind: int,
                 turn_id: int | None = None) -> None:
        """At a turn's fed prompt (the caller holds the lock): a question at its insertion point, if
        the prompt qualifies."""
        q = self.question
        if q is None or len(prompt) < q.min_prompt_tokens:
            return
        eos = shadow.reader.model.config.eos_token_id
        last = max((i for i, t in enumerate(prompt) if t == eos), default=None)
        if last is None:
            return
        if session.name in self.pending:
            self.counters.standing_replaced += 1
        wanted = self.label_from_upstream and reference is None
        self.pending[session.name] = Pending(session.name, last + 1, reference, behind, self.clock(), turn_id, wanted,
                                             "header" if reference is not None else None)
        self.hold(session.name, self.line(session.name, shadow.grid))

    def _drop(self, name: str) -> None:
        self.pending.pop(name, None)
        self.hold(name, None)

    def answer_if_ready(self, shadow: Shadow, session: Session) -> None:
        """On the device thread: answer the session's question once the reader sits at its
        insertion point's grid line (dropped if the session changed under it)."""
        with self.lock:
            p = self.pending.get(session.name)
            line = self.line(session.name, shadow.grid)
            if p is None or session.committed < line:
                return
            if session.committed > line or p.insertion > len(session.ids):
                self._drop(session.name)  # nothing valid to ask
                return
        q = self.question
        probs = shadow.reader.ask(session, q.question_ids, q.choice_ids, end=p.insertion).tolist()
        best = max(range(len(probs)), key=probs.__getitem__)
        record = {
            "standing": q.name, "session": session.name, "choices": list(q.labels), "probs": probs,
            "label": q.labels[best], "reference": p.reference, "reference_source": p.reference_source,
            "fresh": None, "behind": p.behind, "lag_s": round(self.clock() - p.registered, 4),
            "weights": shadow.weights, "weights_hash": shadow.weights_hash, "grid": shadow.grid,
            "arithmetic": shadow.store.identity.arithmetic, "insertion": p.insertion,
            "prefix_crc": ids_crc(session.ids[: p.insertion]), "question_tokens": len(q.question_ids),
            "question_ids": list(q.question_ids), "time": time.time(),
        }
        with self.lock:
            if self.pending.get(session.name) is p:
                self._drop(session.name)
            if p.upstream_answer is not None:
                record["upstream_answer"] = p.upstream_answer
            self.counters.standing_answered += 1
            if p.label_wanted and p.turn_id is not None:  # journaled when the upstream's label comes
                self._awaiting_label[p.turn_id] = record
            else:
                self.journal.answer(record)

    def wants_label(self, turn_id: int) -> bool:
        """Whether this turn's question waits for a label from the upstream model (the caller holds the lock)."""
        return turn_id in self._awaiting_label or any(
            p.turn_id == turn_id and p.label_wanted for p in list(self.pending.values()))

    def attach_label(self, turn_id: int, label: str | None, answer: str | None) -> None:
        """On the device thread: the upstream model's answer becomes the reference of the shadow's
        answer, journaled at once if the shadow answered already."""
        with self.lock:
            record = self._awaiting_label.pop(turn_id, None)
            if record is not None:
                self.journal.answer(record | {"reference": label, "reference_source": "upstream",
                                              "upstream_answer": answer})
                return
            for p in self.pending.values():
                if p.turn_id == turn_id and p.label_wanted:
                    p.reference, p.reference_source, p.upstream_answer = label, "upstream", answer
                    p.label_wanted = False
