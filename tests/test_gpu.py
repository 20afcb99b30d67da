"""The fast path on CUDA (skipped without a GPU and flash-linear-attention): fla kernels agree with
the reference kernels, and the piecewise-graphed reader keeps the exactness contract."""

from __future__ import annotations

import pytest
import torch

from shadow.model import ModelConfig, load_model, runtime, write_random_checkpoint
from shadow.model.kernels import attention, fla, reference, sets
from shadow.model.piecewise import PiecewiseForward
from shadow.core.reader import Reader
from shadow.offline.verify import compare_states

pytestmark = pytest.mark.skipif(not runtime.fast_available(), reason="needs CUDA and flash-linear-attention (fla-core)")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_fla_gdn_matches_reference_kernel():
    g = torch.Generator(device="cuda").manual_seed(0)
    t, hk, hv, dk, dv = 512, 4, 8, 128, 128
    q = torch.randn(t, hk, dk, device="cuda", generator=g).bfloat16()
    k = torch.randn(t, hk, dk, device="cuda", generator=g).bfloat16()
    v = torch.randn(t, hv, dv, device="cuda", generator=g).bfloat16()
    decay = -torch.rand(t, hv, device="cuda", generator=g) * 0.3
    beta = torch.rand(t, hv, device="cuda", generator=g).bfloat16()
    state = torch.randn(hv, dk, dv, device="cuda", generator=g) * 0.1
    out, new = fla.gdn_fla(q, k, v, decay, beta, state)
    ref_out, ref_new = reference.gdn_reference(q.double(), k.double(), v.double(), decay.double(), beta.double(), state.double())
    assert rel(out, ref_out) < 2e-2 and rel(new, ref_new) < 2e-2
    step_out, step_new = fla.gdn_fla(q[:1], k[:1], v[:1], decay[:1], beta[:1], state)
    ref_step, ref_step_new = reference.gdn_recurrent(
        reference.l2norm(q[:1].float().repeat_interleave(2, 1)) * dk ** -0.5, reference.l2norm(k[:1].float().repeat_interleave(2, 1)),
        v[:1], decay[:1], beta[:1], state)
    assert rel(step_out, ref_step) < 2e-2 and rel(step_new, ref_step_new) < 2e-2


def test_fla_gate_in_kernel_matches_the_reference_gate():
    g = torch.Generator(device="cuda").manual_seed(3)
    for t in (512, 1):
        q = torch.randn(t, 4, 128, device="cuda", generator=g).bfloat16()
        k = torch.randn(t, 4, 128, device="cuda", generator=g).bfloat16()
        v = torch.randn(t, 8, 128, device="cuda", generator=g).bfloat16()
        a, b = (torch.randn(t, 8, device="cuda", generator=g).bfloat16() for _ in range(2))
        a_log, dt_bias = torch.rand(8, device="cuda", generator=g), torch.rand(8, device="cuda", generator=g)
        state = torch.randn(8, 128, 128, device="cuda", generator=g) * 0.1
        out, new = fla.gdn_fla_gated(q, k, v, a, b, a_log, dt_bias, state)
        ref_out, ref_new = reference.gdn_gated_reference(q.double(), k.double(), v.double(), a.double(), b.double(),
                                                   a_log.double(), dt_bias.double(), state.double())
        assert rel(out, ref_out) < 2e-2 and rel(new, ref_new) < 2e-2, t


def test_fla_batched_rule_gives_each_session_its_bits_alone():
    """The 0.8B's GDN shapes (16 key and value heads of 128), B = 1 to 8 sessions' 512-row chunks
    in one call against one call each: outputs and states bit-equal, with the autotuning pinned."""
    runtime.pin_autotuning()
    g = torch.Generator(device="cuda").manual_seed(8)
    a_log, dt_bias = torch.rand(16, device="cuda", generator=g), torch.rand(16, device="cuda", generator=g)
    for b in (1, 2, 3, 4, 8):
        q, k, v = (torch.randn(b, 512, 16, 128, device="cuda", generator=g).bfloat16() for _ in range(3))
        gates, betas = (torch.randn(b, 512, 16, device="cuda", generator=g).bfloat16() for _ in range(2))
        states = torch.randn(b, 16, 128, 128, device="cuda", generator=g) * 0.1
        out, new = fla.gdn_fla_gated_batch(q, k, v, gates, betas, a_log, dt_bias, states)
        for j in range(b):
            alone, alone_new = fla.gdn_fla_gated(q[j], k[j], v[j], gates[j], betas[j], a_log, dt_bias, states[j])
            assert torch.equal(out[j], alone) and torch.equal(new[j], alone_new), (b, j)


def test_triton_kernels_match_their_twins_on_cuda():
    from shadow.model.kernels import triton as tri
    from shadow.model.kernels import twins as twin

    g = torch.Generator(device="cuda").manual_seed(4)
    for t in (1, 3, 512):
        proj = torch.randn(t, 8224 + 100, device="cuda", generator=g).bfloat16()[:, :8224]  # the 0.8B's in_proj
        state = torch.randn(6144, 3, device="cuda", generator=g).bfloat16()
        w = torch.randn(6144, 4, device="cuda", generator=g).bfloat16()
        got = tri.conv_split(proj, state, w, 2048, 2048, 16)
        for a, b in zip(got, twin.conv_split(proj, state, w, 2048, 2048, 16)):
            assert a.shape == b.shape and a.is_contiguous() and rel(a, b) < 1e-2
        assert torch.equal(torch.cat(got[3:6], -1), proj[:, 6144:])
    proj = torch.randn(3 * 512, 8224, device="cuda", generator=g).bfloat16()  # three sessions' rows, one launch
    states = torch.randn(3, 6144, 3, device="cuda", generator=g).bfloat16()
    stacked = tri.conv_split(proj, states, w, 2048, 2048, 16)
    for j in range(3):
        alone = tri.conv_split(proj[j * 512 : (j + 1) * 512], states[j], w, 2048, 2048, 16)
        assert all(torch.equal(x[j * 512 : (j + 1) * 512], y) for x, y in zip(stacked[:6], alone[:6]))
        assert torch.equal(stacked[6][j], alone[6])
    gu = torch.randn(512, 2 * 3584, device="cuda", generator=g).bfloat16()
    assert rel(tri.swiglu(gu), twin.swiglu(gu)) < 1e-2
    x = torch.randn(512, 8, 512, device="cuda", generator=g).bfloat16()[..., :256]
    args = (torch.rand(256, device="cuda", generator=g) + 0.5, torch.randn(512, 64, device="cuda", generator=g),
            torch.randn(512, 64, device="cuda", generator=g), 1e-6)
    assert rel(tri.norm_rope(x, *args), twin.norm_rope(x, *args)) < 1e-2
    for t in (1, 512):
        h, d = torch.randn(t, 1024, device="cuda", generator=g).bfloat16(), torch.randn(t, 1024, device="cuda", generator=g).bfloat16()
        weight = (torch.rand(1024, device="cuda", generator=g) + 0.5).bfloat16()
        total, normed = tri.add_rms_norm(h, d, weight, 1e-6)
        want_total, want_normed = twin.add_rms_norm(h, d, weight, 1e-6)
        assert torch.equal(total, want_total) and rel(normed, want_normed) < 1e-2
        assert torch.equal(tri.add_rms_norm(total, None, weight, 1e-6)[1], normed)  # a sum's norm = its norm alone
        proj = torch.randn(t, 8, 512, device="cuda", generator=g).bfloat16()
        attended = torch.randn(t, 8, 256, device="cuda", generator=g).bfloat16()
        assert rel(tri.gate_mul(attended, proj[..., 256:]), twin.gate_mul(attended, proj[..., 256:])) < 1e-2


@pytest.mark.parametrize("t", [1, 512, 4096])  # a decode step, a chunk over cached rows, a first chunk
def test_sdpa_attention_matches_reference_kernel(t):
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(8, t, 256, device="cuda", generator=g).bfloat16()
    k = torch.randn(2, 4096, 256, device="cuda", generator=g).bfloat16()
    v = torch.randn(2, 4096, 256, device="cuda", generator=g).bfloat16()
    out = attention.attention_sdpa(q, k, v, 256 ** -0.5)
    ref = reference.attention(q.float(), k.float(), v.float(), 256 ** -0.5)
    assert rel(out, ref) < 2e-2


@pytest.mark.parametrize("t, cached", [(512, 0), (512, 16384), (620, 41182), (17, 3000), (32, 100)])
def test_triton_chunk_attention_matches_reference_and_repeats_its_bits(t, cached):
    """The 0.8B's heads over the valid rows of a larger buffer, as in a session."""
    from shadow.model.kernels.triton_attention import chunk_attention

    g = torch.Generator(device="cuda").manual_seed(3)
    length = cached + t
    q = torch.randn(8, t, 256, device="cuda", generator=g).bfloat16()
    k = torch.randn(2, length + 4000, 256, device="cuda", generator=g).bfloat16()[:, :length]
    v = torch.randn(2, length + 4000, 256, device="cuda", generator=g).bfloat16()[:, :length]
    out = chunk_attention(q, k, v, 256 ** -0.5)
    ref = reference.attention(q.float(), k.float(), v.float(), 256 ** -0.5)
    assert out.shape == (t, 8, 256) and rel(out, ref) < 2e-2
    assert torch.equal(out, chunk_attention(q, k, v, 256 ** -0.5))


@pytest.mark.parametrize("depths", [[16384], [0, 4096, 30000, 512], [65536, 100, 20000, 8192, 0, 3000, 41182, 700]])
def test_chunk_attention_through_descriptors_gives_the_bits_of_plain_loads(depths):
    """Tensor-descriptor (TMA) loads of the key blocks against plain loads: the same values, so
    the same bits, alone and batched."""
    from shadow.model.kernels import triton_attention as ta

    if not ta.descriptors(torch.device("cuda")):
        pytest.skip("tensor descriptors need Hopper or later")
    g = torch.Generator(device="cuda").manual_seed(7)
    t = 512
    ks = [torch.randn(2, d + t + 1000, 256, device="cuda", generator=g).bfloat16() for d in depths]
    vs = [torch.randn(2, d + t + 1000, 256, device="cuda", generator=g).bfloat16() for d in depths]
    q = torch.randn(8, len(depths) * t, 256, device="cuda", generator=g).bfloat16()
    lengths = [d + t for d in depths]
    tma = ta.attend_sessions(q, ks, vs, lengths, 256 ** -0.5, tiles={**ta.TILES, "desc": True})
    plain = ta.attend_sessions(q, ks, vs, lengths, 256 ** -0.5, tiles={**ta.TILES, "desc": False})
    assert torch.equal(tma, plain)
    assert torch.equal(tma, ta.attend_sessions(q, ks, vs, lengths, 256 ** -0.5))  # the default on this GPU


def test_warmed_chunk_attention_compiles_nothing_at_any_later_length():
    """After `warm` for the fork and chunk row counts, launches at random depths (as asks and a
    phrase's pieces meet them) find every kernel compiled: no compile mid-stream."""
    from shadow.model.kernels import triton_attention as ta

    rows = [16, 32, 64, 128, 256, 512]
    ta.warm(8, 2, 256, rows, torch.bfloat16, torch.device("cuda"))

    def compiled() -> int:
        return sum(len(c[0]) for fn in (ta._attention_slice, ta._attention_merge) for c in fn.device_caches.values())

    before = compiled()
    g = torch.Generator().manual_seed(5)
    kv = torch.zeros(2, 30000, 256, dtype=torch.bfloat16, device="cuda")
    for _ in range(60):
        t = rows[int(torch.randint(len(rows), (1,), generator=g))]
        length = int(torch.randint(t, 30000, (1,), generator=g))
        q = torch.zeros(t, 8, 256, dtype=torch.bfloat16, device="cuda").transpose(0, 1)
        ta.chunk_attention(q, kv[:, :length], kv[:, :length], 256 ** -0.5)
    assert before > 0 and compiled() == before


@pytest.fixture(scope="module", params=[sets.FAST, sets.FUSED, sets.TRITON], ids=["fla", "fused", "triton"])
def tiny_cuda(request):
    return load_model("tiny", dtype=torch.bfloat16, device="cuda", kernels=request.param)


# the 0.8B's head shapes (GDN 16/16 x 128, attention 8/2 x 256) in two layers of width 1024
WIDE = ModelConfig(
    hidden_size=1024, num_hidden_layers=4, intermediate_size=1024, num_attention_heads=8,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
    linear_key_head_dim=128, linear_value_head_dim=128,
)


TINY_XFAIL = pytest.mark.xfail(
    reason="fla 0.6.0 at the tiny preset's 16-dim GDN heads: 12% off the reference on the H200 (2026-11-30); "
    "auto kernels keep tiny on the reference kernels", strict=False,
)


@pytest.mark.parametrize("kernels", [sets.FAST, sets.FUSED, sets.TRITON], ids=["fla", "fused", "triton"])
@pytest.mark.parametrize("config", [pytest.param("tiny", marks=TINY_XFAIL), "wide"])
def test_fast_forward_close_to_reference_on_the_same_rounded_weights(config, kernels, tmp_path):
    """The fla/SDPA forward in bfloat16 against the reference kernels in float32 on the same
    bfloat16-rounded weights (so only the kernels and the compute dtype differ)."""
    name = "tiny" if config == "tiny" else str(write_random_checkpoint(tmp_path / "wide", WIDE, dtype=torch.bfloat16))
    fast_model = load_model(name, dtype=torch.bfloat16, device="cuda", kernels=kernels).model
    ref_model = load_model(name, dtype=torch.bfloat16, device="cuda", kernels=reference.REFERENCE).model.float()
    ids = torch.randint(0, 248044, (512,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    a = fast_model.logits(fast_model(ids, fast_model.new_state()))
    b = ref_model.logits(ref_model(ids, ref_model.new_state()))
    assert rel(a, b) < 3e-2, f"{config}: relative error {rel(a, b):.4f}"


def test_graphed_reader_is_exact_after_turns_rollback_and_forks(tiny_cuda):
    model = tiny_cuda.model
    reader = Reader(model, 512, forward=PiecewiseForward(model, sizes={512, 1, 64, 128, 256}))
    ids = torch.randint(0, 248044, (6000,), generator=torch.Generator().manual_seed(0)).tolist()
    s = reader.new_session("a")
    reader.feed_prompt(s, ids[:2100])
    reader.advance(s)
    reader.feed_output(s, ids[2100:2700])
    reader.advance(s)
    before = {k: v.clone() for k, v in s.state.tensors().items()}
    probs = reader.ask(s, ids[:300], [32, 33, 34])
    assert abs(probs.sum().item() - 1) < 1e-3
    reader.decode(s, ids[:20], 5)
    assert all(torch.equal(before[k], v) for k, v in s.state.tensors().items())
    reader.feed_prompt(s, ids[:2100] + ids[3000:6000])  # differs at 2100: back to the checkpoint at 2048
    assert s.rollbacks == 1 and s.committed == 2048
    reader.advance(s)
    fresh = reader.prefill(s.ids[: s.committed])
    compared, mismatched, _ = compare_states(s.state, fresh)
    assert compared == 8 and mismatched == []


def test_the_host_tier_moves_a_cuda_session_to_pinned_memory_and_back_bit_for_bit(tiny_cuda):
    """A session on the GPU moves to the host tier (pinned copies) and back; every tensor, id and
    checkpoint equal, and reading on from it equals a fresh prefill."""
    from shadow.core.store import SessionStore

    reader = Reader(tiny_cuda.model, 512)
    store = SessionStore(reader, "h", cap_gib=0, host_cap_gib=1.0)
    ids = torch.randint(0, 248044, (3000,), generator=torch.Generator().manual_seed(5)).tolist()
    s = store.get("a")
    reader.feed_prompt(s, ids[:2600])
    reader.advance(s)
    before = {k: v.clone() for k, v in s.state.tensors().items()}
    marks = [(c.position, c.conv.clone(), c.recurrent.clone()) for c in s.checkpoints]
    store.get("b")
    store.settle(keep="b")
    store.flush()  # the copy, made on a stream of its own, is whole: it takes its place in the tier
    copy = store.host.peek("a")
    assert copy is not None and all(t.is_pinned() for t in copy.state.tensors().values())
    back = store.get("a")
    assert all(torch.equal(before[k], v) for k, v in back.state.tensors().items())
    assert [(c.position, torch.equal(c.conv, x), torch.equal(c.recurrent, y))
            for c, (_, x, y) in zip(back.checkpoints, marks)] == [(p, True, True) for p, _, _ in marks]
    reader.feed_output(back, ids[2600:])
    reader.advance(back)
    compared, mismatched, _ = compare_states(back.state, reader.prefill(back.ids[: back.committed]))
    assert compared > 0 and mismatched == []


def test_copies_out_take_the_pools_memory_pinned_ahead_and_give_it_back(tiny_cuda):
    """On a GPU the store pins ahead on the pool's thread: a session's move out takes every tensor's
    memory from the pool (pinned, nothing pinned where the move began), comes back bit for bit,
    and once the copy is let go its spans are the pool's again."""
    import gc

    from shadow.core.store import SessionStore

    reader = Reader(tiny_cuda.model, 512)
    store = SessionStore(reader, "h", cap_gib=0, host_cap_gib=1.0)
    assert store.pinned is not None and store.pinned.wait_filled(60)
    ids = torch.randint(0, 248044, (3000,), generator=torch.Generator().manual_seed(9)).tolist()
    s = store.get("a")
    reader.feed_prompt(s, ids)
    reader.advance(s)
    before = {k: v.clone() for k, v in s.state.tensors().items()}
    tensors = len(before) + 2 * len(s.checkpoints)
    del s
    store.get("b")
    store.settle(keep="b")
    store.flush()
    copy = store.host.peek("a")
    assert all(t.is_pinned() for t in copy.state.tensors().values())
    stats = store.pinned.stats()
    assert stats.fallbacks == 0 and stats.spans_lent == tensors and stats.pinned_bytes <= store.pinned.limit
    del copy
    back = store.get("a")
    assert all(torch.equal(before[k], v) for k, v in back.state.tensors().items())
    gc.collect()
    assert store.pinned.stats().spans_lent == 0
    assert store.totals()["pinned"]["fallbacks"] == 0


def test_a_pin_ahead_past_the_bound_pins_it_all_at_start_and_nothing_while_moving(tiny_cuda):
    """`pin_ahead_gib` at or past the host tier's bound: the pool pins the whole bound when the
    store starts, and a move out takes its memory without a pin beside it."""
    from shadow.core.store import SessionStore

    reader = Reader(tiny_cuda.model, 512)
    store = SessionStore(reader, "h", cap_gib=0, host_cap_gib=0.5, pin_ahead_gib=64)
    assert store.pinned is not None and store.pinned.wait_filled(60)
    before = store.pinned.stats()
    assert before.pinned_bytes == store.pinned.limit == 1 << 29 and before.free_bytes == before.pinned_bytes
    s = store.get("a")
    reader.feed_prompt(s, list(range(1, 1500)))
    reader.advance(s)
    del s
    store.get("b")
    store.settle(keep="b")
    store.flush()
    after = store.pinned.stats()
    assert store.host.peek("a") is not None and after.fallbacks == 0 and after.spans_lent > 0
    assert (after.slabs, after.pinned_bytes, after.pin_seconds) == (before.slabs, before.pinned_bytes, before.pin_seconds)


def test_a_move_out_holds_its_pool_back_until_its_copy_is_whole(tiny_cuda):
    """A move out tells the pool it takes memory from of its copy (the move's event): the pool's
    thread begins no slab until the copy is whole, and lets the event go once it is."""
    from shadow.core.hosttier import move_to_host
    from shadow.core.pinnedpool import PinnedPool

    reader = Reader(tiny_cuda.model, 512)
    s = reader.new_session("a")
    reader.feed_prompt(s, list(range(1, 1500)))
    reader.advance(s)
    pool = PinnedPool(limit=256 << 20, ahead=64 << 20, slab_bytes=64 << 20)
    try:
        assert pool.wait_filled(60)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # the copy queued behind about 0.1 s of work
        move = move_to_host(s, side, pool)
        assert not move.done() and any(e is move.event for e in pool._in_flight)
        move.wait()
        assert pool.wait_filled(60)  # the pool refills once the copy is whole
        assert not pool._in_flight and pool.stats().quiet_seconds >= 0.05  # the copy waited behind about 0.1 s
    finally:
        pool.close()


def test_a_slab_is_page_locked_copies_bit_for_bit_and_is_let_go():
    """A pool's slab is mapped memory page-locked by `cudaHostRegister`: torch sees it pinned, a
    device-to-host copy into it and back is bit-equal, and once the slab is freed its mapping is
    unregistered and closed."""
    import ctypes
    import gc

    from shadow.core.pinnedpool import Slab

    slab = Slab(64 << 20, pin=True)
    view = torch.frombuffer((ctypes.c_char * slab.nbytes).from_address(slab.address), dtype=torch.uint8)
    assert slab.pinned and view.is_pinned()
    src = torch.randint(0, 255, (slab.nbytes,), dtype=torch.uint8, device="cuda")
    view.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(view.cuda(), src)
    mapped = slab._map
    del view, slab
    gc.collect()
    assert mapped.closed


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_restore_ahead_on_a_side_stream_beside_reads_gives_the_session_bit_for_bit(tiny_cuda, tier, tmp_path):
    """A session in the host tier or on disk brought back on a stream of its own, on another
    thread, while the default stream reads another session: every tensor and checkpoint equal to
    the session that left, taken by the store, and reading on from it equals a fresh prefill."""
    import threading

    from shadow.core.store import SessionStore
    from shadow.server.restores import RestoresAhead

    reader = Reader(tiny_cuda.model, 512)
    store = SessionStore(reader, "h", cap_gib=0, disk=tmp_path, host_cap_gib=1.0 if tier == "host" else None)
    ids = torch.randint(0, 248044, (6000,), generator=torch.Generator().manual_seed(7)).tolist()
    s = store.get("a")
    reader.feed_prompt(s, ids[:2600])
    reader.advance(s)
    before = {k: v.clone() for k, v in s.state.tensors().items()}
    marks = [(c.position, c.conv.clone(), c.recurrent.clone()) for c in s.checkpoints]
    b = store.get("b")
    reader.feed_prompt(b, ids[3000:])
    store.settle(keep="b")
    store.flush()  # its copy out whole (and, for disk, its file written behind)
    assert store.peek("a") is None and store.status()[0].tier == tier
    ahead = RestoresAhead()
    try:
        reading = threading.Thread(target=reader.advance, args=(b,))  # the default stream busy meanwhile
        reading.start()
        brought = ahead.take(ahead.start(store, "a"), "a")
        reading.join()
    finally:
        ahead.close()
    back = store.get("a", brought)
    assert back is brought.session
    assert all(torch.equal(before[k], v) for k, v in back.state.tensors().items())
    assert [(c.position, torch.equal(c.conv, x), torch.equal(c.recurrent, y))
            for c, (_, x, y) in zip(back.checkpoints, marks)] == [(p, True, True) for p, _, _ in marks]
    reader.feed_output(back, ids[2600:3000])
    reader.advance(back)
    for session in (back, b):
        compared, mismatched, _ = compare_states(session.state, reader.prefill(session.ids[: session.committed]))
        assert compared > 0 and mismatched == []


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("asked", [False, True], ids=["left", "asked-while-moving"])
def test_a_session_moves_out_on_a_side_stream_behind_queued_reads_bit_for_bit(tiny_cuda, tier, asked, tmp_path):
    """A session leaves the device while the default stream is busy (a read of another session
    queued, then a sleep): its copy waits on a stream of its own for what was queued, and the
    session is moving, its rows held, until the copy's event completes; then it is in the host
    tier (or waits there for its write to disk) and comes back with every tensor and checkpoint
    equal. Asked for while it moves, it stays on the device; reading on equals a fresh prefill."""
    from shadow.core.store import SessionStore

    reader = Reader(tiny_cuda.model, 512)
    store = SessionStore(reader, "h", cap_gib=0, disk=tmp_path if tier == "disk" else None,
                         host_cap_gib=1.0 if tier == "host" else None)
    ids = torch.randint(0, 248044, (6000,), generator=torch.Generator().manual_seed(11)).tolist()
    a = store.get("a")
    reader.feed_prompt(a, ids[:2600])
    reader.advance(a)
    before = {k: v.clone() for k, v in a.state.tensors().items()}
    marks = [(c.position, c.conv.clone(), c.recurrent.clone()) for c in a.checkpoints]
    b = store.get("b")
    reader.feed_prompt(b, ids[3000:])
    reader.advance(b)
    torch.cuda._sleep(2_000_000_000)  # the default stream busy for a second or so: the copy waits behind it
    store.settle(keep="b")
    row = next(r for r in store.status() if r.name == "a")
    assert (row.tier, row.moving) == ("device", "to host memory" if tier == "host" else "to disk")
    assert store.peek("a") is None and store.holds("a") and store.totals()["moving_sessions"] == 1
    if asked:
        back = store.get("a")
        assert back is a and store.counters.moves_kept == 1
    else:
        store.flush()
        if tier == "host":
            assert all(t.is_pinned() for t in store.host.peek("a").state.tensors().values())
        back = store.get("a")
        assert back is not a
        assert all(torch.equal(before[k], v) for k, v in back.state.tensors().items())
        assert [(c.position, torch.equal(c.conv, x), torch.equal(c.recurrent, y))
                for c, (_, x, y) in zip(back.checkpoints, marks)] == [(p, True, True) for p, _, _ in marks]
    reader.feed_output(back, ids[2600:3000])
    reader.advance(back)
    for session in (back, b):
        compared, mismatched, _ = compare_states(session.state, reader.prefill(session.ids[: session.committed]))
        assert compared > 0 and mismatched == []
    assert store.close() == []


def test_an_embedded_shadow_on_a_gpu_sizes_its_cap_from_the_memory_its_generator_leaves(tiny_cuda):
    """Embedded on a GPU without --cap-gib: the cap is `residency.embedded_cap_gib` of the free device
    memory, the generator's requests at their longest (its own state sizes) and the prefix cache."""
    from dataclasses import replace

    from shadow.core.residency import GIB, StateSize, embedded_cap_gib
    from shadow.server.http.build import embedded_cap
    from shadow.server.settings import ServeSettings, StoreSettings

    settings, model = ServeSettings(), tiny_cuda.model
    size, limits = StateSize.of(model.config, 2), settings.limits
    requests = limits.max_generating * size.resident(size.capacity(limits.max_prompt_tokens + limits.max_tokens), 0)
    assert embedded_cap(settings, model, free_bytes=40 * GIB) == \
        embedded_cap_gib(40 * GIB, requests, int(settings.prefix.gib * GIB))
    assert embedded_cap(replace(settings, store=StoreSettings(cap_gib=3.0)), model) == 3.0
    free, _ = torch.cuda.mem_get_info()
    assert 0.5 <= embedded_cap(settings, model) <= free / GIB


def test_pinned_autotuning_gives_the_same_bits_as_tuning(tiny_cuda):
    """Every fla autotuner's choices recorded, forgotten, and put back from the recording: the
    forward gives the same bits (the pins are what a cleared cache would otherwise re-tune)."""
    from shadow.model.kernels import pins as autotune_pins

    model = tiny_cuda.model
    ids = torch.randint(0, 248044, (512,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    before = model(ids, model.new_state())
    recording = autotune_pins.record()
    assert recording, "no fla autotuner has chosen a config"
    for tuner in autotune_pins._autotuners().values():
        tuner.cache.clear()
    assert autotune_pins.apply_recording(recording) == sum(len(v) for v in recording.values())
    assert torch.equal(model(ids, model.new_state()), before)


@pytest.fixture(scope="module")
def eight_layers(tmp_path_factory):
    """A checkpoint of the 0.8B's head shapes in eight layers: two attention layers, three pieces."""
    import dataclasses

    layers = ("linear_attention",) * 3 + ("full_attention",)
    config = dataclasses.replace(WIDE, num_hidden_layers=8, layer_types=layers * 2)
    return write_random_checkpoint(tmp_path_factory.mktemp("eight"), config, dtype=torch.bfloat16)


@pytest.mark.parametrize("kernels", [sets.FAST, sets.FUSED, sets.TRITON], ids=["fla", "fused", "triton"])
def test_graphed_pieces_equal_eager_pieces_bit_for_bit(kernels, eight_layers):
    """Graph replays against the same pieces run eagerly, chunk after chunk, with a graph of
    another row count replayed in between, on eight layers (two attention layers, three pieces):
    each attention must read its own layer's q, k, v (a replay rewrites the tensors its capture
    made; reading another piece's would still repeat its bits run to run, so only this comparison
    shows it; `tests/test_piecewise.py` emulates it on the CPU)."""
    model = load_model(str(eight_layers), dtype=torch.bfloat16, device="cuda", kernels=kernels).model
    graphed, eager = PiecewiseForward(model, sizes={512, 64}), PiecewiseForward(model, sizes={512, 64}, graphs=False)
    ids = torch.randint(0, 248044, (1600,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(6))
    a, b = model.new_state(), model.new_state()
    for lo, hi in ((0, 512), (512, 576), (576, 1088), (1088, 1600)):
        assert torch.equal(graphed(ids[lo:hi], a), eager(ids[lo:hi], b)), (lo, hi)
    assert compare_states(a, b)[1] == []


@pytest.mark.parametrize("kernels", [sets.FAST, sets.FUSED, sets.TRITON], ids=["fla", "fused", "triton"])
def test_batched_reads_equal_graphed_reads_alone_bit_for_bit(kernels, eight_layers):
    """B = 1, 2, 4, 8 sessions at mixed depths (0 to 3 chunks read): one batched forward of their
    next chunks (rows stacked, state per session; run eagerly, and replayed from batch graphs)
    against each chunk read alone through the graphed reader; every state tensor and checkpoint
    bit-equal."""
    model = load_model(str(eight_layers), dtype=torch.bfloat16, device="cuda", kernels=kernels).model
    graphed = Reader(model, 512, forward=PiecewiseForward(model, sizes={512, 1, 64, 128, 256}))
    # the same batches replayed from graphs of their own (the live reader's path); 3 runs eagerly
    batch_graphs = Reader(model, 512, forward=PiecewiseForward(model, sizes={512, 1, 64, 128, 256}, batches={2, 4, 8}))
    g = torch.Generator().manual_seed(3)
    for b, batching in ((1, graphed), (2, graphed), (4, graphed), (8, graphed), (2, batch_graphs), (3, batch_graphs),
                        (8, batch_graphs)):
        alone, batched = [], []
        for k in range(b):
            ids = torch.randint(1000, 200000, ((k % 4 + 1) * 512 + 37,), generator=g).tolist()
            for group in (alone, batched):
                s = graphed.new_session(f"s{k}")
                graphed.feed_prompt(s, ids)
                while s.committed + 1024 <= len(s.ids):
                    graphed.advance(s, max_chunks=1)
                group.append(s)
        for s in alone:
            graphed.advance(s, max_chunks=1)
        batching.advance_batch(batched)
        for x, y in zip(alone, batched):
            compared, mismatched, _ = compare_states(x.state, y.state)
            assert compared > 0 and mismatched == [], (b, x.name, mismatched)
            assert all(torch.equal(c.recurrent, d.recurrent) for c, d in zip(x.checkpoints, y.checkpoints))


@pytest.mark.parametrize("kernels", [sets.FAST, sets.FUSED, sets.TRITON], ids=["fla", "fused", "triton"])
def test_batches_of_runs_equal_graphed_reads_alone_bit_for_bit(kernels, eight_layers):
    """Batches whose entries hold several consecutive chunks of a session (runs: [8], [3, 1, 2, 2],
    [1, 7], ...), each layout replayed from the one graph set of its batch size where the steps
    read layouts on the device (the fused sets), eagerly otherwise, and a layout of B sessions
    alone between them; against each session's chunks read one at a time through the graphed
    reader: every state tensor and checkpoint bit-equal."""
    model = load_model(str(eight_layers), dtype=torch.bfloat16, device="cuda", kernels=kernels).model
    graphed = Reader(model, 512, forward=PiecewiseForward(model, sizes={512, 1, 64, 128, 256}))
    batching = Reader(model, 512, forward=PiecewiseForward(model, sizes={512, 1, 64, 128, 256}, batches={2, 4, 8}))
    g = torch.Generator().manual_seed(4)
    for runs in ([2], [1, 1], [2, 2], [1, 3], [4], [8], [3, 1, 2, 2], [1] * 8, [1, 7], [2, 1, 1, 1, 1, 1, 1]):
        alone, batched = [], []
        for k, n in enumerate(runs):
            ids = torch.randint(1000, 200000, ((k % 3 + n) * 512 + 37,), generator=g).tolist()
            for group in (alone, batched):
                s = graphed.new_session(f"s{k}")
                graphed.feed_prompt(s, ids)
                graphed.advance(s, max_chunks=k % 3)
                group.append(s)
        for s, n in zip(alone, runs):
            graphed.advance(s, max_chunks=n)
        batching.advance_batch([s for s, n in zip(batched, runs) for _ in range(n)])
        for x, y in zip(alone, batched):
            compared, mismatched, _ = compare_states(x.state, y.state)
            assert compared > 0 and mismatched == [] and x.committed == y.committed, (runs, x.name, mismatched)
            assert all(torch.equal(c.recurrent, d.recurrent) for c, d in zip(x.checkpoints, y.checkpoints))
    of_a_layout = [key for key in batching.forward._plans if len(key) == 3]  # eager plans of one layout
    assert (of_a_layout == []) == (kernels.gdn_gated_batch is not None)


def test_embedded_generator_on_graphs_gives_greedy_decodings_bit_for_bit(tiny_cuda):
    """The generator launches each round before it hands out the token before it; its tokens are
    those of a plain greedy loop on the same graphed forward."""
    from shadow.server.generator import Generator

    model = tiny_cuda.model
    generator = Generator.on(model)
    prompt = torch.randint(0, 248044, (700,), generator=torch.Generator().manual_seed(7)).tolist()
    prompt = [i % model.config.vocab_size for i in prompt]
    got = list(generator.generate(prompt, 24))
    state = model.new_state()
    for lo in range(0, len(prompt), 512):
        hidden = generator.forward(torch.tensor(prompt[lo : lo + 512], device="cuda"), state)
    want = []
    while len(want) < 24:
        token = int(model.logits(hidden[-1:])[0].argmax())
        want.append(token)
        if len(want) < 24:
            hidden = generator.forward(torch.tensor([token], device="cuda"), state)
    assert got == want
