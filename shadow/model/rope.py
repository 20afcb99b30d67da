"""Rotary position embedding for Qwen3.5 text: partial RoPE on the first rotary_dim features
(text-only M-RoPE reduces to plain RoPE)."""

from __future__ import annotations

import torch

from shadow.model.config import ModelConfig


def rope_tables(c: ModelConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rotary_dim] for absolute positions; text-only M-RoPE is plain RoPE."""
    dim = c.rotary_dim
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim features of x [T, H, D]; the rest pass through."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)
