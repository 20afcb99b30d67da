"""Attention on CUDA behind `reference.attention`'s contract: torch SDPA (flash or memory-efficient
backend, never cuDNN) and the project's Triton chunk attention (`triton_attention`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from shadow.model.kernels import reference


SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]  # never cuDNN (attention_sdpa)
CHUNK_ATTENTION_ROWS = 16  # from this many query rows up, attention_triton runs the Triton chunk kernel


def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """`reference.attention`'s contract on torch SDPA (flash or memory-efficient backend), GQA in the kernel.

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
    """`reference.attention`'s contract: the project's Triton chunk attention (`triton_attention`) from
    CHUNK_ATTENTION_ROWS rows up (chunks, asks), SDPA below (decode steps)."""
    if q.shape[1] < CHUNK_ATTENTION_ROWS:
        return attention_sdpa(q, k, v, scale)
    from shadow.model.kernels.triton_attention import chunk_attention

    return chunk_attention(q, k, v, scale)


def attention_batch_triton(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], lengths: list[int],
                           scale: float, new: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """`Kernels.attention_batch`'s contract: from CHUNK_ATTENTION_ROWS rows a session up, all the
    sessions' new rows written and attended in one launch each (`triton_attention.attend_sessions`,
    a session's bits what `attention_triton` gives it alone); below, each on its own as there."""
    t = q.shape[1] // len(ks)
    if t >= CHUNK_ATTENTION_ROWS:
        from shadow.model.kernels.triton_attention import attend_sessions

        return attend_sessions(q, ks, vs, lengths, scale, new=new, out=out)
    return reference.attention_batch_each(attention_triton, q, ks, vs, lengths, scale, new, out)


def warm_attention_triton(heads: int, kv_heads: int, head_dim: int, rows, dtype: torch.dtype,
                          device: torch.device) -> int:
    """`attention_triton`'s kernels compiled for every row count in `rows` it runs Triton at, at
    every key length (the kernels specialise on the row count alone), so no first call at a new
    length compiles mid-stream. Returns the launches."""
    from shadow.model.kernels import triton_attention

    chunked = sorted(t for t in set(rows) if t >= CHUNK_ATTENTION_ROWS)
    return triton_attention.warm(heads, kv_heads, head_dim, chunked, dtype, device)
