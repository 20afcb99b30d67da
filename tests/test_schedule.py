"""The read scheduler on scripted timelines: idle bursts, the engine's share in capped slices, cost
estimates that one slow chunk cannot stall, and the priority steps in order."""

from __future__ import annotations

import math

import pytest

from shadow.core.schedule import BandwidthRule, ChunkCosts, KnownCosts, Priorities, Read, ReadScheduler, Wait

G = 512


def scheduler(chunk_s: float | None = 0.35, priorities: Priorities = Priorities(), **rule) -> ReadScheduler:
    costs = ChunkCosts()
    if chunk_s is not None:
        costs.warm(0, chunk_s)
    return ReadScheduler(BandwidthRule(**rule), G, costs, priorities)


def run_idle(s: ReadScheduler, t: float, until: float, chunk_s: float, arrivals=()) -> list[float]:
    """Drive the idle window from t to `until` as the live idle thread does (each chunk takes
    chunk_s); `arrivals`: (time, turn, session) of requests. Returns the chunks' start times."""
    starts, arrivals = [], sorted(arrivals)
    while t < until:
        while arrivals and arrivals[0][0] <= t:
            _, turn, session = arrivals.pop(0)
            s.turn_started(turn, session, t)
        d = s.next_read(t)
        if isinstance(d, Read):
            starts.append(round(t, 6))
            t += chunk_s
            s.read_done(d, 1, chunk_s, t)
        else:
            t = min([d.until, until] + [a[0] for a in arrivals])
    return starts


def test_an_idle_burst_starts_at_a_tick_and_ends_within_burst_s():
    s = scheduler()
    s.update("a", 0, 40 * G, now=0.93)
    assert s.next_read(0.93) == Wait(pytest.approx(1.0))  # the next poll tick
    starts = run_idle(s, 1.0, 2.8, 0.35)
    assert starts == [1.0, 1.35, 1.7, 2.05, 2.4]  # 2.75 + 0.35 would pass 3.0
    assert s.next_read(2.75) == Wait(pytest.approx(2.8))  # the next burst begins at the next tick
    assert isinstance(s.next_read(2.8), Read)


def test_a_waiting_request_waits_at_most_one_chunk():
    s = scheduler()
    s.update("a", 0, 40 * G, now=0.0)
    starts = run_idle(s, 1.0, 5.0, 0.35, arrivals=[(1.5, "t1", "b")])
    assert starts == [1.0, 1.35]  # the chunk started at 1.35 finishes at 1.7: the request waited 0.2 s
    assert s.next_read(1.7) == Wait(math.inf)
    s.waiting(1, 1.7)  # a request waiting for the device counts as busy too
    s.turn_ended("t1", 2.0)
    assert s.next_read(2.0) == Wait(math.inf)
    s.waiting(0, 2.1)
    assert s.next_read(2.1) == Wait(pytest.approx(2.2))


def test_one_slow_chunk_never_stops_reading():
    s = scheduler(chunk_s=0.05)
    s.update("a", 0, 100 * G, now=0.0)
    d = s.next_read(0.0)
    s.read_done(d, 1, 3.0, 3.0)  # one chunk of 3 s: longer than a burst and than a slice
    assert s.costs.estimate(G) <= 0.05 * 1.9 + 1e-12
    assert isinstance(s.next_read(3.0), Read)  # the burst still has room for the new estimate
    s.turn_started("t", "a", 3.1)
    s.first_token("t", 3.2)
    d = s.next_read(20.0, between_rounds=True)  # 2 % of 16.8 s: 0.336 s, a slice of 0.15 s
    assert isinstance(d, Read) and d.window == "share" and d.chunks >= 1


def test_a_chunk_longer_than_a_burst_is_still_read_one_a_burst():
    s = scheduler(chunk_s=None)
    s.update("a", 0, 10 * G, now=0.0)
    starts = run_idle(s, 0.0, 20.0, 5.0)  # every chunk takes 5 s and the estimate stays above 2 s
    assert starts == [0.0, 5.0, 10.0, 15.0]


def test_without_an_estimate_the_share_reads_nothing_but_the_idle_window_measures():
    s = scheduler(chunk_s=None)
    s.update("a", 0, 10 * G, now=0.0)
    s.turn_started("t", "a", 0.0)
    s.first_token("t", 0.1)
    assert s.next_read(100.0, between_rounds=True) == Wait(math.inf)
    s.turn_ended("t", 100.0)
    d = s.next_read(100.0)
    assert isinstance(d, Read) and d.estimate_s is None
    s.read_done(d, 1, 0.04, 100.04)
    assert s.costs.estimate(0) == pytest.approx(0.04)


def test_the_estimate_decays_toward_new_measurements():
    c = ChunkCosts(alpha=0.3)
    c.warm(0, 0.1)
    c.observe(0, 10.0)  # counted as 4x the estimate
    assert c.estimate(0) == pytest.approx(0.1 + 0.3 * (0.4 - 0.1))
    for _ in range(30):
        c.observe(0, 0.05)
    assert c.estimate(0) == pytest.approx(0.05, rel=1e-3)


def test_unseen_depths_interpolate_or_take_the_nearest():
    c = ChunkCosts(bucket_tokens=8192)
    assert c.estimate(0) is None and not c.known
    c.warm(0, 0.01)
    c.warm(65536, 0.03)
    assert c.estimate(32768) == pytest.approx(0.02)
    assert c.estimate(300_000) == pytest.approx(0.03) and c.estimate(4000) == pytest.approx(0.01)
    assert c.table() == {0: 0.01, 65536: 0.03}


def test_a_share_slice_is_capped_at_the_slice_and_at_the_budget():
    s = scheduler(chunk_s=0.01, slice_chunks=100)
    s.update("a", 0, 100 * G, now=0.0)
    s.turn_started("t", "a", 0.0)
    s.first_token("t", 1.0)
    d = s.next_read(3.0, between_rounds=True)  # 2 % of 2 s = 0.04 s: four chunks
    assert isinstance(d, Read) and d.chunks == 4
    s.read_done(d, 4, 0.04, 3.04)
    assert s.next_read(3.04, between_rounds=True) == Wait(pytest.approx(1.0 + 0.05 / 0.02))
    d = s.next_read(100.0, between_rounds=True)  # 1.94 s pooled: one slice of 0.15 s
    assert d.chunks == 15 and d.estimate_s <= 0.15 + 1e-9
    assert s.next_read(100.0) == Wait(math.inf)  # not between rounds: nothing inside a turn


def test_by_default_a_slice_is_one_chunk_and_asking_again_too_soon_is_skipped():
    """One chunk a slice (no gap between two rounds longer than one chunk); the Wait between
    rounds holds while nothing changes, so a caller may skip asking until its time."""
    s = scheduler(chunk_s=0.01)
    s.update("a", 0, 100 * G, now=0.0)
    s.turn_started("t", "a", 0.0)
    s.first_token("t", 1.0)
    d = s.next_read(3.0, between_rounds=True)  # a budget of four chunks: one a slice
    assert isinstance(d, Read) and d.chunks == 1
    s.read_done(d, 1, 0.01, 3.01)
    assert s.between_rounds_due(3.01)  # a read changed the answer: ask again
    for t in (3.02, 3.03):
        d = s.next_read(t, between_rounds=True)
        assert isinstance(d, Read) and d.chunks == 1
        s.read_done(d, 1, 0.01, t + 0.01)
    assert isinstance(s.next_read(3.04, between_rounds=True), Read)
    s.read_done(Read("a", 1, "share", 3 * G, 0.01), 1, 0.01, 3.05)
    wait = s.next_read(3.05, between_rounds=True)  # four chunks read: the budget is spent
    assert isinstance(wait, Wait) and wait.until > 3.05
    assert not s.between_rounds_due(3.05) and not s.between_rounds_due(wait.until - 1e-6)
    s.update("a", 4 * G, 100 * G + 7, now=3.06)  # more ids in the same whole chunk: nothing changes
    assert not s.between_rounds_due(3.06)
    s.update("a", 4 * G, 100 * G + G, now=3.07)  # a new whole chunk: ask again
    assert s.between_rounds_due(3.07) and s.between_rounds_due(wait.until)


def test_the_share_is_the_engines_not_each_turns():
    s = scheduler(chunk_s=0.01)
    s.update("a", 0, 100 * G, now=0.0)
    s.update("b", 0, 100 * G, now=0.0)
    s.turn_started(1, "a", 0.0)
    s.first_token(1, 1.0)
    s.turn_started(2, "b", 1.5)
    s.first_token(2, 2.0)  # a second turn decoding does not start a new stretch
    assert s.stretch_start == 1.0 and s.share_left(3.0) == pytest.approx(0.04)
    s.turn_ended(1, 4.0)
    assert s.stretch_start == 1.0  # turn 2 still decodes
    s.turn_ended(2, 5.0)
    assert s.stretch_start is None and s.share_left(6.0) == 0.0


def test_a_chunk_over_the_slice_is_read_idle_not_in_a_turn():
    s = scheduler(chunk_s=0.2)
    s.update("a", 0, 10 * G, now=0.0)
    s.turn_started("t", "a", 0.0)
    s.first_token("t", 0.0)
    assert s.next_read(1000.0, between_rounds=True) == Wait(math.inf)
    s.turn_ended("t", 1000.0)
    assert isinstance(s.next_read(1000.0), Read)


def order(s: ReadScheduler, now: float) -> list[str]:
    """The sessions in the order the share reads them (one chunk each)."""
    out = []
    while isinstance(d := s.next_read(now, between_rounds=True), Read):
        out.append(d.session)
        s.read_done(d, d.chunks, 0.0, now)
    return out


def five_sessions(priorities: Priorities) -> ReadScheduler:
    """Each has one whole chunk. old1 and old2 had their last turns at 2.0 (old2's backlog is
    older); new's last turn at 4.0; run has a turn in flight from 5.0; q has a pending question."""
    s = scheduler(chunk_s=0.001, priorities=priorities)
    for name, backlog_at in [("old1", 0.5), ("new", 3.0), ("old2", 0.2), ("run", 0.1), ("q", 1.0)]:
        s.update(name, 0, 0, now=0.0)
        s.update(name, 0, G + 10, now=backlog_at)
    for turn, (name, at) in enumerate([("q", 1.0), ("old1", 2.0), ("old2", 2.0), ("new", 4.0)]):
        s.turn_started(turn, name, at)
        s.turn_ended(turn, at + 0.5)
    s.question("q", 4.0)
    s.turn_started("live", "run", 5.0)
    s.first_token("live", 5.5)
    return s


@pytest.mark.parametrize("spec, expected", [
    ("all", ["q", "run", "new", "old2", "old1"]),
    ("none", ["old1", "new", "old2", "run", "q"]),  # the order the sessions were first seen
    ("running,recent,oldest", ["run", "new", "old2", "old1", "q"]),  # q's last turn is the oldest
    ("question,recent,oldest", ["q", "run", "new", "old2", "old1"]),  # run's turn is the most recent
    ("question,running,oldest", ["q", "run", "old2", "old1", "new"]),
    ("question,running,recent", ["q", "run", "new", "old1", "old2"]),
    ("oldest", ["run", "old2", "old1", "q", "new"]),
])
def test_priorities_order_step_by_step(spec, expected):
    assert order(five_sessions(Priorities.parse(spec)), 100.0) == expected


def test_priorities_parse_and_label():
    assert Priorities.parse("all").label == "all" and Priorities.parse("none").label == "none"
    assert Priorities.parse("recent, running").label == "running,recent"
    with pytest.raises(ValueError, match="priorities are"):
        Priorities.parse("fastest")


def test_a_standing_question_holds_the_reader_at_its_line():
    s = scheduler(chunk_s=0.001)
    s.update("a", 0, 10 * G, now=0.0)
    s.question("a", 0.0, stop=3 * G)
    d = s.next_read(0.0)
    assert d.chunks == 1 and s.whole_chunks("a") == 3
    for _ in range(3):
        d = s.next_read(0.2)
        s.read_done(d, 1, 0.001, 0.2)
    assert s.whole_chunks("a") == 0 and s.next_read(0.2) == Wait(math.inf)
    s.answered("a", 0.3)
    assert s.whole_chunks("a") == 7


def test_spilled_sessions_wait_and_updates_move_read_positions():
    s = scheduler(chunk_s=0.001)
    s.update("disk", 0, 10 * G, now=0.0, resident=False)
    assert s.next_read(0.0) == Wait(math.inf)
    s.update("disk", 0, 10 * G, now=0.1, resident=True)
    d = s.next_read(0.2)
    assert d == Read("disk", 1, "idle", 0, 0.001)
    s.update("disk", 4 * G, 10 * G, now=0.2)  # a rollback or an ask moved it meanwhile
    s.read_done(d, 1, 0.001, 0.201)  # the read position stays what the update said
    assert s.sessions["disk"].committed == 4 * G
    s.forget("disk")
    assert s.next_read(0.4) == Wait(math.inf)


def test_the_fewest_step_reads_the_session_nearest_to_fresh_first():
    s = scheduler(chunk_s=0.001, priorities=Priorities.parse("fewest"), slice_chunks=100)
    s.update("far", 0, 5 * G, now=0.0)
    s.update("near", 0, 2 * G, now=0.0)
    s.turn_started("t", "far", 0.0)
    s.first_token("t", 0.0)
    reads = []
    while isinstance(d := s.next_read(100.0, between_rounds=True), Read):
        reads.append((d.session, d.chunks))
        s.read_done(d, 1, 0.0, 100.0)  # one chunk at a time: the ranks follow the backlogs
        if len(reads) > 20:
            break
    assert reads[:2] == [("near", 2), ("near", 1)] and reads[2][0] == "far"
    assert Priorities.parse("question,running,fewest,recent,oldest").label == "question,running,fewest,recent,oldest"
    assert Priorities().label == "all" and not Priorities().fewest


def test_batches_take_chunks_in_rank_order_a_sessions_run_first_within_the_bound():
    """With `batch`, an idle read names more chunks, in batches of 2, 4, ..., while the batch's
    estimate stays within `batch_s`: the first session's next chunks (a run), then the next
    session's; a batch's reported seconds move every session on by its chunks and teach the
    batch size's own estimate."""
    s = scheduler(chunk_s=0.004, batch=8, batch_s=0.0125)
    for k in range(5):
        s.update(f"s{k}", 0, 3 * G, now=float(k))
    read = s.next_read(10.0)
    assert isinstance(read, Read) and read.chunks == 1 and read.batch == 2  # three chunks fit 12.5 ms: a batch of 2
    assert read.session == "s0" and read.others == (("s0", G),) and read.estimate_s == pytest.approx(0.008)
    s.read_done(read, 2, 0.005, 10.005)  # faster than two singles: the batch size's estimate learns it
    assert s.sessions["s0"].committed == 2 * G and s.sessions["s1"].committed == 0
    assert s.batch_estimate([G, G]) == pytest.approx(0.005)
    read = s.next_read(10.005)  # s0's last chunk, then s1's first: a run of one, then the next session's
    assert read.batch == 2 and (read.session, read.depth) == ("s0", 2 * G) and read.others == (("s1", 0),)
    s.read_done(read, 2, 0.005, 10.01)
    assert s.sessions["s0"].committed == 3 * G and s.sessions["s1"].committed == G
    one = scheduler(chunk_s=0.004)
    one.update("a", 0, 3 * G, now=0.0)
    one.update("b", 0, 3 * G, now=0.0)
    assert one.next_read(1.0).others == ()  # batch 1 (the default): one session a read


def test_a_sessions_run_ends_at_its_next_checkpoint_line():
    """A checkpoint is taken between two chunks, never inside a forward: a session's run in a batch
    stops at the line it was told (`update(mark=...)`), and the next session's chunks follow."""
    s = scheduler(chunk_s=0.001, batch=8, batch_s=1.0)
    s.update("a", 0, 6 * G, now=0.0, mark=2 * G)
    s.update("b", 0, 6 * G, now=1.0)
    read = s.next_read(2.0)
    assert [(read.session, read.depth), *read.others] == [("a", 0), ("a", G), *(("b", k * G) for k in range(6))]
    s.read_done(read, 8, 0.008, 2.008)
    s.update("a", 2 * G, 6 * G, now=2.008)  # the line reached: no mark past it
    read = s.next_read(2.2)
    assert [(read.session, read.depth), *read.others][:4] == [("a", 2 * G), ("a", 3 * G), ("a", 4 * G), ("a", 5 * G)]


def test_a_batch_is_cut_to_a_size_the_reader_has_graphs_for():
    from shadow.core.schedule import graphed_batch

    assert [graphed_batch(n) for n in range(1, 10)] == [1, 2, 2, 4, 4, 4, 4, 8, 8]
    assert graphed_batch(0) == 1


def test_in_the_share_a_batch_is_paid_whole_within_batch_s_and_waited_for():
    """With batches on, a share slice holds one batched read: the next sessions' chunks join while
    the batch's estimate stays within `batch_s`, and the budget pays for the whole batch before it
    is read (until then the answer is a Wait for that budget, not a single chunk). A size warmed
    at load (`warm_batch`) is estimated by its own cost."""
    s = scheduler(chunk_s=0.004, batch=8, batch_s=0.0125)
    for k in range(5):
        s.update(f"s{k}", 0, 3 * G, now=0.0)
    s.turn_started("t", "s0", 0.0)
    s.first_token("t", 1.0)
    wait = s.next_read(1.25, between_rounds=True)  # 5 ms of budget: one chunk, not the batch of two (8 ms)
    assert wait == Wait(pytest.approx(1.0 + 0.008 / 0.02))
    read = s.next_read(1.4, between_rounds=True)
    assert isinstance(read, Read) and read.window == "share" and read.batch == 2
    assert read.estimate_s == pytest.approx(0.008)
    s.read_done(read, 2, 0.006, 1.406)
    assert s.share_used == pytest.approx(0.006)
    s.warm_batch(4, 0, 0.010)  # four chunks in 10 ms, within 12.5: a batch of four
    read = s.next_read(2.0, between_rounds=True)  # 20 ms of budget less the 6 used
    assert read.batch == 4 and read.estimate_s == pytest.approx(0.010)
    assert [n for n, _ in ((read.session, 0), *read.others)] == ["s0", "s1", "s1", "s1"]  # s0's last chunk, then s1's run
    alone = scheduler(chunk_s=0.004)  # without batches: a chunk as soon as the budget pays for one
    for k in range(5):
        alone.update(f"s{k}", 0, 3 * G, now=0.0)
    alone.turn_started("t", "s0", 0.0)
    alone.first_token("t", 1.0)
    read = alone.next_read(1.25, between_rounds=True)
    assert isinstance(read, Read) and read.batch == 1 and read.chunks == 1
    lone = scheduler(chunk_s=0.004, batch=8)  # one session with a backlog: its run, paid whole
    lone.update("a", 0, 3 * G, now=0.0)
    lone.turn_started("t", "a", 0.0)
    lone.first_token("t", 1.0)
    assert lone.next_read(1.25, between_rounds=True) == Wait(pytest.approx(1.0 + 0.008 / 0.02))
    read = lone.next_read(1.4, between_rounds=True)
    assert read.batch == 2 and read.others == (("a", G),)
    single = scheduler(chunk_s=0.004, batch=8)  # a session with one whole chunk: a chunk a slice
    single.update("a", 0, G + 5, now=0.0)
    single.turn_started("t", "a", 0.0)
    single.first_token("t", 1.0)
    assert single.next_read(1.25, between_rounds=True).batch == 1


def test_known_costs_are_where_a_scheduler_starts_and_its_own_measures_replace_them():
    """Costs measured elsewhere seed the estimates at their depths (a deep chunk is estimated by
    its own depth, not the deepest the load measured); batch sizes the rule may not read are
    left out; a later warm or read replaces a bucket."""
    s = scheduler(chunk_s=None, batch=4)
    s.warm_known(KnownCosts(chunks=((0, 0.003), (65536, 0.006)), batches=((2, 0, 0.005), (8, 0, 0.016)), label="f"))
    assert s.costs.estimate(65536) == pytest.approx(0.006) and s.costs.estimate(100_000) == pytest.approx(0.006)
    assert sorted(s.batch_costs) == [2] and s.batch_estimate([0, 0]) == pytest.approx(0.005)
    s.costs.warm(0, 0.004)  # the load's own measure at depth 0
    assert s.costs.estimate(0) == pytest.approx(0.004) and s.costs.estimate(65536) == pytest.approx(0.006)


def test_a_share_batch_may_take_batch_read_s_in_all_its_pieces_each_within_batch_s():
    """With `batch_read_s` above `batch_s` the share grants a batch up to `batch_read_s` (its caller
    reads it in pieces of at most `batch_s` between rounds); the idle window keeps to `batch_s`."""
    def busy_scheduler(**rule):
        s = scheduler(chunk_s=0.004, batch=8, batch_s=0.010, **rule)
        for k in range(8):
            s.update(f"s{k}", 0, G + 1, now=0.0)
        s.turn_started("t", "s0", 0.0)
        s.first_token("t", 1.0)
        return s

    one_piece = busy_scheduler().next_read(10.0, between_rounds=True)
    assert one_piece.batch == 2 and one_piece.estimate_s == pytest.approx(0.008)  # 12 ms would pass 10
    pieces = busy_scheduler(batch_read_s=0.05).next_read(10.0, between_rounds=True)
    assert pieces.batch == 8 and pieces.estimate_s == pytest.approx(0.032)
    assert BandwidthRule(batch_read_s=0.05).share_batch_s == pytest.approx(0.05)
    assert BandwidthRule(batch_read_s=0.5).share_batch_s == pytest.approx(0.15)  # never past the slice
    idle = scheduler(chunk_s=0.004, batch=8, batch_s=0.010, batch_read_s=0.05)
    for k in range(8):
        idle.update(f"s{k}", 0, G + 1, now=0.0)
    assert idle.next_read(1.0).batch == 2


def test_while_the_share_is_busy_a_batch_short_of_full_waits_for_more_chunks():
    """`batch_wait_s`: a share whose reads of the last 10 s used at least `batch_busy` of that share,
    with less than `batch_bank_s` of budget left, holds a batch that could take more chunks for up
    to `batch_wait_s` from its oldest backlog; more chunks come, or the time is up, and it reads.
    Not busy, it reads at once."""
    rule = dict(chunk_s=0.004, batch=4, batch_s=1.0, batch_wait_s=1.0, batch_busy=0.5, busy_window_s=10.0,
                batch_bank_s=0.6)
    s = scheduler(**rule)
    s.turn_started("t", "x", 0.0)
    s.first_token("t", 0.0)
    s.update("a", 0, 2 * G + 1, now=100.0)  # two chunks of four
    assert not s.share_busy(100.0)
    read = s.next_read(100.0, between_rounds=True)
    assert read.batch == 2  # not busy: at once
    s.read_done(read, 2, 0.008, 100.0)
    busy(s, 100.0)
    assert s.share_busy(100.5)
    s.update("b", 0, G + 1, now=100.5)
    assert s.next_read(100.6, between_rounds=True) == Wait(pytest.approx(101.5))  # b's backlog since 100.5
    s.update("c", 0, 3 * G + 1, now=100.8)  # four chunks now: full, read at once
    read = s.next_read(100.9, between_rounds=True)
    assert read.batch == 4 and [n for n, _ in ((read.session, 0), *read.others)] == ["b", "c", "c", "c"]
    lone = scheduler(**rule)
    lone.turn_started("t", "x", 0.0)
    lone.first_token("t", 0.0)
    busy(lone, 100.0)
    lone.update("a", 0, G + 1, now=100.0)
    assert lone.next_read(100.2, between_rounds=True) == Wait(pytest.approx(101.0))
    read = lone.next_read(101.0, between_rounds=True)  # waited its second: read alone
    assert isinstance(read, Read) and read.batch == 1
    assert not lone.share_busy(111.0)  # the read has left the window
    rich = scheduler(**{**rule, "batch_bank_s": 0.001})  # a budget that holds more than the bank: at once
    rich.turn_started("t", "x", 0.0)
    rich.first_token("t", 0.0)
    busy(rich, 100.0)
    rich.update("a", 0, G + 1, now=100.0)
    assert isinstance(rich.next_read(100.2, between_rounds=True), Read)


def busy(s: ReadScheduler, at: float) -> None:
    """As if the share had read 1.5 s at `at` (ten seconds' 2 % is 0.2 s): its budget down to about
    0.5 s, its last 10 s well used."""
    s._share_reads.append((at, 1.5))
    s._share_used_recently += 1.5
    s.share_used += 1.5


def busy_stretch(rule: dict, turns: dict[str, bool]) -> ReadScheduler:
    """A busy share (`busy`) at 100 s with a turn in flight, decoding, on each of `turns`' sessions,
    told held or not; session "a" has one chunk to read from 100 s."""
    s = scheduler(**rule)
    for n, (name, held) in enumerate(turns.items()):
        s.turn_started(n, name, 0.0)
        s.update(name, 0, 10, now=0.0, held=held)
        s.first_token(n, 0.0)
    busy(s, 100.0)
    s.update("a", 0, G + 1, now=100.0)
    return s


def test_a_batch_waits_only_where_a_turn_in_flight_may_bring_chunks():
    """A busy share's batch short of full waits for more chunks only while some turn in flight may
    bring them: a session whose output is read as it streams. With every turn in flight on a held
    session (its output waits out of reading for its re-render), none can come before a turn ends,
    so the batch reads at once; the hold let go, it waits again, as does a turn whose prompt is
    still to come (a turn's start clears its session's `held`, its prompt told with it)."""
    rule = dict(chunk_s=0.004, batch=4, batch_s=1.0, batch_wait_s=1.0, batch_busy=0.5, busy_window_s=10.0,
                batch_bank_s=0.6)
    held = busy_stretch(rule, {"x": True, "y": True})
    assert not held.chunks_may_come()
    read = held.next_read(100.2, between_rounds=True)
    assert isinstance(read, Read) and read.session == "a" and read.batch == 1  # no wait for chunks that cannot come

    streaming = busy_stretch(rule, {"x": True, "y": False})  # y's output is read as it streams: as before
    assert streaming.chunks_may_come()
    assert streaming.next_read(100.2, between_rounds=True) == Wait(pytest.approx(101.0))
    assert isinstance(streaming.next_read(101.0, between_rounds=True), Read)  # waited its second

    let_go = busy_stretch(rule, {"x": True})
    assert isinstance(let_go.next_read(100.2, between_rounds=True), Read)
    let_go.update("x", 0, 10, now=100.3)  # the hold let go (a phrase must read it): its stream may bring chunks
    assert let_go.between_rounds_due(100.3)
    assert let_go.next_read(100.3, between_rounds=True) == Wait(pytest.approx(101.0))

    new_turn = busy_stretch(rule, {"x": True})
    new_turn.update("z", 0, 10, now=50.0, held=True)  # held at its last turn's prediction
    assert not new_turn.chunks_may_come()  # no turn of z in flight, x held
    new_turn.turn_started("next", "z", 100.1)  # z's next turn: its prompt is still to be fed
    assert new_turn.chunks_may_come()
    assert new_turn.next_read(100.2, between_rounds=True) == Wait(pytest.approx(101.0))
    new_turn.update("z", 0, 10, now=100.3, held=True)  # its prompt fed, its output held
    assert isinstance(new_turn.next_read(100.3, between_rounds=True), Read)
    unnamed = busy_stretch(rule, {"x": True})
    unnamed.turn_started("found later", None, 100.1)  # a proxy still finding its session from the prompt
    assert unnamed.chunks_may_come()


def test_a_share_read_charges_at_most_its_cost_at_load_under_the_alone_charge():
    """Beside an engine in another process, a read's own seconds hold the engine's work on the GPU
    too: `charge="alone"` charges the stretch the lesser of them and the cost kept at load."""
    for charge, want in (("wall", [0.03, 0.006, 0.02]), ("alone", [0.01, 0.006, 0.012])):
        s = scheduler(chunk_s=None, charge=charge)
        s.keep_alone([(0, 0.01), (8192, 0.02)], [(2, 8192, 0.012)])
        s.costs.warm(0, 0.5)  # a later measurement moves the estimate, not the cost kept at load
        s.update("a", 0, 100 * G, now=0.0)
        s.turn_started("t", "a", 0.0)
        s.first_token("t", 1.0)
        got = [s.read_done(Read("a", 1, "share", 0, 0.01), 1, 0.03, 2.0),  # contended: 3x its cost at load
               s.read_done(Read("a", 1, "share", G, 0.01), 1, 0.006, 2.1),  # faster than at load: its own seconds
               s.read_done(Read("a", 1, "share", 8192, 0.012, others=(("b", 8192),)), 2, 0.02, 2.2)]  # a batch of 2
        assert got == pytest.approx(want), charge
        assert s.share_used == pytest.approx(sum(want))
        assert s.read_done(Read("a", 1, "ask", 0, 0.01), 1, 0.03, 2.3) == 0.0  # an ask's read charges no share
        assert s.read_done(Read("a", 1, "idle", 0, 0.01), 1, 0.03, 2.4) == 0.0


def test_the_alone_charge_without_a_cost_at_load_charges_a_reads_own_seconds():
    s = scheduler(chunk_s=None, charge="alone")
    assert s.read_done(Read("a", 2, "share", 0, None), 2, 0.05, 1.0) == 0.05  # nothing kept at load
    s.costs.warm(0, 0.3)  # learned from reads: never kept
    s.keep_alone([(0, 0.01)])
    assert s.read_done(Read("a", 2, "share", 0, 0.02), 2, 0.05, 1.1) == pytest.approx(0.02)  # two chunks' costs
    # a batch of a size with no cost at load: its entries' chunk costs
    assert s.read_done(Read("a", 1, "share", 0, 0.02, others=(("b", G),)), 2, 0.05, 1.2) == pytest.approx(0.02)
    empty = scheduler(chunk_s=None, charge="alone")
    empty.keep_alone([])  # kept with no estimate at all
    assert empty.read_done(Read("a", 1, "share", 0, None), 1, 0.05, 1.0) == 0.05


def test_the_alone_charge_keeps_the_known_costs_where_the_load_measured_none():
    s = scheduler(chunk_s=None, charge="alone", batch=2)
    s.warm_known(KnownCosts(chunks=((0, 0.01), (65536, 0.04)), batches=((2, 65536, 0.05),)))
    s.keep_alone([(0, 0.008)])  # the load measured depth 0 again, nothing deeper
    assert s.read_done(Read("a", 1, "share", 0, 0.01), 1, 0.05, 1.0) == pytest.approx(0.008)
    assert s.read_done(Read("a", 1, "share", 65536, 0.04), 1, 0.05, 1.1) == pytest.approx(0.04)
    assert s.read_done(Read("a", 1, "share", 65536, 0.05, others=(("b", 65536),)), 2, 0.07, 1.2) == pytest.approx(0.05)


def test_the_alone_charge_sums_a_runs_chunks_by_depth_and_draws_a_line_past_the_deepest_kept():
    s = scheduler(chunk_s=None, charge="alone")
    s.keep_alone([(0, 0.01), (8192, 0.02), (32768, 0.03)])
    # two chunks from 7680: one in bucket 0, one in bucket 1 (8192 and up)
    assert s.read_done(Read("a", 2, "share", 7680, 0.03), 2, 0.5, 1.0) == pytest.approx(0.01 + 0.02)
    # past 32768 + 8192: the line through the two deepest kept (0.02 at bucket 1, 0.03 at bucket 4)
    assert s.read_done(Read("a", 1, "share", 131072, 0.05), 1, 0.5, 1.1) == pytest.approx(0.03 + (0.01 / 3) * 12)
    one = scheduler(chunk_s=None, charge="alone")
    one.keep_alone([(0, 0.01)])  # one depth kept: nothing known past it
    assert one.read_done(Read("a", 1, "share", 65536, 0.01), 1, 0.5, 1.0) == 0.5
    zero = scheduler(chunk_s=None, charge="alone")
    zero.keep_alone([(0, 0.0), (8192, 0.0)])  # a cost of 0 kept: unknown, not free
    assert zero.read_done(Read("a", 1, "share", 0, 0.0), 1, 0.5, 1.0) == 0.5


def test_a_second_load_keeps_its_own_costs_and_the_charge_is_what_the_busy_window_counts():
    s = scheduler(chunk_s=None, charge="alone")
    s.keep_alone([(0, 0.01)])
    s.keep_alone([(0, 0.02)])  # the model loaded again: the new load's costs
    s.update("a", 0, 100 * G, now=0.0)
    s.turn_started("t", "a", 0.0)
    s.first_token("t", 1.0)
    assert s.read_done(Read("a", 1, "share", 0, 0.02), 1, 0.5, 2.0) == pytest.approx(0.02)
    assert s._share_used_recently == pytest.approx(0.02) and s.share_used == pytest.approx(0.02)


def test_a_restarted_stretch_banks_no_share_and_keeps_the_decoded_seconds():
    s = scheduler(share=0.02)
    s.restart_stretch(1.0)  # no stretch: nothing to restart
    assert s.stretch_start is None and s.decoded_s(1.0) == 0.0
    s.turn_started("t", "a", 0.0)
    s.first_token("t", 0.0)
    assert s.share_left(10.0) == pytest.approx(0.2)  # 2 % of 10 s decoded
    s.restart_stretch(10.0)  # a shadow switched back on at 10 s: the share of the 10 s before is gone
    assert s.share_left(10.0) == 0.0 and s.share_left(15.0) == pytest.approx(0.1)
    assert s.decoded_s(15.0) == pytest.approx(15.0)  # the engine's decode seconds run on
    s.turn_ended("t", 20.0)
    assert s.stretch_start is None and s.decode_s == pytest.approx(20.0)
