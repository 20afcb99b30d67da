"""What the live service does that the ledger replay runs beside the scheduler: when a turn's ids
reach the shadow (by engine dialect), the resident cap and the store, the voice's share, a label
asked of the engine after a turn, and asks.

`IDS` (when the shadow holds a turn's ids; `shadow serve`'s engine dialects, docs/SERVE.md):

- `embedded`: the prompt at the request's start, the output as it is decoded (the embedded
  generator, one process);
- `engine`: the prompt ids on the engine's first streamed chunk (vLLM's `return_token_ids`), the
  output ids as they stream;
- `tokenizer`: the prompt from the big model's template and tokenizer (the generic dialect,
  `transformers serve`; llama.cpp's `/apply-template` and `/tokenize` alike), known a round trip
  after the start (the cost table's tokenisation) and fed at the first streamed event after that;
  the output ids as they stream (logprob ids);
- `end`: the prompt as `tokenizer`, the output ids only when the response is over (SGLang's
  streamed `sglext` ids; llama.cpp's streamed chat with reasoning);
- `none`: the prompt as `tokenizer`, the output never (`transformers serve` shows no ids: the
  next prompt brings it).

In every mode but `embedded` the proxy feeds the shadow between the engine's events and ends a
turn after its response (`_finish`): once the device is free, the held ids fed, a label asked of
the engine (`label_s`), then the turn's end and a settle of the cap. Embedded turns end once the
device is free too (the read in flight first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shadow.core.residency import StateSize
from shadow.model.config import PRESETS

IDS = ("embedded", "engine", "tokenizer", "end", "none")
LIVE_IDS = "engine"  # the live service's usual case: beside an engine that streams its ids
LIVE_MODEL = "qwen3.5-0.8b"  # the shadow whose sessions' sizes a replay charges by default
LINE_QUIET_S = 1.5  # a streamed turn's first status line after its first token (`LineTiming.quiet_s`)
LINE_EVERY_S = 10.0  # and one each this often while it writes (`LineTiming.progress_every_s`)


@dataclass(frozen=True)
class ReplayLimits:
    """The live service's limits, as the replay runs them; the defaults leave them all out (the
    idealised replay: ids at once, no cap, no voice, no asks). `cap_gib` per shadow (None: no cap)
    with `state` the sessions' sizes; `host_cap_gib`: the host tier below the cap (None or 0: none);
    `disk`: spill rather than drop; `restore_ahead`: a request that comes for a session in the
    host tier or on disk starts bringing it back at once, one restore at a time beside the reads
    (`shadow serve --restore-ahead`), else its prompt's feed restores it on the device;
    `voice_share`: each decoding turn's voice phrases, one at each of its status lines (a tool call
    being written: `LINE_QUIET_S` after its first token, then every `LINE_EVERY_S`) where its
    budget (that share of the time since its first token) holds one and the device is free;
    `label_s`: after each turn, the
    engine asked a standing question's label; `asks_per_hour`: asks per active session (Poisson,
    seeded by `seed`), each reading its session to its end and one forward, its question
    `ask_tokens` ids long; `asks_at`: instead, asks at these (time, session, kind) as a client sent
    them (a live run's), each answer tallied under its kind. `pieces`: the pieces of the shadow's
    forward (`PiecewiseForward`), in which a share batch longer than `batch_s` is read between
    rounds. `prefix_cache_gib`: each
    shadow's prefix cache (`offline.prefixmodel`, needs `state`), every session's first prompt
    sharing its first `shared_prefix_tokens` ids with the others'. `predict` (proxy modes, as
    `shadow serve --predict`): a turn's output is held out of reading and, at its end, the session
    reads on up to what the next prompt keeps of its ids and holds the rest, as the ledger's
    `predicted_*` counts say (requests without them: read as they came), or, `read_ahead`, takes
    the next prompt's start as predicted and reads it; `hold_max`: as live, a status line's phrase that finds more ids unread than
    it may read (2 grids) lets its turn's held output go, to be read as it comes, and the
    prediction then sends it back (None: never)."""

    ids: str = "embedded"
    cap_gib: float | None = None
    state: StateSize | None = None
    disk: bool = False
    host_cap_gib: float | None = None
    restore_ahead: bool = False
    voice_share: float = 0.0
    label_s: float = 0.0
    asks_per_hour: float = 0.0
    asks_at: tuple[tuple[float, str, str], ...] = ()  # (time, session, kind): asks as sent, not Poisson
    ask_tokens: int = 64
    seed: int = 0
    prefix_cache_gib: float | None = None  # the prefix cache's bound per shadow (None or 0: none)
    shared_prefix_tokens: int = 0  # ids every session's first prompt shares (a system prompt and tools)
    predict: bool = True  # proxy modes: each turn's output held, its next prompt predicted where the ledger says
    read_ahead: bool = False  # with predict: the prediction's ids read before the next prompt, not held
    hold_max: int | None = None  # a phrase finding more ids unread lets its turn's held output go (None: never)
    pieces: int = 7  # pieces a shadow's forward runs in, read between rounds (attention layers + 1: the 0.8B's 7)

    def __post_init__(self) -> None:
        if self.ids not in IDS:
            raise ValueError(f"ids is one of {', '.join(IDS)} (got {self.ids!r})")
        if self.cap_gib is not None and (self.state is None or self.cap_gib <= 0):
            raise ValueError("a cap is positive and needs the sessions' state sizes")
        if min(self.voice_share, self.label_s, self.asks_per_hour) < 0 or self.ask_tokens < 1 or self.pieces < 1:
            raise ValueError("voice share, label seconds and asks per hour are not negative")
        if self.asks_at and self.asks_per_hour:
            raise ValueError("asks come at a rate or at given times, not both")
        if any(not (math.isfinite(t) and t >= 0) for t, _, _ in self.asks_at):
            raise ValueError("an ask's time is a finite number of seconds, not negative")
        if (self.prefix_cache_gib or 0) < 0 or self.shared_prefix_tokens < 0:
            raise ValueError("the prefix cache's bound and the shared prefix tokens are not negative")

    @property
    def cap_bytes(self) -> int | None:
        return None if self.cap_gib is None else int(self.cap_gib * 2**30)

    @property
    def host_cap_bytes(self) -> int | None:
        return int(self.host_cap_gib * 2**30) if self.host_cap_gib else None

    @property
    def proxy(self) -> bool:
        return self.ids != "embedded"

    @property
    def prompt_at_first_event(self) -> bool:
        return self.ids != "embedded"

    @property
    def output_streamed(self) -> bool:
        return self.ids in ("embedded", "engine", "tokenizer")




def for_model(model: str = LIVE_MODEL, **limits) -> ReplayLimits:
    """`ReplayLimits(**limits)` for the sessions of the preset `model`: their state sizes (bf16),
    its forward's pieces (attention layers + 1) unless `limits` names them. The live service's
    cap and voice share are `shadow serve`'s settings; the caller passes them."""
    config = PRESETS[model]
    limits.setdefault("pieces", len(config.attention_layers) + 1)
    return ReplayLimits(state=StateSize.of(config, 2), **limits)
