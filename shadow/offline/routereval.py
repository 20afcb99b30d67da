"""Router evaluation offline: re-ask a classification question at the journal's insertion points.

The journal is `shadow serve`'s (one answered ask a line, with `session`, `insertion` (ids the
session held when asked), `question_ids`, `choices`, `probs`, `reference` (the label the router
gave, when known), `fresh` (the label was decided on that turn), `weights_hash`, `grid`). Session
ids come from the parked session files (`--disk` of serve). For each model and question the
session is read to the insertion point on the journal's grid, exactly as live, and asked.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


from shadow.errors import ShadowInputError, read_text
from shadow.offline.journal import ids_crc
from shadow.core.reader import Reader
from shadow.core.sessionfile import SessionFileError, read_ids
from shadow.model.runtime import arithmetic
from shadow.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class Entry:
    session: str
    insertion: int
    question_ids: tuple[int, ...]
    choices: tuple[str, ...]
    probs: tuple[float, ...]
    reference: str
    fresh: bool
    weights_hash: str
    grid: int
    prefix_crc: int | None
    arithmetic: str | None = None  # the live reader's kernel set and dtype, e.g. 'fla/bfloat16'


@dataclass(frozen=True)
class Question:
    """A question to re-ask: the journal's own (`text` None), or a text with its choices."""

    name: str
    text: str | None = None
    choices: tuple[str, ...] | None = None


@dataclass
class Score:
    model: str
    question: str
    random_weights: bool
    turns: int = 0
    changed: int = 0  # entries skipped: the session's ids before the insertion point changed later
    agree: int = 0
    fresh_turns: int = 0
    fresh_agree: int = 0
    constant_baseline: int = 0
    fresh_constant_baseline: int = 0
    control_max_abs_diff: float | None = None  # only where the model is the journal's own
    control_same_arithmetic: bool | None = None  # the control re-asked with the live kernels and dtype
    confusion: dict[str, Counter] = field(default_factory=dict)


def read_journal(path: str | Path) -> tuple[list[Entry], int]:
    """The journal's answers that carry a reference label, and how many answers had none (the
    journal's turn records, `"kind": "turn"`, are skipped)."""
    path = Path(path)
    if not path.is_file():
        raise ShadowInputError(f"no journal file {path}")
    entries, unlabelled = [], 0
    for n, line in enumerate(read_text(path, "journal").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if row.get("kind") == "turn":  # a turn's check against the engine, not an answer
                continue
            if row.get("reference") is None:
                unlabelled += 1
                continue
            entries.append(Entry(
                str(row["session"]), int(row["insertion"]), tuple(int(i) for i in row["question_ids"]),
                tuple(str(c) for c in row["choices"]), tuple(float(p) for p in row["probs"]),
                str(row["reference"]), bool(row.get("fresh")), str(row["weights_hash"]), int(row["grid"]),
                row.get("prefix_crc"), row.get("arithmetic"),
            ))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise ShadowInputError(f"{path}:{n}: not a journal line ({type(e).__name__}: {e})") from None
    if not entries:
        raise ShadowInputError(f"{path} has no answered ask with a reference label")
    return entries, unlabelled


def session_ids(folder: str | Path, names: set[str]) -> dict[str, list[int]]:
    """Each named session's ids from its parked file in `folder` (every byte of the file checked)."""
    found: dict[str, list[int]] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            name, ids = read_ids(path)  # every byte verified
        except SessionFileError:
            continue
        if name in names:
            found[name] = list(ids)
    missing = sorted(names - set(found))
    if missing:
        raise ShadowInputError(f"no parked session file for {', '.join(missing[:3])} in {folder}")
    return found


def evaluate(
    entries: Sequence[Entry], ids: dict[str, list[int]], reader: Reader, weights_hash: str, random_weights: bool,
    tokenizer: Tokenizer, *, question: Question, model_name: str, progress: Callable[[], None] | None = None,
) -> Score:
    score = Score(model_name, question.name, random_weights)
    valid = []
    for e in entries:
        if e.insertion > len(ids[e.session]):
            raise ShadowInputError(f"session {e.session} holds {len(ids[e.session])} ids, the journal asks at {e.insertion}")
        if e.prefix_crc is not None and ids_crc(ids[e.session][: e.insertion]) != e.prefix_crc:
            score.changed += 1  # a later prompt re-rendered what came before this ask
        else:
            valid.append(e)
    if not valid:
        return score
    entries = valid
    refs = Counter(e.reference for e in entries)
    fresh_refs = Counter(e.reference for e in entries if e.fresh)
    score.constant_baseline = refs.most_common(1)[0][1]
    score.fresh_constant_baseline = fresh_refs.most_common(1)[0][1] if fresh_refs else 0
    own = question.text is None and all(e.weights_hash == weights_hash for e in entries)
    question_ids = None if question.text is None else tokenizer.encode(question.text)
    sessions = {}
    worst = 0.0
    for e in sorted(entries, key=lambda e: (e.session, e.insertion)):
        s = sessions.get(e.session) or sessions.setdefault(e.session, reader.new_session(e.session))
        reader.feed_prompt(s, ids[e.session][: e.insertion])  # reads on from the last insertion point
        reader.advance(s)
        choices = e.choices if question.choices is None else question.choices
        choice_ids = [tokenizer.single_token(c) for c in choices]
        probs = reader.ask(s, e.question_ids if question_ids is None else question_ids, choice_ids).tolist()
        label = choices[max(range(len(probs)), key=probs.__getitem__)]
        score.turns += 1
        score.agree += label == e.reference
        score.fresh_turns += e.fresh
        score.fresh_agree += e.fresh and label == e.reference
        score.confusion.setdefault(e.reference, Counter())[label] += 1
        if own:
            worst = max(worst, max(abs(a - b) for a, b in zip(probs, e.probs)))
        if progress:
            progress()
    score.control_max_abs_diff = worst if own else None
    if own:
        mine = arithmetic(reader.model)
        score.control_same_arithmetic = all(e.arithmetic in (None, mine) for e in entries)
    return score


def load_question(spec: str) -> Question:
    """'journal' (the journal's own question), or a JSON file {"name", "text", "choices"}."""
    if spec == "journal":
        return Question("journal")
    path = Path(spec)
    try:
        doc = json.loads(read_text(path, "question file"))
        return Question(str(doc.get("name", path.stem)), str(doc["text"]), tuple(str(c) for c in doc["choices"]))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ShadowInputError(f"{spec}: not 'journal' nor a question file with text and choices ({type(e).__name__})") from None
