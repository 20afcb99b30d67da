"""The replay with the live service's limits, on hand-computed timelines: chunk costs by depth, when
ids reach the shadow, restores and drops at the cap, the voice and asks as load, a label that
holds a turn open, what an operator reads off it (ask wait, time to fresh, lag), targets on those
figures, fleet inversions, and the command's tables and errors."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from shadow.cli.main import app
from shadow.core.residency import StateSize
from shadow.core.schedule import BandwidthRule
from shadow.model.config import PRESETS
from shadow.offline.costs import BatchTable, ChunkTable, CostTable, ReadTime
from shadow.offline.fleet import inversions
from shadow.offline.ledger import Request, Router, route_requests, write_ledger
from shadow.offline.limits import ReplayLimits
from shadow.offline.metrics import summary
from shadow.offline.replay import replay
from shadow.offline.targets import Target, parse_target, solve
from shadow.offline.timelines import windows

MS = 1e-3
FLAT = ChunkTable.flat(1e6 / 512 * 0.1, 512)  # 0.1 s a chunk: times are easy to add up
COSTS = CostTable(FLAT, restore_gib_s=math.inf, spill_gib_s=math.inf, ask_s=0.0, phrase_s=0.05, tokenize_s_per_1k=0.0)


def test_a_chunk_table_is_linear_between_its_depths_and_flat_past_them():
    t = ChunkTable((0, 16384, 65536), (0.003, 0.004, 0.006), "x")
    assert t(0) == 0.003 and t(8192) == pytest.approx(0.0035) and t(40960) == pytest.approx(0.005)
    assert t(10**6) == 0.006 and t(16384) == 0.004
    read = ReadTime(t, 512)
    assert read(0, 2) == pytest.approx(t(0) + t(512)) and read(3, 3) == 0.0


def test_the_built_in_table_is_the_h200_run_and_a_read_rate_file_gives_its_own_rows():
    h200 = ChunkTable.h200()
    assert h200.depths == (0, 16384, 65536, 100352) and h200(16384) * 1e6 / 512 == pytest.approx(7.4066, abs=1e-3)
    doc = {"model": "m", "kernels": "k", "ms_per_1k_tokens": 7.0, "rows": [
        {"model": "m", "kernels": "k", "grid": 512, "context": 0, "ms_per_chunk": 3.0},
        {"model": "m", "kernels": "k", "grid": 512, "context": 65536, "ms_per_1k_tokens": 12.0},
        {"model": "m", "kernels": "other", "grid": 512, "context": 16384, "ms_per_chunk": 99.0},
        {"model": "m", "kernels": "k", "grid": 1024, "context": 16384, "ms_per_chunk": 99.0}]}
    t = ChunkTable.from_read_rate(doc, 512, "f")
    assert t.depths == (0, 65536) and t.seconds == pytest.approx((0.003, 0.006144))
    assert ChunkTable.from_read_rate({"ms_per_1k_tokens": 7.0}, 512, "f").seconds == pytest.approx((512 * 7e-6,))
    with pytest.raises(ValueError, match="no rows at grid 256"):
        ChunkTable.from_read_rate(doc, 256, "f")


def test_chunks_cost_what_their_depth_costs():
    """One session of 4,096 ids read in the idle window from 1.0 s, chunk k costing 0.1 + 0.1 k s
    (its first row at depth k * 512): chunks end at 1.1, 1.3, 1.6, 2.0, 2.5 and 3.1 s, so the
    turn at 3.0 s finds five read (the sixth in flight); at 0.1 s a chunk all eight were read by
    1.8 s."""
    table = ChunkTable(tuple(k * 512 for k in range(9)), tuple(0.1 + 0.1 * k for k in range(9)), "steep")
    reqs = [Request("s", 0.0, 0.5, 1.0, 4096, 4096, 0), Request("s", 3.0, 3.1, 6.0, 4196, 100, 10)]
    arm = replay(reqs, costs=CostTable(table), use_share=False)
    assert arm.turns[0].behind == 4096 - 5 * 512
    flat = replay(reqs, costs=CostTable(ChunkTable.flat(0.1e6 / 512, 512)), use_share=False)
    assert flat.turns[0].behind == 0


def test_when_the_output_reaches_the_shadow():
    """A turn's prompt of 1,024 ids, its output of 600 decoded from 3 to 5 s; the next turn at 10 s.
    The output is read in the idle window after 5 s when the shadow sees it (embedded, or an
    engine that streams its ids), never when the engine shows none."""
    reqs = [Request("s", 0.0, 3.0, 5.0, 1024, 1024, 600), Request("s", 10.0, 10.1, 11.0, 1724, 100, 10)]
    behind = {ids: replay(reqs, costs=COSTS, limits=ReplayLimits(ids=ids), use_share=False).turns[0].behind
              for ids in ("embedded", "engine", "end", "none")}
    assert behind == {"embedded": 1624 - 1536, "engine": 1624 - 1536, "end": 1624 - 1536, "none": 600}


def test_an_output_the_engine_never_showed_as_ids_comes_with_the_next_prompt():
    """The timeline above, its ids at the response's end, but the engine gave no ids for the first
    output (`output_seen` false, as a live ledger marks it): the 600 ids stay unread until the
    next prompt brings them, so the next turn starts 600 behind; a third turn of the session finds
    that prompt read (the second request's output was shown)."""
    reqs = [Request("s", 0.0, 3.0, 5.0, 1024, 1024, 600, output_seen=False), Request("s", 10.0, 10.1, 11.0, 1724, 100, 10),
            Request("s", 20.0, 20.1, 21.0, 1834, 100, 10)]
    arm = replay(reqs, costs=COSTS, limits=ReplayLimits(ids="end"), use_share=False)
    assert [t.behind for t in arm.turns] == [600, 1734 - 1536]
    shown = replay([replace(r, output_seen=True) for r in reqs], costs=COSTS, limits=ReplayLimits(ids="end"), use_share=False)
    assert shown.turns[0].behind == 1624 - 1536


def test_a_prompt_known_only_at_its_first_chunk_waits_for_it():
    """Session b decodes from 0.1 to 20 s (its share reads other sessions too); session s's turn
    starts at 1 s with a 2,048-id prompt and a first token at 6 s. Embedded, the prompt is known
    at once and b's share reads it during s's prefill; through an engine that shows the ids on its
    first chunk, not before 6 s."""
    reqs = [Request("b", 0.0, 0.1, 20.0, 512, 512, 100), Request("s", 1.0, 6.0, 7.0, 2048, 2048, 0),
            Request("s", 30.0, 30.1, 31.0, 2148, 100, 5)]
    fresh = {}
    for ids in ("embedded", "engine"):
        arm = replay(reqs, costs=COSTS, limits=ReplayLimits(ids=ids), rule=BandwidthRule(share=0.2))
        (f,) = [f for f in arm.to_fresh if f.session == "s" and f.start == 1.0]
        assert not f.censored
        fresh[ids] = f.seconds
    assert fresh["embedded"] < 5.0 <= fresh["engine"]


def test_a_dropped_session_is_read_again_and_an_ask_would_wait_for_all_of_it():
    """Two sessions of 8,192 ids under a cap that holds one read session: the idle window reads a,
    then b, and each settle after a chunk drops the other (no disk). At b's next turn, a was
    dropped: it is read again from the start, and an ask about it would wait for every chunk."""
    size = StateSize.of(PRESETS["tiny"], 4)
    cap = (size.resident(8192, 1) + size.delta) / 2**30
    reqs = [Request("a", 0.0, 0.1, 0.2, 8192, 8192, 0), Request("b", 0.0, 0.1, 0.2, 8192, 8192, 0),
            Request("a", 20.0, 20.1, 21.0, 8292, 100, 10), Request("b", 20.0, 20.1, 21.0, 8292, 100, 10)]
    capped = replay(reqs, costs=COSTS, limits=ReplayLimits(cap_gib=cap, state=size), use_share=False, samples=5)
    free = replay(reqs, costs=COSTS, use_share=False)
    assert capped.drops >= 1 and free.drops == 0
    waits = {t.session: t.wait_s for t in capped.turns}
    assert sorted(waits.values()) == [pytest.approx(0.0), pytest.approx(16 * 0.1)]
    assert [t.behind for t in free.turns] == [0, 0] and max(t.behind for t in capped.turns) == 8192


def test_a_restore_takes_the_device_and_delays_the_reads_after_it():
    """Session a (2,048 ids, read at once) is spilled when b's turn ends; at a's next turn (30 s,
    ending at 30.2 s) its restore takes the device: for nothing (an infinite rate), or 0.4 s (its
    file's bytes at a rate made so: reading it again would take as long, so it is spilled, not
    dropped). The turn ends once the device is free, so the idle window that reads its new prompt
    opens at the 30.4 s poll, not the 30.2 s one: fresh 0.2 s later."""
    size = StateSize.of(PRESETS["tiny"], 4)
    cap = (size.resident(8192, 1) + size.delta) / 2**30
    reqs = [Request("a", 0.0, 0.1, 0.2, 2048, 2048, 0), Request("b", 5.0, 5.1, 5.2, 2048, 2048, 0),
            Request("a", 30.0, 30.05, 30.2, 4096, 2048, 0), Request("b", 40.0, 40.1, 40.2, 2148, 100, 0)]
    limits = ReplayLimits(cap_gib=cap, state=size, disk=True)
    fast = replay(reqs, costs=COSTS, limits=limits, use_share=False)
    slow_costs = CostTable(FLAT, restore_gib_s=size.file(2048, 2048, 1) / 2**30 / 0.4, spill_gib_s=math.inf)
    slow = replay(reqs, costs=slow_costs, limits=limits, use_share=False)
    assert fast.restores >= 1 and slow.restores >= 1 and fast.drops == 0
    (f0,), (f1,) = [[f for f in arm.to_fresh if f.session == "a" and f.start == 30.0] for arm in (fast, slow)]
    assert f0.seconds == pytest.approx(0.6) and f1.seconds == pytest.approx(0.8)


def test_a_restore_started_at_the_requests_arrival_runs_beside_the_engines_prefill():
    """The timeline above with the prompt ids known at the engine's first chunk (30.05 s): fed
    then, a's restore takes the device for 0.4 s from 30.05 s (fresh 1.0 s after its start); started
    when the request came (`restore_ahead`, as `shadow serve` does), it runs on its own thread from
    30.0 s while the engine reads the prompt, the prompt waits for it without holding the device,
    and a is fresh as soon as it is whenever the prompt comes at once (0.8 s)."""
    size = StateSize.of(PRESETS["tiny"], 4)
    cap = (size.resident(8192, 1) + size.delta) / 2**30
    reqs = [Request("a", 0.0, 0.1, 0.2, 2048, 2048, 0), Request("b", 5.0, 5.1, 5.2, 2048, 2048, 0),
            Request("a", 30.0, 30.05, 30.2, 4096, 2048, 0), Request("b", 40.0, 40.1, 40.2, 2148, 100, 0)]
    slow_costs = CostTable(FLAT, restore_gib_s=size.file(2048, 2048, 1) / 2**30 / 0.4, spill_gib_s=math.inf)
    arms = {ahead: replay(reqs, costs=slow_costs, use_share=False, limits=ReplayLimits(
        cap_gib=cap, state=size, disk=True, ids="engine", restore_ahead=ahead)) for ahead in (False, True)}
    assert arms[False].restores == arms[True].restores == 2
    assert (arms[False].restores_ahead, arms[True].restores_ahead) == (0, 2)
    fresh = {ahead: {(f.session, f.start): f.seconds for f in arm.to_fresh} for ahead, arm in arms.items()}
    assert fresh[False][("a", 30.0)] == pytest.approx(1.0) and fresh[True][("a", 30.0)] == pytest.approx(0.8)
    assert fresh[True][("b", 40.0)] < fresh[False][("b", 40.0)]


def test_the_voice_speaks_at_status_lines_within_its_budget():
    """One turn decoding for 40 s: its status lines come 1.5 s after its first token and every 10 s
    after (at 1.6, 11.6, 21.6, 31.6 s); the voice's 3 % holds a 50 ms phrase from 1.77 s, so the
    first line goes without one and the next three take one each. The line timing is the live
    service's."""
    from shadow.offline.limits import LINE_EVERY_S, LINE_QUIET_S
    from shadow.server.settings import LineTiming

    assert (LINE_QUIET_S, LINE_EVERY_S) == (LineTiming().quiet_s, LineTiming().progress_every_s)
    reqs = [Request("s", 0.0, 0.1, 40.1, 512, 512, 400)]
    arm = replay(reqs, costs=COSTS, limits=ReplayLimits(voice_share=0.03), use_share=False)
    assert arm.voice_s == pytest.approx(0.05 * 3)


def test_a_label_asked_of_the_engine_keeps_the_turn_open():
    """The turn's response ends at 1.0 s; asking its label takes 2.05 s, so the idle window opens
    only at 3.2 s (the poll after the turn's end): the next turn at 3.1 s finds nothing read."""
    reqs = [Request("s", 0.0, 0.1, 1.0, 1024, 1024, 0), Request("s", 3.1, 3.2, 4.0, 1124, 100, 5)]
    plain = replay(reqs, costs=COSTS, limits=ReplayLimits(ids="engine"), use_share=False)
    labelled = replay(reqs, costs=COSTS, limits=ReplayLimits(ids="engine", label_s=2.05), use_share=False)
    assert plain.turns[0].behind == 0 and labelled.turns[0].behind == 1024


def test_asks_are_load_and_their_wait_is_the_reading_they_wait_for():
    reqs = [Request("s", 0.0, 0.1, 500.0, 4096, 4096, 10)]
    arm = replay(reqs, costs=COSTS, limits=ReplayLimits(asks_per_hour=60, seed=3), use_share=False)
    assert arm.asks and arm.chunks_ask >= 8  # the first ask read the session (idle reads never: a turn runs)
    assert max(a.wait_s for a in arm.asks) == pytest.approx(8 * 0.1)


def test_an_asks_forward_is_drawn_from_the_measured_forwards_seeded():
    """`ask_samples`: each ask's forward is one of a live run's forwards (seeded by the limits'
    seed), not the one `ask_s`; the same seed draws the same, and every draw is a sample."""
    reqs = [Request("s", 0.0, 0.1, 500.0, 4096, 4096, 10)]
    times = tuple((1.0 + 2.0 * k, "s", "random") for k in range(40))
    base = CostTable(FLAT, restore_gib_s=math.inf, spill_gib_s=math.inf, ask_s=0.01, tokenize_s_per_1k=0.0)
    drawn = replace(base, ask_samples=(0.005, 0.006, 0.2))
    waits = lambda costs, seed: [a.wait_s for a in replay(reqs, costs=costs, limits=ReplayLimits(asks_at=times, seed=seed),
                                                          use_share=False).asks][1:]  # past the first: forwards only
    plain, one, again, other = waits(base, 0), waits(drawn, 0), waits(drawn, 0), waits(drawn, 1)
    assert all(w == pytest.approx(0.01) for w in plain)
    assert one == again and one != other  # seeded
    assert all(any(w == pytest.approx(x) for x in (0.005, 0.006, 0.2)) for w in one)
    assert {round(w, 3) for w in one} == {0.005, 0.006, 0.2}  # 39 draws of three: each came up


FORWARDS, RATES = "--ask-forwards-json", "--host-rates-json"


@pytest.mark.parametrize("flag, content, says", [
    (FORWARDS, "[]", "non-empty JSON list"), (FORWARDS, "[1, -2]", "each a number above 0"),
    (FORWARDS, '{"ms": [1]}', "non-empty JSON list"), (FORWARDS, "[1, true]", "each a number above 0"),
    (FORWARDS, "[1, 2", "not a JSON list of ms"), (FORWARDS, "[1e400]", "at most 3,600,000"),
    (FORWARDS, "[" + "9" * 400 + "]", "at most 3,600,000"), (FORWARDS, "[NaN]", "each a number above 0"),
    (RATES, "[]", "non-empty JSON list"), (RATES, "[1, 0]", "each a number above 0"),
    (RATES, "[1e6]", "at most 100,000"), (RATES, "[1, 2", "not a JSON list of GiB/s")])
def test_replay_ledger_refuses_bad_samples_before_any_work(tmp_path, flag, content, says):
    """An ask's forwards (ms) or moves back from host memory (GiB/s) as a live run measured them."""
    bad, out = tmp_path / "samples.json", tmp_path / "out.ledger.jsonl"
    bad.write_text(content)
    result = CliRunner().invoke(app, ["replay-ledger", str(ledger_file(tmp_path)), flag, str(bad),
                                      "--write-ledger", str(out)])
    assert result.exit_code == 2 and says in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_replay_ledger_draws_asks_forwards_from_a_file(tmp_path):
    forwards = tmp_path / "forwards.json"
    forwards.write_text(json.dumps([8.0] * 98 + [300.0, 400.0]))
    asks = tmp_path / "asks.jsonl"
    asks.write_text("".join(json.dumps({"time": 9.0 * k + 0.5, "session": f"s{k}", "kind": "random"}) + "\n"
                            for k in range(1, 4)))
    result = CliRunner().invoke(app, ["replay-ledger", str(ledger_file(tmp_path)), "--asks-at", str(asks),
                                      "--ask-forwards-json", str(forwards), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output.strip().splitlines()[-1])
    assert doc["limits"]["ask_forwards"] == {"n": 100, "p50": 8.0, "p90": 8.0, "p99": 300.0, "max": 400.0}
    assert "an ask's forward drawn from 100 measured (p50 8, p99 300 ms)" in result.output


def test_replay_ledger_draws_moves_back_from_a_file(tmp_path):
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps([20.0] * 99 + [0.5]))
    result = CliRunner().invoke(app, ["replay-ledger", str(ledger_file(tmp_path)), "--host-rates-json", str(rates),
                                      "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output.strip().splitlines()[-1])
    assert doc["limits"]["host_rates"] == {"n": 100, "p1": 0.5, "p10": 20.0, "p50": 20.0, "max": 20.0}
    assert "a move back from host memory drawn from 100 measured (p50 20, p1 0.5 GiB/s)" in " ".join(result.output.split())


def test_asks_at_given_times_wait_for_the_device_and_are_tallied_by_kind():
    """Asks as a client sent them: the first (at 1.0 s) reads the session's 8 chunks (0.8 s), the
    second (at 1.05 s, another kind) waits for the device until the first is answered at 1.8 s."""
    reqs = [Request("s", 0.0, 0.1, 500.0, 4096, 4096, 10)]
    costs = CostTable(FLAT, restore_gib_s=math.inf, spill_gib_s=math.inf, ask_s=0.01, tokenize_s_per_1k=0.0)
    limits = ReplayLimits(asks_at=((1.05, "s", "random"), (1.0, "s", "turn")))
    arm = replay(reqs, costs=costs, limits=limits, use_share=False)
    first, second = arm.asks
    assert (first.kind, first.arrival, first.queued_s) == ("turn", 1.0, 0.0)
    assert first.wait_s == pytest.approx(0.8 + 0.01)
    assert second.kind == "random" and second.queued_s == pytest.approx(0.81 - 0.05)
    assert second.wait_s == pytest.approx(0.76 + 0.01)  # read to its end already: its own forward
    asks = summary(arm, windows(reqs, [0], 1), 512)["asks"]
    assert asks["n"] == 2 and set(asks["by_kind"]) == {"random", "turn"}
    assert asks["by_kind"]["random"]["queued_ms"]["p50"] == pytest.approx(760.0)
    with pytest.raises(ValueError, match="not both"):
        ReplayLimits(asks_at=((1.0, "s", "turn"),), asks_per_hour=1)
    with pytest.raises(ValueError, match="finite"):
        ReplayLimits(asks_at=((math.nan, "s", "turn"),))


def test_an_asks_chunks_cost_their_scale_and_a_move_back_from_the_host_is_in_its_wait():
    """The first ask above with its chunks at half the table's cost (`ask_chunk_scale`, a live run's
    measured ratio): 8 chunks in 0.4 s. Three sessions under a cap that holds two, a host tier
    below it with moves of 0.1 s a session (`host_gib_s`, a live run's measured rate): c's turn
    sends a to the host, and an ask about a waits for its move back before its forward."""
    reqs = [Request("s", 0.0, 0.1, 500.0, 4096, 4096, 10)]
    half = CostTable(FLAT, restore_gib_s=math.inf, spill_gib_s=math.inf, ask_s=0.01, tokenize_s_per_1k=0.0,
                     ask_chunk_scale=0.5)
    arm = replay(reqs, costs=half, limits=ReplayLimits(asks_at=((1.0, "s", "turn"),)), use_share=False)
    assert arm.asks[0].wait_s == pytest.approx(8 * 0.05 + 0.01)

    size = StateSize.of(PRESETS["tiny"], 4)
    one = size.resident(2048, 1)
    three = [Request(name, 5.0 * k, 5.0 * k + 0.1, 5.0 * k + 0.2, 2048, 2048, 0) for k, name in enumerate("abc")]
    costs = CostTable(FLAT, restore_gib_s=math.inf, spill_gib_s=math.inf, host_gib_s=one / 2**30 / 0.1, ask_s=0.01,
                      tokenize_s_per_1k=0.0)
    limits = ReplayLimits(cap_gib=(2 * one + size.delta) / 2**30, state=size, host_cap_gib=1.0,
                          asks_at=((30.0, "a", "random"),))
    arm = replay(three, costs=costs, limits=limits, use_share=False)
    assert arm.from_host == 1 and arm.asks[0].wait_s == pytest.approx(0.1 + 0.01, rel=0.05)


def test_a_move_back_from_the_host_is_drawn_from_the_measured_speeds_seeded():
    """`host_rates`: each move back from the host tier takes its bytes at a speed drawn from a live
    run's (seeded by the limits' seed), not at `host_gib_s`. The same three sessions as above, and
    an ask about a (in the tier) every 20 s, each sending another to the tier: every move back is
    about 0.1 s or 1.0 s (the speeds of one session in 0.1 and in 1.0 s), both come up, and the same seed
    draws the same."""
    size = StateSize.of(PRESETS["tiny"], 4)
    one = size.resident(2048, 1)
    three = [Request(name, 5.0 * k, 5.0 * k + 0.1, 5.0 * k + 0.2, 2048, 2048, 0) for k, name in enumerate("abc")]
    base = CostTable(FLAT, restore_gib_s=math.inf, spill_gib_s=math.inf, host_gib_s=one / 2**30 / 0.1, ask_s=0.01,
                     tokenize_s_per_1k=0.0)
    drawn = replace(base, host_rates=(one / 2**30 / 0.1, one / 2**30 / 1.0))
    asks = tuple((30.0 + 20.0 * k, "abc"[k % 3], "random") for k in range(24))

    def waits(costs, seed):
        arm = replay(three, costs=costs, use_share=False, limits=ReplayLimits(
            cap_gib=(one + size.delta) / 2**30, state=size, host_cap_gib=1.0, asks_at=asks, seed=seed))
        assert arm.from_host == len(asks)  # each ask brought its session back
        return [a.wait_s - 0.01 for a in arm.asks]

    speed = lambda w: next(x for x in (0.1, 1.0) if w == pytest.approx(x, rel=0.05))  # its state a little over `one`
    plain, one_draw, again, other = waits(base, 0), waits(drawn, 0), waits(drawn, 0), waits(drawn, 1)
    assert {speed(w) for w in plain} == {0.1}
    assert {speed(w) for w in one_draw} == {0.1, 1.0} and one_draw == again and one_draw != other


def test_probes_see_the_lag_and_the_wait():
    reqs = [Request("s", 0.0, 0.1, 100.0, 4096, 4096, 0)]
    arm = replay(reqs, costs=COSTS, use_share=False, samples=20, seed=1)
    assert len(arm.probes) == 20 and all(p.lag == 4096 and p.wait_s == pytest.approx(0.8) for p in arm.probes)
    s = summary(arm, windows(reqs, [0], 1), 512)
    assert s["random"]["stale_pct"] == 100.0 and s["random"]["ask_wait_ms"]["p99"] == pytest.approx(800.0)
    assert s["sessions"]["ever_stale_pct"] == 100.0


def test_windows_measure_the_load_where_it_is():
    """Two sessions for the first 60 s, none for the next 60, one after: the mean over the span is
    light, the windows are not."""
    reqs = [Request("a", 0.0, 1.0, 60.0, 6000, 6000, 0), Request("b", 0.0, 1.0, 60.0, 6000, 6000, 0),
            Request("c", 120.0, 121.0, 180.0, 3000, 3000, 0)]
    w = windows(reqs, [0, 0, 0], 1, window_s=60.0)
    assert [x.active for x in w] == pytest.approx([2.0, 0.0, 1.0])
    assert [x.new_tok_s for x in w] == pytest.approx([200.0, 0.0, 50.0])


@pytest.mark.parametrize("text, message", [
    ("p99 ask wait", "reads like"), ("ask wait <= 5 ms", "needs p50, p90, p99 or max"),
    ("p99 fresh >= 97", "one figure"), ("p99 speed <= 3 ms", "unknown metric"), ("fresh >= 97 ms", "in %, not ms"),
    ("150", "is a percentage in (0, 100]"), ("ready >= 197 %", "a percentage, at most 100"),
    ("fresh >= 101", "a percentage, at most 100"),
])
def test_a_malformed_target_is_refused(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_target(text)


def test_targets_read_their_figure_and_the_solver_finds_the_share():
    t = parse_target("p90 time to fresh <= 1500 ms")
    assert t == Target("time to fresh", "p90", "<=", 1.5) and t.met(1.4) and not t.met(None)
    assert parse_target("97") == Target("fresh", None, ">=", 97.0)
    solved = solve(lambda share: 1000 * (0.1 - share), parse_target("max ask wait <= 50 ms"))
    assert solved.share == pytest.approx(0.05, rel=0.03) and solved.monotone and solved.below < solved.share


def test_a_target_on_turn_starts_ready_for_the_new_prompt():
    """'ready >= 97 %': the share of turn starts under a chunk from the part of the new prompt known
    before it came (`turn_starts.ready_pct` of a replay's summary); one figure, in %."""
    t = parse_target("ready >= 97 %")
    assert t == Target("ready", None, ">=", 97.0) and t.text == "ready >= 97 %" and t.higher_is_better
    summary = {"turn_starts": {"fresh_pct": 99.0, "ready_pct": 96.5}}
    assert t.figure(summary) == 96.5 and not t.met(t.figure(summary))
    assert parse_target("ready >= 97").met(97.0)
    with pytest.raises(ValueError, match="one figure"):
        parse_target("p99 ready >= 97 %")
    solved = solve(lambda share: min(100.0, 90.0 + 500 * share), t)
    assert solved.share == pytest.approx(0.014, rel=0.03) and solved.value >= 97.0


def test_rendezvous_routing_moves_sessions_only_to_the_new_engine():
    names = [f"s{i}" for i in range(300)]
    for n in range(1, 6):
        before, after = Router(n, "rendezvous"), Router(n + 1, "rendezvous")
        moved = [s for s in names if before.pick(s, [0] * n) != after.pick(s, [0] * (n + 1))]
        assert all(after.pick(s, [0] * (n + 1)) == n for s in moved) and moved


def test_fleet_inversions_are_found_and_explained():
    """Turn starts fresh on 1 engine and stale on 2 are counted per session with why."""
    reqs = [Request(f"s{k}", 0.5 * k, 0.5 * k + 0.1, 0.5 * k + 5, 3000, 3000, 50) for k in range(6)]
    reqs += [Request(f"s{k}", 30 + 0.5 * k, 30.1 + 0.5 * k, 31 + 0.5 * k, 3100, 50, 5) for k in range(6)]
    one, two = route_requests(reqs, 1), route_requests(reqs, 2)
    a = replay(reqs, costs=COSTS, engines=1, engine_of=one, rule=BandwidthRule(share=0.05))
    b = replay(reqs, costs=COSTS, engines=2, engine_of=two, rule=BandwidthRule(share=0.05))
    report = inversions(reqs, a, b, one, two)
    assert report["engines"] == [1, 2] and report["fresh"] == [a.fresh, b.fresh]
    lost = sum(1 for x, y in zip(a.turns, b.turns) if x.fresh and not y.fresh)
    assert report["inversions"] == lost and all(r["why"] for r in report["rows"])


def ledger_file(tmp_path):
    path = tmp_path / "l.jsonl"
    reqs = []
    for k in range(8):
        t, prompt = 3.0 * k, 0
        for _ in range(4):
            prompt += 2500
            reqs.append(Request(f"s{k}", t, t + 0.3, t + 8.0, prompt, 2500, 200))
            prompt += 200
            t += 9.0
    write_ledger(path, reqs)
    return path


def test_the_command_reports_the_operators_figures_in_80_columns(tmp_path, monkeypatch):
    import shadow.cli.common as common
    from rich.console import Console

    monkeypatch.setattr(common, "console", Console(width=80, record=True, highlight=False))
    import shadow.cli.replay_ledger as command

    monkeypatch.setattr(command, "console", common.console)
    result = CliRunner().invoke(app, ["replay-ledger", str(ledger_file(tmp_path)), "--cap-gib", "0.05", "--share",
                                      "0.02", "--solve-share", "p99 ask wait <= 50 ms", "--samples", "200", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output.strip().splitlines()[-1])
    s = doc["arms"][1]["summary"]
    for path in (("turn_starts", "ask_wait_ms", "p99"), ("random", "ask_wait_ms", "p90"), ("to_fresh_s", "p50"),
                 ("sessions", "worst_lag", "max"), ("sessions", "ever_stale_pct")):
        node = s
        for key in path:
            node = node[key]
        assert node is None or isinstance(node, (int, float))
    assert doc["load"]["new_tok_s"]["peak"] >= doc["load"]["new_tok_s"]["p50"] > 0
    assert doc["limits"]["cap_gib"] == 0.05 and doc["solve"][0]["target"] == "p99 ask wait <= 50 ms"
    text = common.console.export_text()
    assert max(len(line) for line in text.splitlines() if line.startswith(("┃", "│", "┏", "└"))) <= 80


def test_a_malformed_target_exits_2_before_any_work(tmp_path):
    out = tmp_path / "out.ledger.jsonl"
    result = CliRunner().invoke(app, ["replay-ledger", str(ledger_file(tmp_path)), "--solve-share", "p99 ask wait",
                                      "--write-ledger", str(out)])
    assert result.exit_code == 2 and "--solve-share a target reads like" in result.output
    assert not out.exists()


@pytest.mark.parametrize("scale", ["0", "-1", "nan", "inf", "101"])
def test_a_bad_ask_chunk_scale_exits_2_before_any_work(tmp_path, scale):
    out = tmp_path / "out.ledger.jsonl"
    result = CliRunner().invoke(app, ["replay-ledger", str(ledger_file(tmp_path)), "--ask-chunk-scale", scale,
                                      "--write-ledger", str(out)])
    assert result.exit_code == 2 and "--ask-chunk-scale must be > 0 and <= 100" in result.output
    assert "Traceback" not in result.output and not out.exists()


def test_replay_ledger_asks_at_a_clients_times_reports_them_by_kind(tmp_path):
    asks = tmp_path / "asks.jsonl"
    asks.write_text("".join(json.dumps({"time": 9.0 * k + 0.5, "session": f"s{k}", "kind": kind}) + "\n"
                            for k in range(1, 4) for kind in ("turn", "random")) + "\n")
    result = CliRunner().invoke(app, ["replay-ledger", str(ledger_file(tmp_path)), "--asks-at", str(asks), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output.strip().splitlines()[-1])
    assert doc["limits"]["asks_at"] == 6 and doc["limits"]["asks_per_hour"] == 0
    for arm in doc["arms"]:
        by_kind = arm["summary"]["asks"]["by_kind"]
        assert {k: v["n"] for k, v in by_kind.items()} == {"random": 3, "turn": 3}
        assert all(v["queued_ms"]["max"] <= v["wait_ms"]["max"] for v in by_kind.values())


@pytest.mark.parametrize("flag", ["--turns", "--write-ledger", "--csv"])
def test_replay_ledger_never_writes_over_a_file_it_reads(tmp_path, flag):
    ledger = ledger_file(tmp_path)
    before = ledger.read_bytes()
    result = CliRunner().invoke(app, ["replay-ledger", str(ledger), flag, str(tmp_path / "." / ledger.name)])
    assert result.exit_code == 2 and "is a file this command reads" in result.output, result.output
    assert ledger.read_bytes() == before


def test_replay_ledger_writes_every_arms_turn_starts_to_set_beside_a_live_run(tmp_path):
    out = tmp_path / "turns.jsonl"
    result = CliRunner().invoke(app, ["replay-ledger", str(ledger_file(tmp_path)), "--turns", str(out), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output.strip().splitlines()[-1])
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    for arm in doc["arms"]:  # each arm's lines: as many as its turn starts, as fresh as its summary says
        mine = [x for x in lines if x["arm"] == arm["arm"] and x["share"] == arm["share"]]
        assert len(mine) == arm["turns"] > 0 and sum(x["fresh"] for x in mine) == arm["fresh"]
        assert all(x["fresh"] == (x["behind"] < doc["grid"]) for x in mine)
        assert [x["start"] for x in mine] == sorted(x["start"] for x in mine)
    assert {x["session"] for x in lines} <= {f"s{k}" for k in range(8)}  # the ledger's sessions


@pytest.mark.parametrize("lines, extra, says", [
    ([{"time": -1, "session": "s1"}], [], "asks.jsonl:1: time is a finite number"),
    ([{"time": 1, "session": "s1"}, {"time": 2}], [], "asks.jsonl:2: session is a non-empty name"),
    ([{"time": 1, "session": "s1", "kind": ""}], [], "kind is a name of 1 to 40"),
    (["not json"], [], "asks.jsonl:1: not valid JSON"),
    ([], [], "holds no asks"),
    ([{"time": 1, "session": "nobody"}], [], "1 asked sessions are not in the trace, e.g. 'nobody'"),
    ([{"time": 1, "session": "s1"}], ["--asks-per-hour", "10"], "not with --asks-per-hour or --pack"),
])
def test_replay_ledger_refuses_a_bad_asks_file_and_writes_nothing(tmp_path, lines, extra, says):
    asks, out = tmp_path / "asks.jsonl", tmp_path / "out.ledger.jsonl"
    asks.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    result = CliRunner().invoke(app, ["replay-ledger", str(ledger_file(tmp_path)), "--asks-at", str(asks),
                                      "--write-ledger", str(out), *extra])
    assert result.exit_code == 2 and says in " ".join(result.output.split()), result.output
    assert not out.exists()


def test_a_batch_table_is_the_batched_reads_time_over_its_chunks_alone():
    table = BatchTable.measured({0: {1: 4.0, 2: 6.0, 8: 16.0}, 1000: {1: 10.0, 2: 18.0, 8: 72.0}}, "t")
    assert table.ratios == {2: (0.75, 0.9), 8: (0.5, 0.9)}
    assert table.ratio(2, 500) == pytest.approx(0.825) and table.ratio(8, 5000) == 0.9
    assert table.ratio(4, 0) == 0.75 and table.ratio(1, 0) == 1.0  # a size not measured: the largest below it
    costs = CostTable(ChunkTable((0, 1000), (0.004, 0.010), "c"), batch=table)
    assert costs.batch_s([0, 1000]) == pytest.approx(0.004 * 0.75 + 0.010 * 0.9)
    assert costs.batch_s([1000]) == 0.010
    with pytest.raises(ValueError, match="single chunk"):
        BatchTable.measured({0: {2: 6.0}}, "t")
    with pytest.raises(ValueError, match="some depths only"):
        BatchTable.measured({0: {1: 4.0, 2: 6.0}, 1000: {1: 10.0}}, "t")
    assert BatchTable.h200().ratio(8, 16384) == pytest.approx(21.623 / (8 * 3.799))


def test_a_read_rate_file_gives_its_batch_rows():
    doc = {"model": "m", "kernels": "k", "batch_rows": [
        {"model": "m", "kernels": "k", "grid": 512, "context": 0, "batch": 1, "ms_per_read": 3.0},
        {"model": "m", "kernels": "k", "grid": 512, "context": 0, "batch": 4, "ms_per_read": 9.0},
        {"model": "m", "kernels": "other", "grid": 512, "context": 0, "batch": 4, "ms_per_read": 99.0}]}
    assert BatchTable.from_read_rate(doc, 512, "f").ratios == {4: (0.75,)}
    assert BatchTable.from_read_rate({"rows": []}, 512, "f") is None
    assert BatchTable.from_read_rate(doc, 256, "f") is None  # batches timed at another grid only


def test_batched_idle_reads_take_several_sessions_chunks_in_one_read():
    """Four sessions of 1,024 ids each end their turn at 0.2 s, a poll tick; their eight chunks
    (0.1 s each alone) are read in the idle window from then. One at a time, session by session,
    they are fresh at 0.4, 0.6, 0.8 and 1.0 s (the last after its next turn began); in batches of 4 at half the time a chunk, two reads
    of 0.2 s, each of two sessions' runs of two chunks: a and b fresh at 0.4 s, c and d at 0.6 s. The
    next turns at 0.9 s find every session fresh with batches, and without, the last one's second
    chunk in flight."""
    reqs = [Request(s, 0.0, 0.1, 0.2, 1024, 1024, 0) for s in "abcd"]
    reqs += [Request(s, 0.9, 1.0, 1.1, 1124, 100, 0) for s in "abcd"]
    halves = BatchTable((0,), {2: (0.75,), 4: (0.5,)}, "halves")
    costs = CostTable(FLAT, restore_gib_s=math.inf, spill_gib_s=math.inf, ask_s=0.0, batch=halves)
    alone = replay(reqs, costs=costs, use_share=False)
    batched = replay(reqs, costs=costs, use_share=False, rule=BandwidthRule(batch=4, batch_s=1.0))
    assert alone.chunks_idle == batched.chunks_idle == 8
    assert [t.seconds for t in alone.to_fresh[:4]] == pytest.approx([0.4, 0.6, 0.8, 0.9])
    assert [t.censored for t in alone.to_fresh[:4]] == [False, False, False, True]  # not fresh by its next turn
    assert [t.seconds for t in batched.to_fresh[:4]] == pytest.approx([0.4, 0.4, 0.6, 0.6])
    assert [t.behind for t in alone.turns] == [0, 0, 0, 512] and all(t.fresh for t in batched.turns)


def test_a_share_batch_in_pieces_is_read_between_rounds_and_no_gap_passes_a_piece():
    """The replay's device reads a share batch estimated past `batch_s` in pieces between the
    decoding turn's rounds (`ReplayLimits.pieces` of them in all, as many a round as fit `batch_s`), as
    `Reading.share` does: the same chunks read as in one piece, each gap between rounds one piece
    long, the batch's sessions moved on only once its last piece is read."""
    reqs = [Request("d1", 0.0, 0.1, 21.0, 100, 100, 400)]  # a long decode (rounds of 52 ms), no whole chunk
    reqs += [Request(s, 1.0, 1.01, 1.02, 512, 512, 0) for s in "abcd"]  # four chunks to read, in the share
    reqs += [Request(s, 20.0, 20.1, 20.2, 612, 100, 0) for s in "abcd"]
    halves = BatchTable((0,), {2: (0.75,), 4: (0.5,)}, "halves")
    costs = CostTable(FLAT, restore_gib_s=math.inf, spill_gib_s=math.inf, ask_s=0.0, batch=halves)
    whole = replay(reqs, costs=costs, limits=ReplayLimits(pieces=4),
                   rule=BandwidthRule(share=0.5, slice_s=1.0, batch=4, batch_s=1.0))
    pieces = replay(reqs, costs=costs, limits=ReplayLimits(pieces=4),
                    rule=BandwidthRule(share=0.5, slice_s=1.0, batch=4, batch_s=0.06, batch_read_s=1.0))
    assert whole.chunks_share == pieces.chunks_share == 4 and whole.chunks_idle == pieces.chunks_idle == 0
    assert whole.longest_slice_s == pytest.approx(0.2)  # the batch of four at half a chunk each, in one gap
    assert pieces.longest_slice_s == pytest.approx(0.05)  # a quarter of it a round
    assert all(t.fresh for t in pieces.turns) and len(pieces.turns) == 4


def test_a_runs_chunks_are_charged_by_the_runs_measured_ratio_at_their_own_depths():
    """`BatchTable.measured` with runs: a run of B chunks from a depth over the single chunks at its
    chunks' own depths (linear between the depths measured); `batch_s` charges a run's entries by
    it and the others by the batch ratio; without runs measured, a run's chunk costs any batched
    chunk's."""
    ms = {0: {1: 2.0, 2: 3.0}, 4096: {1: 4.0, 2: 6.0}}
    runs = {0: {2: 4.2}, 4096: {2: 8.5}}
    table = BatchTable.measured(ms, "t", runs, grid=512)
    assert table.ratios[2] == pytest.approx((0.75, 0.75))
    assert table.run_ratios[2] == pytest.approx((4.2 / (2.0 + 2.25), 8.5 / (4.0 + 4.0)))  # 2.25: 512 deep
    costs = CostTable(ChunkTable((0, 4096), (0.002, 0.004), "c"), batch=table)
    assert costs.batch_s([0, 512]) == pytest.approx(0.002 * 0.75 + 0.00225 * 0.75)
    r0, r1 = 4.2 / 4.25, 8.5 / 8.0
    assert costs.batch_s([0, 512], [True, True]) == pytest.approx(0.002 * r0 + 0.00225 * (r0 + (r1 - r0) / 8))
    plain = CostTable(ChunkTable((0, 4096), (0.002, 0.004), "c"), batch=BatchTable.measured(ms, "t"))
    assert plain.batch_s([0, 512], [True, True]) == pytest.approx(plain.batch_s([0, 512]))
    with pytest.raises(ValueError, match="other depths or sizes"):
        BatchTable.measured(ms, "t", {0: {2: 4.2}})
    rows = [{"context": d, "batch": b, "ms_per_read": x} for d, row in ms.items() for b, x in row.items()]
    doc = {"batch_rows": rows + [{"context": d, "batch": 2, "ms_per_read": runs[d][2], "run": True} for d in runs]}
    assert BatchTable.from_read_rate(doc, 512, "f").run_ratios[2] == pytest.approx(table.run_ratios[2])
    doc["batch_rows"][-1]["run"] = "yes"
    with pytest.raises(ValueError, match="run is true or false"):
        BatchTable.from_read_rate(doc, 512, "f")
