"""Whether the ids the shadow read for a turn are the ids the engine read and wrote.

A turn's ids come from a source (prompt: `engine`, `engine-tokenize`, `template`; output:
`engine`, `logprobs`) and are checked against what the engine shows: its own ids, where it
returns them (equal, id for id), and the `usage` counts always. An output is read only where its
ids are the engine's (its own id list, or the ids of its logprob tokens); text is never
re-tokenised into output ids (an equal count is not equal ids): such an output is not read, and
the next prompt brings the reply as the engine's template renders it.

Each part of a turn, its prompt and its output, ends in one of four states (`PART_STATES`):

- `verified`: read, and every check that could run passed, at least one of them (ids the
  engine's own, or compared id for id with them; or a count equal to `usage`);
- `unverified`: read, and no check could run (no usage, no ids shown);
- `mismatched`: read, and a check failed;
- `not_read`: the shadow holds none of it (no ids to be had, text only, over a limit, ids the
  shadow could not take, the shadow off).

A turn is verified when both parts are, mismatched when either is, unverified otherwise. A count
check is weaker than an id check; the record says which checks ran (`checks`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

PROMPT_SOURCES = ("engine", "engine-tokenize", "template")
OUTPUT_SOURCES = ("engine", "logprobs")
PART_STATES = ("verified", "unverified", "mismatched", "not_read")


@dataclass
class TurnIds:
    """The ids the shadow reads for one turn, where they came from, and what the engine showed."""

    prompt: list[int] | None = None
    prompt_source: str | None = None
    output: list[int] = field(default_factory=list)
    output_source: str | None = None
    engine_prompt: list[int] | None = None  # the engine's own prompt ids, when it showed them
    engine_output: list[int] | None = None
    prompt_tokens: int | None = None  # usage
    completion_tokens: int | None = None
    notes: list[str] = field(default_factory=list)  # why a source was missing or fell back
    output_skipped: str | None = None  # why the output is not read (no engine ids, or ids known to be incomplete)


@dataclass(frozen=True)
class TurnCheck:
    verified: bool | None  # True (both parts verified), False (a part mismatched), None (otherwise)
    prompt_verified: bool | None  # True verified, False mismatched, None unverified or not read
    output_verified: bool | None
    prompt_source: str | None
    output_source: str | None
    checks: tuple[str, ...]  # what ran and passed, e.g. "prompt ids", "prompt count", "output count"
    reasons: tuple[str, ...]  # what failed, could not run, or was not read
    first_diff: int | None = None  # first differing position in the prompt (ids compared), if any
    prompt_check: str = "not_read"  # one of PART_STATES
    output_check: str = "not_read"

    def as_dict(self) -> dict:
        return {"verified": self.verified, "prompt_check": self.prompt_check, "output_check": self.output_check,
                "prompt_verified": self.prompt_verified, "output_verified": self.output_verified,
                "ids_source": {"prompt": self.prompt_source, "output": self.output_source},
                "checks": list(self.checks), "reasons": list(self.reasons), "first_diff": self.first_diff}

    def as_read(self, prompt: bool, output: bool, why: str = "the shadow did not read it") -> TurnCheck:
        """The check as the shadow holds the turn: a part it did not read (`prompt`, `output`
        False) is `not_read`, whatever its checks said (their reasons stay)."""
        prompt_check = self.prompt_check if prompt else "not_read"
        output_check = self.output_check if output else "not_read"
        if (prompt_check, output_check) == (self.prompt_check, self.output_check):
            return self
        reasons = list(self.reasons)
        if prompt_check != self.prompt_check:
            reasons.append(f"prompt not read: {why}")
        if output_check != self.output_check:
            reasons.append(f"output not read: {why}")
        return replace(self, prompt_check=prompt_check, output_check=output_check,
                       prompt_verified=_as_bool(prompt_check), output_verified=_as_bool(output_check),
                       verified=_turn(prompt_check, output_check), reasons=tuple(reasons),
                       output_source=self.output_source if output else None)


def _as_bool(state: str) -> bool | None:
    return {"verified": True, "mismatched": False}.get(state)


def _turn(prompt: str, output: str) -> bool | None:
    if "mismatched" in (prompt, output):
        return False
    return True if prompt == output == "verified" else None


def first_difference(a: list[int], b: list[int]) -> int | None:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else n


@dataclass
class _Part:
    """The checks of one side of a turn (its prompt or its output)."""

    passed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    first_diff: int | None = None
    read: bool = True

    @property
    def state(self) -> str:
        if not self.read:
            return "not_read"
        return "mismatched" if self.failed else ("verified" if self.passed else "unverified")


def _check_part(name: str, ids: list[int], source: str | None, engine_ids: list[int] | None,
                usage_key: str, counted: int | None, *, count_ok: bool) -> _Part:
    """`name`'s ids against the engine's own ids (where it showed them and they are not the
    source already) and against its usage count."""
    part = _Part()
    if engine_ids is not None and source != "engine":
        part.first_diff = first_difference(ids, engine_ids)
        if part.first_diff is None:
            part.passed.append(f"{name} ids")
        else:
            part.failed.append(f"{name} ids differ from the engine's at {part.first_diff}")
    elif source == "engine":
        part.passed.append(f"{name} ids")
    if counted is None:
        part.unknown.append(f"no usage.{usage_key}")
    elif count_ok:
        part.passed.append(f"{name} count")
    else:
        via = f" ({source})" if name == "output" else ""
        part.failed.append(f"{name}: {len(ids)} ids{via}, the engine counted {counted}")
    return part


def check_turn(t: TurnIds) -> TurnCheck:
    """Each part's state from its ids, their source and what the engine showed; a part with no
    ids (or an output left unread) is `not_read`."""
    if t.prompt is None:
        prompt = _Part(unknown=["prompt not read: no prompt ids" + (f" ({'; '.join(t.notes)})" if t.notes else "")],
                       read=False)
    else:
        prompt = _check_part("prompt", t.prompt, t.prompt_source, t.engine_prompt, "prompt_tokens", t.prompt_tokens,
                             count_ok=t.prompt_tokens == len(t.prompt))
    if t.output_skipped is not None:
        output = _Part(unknown=[t.output_skipped], read=False)
    elif t.output_source is None:
        output = _Part(unknown=["output not read: no output ids"], read=False)
    else:
        output = _check_part("output", t.output, t.output_source, t.engine_output, "completion_tokens",
                             t.completion_tokens, count_ok=_output_count_ok(t))
    failed = (prompt.failed if prompt.read else []) + (output.failed if output.read else [])
    return TurnCheck(_turn(prompt.state, output.state), _as_bool(prompt.state), _as_bool(output.state),
                     t.prompt_source, t.output_source if output.read else None,
                     tuple(prompt.passed + output.passed), tuple(failed + prompt.unknown + output.unknown),
                     prompt.first_diff, prompt.state, output.state)


def _output_count_ok(t: TurnIds) -> bool:
    """usage.completion_tokens counts the generated ids; engines differ on whether the end token
    is among them, so a count one above it is accepted when the last id read is the end token
    the engine did not count (the caller appends it; see `dialects`)."""
    n = len(t.output)
    return t.completion_tokens == n or ("end token appended" in t.notes and t.completion_tokens == n - 1)


RECORD_REASONS = 8  # the last reasons a session file keeps, each at most RECORD_REASON_CHARS
RECORD_REASON_CHARS = 1000
RECORD_KEYS = ("frontier", "verified", "unverified", "mismatched", "parts", "first_mismatch_turn", "first_diff",
               "reasons")


def _zero() -> dict[str, int]:
    return dict.fromkeys(PART_STATES, 0)


@dataclass
class SessionChecks:
    """A session's record against the engine. History: turns verified (both parts), mismatched
    (either part) and unverified (the rest: a part not read or not checked); each part's states
    apart (`parts`); the first mismatch's turn and position. Now: `frontier`, how many of the
    session's leading ids are verified; the session is exact while it holds no id past the
    frontier. A prompt that replaces ids pulls the frontier back to what it kept; a verified
    prompt moves it to the prompt's end, a verified output past the output."""

    verified: int = 0
    unverified: int = 0
    mismatched: int = 0
    parts: dict = field(default_factory=lambda: {"prompt": _zero(), "output": _zero()})
    first_mismatch_turn: int | None = None
    first_diff: int | None = None
    frontier: int = 0
    last_reasons: tuple[str, ...] = ()
    logged: bool = False  # a mismatch was logged for this session (once)
    predicted_from: int | None = None  # ids from here on are a prediction of the next prompt (`predicted_past`)

    def replaced(self, kept: int) -> None:
        """A prompt was fed that keeps only the first `kept` ids the session held."""
        self.frontier = min(self.frontier, kept)
        self.predicted_from = None

    def predicted_past(self, kept: int) -> None:
        """The ids past the first `kept` are the next prompt's start as the chat template renders
        the turn's reply (read ahead: `ShadowService.predict`), unverified until that prompt comes."""
        self.frontier = min(self.frontier, kept)
        self.predicted_from = kept

    def add(self, turn: int, check: TurnCheck, prompt_len: int, output_len: int, latest: bool = True) -> bool:
        """Count a turn (whose prompt of `prompt_len` ids and `output_len` output ids the session
        read, if it is still the session's `latest`); True the first time the session has a
        mismatch (log it then)."""
        if check.verified is True:
            self.verified += 1
        elif check.verified is None:
            self.unverified += 1
        else:
            self.mismatched += 1
        self.parts["prompt"][check.prompt_check] += 1
        self.parts["output"][check.output_check] += 1
        if check.verified is not True:
            self.last_reasons = check.reasons
        if latest and check.prompt_check == "verified":
            self.frontier = prompt_len + (output_len if check.output_check == "verified" else 0)
        if check.verified is False:
            if self.first_mismatch_turn is None:
                self.first_mismatch_turn = turn
                self.first_diff = check.first_diff
            if not self.logged:
                self.logged = True
                return True
        return False

    @property
    def turns(self) -> int:
        return self.verified + self.unverified + self.mismatched

    def exact(self, length: int) -> bool:
        """Every id the session holds (`length` of them) is verified against the engine."""
        return length > 0 and self.frontier >= length

    def why_not(self, length: int) -> str | None:
        if self.exact(length):
            return None
        if length == 0:
            why = "the session holds no ids"
            return why + (f" ({'; '.join(self.last_reasons)})" if self.turns and self.last_reasons else "")
        if self.turns == 0:
            return "no turn of this session has been checked against the engine yet"
        predicted = self.predicted_from
        if predicted is not None and self.frontier >= predicted:
            return (f"ids {predicted:,} to {length:,} are the next prompt's start as the chat template renders "
                    "the last reply, read ahead; the next prompt checks them (serve --no-predict reads the reply as "
                    "the engine wrote it)")
        why = f"ids {self.frontier:,} to {length:,} are not verified"
        return why + (f" ({'; '.join(self.last_reasons)})" if self.last_reasons else " (a turn in flight)")

    def record(self) -> dict:
        """What a session file carries of these checks (`from_record` reads it back): the frontier,
        the turns by result, each part's states, the first mismatch, the last reasons; a restart
        keeps the session as exact as it was."""
        return {"frontier": self.frontier, "verified": self.verified, "unverified": self.unverified,
                "mismatched": self.mismatched, "parts": {k: dict(v) for k, v in self.parts.items()},
                "first_mismatch_turn": self.first_mismatch_turn, "first_diff": self.first_diff,
                "reasons": [r[:RECORD_REASON_CHARS] for r in self.last_reasons[:RECORD_REASONS]]}

    @classmethod
    def from_record(cls, record: dict, length: int) -> SessionChecks:
        """The checks a session file carried (`record`), for a session of `length` ids; a record
        that is not one (other keys or types, a frontier past the ids) is refused (ValueError)."""
        def count(v, none: bool = False) -> bool:
            return (none and v is None) or (type(v) is int and v >= 0)

        if not isinstance(record, dict) or set(record) != set(RECORD_KEYS):
            raise ValueError("not a record of a session's checks")
        parts, reasons = record["parts"], record["reasons"]
        if not all(count(record[k]) for k in ("frontier", "verified", "unverified", "mismatched")) \
                or record["frontier"] > length \
                or not all(count(record[k], none=True) for k in ("first_mismatch_turn", "first_diff")) \
                or not isinstance(parts, dict) or set(parts) != {"prompt", "output"} \
                or any(not isinstance(v, dict) or set(v) != set(PART_STATES) or not all(map(count, v.values()))
                       for v in parts.values()) \
                or not isinstance(reasons, list) or len(reasons) > RECORD_REASONS \
                or any(not isinstance(r, str) or len(r) > RECORD_REASON_CHARS for r in reasons):
            raise ValueError("not a record of a session's checks")
        return cls(verified=record["verified"], unverified=record["unverified"], mismatched=record["mismatched"],
                   parts={k: dict(v) for k, v in parts.items()}, first_mismatch_turn=record["first_mismatch_turn"],
                   first_diff=record["first_diff"], frontier=record["frontier"], last_reasons=tuple(reasons),
                   logged=record["mismatched"] > 0)

    def as_dict(self, length: int) -> dict:
        return {"exact": self.exact(length), "why_not": self.why_not(length), "verified_ids": min(self.frontier, length),
                "ids": length, "turns_verified": self.verified, "turns_unverified": self.unverified,
                "turns_mismatched": self.mismatched, "prompts": dict(self.parts["prompt"]),
                "outputs": dict(self.parts["output"]), "first_mismatch_turn": self.first_mismatch_turn,
                "first_diff": self.first_diff}
