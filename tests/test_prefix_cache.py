"""The prefix cache: a session that starts at a cached grid line holds the state a fresh prefill of
its own ids gives, bit for bit (every tensor, `torch.equal`), whether it diverges from the cached
session mid-chunk or at a line, after evictions, after a rollback to the start, and when the lines
were stored by batched reads; the cache stays within its bytes, least recently used out first."""

from __future__ import annotations

import pytest
import torch

from shadow.core.prefixcache import PrefixCache, PrefixTrie, cache_for
from shadow.core.reader import Reader
from shadow.errors import ShadowInputError
from shadow.model.runtime import load_model
from shadow.offline.verify import compare_states

G = 512


@pytest.fixture(scope="module")
def model(shadow_cache):
    return load_model("tiny").model


def reader_with_cache(model, cap: int = 2**30) -> Reader:
    reader = Reader(model, G)
    reader.prefix_cache = PrefixCache(model, G, cap)
    return reader


def ids_of(seed: int, n: int) -> list[int]:
    return torch.randint(1000, 200000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_fresh(reader: Reader, session) -> None:
    """The session's state is bit-equal to a fresh prefill of its committed ids on the same grid."""
    fresh = reader.prefill(session.ids[: session.committed])
    compared, mismatched, _ = compare_states(session.state, fresh)
    assert compared > 0 and mismatched == [], mismatched
    assert session.state.length == fresh.length == session.committed


def read_all(reader: Reader, session) -> None:
    while reader.advance(session, max_chunks=1):
        pass


def test_a_session_diverging_mid_chunk_starts_at_the_shared_line_bit_equal(model):
    reader = reader_with_cache(model)
    shared = ids_of(1, 3 * G + 200)
    a = reader.new_session("a")
    assert reader.feed_prompt(a, shared + ids_of(2, 2 * G)).cached == 0
    read_all(reader, a)
    b = reader.new_session("b")
    feed = reader.feed_prompt(b, shared + ids_of(3, 2 * G))
    assert feed.cached == 3 * G and b.committed == 3 * G
    assert_fresh(reader, b)
    read_all(reader, b)
    assert b.committed == len(b.ids) // G * G and [c.position for c in b.checkpoints] == [b.committed]
    assert_fresh(reader, b)
    status = reader.prefix_cache.status()
    assert (status["hits"], status["misses"], status["tokens_saved"]) == (1, 1, 3 * G)


def test_a_session_diverging_at_a_line_starts_there_and_a_prompt_of_whole_shared_chunks_at_its_end(model):
    reader = reader_with_cache(model)
    shared = ids_of(4, 4 * G)
    a = reader.new_session("a")
    reader.feed_prompt(a, shared + ids_of(5, G + 10))
    read_all(reader, a)
    b = reader.new_session("b")
    assert reader.feed_prompt(b, shared + ids_of(6, 100)).cached == 4 * G
    assert_fresh(reader, b)
    assert [c.position for c in b.checkpoints] == [4 * G]  # its prompt's line, taken at the start
    c = reader.new_session("c")
    assert reader.feed_prompt(c, shared[: 2 * G + 5]).cached == 2 * G  # a shorter prompt: its own last line
    assert_fresh(reader, c)
    d = reader.new_session("d")
    assert reader.feed_prompt(d, ids_of(7, 3 * G)).cached == 0 and d.committed == 0


def test_after_evictions_a_session_starts_at_what_is_left_and_is_bit_equal(model):
    """A cap of three lines: the first session stores two (half the cap), the second starts at
    line 2 and stores 3 and 4, pushing states out; the third starts where a state is left."""
    probe = reader_with_cache(model)
    a = probe.new_session("a")
    probe.feed_prompt(a, ids_of(8, 6 * G))
    probe.advance(a, max_chunks=1)
    one_line = probe.prefix_cache.status()["bytes"]
    reader = reader_with_cache(model, cap=3 * one_line)  # three lines' KV rows and states
    shared = ids_of(8, 6 * G)
    a = reader.new_session("a")
    reader.feed_prompt(a, shared + ids_of(9, 50))
    read_all(reader, a)
    assert reader.prefix_cache.status()["lines"] == 2 and a.prefix.stored == 2 * one_line
    b = reader.new_session("b")
    assert reader.feed_prompt(b, shared + ids_of(10, 50)).cached == 2 * G
    assert_fresh(reader, b)
    read_all(reader, b)
    assert_fresh(reader, b)
    status = reader.prefix_cache.status()
    assert status["bytes"] <= 3 * one_line and status["evictions"] > 0
    c = reader.new_session("c")
    line = reader.feed_prompt(c, shared + ids_of(11, 50)).cached
    assert 0 < line <= 4 * G
    assert_fresh(reader, c)
    read_all(reader, c)
    assert_fresh(reader, c)


def test_a_rollback_to_the_start_starts_at_the_sessions_own_cached_line(model):
    reader = reader_with_cache(model)
    first = ids_of(11, 4 * G + 30)
    a = reader.new_session("a")
    reader.feed_prompt(a, first)
    read_all(reader, a)
    assert [c.position for c in a.checkpoints] == [4 * G]
    second = first[: 2 * G + 10] + ids_of(12, 3 * G)  # differs below its only checkpoint
    feed = reader.feed_prompt(a, second)
    assert feed.rolled_back_to == 2 * G and feed.cached == 2 * G and feed.reread == 2 * G
    assert_fresh(reader, a)
    read_all(reader, a)
    assert_fresh(reader, a)


@pytest.mark.parametrize("b", [2, 3, 4, 8])
def test_lines_stored_by_batched_runs_start_later_sessions_bit_equal(model, b):
    """The first session is read in runs of two chunks beside others (lines stored at each run's
    end: 2, 4, 6); the second shares five chunks, starts at line 4, finds chunk 5 cached without a
    state and marks its line, so its own read stops there and stores it; the third starts at 5."""
    reader = reader_with_cache(model)
    shared = ids_of(20 + b, 5 * G)
    a = reader.new_session("a")
    reader.feed_prompt(a, shared + ids_of(30 + b, G + 7))
    others = [reader.new_session(f"o{k}") for k in range(b - 2)]
    for k, s in enumerate(others):
        reader.feed_prompt(s, ids_of(40 + k, 4 * G))
    for _ in range(3):
        assert reader.advance_batch([a, a, *others]) == b
    assert a.committed == 6 * G
    assert_fresh(reader, a)
    second = reader.new_session("second")
    assert reader.feed_prompt(second, shared + ids_of(50 + b, 300)).cached == 4 * G
    assert 5 * G in second.marks and reader.run_limit(second) == 1
    assert_fresh(reader, second)
    assert reader.advance_batch([second, *others[:1]]) == min(2, b - 1)
    assert second.committed == 5 * G
    assert_fresh(reader, second)
    third = reader.new_session("third")
    assert reader.feed_prompt(third, shared + ids_of(60 + b, 300)).cached == 5 * G
    assert_fresh(reader, third)
    for s in others:
        assert_fresh(reader, s)


def test_sessions_started_from_the_cache_are_bit_equal_after_batched_reads_of_them(model):
    reader = reader_with_cache(model)
    shared = ids_of(70, 3 * G + 5)
    first = reader.new_session("first")
    reader.feed_prompt(first, shared + ids_of(71, G))
    read_all(reader, first)
    sessions = [reader.new_session(f"s{k}") for k in range(8)]
    for k, s in enumerate(sessions):
        assert reader.feed_prompt(s, shared + ids_of(80 + k, (k % 3 + 1) * G)).cached == 3 * G
    reader.advance_batch(sessions)
    for s in sessions:
        assert s.committed == 4 * G
        assert_fresh(reader, s)


def test_the_cache_stays_within_its_bytes_least_recently_used_out_first(model):
    probe = reader_with_cache(model)
    p = probe.new_session("p")
    probe.feed_prompt(p, ids_of(90, 2 * G))
    probe.advance(p, max_chunks=1)
    one_line = probe.prefix_cache.status()["bytes"]
    reader = reader_with_cache(model, cap=4 * one_line)
    prompts = [ids_of(100 + k, G + 3) for k in range(3)]
    for k, ids in enumerate(prompts):
        s = reader.new_session(f"s{k}")
        reader.feed_prompt(s, ids)
        read_all(reader, s)
    assert reader.prefix_cache.status()["lines"] == 3
    again = reader.new_session("again")
    assert reader.feed_prompt(again, prompts[0]).cached == G  # s0's line used again: now the most recent
    for k in range(3, 5):
        s = reader.new_session(f"s{k}")
        reader.feed_prompt(s, ids_of(100 + k, G + 3))
        read_all(reader, s)
        assert reader.prefix_cache.status()["bytes"] <= 4 * one_line
    status = reader.prefix_cache.status()
    assert status["lines"] == 4 and status["evictions"] == 1
    hits = [reader.feed_prompt(reader.new_session(f"q{k}"), ids).cached for k, ids in enumerate(prompts)]
    assert hits == [G, 0, G]  # s1 was the least recently used


def test_a_cache_of_no_bytes_keeps_nothing_and_changes_no_result(model):
    reader = reader_with_cache(model, cap=0)
    shared = ids_of(120, 2 * G)
    for name in ("a", "b"):
        s = reader.new_session(name)
        assert reader.feed_prompt(s, shared + ids_of(121, 10)).cached == 0
        read_all(reader, s)
        assert_fresh(reader, s)
    assert reader.prefix_cache.status()["bytes"] == 0


def test_bad_bounds_are_refused(model):
    for gib in (-1.0, float("nan")):
        with pytest.raises(ShadowInputError):
            cache_for(model, G, gib)
    with pytest.raises(ShadowInputError):
        PrefixTrie(G, -1)
    assert cache_for(model, G, 0) is None and cache_for(model, G, None) is None


def test_bad_ids_change_nothing_in_the_cache(model):
    reader = reader_with_cache(model)
    s = reader.new_session("s")
    reader.feed_prompt(s, ids_of(130, 2 * G))
    read_all(reader, s)
    before = reader.prefix_cache.status()
    t = reader.new_session("t")
    with pytest.raises(ShadowInputError):
        reader.feed_prompt(t, ids_of(130, 2 * G)[:-1] + [10**9])
    assert reader.prefix_cache.status() == before and t.ids == [] and t.committed == 0


def test_the_replays_model_of_the_cache_stores_hits_and_evicts_as_the_live_cache(model):
    """The same sessions (a shared prefix, then each one's own ids) through the live cache and the
    replay's model (`offline.prefixmodel`, sizes from the model's shapes): the same start line for
    every session and the same bytes, lines, hits, tokens saved and evictions."""
    from shadow.core.residency import StateSize
    from shadow.offline.costs import ChunkTable, CostTable
    from shadow.offline.modelled import ModelledStore
    from shadow.offline.prefixmodel import PrefixModel

    size = StateSize.of(model.config, model.new_state().arena.conv.element_size())
    cap = 7 * size.kv_row * G + 3 * size.delta
    reader = reader_with_cache(model, cap)
    modelled = ModelledStore(G, CostTable(ChunkTable.flat(1.0, G)), size=size)
    modelled.prefix = PrefixModel(G, cap, size, shared_tokens=3 * G + 100)
    shared = ids_of(140, 3 * G + 100)
    for k in range(6):
        prompt = shared + ids_of(150 + k, (k % 3 + 1) * G + 50)
        s = reader.new_session(f"s{k}")
        h, _ = modelled.get(f"s{k}")
        live, mod = reader.feed_prompt(s, prompt).cached, modelled.feed_prompt(h, len(prompt), 0).cached
        assert live == mod and (k == 0 or live > 0)
        read_all(reader, s)
        while h.committed + G <= h.ids:
            modelled.advance(h)
        assert s.committed == h.committed
        assert reader.prefix_cache.status() == modelled.prefix.status() | {"start_s": reader.prefix_cache.status()["start_s"]}
    assert reader.prefix_cache.status()["evictions"] > 0


def test_a_long_session_read_from_its_start_keeps_the_line_sessions_diverged_at(model):
    """A session stores at most half the cap; past the cap, the states of lines where no sessions
    diverged go before the line where they did, so a later session still starts there."""
    probe = reader_with_cache(model)
    p = probe.new_session("p")
    probe.feed_prompt(p, ids_of(160, 2 * G))
    probe.advance(p, max_chunks=1)
    one_line = probe.prefix_cache.status()["bytes"]
    reader = reader_with_cache(model, cap=8 * one_line)
    shared = ids_of(161, 2 * G)
    for k in range(2):  # two sessions diverge at line 2
        s = reader.new_session(f"s{k}")
        reader.feed_prompt(s, shared + ids_of(162 + k, G + 9))
        read_all(reader, s)
    long = reader.new_session("long")
    reader.feed_prompt(long, ids_of(170, 20 * G))
    read_all(reader, long)
    status = reader.prefix_cache.status()
    assert status["bytes"] <= 8 * one_line and long.prefix.stored <= 5 * one_line
    late = reader.new_session("late")
    assert reader.feed_prompt(late, shared + ids_of(180, 300)).cached == 2 * G
    assert_fresh(reader, late)


def _service(cache: bool):
    from shadow.core.reader import open_reader
    from shadow.core.store import SessionStore
    from shadow.server.host import Shadow
    from shadow.server.service import ShadowService
    from shadow.server.settings import ModelSettings, PrefixCacheSettings, ServeSettings, StoreSettings

    loaded, reader = open_reader("tiny", grid=G)
    store = SessionStore(reader, loaded.weights_hash, cap_gib=None, disk=None)
    settings = ServeSettings(model=ModelSettings("tiny", grid=G), store=StoreSettings(cap_gib=None, disk=None),
                             prefix=PrefixCacheSettings(on=cache, gib=0.5))
    return ShadowService(settings, Shadow(reader, store, "random"), reader.model.config)


def _turn(service, name: str, ids: list[int]) -> None:
    """A turn's prompt fed on the device thread, then its session read to its last whole chunk there."""
    turn = service.begin_turn(requested=name)
    service.run_request(lambda: service.set_prompt(turn, ids))
    service.end_turn(turn)

    def read() -> None:
        with service.state_lock:
            session = service.store.get(name)
        service.reader.advance(session)

    service.run_request(read)


def test_the_service_starts_sessions_at_the_cached_line_and_counts_it_in_status_and_metrics(shadow_cache):
    from shadow.server.metrics import Metrics
    from shadow.server.timings import REQUEST_SECONDS, Histogram

    shared = ids_of(190, 3 * G + 40)
    service = _service(cache=True)
    try:
        for k in range(3):
            _turn(service, f"s{k}", shared + ids_of(191 + k, G))
        cache = service.status()["prefix_cache"]
        assert (cache["hits"], cache["tokens_saved"], cache["cap_bytes"]) == (2, 6 * G, int(0.5 * 2**30))
        with service.device.hold(), service.state_lock:
            for k in range(3):
                assert_fresh(service.reader, service.store.get(f"s{k}"))
        text = Metrics(service, Histogram(REQUEST_SECONDS)).render()[0].decode()
        assert 'shadow_prefix_cache_hits_total{engine="embedded",model="tiny"} 2.0' in text
        assert f'shadow_prefix_cache_tokens_saved_total{{engine="embedded",model="tiny"}} {6 * G}.0' in text
        assert 'shadow_prefix_cache_bytes{engine="embedded",model="tiny"}' in text
    finally:
        service.stop()
    off = _service(cache=False)
    try:
        _turn(off, "s0", shared)
        assert off.status()["prefix_cache"] is None and off.reader.prefix_cache is None
        assert "shadow_prefix_cache" not in Metrics(off, Histogram(REQUEST_SECONDS)).render()[0].decode()
    finally:
        off.stop()


def test_a_prefix_cache_bound_that_is_no_positive_number_is_refused():
    from shadow.server.settings import PrefixCacheSettings, ServeSettings, check

    for gib in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ShadowInputError, match="--prefix-cache-gib"):
            check(ServeSettings(prefix=PrefixCacheSettings(gib=gib)))


@pytest.mark.skipif(not __import__("shadow.model.runtime", fromlist=["fast_available"]).fast_available(),
                    reason="needs CUDA and flash-linear-attention (fla-core)")
@pytest.mark.parametrize("kernels", ["fla-triton", "fla-fused"])
def test_on_cuda_sessions_started_from_the_cache_equal_their_graphed_prefill_bit_for_bit(kernels, tmp_path):
    """The fast path (bfloat16, piecewise CUDA graphs, batch graphs): lines stored by batched runs
    of two chunks beside another session, a second session started at line 4 that marks line 5 and
    stores it, a third started at 5, eight sessions started at 5 read in one batch: every state
    tensor bit-equal to a fresh prefill of its ids through the same graphed reader."""
    import dataclasses

    from shadow.model import ModelConfig, write_random_checkpoint
    from shadow.model.piecewise import PiecewiseForward

    config = ModelConfig(hidden_size=1024, num_hidden_layers=8, intermediate_size=1024, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                         linear_key_head_dim=128, linear_value_head_dim=128)
    config = dataclasses.replace(config, layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 2)
    folder = write_random_checkpoint(tmp_path / "eight", config, dtype=torch.bfloat16)
    cuda = load_model(str(folder), dtype=torch.bfloat16, device="cuda", kernels=kernels).model
    reader = Reader(cuda, G, forward=PiecewiseForward(cuda, sizes={G, 1, 64, 128, 256}, batches={2, 4, 8}))
    reader.prefix_cache = PrefixCache(cuda, G, 2**30)
    shared = ids_of(200, 5 * G)
    a, other = reader.new_session("a"), reader.new_session("other")
    reader.feed_prompt(a, shared + ids_of(201, G + 7))
    reader.feed_prompt(other, ids_of(202, 4 * G))
    for _ in range(3):
        assert reader.advance_batch([a, a, other]) == 3
    second = reader.new_session("second")
    assert reader.feed_prompt(second, shared + ids_of(203, 300)).cached == 4 * G and 5 * G in second.marks
    reader.advance_batch([second, other])
    third = reader.new_session("third")
    assert reader.feed_prompt(third, shared + ids_of(204, 300)).cached == 5 * G
    many = [reader.new_session(f"m{k}") for k in range(8)]
    for k, s in enumerate(many):
        assert reader.feed_prompt(s, shared + ids_of(210 + k, G + 5)).cached == 5 * G
    assert reader.advance_batch(many) == 8
    for s in (a, second, third, *many):
        fresh = reader.prefill(s.ids[: s.committed])
        compared, mismatched, _ = compare_states(s.state, fresh)
        assert compared > 0 and mismatched == [], (kernels, s.name, mismatched)


def test_a_session_back_from_the_host_tier_goes_on_storing_its_first_prompt(shadow_cache):
    from shadow.core.store import SessionStore

    loaded = load_model("tiny")
    reader = reader_with_cache(loaded.model)
    store = SessionStore(reader, loaded.weights_hash, cap_gib=1e-6, host_cap_gib=1.0)
    shared = ids_of(230, 4 * G)
    a = store.get("a")
    reader.feed_prompt(a, shared + ids_of(231, 40))
    reader.advance(a, max_chunks=2)
    store.get("b")
    store.settle(keep="b")  # "a" leaves the device for the host tier
    assert store.peek("a") is None and store.holds("a")
    a = store.get("a")
    assert a.committed == 2 * G
    read_all(reader, a)
    c = reader.new_session("c")
    assert reader.feed_prompt(c, shared + ids_of(232, 40)).cached == 4 * G
    assert_fresh(reader, c)
