"""Fleet monotonicity: one more engine should never leave a turn start less fresh. Two replays of
the same requests on n and n + 1 engines are compared turn start by turn start; every turn start
fresh on n engines and stale on n + 1 is an inversion, and each session with one is explained by
what its engine carried: moved (by the route) to an engine that carried more new tokens per
second over the session's time than its engine on n did, or not (then the order reads came in
changed: the scheduler's timing)."""

from __future__ import annotations

from collections.abc import Sequence

from shadow.offline.ledger import Request


def _load(requests: Sequence[Request], engine_of: Sequence[int], session: str) -> tuple[int, float]:
    """(the engine of `session`'s first request, the new tokens per second all requests on that
    engine brought over the session's time from its first start to its last end)."""
    mine = [(r, e) for r, e in zip(requests, engine_of) if r.session == session]
    a, b = min(r.start for r, _ in mine), max(r.end for r, _ in mine)
    engine = min(mine, key=lambda x: x[0].start)[1]
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
    return engine, tokens / max(b - a, 1e-9)


def inversions(requests: Sequence[Request], fewer, more, engine_of_fewer: Sequence[int],
               engine_of_more: Sequence[int], show: int = 10) -> dict:
    """Compare two replays (`replay.Arm`) of `requests` on n (`fewer`) and n + 1 (`more`) engines.
    Returns the fresh turn starts of each, the inversions, the sessions with one, how many of
    those moved to a busier engine, and the `show` sessions with the most inversions, each with
    its engines, their loads and why."""
    before = {(t.session, t.start): t for t in fewer.turns}
    lost: dict[str, list] = {}
    for t in more.turns:
        b = before.get((t.session, t.start))
        if b is not None and b.fresh and not t.fresh:
            lost.setdefault(t.session, []).append((b, t))
    rows = []
    for session, pairs in sorted(lost.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        e0, load0 = _load(requests, engine_of_fewer, session)
        e1, load1 = _load(requests, engine_of_more, session)
        busier = load1 > load0 * 1.0001
        why = (f"moved to a busier engine ({load0:,.0f} -> {load1:,.0f} new tok/s over its time)" if busier
               else f"its engine no busier ({load0:,.0f} -> {load1:,.0f} new tok/s): the order reads came in changed")
        rows.append({"session": session, "turns": len(pairs), "engines": [e0, e1],
                     "new_tok_s": [round(load0, 1), round(load1, 1)], "busier": busier,
                     "worst_behind": max(t.behind for _, t in pairs), "why": why})
    return {
        "engines": [fewer.engines, more.engines], "fresh": [fewer.fresh, more.fresh],
        "turn_starts": len(more.turns), "inversions": sum(r["turns"] for r in rows), "sessions": len(rows),
        "sessions_moved_busier": sum(r["busier"] for r in rows),
        "inversions_moved_busier": sum(r["turns"] for r in rows if r["busier"]), "rows": rows[:show],
    }
