"""Fast kernels in plain torch for the fast sets: the GDN conv in the rows' own layout and torch's
fused RMSNorm, each with a reference contract (`reference`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv_rows(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.causal_conv`'s contract computed in the rows' own layout ([T, C], no transposes):
    K shifted multiply-adds in float32, then silu; a few elementwise launches instead of a cat
    of transposes and a depthwise convolution."""
    t, k = x.shape[0], weight.shape[-1]
    seq = torch.cat([state.t().to(x.dtype), x], dim=0)  # [K-1+T, C]
    w = weight.float()
    acc = seq[0:t].float() * w[:, 0]
    for i in range(1, k):
        acc.addcmul_(seq[i : i + t], w[:, i])
    return F.silu(acc).to(x.dtype), seq[t:].t()


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`reference.rms_norm`'s contract with torch's fused RMSNorm (the reduction in float32 inside)."""
    return F.rms_norm(x, (x.shape[-1],), weight=(1.0 + weight.float()).to(x.dtype), eps=eps)
