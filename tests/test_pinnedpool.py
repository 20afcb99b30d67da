"""The pinned pool: memory filled ahead on its own thread, lent in aligned spans that come back when
their tensors are freed, bounded, and a host copy carved from it equal to the session bit for bit.
On the CPU the pool's memory is plain (`pin=False`); the GPU tests pin it."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from test_store import GRID, fed, fingerprint, assert_same

from shadow.core.hosttier import from_host, move_to_host
from shadow.core import pinnedpool
from shadow.core.pinnedpool import ALIGN, PinnedPool
from shadow.core.reader import Reader
from shadow.core.store import SessionStore

KIB = 1024
SLAB = 64 * KIB


@pytest.fixture()
def pool():
    p = PinnedPool(limit=4 * SLAB, ahead=2 * SLAB, slab_bytes=SLAB, pin=False)
    assert p.wait_filled(10)
    yield p
    p.close()


def test_the_pool_fills_ahead_on_its_own_thread_and_lends_aligned_disjoint_spans(pool):
    stats = pool.stats()
    assert (stats.slabs, stats.pinned_bytes, stats.free_bytes, stats.spans_lent) == (2, 2 * SLAB, 2 * SLAB, 0)
    a, b, c = pool.take([((3, 100), torch.bfloat16), ((7,), torch.float32), ((2, 5, 9), torch.int64)])
    assert (a.shape, a.dtype, b.shape, b.dtype, c.shape, c.dtype) == \
        ((3, 100), torch.bfloat16, (7,), torch.float32, (2, 5, 9), torch.int64)
    assert all(t.data_ptr() % ALIGN == 0 and t.is_contiguous() for t in (a, b, c))
    a.fill_(1.5), b.fill_(-2.0), c.fill_(7)
    assert (a == 1.5).all() and (b == -2.0).all() and (c == 7).all()  # no span overlaps another
    assert pool.stats().spans_lent == 3 and pool.stats().lent_bytes == 3 * ALIGN


def test_a_span_comes_back_when_its_tensor_and_every_view_of_it_are_freed(pool):
    (t,) = pool.take([((1000,), torch.float32)])
    view = t[10:20]
    del t
    gc.collect()
    assert pool.stats().spans_lent == 1  # the view still reads the span
    view.fill_(3.0)
    del view
    gc.collect()
    stats = pool.stats()
    assert stats.spans_lent == 0 and stats.free_bytes == stats.pinned_bytes
    # the freed runs merged back: the whole slab can be lent as one span again
    whole = pool.take([((SLAB,), torch.uint8)])
    assert whole is not None and whole[0].numel() == SLAB


def test_a_request_the_free_spans_cannot_hold_takes_nothing_and_the_thread_pins_for_it(pool):
    held = pool.take([((SLAB,), torch.uint8), ((SLAB,), torch.uint8)])  # both slabs lent
    assert held is not None
    before = pool.stats()
    assert pool.take([((SLAB // 2,), torch.uint8), ((3 * SLAB,), torch.uint8)]) is None
    after = pool.stats()
    assert after.fallbacks == before.fallbacks + 1 and after.spans_lent == 2  # none taken
    # a slab for the unmet tensor (3 slabs: 4 as a power of two) passes the limit (4, 2 pinned), so
    # the thread pins an ordinary one, as the free bytes (none) are below `ahead`
    assert pool.wait_filled(10)
    stats = pool.stats()
    assert stats.pinned_bytes == 4 * SLAB and stats.free_bytes == 2 * SLAB
    assert pool.take([((SLAB // 2,), torch.uint8)]) is not None


def test_the_pool_never_pins_past_its_limit_and_a_lent_out_pool_falls_back():
    p = PinnedPool(limit=3 * SLAB, ahead=10 * SLAB, slab_bytes=SLAB, pin=False)
    try:
        assert p.wait_filled(10)
        assert p.stats().pinned_bytes == 3 * SLAB  # ahead asked for ten: the limit allows three
        lent = [p.take([((SLAB,), torch.uint8)]) for _ in range(3)]
        assert all(x is not None for x in lent)
        assert p.take([((1,), torch.uint8)]) is None
        assert p.wait_filled(10) and p.stats().pinned_bytes == 3 * SLAB and p.stats().fallbacks == 1
    finally:
        p.close()


def test_an_unmet_request_gets_a_slab_of_its_size_where_the_limit_has_room():
    p = PinnedPool(limit=8 * SLAB, ahead=SLAB, slab_bytes=SLAB, pin=False)
    try:
        assert p.wait_filled(10)
        assert p.take([((3 * SLAB,), torch.uint8)]) is None  # larger than any slab
        assert p.wait_filled(10)
        got = p.take([((3 * SLAB,), torch.uint8)])  # a slab of its size pinned for it
        assert got is not None and p.stats().pinned_bytes == 4 * SLAB
    finally:
        p.close()


def test_the_pool_pins_nothing_while_a_copy_it_was_told_of_is_in_flight(pool, monkeypatch):
    monkeypatch.setattr(pinnedpool, "QUIET_WAIT_S", 30.0)  # the bound is not what this test is about
    with pool.quiet():
        held = pool.take([((SLAB,), torch.uint8), ((SLAB,), torch.uint8)])  # both slabs lent: it wants two more
        assert held is not None
        time.sleep(0.3)
        assert pool.stats().slabs == 2
    assert pool.wait_filled(10) and pool.stats().slabs == 4
    assert pool.stats().quiet_seconds >= 0.2


def test_a_pool_closed_while_it_waits_for_a_copy_pins_nothing_more(pool, monkeypatch):
    monkeypatch.setattr(pinnedpool, "QUIET_WAIT_S", 30.0)
    with pool.quiet():
        held = pool.take([((SLAB,), torch.uint8), ((SLAB,), torch.uint8)])
        assert held is not None
        time.sleep(0.1)  # the thread waits for the copy
        pool.close()
    time.sleep(0.1)
    assert pool.stats().slabs == 2 and not pool._thread.is_alive()


def test_a_copy_in_flight_holds_the_pool_back_no_longer_than_its_bound(pool, monkeypatch):
    monkeypatch.setattr(pinnedpool, "QUIET_WAIT_S", 0.2)
    with pool.quiet():
        held = pool.take([((SLAB,), torch.uint8), ((SLAB,), torch.uint8)])
        assert held is not None and pool.wait_filled(10) and pool.stats().slabs == 4  # pinned in the block, after its bound
    assert 0.2 <= pool.stats().quiet_seconds < 5


def test_threads_taking_and_freeing_at_once_leave_the_pool_whole(pool):
    errors = []

    def churn(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        try:
            for _ in range(300):
                n = int(torch.randint(1, 20 * KIB, (1,), generator=g))
                got = pool.take([((n,), torch.uint8)])
                if got is not None:
                    got[0].fill_(seed)
                    assert bool((got[0] == seed).all())
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=churn, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    stats = pool.stats()
    assert not errors and stats.spans_lent == 0 and stats.free_bytes == stats.pinned_bytes <= pool.limit


class Cycle:
    """An object only the cycle collector frees (it refers to itself), with young garbage beside it
    so that collections come often, at any allocation, some inside the pool's own calls."""

    def __init__(self, tensor):
        self.self, self.tensor, self.junk = self, tensor, [[] for _ in range(3)]


def test_a_collection_on_any_thread_gives_spans_back_without_a_deadlock(pool):
    """A pool tensor in a reference cycle is freed by the cycle collector, which may run inside the
    pool's own calls (its lock held): the span comes back at the pool's next call, nothing hangs."""
    done = threading.Event()

    def churn() -> None:
        for _ in range(20000):
            got = pool.take([((16,), torch.float32)])
            Cycle(got and got[0])
        done.set()

    worker = threading.Thread(target=churn, daemon=True)
    worker.start()
    assert done.wait(120), "the pool hung"
    gc.collect()
    stats = pool.stats()
    assert stats.spans_lent == 0 and stats.free_bytes == stats.pinned_bytes


def test_a_pool_nobody_holds_is_let_go_with_its_thread_but_a_lent_span_keeps_its_memory():
    import weakref

    p = PinnedPool(limit=2 * SLAB, ahead=SLAB, slab_bytes=SLAB, pin=False)
    assert p.wait_filled(10)
    (t,) = p.take([((100,), torch.int64)])
    t.copy_(torch.arange(100))
    thread, ref = p._thread, weakref.ref(p)
    del p
    gc.collect()
    thread.join(5)
    assert ref() is None and not thread.is_alive()
    torch.zeros(SLAB // 8, dtype=torch.int64).fill_(-1)  # memory freed now would be handed out again
    assert torch.equal(t, torch.arange(100))  # the span's slab lives as long as the span


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        PinnedPool(limit=-1, ahead=0)
    with pytest.raises(ValueError):
        PinnedPool(limit=SLAB, ahead=0, slab_bytes=0)


def test_a_host_copy_carved_from_the_pool_moves_back_bit_for_bit(tiny):
    reader = Reader(tiny.model, GRID)
    store = SessionStore(reader, "h", cap_gib=None)
    a = fed(store, reader, "a", seed=3)
    before = fingerprint(a)
    p = PinnedPool(limit=64 << 20, ahead=32 << 20, slab_bytes=16 << 20, pin=False)
    try:
        assert p.wait_filled(10)
        move = move_to_host(a, pool=p)
        copy = move.copy
        lent = p.stats().spans_lent
        assert lent == len(a.state.tensors()) + 2 * len(a.checkpoints) and p.stats().fallbacks == 0
        back = from_host(copy, reader.model.new_state())
        assert_same(before, fingerprint(back))
        del move, copy, back  # (on the CPU the session back shares its checkpoints' memory with the copy)
        gc.collect()
        assert p.stats().spans_lent == 0  # the copy freed, its spans are the pool's again
    finally:
        p.close()


def test_a_store_off_a_gpu_has_no_pinned_pool(tiny, tmp_path):
    store = SessionStore(Reader(tiny.model, GRID), "h", cap_gib=0, host_cap_gib=1.0, disk=tmp_path)
    assert store.pinned is None and store.totals()["pinned"] is None


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_pin_ahead_not_finite_and_non_negative_is_refused(tiny, tmp_path, bad):
    with pytest.raises(ValueError, match="pin_ahead_gib"):
        SessionStore(Reader(tiny.model, GRID), "h", cap_gib=0, host_cap_gib=1.0, disk=tmp_path, pin_ahead_gib=bad)
    assert not any(tmp_path.iterdir())  # nothing made
