"""The live service drives the one read scheduler: the same timeline live and replayed reads the same
chunks of the same sessions at the same times; slow chunks never stop the reader; the first
streamed turn after a start never waits for a chunk read to measure its cost."""

from __future__ import annotations

from dataclasses import replace

import json
import math
import random
import threading
import time

import pytest

from serving import (GRID, assert_exact, long_text, running, service_for, serving, settings_for, settled,
                     wait_until_read)
from shadow.core.reader import open_reader
from shadow.core.schedule import BandwidthRule, ReadScheduler, Wait
from shadow.core.residency import RestoreRate, StateSize
from shadow.core.sessionfile import file_bytes
from shadow.core.store import SessionStore
from shadow.offline.ledger import Request
from shadow.offline.costs import ChunkTable, CostTable
from shadow.offline.limits import ReplayLimits
from shadow.offline.replay import readable, replay, time_readable
from shadow.server.generator import Generator
from shadow.server.host import Shadow
from shadow.server.http.app import ShadowApp
from shadow.server.service import ShadowService
from shadow.server.settings import PrefixCacheSettings
from shadow.text.tokenizer import load_tokenizer

CHUNK_S = 0.0625  # 1/16 s: every time in the timeline below is exact in binary, so both sides add alike
RULE = BandwidthRule(poll_s=0.25, burst_s=1.0, share=0.1, slice_s=0.15)
_START, _FIRST, _END = 0, 1, 2


class ReadLog:
    """Every read reported to a scheduler, replayed or live (both drive `ReadScheduler`: its
    `read_done` is traced, in one place)."""

    def __init__(self, monkeypatch):
        self.reads: list[tuple] = []
        done = ReadScheduler.read_done

        def traced(sched, read, chunks, seconds, now):
            if chunks:  # (seconds compared exactly: both sides add the same binary fractions)
                self.reads.append((read.session, read.window, read.depth, chunks, now, seconds))
            return done(sched, read, chunks, seconds, now)

        monkeypatch.setattr(ReadScheduler, "read_done", traced)

    def take(self) -> list[tuple]:
        """The reads logged since the last take."""
        reads, self.reads = self.reads, []
        return reads


@pytest.fixture
def read_log(monkeypatch) -> ReadLog:
    return ReadLog(monkeypatch)


def timeline(seed: int) -> list[Request]:
    """Three sessions of two or three turns each, overlapping one another on the engine; each prompt
    extends the session's last prompt and output (no rollback); times on a 1/32 s grid, decode
    rounds of 1/32 s."""
    rng = random.Random(seed)
    requests = []
    for session in "abc":
        t, prompt = rng.randrange(16, 160) / 32, 0
        for _ in range(rng.randrange(2, 4)):
            new, output = rng.randrange(50, 700), rng.randrange(8, 64)
            prompt += new
            first = t + rng.randrange(4, 40) / 32
            requests.append(Request(session, t, first, first + output / 32, prompt, new, output))
            prompt += output
            t = first + output / 32 + rng.randrange(1, 200) / 32
    return sorted(requests, key=lambda r: r.start)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class ChunkCost:
    """The reader's forward as the test's hook: a chunk costs CHUNK_S of the clock, and the driver's
    events that fall inside it fire at their times (as HTTP threads would, beside the device)."""

    def __init__(self, inner, clock: Clock):
        self.inner, self.clock, self.driver = inner, clock, None

    def __call__(self, ids, state):
        end = self.clock.t + CHUNK_S
        if self.driver is not None:
            self.driver.fire(end, inclusive=False, mid_chunk=True)
        self.clock.t = end
        return self.inner(ids, state)


class LiveDriver:
    """The timeline's engine beside a live `ShadowService`, on an injected clock, stepped the way
    the replay steps its engine: events at their times (those that fall inside a chunk fire
    inside it, from the chunk-cost hook, as HTTP threads would, beside the device), the device's
    work they cause done once the device is free, first come first served (a prompt fed; a turn's
    end: its output fed, then `end_turn`), the decoded output as it comes, and at each step the
    service's idle look or, between decode rounds, its share slice; until the last event's work
    is done."""

    def __init__(self, service: ShadowService, clock: Clock, requests: list[Request], ids: list[tuple[list, list]]):
        self.service, self.clock, self.requests, self.ids = service, clock, requests, ids
        self.events = sorted([(r.start, _START, i) for i, r in enumerate(requests)]
                             + [(r.first_token, _FIRST, i) for i, r in enumerate(requests)]
                             + [(r.end, _END, i) for i, r in enumerate(requests)])
        self.next_event = 0
        self.turns: dict[int, object] = {}  # request -> its turn's record
        self.fed: dict[int, int] = {}  # request -> output ids fed
        self.jobs: list[tuple[str, int]] = []  # device work waiting for the device
        self.decoding: dict[int, Request] = {}
        self.shares: list[tuple[str, str]] = []  # (the session of the turn that asked, the session read)
        self.mid_chunk: list[int] = []  # kinds of the events that fired inside a chunk
        self.lock_free = -math.inf  # when the service's lock was last let go after a restore or spill

    def fire(self, t: float, inclusive: bool, mid_chunk: bool = False) -> None:
        while self.next_event < len(self.events):
            when, kind, i = self.events[self.next_event]
            if when > t or (when == t and not inclusive):
                return
            self.next_event += 1
            self.clock.t = max(when, self.lock_free)  # one that came while the lock was held waited for it
            self.handle(kind, i, mid_chunk)

    def handle(self, kind: int, i: int, mid_chunk: bool) -> None:
        r, service = self.requests[i], self.service
        if mid_chunk:
            self.mid_chunk.append(kind)
        if kind == _START:
            turn = self.turns[i] = service.begin_turn(r.session)
            service.name_turn(turn, self.ids[i][0])  # its session is known at once (a request header)
            self.jobs.append(("prompt", i))
        elif kind == _FIRST:
            service.first_token(self.turns[i])
            if r.end > r.first_token:
                self.decoding[i] = r
        else:
            self.decoding.pop(i, None)
            self.jobs.append(("finish", i))

    def job(self, kind: str, i: int) -> None:
        if kind == "prompt":
            self.service.set_prompt(self.turns[i], self.ids[i][0])
            self.fed[i] = 0
        else:
            self.output(i, self.requests[i].output_tokens)
            self.service.end_turn(self.turns[i])

    def output(self, i: int, upto: int) -> None:
        if upto > self.fed.get(i, upto):
            self.service.add_output(self.turns[i], self.ids[i][1][self.fed[i]:upto])
            self.fed[i] = upto

    def round_s(self) -> float:
        return min(((r.end - r.first_token) / r.output_tokens for r in self.decoding.values() if r.output_tokens),
                   default=0.0)

    def run(self) -> None:
        service, next_round = self.service, -math.inf
        while True:
            t = self.clock.t
            self.fire(t, inclusive=True)
            self.clock.t = t
            if self.jobs:
                self.job(*self.jobs.pop(0))
                continue
            if self.next_event >= len(self.events):  # the timeline is over
                return
            for i, r in self.decoding.items():
                self.output(i, readable(r, t) - r.prompt_tokens)
                if self.clock.t != t:  # a restore took the device: what came meanwhile first
                    break
            if self.clock.t != t:
                continue
            if self.decoding and t >= next_round:
                turn = next(iter(self.decoding))
                service.share_slice(self.turns[turn])
                decision = service.reading.last
                if not isinstance(decision, Wait):
                    self.shares.append((self.requests[turn].session, decision.session))
                    next_round = self.clock.t + self.round_s()
                    continue
            elif self.decoding:
                decision = Wait(math.inf)  # busy, and not between two rounds
            else:
                decision = service.reading.idle_once()
                if not isinstance(decision, Wait):
                    continue
            wake = [decision.until]
            if self.next_event < len(self.events):
                wake.append(self.events[self.next_event][0])
            if self.decoding and next_round > t:
                wake.append(next_round)
            for i, r in self.decoding.items():
                if i in self.fed:
                    known = readable(r, t)
                    wake.append(time_readable(r, (known // GRID + 1) * GRID))
            nxt = min(wake)
            if nxt == math.inf:
                return
            self.clock.t = max(nxt, math.nextafter(t, math.inf))


def live_reads(requests: list[Request], store_for, read_log: ReadLog, on_driver=lambda driver: None
               ) -> tuple[list, ShadowService, LiveDriver]:
    """Every read the live service reports over the timeline (its store from `store_for(reader,
    loaded, clock)`), the service (the caller stops it) and its driver (shown to `on_driver`)."""
    rng = random.Random(5)
    ids, last = [], {}
    for r in requests:
        prompt = last.get(r.session, []) + [rng.randrange(1000, 200000) for _ in range(r.new_prompt_tokens)]
        assert len(prompt) == r.prompt_tokens
        output = [rng.randrange(1000, 200000) for _ in range(r.output_tokens)]
        ids.append((prompt, output))
        last[r.session] = prompt + output
    clock = Clock()
    loaded, reader = open_reader("tiny", grid=GRID)
    hook = ChunkCost(reader.forward, clock)
    reader.forward = hook
    # restores at the prompt's feed and no prefix cache, as the replay's defaults (the replay's model of the
    # prefix cache against the live one: tests/test_prefix_cache.py)
    settings = settings_for(rule=RULE, prefix_match=False, prefix=PrefixCacheSettings(on=False))
    settings = replace(settings, store=replace(settings.store, restore_ahead=False))
    service = service_for(settings, reader, store_for(reader, loaded, clock),
                          clock=clock)
    read_log.take()
    assert service.reading.sched.costs.table() == {0: CHUNK_S, 8192: CHUNK_S, 32768: CHUNK_S}  # warmed at load
    clock.t = 0.0
    hook.driver = driver = LiveDriver(service, clock, requests, ids)
    on_driver(driver)
    try:
        driver.run()
    except BaseException:
        service.stop()
        raise
    hook.driver = None
    return read_log.take(), service, driver


@pytest.mark.parametrize("seed", [4, 9, 21])  # timelines where a start, a first token or an end comes mid-chunk
def test_live_and_replayed_read_the_same_chunks_of_the_same_sessions_at_the_same_times(tiny, read_log, seed):
    """The replay and a live service (injected clock, chunk costs and the engine's events from a
    hook) over one timeline: every read (session, window, depth, chunks, end, seconds) the same."""
    requests = timeline(seed)
    arm = replay(requests, read_ms_per_1k=CHUNK_S * 1e6 / GRID, grid=GRID, rule=RULE)
    replayed = read_log.take()
    live, service, driver = live_reads(requests, lambda reader, loaded, clock: SessionStore(
        reader, loaded.weights_hash, cap_gib=None), read_log)
    try:
        assert live == replayed
        windows = {w for _, w, *_ in live}
        assert windows == {"idle", "share"} and len({s for s, *_ in live}) == 3
        assert any(asked != read for asked, read in driver.shares)  # a share read another session than the turn's
        assert driver.mid_chunk  # an engine event came while a chunk was read
        counters = service.status()["counters"]
        assert (counters["chunks_idle"], counters["chunks_share"]) == (arm.chunks_idle, arm.chunks_share)
        assert_exact(service, "a")
    finally:
        service.stop()


def test_a_live_share_read_twice_as_slow_as_at_load_charges_its_cost_at_load_under_the_alone_charge(
        tiny, read_log, monkeypatch):
    """`--share-charge alone`: chunks that take twice the cost measured at load (an engine in another
    process beside them) charge the decode stretches that cost; status and /metrics keep the
    reads' own seconds apart (`share_read_s`, `read_seconds{window="share"}`)."""
    import sys

    module, base = sys.modules[__name__], CHUNK_S
    monkeypatch.setattr(module, "RULE", replace(RULE, charge="alone"))
    slow = lambda driver: monkeypatch.setattr(module, "CHUNK_S", 2 * base)  # after the load's measurements
    live, service, _ = live_reads(timeline(4), lambda reader, loaded, clock: SessionStore(
        reader, loaded.weights_hash, cap_gib=None), read_log, on_driver=slow)
    try:
        share = [r for r in live if r[1] == "share"]
        assert share and all(seconds == 2 * base * chunks for *_, chunks, _, seconds in share)
        counters = service.status()["counters"]
        assert counters["share_read_s"] == pytest.approx(2 * base * counters["chunks_share"])
        assert counters["share_s"] == pytest.approx(base * counters["chunks_share"])  # the load's cost a chunk
        reading = service.status()["reading"]  # the costs kept at load, apart from those the reads taught
        kept = [ms for ms in reading["charge_ms_by_depth"].values()]
        assert kept and all(ms == pytest.approx(base * 1000) for ms in kept)
        assert any(ms > 1.2 * base * 1000 for ms in reading["chunk_ms_by_depth"].values())  # the reads taught more
        from prometheus_client.parser import text_string_to_metric_families

        from shadow.server.metrics import Metrics
        from shadow.server.timings import Histogram

        text = Metrics(service, Histogram((0.1,))).render()[0].decode()
        samples = {(m.name, m.labels.get("window")): m.value for f in text_string_to_metric_families(text) for m in f.samples}
        assert samples[("shadow_share_charged_seconds_total", None)] == pytest.approx(counters["share_s"])
        assert samples[("shadow_read_seconds_total", "share")] == pytest.approx(counters["share_read_s"])
    finally:
        service.stop()


class TimedStore:
    """The store's restores and writes as the test's hook: each costs the cost table's seconds of
    its file's bytes on the clock, under the service's lock (what happens meanwhile waits for
    it), but a prompt's restore, read before the lock; the restore rate it learns is the table's.
    A session back from its copy while its file is written behind is charged as a restore (the
    replay knows no write's timing); the writes behind take no time on this clock (no device time)."""

    def __init__(self, store: SessionStore, costs: CostTable, clock: Clock):
        self.store, self.costs, self.clock, self.driver = store, costs, clock, None
        self.restore, self.write, self.ahead = store._restore, store._write, store.restore_ahead
        self.staged = store._from_staged
        store._restore, store._write, store.restore_ahead = self._restore, self._write, self._restore_ahead
        store._from_staged = self._from_staged
        rate = store.restore_rate
        store.restore_rate.observe = lambda nbytes, seconds: RestoreRate.observe(rate, nbytes, costs.restore_s(nbytes))

    def _spend(self, seconds: float, locked: bool = True) -> None:
        self.clock.t += seconds
        if locked:
            self.driver.lock_free = self.clock.t

    def _restore_ahead(self, name):  # a prompt's restore: before the service takes its lock
        restored = self.ahead(name)
        if restored is not None:
            self._spend(self.costs.restore_s(file_bytes(restored.session)), locked=False)
        return restored

    def _restore(self, name):
        session = self.restore(name)
        if session is not None:
            self._spend(self.costs.restore_s(file_bytes(session)))
        return session

    def _from_staged(self, name):  # a session whose file is still being written: restored from its copy, as a restore
        session = self.staged(name)
        if session is not None:
            self._spend(self.costs.restore_s(file_bytes(session)))
        return session

    def _write(self, session):
        error = self.write(session)
        if error is None:
            self._spend(self.costs.spill_s(file_bytes(session)))
        return error


@pytest.mark.slow
def test_live_and_replayed_spill_and_restore_at_the_same_costs(tiny, read_log, tmp_path):
    """With restores and spills that take time (1 and 2 MiB/s of their files' bytes, so that
    restoring a shallow session is slower than reading it again: it is spilled all the same),
    every read, spill and restore is the same live and replayed."""
    size = StateSize.of(tiny.model.config, 4)
    cap_gib = (size.resident(8192, 0) + 20 * size.checkpoint) / 2**30
    costs = CostTable(ChunkTable.flat(CHUNK_S * 1e6 / GRID, GRID), restore_gib_s=1 / 1024, spill_gib_s=2 / 1024)
    seen = [0, 0]
    for seed in (4, 9, 21):
        requests = timeline(seed)
        read_log.take()
        arm = replay(requests, grid=GRID, rule=RULE, limits=ReplayLimits(cap_gib=cap_gib, state=size, disk=True), costs=costs)
        replayed, timed = read_log.take(), []

        def store_for(reader, loaded, clock):
            store = SessionStore(reader, loaded.weights_hash, cap_gib=cap_gib, disk=tmp_path / f"disk{seed}")
            timed.append(TimedStore(store, costs, clock))
            return store

        live, service, _ = live_reads(requests, store_for, read_log, lambda driver: setattr(timed[0], "driver", driver))
        try:
            c = timed[0].store.counters
            assert (arm.spills, arm.restores, arm.drops) == (c.spills, c.restores, c.drops)
            seen[0] += c.restores
            seen[1] += c.spills
            assert live == replayed
        finally:
            service.stop()
    assert min(seen) > 0  # sessions were spilled and restored


def live_under_a_cap(requests, read_log, **store_options):
    """`live_reads` through a store of `store_options`: (the reads, the service, the store)."""
    stores = []

    def store_for(reader, loaded, clock):
        store = SessionStore(reader, loaded.weights_hash, **store_options)
        stores.append(store)
        return store

    live, service, _ = live_reads(requests, store_for, read_log)
    return live, service, stores[0]


@pytest.mark.parametrize("disk", [False, True], ids=["drop", "spill"])
@pytest.mark.parametrize("seed", [4, 9, 21])
def test_live_and_replayed_read_the_same_chunks_under_a_cap_that_forces_spills(tiny, read_log, tmp_path, seed, disk):
    """The same, with a resident cap that holds one read session: at every turn's end and after
    every idle chunk, sessions past it leave memory, least recently used first; without a disk
    they are dropped (read again from the start at their next turn; output that comes for one
    meanwhile is not fed), with one they are spilled and restored when fed again. The replay
    models the store from the sessions' state sizes: the same sessions leave at the same
    settles, and every read is the same. (Spills and restores take no time on this clock; the
    store's choice to drop a session cheaper to read again is off, its restore rate unknown.)"""
    requests = timeline(seed)
    size = StateSize.of(tiny.model.config, 4)
    cap_gib = (size.resident(8192, 0) + 20 * size.checkpoint) / 2**30  # one read session and a few unread
    limits = ReplayLimits(cap_gib=cap_gib, state=size, disk=disk)
    arm = replay(requests, grid=GRID, rule=RULE, limits=limits,
                 costs=CostTable(ChunkTable.flat(CHUNK_S * 1e6 / GRID, GRID), restore_gib_s=math.inf,
                                 spill_gib_s=math.inf))
    replayed = read_log.take()
    live, service, store = live_under_a_cap(requests, read_log, cap_gib=cap_gib, disk=tmp_path / "disk" if disk else None)
    try:
        c = store.counters
        assert (arm.spills, arm.restores, arm.drops) == (c.spills, c.restores, c.drops)
        assert (c.spills if disk else c.drops) > 3 and (c.restores > 0) == disk  # the cap bit
        assert live == replayed
        counters = service.status()["counters"]
        assert (counters["chunks_idle"], counters["chunks_share"]) == (arm.chunks_idle, arm.chunks_share)
        for name in "abc":
            if store.holds(name):
                assert_exact(service, name)
    finally:
        service.stop()


@pytest.mark.parametrize("disk", [False, True], ids=["drop", "spill"])
@pytest.mark.parametrize("seed", [4, 9, 21])
def test_live_and_replayed_moves_through_the_host_tier_read_the_same_chunks(tiny, read_log, tmp_path, seed, disk):
    """The same cap, with a host tier below it that holds about one read session: sessions past
    the cap move to host memory, the tier's oldest copies leave for disk (or are dropped) when a
    new one needs its room, and a session fed again comes back from wherever it is. The replay
    moves the same sessions at the same settles (moves charged nothing on this clock), and every
    read is the same."""
    requests = timeline(seed)
    size = StateSize.of(tiny.model.config, 4)
    cap_gib = (size.resident(8192, 0) + 20 * size.checkpoint) / 2**30
    host_gib = 150_000 / 2**30  # about one of these sessions in host memory
    limits = ReplayLimits(cap_gib=cap_gib, state=size, disk=disk, host_cap_gib=host_gib)
    arm = replay(requests, grid=GRID, rule=RULE, limits=limits,
                 costs=CostTable(ChunkTable.flat(CHUNK_S * 1e6 / GRID, GRID), restore_gib_s=math.inf,
                                 spill_gib_s=math.inf, host_gib_s=math.inf))
    replayed = read_log.take()
    live, service, store = live_under_a_cap(requests, read_log, cap_gib=cap_gib, disk=tmp_path / "disk" if disk else None,
                                            host_cap_gib=host_gib)
    try:
        c = store.counters
        assert (arm.to_host, arm.from_host, arm.spills, arm.restores, arm.drops) == \
            (c.to_host, c.from_host, c.spills, c.restores, c.drops)
        assert c.to_host > 3 and c.from_host > 0 and (c.host_to_disk if disk else c.drops) > 0  # the tier bit, and filled
        assert live == replayed
        for name in "abc":
            if store.holds(name):
                assert_exact(service, name)
    finally:
        service.stop()


class LooksLater:
    """Stands for a copy's CUDA event on the CPU (where every copy is whole at once): done only from
    the store's `LOOKS`-th look at it on (a look at each settle and `get`), so a move out is in
    flight across settles, as on a GPU."""

    LOOKS = 6

    def __init__(self):
        self.looks = 0

    def query(self) -> bool:
        self.looks += 1
        return self.looks >= self.LOOKS

    def synchronize(self) -> None:
        self.looks = self.LOOKS


@pytest.mark.parametrize("tiers", ["host-spill", "disk"])
def test_live_and_replayed_read_the_same_chunks_while_moves_out_are_in_flight(tiny, read_log, tmp_path, monkeypatch,
                                                                              tiers):
    """Moves out beside the reads: each session's copy out stays in flight until the store's second
    look (at a later settle or `get`), so sessions are moving across settles, and those fed again
    meanwhile stay on the device. Through the host tier to disk, and straight to disk (the copy
    then waits for its write behind). The replay, which knows no copy's timing,
    moves the same sessions out at the same settles and back when they are fed: the counts and
    every read are the same. (Without a disk, a dropped session's next read starts at the prefix
    cache's line live; that is the prefix cache's to model, not the moves'.)"""
    import shadow.core.hosttier as hosttier
    import shadow.core.store as store_module

    def in_flight(session, stream=None, pool=None):
        move = hosttier.move_to_host(session, stream, pool)
        move.event = LooksLater()
        return move

    monkeypatch.setattr(store_module, "move_to_host", in_flight)
    requests = timeline(9)
    size = StateSize.of(tiny.model.config, 4)
    cap_gib = (size.resident(8192, 0) + 20 * size.checkpoint) / 2**30
    host_gib = 150_000 / 2**30 if tiers == "host-spill" else None
    limits = ReplayLimits(cap_gib=cap_gib, state=size, disk=True, host_cap_gib=host_gib)
    arm = replay(requests, grid=GRID, rule=RULE, limits=limits,
                 costs=CostTable(ChunkTable.flat(CHUNK_S * 1e6 / GRID, GRID), restore_gib_s=math.inf,
                                 spill_gib_s=math.inf, host_gib_s=math.inf))
    replayed = read_log.take()
    live, service, store = live_under_a_cap(requests, read_log, cap_gib=cap_gib, disk=tmp_path / "disk",
                                            host_cap_gib=host_gib)
    try:
        c = store.counters
        assert (arm.to_host, arm.from_host, arm.spills, arm.restores, arm.drops) == \
            (c.to_host, c.from_host, c.spills, c.restores, c.drops)
        assert c.moves_kept > 0 and c.to_host + c.spills > 3  # moves were in flight when their sessions came back
        assert live == replayed
        for name in "abc":
            if store.holds(name):
                assert_exact(service, name)
    finally:
        service.stop()


def test_a_turn_named_late_counts_as_running_from_then():
    sched = ReadScheduler(grid=4)
    sched.update("x", 0, 40, 0.0)
    sched.turn_started(1, None, 1.0)
    assert sched.busy and sched.next_read(1.0) == Wait(math.inf)
    sched.turn_session(1, "y", 2.0)
    sched.update("y", 0, 8, 2.0)
    sched.first_token(1, 3.0)
    read = sched.next_read(3.0 + 100, between_rounds=False)
    assert read == Wait(math.inf)
    sched.costs.warm(0, 0.01)
    read = sched.next_read(200.0, between_rounds=True)
    assert read.session == "y"  # the running turn's session first
    sched.turn_ended(1, 201.0)
    assert not sched.busy


class SlowFirst:
    """A reader's forward whose next `left` chunks each take `seconds` longer (a cold device)."""

    def __init__(self, inner, seconds: float):
        self.inner, self.seconds, self.left = inner, seconds, 0
        self.kinds: list[str | None] = []
        self.device = None

    def __call__(self, ids, state):
        if self.left > 0:
            self.left -= 1
            self.kinds.append(self.device.running if self.device else None)
            time.sleep(self.seconds)
        return self.inner(ids, state)


@pytest.mark.slow
def test_chunks_slower_than_a_burst_never_stop_the_idle_reader(tiny):
    """Three chunks after the start take longer than a whole idle burst: the reader reads them, one
    a burst, its estimate moves by at most a bounded factor for each, and it reads on to the end."""
    loaded, reader = open_reader("tiny", grid=GRID)
    slow = SlowFirst(reader.forward, 0.5)
    reader.forward = slow
    settings = settings_for(rule=BandwidthRule(burst_s=0.3), prefix_match=False)
    service = service_for(settings, reader, SessionStore(reader, loaded.weights_hash, cap_gib=None), loaded.weights_label)
    slow.device, slow.left = service.device, 3
    app = ShadowApp(settings, service, load_tokenizer(None), "tiny", generator=Generator(loaded.model)).app
    with serving(app) as client:
        r = client.post("/v1/chat/completions", headers={"x-session-id": "slow"},
                        json={"messages": [{"role": "user", "content": long_text(3, 900)}], "max_tokens": 2})
        assert r.status_code == 200
        wait_until_read(service, ["slow"])
        status = client.get("/v1/shadow/status").json()
    assert slow.left == 0 and slow.kinds == ["reader"] * 3  # the slow chunks were the idle reader's
    row = next(s for s in status["sessions"] if s["name"] == "slow")
    assert row["pending"] < GRID and status["counters"]["chunks_idle"] == row["committed"] // GRID
    assert status["idle_reader"]["alive"] and status["idle_reader"]["errors"] == 0
    assert status["reading"]["chunk_ms_by_depth"]["0"] < 500  # the estimate came back down


@pytest.mark.slow
def test_the_first_streamed_turn_after_a_start_never_waits_for_a_measuring_chunk(tiny):
    """A proxy beside a real engine on loopback, its shadow loading in the background. The first
    chunk its reader ever reads is slow (a cold device): it is read at load, left out of the
    estimates; the first streamed turn's share reads between deltas (a large share, so it reads)
    and no gap between the client's deltas comes near that chunk's cost."""
    from shadow.model.checkpoint import read_config, resolve_checkpoint

    cold_s = 2.0
    slow: list[SlowFirst] = []

    def load():
        _, reader = open_reader("tiny", grid=GRID)
        slow.append(SlowFirst(reader.forward, cold_s))
        slow[0].left, slow[0].device = 1, service.device
        reader.forward = slow[0]
        return Shadow(reader, SessionStore(reader, tiny.weights_hash, cap_gib=None), "random")

    with running() as (engine, _):
        settings = settings_for(str(engine.base_url).rstrip("/") + "/v1", rule=BandwidthRule(share=0.5), prefix_match=False)
        service = ShadowService(settings, load, read_config(resolve_checkpoint("tiny")))
        app = ShadowApp(settings, service, load_tokenizer(None), "upstream").app
        with serving(app) as proxy:
            deadline = time.time() + 60
            while not proxy.get("/v1/shadow/status").json()["ready"] and time.time() < deadline:
                time.sleep(0.05)
            assert service.ready.is_set() and slow[0].kinds == ["load"]  # the cold chunk: read at load
            body = {"messages": [{"role": "user", "content": long_text(40, 1200)}], "max_tokens": 96,
                    "ignore_eos": True, "stream": True}
            arrivals = []
            with proxy.stream("POST", "/v1/chat/completions", json=body, headers={"x-session-id": "first"}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.monotonic())
                        assert "choices" in json.loads(line[6:])
            settled(service)
            status = proxy.get("/v1/shadow/status").json()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert len(arrivals) > 90 and status["counters"]["chunks_share"] > 0  # the share read inside the stream
    assert max(gaps) < cold_s
    assert set(status["reading"]["chunk_ms_by_depth"]) == {"0", "8192", "32768"}
    assert all(ms < 1000 * cold_s / 4 for ms in status["reading"]["chunk_ms_by_depth"].values())


def test_status_shows_the_scheduler_and_the_idle_reader(tiny):
    with running() as (client, service):
        status = client.get("/v1/shadow/status").json()
        reading, idle = status["reading"], status["idle_reader"]
        assert set(reading["chunk_ms_by_depth"]) == {"0", "8192", "32768"} and reading["share_left_s"] == 0.0
        assert reading["busy"] is False and idle["alive"] is True and idle["errors"] == 0
        assert idle["state"] in ("caught up", "not started", "reading", "between bursts")


@pytest.mark.slow
def test_a_failing_idle_round_is_counted_shown_and_the_reader_goes_on(tiny):
    with running() as (client, service):
        broken = threading.Event()

        def fail_once():
            if not broken.is_set():
                broken.set()
                raise OSError("disk gone")

        service.reading.after_round = fail_once
        deadline = time.time() + 10
        while service.counters.idle_errors == 0 and time.time() < deadline:
            time.sleep(0.05)
        status = client.get("/v1/shadow/status").json()
        assert status["idle_reader"]["errors"] == 1 and "disk gone" in status["idle_reader"]["last_error"]
        r = client.post("/v1/chat/completions", headers={"x-session-id": "after"},
                        json={"messages": [{"role": "user", "content": long_text(9, 400)}], "max_tokens": 2})
        assert r.status_code == 200
        wait_until_read(service, ["after"])  # the idle reader went on
        assert client.get("/v1/shadow/status").json()["idle_reader"]["alive"] is True

