"""The fused steps (merged projections, one-launch kernels) against the modules' own steps, on
the CPU in float32 with the kernels' PyTorch twins; and the Triton kernels against those twins
under Triton's interpreter (when Triton is installed)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from shadow.model import load_model
from shadow.model.kernels import reference
from shadow.model.fused import FusedSteps
from shadow.model.piecewise import PiecewiseForward
from shadow.model.qwen35 import ModuleSteps
from shadow.core.reader import Reader
from shadow.offline.verify import compare_states

pytestmark = pytest.mark.slow  # kernels under Triton's interpreter: `pytest -m 'not slow'` leaves them out

FUSED_REFERENCE = dataclasses.replace(reference.REFERENCE, name="reference-fused", fused=True)


@pytest.fixture(scope="module")
def fused(shadow_cache):
    return load_model("tiny", kernels=FUSED_REFERENCE).model


def ids_of(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 248044, (n,), generator=torch.Generator().manual_seed(seed))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_fused_steps_close_to_the_modules_steps_with_state_carried(tiny, fused):
    assert isinstance(fused.steps, FusedSteps) and isinstance(tiny.model.steps, ModuleSteps)
    ids = ids_of(200, 0)
    plain, merged = tiny.model.new_state(), fused.new_state()
    for lo, hi in ((0, 64), (64, 190), (190, 191), (191, 200)):  # chunks, a decode step, a tail
        a, b = tiny.model(ids[lo:hi], plain), fused(ids[lo:hi], merged)
        assert rel(b, a) < 1e-4, (lo, hi, rel(b, a))
    for x, y in zip(plain.layers, merged.layers):
        for name in ("conv", "recurrent", "k", "v"):
            if hasattr(x, name):
                assert rel(getattr(y, name).float(), getattr(x, name).float()) < 1e-4, name


def test_module_weights_become_views_of_the_merged_ones(fused):
    steps = fused.steps
    layer = next(i for i, l in enumerate(fused.layers) if l.kind != "full_attention")
    gdn = fused.layers[layer].linear_attn
    merged = steps.layers[layer].in_proj
    assert gdn.in_proj_qkv.weight.data_ptr() == merged.data_ptr()
    assert torch.equal(merged[-gdn.in_proj_a.weight.shape[0] :], gdn.in_proj_a.weight)


def test_fused_pieces_equal_the_fused_forward_bit_for_bit(fused):
    pieces = PiecewiseForward(fused, sizes={64}, graphs=False)
    ids = ids_of(192, 1)
    plain, split = fused.new_state(), fused.new_state()
    for lo in range(0, 192, 64):
        assert torch.equal(fused(ids[lo : lo + 64], plain), pieces(ids[lo : lo + 64], split))
    assert compare_states(plain, split)[1] == []


def test_fused_reader_keeps_the_exactness_contract(fused):
    reader = Reader(fused, 64)
    ids = ids_of(700, 2).tolist()
    s = reader.new_session("f")
    reader.feed_prompt(s, ids[:300])
    reader.advance(s)
    before = {k: v.clone() for k, v in s.state.tensors().items()}
    reader.ask(s, ids[:40], [32, 33])
    reader.decode(s, ids[:5], 3)
    assert all(torch.equal(before[k], v) for k, v in s.state.tensors().items())
    reader.feed_prompt(s, ids[:200] + ids[400:700])  # differs at 200: back to the checkpoint at 192
    reader.advance(s)
    compared, mismatched, _ = compare_states(s.state, reader.prefill(s.ids[: s.committed]))
    assert compared > 0 and mismatched == []


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_kernels_match_their_twins_under_the_interpreter():
    """Run in a child process: TRITON_INTERPRET must be set before Triton compiles anything."""
    script = textwrap.dedent("""
        import torch
        import triton.runtime.interpreter as interp

        # Triton 3.6's interpreter turns a scalar into an index by int(array); numpy 2.4 refuses
        # that for its shape-(1,) scalars, which loop bounds computed from program ids are
        patch_tensor = interp._patch_lang_tensor
        def patched(tensor, scope):
            patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
        interp._patch_lang_tensor = patched

        from shadow.model.kernels import reference, triton as tri, triton_attention as ta, twins as twin
        assert not ta.descriptors(torch.device("cuda"))  # under the interpreter: plain loads, even for CUDA
        torch.manual_seed(0)
        worst = 0.0
        for t in (1, 3, 70):
            proj = torch.randn(t, 170)[:, :136]  # strided rows: conv channels 96, z 32, b 4, a 4
            state, w = torch.randn(96, 3), torch.randn(96, 4)
            got, want = tri.conv_split(proj, state, w, 16, 32, 4), twin.conv_split(proj, state, w, 16, 32, 4)
            assert all(g.is_contiguous() and g.shape == h.shape for g, h in zip(got, want))
            # blocks as wide as a head: every program takes a straight branch (one part, no state)
            aligned = tri.conv_split(proj, state, w, 16, 32, 4, {"BT": 2, "BC": 16, "num_warps": 1})
            assert all(torch.equal(g, h) for g, h in zip(got, aligned))
            worst = max(worst, *((a - b).abs().max().item() for a, b in zip(got, want)))
            y, s = reference.causal_conv(proj[:, :96], state, w)
            worst = max(worst, (torch.cat(got[:3], -1) - y).abs().max().item(), (got[6] - s).abs().max().item())
            assert torch.equal(torch.cat(got[3:6], -1), proj[:, 96:])  # z, b, a: the projection's bits
        # three sessions' rows stacked, each convolved on its own state: the bits each gives alone
        proj, states = torch.randn(3 * 70, 170)[:, :136], torch.randn(3, 96, 3)
        stacked, twins = tri.conv_split(proj, states, w, 16, 32, 4), twin.conv_split(proj, states, w, 16, 32, 4)
        assert all(g.shape == h.shape for g, h in zip(stacked, twins)) and stacked[6].shape == (3, 96, 3)
        for j in range(3):
            alone = tri.conv_split(proj[j * 70 : (j + 1) * 70], states[j].contiguous(), w, 16, 32, 4)
            assert all(torch.equal(g[j * 70 : (j + 1) * 70], h) for g, h in zip(stacked[:6], alone[:6]))
            assert torch.equal(stacked[6][j], alone[6])
        worst = max(worst, *((a - b).abs().max().item() for a, b in zip(stacked, twins)))
        gu = torch.randn(5, 600)
        worst = max(worst, (tri.swiglu(gu) - twin.swiglu(gu)).abs().max().item())
        h, d, weight = torch.randn(7, 100)[:, :96], torch.randn(7, 96), torch.rand(96) + 0.5  # a strided x, D < block
        for got, want in zip(tri.add_rms_norm(h, d, weight, 1e-6), twin.add_rms_norm(h, d, weight, 1e-6)):
            worst = max(worst, (got - want).abs().max().item())
        total, normed = tri.add_rms_norm(h, d, weight, 1e-6)
        assert torch.equal(tri.add_rms_norm(total, None, weight, 1e-6)[1], normed)  # a sum's norm = its norm alone
        assert tri.add_rms_norm(h, None, weight, 1e-6)[0] is h
        proj, attended = torch.randn(4, 3, 64), torch.randn(4, 3, 32)
        worst = max(worst, (tri.gate_mul(attended, proj[..., 32:]) - twin.gate_mul(attended, proj[..., 32:])).abs().max().item())
        x = torch.randn(6, 3, 64)[..., :32]
        args = (torch.randn(32), torch.randn(6, 8), torch.randn(6, 8), 1e-6)
        worst = max(worst, (tri.norm_rope(x, *args) - twin.norm_rope(x, *args)).abs().max().item())
        # chunk attention: small tiles so the cached rows split into several slices (and one row, T < BM)
        tiles = {"BM": 16, "BN": 16, "num_warps": 4, "num_stages": 1}
        for hq, hkv, t, cached in ((4, 2, 70, 230), (2, 2, 16, 0), (4, 1, 33, 900), (2, 1, 1, 50)):
            q = torch.randn(hq, t, 32)
            k, v = torch.randn(hkv, cached + t + 40, 32), torch.randn(hkv, cached + t + 40, 32)
            got = ta.chunk_attention(q, k[:, : cached + t], v[:, : cached + t], 32 ** -0.5, tiles)
            want = reference.attention(q, k[:, : cached + t], v[:, : cached + t], 32 ** -0.5)
            assert got.shape == want.shape and got.is_contiguous()
            worst = max(worst, (got - want).abs().max().item())
        # three sessions at other depths in one launch, their new rows written by it: each its bits alone
        q, lengths = torch.randn(4, 3 * 20, 32), [20, 260, 75]
        bufs = [(torch.randn(2, n + 30, 32), torch.randn(2, n + 30, 32)) for n in lengths]
        new = torch.randn(2, 2, 3 * 20, 32).unbind(0)
        alone = []
        for j, ((k, v), n) in enumerate(zip(bufs, lengths)):
            k2, v2 = k.clone(), v.clone()
            k2[:, n - 20 : n], v2[:, n - 20 : n] = new[0][:, j * 20 : (j + 1) * 20], new[1][:, j * 20 : (j + 1) * 20]
            alone.append((ta.chunk_attention(q[:, j * 20 : (j + 1) * 20], k2[:, :n], v2[:, :n], 32 ** -0.5, tiles), k2, v2))
        out = torch.empty(3 * 20, 4, 32)
        got = ta.attend_sessions(q, [k for k, _ in bufs], [v for _, v in bufs], lengths, 32 ** -0.5, new=new, out=out, tiles=tiles)
        assert got is out
        for j, (want, k2, v2) in enumerate(alone):
            assert torch.equal(got[j * 20 : (j + 1) * 20], want)
            assert torch.equal(bufs[j][0], k2) and torch.equal(bufs[j][1], v2)
        print(worst)
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) < 1e-5


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_kernels_compile_for_the_h200():
    """Triton's front end and ptxas run without a GPU: each kernel compiles for sm_90 (the
    interpreter above accepts code the compiler refuses, e.g. a name rebound to another type)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from shadow.model.kernels import triton_attention as ta
    from shadow.model.kernels import triton as tri

    ptr, i32 = "*bf16", "i32"
    kernels = [
        (tri._conv_kernel, dict(x=ptr, x_row=i32, state=ptr, weight=ptr, q=ptr, k=ptr, v=ptr, z=ptr, b=ptr, a=ptr,
                                new_state=ptr, T=i32, C=i32, KEY=i32, VALUE=i32, Z=i32, H=i32, CONV_BLOCKS=i32),
         dict(K=4, BT=16, BC=128)),
        (tri._swiglu_kernel, dict(gu=ptr, out=ptr, T=i32, I=i32), dict(BT=8, BI=256)),
        (tri._add_norm_kernel, dict(x=ptr, x_row=i32, delta=ptr, delta_row=i32, weight=ptr, out_sum=ptr, out_norm=ptr,
                                    D=i32, eps="fp32"), dict(HAS_DELTA=True, BD=1024)),
        (tri._add_norm_kernel, dict(x=ptr, x_row=i32, delta=ptr, delta_row=i32, weight=ptr, out_sum=ptr, out_norm=ptr,
                                    D=i32, eps="fp32"), dict(HAS_DELTA=False, BD=1024)),
        (tri._gate_kernel, dict(attended=ptr, gate=ptr, g_row=i32, g_head=i32, out=ptr, H=i32), dict(D=256)),
        (tri._norm_rope_kernel, dict(x=ptr, x_row=i32, x_head=i32, weight="*fp32", cos="*fp32", sin="*fp32",
                                     out=ptr, T=i32, H=i32, eps="fp32"), dict(D=256, R=64)),
    ]
    f32 = "*fp32"
    tiles = ta.TILES
    kernels += [  # the slices with plain loads and through tensor descriptors (TMA, Hopper's default)
        (ta._attention_slice, dict(q=ptr, o_part=f32, m_part=f32, l_part=f32, sessions="*i64", work="*i32", T=i32,
                                   q_head=i32, q_row=i32, qk_scale="fp32"),
         dict(GROUPS=4, D=256, BM=tiles["BM"], BN=tiles["BN"], DESC=desc)) for desc in (False, True)
    ] + [
        (ta._attention_merge, dict(o_part=f32, m_part=f32, l_part=f32, out=ptr, sessions="*i64", T=i32), dict(D=256)),
        (ta._write_rows, dict(k=ptr, v=ptr, k_head=i32, k_row=i32, v_head=i32, v_row=i32, sessions="*i64", T=i32),
         dict(D=256)),
    ]
    assert not ta.descriptors(torch.device("cpu"))  # off a GPU: plain loads
    options = {ta._attention_slice: dict(num_warps=tiles["num_warps"], num_stages=tiles["num_stages"])}
    for fn, signature, constants in kernels:
        # the launcher marks pointers and strides divisible by 16 as such; so does this compile
        aligned = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(signature.items())
                   if kind.startswith("*") or name in ("x_row", "x_head", "q_head", "q_row", "k_head", "k_row", "delta_row", "g_row", "g_head",
                                                       "v_head", "v_row")}
        source = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constants}},
                           constexprs=constants, attrs=aligned)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options.get(fn, {}))
        assert ".entry" in compiled.asm["ptx"], fn.__name__
        if "DESC" in constants:  # TMA bulk tensor copies in the descriptor slices, none in the plain ones
            assert ("cp.async.bulk.tensor" in compiled.asm["ptx"]) == constants["DESC"], fn.__name__


def test_a_kernel_set_revision_is_part_of_the_stored_arithmetic(fused):
    from shadow.model.runtime import arithmetic

    assert arithmetic(fused) == "reference-fused/float32"
    revised = load_model("tiny", kernels=dataclasses.replace(FUSED_REFERENCE, revision=2)).model
    assert arithmetic(revised) == "reference-fused.2/float32"


def test_the_descriptor_scratch_allocator_is_set_in_every_context_that_launches():
    """Triton keeps its allocator in a context variable: a new thread, an asyncio task or a copied
    context starts without it, so `use_workspace` sets it in each context it runs in."""
    import asyncio
    import contextvars
    import threading

    import triton.runtime._allocation as allocation

    from shadow.model.kernels import triton_attention as ta

    def launch_once() -> bool:
        ta.use_workspace()
        return allocation._allocator.get() is ta._workspace

    seen = []
    thread = threading.Thread(target=lambda: seen.extend(contextvars.copy_context().run(launch_once) for _ in range(3)))
    thread.start()
    thread.join()

    async def tasks():
        return [await asyncio.to_thread(launch_once) for _ in range(3)]

    assert seen == [True, True, True] and asyncio.run(tasks()) == [True, True, True]
