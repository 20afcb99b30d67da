"""The fast kernel sets for CUDA: flash-linear-attention's gated delta rule; SDPA or Triton attention.

Same contracts as the reference set in `ops`. Exactness rests on determinism: fla's Triton
kernels are autotuned once per shape and the choice is cached (FLA_CACHE_RESULTS=1, under
TRITON_CACHE_DIR), so later calls and later processes on the machine run the same configs; where
the project holds a recording for the GPU (`autotune_pins`), the choices are pinned from it, so a
cleared cache changes nothing. The FlashQLA backend is switched off (FLA_FLASH_QLA=0) so one
backend computes every chunk.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

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


def gdn_fla_gated(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    a_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.gdn_gated_reference`'s contract on fla: the decay and beta computed inside its kernels
    from the raw projections a, b (chunked from 64 rows up, fused recurrent below)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    rule = chunk_gated_delta_rule if q.shape[0] >= 64 else fused_recurrent_gated_delta_rule
    out, new = rule(
        q[None], k[None], v[None], g=a[None], beta=b[None], initial_state=state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        A_log=a_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True,
    )
    return out[0], new[0]


SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]  # never cuDNN (attention_sdpa)
CHUNK_ATTENTION_ROWS = 16  # from this many query rows up, attention_triton runs the Triton chunk kernel


def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """`ops.attention`'s contract on torch SDPA (flash or memory-efficient backend), GQA in the kernel.

    Never cuDNN: torch builds a cuDNN graph for each new key length, tens of milliseconds, and a
    decode step has a new length every time (measured in docs/BENCHMARKS.md, the A/B section)."""
    from torch.nn.attention.bias import causal_lower_right

    t, length = q.shape[1], k.shape[1]
    kwargs = {"scale": scale, "enable_gqa": True}
    with sdpa_kernel(SDPA_BACKENDS):
        if t == 1:
            out = F.scaled_dot_product_attention(q[None], k[None], v[None], **kwargs)
        elif t == length:
            out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, **kwargs)
        else:
            out = F.scaled_dot_product_attention(
                q[None], k[None], v[None], attn_mask=causal_lower_right(t, length), **kwargs
            )
    return out[0].transpose(0, 1)


def attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """`ops.attention`'s contract: the project's Triton chunk attention (`triton_attention`) from
    CHUNK_ATTENTION_ROWS rows up (chunks, asks), SDPA below (decode steps)."""
    if q.shape[1] < CHUNK_ATTENTION_ROWS:
        return attention_sdpa(q, k, v, scale)
    from shadow.model.triton_attention import chunk_attention

    return chunk_attention(q, k, v, scale)


def causal_conv_rows(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.causal_conv`'s contract computed in the rows' own layout ([T, C], no transposes):
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
    """`ops.rms_norm`'s contract with torch's fused RMSNorm (the reduction in float32 inside)."""
    return F.rms_norm(x, (x.shape[-1],), weight=(1.0 + weight.float()).to(x.dtype), eps=eps)


def gated_rms_norm_fla(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`ops.gated_rms_norm`'s contract as one fla kernel (norm, weight, silu gate)."""
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    shape = x.shape
    out = rms_norm_gated(x.reshape(-1, shape[-1]), gate.reshape(-1, shape[-1]), weight, None, "swish", eps=eps)
    return out.reshape(shape)


# revision 1: fla's autotuning pinned (its configs, and with them the bits, may differ from a tuning)
FAST = ops.Kernels(
    name="fla", gdn=gdn_fla, conv=causal_conv_rows, attention=attention_sdpa,
    norm=rms_norm_fused, gated_norm=gated_rms_norm_fla, gdn_gated=gdn_fla_gated, revision=1,
)
# `fused.FusedSteps` on these kernels; revision 2: also residual adds fused with the norms that read
# them, the attention gate in one kernel
FUSED = dataclasses.replace(FAST, name="fla-fused", fused=True, revision=2)
TRITON = dataclasses.replace(FUSED, name="fla-triton", attention=attention_triton)  # and Triton chunk attention
SETS = {"fast": TRITON, "fla-triton": TRITON, "fla-fused": FUSED, "fla": FAST}


MIN_FAST_HEAD_DIM = 64  # fla 0.6.0 at the tiny preset's 16-dim GDN heads was off by ~12% on the H200


def pick(name: str, device: str, head_dim: int = 128) -> ops.Kernels:
    """'reference'; 'fast' = 'fla-triton' (the fused steps on fla and Triton: merged projections,
    one-launch kernels, Triton chunk attention); 'fla-fused' (the same with SDPA attention); 'fla'
    (fla's kernels inside the modules' own steps, the first fast path); or 'auto' (fast on CUDA
    when fla is installed and the GDN heads are at least MIN_FAST_HEAD_DIM wide, the reference
    kernels otherwise). Picking a fast set pins fla's autotuning (`pin_autotuning`)."""
    from shadow.errors import ShadowInputError

    if name == "reference":
        return ops.REFERENCE
    if name != "auto" and name not in SETS:
        raise ShadowInputError(f"unknown kernels {name!r} (auto, reference, {', '.join(SETS)})")
    wide = head_dim >= MIN_FAST_HEAD_DIM
    if name == "auto" and not (device.startswith("cuda") and available() and wide):
        return ops.REFERENCE
    if not available():
        raise ShadowInputError("the fast kernels need CUDA and flash-linear-attention (pip install fla-core)")
    pin_autotuning()
    return SETS["fast" if name == "auto" else name]


_pinned: int | None = None


def pin_autotuning() -> int:
    """Pin fla's autotuned configs from this GPU's committed recording (`autotune_pins`), once per
    process; returns the keys pinned (0: no recording for this GPU and these versions)."""
    global _pinned
    if _pinned is None:
        from shadow.model import autotune_pins

        _pinned = autotune_pins.apply()
    return _pinned


def pinned() -> int | None:
    """Keys pinned by `pin_autotuning` in this process; None when no fast set was picked."""
    return _pinned
