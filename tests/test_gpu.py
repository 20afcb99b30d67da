"""The fast path on CUDA (skipped without a GPU and flash-linear-attention): fla kernels agree with
the reference kernels, and the piecewise-graphed reader keeps the exactness contract."""

from __future__ import annotations

import pytest
import torch

from shadow.model import fast, load_model, ops
from shadow.model.piecewise import PiecewiseForward
from shadow.reader import Reader
from shadow.verify import compare_states

pytestmark = pytest.mark.skipif(not fast.available(), reason="needs CUDA and flash-linear-attention (fla-core)")


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
    out, new = fast.gdn_fla(q, k, v, decay, beta, state)
    ref_out, ref_new = ops.gdn_reference(q.double(), k.double(), v.double(), decay.double(), beta.double(), state.double())
    assert rel(out, ref_out) < 2e-2 and rel(new, ref_new) < 2e-2
    step_out, step_new = fast.gdn_fla(q[:1], k[:1], v[:1], decay[:1], beta[:1], state)
    ref_step, ref_step_new = ops.gdn_recurrent(
        ops.l2norm(q[:1].float().repeat_interleave(2, 1)) * dk ** -0.5, ops.l2norm(k[:1].float().repeat_interleave(2, 1)),
        v[:1], decay[:1], beta[:1], state)
    assert rel(step_out, ref_step) < 2e-2 and rel(step_new, ref_step_new) < 2e-2


def test_sdpa_attention_matches_reference_kernel():
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(8, 512, 256, device="cuda", generator=g).bfloat16()
    k = torch.randn(2, 4096, 256, device="cuda", generator=g).bfloat16()
    v = torch.randn(2, 4096, 256, device="cuda", generator=g).bfloat16()
    out = fast.attention_sdpa(q, k, v, 256 ** -0.5)
    ref = ops.attention(q.float(), k.float(), v.float(), 256 ** -0.5)
    assert rel(out, ref) < 2e-2


@pytest.fixture(scope="module")
def tiny_cuda():
    return load_model("tiny", dtype=torch.bfloat16, device="cuda", kernels=fast.FAST)


def test_fast_forward_close_to_reference_forward(tiny_cuda):
    ref = load_model("tiny", dtype=torch.float32, device="cuda", kernels=ops.REFERENCE)
    ids = torch.randint(0, 248044, (512,), device="cuda")
    a = tiny_cuda.model.logits(tiny_cuda.model(ids, tiny_cuda.model.new_state()))
    b = ref.model.logits(ref.model(ids, ref.model.new_state()))
    assert rel(a, b) < 3e-2


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
