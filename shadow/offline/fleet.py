"""Fleet monotonicity: one more engine should never leave a turn start less fresh. Two replays of
the same requests on n and n + 1 engines are compared turn start by turn start; every turn start
fresh on n engines and stale on n + 1 is an inversion, and each session with one is explained by
what its engine carried in the minute before: more new tokens per second on n + 1 (the route
placed other sessions beside it: affinity places each new session by the requests in flight, so
one more engine reshuffles every later session), or not (then the reads came in another order:
the scheduler's timing)."""

from __future__ import annotations

from collections.abc import Sequence

from shadow.offline.ledger import Request


def _window_tokens(requests: Sequence[Request], engine_of: Sequence[int], engine: int, a: float, b: float) -> float:
    """New tokens (new prompt tokens at their start, output as decoded) on `engine` in [a, b]."""
    tokens = 0.0
    for r, e in zip(requests, engine_of):
        if e != engine or r.end < a or r.start > b:
            continue
        if a <= r.start <= b:
            tokens += r.new_prompt_tokens
        if r.end > r.first_token:
            lo, hi = max(a, r.first_token), min(b, r.end)
            if hi > lo:
                tokens += r.output_tokens * (hi - lo) / (r.end - r.first_token)
    return tokens


def _engine_at(requests: Sequence[Request], engine_of: Sequence[int], session: str, t: float) -> int:
    """The engine of the session's latest request started at or before t."""
    mine = [(r.start, e) for r, e in zip(requests, engine_of) if r.session == session and r.start <= t]
    return max(mine)[1]


def inversions(requests: Sequence[Request], fewer, more, engine_of_fewer: Sequence[int],
               engine_of_more: Sequence[int], show: int = 10, window_s: float = 60.0) -> dict:
    """Compare two replays (`replay.Arm`) of `requests` on n (`fewer`) and n + 1 (`more`) engines.
    Returns the fresh turn starts of each, the inversions, the sessions with one, how many of
    those had a busier engine, and the `show` sessions with the most inversions, each with its
    engines, the new tokens per second its engine carried in the `window_s` before its lost turn
    starts (on n and on n + 1 engines), and why."""
    before = {(t.session, t.start): t for t in fewer.turns}
    lost: dict[str, list] = {}
    for t in more.turns:
        b = before.get((t.session, t.start))
        if b is not None and b.fresh and not t.fresh:
            lost.setdefault(t.session, []).append((b, t))
    rows = []
    for session, pairs in sorted(lost.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        loads, engines = [0.0, 0.0], [set(), set()]
        for b, _ in pairs:
            for k, eo in enumerate((engine_of_fewer, engine_of_more)):
                e = _engine_at(requests, eo, session, b.start)
                engines[k].add(e)
                loads[k] += _window_tokens(requests, eo, e, b.start - window_s, b.start) / window_s / len(pairs)
        busier = loads[1] > loads[0] * 1.0001
        why = (f"its engine carried more in the {window_s:g} s before ({loads[0]:,.0f} -> {loads[1]:,.0f} new tok/s): "
               "the route placed other sessions beside it" if busier else
               f"its engine carried no more in the {window_s:g} s before ({loads[0]:,.0f} -> {loads[1]:,.0f} new tok/s): "
               "the reads came in another order (its neighbours' turns, so the engine's idle windows and decode "
               "stretches, fell at other times)")
        rows.append({"session": session, "turns": len(pairs), "engines": [sorted(engines[0]), sorted(engines[1])],
                     "new_tok_s": [round(loads[0], 1), round(loads[1], 1)], "busier": busier,
                     "worst_behind": max(t.behind for _, t in pairs), "why": why})
    return {
        "engines": [fewer.engines, more.engines], "fresh": [fewer.fresh, more.fresh],
        "turn_starts": len(more.turns), "inversions": sum(r["turns"] for r in rows), "sessions": len(rows),
        "sessions_busier": sum(r["busier"] for r in rows),
        "inversions_busier": sum(r["turns"] for r in rows if r["busier"]), "rows": rows[:show],
    }
