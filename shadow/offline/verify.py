"""Replay a conversation turn by turn and check the exactness contract.

Same grid: the replayed state against a fresh prefill of the same ids, every tensor, torch.equal.
Other grid: a fresh prefill of the same ids in chunks of another size (largest absolute
difference per tensor kind) and question probes asked of both states (top token, KL).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from shadow.text.chat import render_question
from shadow.text.rendering import CodeRendering, TemplateRendering
from shadow.text.conversations import Conversation
from shadow.errors import ShadowInputError
from shadow.core.reader import Reader, Session, check_grid
from shadow.model.state import ModelState, tensor_kind
from shadow.core.store import SessionStore
from shadow.text.tokenizer import Tokenizer

PROBES = (
    "What task is the user asking for? Answer in one line.",
    "Which file was read or changed last?",
    "Did the last command succeed? Answer yes or no.",
    "Summarise the latest tool output in one sentence.",
)
KINDS = ("k", "v", "recurrent", "conv")


@dataclass
class Predictions:
    """What predicting each next prompt did: predictions made, and those the next prompt sent back."""

    made: int = 0
    missed: int = 0


@dataclass
class OtherGrid:
    grid: int
    max_abs_diff: dict[str, float]
    probe_top1_agree: int
    probes: int
    probe_max_kl: float


@dataclass
class Verdict:
    """What verify-exact found for one conversation."""

    name: str
    turns: int
    tokens: int  # ids the session holds at the end
    committed: int
    rollbacks: int
    ids_reread: int
    same_grid_bit_equal: bool
    tensors_compared: int
    mismatched: list[str] = field(default_factory=list)
    other_grid: OtherGrid | None = None
    chunks_batched: int = 0  # of its chunks, those read in one forward with other sessions' (`batch` > 1)
    predictions: int = 0  # next prompts predicted at a turn's end (`predict`)
    predictions_missed: int = 0  # of those, the ones the next prompt sent back


def replay(
    reader: Reader, tokenizer: Tokenizer, conversations: Sequence[Conversation], store: SessionStore,
    on_turn: Callable[[], None] | None = None, batch: int = 1, *, batched: Counter | None = None,
    rendering: CodeRendering | TemplateRendering | None = None, predict: bool = False,
    predictions: dict[str, Predictions] | None = None, hold_max: int | None = None, read_ahead: bool = False,
) -> dict[str, list[int]]:
    """Feed every request of every conversation (its re-rendered prompt, then its output) and read
    after each, the conversations' turns interleaved round robin through `store` (which may
    spill or drop sessions between turns). With `batch` > 1 a round's turns are fed side by side
    and their chunks read up to `batch` sessions a forward (`Reader.advance_batch`), the sessions
    at their own depths; the store must then keep them all resident (no cap), and `batched`
    counts each conversation's chunks read beside another's. `rendering`: how turns become ids
    (default: the template in code). `predict` (a rendering that predicts): each output is held
    out of reading and, at the turn's end, read only up to where the next prompt's start as
    predicted differs from it (`read_ahead`: replaced by that prediction and read, `Reader.predict`),
    counted in `predictions`; an output that leaves more than `hold_max` ids
    unread is read as it came (as `shadow serve` lets a hold go when a phrase or an ask must read
    it from a fork), and its prediction sends those rows back. Returns each conversation's final ids."""
    rendering = rendering or CodeRendering(tokenizer)
    predict = predict and rendering.predicts
    predictions = predictions if predictions is not None else {}
    for c in conversations:
        predictions.setdefault(c.name, Predictions())
    pending = {c.name: list(c.requests()) for c in conversations}
    final: dict[str, list[int]] = {}

    predicted: set[str] = set()  # sessions whose ids end in a prediction no prompt has checked yet

    def feed(name: str, session: Session, history) -> None:
        fed = reader.feed_prompt(session, rendering.prompt(history), hold_output=predict)
        if name in predicted and fed.rolled_back_to is not None:
            predictions[name].missed += 1
        predicted.discard(name)

    def output(name: str, session: Session, turn: int) -> None:
        reader.feed_output(session, rendering.output(*pending[name][turn]))
        if session.hold is not None and hold_max is not None and len(session.ids) - session.committed > hold_max:
            session.hold = None

    def turn_over(name: str, session: Session, turn: int) -> None:
        """The turn's end: where a next request comes (the last turn's is not predicted: no request
        would check it), the next prompt's start predicted: the session reads on up to where it
        differs from the ids served and holds the rest (`read_ahead`: takes the prediction's ids
        and reads them); else the output is read as it came."""
        history, output = pending[name][turn]
        ids = rendering.next_prompt(history, output) if predict and turn + 1 < len(pending[name]) else None
        if ids is None or (session.hold is None and not read_ahead):
            session.hold = None
            return
        if read_ahead:
            reader.predict(session, ids)
        else:
            reader.hold_past(session, ids)
        predictions.setdefault(name, Predictions()).made += 1
        predicted.add(name)

    for turn in range(max(len(r) for r in pending.values())):
        names = [name for name, requests in pending.items() if turn < len(requests)]
        if batch > 1:
            sessions = [store.get(name) for name in names]
            for name, session in zip(names, sessions):
                feed(name, session, pending[name][turn][0])
            read_batched(reader, sessions, batch, batched)
            for name, session in zip(names, sessions):
                output(name, session, turn)
            read_batched(reader, sessions, batch, batched)
            for name, session in zip(names, sessions):
                turn_over(name, session, turn)
            read_batched(reader, sessions, batch, batched)
            for name, session in zip(names, sessions):
                final[name] = list(session.ids)
                if on_turn:
                    on_turn()
            continue
        for name in names:
            session = store.get(name)
            feed(name, session, pending[name][turn][0])
            reader.advance(session)
            output(name, session, turn)
            reader.advance(session)
            turn_over(name, session, turn)
            reader.advance(session)
            final[name] = list(session.ids)
            store.settle(keep=name)
            if on_turn:
                on_turn()
    return final


def read_batched(reader: Reader, sessions: Sequence[Session], batch: int, batched: Counter | None = None) -> int:
    """Every whole chunk of `sessions`, read in forwards of up to `batch` sessions' next chunks
    (those with a chunk to read, in their order); `batched` counts, by session name, the chunks
    read beside another session's. Returns the forwards run."""
    forwards = 0
    while True:
        ready = [s for s in sessions if s.committed + reader.grid <= s.readable][:batch]
        if not ready:
            return forwards
        reader.advance_batch(ready)
        forwards += 1
        if batched is not None and len(ready) > 1:
            batched.update(s.name for s in ready)


def compare_states(a: ModelState, b: ModelState) -> tuple[int, list[str], dict[str, float]]:
    """(tensors compared, names not bit-equal, largest absolute difference by kind)."""
    ta, tb = a.tensors(), b.tensors()
    if ta.keys() != tb.keys() or a.length != b.length:
        raise ValueError("states of different models or lengths")
    mismatched, diffs = [], dict.fromkeys(KINDS, 0.0)
    for name, x in ta.items():
        y = tb[name]
        if not torch.equal(x, y):
            mismatched.append(name)
            kind = tensor_kind(name)
            diffs[kind] = max(diffs[kind], (x.float() - y.float()).abs().max().item())
    return len(ta), mismatched, diffs


def probe_agreement(
    reader: Reader, tokenizer: Tokenizer, session: Session, other: ModelState,
    probes: Sequence[str] = PROBES,
) -> tuple[int, float]:
    """Ask each probe of the session's state and of `other` (same ids); (top-1 agreements, max KL)."""
    agree, worst = 0, 0.0
    mirror = Session(name=session.name, state=other, ids=session.ids)
    for text in probes:
        question = tokenizer.encode(render_question(text))
        p = torch.log_softmax(reader.next_logits(session, question).double(), -1)
        q = torch.log_softmax(reader.next_logits(mirror, question).double(), -1)
        agree += int(p.argmax() == q.argmax())
        worst = max(worst, float((p.exp() * (p - q)).sum()))
    return agree, worst


def verify(
    reader: Reader, tokenizer: Tokenizer, conversations: Sequence[Conversation],
    against_grid: int | None = None, store: SessionStore | None = None,
    progress: Callable[[int, int, str], None] | None = None, *, batch: int = 1,
    rendering: CodeRendering | TemplateRendering | None = None, predict: bool = False, hold_max: int | None = None,
    read_ahead: bool = False,
) -> list[Verdict]:
    """Replay `conversations` (interleaved, through `store`; default: one with no cap), then
    compare each final state with fresh prefills. ShadowInputError, before anything is read or
    written, when `store` already holds a session named like a conversation. progress(done, total, stage) is called as it
    goes (total = all turns + 2 per conversation). `batch` > 1: chunks read several sessions a
    forward (`replay`); ShadowInputError where `store` has a cap, which could spill a session
    between its feed and its read. `rendering`, `predict`, `hold_max`, `read_ahead`: as `replay`."""
    if against_grid is not None:
        check_grid(against_grid)
    if not isinstance(batch, int) or batch < 1:
        raise ShadowInputError(f"batch must be a whole number of sessions from 1 up, got {batch!r}")
    if batch > 1 and store is not None and store.cap is not None:
        raise ShadowInputError("batched reads keep a round's sessions resident together: give no cap with a batch")
    names = [c.name for c in conversations]
    if len(set(names)) != len(names):
        raise ShadowInputError(f"two conversations share a name: {min(n for n in names if names.count(n) > 1)}")
    store = store or SessionStore(reader, weights_hash="", cap_gib=None)
    held = sorted(set(names) & set(store.names()))
    if held:  # a replay starts from an empty session; an earlier run's would be continued
        raise ShadowInputError(
            f"the store already holds a session named {held[0]!r} (an earlier run's?): "
            "verify replays each conversation from empty, so give it a folder without it"
        )
    turns = {c.name: sum(1 for _ in c.requests()) for c in conversations}
    total, done = sum(turns.values()) + 2 * len(conversations), 0
    report = progress or (lambda done, total, stage: None)

    def turn_done() -> None:
        nonlocal done
        done += 1
        report(done, total, "replay")

    batched = Counter()
    predictions: dict[str, Predictions] = {}
    final = replay(reader, tokenizer, conversations, store, turn_done, batch, batched=batched,
                   rendering=rendering, predict=predict, predictions=predictions, hold_max=hold_max,
                   read_ahead=read_ahead)
    verdicts = []
    for conv in conversations:
        session = store.get(conv.name)
        if session.ids != final[conv.name]:  # dropped past the cap without a disk: read it again
            reader.feed_prompt(session, final[conv.name])
            reader.advance(session)
        committed = session.committed
        fresh = reader.prefill(session.ids[:committed])
        compared, mismatched, _ = compare_states(session.state, fresh)
        done += 1
        report(done, total, f"{conv.name}: fresh prefill, same grid")
        verdict = Verdict(
            name=conv.name, turns=turns[conv.name], tokens=len(session.ids), committed=committed,
            rollbacks=session.rollbacks, ids_reread=session.ids_reread,
            same_grid_bit_equal=not mismatched, tensors_compared=compared, mismatched=mismatched,
            chunks_batched=batched[conv.name], predictions=predictions[conv.name].made,
            predictions_missed=predictions[conv.name].missed,
        )
        if against_grid is not None:
            other = reader.prefill(session.ids[:committed], chunk=against_grid)
            _, _, diffs = compare_states(session.state, other)
            agree, kl = probe_agreement(reader, tokenizer, session, other)
            verdict.other_grid = OtherGrid(against_grid, diffs, agree, len(PROBES), kl)
        done += 1
        report(done, total, f"{conv.name}: fresh prefill, other grid")
        store.settle(keep=conv.name)
        verdicts.append(verdict)
    return verdicts
