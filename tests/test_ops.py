"""Reference kernels against their definitions (relative error, as fla's tests do)."""

from __future__ import annotations

import pytest
import torch

from shadow.model.kernels import reference


def gdn_inputs(t: int, h: int = 4, dk: int = 16, dv: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = reference.l2norm(torch.randn(t, h, dk, generator=g)) * dk ** -0.5
    k = reference.l2norm(torch.randn(t, h, dk, generator=g))
    v = torch.randn(t, h, dv, generator=g)
    decay = -torch.rand(t, h, generator=g) * 0.5
    beta = torch.rand(t, h, generator=g)
    state = torch.randn(h, dk, dv, generator=g) * 0.1
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("t", [1, 63, 64, 130, 256], ids=lambda t: f"T{t}")
def test_gdn_chunked_matches_recurrent_definition(t):
    args = gdn_inputs(t)
    out, state = reference.gdn_chunked(*args)
    ref_out, ref_state = reference.gdn_recurrent(*args)
    assert torch.allclose(out, ref_out, rtol=1e-4, atol=1e-5)
    assert torch.allclose(state, ref_state, rtol=1e-4, atol=1e-5)


def test_gdn_state_carries_across_calls():
    q, k, v, g, b, s0 = gdn_inputs(192)
    whole, s_whole = reference.gdn_chunked(q, k, v, g, b, s0)
    first, s1 = reference.gdn_chunked(q[:128], k[:128], v[:128], g[:128], b[:128], s0)
    second, s2 = reference.gdn_chunked(q[128:], k[128:], v[128:], g[128:], b[128:], s1)
    assert torch.allclose(torch.cat([first, second]), whole, rtol=1e-5, atol=1e-6)
    assert torch.allclose(s2, s_whole, rtol=1e-5, atol=1e-6)


def test_causal_conv_continues_from_state():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(40, 6, generator=g), torch.randn(6, 4, generator=g)
    zero = torch.zeros(6, 3)
    whole, end = reference.causal_conv(x, zero, w)
    a, mid = reference.causal_conv(x[:17], zero, w)
    b, end2 = reference.causal_conv(x[17:], mid, w)
    assert torch.allclose(torch.cat([a, b]), whole, atol=1e-6)
    assert torch.equal(end, end2) and torch.equal(end, x[-3:].t())


@pytest.mark.parametrize("past", [0, 100, 5000], ids=lambda p: f"past{p}")
def test_online_attention_matches_plain(past):
    g = torch.Generator().manual_seed(past)
    t = 96
    q = torch.randn(4, t, 32, generator=g)
    k, v = torch.randn(2, past + t, 32, generator=g), torch.randn(2, past + t, 32, generator=g)
    plain = reference.attention(q, k, v, 32 ** -0.5)
    online = reference.attention_online(q, k, v, 32 ** -0.5, block=256)
    assert torch.allclose(online, plain, rtol=1e-4, atol=1e-5)


def test_attention_is_causal_lower_right():
    """Changing the last cached row changes only the last query row."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 8, 16, generator=g), torch.randn(1, 20, 16, generator=g), torch.randn(1, 20, 16, generator=g)
    base = reference.attention_online(q, k, v, 0.25)
    v2 = v.clone()
    v2[:, -1] += 1.0
    moved = reference.attention_online(q, k, v2, 0.25)
    assert torch.equal(base[:-1], moved[:-1]) and not torch.equal(base[-1], moved[-1])


def test_row_layout_conv_matches_reference_conv():
    from shadow.model.kernels.torch_ops import causal_conv_rows

    g = torch.Generator().manual_seed(3)
    x, w, state = torch.randn(50, 12, generator=g), torch.randn(12, 4, generator=g), torch.randn(12, 3, generator=g)
    y, new = causal_conv_rows(x, state, w)
    ref_y, ref_new = reference.causal_conv(x, state, w)
    assert torch.allclose(y, ref_y, atol=1e-5) and torch.equal(new, ref_new)


def test_fused_rms_norm_matches_reference():
    from shadow.model.kernels.torch_ops import rms_norm_fused

    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(7, 64, generator=g), 0.1 * torch.randn(64, generator=g)
    assert torch.allclose(rms_norm_fused(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), atol=1e-5)
