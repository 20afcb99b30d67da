"""The fast kernel set for CUDA: flash-linear-attention's gated delta rule, SDPA attention.

Same contracts as the reference set in `ops`. Exactness rests on determinism: fla's Triton
kernels are autotuned once per shape and the choice is cached (FLA_CACHE_RESULTS=1, under
TRITON_CACHE_DIR), so later calls and later processes on the machine run the same configs;
the FlashQLA backend is switched off (FLA_FLASH_QLA=0) so one backend computes every chunk.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from shadow.model import ops

os.environ.setdefault("FLA_FLASH_QLA", "0")
os.environ.setdefault("FLA_CACHE_RESULTS", "1")


def available() -> bool:
    """True when CUDA and flash-linear-attention are both there."""
    if not torch.cuda.is_available():
        return False
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def gdn_fla(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.gdn_reference`'s contract on fla: the chunked kernel from 64 rows up, the fused
    recurrent one below (decode steps); l2norm, scale and grouped value heads in the kernel."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    rule = chunk_gated_delta_rule if q.shape[0] >= 64 else fused_recurrent_gated_delta_rule
    out, new = rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    return out[0], new[0]


def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """`ops.attention`'s contract on torch SDPA (flash or memory-efficient backend), GQA in the kernel."""
    from torch.nn.attention.bias import causal_lower_right

    t, length = q.shape[1], k.shape[1]
    kwargs = {"scale": scale, "enable_gqa": True}
    if t == 1:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], **kwargs)
    elif t == length:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, **kwargs)
    else:
        out = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=causal_lower_right(t, length), **kwargs
        )
    return out[0].transpose(0, 1)


FAST = ops.Kernels(name="fla", gdn=gdn_fla, conv=ops.causal_conv, attention=attention_sdpa)


def pick(name: str, device: str) -> ops.Kernels:
    """'reference', 'fast', or 'auto' (fast on CUDA when fla is installed)."""
    from shadow.errors import ShadowInputError

    if name == "reference":
        return ops.REFERENCE
    if name == "fast" or (name == "auto" and device.startswith("cuda") and available()):
        if not available():
            raise ShadowInputError("the fast kernels need CUDA and flash-linear-attention (pip install fla-core)")
        return FAST
    if name == "auto":
        return ops.REFERENCE
    raise ShadowInputError(f"unknown kernels {name!r} (auto, reference, fast)")
