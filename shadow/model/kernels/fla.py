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
    a_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, layout=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gdn_fla_gated` for B entries' chunks in one call, the entry as fla's batch dimension
    (q [B, T, H, K], state [B, Hv, K, V]). fla's programs each take one (entry, head) or one
    (entry, chunk, head), and its autotuning keys hold neither B nor T, so an entry's bits do not
    depend on the others while the in-kernel l2norm and gate stay in one row bucket (B * T * H up
    to 65,536: `reference.GDN_BATCH_HEAD_ROWS`); tests/test_gpu.py checks it bit for bit.

    With a `layout.LayoutTensors`, a run of entries is one sequence (`gdn_fla_runs`)."""
    if layout is not None and q.shape[1] >= 64:
        return gdn_fla_runs(q, k, v, a, b, a_log, dt_bias, state, layout)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    rule = chunk_gated_delta_rule if q.shape[1] >= 64 else fused_recurrent_gated_delta_rule
    return rule(
        q, k, v, g=a, beta=b, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True,
    )


def gdn_fla_runs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    a_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, layout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gdn_fla_gated_batch` where a run of consecutive entries is one sequence: fla's chunked
    rule taken step by step as its `chunk_gated_delta_rule` takes it (q and k l2-normalised, beta's
    sigmoid, the gate's chunk cumsum, the WY form, the state pass, the output), every step on the
    B entries as its batch but the state pass, which runs over the runs as variable-length
    sequences (`layout.cu_seqlens`, B of them: the runs, then empty ones). Every step but the state
    pass is local to a 64-row block; the state pass carries a run's state from one entry to the
    next in float32 as it does from one block to the next, and its offsets come from device
    tensors, so one CUDA graph serves every layout. state: [B, Hv, K, V], sequence j's initial
    state; returns (out [B, T, Hv, V], final states [B, ...] by sequence)."""
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.common.gate import fused_beta_sigmoid
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.gated_delta_rule.gate import gdn_gate_chunk_cumsum
    from fla.ops.utils.constant import RCP_LN2

    entries, t, hv = v.shape[0], v.shape[1], v.shape[2]
    q, k, v, a, b, state = (x.contiguous() for x in (q, k, v, a, b, state))
    scale = k.shape[-1] ** -0.5
    with torch.cuda.device(q.device.index):
        q, _ = l2norm_fwd(q)
        k, _ = l2norm_fwd(k)
        beta = fused_beta_sigmoid(b, scale=1.0)
        g = gdn_gate_chunk_cumsum(g=a, A_log=a_log, chunk_size=64, scale=RCP_LN2, dt_bias=dt_bias)
        w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, chunk_size=64)
        flat = entries * t
        h, v_new, final = chunk_gated_delta_rule_fwd_h(
            k=k.view(1, flat, *k.shape[2:]), w=w.view(1, flat, *w.shape[2:]), u=u.view(1, flat, *u.shape[2:]),
            g=g.view(1, flat, hv), initial_state=state, output_final_state=True, chunk_size=64,
            cu_seqlens=layout.cu_seqlens, chunk_indices=_chunk_count(flat // 64, q.device),
            chunk_offsets=layout.chunk_offsets,
        )
        o = chunk_fwd_o(q=q, k=k, v=v_new.view(v.shape), h=h.view(entries, t // 64, *h.shape[2:]), g=g,
                        scale=scale, chunk_size=64)
    return o.to(q.dtype), final


_chunk_counts: dict[tuple[int, torch.device], torch.Tensor] = {}


def _chunk_count(chunks: int, device: torch.device) -> torch.Tensor:
    """A tensor of `chunks` rows: fla's state pass takes the number of 64-row blocks from its
    `chunk_indices`' length (and reads nothing else of it), so one is kept a size."""
    key = (chunks, device)
    if key not in _chunk_counts:
        _chunk_counts[key] = torch.zeros(chunks, 2, dtype=torch.long, device=device)
    return _chunk_counts[key]


def gated_rms_norm_fla(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`reference.gated_rms_norm`'s contract as one fla kernel (norm, weight, silu gate)."""
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    shape = x.shape
    out = rms_norm_gated(x.reshape(-1, shape[-1]), gate.reshape(-1, shape[-1]), weight, None, "swish", eps=eps)
    return out.reshape(shape)
