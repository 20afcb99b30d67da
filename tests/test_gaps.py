"""The streams' long gaps: kept with when they ended and what ran inside them, on the embedded
engine's device thread (`round`) and in the HTTP stream's writes (`write`), in status."""

from __future__ import annotations

import time

import httpx

from serving import running
from shadow.server.gaps import LongGaps, RoundClock


def test_only_long_gaps_are_kept_with_their_parts_in_ms():
    gaps = LongGaps(long_ms=10, keep=2)
    gaps.add("round", 0.004, {"engine": 0.003})  # short: neither counted nor kept
    for seconds in (0.011, 0.020, 0.030):
        gaps.add("round", seconds, {"engine": seconds / 2})
    gaps.add("write", 0.012)
    shown = gaps.status()
    assert shown["long_ms"] == 10 and shown["round"]["count"] == 3 and shown["write"]["count"] == 1
    assert [g["ms"] for g in shown["round"]["last"]] == [20.0, 30.0]  # the last `keep`
    assert [g["engine_ms"] for g in shown["round"]["last"]] == [10.0, 15.0]
    assert shown["write"]["last"][0]["ms"] == 12.0 and abs(shown["write"]["last"][0]["at"] - time.time()) < 5


def test_a_round_gap_is_taken_apart_into_the_engines_step_the_shadows_work_and_the_time_away():
    collected = [0.0]
    gaps = LongGaps(long_ms=10)
    clock = RoundClock(gaps, lambda: collected[0])
    clock.token(0.001)  # the first token: no gap before it
    clock.after(0.004, read_s=0.003, phrase_s=0.0)
    clock.away()
    time.sleep(0.015)
    clock.back()
    collected[0] = 0.002
    clock.token(0.0005)
    (gap,) = gaps.status()["round"]["last"]
    assert gap["ms"] >= 15 and gap["away_ms"] >= 15 and gap["away_ms"] <= gap["ms"]
    assert gap["engine_ms"] == 0.5 and gap["shadow_ms"] == 4.0 and gap["read_ms"] == 3.0
    assert gap["phrase_ms"] == 0.0 and gap["gc_ms"] == 2.0
    clock.token(0.0)  # straight after: short, and the parts of the gap before do not carry over
    assert gaps.counts["round"] == 1


def stream(client: httpx.Client, tokens: int) -> int:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": tokens, "stream": True,
            "ignore_eos": True, "min_tokens": tokens, "return_token_ids": True}
    got = 0
    with client.stream("POST", "/v1/chat/completions", json=body, headers={"x-session-id": "gaps"}) as r:
        assert r.status_code == 200
        got = sum(1 for line in r.iter_lines() if '"token_ids": [' in line and '"token_ids": []' not in line)
    return got


def test_the_embedded_engine_shows_each_gap_between_its_tokens_on_the_device_thread_and_in_the_writes(tiny):
    """Every gap kept (threshold 0): one a token after the first on the device thread, each split
    into parts that fit inside it; the writes' gaps in the same window."""
    with running() as (client, service):
        service.counters.gaps = LongGaps(long_ms=0)
        begun = time.time()
        assert stream(client, 6) >= 2
        shown = client.get("/v1/shadow/status").json()["gaps"]
    rounds = shown["round"]["last"]
    assert shown["round"]["count"] == len(rounds) == 5  # 6 tokens: 5 gaps between them
    for gap in rounds:
        assert begun <= gap["at"] <= time.time()
        assert set(gap) == {"at", "ms", "engine_ms", "shadow_ms", "read_ms", "phrase_ms", "gc_ms", "away_ms"}
        assert gap["engine_ms"] > 0 and gap["engine_ms"] + gap["shadow_ms"] + gap["away_ms"] <= gap["ms"] + 0.01
        assert gap["read_ms"] + gap["phrase_ms"] <= gap["shadow_ms"] + 0.01
    writes = shown["write"]["last"]
    assert 1 <= len(writes) <= 5 and all(begun <= g["at"] <= time.time() and g["ms"] >= 0 for g in writes)


def test_the_proxy_shows_its_writes_gaps_with_what_it_held_and_its_last_feed(tiny):
    with running() as (engine, _), running(upstream=str(engine.base_url).rstrip("/") + "/v1") as (proxy, service):
        service.counters.gaps = LongGaps(long_ms=0)
        assert stream(proxy, 6) >= 2
        shown = proxy.get("/v1/shadow/status").json()["gaps"]
    assert shown["round"]["count"] == 0  # no engine of its own
    writes = shown["write"]["last"]
    assert writes and all(set(g) == {"at", "ms", "held_ms", "feed_ms"} for g in writes)
    assert all(0 <= g["held_ms"] <= g["ms"] + 0.01 and g["feed_ms"] >= 0 for g in writes)
