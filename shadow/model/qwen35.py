"""The project's own Qwen3.5 text forward with explicit state.

Parameter names follow the Hugging Face text model (`embed_tokens`, `layers.N.linear_attn.*`,
`layers.N.self_attn.*`, `layers.N.mlp.*`, `norm`, `lm_head`), so a checkpoint loads with
`load_state_dict` once its prefix is stripped. No batch dimension: the rows of one session, or of
several chunks stacked (`forward_batch`: B entries of T rows each, an entry one session's chunk,
a session's consecutive entries its next chunks), for which every row-wise step (projections,
norms, MLPs) runs on the stacked rows and every step with state (the GDN conv and recurrence,
attention over the session's own rows) runs per entry, in order along a session.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from shadow.model.config import ModelConfig
from shadow.model.kernels.reference import REFERENCE, Kernels, attention_batch_each, rms_norm
from shadow.model.layout import Layout, LayoutTensors
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

    def forward(self, x: torch.Tensor, states: list[DeltaState], kernels: Kernels) -> torch.Tensor:
        """x [B*T, hidden]: B entries' rows stacked, `states` theirs in order (a session's
        consecutive entries share its state object); each entry's conv and recurrence run on its
        own rows from its session's state as the entries before it left it (replaced in place)."""
        c, n = self.c, x.shape[0]
        qkv = self.in_proj_qkv(x)
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        z = self.in_proj_z(x).reshape(n, c.linear_num_value_heads, c.linear_value_head_dim)
        key_dim = c.linear_num_key_heads * c.linear_key_head_dim
        outs = []
        # the gated norm runs on each session's own output as the recurrence left it (a strided
        # view: a norm's reduction over a strided row is summed in another order than over a
        # contiguous one, so the stacked rows would not give the bits one session's rows give)
        for (qkv_b, g_b, beta_b, z_b), state in zip(zip(*(blocks(t, len(states)) for t in (qkv, g, beta, z))), states):
            mixed, conv = kernels.conv(qkv_b, state.conv, self.conv1d.weight.squeeze(1))
            t = mixed.shape[0]
            q, k, v = mixed.split([key_dim, key_dim, c.value_dim], dim=-1)
            q = q.reshape(t, c.linear_num_key_heads, c.linear_key_head_dim)
            k = k.reshape(t, c.linear_num_key_heads, c.linear_key_head_dim)
            v = v.reshape(t, c.linear_num_value_heads, c.linear_value_head_dim)
            out, recurrent = kernels.gdn(q, k, v, g_b, beta_b, state.recurrent)
            state.conv.copy_(conv)
            state.recurrent.copy_(recurrent)
            outs.append(kernels.gated_norm(out.to(x.dtype), z_b, self.norm.weight, c.rms_norm_eps))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.out_proj(out.reshape(n, c.value_dim))


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


def entry_starts(states: list, t: int) -> list[int]:
    """The first row of each entry: a state's `length` for its first entry, T rows further for each
    next one of its run (`layout.Layout.of` refuses a state in two runs)."""
    layout = Layout.of(states)
    return [states[first].length + offset for (first, n) in layout.firsts_and_runs for offset in range(0, n * t, t)]


def blocks(x: torch.Tensor, b: int, dim: int = 0) -> list[torch.Tensor]:
    """`x` cut along `dim` into `b` equal blocks of rows (one session's each); [x] itself for one."""
    return [x] if b == 1 else list(x.chunk(b, dim=dim))


def attend_each(states: list[AttentionState], starts: list[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kernels: Kernels, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """B entries' stacked rows (q [Hq, B*T, D], k, v [Hkv, B*T, D]): each entry's new k, v stored
    at rows start.. of its session's buffer, then its rows attended over exactly the rows valid up
    to its own (a session's later entry sees its earlier ones' new rows); the attended rows
    [B*T, Hq, D] stacked in the same order (into `out` where given). Never inside a CUDA graph: a
    buffer is its session's and may move when it grows."""
    t = q.shape[1] // len(states)
    for state, start in zip(states, starts, strict=True):
        state.reserve(start + t)
    batch = kernels.attention_batch or partial(attention_batch_each, kernels.attention)
    return batch(q, [s.k for s in states], [s.v for s in states], [start + t for start in starts],
                 q.shape[-1] ** -0.5, (k, v), out)


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

    def gdn(self, i: int, x: torch.Tensor, states: list[DeltaState], layout: LayoutTensors | None = None) -> torch.Tensor:
        """Layer i (a GDN layer) whole: x [B*T, hidden] -> x (B entries' rows); replaces each
        session's conv and recurrent state. `states`: one an entry (a session's consecutive
        entries share its object); with `layout`, one slot an entry, a session's state in its
        run's first slot (`layout.Layout.home`), the others spare."""
        if layout is not None:
            states = [states[h] for h in layout.layout.home]
        layer = self.model.layers[i]
        x = x + layer.linear_attn(layer.input_layernorm(x), states, self.model.kernels)
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
        return self.forward_batch(ids, [state])

    @torch.no_grad()
    def forward_batch(self, ids: torch.Tensor, states: list[ModelState]) -> torch.Tensor:
        """B entries of T ids each, stacked (ids [B*T], `states` in the same order): an entry is a
        session's next T ids, and a state named by consecutive entries reads their ids one after
        another (its next chunks). Each entry is read at its own rows (a session's first at
        state.length, its next T rows on): the final-norm hidden rows [B*T, hidden], stacked.
        Each state comes out as `forward` of its own ids, chunk by chunk, alone would leave it,
        as long as every row-wise kernel gives a row the same bits with B*T rows as with T (the
        kernel sets are tested so at the shapes they run)."""
        steps, b = self.steps, len(states)
        t = ids.shape[0] // b
        if t * b != ids.shape[0]:
            raise ValueError(f"{ids.shape[0]} ids do not split into {b} chunks of one length")
        starts = entry_starts(states, t)
        x = steps.embed(ids)
        positions = [torch.arange(start, start + t, device=ids.device) for start in starts]
        rope = steps.rope(positions[0] if b == 1 else torch.cat(positions))
        for i, layer in enumerate(self.layers):
            layer_states = [s.layers[i] for s in states]
            if layer.kind == "full_attention":
                q, k, v, gate = steps.attention_in(i, x, rope)
                x = steps.attention_out(i, x, attend_each(layer_states, starts, q, k, v, self.kernels), gate)
            else:
                x = steps.gdn(i, x, layer_states)
        for s, start in zip(states, starts):  # a session's last entry sets its length
            s.length = start + t
        return steps.final(x)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [T, vocab] for hidden rows [T, hidden]."""
        head = self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, head).float()
