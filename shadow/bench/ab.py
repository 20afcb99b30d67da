"""Decode-cost A/B against a running server: the shadow off and on, arms alternating, a new
session each run (so the shadow reads the whole prompt every time), paired run by run.

Decode tok/s comes from streamed token arrival times, the first token excluded; TTFT is from the
request's send to its first token. The shadow is switched through `POST /v1/shadow/switch`.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
import uuid
from dataclasses import dataclass

import httpx

from shadow.sample import sample_conversation
from shadow.tokenizer import Tokenizer


@dataclass(frozen=True)
class Run:
    arm: str  # "off" or "on"
    pair: int
    ttft_s: float
    decode_tok_s: float
    tokens: int
    share_s: float | None = None  # the server's reading charged to shares during the run (None: not reported)

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


def stream_once(client: httpx.Client, base: str, text: str, max_tokens: int, session: str, arm: str, pair: int) -> Run:
    # token ids asked for (vLLM's return_token_ids; the project's serve too), so every token counts,
    # also one whose text waits for the rest of a character; without ids, non-empty deltas count
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "min_tokens": max_tokens, "return_token_ids": True}
    times, count = [], 0
    start = time.perf_counter()
    with client.stream("POST", base + "/chat/completions", json=body, headers={"x-session-id": session}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = (json.loads(line[6:]).get("choices") or [{}])[0]
            n = len(choice.get("token_ids") or []) or (1 if (choice.get("delta") or {}).get("content") else 0)
            if n:
                times.append(time.perf_counter())
                count += n
    if count < 2:
        raise RuntimeError("fewer than two tokens streamed: no decode rate")
    return Run(arm, pair, times[0] - start, (count - 1) / (times[-1] - times[0]), count)


def share_seconds(client: httpx.Client, base: str) -> float | None:
    """The server's `share_s` counter (seconds read inside turns' shares), if it reports one."""
    r = client.get(base + "/shadow/status")
    r.raise_for_status()
    return r.json().get("counters", {}).get("share_s")


def switch(client: httpx.Client, base: str, on: bool) -> None:
    r = client.post(base + "/shadow/switch", json={"on": on})
    r.raise_for_status()


def run_ab(base: str, tokenizer: Tokenizer, prompt_tokens: int, output_tokens: int, runs: int, pause_s: float,
           progress=None) -> list[Run]:
    """`runs` pairs; within a pair the arms alternate (off first in even pairs, on first in odd ones).
    `progress(done, total, run)` is called after each run."""
    out = []
    with httpx.Client(timeout=httpx.Timeout(900.0)) as client:
        for pair in range(runs):
            for arm in (("off", "on") if pair % 2 == 0 else ("on", "off")):
                switch(client, base, arm == "on")
                tag = uuid.uuid4().hex[:12]
                before = share_seconds(client, base)
                run = stream_once(client, base, prompt_text(tokenizer, prompt_tokens, tag), output_tokens,
                                  f"ab-{tag}", arm, pair)
                after = share_seconds(client, base)
                share = None if before is None or after is None else after - before
                out.append(dataclasses.replace(run, share_s=share))
                if progress:
                    progress(len(out), 2 * runs, out[-1])
                time.sleep(pause_s)
        switch(client, base, True)
    return out


def summarize(runs: list[Run], gate_pct: float) -> dict:
    """Medians per arm, the change in decode rate (on vs off, %), paired deltas, the verdict, and
    `share_pct`: the median over "on" runs of the reading the server charged to shares, as a % of
    the run's decode time (None when the server does not report it); a slowdown beyond it is
    cost the share does not account for."""
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
    return {"runs": len(pairs), "decode_tok_s": decode, "ttft_s": ttft, "delta_pct": delta,
            "paired_deltas_pct": paired, "share_pct": statistics.median(charged) if charged else None,
            "gate_pct": gate_pct, "passed": -delta <= gate_pct}
