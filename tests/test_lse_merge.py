"""Attention in parts merged by log-sum-exp (`shadow.model.kernels.lse_merge`): the cut by a
session's own depth, the Triton merge against its torch form under Triton's interpreter, a
session's bits alone and in a batch, and the parts recomposing the whole attention."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="the merge is a Triton kernel (its module imports Triton)")

from shadow.model.kernels.lse_merge import split_rows  # noqa: E402 - after the skip


@pytest.mark.parametrize("cached", [0, 511, 512, 4096, 8191, 16384, 16896, 65536, 100352])
def test_a_session_is_cut_by_its_own_depth_into_whole_chunks(cached):
    per, count = split_rows(cached, 512)
    assert per % 512 == 0 and per >= 4096 and 0 <= count <= 4
    assert count * per <= cached and cached - count * per < per
    tail = cached - count * per + 512  # the rows left and the chunk's own, under the causal mask
    assert tail >= 512
    assert split_rows(cached, 512) == (per, count)  # a pure function of the depth


def test_the_cut_rounds_its_least_slice_up_to_whole_chunks_and_refuses_bad_arguments():
    assert split_rows(10_000, 300, least=1000) == (2700, 3)  # 10000 / 4 = 2500 -> 2700 rows (9 chunks); 1000 -> 1200
    assert split_rows(1_000, 300, least=1000) == (1200, 0)
    assert split_rows(16_384, 512) == (4096, 4) and split_rows(65_536, 512) == (16_384, 4)
    for bad in ((-1, 512), (10, 0), (10, 512, 0), (10, 512, 4, 0)):
        with pytest.raises(ValueError):
            split_rows(*bad)


def test_the_merge_matches_its_torch_form_keeps_a_sessions_bits_and_recomposes_attention():
    """Run in a child process: TRITON_INTERPRET must be set before Triton compiles anything."""
    script = textwrap.dedent("""
        import torch
        import triton.runtime.interpreter as interp

        patch_tensor = interp._patch_lang_tensor  # as in test_fused: numpy 2.4 and Triton 3.6's interpreter
        def patched(tensor, scope):
            patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
        interp._patch_lang_tensor = patched

        from shadow.model.kernels import reference
        from shadow.model.kernels.lse_merge import merge_parts, merge_parts_reference, merge_table, split_rows

        torch.manual_seed(0)
        T, HQ, HKV, D, SCALE = 8, 4, 2, 32, 32 ** -0.5

        def part(q, k, v, causal):  # one part's normalised output [T, Hq, D] and log-sum-exp [Hq, T], float32
            kk, vv = k.repeat_interleave(HQ // HKV, 0), v.repeat_interleave(HQ // HKV, 0)
            s = q @ kk.transpose(-1, -2) * SCALE
            if causal:  # bottom-right: row r sees keys up to len - T + r
                n = k.shape[1]
                s = s.masked_fill(torch.arange(n)[None] > torch.arange(T)[:, None] + n - T, float("-inf"))
            return (torch.softmax(s, -1) @ vv).transpose(0, 1).contiguous(), torch.logsumexp(s, -1)

        # three sessions at other depths: 0, 3 and 4 slices of at least 16 rows
        lengths = [T + T, T + 88, T + 160]
        qs = [torch.randn(HQ, T, D) for _ in lengths]
        kvs = [(torch.randn(HKV, n, D), torch.randn(HKV, n, D)) for n in lengths]
        o_sl, l_sl, o_tail, l_tail, counts = [], [], [], [], []
        for q, (k, v), n in zip(qs, kvs, lengths):
            per, count = split_rows(n - T, T, least=16)
            counts.append(count)
            for j in range(count):
                o, l = part(q, k[:, j * per : (j + 1) * per], v[:, j * per : (j + 1) * per], False)
                o_sl.append(o); l_sl.append(l)
            o, l = part(q, k[:, count * per :], v[:, count * per :], True)
            o_tail.append(o); l_tail.append(l)
        assert counts == [0, 3, 4], counts
        o_sl, l_sl = torch.cat(o_sl), torch.cat(l_sl, 1).contiguous()
        o_tail, l_tail = torch.cat(o_tail), torch.cat(l_tail, 1).contiguous()
        got = merge_parts(o_sl, l_sl, o_tail, l_tail, counts, T)
        want = merge_parts_reference(o_sl, l_sl, o_tail, l_tail, counts, T)
        worst = (got - want).abs().max().item()
        for b, (q, (k, v)) in enumerate(zip(qs, kvs)):  # the parts recompose the session's attention
            whole = reference.attention(q, k, v, SCALE)
            worst = max(worst, (got[b * T : (b + 1) * T] - whole).abs().max().item())
        # each session alone: its rows' bits in the batch
        firsts = [sum(counts[:b]) * T for b in range(3)]
        def alone(b, o_sl=o_sl, l_sl=l_sl):
            a, n = firsts[b], counts[b] * T
            return merge_parts(o_sl[a : a + n].contiguous(), l_sl[:, a : a + n].contiguous(),
                               o_tail[b * T : (b + 1) * T].contiguous(), l_tail[:, b * T : (b + 1) * T].contiguous(), [counts[b]], T)
        for b in range(3):
            assert torch.equal(alone(b), got[b * T : (b + 1) * T]), b
        # the other sessions' parts changed: session 1's rows keep their bits
        o2, l2 = o_sl.clone(), l_sl.clone()
        o2[firsts[2] :] += 1.0
        l2[:, firsts[2] :] -= 3.0
        t2 = o_tail.clone(); t2[: T] *= 2.0; t2[2 * T :] -= 1.0
        moved = merge_parts(o2, l2, t2, l_tail, counts, T)
        assert torch.equal(moved[T : 2 * T], got[T : 2 * T]) and not torch.equal(moved[2 * T :], got[2 * T :])
        # every log-sum-exp 100 higher (the weights the same: exp(lse) alone would overflow), and parts far apart
        for shift in (100.0, 300.0):
            high = merge_parts(o_sl, l_sl + shift, o_tail, l_tail + shift, counts, T)
            assert torch.isfinite(high).all()  # (max() below would pass a NaN over)
            worst = max(worst, (high - want).abs().max().item())
        apart = l_sl.clone(); apart[:, ::2] -= 40.0
        far = merge_parts(o_sl, apart, o_tail, l_tail, counts, T)
        assert torch.isfinite(far).all()
        worst = max(worst, (far - merge_parts_reference(o_sl, apart, o_tail, l_tail, counts, T)).abs().max().item())
        # bf16 parts, as a kernel returns them, into a given out; no slice anywhere
        out = torch.empty(T, HQ, D, dtype=torch.bfloat16)
        tail_only = merge_parts(o_sl[:0].bfloat16(), l_sl[:, :0].contiguous(), o_tail[:T].bfloat16(), l_tail[:, :T].contiguous(), [0], T, out=out)
        assert tail_only is out and torch.equal(out, o_tail[:T].bfloat16())  # one part: weight 1, its own bits
        # refused, and `out` left as it was: bad counts, a table of other counts, dtypes, an out of another shape
        out = torch.full_like(o_tail, 7.0)
        cases = [dict(counts=bad) for bad in ([1, 3, 4], [0, 3], [-1, 4, 4], [0.0, 3, 4], [], [True, 3, 3])]
        cases += [dict(table=merge_table([1, 3, 3], "cpu")), dict(table=merge_table([0, 4, 3], "cpu")),
                  dict(l_sl=l_sl.double()), dict(l_tail=l_tail.bfloat16()), dict(o_sl=o_sl.bfloat16()),
                  dict(o_sl=o_sl.int()), dict(o_tail=o_tail.int()), dict(out=out[:T]), dict(out=out.bfloat16()),
                  dict(o_sl=o_sl.transpose(1, 2).contiguous().transpose(1, 2)), dict(t=0)]
        for case in cases:
            args = dict(o_sl=o_sl, l_sl=l_sl, o_tail=o_tail, l_tail=l_tail, counts=counts, t=T, out=out, table=None)
            args.update(case)
            try:
                merge_parts(args["o_sl"], args["l_sl"], args["o_tail"], args["l_tail"], args["counts"], args["t"],
                            out=args["out"], table=args["table"])
            except ValueError:
                pass
            else:
                raise AssertionError(f"taken: {sorted(case)}")
            assert torch.equal(out, torch.full_like(o_tail, 7.0))
        assert merge_parts(o_sl, l_sl, o_tail, l_tail, counts, T, out=out, table=merge_table(counts, "cpu")) is out
        assert torch.equal(out, got)
        print(worst)
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    worst = float(out.stdout.split()[-1])
    assert 0 <= worst < 1e-5  # (a NaN fails both)


def test_the_merge_compiles_for_the_h200():
    """Triton's front end and ptxas run without a GPU: the merge compiles for sm_90 with bf16 parts."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from shadow.model.kernels import lse_merge

    ptr, f32, i32 = "*bf16", "*fp32", "i32"
    signature = dict(o_sl=ptr, lse_sl=f32, o_tail=ptr, lse_tail=f32, out=ptr, sessions="*i32", T=i32, sl_rows=i32,
                     tail_rows=i32, D="constexpr")
    aligned = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind.startswith("*")}
    source = ASTSource(fn=lse_merge._merge, signature=signature, constexprs={"D": 256}, attrs=aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert ".entry" in compiled.asm["ptx"]


@pytest.mark.parametrize("bad", [["--mixed", "abc"], ["--mixed", "-5"], ["--depths", "x"], ["--batches", "0"],
                                 ["--mixed", "1,,2"]])
def test_the_kernel_survey_refuses_bad_sizes_with_one_line(bad):
    """experiments/attention_kernels.py parses its sizes before it touches a GPU: exit 2, one line."""
    out = subprocess.run([sys.executable, "experiments/attention_kernels.py", *bad], capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("attention_kernels.py: error: argument")
