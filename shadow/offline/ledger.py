"""Request ledgers: the project's JSONL format, a writer, and importers for real traces.

Ledger format (`*.ledger.jsonl`), one request a line, in any order:

    {"session": "s1", "start": 12.5, "first_token": 13.1, "end": 20.4,
     "prompt_tokens": 16350, "new_prompt_tokens": 1200, "output_tokens": 346}

Times in seconds (any origin); `start` is the request's arrival, `first_token` its first output
token, `end` its last. `new_prompt_tokens` is what the shadow has not seen: the prompt minus the
prefix it shares with the session's previous prompt and output (a re-rendered earlier answer is
not shared). Rules: start <= first_token <= end, no negative times or counts,
new_prompt_tokens <= prompt_tokens.

Optional, where the big model's template rendered the turns (`import_trajectory` with a
renderer): `predicted_tokens`, the length of the next prompt's start the proxy predicts at this
request's end (`ChatRenderer.next_prompt_ids`; 0: none), `predicted_kept`, the ids of this
request's prompt and output the prediction keeps, and `predicted_confirmed`, the ids of the
prediction the next prompt holds. Rules: kept <= prompt + output, confirmed <= predicted.

Optional, from a live run: `output_seen` (true when absent), false where the engine never gave
the proxy this response's output as ids it could check (llama-server's streamed logprobs short of
its own count); the shadow then gets that output with the session's next prompt.
"""

from __future__ import annotations

import heapq
import json
import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from shadow.errors import ShadowInputError, read_text

FIELDS = ("session", "start", "first_token", "end", "prompt_tokens", "new_prompt_tokens", "output_tokens")
PREDICTED = ("predicted_tokens", "predicted_kept", "predicted_confirmed")  # optional, 0 when absent


@dataclass(frozen=True)
class Request:
    session: str
    start: float
    first_token: float
    end: float
    prompt_tokens: int
    new_prompt_tokens: int
    output_tokens: int
    predicted_tokens: int = 0
    predicted_kept: int = 0
    predicted_confirmed: int = 0
    output_seen: bool = True


@dataclass(frozen=True)
class Arrival:
    """A request as a trace gives it, before a service model times it."""

    session: str
    time: float
    prompt_tokens: int
    new_prompt_tokens: int
    output_tokens: int


ROUTES = ("affinity", "hash", "rendezvous", "round-robin")


class Router:
    """Which of `engines` engines serves a request. 'affinity': a session's first request goes to
    the engine with the fewest requests in flight (ties to the lowest index) and the session stays
    there; 'hash': crc32 of the session's name modulo the engines (stays too); 'rendezvous': the
    engine whose crc32 of (session, engine) is highest (stays; one more engine takes sessions from
    every other and moves no other session); 'round-robin': request after request in arrival
    order, whatever the session."""

    def __init__(self, engines: int = 1, how: str = "affinity"):
        if engines < 1:
            raise ShadowInputError("a fleet needs at least one engine")
        if how not in ROUTES:
            raise ShadowInputError(f"unknown route {how!r} ({', '.join(ROUTES)})")
        self.engines, self.how = engines, how
        self._home: dict[str, int] = {}
        self._next = 0

    def pick(self, session: str, in_flight: Sequence[int]) -> int:
        """The engine for the next request of `session`; `in_flight`: requests each engine holds now."""
        if self.engines == 1:
            return 0
        if self.how == "round-robin":
            self._next += 1
            return (self._next - 1) % self.engines
        if self.how == "hash":
            return zlib.crc32(session.encode()) % self.engines
        if self.how == "rendezvous":
            return max(range(self.engines), key=lambda e: (zlib.crc32(f"{session}\0{e}".encode()), -e))
        if session not in self._home:
            self._home[session] = min(range(self.engines), key=lambda e: (in_flight[e], e))
        return self._home[session]


def route_requests(requests: Sequence[Request], engines: int = 1, how: str = "affinity") -> list[int]:
    """The engine of each request (same order), requests in flight counted from their own times."""
    router = Router(engines, how)
    ends: list[list[float]] = [[] for _ in range(engines)]
    out = [0] * len(requests)
    for i in sorted(range(len(requests)), key=lambda i: requests[i].start):
        r = requests[i]
        for heap in ends:
            while heap and heap[0] <= r.start:
                heapq.heappop(heap)
        e = out[i] = router.pick(r.session, [len(h) for h in ends])
        heapq.heappush(ends[e], r.end)
    return out


@dataclass(frozen=True)
class ServiceModel:
    """Turns arrivals and token counts into first-token and end times, for traces without them:
    each engine serves `slots` requests at once, first come first served; a request waits for a
    free slot, prefills its new prompt tokens (the engine caches shared prefixes) at
    `prefill_tok_s`, then decodes at `decode_tok_s`."""

    prefill_tok_s: float = 20_000.0
    decode_tok_s: float = 40.0
    slots: int = 32

    def serve(self, arrivals: Sequence[Arrival | tuple]) -> list[Request]:
        """One engine; arrivals as `Arrival`s or (session, arrival s, prompt, new prompt, output) tuples."""
        return self.serve_fleet(arrivals)[0]

    def serve_fleet(self, arrivals: Sequence[Arrival | tuple], engines: int = 1,
                    route: str = "affinity") -> tuple[list[Request], list[int]]:
        """A fleet: each arrival routed when it comes (`Router`, requests in flight counted on the
        engines' own slots), then served by its engine. Returns the requests in arrival order and
        each one's engine."""
        router = Router(engines, route)
        free = [[0.0] * self.slots for _ in range(engines)]
        ends: list[list[float]] = [[] for _ in range(engines)]
        out, engine_of = [], []
        for a in sorted((a if isinstance(a, Arrival) else Arrival(*a) for a in arrivals), key=lambda a: a.time):
            for heap in ends:
                while heap and heap[0] <= a.time:
                    heapq.heappop(heap)
            e = router.pick(a.session, [len(h) for h in ends])
            slots = free[e]
            slot = min(range(self.slots), key=slots.__getitem__)
            begin = max(a.time, slots[slot])
            first = begin + a.new_prompt_tokens / self.prefill_tok_s
            end = first + a.output_tokens / self.decode_tok_s
            slots[slot] = end
            heapq.heappush(ends[e], end)
            out.append(Request(a.session, a.time, first, end, a.prompt_tokens, a.new_prompt_tokens, a.output_tokens))
            engine_of.append(e)
        return out, engine_of


def write_ledger(path: str | Path, requests: Iterable[Request]) -> None:
    with open(path, "w") as f:
        for r in requests:
            row = asdict(r)
            if not r.predicted_tokens:
                row = {k: v for k, v in row.items() if k not in PREDICTED}
            if r.output_seen:
                del row["output_seen"]
            f.write(json.dumps(row) + "\n")


def read_ledger(path: str | Path) -> list[Request]:
    """Read and check a ledger; a bad line gets a ShadowInputError naming the file and line."""
    out = []
    for where, row in _json_lines(Path(path), "ledger"):
        if not isinstance(row, dict) or set(FIELDS) - set(row):
            missing = sorted(set(FIELDS) - set(row)) if isinstance(row, dict) else list(FIELDS)
            raise ShadowInputError(f"{where}: not a ledger line (missing {', '.join(missing)})")
        try:
            r = Request(
                str(row["session"]), float(row["start"]), float(row["first_token"]), float(row["end"]),
                int(row["prompt_tokens"]), int(row["new_prompt_tokens"]), int(row["output_tokens"]),
                *(_count(row.get(k, 0)) for k in PREDICTED), _flag(row.get("output_seen", True), "output_seen"),
            )
        except (TypeError, ValueError) as e:
            raise ShadowInputError(f"{where}: {e}") from None
        check_request(r, where)
        out.append(r)
    if not out:
        raise ShadowInputError(f"{path} holds no requests")
    return out


def read_asks(path: str | Path) -> tuple[tuple[float, str, str], ...]:
    """Asks as a client sent them, one JSON object a line: `time` (seconds on the ledger's clock,
    finite, not negative), `session` (a name), `kind` (optional, at most 40 characters; "ask"
    without one). A bad line gets a ShadowInputError naming the file and line."""
    out = []
    for where, row in _json_lines(Path(path), "asks"):
        if not isinstance(row, dict):
            raise ShadowInputError(f"{where}: not an object with time and session")
        t, session, kind = row.get("time"), row.get("session"), row.get("kind", "ask")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ShadowInputError(f"{where}: time is a finite number of seconds, not negative (got {t!r})")
        if not isinstance(session, str) or not session:
            raise ShadowInputError(f"{where}: session is a non-empty name")
        if not isinstance(kind, str) or not 0 < len(kind) <= 40:
            raise ShadowInputError(f"{where}: kind is a name of 1 to 40 characters")
        out.append((float(t), session, kind))
    if not out:
        raise ShadowInputError(f"{path} holds no asks")
    return tuple(out)


def _json_lines(path: Path, what: str) -> Iterable[tuple[str, object]]:
    """(where, value) of each non-blank line of a JSON Lines file the user named: `where` its
    file:line; a ShadowInputError for a missing file or a line that is not JSON."""
    if not path.is_file():
        raise ShadowInputError(f"no {what} file {path}")
    for n, line in enumerate(read_text(path, f"{what} file").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{n}", json.loads(line)
        except json.JSONDecodeError as e:
            raise ShadowInputError(f"{path}:{n}: not valid JSON: {e}") from None


def _count(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"a predicted count must be a whole number, got {value!r}")
    return value


def _flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} is true or false, got {value!r}")
    return value


def check_request(r: Request, where: str) -> None:
    if min(r.start, r.first_token, r.end) < 0:
        raise ShadowInputError(f"{where}: negative time")
    if not r.start <= r.first_token <= r.end:
        raise ShadowInputError(f"{where}: times out of order (need start <= first_token <= end)")
    if min(r.prompt_tokens, r.new_prompt_tokens, r.output_tokens) < 0:
        raise ShadowInputError(f"{where}: negative token count")
    if r.new_prompt_tokens > r.prompt_tokens:
        raise ShadowInputError(f"{where}: new_prompt_tokens exceeds prompt_tokens")
    if min(r.predicted_tokens, r.predicted_kept, r.predicted_confirmed) < 0:
        raise ShadowInputError(f"{where}: negative predicted count")
    if r.predicted_kept > r.prompt_tokens + r.output_tokens or r.predicted_confirmed > r.predicted_tokens \
            or r.predicted_kept > r.predicted_tokens:
        raise ShadowInputError(f"{where}: predicted counts out of range (need kept <= prompt + output, "
                               "kept <= predicted and confirmed <= predicted)")


# importers ------------------------------------------------------------------------------


MOONCAKE_BLOCK = 512  # tokens per hash id in Mooncake's traces, whatever the shadow's grid


def mooncake_arrivals(path: str | Path, block: int = MOONCAKE_BLOCK) -> list[Arrival]:
    """Mooncake's trace: arrival (ms), input and output lengths, one hash id per `block`-token
    prefix block (512 in the published traces). Sessions are prefix chains: a request continues
    the session whose latest request's blocks it repeats (all but that request's last, partial
    block), beyond the first block that every request shares. What it shares with that session:
    the previous prompt and its output when the prompt is long enough to hold them (a chat
    appends the answer and a new message; the hashes cannot show the answer, whose block holds
    the previous prompt's tail), else the repeated blocks only; new prompt tokens are the rest."""
    path = Path(path)
    rows = []
    for n, line in enumerate(read_text(path, "ledger").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append((float(row["timestamp"]) / 1000, int(row["input_length"]), int(row["output_length"]),
                         [int(h) for h in row["hash_ids"]]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ShadowInputError(f"{path}:{n}: not a Mooncake trace line ({type(e).__name__}: {e})") from None
        if rows[-1][0] < 0 or rows[-1][1] < 0 or rows[-1][2] < 0:
            raise ShadowInputError(f"{path}:{n}: negative time or length")
    if not rows:
        raise ShadowInputError(f"{path} holds no requests")
    latest: dict[tuple[int, ...], str] = {}  # blocks of a session's latest prompt, minus its last -> session
    last: dict[str, tuple[int, int]] = {}  # session -> its latest (prompt, output) tokens
    arrivals = []
    for i, (t, prompt, output, blocks) in enumerate(sorted(rows, key=lambda r: r[0])):
        session, shared = None, 0
        for cut in range(len(blocks), 1, -1):  # the longest earlier prefix, past the common first block
            key = tuple(blocks[:cut])
            if key in latest:
                session, shared = latest.pop(key), cut * block
                before = sum(last[session])
                if prompt >= before:  # the previous prompt and its answer, then the new message
                    shared = max(shared, before)
                break
        session = session or f"m{i}"
        latest[tuple(blocks[:-1]) if len(blocks) > 1 else tuple(blocks)] = session
        last[session] = (prompt, output)
        arrivals.append(Arrival(session, t, prompt, max(0, prompt - min(shared, prompt)), output))
    return arrivals


def import_mooncake(path: str | Path, service: ServiceModel, block: int = MOONCAKE_BLOCK) -> list[Request]:
    """Mooncake's trace (`mooncake_arrivals`) timed by one engine of `service`."""
    return service.serve(mooncake_arrivals(path, block))


def import_trajectory(path: str | Path, service: ServiceModel, tokenizer=None, renderer=None) -> list[Request]:
    """A mini-swe-agent trajectory: one session; each assistant message one request, arriving at
    its response's `created` time (unix s; `rebase` shifts a set of sessions to start at 0). Token
    counts: with a `renderer` (the big model's `ChatRenderer`), the turns rendered as the proxy
    renders them, with each next prompt's start predicted as the proxy predicts it (the
    `predicted_*` fields); else with a tokenizer, the Qwen3.5-style prompts and outputs re-rendered
    in code and re-tokenised; new prompt tokens = the prompt past its shared prefix with the
    previous prompt and output. Without either, the provider's `usage` counts (new prompt tokens =
    the prompt past the previous prompt). First token and end come from `service`'s prefill and
    decode rates, an end clamped to the next request's arrival."""
    from shadow.text.conversations import load_conversation
    from shadow.core.reader import common_prefix
    from shadow.text.rendering import CodeRendering, TemplateRendering

    path = Path(path)
    try:
        doc = json.loads(read_text(path, "trajectory"))
        messages = doc["messages"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ShadowInputError(f"{path}: not a mini-swe-agent trajectory ({type(e).__name__})") from None
    responses = [m.get("extra", {}).get("response", {}) for m in messages if m.get("role") == "assistant"]
    times = [r.get("created") for r in responses]
    if not times or any(not isinstance(t, (int, float)) for t in times):
        raise ShadowInputError(f"{path}: an assistant message has no response 'created' time")
    name = path.name.split(".")[0]
    arrivals = []
    if renderer is not None or tokenizer is not None:
        rendering = TemplateRendering(renderer) if renderer is not None else CodeRendering(tokenizer)
        turns = list(load_conversation(path).requests())
        previous: list[int] = []
        predicted: list[int] | None = None
        for k, (t, (history, output)) in enumerate(zip(times, turns)):
            prompt, out = rendering.prompt(history), rendering.output(history, output)
            if predicted is not None:  # what the previous request's prediction kept of this prompt
                arrivals[-1] = (*arrivals[-1][:-1], common_prefix(predicted, prompt))
            shared = common_prefix(previous, prompt)
            predicted = rendering.next_prompt(history, output) if k + 1 < len(turns) else None
            kept = common_prefix(prompt + out, predicted) if predicted else 0
            arrivals.append((name, float(t), len(prompt), len(prompt) - shared, len(out),
                             len(predicted or ()), kept, 0))
            previous = prompt + out
    else:
        last_prompt = 0
        for t, r in zip(times, responses):
            usage = r.get("usage") or {}
            prompt, output = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
            arrivals.append((name, float(t), prompt, max(0, prompt - last_prompt), output, 0, 0, 0))
            last_prompt = prompt
    arrivals.sort(key=lambda a: a[1])
    out = []
    for i, (session, t, prompt, new, output, *predicted_counts) in enumerate(arrivals):
        start = t
        first = start + new / service.prefill_tok_s
        end = first + output / service.decode_tok_s
        if i + 1 < len(arrivals):  # the agent sent its next request then, so this one had ended
            end = min(end, arrivals[i + 1][1])
            first = min(first, end)
        out.append(Request(session, start, first, end, prompt, new, output, *predicted_counts))
    return out


def rebase(requests: Sequence[Request]) -> list[Request]:
    """The same requests with times counted from the earliest start."""
    origin = min(r.start for r in requests)
    return [replace(r, start=r.start - origin, first_token=r.first_token - origin, end=r.end - origin)
            for r in requests]
