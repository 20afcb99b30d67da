"""Whether the ids the shadow read for a turn are the ids the engine read and wrote.

A turn's ids come from a source (prompt: `engine`, `engine-tokenize`, `template`; output:
`engine`, `logprobs`, `retokenised`) and are checked against what the engine shows: its own ids,
where it returns them (equal, id for id), and the `usage` counts always. A turn is verified when
every check that could run passed and at least one ran for the prompt and one for the output
(or the output was not read: re-tokenised text that cannot match the engine's count is left for
the next prompt to bring); mismatched when any failed; unknown otherwise. A count check is weaker than an id check (equal
counts do not prove equal ids); the record says which checks ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROMPT_SOURCES = ("engine", "engine-tokenize", "template")
OUTPUT_SOURCES = ("engine", "logprobs", "retokenised")


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
    output_skipped: str | None = None  # why the output was not read (it could not be made to match the engine)


@dataclass(frozen=True)
class TurnCheck:
    verified: bool | None  # True, False (a check failed), None (nothing could be checked)
    prompt_verified: bool | None
    output_verified: bool | None
    prompt_source: str | None
    output_source: str | None
    checks: tuple[str, ...]  # what ran and passed, e.g. "prompt ids", "prompt count", "output count"
    reasons: tuple[str, ...]  # what failed or could not run
    first_diff: int | None = None  # first differing position in the prompt (ids compared), if any

    def as_dict(self) -> dict:
        return {"verified": self.verified, "prompt_verified": self.prompt_verified,
                "output_verified": self.output_verified,
                "ids_source": {"prompt": self.prompt_source, "output": self.output_source},
                "checks": list(self.checks), "reasons": list(self.reasons), "first_diff": self.first_diff}


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

    @property
    def verified(self) -> bool | None:
        return False if self.failed else (True if self.passed else None)


def _check_part(name: str, ids: list[int], source: str | None, engine_ids: list[int] | None,
                usage_key: str, counted: int | None, count_ok: bool) -> _Part:
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
    if t.prompt is None:
        prompt = _Part(unknown=["no prompt ids" + (f" ({'; '.join(t.notes)})" if t.notes else "")])
    else:
        prompt = _check_part("prompt", t.prompt, t.prompt_source, t.engine_prompt, "prompt_tokens", t.prompt_tokens,
                             t.prompt_tokens == len(t.prompt))
    if t.output_skipped is not None:
        output = _Part(unknown=[t.output_skipped])
    elif t.output_source is None:
        output = _Part(unknown=["no output ids"])
    else:
        output = _check_part("output", t.output, t.output_source, t.engine_output, "completion_tokens",
                             t.completion_tokens, _output_count_ok(t))
    failed = prompt.failed + output.failed
    if failed:
        verified = False
    elif prompt.verified and (output.verified or t.output_skipped is not None):  # every id read is verified
        verified = True
    else:
        verified = None
    return TurnCheck(verified, prompt.verified, output.verified, t.prompt_source, t.output_source,
                     tuple(prompt.passed + output.passed), tuple(failed + prompt.unknown + output.unknown),
                     prompt.first_diff)


def _output_count_ok(t: TurnIds) -> bool:
    """usage.completion_tokens counts the generated ids; engines differ on whether the end token
    is among them, so a count one above it is accepted when the last id read is the end token
    the engine did not count (the caller appends it; see `dialects`)."""
    n = len(t.output)
    return t.completion_tokens == n or ("end token appended" in t.notes and t.completion_tokens == n - 1)


@dataclass
class SessionChecks:
    """A session's record against the engine. History: turns verified, unverified (nothing could
    be checked) and mismatched, the first mismatch's turn and position. Now: `frontier`, how many
    of the session's leading ids are verified; the session is exact while it holds no id past
    the frontier. A prompt that replaces ids pulls the frontier back to what it kept; a verified
    prompt moves it to the prompt's end, a verified output past the output."""

    verified: int = 0
    unverified: int = 0
    mismatched: int = 0
    first_mismatch_turn: int | None = None
    first_diff: int | None = None
    frontier: int = 0
    last_reasons: tuple[str, ...] = ()
    logged: bool = False  # a mismatch was logged for this session (once)

    def replaced(self, kept: int) -> None:
        """A prompt was fed that keeps only the first `kept` ids the session held."""
        self.frontier = min(self.frontier, kept)

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
        if check.verified is not True:
            self.last_reasons = check.reasons
        if latest and check.prompt_verified:
            self.frontier = prompt_len + (output_len if check.output_verified else 0)
        if check.verified is False:
            if self.first_mismatch_turn is None:
                self.first_mismatch_turn = turn
                self.first_diff = check.first_diff
            if not self.logged:
                self.logged = True
                return True
        return False

    def exact(self, length: int) -> bool:
        """Every id the session holds (`length` of them) is verified against the engine."""
        return length > 0 and self.frontier >= length

    def why_not(self, length: int) -> str | None:
        if self.exact(length):
            return None
        if length == 0:
            return "the session holds no ids"
        if self.verified + self.unverified + self.mismatched == 0:
            return "no turn of this session has been checked against the engine yet"
        why = f"ids {self.frontier:,} to {length:,} are not verified"
        return why + (f" ({'; '.join(self.last_reasons)})" if self.last_reasons else " (a turn in flight)")

    def as_dict(self, length: int) -> dict:
        return {"exact": self.exact(length), "why_not": self.why_not(length), "verified_ids": min(self.frontier, length),
                "ids": length, "turns_verified": self.verified, "turns_unverified": self.unverified,
                "turns_mismatched": self.mismatched, "first_mismatch_turn": self.first_mismatch_turn,
                "first_diff": self.first_diff}
