"""The project's own Qwen3.5 text forward with explicit state.

Parameter names follow the Hugging Face text model (`embed_tokens`, `layers.N.linear_attn.*`,
`layers.N.self_attn.*`, `layers.N.mlp.*`, `norm`, `lm_head`), so a checkpoint loads with
`load_state_dict` once its prefix is stripped. No batch dimension: one session, T new rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shadow.model.config import ModelConfig
from shadow.model.kernels.reference import REFERENCE, Kernels, rms_norm
from shadow.model.rope import apply_rope, rope_tables
from shadow.model.state import AttentionState, DeltaState, ModelState


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Norm(nn.Module):
    """Zero-centred RMSNorm (`x * (1 + w)`); `kernel` is the model's kernel set's norm."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.kernel = rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        key_dim = c.linear_num_key_heads * c.linear_key_head_dim
        self.in_proj_qkv = nn.Linear(c.hidden_size, 2 * key_dim + c.value_dim, bias=False)
        self.in_proj_z = nn.Linear(c.hidden_size, c.value_dim, bias=False)
        self.in_proj_b = nn.Linear(c.hidden_size, c.linear_num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(c.hidden_size, c.linear_num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.linear_conv_kernel_dim, groups=c.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(c.linear_num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(c.linear_num_value_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(c.linear_value_head_dim))
        self.out_proj = nn.Linear(c.value_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, state: DeltaState, kernels: Kernels) -> torch.Tensor:
        c, t = self.c, x.shape[0]
        mixed, conv = kernels.conv(self.in_proj_qkv(x), state.conv, self.conv1d.weight.squeeze(1))
        key_dim = c.linear_num_key_heads * c.linear_key_head_dim
        q, k, v = mixed.split([key_dim, key_dim, c.value_dim], dim=-1)
        q = q.reshape(t, c.linear_num_key_heads, c.linear_key_head_dim)
        k = k.reshape(t, c.linear_num_key_heads, c.linear_key_head_dim)
        v = v.reshape(t, c.linear_num_value_heads, c.linear_value_head_dim)
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        out, recurrent = kernels.gdn(q, k, v, g, beta, state.recurrent)
        state.conv.copy_(conv)
        state.recurrent.copy_(recurrent)
        z = self.in_proj_z(x).reshape(t, c.linear_num_value_heads, c.linear_value_head_dim)
        out = kernels.gated_norm(out.to(x.dtype), z, self.norm.weight, c.rms_norm_eps)
        return self.out_proj(out.reshape(t, c.value_dim))


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, 2 * c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = Norm(c.head_dim, c.rms_norm_eps)
        self.k_norm = Norm(c.head_dim, c.rms_norm_eps)

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """q [Hq, T, D] (normed, rotated), k, v [Hkv, T, D], gate [T, Hq * D] from normed rows x [T, hidden]."""
        c, t = self.c, x.shape[0]
        q, gate = self.q_proj(x).view(t, c.num_attention_heads, 2 * c.head_dim).chunk(2, dim=-1)
        q = apply_rope(self.q_norm(q), *rope).transpose(0, 1)
        k = apply_rope(self.k_norm(self.k_proj(x).view(t, c.num_key_value_heads, c.head_dim)), *rope)
        v = self.v_proj(x).view(t, c.num_key_value_heads, c.head_dim)
        return q, k.transpose(0, 1), v.transpose(0, 1), gate.reshape(t, -1)

    def output(self, attended: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o_proj of the attended rows [T, Hq, D], gated by sigmoid(gate)."""
        return self.o_proj(attended.reshape(gate.shape) * torch.sigmoid(gate))


def attend(
    state: AttentionState, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    kernels: Kernels,
) -> torch.Tensor:
    """Store the new rows' k, v at rows start.. of the session's buffer and attend over exactly
    the valid rows. Never inside a CUDA graph: the buffer is the session's and may move."""
    state.write(start, k, v)
    end = start + q.shape[1]
    return kernels.attention(q, state.k[:, :end], state.v[:, :end], q.shape[-1] ** -0.5)


class Layer(nn.Module):
    def __init__(self, c: ModelConfig, kind: str):
        super().__init__()
        self.kind = kind
        if kind == "full_attention":
            self.self_attn = Attention(c)
        else:
            self.linear_attn = GatedDeltaNet(c)
        self.mlp = MLP(c)
        self.input_layernorm = Norm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = Norm(c.hidden_size, c.rms_norm_eps)


class ModuleSteps:
    """The forward's steps as the modules compute them (the reference arithmetic, any kernel set).

    A steps object is what the forward and `PiecewiseForward` call between attention layers; the
    fused one (`fused.FusedSteps`) offers the same five steps with merged projections."""

    def __init__(self, model: Qwen35):
        self.model = model

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.model.config, positions, self.model.dtype)

    def gdn(self, i: int, x: torch.Tensor, state: DeltaState) -> torch.Tensor:
        """Layer i (a GDN layer) whole: x [T, hidden] -> x; replaces its conv and recurrent state."""
        layer = self.model.layers[i]
        x = x + layer.linear_attn(layer.input_layernorm(x), state, self.model.kernels)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def attention_in(self, i: int, x: torch.Tensor, rope) -> tuple[torch.Tensor, ...]:
        """Attention layer i up to attention: q [Hq, T, D], k, v [Hkv, T, D], and the gate, which
        callers hand back to `attention_out` as it is ([T, Hq * D] here; the fused steps' differs)."""
        layer = self.model.layers[i]
        return layer.self_attn.project(layer.input_layernorm(x), rope)

    def attention_out(self, i: int, x: torch.Tensor, attended: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Attention layer i after attention (attended [T, Hq, D]): the output projection and the MLP."""
        layer = self.model.layers[i]
        x = x + layer.self_attn.output(attended, gate)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def final(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.norm(x)


class Qwen35(nn.Module):
    """Qwen3.5 text model. `forward(ids, state)` reads ids at rows state.length.. and advances the state."""

    def __init__(self, config: ModelConfig, kernels: Kernels = REFERENCE):
        super().__init__()
        self.config = config
        self.kernels = kernels
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Layer(config, kind) for kind in config.layer_types])
        self.norm = Norm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, Norm):
                module.kernel = kernels.norm
        # what the forward calls between attention layers: the modules' own steps, unless the
        # runtime gives the fused ones (`runtime.load_model`, once the weights are loaded)
        self.steps = ModuleSteps(self)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_state(self) -> ModelState:
        return ModelState(self.config, self.dtype, self.device)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, state: ModelState) -> torch.Tensor:
        """Read ids [T] at absolute rows state.length .. +T; returns final-norm hidden rows [T, hidden].

        Writes KV rows and replaces the GDN state in place; state.length grows by T.
        """
        steps, start = self.steps, state.length
        x = steps.embed(ids)
        rope = steps.rope(torch.arange(start, start + ids.shape[0], device=ids.device))
        for i, (layer, layer_state) in enumerate(zip(self.layers, state.layers)):
            if layer.kind == "full_attention":
                q, k, v, gate = steps.attention_in(i, x, rope)
                x = steps.attention_out(i, x, attend(layer_state, start, q, k, v, self.kernels), gate)
            else:
                x = steps.gdn(i, x, layer_state)
        state.length = start + ids.shape[0]
        return steps.final(x)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [T, vocab] for hidden rows [T, hidden]."""
        head = self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, head).float()
