"""Decode-cost A/B against a running server: the shadow off and on, arms alternating, a new
session each run (so the shadow reads the whole prompt every time), paired run by run.

Decode tok/s comes from streamed token arrival times, the first token excluded; TTFT is from the
request's send to its first token; inter-token latency (ITL) is the gap between two streamed
token deltas' arrivals (p50, p99, the longest), what a user watching the stream sees stall. The shadow is switched through `POST /v1/shadow/switch`
(`{"on": bool, "voice": bool}`), and switched back to where it was when the A/B ends, however it
ends (an error, Ctrl-C).

With `voice`, the arms are "shadow, status lines and voice off" against "all on": the "on" runs
also send Open WebUI's chat-id header (`x-openwebui-chat-id`), for which a server with the default
`--status-channel auto` writes status lines (status events before the first token, then lines in
the reasoning) and the voice's phrases after them; the "off" runs send no such header, so they get
no lines. Each run counts the lines it saw (`lines`); lines are never counted as tokens.

Each request asks for a fixed length and the ids (`ignore_eos`, `min_tokens`, `return_token_ids`:
vLLM's fields, which the embedded engine takes too). An engine known not to take them (the server's
status names its dialect: transformers, openai) is sent none; any other that refuses them with a
4xx naming a field gets the request again without the fields named, and the rest of the A/B goes
without them. Without `ignore_eos`/`min_tokens` each run's length is the model's own (at most
`max_tokens`), so runs may differ in length; without `return_token_ids` tokens are counted as the
streamed deltas with text. The summary says which were dropped and what that does (`fields`).

A verdict rests on at least `MIN_PAIRS` pairs whose paired deltas spread (half their range) no wider
than the gate; otherwise it is "not significant".
"""

from __future__ import annotations

import dataclasses
import json
import signal
import statistics
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from shadow.errors import ShadowInputError
from shadow.text.sample import sample_conversation
from shadow.text.framing import MARK
from shadow.text.tokenizer import Tokenizer

STATUS_HEADER = "x-openwebui-chat-id"  # the client kind that gets status lines under `--status-channel auto`
FIELDS = ("ignore_eos", "min_tokens", "return_token_ids")  # asked of the engine; vLLM's names
NOT_TAKEN = {"transformers": FIELDS, "openai": FIELDS}  # dialects that refuse (or do not know) them all
EFFECTS = {
    "ignore_eos": "the model may end a run early: runs may differ in length",
    "min_tokens": "no run is held to max_tokens: runs may differ in length",
    "return_token_ids": "tokens are counted as streamed deltas with text, not ids",
}
MIN_PAIRS = 5  # fewer pairs: the verdict is not significant


class Refused(ShadowInputError):
    """The server answered a 4xx: `status` and the `message` it gave."""

    def __init__(self, status: int, message: str):
        super().__init__(f"the server refused the request ({status}): {message}")
        self.status, self.message = status, message


def fields_for(engine: dict | None) -> tuple[str, ...]:
    """The fields to ask for first, given the server's status `engine` (None: the embedded engine,
    which takes them all; a dialect not probed yet: all, dropped later if refused)."""
    dialect = (engine or {}).get("dialect")
    return tuple(f for f in FIELDS if f not in NOT_TAKEN.get(dialect, ()))


def fields_named(error: Refused, fields: tuple[str, ...]) -> tuple[str, ...]:
    """The fields among `fields` that a refusal's message names (none: the refusal is about something else)."""
    return tuple(f for f in fields if f in error.message)


@dataclass(frozen=True)
class Run:
    arm: str  # "off" or "on"
    pair: int
    ttft_s: float
    decode_tok_s: float
    tokens: int
    fields: tuple = FIELDS  # the fields of FIELDS this run's request carried
    share_s: float | None = None  # the server's reading charged to shares during the run (None: not reported)
    lines: int = 0  # status lines streamed to the client (status events and framed lines)
    voice: bool | None = None  # the voice as the server's switch said it was for this run
    itl_p50_ms: float = 0.0  # gaps between streamed tokens' arrivals
    itl_p99_ms: float = 0.0
    itl_max_ms: float = 0.0
    itl_max_at_s: float = 0.0  # when the longest gap ended, seconds after the first token
    itl_max_at: float = 0.0  # the same, seconds since the epoch (to set beside the server's own times)
    gaps_over_10ms: int = 0
    line_at_s: float | None = None  # when the first status line came, seconds after the first token (< 0: before it)
    voice_s: float | None = None  # the server's voice phrases charged during the run
    # the server's own long gaps that ended during the run (status `gaps`: each with its place,
    # "round" or "write", when it ended, its ms and what ran in it); empty where it reports none
    server_gaps: tuple = ()

    @property
    def decode_s(self) -> float:
        """From the first streamed token to the last."""
        return (self.tokens - 1) / self.decode_tok_s


def prompt_text(tokenizer: Tokenizer, tokens: int, tag: str) -> str:
    """About `tokens` tokens of agent-like text (the seeded sample session), tagged to defeat prefix caches."""
    text = "\n".join(m.content for m in sample_conversation(seed=7, turns=max(4, tokens // 700)).messages)
    ids = tokenizer.encode(text)
    while len(ids) < tokens:
        ids = ids + ids
    return f"[{tag}]\n" + tokenizer.decode(ids[:tokens])


def stream_once(client: httpx.Client, base: str, text: str, max_tokens: int, session: str, arm: str, *, pair: int,
                status_lines: bool = False, fields: tuple[str, ...] = FIELDS) -> Run:
    """One streamed chat request; `status_lines`: send the header that asks for status lines;
    `fields`: those of FIELDS to send. A 4xx answer is the caller's input refused (`Refused`);
    anything else is a RuntimeError."""
    # token ids asked for (vLLM's return_token_ids; the project's serve too), so every token counts,
    # also one whose text waits for the rest of a character; without ids, deltas with text count
    wanted = {"ignore_eos": True, "min_tokens": max_tokens, "return_token_ids": True}
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stream": True} \
        | {f: wanted[f] for f in fields}
    headers = {"x-session-id": session} | ({STATUS_HEADER: session} if status_lines else {})
    times, count, lines, line_at = [], 0, 0, None
    start, wall = time.perf_counter(), time.time()
    with client.stream("POST", base + "/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise _refusal(r.status_code, r.read())
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            choice = (event.get("choices") or [{}])[0]
            delta = choice.get("delta") or {}
            # an Open WebUI status event, or a framed status line: not a token
            if "event" in event or MARK in (delta.get("reasoning_content") or "") + (delta.get("content") or ""):
                lines += 1
                line_at = line_at if line_at is not None else time.perf_counter()
                continue
            n = len(choice.get("token_ids") or []) or (1 if delta.get("content") or delta.get("reasoning_content") else 0)
            if n:
                times.append(time.perf_counter())
                count += n
    if count < 2:
        raise RuntimeError("fewer than two tokens streamed: no decode rate")
    steps = [b - a for a, b in zip(times, times[1:])] or [0.0]
    gaps = sorted(steps)
    p = lambda q: 1000 * gaps[min(len(gaps) - 1, int(q * len(gaps)))]  # noqa: E731
    longest = max(range(len(steps)), key=steps.__getitem__)
    return Run(arm, pair, times[0] - start, (count - 1) / (times[-1] - times[0]), count, fields=tuple(fields), lines=lines,
               itl_p50_ms=p(0.5), itl_p99_ms=p(0.99), itl_max_ms=1000 * gaps[-1],
               itl_max_at_s=times[min(longest + 1, len(times) - 1)] - times[0],
               itl_max_at=wall + times[min(longest + 1, len(times) - 1)] - start,
               gaps_over_10ms=sum(g > 0.010 for g in steps),
               line_at_s=None if line_at is None else line_at - times[0])


def _refusal(status: int, body: bytes) -> Exception:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:300].decode("utf-8", "replace")
    if 400 <= status < 500:
        return Refused(status, str(message))
    return RuntimeError(f"the server failed ({status}): {message}")


def server_counts(client: httpx.Client, base: str) -> tuple[float | None, float | None, list[dict]]:
    """The server's `share_s` and `voice_s` counters (seconds the reads inside turns' shares charged, seconds of
    voice phrases), where it reports them, and the long gaps it kept (each with its place)."""
    r = client.get(base + "/shadow/status")
    if r.status_code != 200:
        raise _refusal(r.status_code, r.content)
    status = r.json()
    counters = status.get("counters", {})
    gaps = status.get("gaps") if isinstance(status.get("gaps"), dict) else {}
    kept = [{"place": place, **gap} for place in ("round", "write") for gap in (gaps.get(place) or {}).get("last", ())
            if isinstance(gap, dict) and isinstance(gap.get("at"), (int, float))]
    return counters.get("share_s"), counters.get("voice_s"), kept


def switch(client: httpx.Client, base: str, on: bool, voice: bool | None = None) -> dict:
    """Turn the shadow (and, given, the voice; else it follows the shadow) on or off; the server's
    answer, `{"on", "voice"}`."""
    r = client.post(base + "/shadow/switch", json={"on": on} | ({} if voice is None else {"voice": voice}),
                    timeout=30.0)
    if r.status_code != 200:
        raise _refusal(r.status_code, r.content)
    return r.json()


def run_ab(base: str, tokenizer: Tokenizer, prompt_tokens: int, output_tokens: int, runs: int, pause_s: float,
           *, progress=None, voice: bool = False, restore: tuple[bool, bool | None] = (True, None),
           api_key: str | None = None, fields: tuple[str, ...] = FIELDS) -> list[Run]:
    """`runs` pairs; within a pair the arms alternate (off first in even pairs, on first in odd ones).
    "off": shadow and voice off; "on": the shadow on, and with `voice` the voice and status lines on
    too. `progress(done, total, run)` is called after each run. Whatever happens, the switch is
    set back to `restore` (on, voice) at the end, a second Ctrl-C during that held back. `api_key`:
    sent as `Authorization: Bearer KEY` (a server with keys wants it; its admin key for the switch).
    `fields`: those of FIELDS asked for first; a 4xx that names some of them sends the run again
    without those, and every later run goes without them (each run's `fields` says what it sent)."""
    out = []
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=httpx.Timeout(900.0), headers=headers) as client:
        try:
            for pair in range(runs):
                for arm in (("off", "on") if pair % 2 == 0 else ("on", "off")):
                    on = arm == "on"
                    state = switch(client, base, on, voice=on and voice)
                    tag = uuid.uuid4().hex[:12]
                    before = server_counts(client, base)
                    begun = time.time()
                    text = prompt_text(tokenizer, prompt_tokens, tag)
                    while True:
                        try:
                            run = stream_once(client, base, text, output_tokens, f"ab-{tag}", arm, pair=pair,
                                              status_lines=on and voice, fields=fields)
                            break
                        except Refused as e:
                            named = fields_named(e, fields)
                            if not named:
                                raise
                            fields = tuple(f for f in fields if f not in named)
                    ended = time.time()
                    after = server_counts(client, base)
                    share, spoken = (None if a is None or b is None else b - a for a, b in zip(before[:2], after[:2]))
                    gaps = tuple(g for g in after[2] if begun <= g["at"] <= ended)
                    out.append(dataclasses.replace(run, share_s=share, voice_s=spoken, voice=state.get("voice"),
                                                   server_gaps=gaps))
                    if progress:
                        progress(len(out), 2 * runs, out[-1])
                    time.sleep(pause_s)
        finally:
            with interrupts_held():
                switch(client, base, *restore)
    return out


@contextmanager
def interrupts_held():
    """Ctrl-C inside the block waits until the block is done, then raises KeyboardInterrupt (in the
    main thread; elsewhere signals do not arrive, and this does nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def summarize(runs: list[Run], gate_pct: float) -> dict:
    """Medians per arm, the change in decode rate (on vs off, %), paired deltas and their median, the verdict, and
    `share_pct`: the median over "on" runs of the reading the server charged to shares, as a % of
    the run's decode time (None when the server does not report it); a slowdown beyond it is
    cost the share does not account for; `voice_pct` the same for the voice's phrases; `itl`: per arm
    the medians of the runs' inter-token p50 and p99 (ms), the longest gap of any run and the gaps
    over 10 ms in all; `server_gaps`: per arm the server's own long gaps in the runs by place
    (`round`: on the engine's device thread, `write`: in the stream's writes);
    `status_lines`: the lines each arm's runs saw. `passed`: the slowdown is within the gate;
    `significant`: at least MIN_PAIRS pairs spread (`spread_pct`: half the paired deltas' range)
    no wider than the gate, else `not_significant_because` says why; `verdict`: "passed", "failed"
    or "not significant"; `fields`: those of FIELDS sent in every run, those dropped, and what
    dropping each does to the measurement."""
    arms = {a: [r for r in runs if r.arm == a] for a in ("off", "on")}
    decode = {a: statistics.median(r.decode_tok_s for r in rs) for a, rs in arms.items()}
    ttft = {a: statistics.median(r.ttft_s for r in rs) for a, rs in arms.items()}
    pairs = sorted({r.pair for r in runs})
    paired = []
    for p in pairs:
        off = next(r for r in arms["off"] if r.pair == p)
        on = next(r for r in arms["on"] if r.pair == p)
        paired.append(100 * (on.decode_tok_s - off.decode_tok_s) / off.decode_tok_s)
    delta = 100 * (decode["on"] - decode["off"]) / decode["off"]
    charged = [100 * r.share_s / r.decode_s for r in arms["on"] if r.share_s is not None]
    spoken = [100 * r.voice_s / r.decode_s for r in arms["on"] if r.voice_s is not None]
    itl = {a: {"p50_ms": statistics.median(r.itl_p50_ms for r in rs), "p99_ms": statistics.median(r.itl_p99_ms for r in rs),
               "max_ms": max(r.itl_max_ms for r in rs), "gaps_over_10ms": sum(r.gaps_over_10ms for r in rs)}
           for a, rs in arms.items()}
    server_gaps = {a: {place: sum(g["place"] == place for r in rs for g in r.server_gaps) for place in ("round", "write")}
                   for a, rs in arms.items()}
    spread = (max(paired) - min(paired)) / 2 if paired else None
    why_not = ([f"{len(pairs)} pairs, fewer than {MIN_PAIRS}"] if len(pairs) < MIN_PAIRS else []) \
        + ([f"the pairs spread \u00b1{spread:.1f} %, wider than the gate's {gate_pct:g} %"]
           if spread is not None and spread > gate_pct else [])
    passed = -delta <= gate_pct
    dropped = [f for f in FIELDS if any(f not in r.fields for r in runs)]
    return {"runs": len(pairs), "decode_tok_s": decode, "ttft_s": ttft, "delta_pct": delta,
            "paired_deltas_pct": paired,
            "paired_median_pct": statistics.median(paired) if paired else None, "share_pct": statistics.median(charged) if charged else None,
            "voice_pct": statistics.median(spoken) if spoken else None, "itl": itl, "server_gaps": server_gaps,
            "status_lines": {a: sum(r.lines for r in rs) for a, rs in arms.items()},
            "gate_pct": gate_pct, "passed": passed, "min_pairs": MIN_PAIRS, "spread_pct": spread,
            "significant": not why_not, "not_significant_because": why_not,
            "verdict": "not significant" if why_not else ("passed" if passed else "failed"),
            "fields": {"sent": [f for f in FIELDS if f not in dropped], "dropped": dropped,
                       "effects": {f: EFFECTS[f] for f in dropped}}}
