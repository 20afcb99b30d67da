"""The ledger replay: hand-computed cases, monotonic properties, importers and bad input."""

from __future__ import annotations

import json
import random
import re

import pytest
from conftest import shared_file

from shadow.errors import ShadowInputError
from shadow.ledger import Request, ServiceModel, import_mooncake, import_trajectory, read_ledger, write_ledger
from shadow.replay import replay
from shadow.schedule import BandwidthRule

MS_100 = 100.0  # ms per 1,000 tokens: a 512-token chunk costs 51.2 ms


def two_turns(second_start: float, shared: int | None = None) -> list[Request]:
    first = Request("s", 0.0, 0.51, 1.01, 1024, 1024, 100)  # ends just past the 1.0 s poll
    prompt = 1124 + 200
    new = prompt - (1124 if shared is None else shared)
    return [first, Request("s", second_start, second_start + 0.1, second_start + 1.0, prompt, new, 50)]


def test_idle_window_reads_the_whole_chunks_before_the_next_turn():
    arm = replay(two_turns(10.0), MS_100, use_share=False)
    assert [(t.behind, t.fresh) for t in arm.turns] == [(100, True)]  # 1,124 known, 1,024 read
    assert arm.chunks_idle == 2 and arm.chunks_share == 0


def test_a_short_gap_leaves_no_idle_window():
    """The first request ends at 1.01 s; the next comes at 1.05 s, before the idle window's first
    poll (1.2 s)."""
    arm = replay(two_turns(1.05), MS_100, use_share=False)
    assert [(t.behind, t.fresh) for t in arm.turns] == [(1124, False)]


def test_share_budget_counts_from_the_first_token():
    """20 % of the 0.5 s decode earns 0.1 s: one chunk (51.2 ms) at 0.766 s; the second would
    be due at 1.022 s, after the decode ended at 1.01 s."""
    arm = replay(two_turns(1.05), MS_100, rule=BandwidthRule(share=0.2))
    assert [t.behind for t in arm.turns] == [1124 - 512] and arm.chunks_share == 1
    at_2pct = replay(two_turns(1.05), MS_100, rule=BandwidthRule(share=0.02))
    assert [t.behind for t in at_2pct.turns] == [1124]  # one chunk needs 2.56 s of decode


def test_idle_bursts_stop_after_two_seconds_and_resume_at_the_next_poll():
    """At 0.5 s a chunk, bursts from 1.0 s hold chunks at 1.0, 1.5, 2.0, 2.5; the next starts at 3.0."""
    reqs = [Request("s", 0.0, 0.5, 1.0, 8192, 8192, 0), Request("s", 3.2, 3.3, 4.0, 8292, 100, 10)]
    arm = replay(reqs, 0.5e6 / 512, use_share=False)
    assert arm.turns[0].behind == 8192 - 5 * 512  # chunks at 1.0, 1.5, 2.0, 2.5 and 3.0


def test_a_prompt_sharing_less_than_was_read_rolls_back():
    arm = replay(two_turns(10.0, shared=700), MS_100, use_share=False)
    assert arm.rollbacks == 1


def random_ledger(seed: int, sessions: int = 6, turns: int = 8) -> list[Request]:
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(turns):
        for s in range(sessions):
            t += rng.choice([0.05, 0.3, 1.0, 4.0])
            prompt = rng.randint(2000, 30000)
            first = t + rng.uniform(0.1, 2.0)
            end = first + rng.uniform(0.5, 20.0)
            out.append(Request(f"s{s}", t, first, end, prompt, rng.randint(200, 3000), rng.randint(20, 800)))
            t = end if rng.random() < 0.7 else t
    return out


@pytest.mark.parametrize("seed", range(8))
def test_share_never_hurts_and_faster_reads_never_hurt(seed):
    ledger = random_ledger(seed)
    for rate in (87.0, 30.0, 10.0):
        idle, both = replay(ledger, rate, use_share=False), replay(ledger, rate, use_share=True)
        assert both.fresh_pct >= idle.fresh_pct
    for use_share in (False, True):
        pct = [replay(ledger, rate, use_share=use_share).fresh_pct for rate in (87.0, 30.0, 10.0, 3.0)]
        assert pct == sorted(pct)


def test_mooncake_trace_is_monotonic_in_share_and_rate():
    requests = import_mooncake(shared_file("mooncake", "conversation_trace.jsonl"), ServiceModel(slots=8))
    sessions = {r.session for r in requests}
    assert len(requests) == 12031 and len(sessions) < len(requests)  # multi-turn chains found
    arms = {(rate, s): replay(requests, rate, use_share=s) for rate in (87.0, 13.66) for s in (False, True)}
    for rate in (87.0, 13.66):
        assert arms[rate, True].fresh_pct >= arms[rate, False].fresh_pct
    for s in (False, True):
        assert arms[13.66, s].fresh_pct >= arms[87.0, s].fresh_pct


def test_mooncake_sessions_are_prefix_chains(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 1000, "input_length": 1200, "output_length": 10, "hash_ids": [0, 7, 8]},
        {"timestamp": 5000, "input_length": 2600, "output_length": 10, "hash_ids": [0, 1, 9, 10, 11, 12]},
    ]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reqs = import_mooncake(path, ServiceModel(slots=1))
    assert reqs[2].session == reqs[0].session != reqs[1].session
    assert reqs[2].new_prompt_tokens == 2600 - 2 * 512  # blocks 0 and 1 shared


def test_trajectory_import_both_token_counts(tokenizer):
    path = shared_file("trajectories", "mini-swe-agent", "pydata__xarray-4629.traj.json")
    qwen = import_trajectory(path, ServiceModel(), tokenizer)
    usage = import_trajectory(path, ServiceModel(), None)
    assert len(qwen) == len(usage) == 18
    for reqs in (qwen, usage):
        assert all(a.end <= b.start for a, b in zip(reqs, reqs[1:]))  # one agent: requests in turn
        assert all(r.start <= r.first_token <= r.end for r in reqs)
    assert qwen[-1].prompt_tokens > 8000 and qwen[1].new_prompt_tokens < qwen[1].prompt_tokens


def test_ledger_round_trip(tmp_path):
    ledger = random_ledger(1, sessions=2, turns=3)
    write_ledger(tmp_path / "l.jsonl", ledger)
    assert read_ledger(tmp_path / "l.jsonl") == ledger


GOOD = {"session": "a", "start": 1.0, "first_token": 1.5, "end": 2.0, "prompt_tokens": 100,
        "new_prompt_tokens": 100, "output_tokens": 5}


@pytest.mark.parametrize(
    "line, message",
    [
        ("{oops", "l.jsonl:2: not valid JSON"),
        (json.dumps({"session": "a"}), "l.jsonl:2: not a ledger line (missing end"),
        (json.dumps(GOOD | {"start": -1.0}), "l.jsonl:2: negative time"),
        (json.dumps(GOOD | {"first_token": 0.5}), "l.jsonl:2: times out of order"),
        (json.dumps(GOOD | {"end": 1.2}), "l.jsonl:2: times out of order"),
        (json.dumps(GOOD | {"output_tokens": -3}), "l.jsonl:2: negative token count"),
        (json.dumps(GOOD | {"new_prompt_tokens": 101}), "l.jsonl:2: new_prompt_tokens exceeds"),
        (json.dumps(GOOD | {"start": "soon"}), "l.jsonl:2: could not convert"),
    ],
    ids=["malformed", "missing-fields", "negative-time", "first-token-before-start", "end-before-first-token",
         "negative-count", "new-exceeds-prompt", "not-a-number"],
)
def test_bad_ledger_lines_are_named(tmp_path, line, message):
    path = tmp_path / "l.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + line + "\n")
    with pytest.raises(ShadowInputError, match=re.escape(message)):
        read_ledger(path)


def test_bad_mooncake_line_is_named(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n{"timestamp": 1}\n')
    with pytest.raises(ShadowInputError, match="m.jsonl:2: not a Mooncake trace line"):
        import_mooncake(path, ServiceModel())
