"""Fleet monotonicity: one more engine should never leave a turn start less fresh. Two replays of
the same requests on n and n + 1 engines are compared turn start by turn start; every turn start
fresh on n engines and stale on n + 1 is an inversion, and each session with one is explained by
what happened to it on n + 1: dropped past its shadow's cap and not yet read back (other sessions
beside it were fed more recently; on n it was not dropped, or read back by then), or (idle only) its engine idle for less of
the time since, or its engine carrying more new tokens per second in the minute before (the route
placed other sessions beside it: affinity places each new session by the requests in flight, so
one more engine reshuffles every later session); else the reads came in another order (the
scheduler's timing)."""

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


def _recovering(arm, session: str, t: float) -> bool:
    """Whether `session` was dropped past its shadow's cap (its state gone) before t and had not
    been fresh at a turn start since: it is still being read again from the start."""
    drops = [when for when, s, kept in arm.left if s == session and when <= t and not kept]
    if not drops:
        return False
    fresh = [x.start for x in arm.turns if x.session == session and x.fresh and x.start < t]
    return max(drops) > max(fresh, default=-1.0)


def _previous_starts(requests: Sequence[Request]) -> dict[tuple[str, float], float]:
    """(session, a request's start) -> the start of the session's request before it."""
    out, last = {}, {}
    for r in sorted(requests, key=lambda r: r.start):
        if r.session in last:
            out[(r.session, r.start)] = last[r.session]
        last[r.session] = r.start
    return out


def _idle_s(requests: Sequence[Request], engine_of: Sequence[int], engine: int, a: float, b: float) -> float:
    """Seconds of [a, b] with no request in flight on `engine`."""
    spans = sorted((max(a, r.start), min(b, r.end)) for r, e in zip(requests, engine_of)
                   if e == engine and r.end > a and r.start < b)
    idle, at = 0.0, a
    for lo, hi in spans:
        if lo > at:
            idle += lo - at
        at = max(at, hi)
    return idle + max(0.0, b - at)


def _engine_at(requests: Sequence[Request], engine_of: Sequence[int], session: str, t: float) -> int:
    """The engine of the session's latest request started at or before t."""
    mine = [(r.start, e) for r, e in zip(requests, engine_of) if r.session == session and r.start <= t]
    return max(mine)[1]


def inversions(requests: Sequence[Request], fewer, more, engine_of_fewer: Sequence[int],
               engine_of_more: Sequence[int], *, show: int | None = None, window_s: float = 60.0) -> dict:
    """Compare two replays (`replay.Arm`) of `requests` on n (`fewer`) and n + 1 (`more`) engines.
    Returns the fresh turn starts of each, the inversions, the sessions with one, their causes
    (sessions and turn starts of each: dropped, less idle, busier, order), and the sessions with
    the most inversions first (the first `show`; None: all), each with its engines, the new tokens
    per second its engine carried in the `window_s` before its lost turn starts and its idle
    seconds since its previous turn (on n and on n + 1 engines), its cause and why."""
    before = {(t.session, t.start): t for t in fewer.turns}
    lost: dict[str, list] = {}
    for t in more.turns:
        b = before.get((t.session, t.start))
        if b is not None and b.fresh and not t.fresh:
            lost.setdefault(t.session, []).append((b, t))
    previous = _previous_starts(requests)
    rows = []
    for session, pairs in sorted(lost.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        loads, idle, engines, dropped = [0.0, 0.0], [0.0, 0.0], [set(), set()], [0, 0]
        for b, _ in pairs:
            since = previous.get((session, b.start), b.start - window_s)
            for k, (eo, arm) in enumerate(((engine_of_fewer, fewer), (engine_of_more, more))):
                e = _engine_at(requests, eo, session, b.start)
                engines[k].add(e)
                loads[k] += _window_tokens(requests, eo, e, b.start - window_s, b.start) / window_s / len(pairs)
                idle[k] += _idle_s(requests, eo, e, since, b.start)
                dropped[k] += _recovering(arm, session, b.start)
        cause = "order"
        if dropped[1] > 0:
            also = (f" (at {dropped[0]} on {fewer.engines} too, and read back by then)" if dropped[0]
                    else f" (not on {fewer.engines})")
            cause, busier, why = "dropped", False, (f"dropped past its shadow's cap and not yet read back at {dropped[1]} of "
                                  f"these turn starts on {more.engines} engines{also}: other sessions beside it were fed "
                                  "more recently, and it is read again from the start")
        elif not fewer.share and idle[1] < idle[0] - 1e-9:
            cause, busier, why = "less idle", False, (f"its engine was idle less between its turns ({idle[0]:,.1f} -> {idle[1]:,.1f} s in all): "
                                  "the route put another session's requests in those gaps")
        else:
            busier = loads[1] > loads[0] * 1.0001
            cause = "busier" if busier else "order"
            why = (f"its engine carried more in the {window_s:g} s before ({loads[0]:,.0f} -> {loads[1]:,.0f} new "
                   "tok/s): the route placed other sessions beside it" if busier else
                   f"its engine carried no more in the {window_s:g} s before ({loads[0]:,.0f} -> {loads[1]:,.0f} new "
                   f"tok/s), and it was at most {max(t.behind for _, t in pairs):,} ids behind: the reads came in "
                   "another order (its neighbours' turns, so the engine's idle windows and decode stretches, fell at "
                   "other times)")
        rows.append({"session": session, "turns": len(pairs), "cause": cause,
                     "engines": [sorted(engines[0]), sorted(engines[1])],
                     "new_tok_s": [round(loads[0], 1), round(loads[1], 1)], "busier": busier,
                     "dropped": dropped, "idle_s": [round(idle[0], 3), round(idle[1], 3)],
                     "worst_behind": max(t.behind for _, t in pairs), "why": why})
    causes = {c: {"sessions": sum(r["cause"] == c for r in rows), "turns": sum(r["turns"] for r in rows if r["cause"] == c)}
              for c in ("dropped", "less idle", "busier", "order")}
    return {
        "engines": [fewer.engines, more.engines], "fresh": [fewer.fresh, more.fresh],
        "turn_starts": len(more.turns), "inversions": sum(r["turns"] for r in rows), "sessions": len(rows),
        "sessions_busier": causes["busier"]["sessions"], "sessions_dropped": causes["dropped"]["sessions"],
        "causes": causes, "rows": rows if show is None else rows[:show],
    }
