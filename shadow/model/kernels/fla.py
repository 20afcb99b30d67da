"""flash-linear-attention's kernels behind the reference contracts (`reference`): the gated
delta rule (the gate computed in the kernel or before it) and the gated RMSNorm.

Exactness rests on determinism: fla's Triton kernels are autotuned once per shape and the choice
is cached (FLA_CACHE_RESULTS=1, under TRITON_CACHE_DIR), so later calls and later processes on
the machine run the same configs; where the project holds a recording for the GPU (`pins`), the
choices are pinned from it (`runtime.pin_autotuning`), so a cleared cache changes nothing. The
FlashQLA backend is switched off (FLA_FLASH_QLA=0) so one backend computes every chunk.
"""

from __future__ import annotations

import os

import torch

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
    """`reference.gdn_reference`'s contract on fla: the chunked kernel from 64 rows up, the fused
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
    """`reference.gdn_gated_reference`'s contract on fla: the decay and beta computed inside its kernels
    from the raw projections a, b (chunked from 64 rows up, fused recurrent below)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    rule = chunk_gated_delta_rule if q.shape[0] >= 64 else fused_recurrent_gated_delta_rule
    out, new = rule(
        q[None], k[None], v[None], g=a[None], beta=b[None], initial_state=state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        A_log=a_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True,
    )
    return out[0], new[0]


def gdn_fla_gated_batch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    a_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gdn_fla_gated` for B sessions' chunks in one call, the session as fla's batch dimension
    (q [B, T, H, K], state [B, Hv, K, V]). fla's programs each take one (session, head) or one
    (session, chunk, head), and its autotuning keys hold neither B nor T, so a session's bits do
    not depend on the others while the in-kernel l2norm and gate stay in one row bucket (B * T
    * H up to 65,536: `reference.GDN_BATCH_HEAD_ROWS`); tests/test_gpu.py checks it bit for bit."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    rule = chunk_gated_delta_rule if q.shape[1] >= 64 else fused_recurrent_gated_delta_rule
    return rule(
        q, k, v, g=a, beta=b, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True,
    )


def gated_rms_norm_fla(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`reference.gated_rms_norm`'s contract as one fla kernel (norm, weight, silu gate)."""
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    shape = x.shape
    out = rms_norm_gated(x.reshape(-1, shape[-1]), gate.reshape(-1, shape[-1]), weight, None, "swish", eps=eps)
    return out.reshape(shape)
