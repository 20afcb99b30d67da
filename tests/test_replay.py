"""The ledger replay: hand-computed cases, fleets, packing, the share solver, monotonic properties,
importers and bad input."""

from __future__ import annotations

import dataclasses
import json
import random
import re

import pytest
from conftest import shared_file

from shadow.errors import ShadowInputError
from shadow.offline.ledger import (Request, ServiceModel, import_mooncake, import_trajectory, mooncake_arrivals, read_ledger,
                           route_requests, write_ledger)
from shadow.offline.replay import Arm, TurnStart, density, monotone_checks, pack, replay, solve_share
from shadow.core.schedule import BandwidthRule, Priorities

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
    be due at 1.022 s, after the decode ended at 1.01 s. (The second turn's decode reads one more.)"""
    arm = replay(two_turns(1.05), MS_100, rule=BandwidthRule(share=0.2))
    assert [t.behind for t in arm.turns] == [1124 - 512] and arm.chunks_share == 2
    assert arm.share_s == pytest.approx(2 * 0.0512)
    at_2pct = replay(two_turns(1.05), MS_100, rule=BandwidthRule(share=0.02))
    assert [t.behind for t in at_2pct.turns] == [1124]  # one chunk needs 2.56 s of decode


def test_idle_bursts_stop_after_two_seconds_and_resume_at_the_next_poll():
    """At 0.5 s a chunk, bursts from 1.0 s hold chunks at 1.0, 1.5, 2.0, 2.5; the next starts at
    3.0, and its chunk, still being read at the turn start at 3.2, does not count."""
    reqs = [Request("s", 0.0, 0.5, 1.0, 8192, 8192, 0), Request("s", 3.2, 3.3, 4.0, 8292, 100, 10)]
    arm = replay(reqs, 0.5e6 / 512, use_share=False)
    assert arm.turns[0].behind == 8192 - 4 * 512
    later = replay([reqs[0], Request("s", 3.5, 3.6, 4.0, 8292, 100, 10)], 0.5e6 / 512, use_share=False)
    assert later.turns[0].behind == 8192 - 5 * 512  # done at 3.5: counted


def test_a_rollback_under_a_chunk_in_flight_wastes_it():
    """The idle chunk 1,024..1,536 is in flight at 2.1 s when a prompt sharing 1,100 ids comes: it
    does not count at the turn start; the prompt is fed once it is read, and rolls the session back
    to its newest checkpoint at or below 1,100 (none: the start), so all three chunks are wasted."""
    first = Request("s", 0.0, 0.5, 1.0, 4096, 4096, 0)
    second = Request("s", 2.1, 2.2, 3.0, 4200, 4200 - 1100, 10)
    arm = replay([first, second], 0.5e6 / 512, use_share=False)  # chunks at 1.0, 1.5, 2.0 (in flight)
    assert arm.turns[0].behind == 4096 - 1024 and arm.rollbacks == 1 and arm.chunks_wasted == 3


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
    arms = [replay(ledger, rate, rule=BandwidthRule(share=s), use_share=s > 0, priorities=p)
            for p in (Priorities(), Priorities.parse("none")) for rate in (30.0, 10.0) for s in (0, 0.02, 0.05, 0.2)]
    assert monotone_checks(arms) == {"ok": True, "failures": []}


def test_monotone_checks_name_a_violation():
    def arm(share: float, fresh: int) -> Arm:
        a = Arm("x", share, 10.0)
        a.turns = [TurnStart("s", float(i), 0 if i < fresh else 9999, i < fresh) for i in range(10)]
        return a

    checks = monotone_checks([arm(0.0, 5), arm(0.02, 4)])
    assert not checks["ok"] and "more share was less fresh" in checks["failures"][0]


def test_share_slices_are_capped_at_the_slice():
    """Session a decodes for 200 s; at 150 s session b brings a 60,000-token prompt. The budget
    pooled by then (2 % of 150 s, less a's output chunks) is read in slices of at most 150 ms,
    one decode round (25 ms) apart."""
    reqs = [Request("a", 0.0, 0.1, 200.1, 500, 500, 8000), Request("b", 150.0, 150.2, 160.0, 60_000, 60_000, 10),
            Request("b", 170.0, 170.1, 171.0, 60_100, 90, 5)]
    arm = replay(reqs, 10.0, rule=BandwidthRule(slice_chunks=100))  # 5.12 ms a chunk: 29 in a slice
    assert arm.longest_slice_s == pytest.approx(29 * 0.00512)
    assert arm.turns[0].behind < 512 and arm.chunks_share > 117
    one = replay(reqs, 10.0)  # by default one chunk a slice, one decode round apart
    assert one.longest_slice_s == pytest.approx(0.00512) and one.turns[0].behind < 512


@pytest.mark.slow
def test_mooncake_trace_is_monotonic_in_share_and_rate():
    requests = import_mooncake(shared_file("mooncake", "conversation_trace.jsonl"), ServiceModel(slots=8))
    sessions = {r.session for r in requests}
    assert len(requests) == 12031 and len(sessions) < len(requests)  # multi-turn chains found
    arms = {(rate, s): replay(requests, rate, use_share=s) for rate in (87.0, 13.66) for s in (False, True)}
    for rate in (87.0, 13.66):
        assert arms[rate, True].fresh_pct >= arms[rate, False].fresh_pct
    for s in (False, True):
        assert arms[13.66, s].fresh_pct >= arms[87.0, s].fresh_pct


MOONCAKE_ROWS = [
    {"timestamp": 0, "input_length": 1500, "output_length": 10, "hash_ids": [0, 1, 2]},
    {"timestamp": 1000, "input_length": 1200, "output_length": 10, "hash_ids": [0, 7, 8]},
    {"timestamp": 5000, "input_length": 2600, "output_length": 10, "hash_ids": [0, 1, 9, 10, 11, 12]},
    {"timestamp": 9000, "input_length": 2605, "output_length": 10, "hash_ids": [0, 1, 9, 10, 11, 13]},
]


def mooncake_file(tmp_path, rows=MOONCAKE_ROWS):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mooncake_sessions_are_prefix_chains_sharing_the_answer(tmp_path):
    reqs = import_mooncake(mooncake_file(tmp_path), ServiceModel(slots=1))
    assert reqs[2].session == reqs[0].session != reqs[1].session
    assert reqs[2].new_prompt_tokens == 2600 - (1500 + 10)  # the prompt holds the previous prompt and answer
    assert reqs[3].session == reqs[0].session
    assert reqs[3].new_prompt_tokens == 2605 - 5 * 512  # too short to hold 2,610: the blocks shared only


def test_a_mooncake_answer_is_read_once(tmp_path):
    """Read at 1 ms a chunk in the idle window, the first prompt and its answer are read before the
    second turn; the second prompt holds them, so nothing rolls back and nothing is read again."""
    reqs = import_mooncake(mooncake_file(tmp_path, MOONCAKE_ROWS[:1] + MOONCAKE_ROWS[2:3]), ServiceModel(slots=1))
    arm = replay(reqs, 1000 / 512, use_share=False)
    assert arm.rollbacks == 0 and arm.chunks_idle == 2 and arm.turns[0].behind == 1510 - 1024


def test_mooncake_blocks_are_512_tokens_whatever_the_grid(tmp_path):
    from typer.testing import CliRunner

    from shadow.cli.main import app

    path = mooncake_file(tmp_path)
    for grid in (512, 1024):
        out = tmp_path / f"g{grid}.ledger.jsonl"
        result = CliRunner().invoke(app, ["replay-ledger", str(path), "--grid", str(grid), "--write-ledger", str(out)])
        assert result.exit_code == 0, result.output
    assert read_ledger(tmp_path / "g512.ledger.jsonl") == read_ledger(tmp_path / "g1024.ledger.jsonl")
    assert [a.new_prompt_tokens for a in mooncake_arrivals(path)] == [1500, 1200, 2600 - 1510, 2605 - 2560]


def fleet_ledger(seed: int, sessions: int = 30) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for s in range(sessions):
        t = rng.uniform(0, 600)
        prompt = 0
        for _ in range(rng.randint(2, 12)):
            prompt += rng.randint(300, 4000)
            first = t + rng.uniform(0.05, 1.5)
            end = first + rng.uniform(1.0, 30.0)
            output = rng.randint(20, 900)
            out.append(Request(f"s{s}", t, first, end, prompt, min(prompt, rng.randint(300, 4000)), output))
            prompt += output
            t = end + rng.choice([0.0, 0.3, 2.0, 20.0])
    return out


@pytest.mark.parametrize("how", ["affinity", "hash"])
def test_fleet_routing_keeps_sessions_on_their_engines(how):
    reqs = fleet_ledger(3)
    engine_of = route_requests(reqs, 4, how)
    homes = {}
    for r, e in zip(reqs, engine_of):
        assert homes.setdefault(r.session, e) == e
    assert len(set(engine_of)) == 4  # and they are spread
    arm = replay(reqs, 10.0, engines=4, route=how)
    assert all(homes[t.session] == t.engine for t in arm.turns)


def test_round_robin_moves_sessions_and_a_shadow_knows_only_its_engine():
    reqs = fleet_ledger(3)
    engine_of = route_requests(reqs, 4, "round-robin")
    assert [e for _, e in sorted(zip((r.start for r in reqs), engine_of))][:8] == [0, 1, 2, 3, 0, 1, 2, 3]
    affinity, spread = replay(reqs, 10.0, engines=4), replay(reqs, 10.0, engines=4, route="round-robin")
    assert len(affinity.turns) == len(spread.turns) and spread.fresh < affinity.fresh


def test_affinity_sends_a_new_session_to_the_engine_with_the_fewest_requests_in_flight():
    reqs = [Request("a", 0.0, 0.1, 10.0, 100, 100, 5), Request("b", 1.0, 1.1, 10.0, 100, 100, 5),
            Request("c", 2.0, 2.1, 3.0, 100, 100, 5), Request("a", 11.0, 11.1, 12.0, 200, 95, 5),
            Request("d", 5.0, 5.1, 6.0, 100, 100, 5)]
    assert route_requests(reqs, 3) == [0, 1, 2, 0, 2]  # d: engine 2 is free again at 5.0


def test_the_fleet_service_model_times_each_engine_on_its_own_slots():
    arrivals = [("a", 0.0, 1000, 1000, 40), ("b", 0.1, 1000, 1000, 40), ("c", 0.2, 1000, 1000, 40)]
    one, _ = ServiceModel(slots=1).serve_fleet(arrivals, 1)
    three, engine_of = ServiceModel(slots=1).serve_fleet(arrivals, 3)
    assert engine_of == [0, 1, 2]
    assert [r.end for r in one] == pytest.approx([1.05, 2.1, 3.15])  # queued behind one slot
    assert [r.end for r in three] == pytest.approx([1.05, 1.15, 1.25])


@pytest.mark.parametrize("target", [2.0, 5.0, 12.0])
def test_pack_hits_its_target_density(target):
    reqs = fleet_ledger(5)
    packed = pack(reqs, target)
    assert density(packed).active == pytest.approx(target, rel=1e-3)
    by = {}
    for r in packed:
        by.setdefault(r.session.split("~")[0], []).append(r)
    original = {}
    for r in reqs:
        original.setdefault(r.session, []).append(r)
    for name, rs in by.items():  # each session (and copy) keeps its own gaps and token counts
        own = sorted(original[name], key=lambda r: r.start)
        copies = len(rs) // len(own)
        assert len(rs) == copies * len(own)
        for c in range(copies):
            copy = [r for r in rs if (r.session.split("~")[1:] or ["1"])[0] == str(c + 1)]
            mine = sorted(copy, key=lambda r: r.start)
            shift = mine[0].start - own[0].start
            assert [(r.start - shift, r.end - shift, r.prompt_tokens) for r in mine] == \
                [(pytest.approx(r.start), pytest.approx(r.end), r.prompt_tokens) for r in own]


def test_pack_repeats_the_set_when_shifting_cannot_reach_the_target():
    reqs = fleet_ledger(5, sessions=6)
    packed = pack(reqs, 20.0)
    assert len({r.session for r in packed}) > 6
    assert density(packed).active == pytest.approx(20.0, rel=1e-3)


def test_solve_share_finds_the_smallest_share_for_a_target():
    reqs = pack(fleet_ledger(7), 12.0)

    def fresh_at(share: float) -> float:
        return replay(reqs, 30.0, rule=BandwidthRule(share=share or 0.02), use_share=share > 0).fresh_pct

    idle = fresh_at(0.0)
    target = idle + (fresh_at(0.5) - idle) * 0.8
    solved = solve_share(fresh_at, target)
    assert solved.share is not None and solved.fresh_pct >= target > solved.below_pct
    assert solved.share - solved.below <= max(1e-4, 0.02 * solved.share) + 1e-12
    assert solved.monotone and fresh_at(solved.share) == solved.fresh_pct
    assert solve_share(fresh_at, 100.1).share is None  # out of reach: said so


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


def test_an_output_not_seen_is_written_only_where_it_is_false_and_read_back(tmp_path):
    ledger = random_ledger(1, sessions=1, turns=3)
    ledger[1] = dataclasses.replace(ledger[1], output_seen=False)
    write_ledger(tmp_path / "l.jsonl", ledger)
    rows = [json.loads(x) for x in (tmp_path / "l.jsonl").read_text().splitlines()]
    assert [r.get("output_seen") for r in rows] == [None, False, None]
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
        (json.dumps(GOOD | {"output_seen": "no"}), "l.jsonl:2: output_seen is true or false"),
    ],
    ids=["malformed", "missing-fields", "negative-time", "first-token-before-start", "end-before-first-token",
         "negative-count", "new-exceeds-prompt", "not-a-number", "output-seen-not-a-flag"],
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


@pytest.mark.slow
def test_the_command_replays_a_packed_fleet_solves_the_share_and_checks(tmp_path):
    from typer.testing import CliRunner

    from shadow.cli.main import app

    ledger = tmp_path / "l.jsonl"
    write_ledger(ledger, fleet_ledger(11))
    result = CliRunner().invoke(app, [
        "replay-ledger", str(ledger), "--read-ms-per-1k", "30", "--read-ms-per-1k", "10", "--share", "0.02",
        "--engines", "2", "--pack", "8", "--priorities", "all", "--priorities", "none", "--solve-share", "90", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output.strip().splitlines()[-1])
    assert doc["engines"] == 2 and doc["density"]["active_per_engine"] == pytest.approx(4.0, rel=1e-3)
    assert [(a["priorities"], a["share"]) for a in doc["arms"]] == \
        [("all", 0.0)] * 2 + [("all", 0.02)] * 2 + [("none", 0.0)] * 2 + [("none", 0.02)] * 2
    assert doc["checks"] == {"ok": True, "failures": []} and "checks: more share never less fresh" in result.output
    assert len(doc["solve"]) == 4
    for s in doc["solve"]:
        assert s["monotone"] and (s["share"] is None or s["fresh_pct"] >= 90 > s["below_fresh_pct"])


@pytest.mark.parametrize("args, message", [
    (["--route", "random"], "--route is one of affinity, hash, rendezvous, round-robin"),
    (["--engines", "0"], "--engines is at least 1"),
    (["--priorities", "fastest"], "priorities are 'all', 'none'"),
    (["--pack", "0"], "--pack needs a positive number"),
    (["--solve-share", "120"], "--solve-share is a percentage"),
], ids=["route", "engines", "priorities", "pack", "solve-share"])
def test_the_command_refuses_bad_fleet_options(tmp_path, args, message):
    from typer.testing import CliRunner

    from shadow.cli.main import app

    ledger = tmp_path / "l.jsonl"
    write_ledger(ledger, fleet_ledger(1, sessions=2))
    result = CliRunner().invoke(app, ["replay-ledger", str(ledger), *args])
    assert result.exit_code == 2 and message in result.output, result.output
