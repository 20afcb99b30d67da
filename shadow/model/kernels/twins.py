"""The Triton kernels of `kernels.triton` in plain PyTorch, same names and contracts (float32
inside, one rounding at the end): what `fused.FusedSteps` runs off CUDA, and what tests compare
the kernels with. No Triton import here."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shadow.model.rope import apply_rope


def conv_split(
    proj: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, key_dim: int, z_dim: int, heads: int,
) -> tuple[torch.Tensor, ...]:
    """The GDN causal conv with silu over proj's first C channels (state [C, K-1], weight [C, K]),
    split into q, k [T, key_dim] and v; then z [T, z_dim], b, a [T, heads] copied from the
    columns after them; and the new state [C, K-1]. All contiguous. With state [B, C, K-1]: B
    sessions' rows stacked in proj, each convolved on its own state, the outputs stacked."""
    if state.dim() == 3:
        rows = proj.shape[0] // state.shape[0]
        each = [conv_split(proj[j * rows : (j + 1) * rows], state[j], weight, key_dim, z_dim, heads)
                for j in range(state.shape[0])]
        return (*(torch.cat(part) for part in list(zip(*each))[:6]), torch.stack([e[6] for e in each]))
    c, kk = weight.shape
    x, rest = proj[:, :c], proj[:, c:]
    seq = torch.cat([state.t().float(), x.float()], dim=0)
    t = x.shape[0]
    acc = sum(seq[i : i + t] * weight[:, i].float() for i in range(kk))
    y = F.silu(acc).to(x.dtype)
    q, k, v = y.split([key_dim, key_dim, c - 2 * key_dim], dim=-1)
    z, b, a = rest.split([z_dim, heads, heads], dim=-1)
    parts = (q, k, v, z, b, a, seq[t:].t().to(state.dtype))
    return tuple(p.contiguous() for p in parts)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] (gate first); [T, I] in its dtype."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm of x [T, H, D] (weight is 1 + w), RoPE on the first R features (cos, sin
    [T, R]); returns [H, T, D] contiguous in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return apply_rope(y, cos.float(), sin.float()).to(x.dtype).transpose(0, 1).contiguous()


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta rounded to x's dtype, its RMSNorm with weight (already 1 + w)); delta None: (x, norm of x)."""
    total = x if delta is None else (x.float() + delta.float()).to(x.dtype)
    f = total.float()
    return total, (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def gate_mul(attended: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """attended [T, H, D] * sigmoid(gate [T, H, D]), rounded once; [T, H * D]."""
    t = gate.shape[0]
    return (attended.float().reshape(gate.shape) * torch.sigmoid(gate.float())).to(attended.dtype).reshape(t, -1)
