"""Batched reads: several sessions' next chunks in one forward (their rows stacked for every
row-wise step, each session's conv, recurrence and attention on its own state), and each session's
state after it bit-equal to reading its chunk alone, at mixed depths, with the reference kernels
and with the fused steps (their PyTorch twins, off CUDA). tests/test_gpu.py checks the CUDA sets."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shadow.core.reader import Reader
from shadow.model.kernels.reference import REFERENCE, gdn_gated_each
from shadow.model.runtime import load_model
from shadow.offline.verify import compare_states

GRID = 512
FUSED_REFERENCE = dataclasses.replace(REFERENCE, name="reference-fused", fused=True)
# the fused steps' batched GDN path (one conv launch for the batch, the states gathered and given back)
BATCHED_REFERENCE = dataclasses.replace(FUSED_REFERENCE, name="reference-fused-batched", gdn_gated_batch=gdn_gated_each)


@pytest.fixture(scope="module", params=[REFERENCE, FUSED_REFERENCE, BATCHED_REFERENCE],
                ids=["reference", "fused", "fused-batched"])
def reader(request, shadow_cache):
    return Reader(load_model("tiny", kernels=request.param).model, GRID)


def pairs(reader: Reader, b: int, seed: int) -> tuple[list, list]:
    """Two copies of `b` sessions at mixed depths (0 to 3 chunks read), each with a chunk to read."""
    g = torch.Generator().manual_seed(seed)
    alone, batched = [], []
    for k in range(b):
        ids = torch.randint(1000, 200000, ((k % 4 + 1) * GRID + 37,), generator=g).tolist()
        for group in (alone, batched):
            s = reader.new_session(f"s{k}")
            reader.feed_prompt(s, ids)
            while s.committed + 2 * GRID <= len(s.ids):
                reader.advance(s, max_chunks=1)
            group.append(s)
    return alone, batched


@pytest.mark.parametrize("b", [1, 2, 3, 8])
def test_a_batched_read_is_bit_equal_to_reading_each_chunk_alone(reader, b):
    alone, batched = pairs(reader, b, seed=b)
    for s in alone:
        assert reader.advance(s, max_chunks=1) == 1
    assert reader.advance_batch(batched) == b
    depths = set()
    for x, y in zip(alone, batched):
        compared, mismatched, _ = compare_states(x.state, y.state)
        assert compared > 0 and mismatched == [] and x.committed == y.committed
        assert [c.position for c in x.checkpoints] == [c.position for c in y.checkpoints]
        assert all(torch.equal(c.recurrent, d.recurrent) and torch.equal(c.conv, d.conv)
                   for c, d in zip(x.checkpoints, y.checkpoints))
        depths.add(x.committed - GRID)
    assert b < 3 or len(depths) >= 3  # mixed depths


def test_the_batched_rule_takes_the_whole_batch_in_one_call_a_layer(shadow_cache):
    calls = []

    def counting(q, *rest):
        calls.append(q.shape[:2])
        return gdn_gated_each(q, *rest)

    kernels = dataclasses.replace(FUSED_REFERENCE, name="counting", gdn_gated_batch=counting)
    reader = Reader(load_model("tiny", kernels=kernels).model, GRID)
    _, batched = pairs(reader, 3, seed=11)
    calls.clear()
    assert reader.advance_batch(batched) == 3
    assert calls == [(3, GRID)] * len(reader.model.config.linear_layers)


def backlogs(reader: Reader, runs: list[int], seed: int) -> tuple[list, list]:
    """Two copies of len(runs) sessions at mixed depths, session k with runs[k] whole chunks to read
    and a checkpoint line past them (its prompt's end), some ids past its last whole chunk."""
    g = torch.Generator().manual_seed(seed)
    alone, batched = [], []
    for k, n in enumerate(runs):
        read = k % 3
        ids = torch.randint(1000, 200000, ((read + n) * GRID + 37,), generator=g).tolist()
        for group in (alone, batched):
            s = reader.new_session(f"s{k}")
            reader.feed_prompt(s, ids)
            reader.advance(s, max_chunks=read)
            group.append(s)
    return alone, batched


def entries(sessions: list, runs: list[int]) -> list:
    return [s for s, n in zip(sessions, runs) for _ in range(n)]


@pytest.mark.parametrize("runs", [[2], [2, 1], [1, 3], [4], [1, 2, 1], [3, 1, 2, 2], [8]],
                         ids=lambda r: "runs" + "-".join(map(str, r)))
def test_a_batch_with_a_sessions_next_chunks_is_bit_equal_to_reading_them_alone(reader, runs):
    """A batch whose entries hold several consecutive chunks of a session (a run): each session's
    state, length and checkpoints as reading its chunks one at a time alone leaves them."""
    alone, batched = backlogs(reader, runs, seed=len(runs) * 10 + runs[0])
    for s, n in zip(alone, runs):
        assert reader.advance(s, max_chunks=n) == n
    assert reader.advance_batch(entries(batched, runs)) == sum(runs)
    for x, y in zip(alone, batched):
        compared, mismatched, _ = compare_states(x.state, y.state)
        assert compared > 0 and mismatched == [] and x.committed == y.committed
        assert [c.position for c in x.checkpoints] == [c.position for c in y.checkpoints]


def test_a_batch_is_refused_when_a_run_is_split_too_long_or_crosses_a_checkpoint_line(reader):
    alone, _ = backlogs(reader, [2, 1], seed=5)
    a, b = alone
    before = [(s.committed, s.state.snapshot()) for s in alone]
    with pytest.raises(ValueError, match="consecutive"):
        reader.advance_batch([a, b, a])
    with pytest.raises(ValueError, match="1 chunk"):
        reader.advance_batch([a, b, b])
    short = reader.new_session("short")
    reader.feed_prompt(short, list(range(1000, 1100)))
    with pytest.raises(ValueError, match="no whole chunk"):
        reader.advance_batch([a, short])
    assert reader.advance_batch([]) == 0
    with pytest.raises(ValueError, match="at least one entry"):
        reader.begin_batch([])
    assert reader.run_limit(a) == 2
    reader.feed_prompt(a, a.ids + list(range(2000, 2000 + GRID)))  # a new prompt end: a line past a's run
    line = a.marks[-1]
    reader.feed_prompt(a, a.ids[: a.committed + GRID + 11])  # differs: the line falls inside the first run
    assert reader.run_limit(a) == 1 and a.marks == [a.committed + GRID] and line > a.marks[0]
    with pytest.raises(ValueError, match="1 chunk"):
        reader.advance_batch([a, a])
    for s, (committed, snap) in zip(alone, before):  # nothing read
        assert s.committed == committed and torch.equal(s.state.arena.recurrent, snap.recurrent)
    assert short.committed == 0


@pytest.mark.parametrize("runs", [[1, 1, 1], [2, 1], [1, 3]], ids=lambda r: "runs" + "-".join(map(str, r)))
def test_batched_pieces_equal_the_batched_forward_bit_for_bit(reader, runs):
    """The piecewise forward (graphs off here: the same pieces a GPU captures) on a batch of
    entries gives the bits of the plain batched forward, and of each chunk read alone."""
    from shadow.model.piecewise import PiecewiseForward

    b = sum(runs)
    pieces = Reader(reader.model, GRID, forward=PiecewiseForward(reader.model, sizes={GRID}, graphs=False, batches={b}))
    alone, batched = backlogs(pieces, runs, seed=11)
    for s, n in zip(alone, runs):
        reader.advance(s, max_chunks=n)
    pieces.advance_batch(entries(batched, runs))
    for x, y in zip(alone, batched):
        _, mismatched, _ = compare_states(x.state, y.state)
        assert mismatched == [] and x.committed == y.committed


@pytest.mark.parametrize("finisher", ["step", "prompt", "fork", "advance", "batch"])
def test_a_batch_read_a_piece_at_a_time_is_finished_before_anything_else_touches_the_reader(reader, finisher):
    """`begin_batch` on a piecewise forward: `step` runs one piece (the tiny model has two), the
    sessions are half read and the read stays open on the reader while output ids are fed (they
    only append); then a step, a prompt fed to any session, a fork, another read or another batch
    finishes it first. Every state as reading its chunks alone leaves it."""
    from shadow.model.piecewise import PiecewiseForward

    pieced = Reader(reader.model, GRID, forward=PiecewiseForward(reader.model, sizes={GRID}, graphs=False, batches={4}))
    runs = [2, 1, 1]
    alone, batched = backlogs(pieced, runs, seed=21)
    other = pieced.new_session("other")
    pieced.feed_prompt(other, list(range(3000, 3000 + 2 * GRID)))
    for s, n in zip(alone, runs):
        reader.advance(s, max_chunks=n)
    read = pieced.begin_batch(entries(batched, runs))
    assert read.pieces == 2 and read.chunks == 4
    assert not read.step(1) and pieced.open is read and read.ran == 1 and read.seconds > 0
    pieced.feed_output(batched[1], [7] * 10)  # appends only: still open
    assert pieced.open is read and not read.over
    if finisher == "step":
        assert read.step(1)
    elif finisher == "prompt":
        pieced.feed_prompt(other, other.ids + [9] * 10)
    elif finisher == "fork":
        pieced.ask(other, [11, 12], [13, 14])
    elif finisher == "advance":
        pieced.advance(other, max_chunks=1)
    else:
        pieced.advance_batch([other, other])
    assert read.over and pieced.open is None and read.ran == 2
    for x, y in zip(alone, batched):
        _, mismatched, _ = compare_states(x.state, y.state)
        assert mismatched == [] and x.committed == y.committed
        assert [c.position for c in x.checkpoints] == [c.position for c in y.checkpoints]


@pytest.mark.slow
def test_the_live_idle_reader_reads_batches_and_every_session_stays_exact(shadow_cache):
    """A service whose rule batches up to 4 sessions: its load measures batched reads of 2 and 4
    at the warm depths; requests to four sessions, then the idle window reads their backlogs in
    batched reads; every session bit-equal to a fresh prefill."""
    from serving import assert_exact, long_text, running, wait_until_read

    from shadow.core.schedule import BandwidthRule

    with running(rule=BandwidthRule(batch=4, batch_s=10.0)) as (client, service):
        from shadow.core.schedule import WARM_DEPTHS

        warmed = {size: costs.table() for size, costs in service.sched.batch_costs.items()}
        assert sorted(warmed) == [2, 4] and all(sorted(t) == list(WARM_DEPTHS) for t in warmed.values())
        shown = service.status()["reading"]["batch_ms_by_depth"]
        assert shown == {str(b): {str(d): round(1000 * x, 3) for d, x in t.items()} for b, t in warmed.items()}
        service.reading.stop_event.set()  # the idle thread waits: the backlogs pile up first
        names = [f"b{k}" for k in range(4)]
        for k, name in enumerate(names):
            r = client.post("/v1/chat/completions", headers={"x-session-id": name},
                            json={"messages": [{"role": "user", "content": long_text(30 + k, 500)}], "max_tokens": 2})
            assert r.status_code == 200
        rule = service.sched.rule
        for _ in range(100):  # the idle window's looks, each at a poll tick (a burst begins there)
            if not service.sched.has_backlog():
                break
            service.reading.idle_once(rule.next_poll(service.clock()))
        wait_until_read(service, names)
        learned = {size: costs.table() for size, costs in service.sched.batch_costs.items()}
        assert learned != warmed  # batched reads were made (their costs learned by size)
        assert service.status()["counters"]["batched_reads"]["idle"] >= 1
        for name in names:
            assert_exact(service, name)


@pytest.mark.slow
def test_the_share_reads_batches_between_the_engines_rounds_and_every_session_stays_exact(shadow_cache):
    """A service whose rule batches up to 4 sessions, with a share large enough to pay for a batch:
    four sessions' backlogs wait (the idle thread held), then a decode on a fifth session; between
    its rounds the share reads several sessions' chunks in one read; every session bit-equal to a
    fresh prefill of what it read."""
    from serving import assert_exact, long_text, running

    from shadow.core.schedule import BandwidthRule

    with running(rule=BandwidthRule(share=0.9, slice_s=10.0, batch=4, batch_s=10.0)) as (client, service):
        names = pile_up(client, service, "q", 40)
        before = service.status()["counters"]["batched_reads"]["share"]
        for turn in range(4):  # each decode adds to the share's budget (a busy machine's load may estimate high)
            r = client.post("/v1/chat/completions", headers={"x-session-id": "d"},
                            json={"messages": [{"role": "user", "content": long_text(50 + turn, 300)}], "max_tokens": 64})
            assert r.status_code == 200
            counters = service.status()["counters"]
            if counters["batched_reads"]["share"] > before:
                break
        assert counters["batched_reads"]["share"] > before and counters["share_s"] > 0
        for name in [*names, "d"]:
            assert_exact(service, name)


@pytest.mark.slow
def test_the_share_reads_a_batch_a_piece_a_round_and_every_session_stays_exact(shadow_cache):
    """`--batch-read-ms` past `--batch-ms`: a batch of the share is read a piece between two of the
    embedded engine's rounds (here every batch, one piece a round: --batch-ms far below a piece),
    no other read begins meanwhile, status shows it under way, and every session ends bit-equal to
    a fresh prefill."""
    from serving import assert_exact, long_text, running

    from shadow.core.schedule import BandwidthRule

    rule = BandwidthRule(share=0.9, slice_s=10.0, batch=4, batch_s=1e-6, batch_read_s=10.0)
    with running(rule=rule, pieces=True) as (client, service):
        names = pile_up(client, service, "p", 60)
        seen_in_flight = []
        original = service.reading._piece

        def watching():
            out = original()
            seen_in_flight.append(service.status()["reading"]["in_flight"])
            return out

        service.reading._piece = watching
        for turn in range(4):
            r = client.post("/v1/chat/completions", headers={"x-session-id": "d"},
                            json={"messages": [{"role": "user", "content": long_text(70 + turn, 300)}], "max_tokens": 64})
            assert r.status_code == 200
            counters = service.status()["counters"]
            if counters["batched_reads"]["share"]:
                break
        assert counters["batched_reads"]["share"] >= 1 and counters["read_pieces"] >= 2
        assert any(f is not None and f["pieces_read"] == 1 and f["pieces"] == 2 for f in seen_in_flight)
        service.device.run(service.reading.finish_in_flight)  # the device thread's own
        for name in [*names, "d"]:
            assert_exact(service, name)


def pile_up(client, service, prefix: str, seed: int) -> list[str]:
    """Four sessions' prompts of about 500 words each, their backlogs left unread (the idle thread
    held: only the share reads them); their names."""
    from serving import long_text

    service.reading.stop_event.set()
    names = [f"{prefix}{k}" for k in range(4)]
    for k, name in enumerate(names):
        r = client.post("/v1/chat/completions", headers={"x-session-id": name},
                        json={"messages": [{"role": "user", "content": long_text(seed + k, 500)}], "max_tokens": 1})
        assert r.status_code == 200
    return names


def test_a_service_starts_from_known_costs_and_its_load_measures_over_them(shadow_cache):
    """Settings with costs measured elsewhere (`--read-rate-json`): the scheduler holds them from
    the start at their depths, and the load's own measurements replace them at the depths it
    measures; status says where they came from."""
    from serving import running

    from shadow.core.schedule import WARM_DEPTHS, BandwidthRule, KnownCosts

    known = KnownCosts(chunks=((0, 9.0), (65536, 7.0)), batches=((2, 65536, 11.0),), label="rate.json")
    with running(rule=BandwidthRule(batch=2), read_costs=known) as (client, service):
        table = service.sched.costs.table()
        assert table[65536] == 7.0 and table[0] != 9.0  # the file's deep chunk; the load's own at depth 0
        assert set(WARM_DEPTHS) <= set(table)
        assert service.sched.batch_costs[2].table()[65536] == 11.0
        assert service.status()["reading"]["known_costs"] == "rate.json"


@pytest.mark.slow
def test_a_service_reads_in_the_order_its_priorities_say_and_shows_them(shadow_cache):
    """`serve --priorities`: the service's scheduler ranks by the steps it was given, and status
    names them."""
    from serving import running

    from shadow.core.schedule import Priorities

    fewest = Priorities.parse("question,running,fewest,recent,oldest")
    with running(priorities=fewest) as (client, service):
        assert service.sched.priorities == fewest
        assert client.get("/v1/shadow/status").json()["reading"]["priorities"] == "question,running,fewest,recent,oldest"
    with running() as (client, service):
        assert client.get("/v1/shadow/status").json()["reading"]["priorities"] == "all"
