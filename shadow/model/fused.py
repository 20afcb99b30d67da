"""The forward's steps fused: merged projections and one-launch kernels, for the fast path.

Per GDN layer one GEMM computes q, k, v, z, b and a together (`in_proj`), one kernel runs the
causal conv, splits q, k, v and copies z, b, a out contiguous, flash-linear-attention computes
the decay and beta inside its kernel, and the MLP's gate and up projections are one GEMM
followed by one SwiGLU kernel. Per
attention layer one GEMM computes q (with its gate), k and v, one kernel per tensor runs the
head norm and RoPE, and one kernel gates the attended rows. Every residual add runs in one kernel
with the norm that reads its sum (the MLP's, the next layer's input norm, or the final norm).
Norm weights (1 + w) are prepared once.

The merged weights are built from the loaded model once; the modules' own weights become views
into them, so the model holds no second copy and its plain steps still see the same values.
The arithmetic differs from `ModuleSteps` (one rounding where the modules round several times),
so this is a kernel set of its own (`fla-fused`): exact against itself, close to the reference.
On CUDA the one-launch kernels are Triton's (`kernels.triton`); elsewhere their PyTorch twins
(`kernels.twins`, for tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shadow.model.kernels.reference import GDN_BATCH_HEAD_ROWS
from shadow.model.layout import Layout, LayoutTensors
from shadow.model.qwen35 import blocks
from shadow.model.rope import rope_tables
from shadow.model.state import DeltaState


def _merge(linears: list[nn.Linear]) -> torch.Tensor:
    """One weight [sum of outputs, in] for several projections of the same rows; each module's
    weight becomes a view into it (same values, no second copy)."""
    merged = torch.cat([lin.weight.data for lin in linears], dim=0)
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = merged[row : row + n]
        row += n
    return merged


def _norm_weight(norm: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    return (1.0 + norm.weight.float()).to(dtype)


@dataclass
class _Mlp:
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class _Gdn:
    input_norm: torch.Tensor
    in_proj: torch.Tensor  # [conv_dim + value_dim + 2 Hv, hidden]: qkv, z, b, a
    conv_weight: torch.Tensor  # [conv_dim, K]
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    norm_weight: torch.Tensor
    out_proj: torch.Tensor
    mlp: _Mlp


@dataclass
class _Attention:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [Hq 2D + 2 Hkv D, hidden]: q with its gate, k, v
    q_norm: torch.Tensor  # float32 1 + w
    k_norm: torch.Tensor
    o_proj: torch.Tensor
    mlp: _Mlp


class FusedSteps:
    """`ModuleSteps`' five steps with merged projections; same shapes and state contract.

    One norm is carried from a step to the next (`_normed`: the sum a residual add made, the
    weight, its norm); a step handed any other x computes the norm itself, with the same bits,
    so forwards that interleave (forks, other row counts) stay correct."""

    def __init__(self, model, one_launch):
        """`model`: a loaded `Qwen35`; `one_launch`: the module of one-launch kernels to call,
        `kernels.triton` on CUDA or `kernels.twins` elsewhere (`runtime.steps_for` chooses)."""
        self.model = model
        c, dtype = model.config, model.dtype
        self.c = c
        self.kernels = model.kernels
        self.key_dim = c.linear_num_key_heads * c.linear_key_head_dim
        self.one_launch = one_launch
        self.layers: list[_Gdn | _Attention] = []
        for layer in model.layers:
            mlp = _Mlp(_norm_weight(layer.post_attention_layernorm, dtype),
                       _merge([layer.mlp.gate_proj, layer.mlp.up_proj]), layer.mlp.down_proj.weight)
            if layer.kind == "full_attention":
                a = layer.self_attn
                self.layers.append(_Attention(
                    _norm_weight(layer.input_layernorm, dtype), _merge([a.q_proj, a.k_proj, a.v_proj]),
                    1.0 + a.q_norm.weight.float(), 1.0 + a.k_norm.weight.float(), a.o_proj.weight, mlp))
            else:
                g = layer.linear_attn
                self.layers.append(_Gdn(
                    _norm_weight(layer.input_layernorm, dtype),
                    _merge([g.in_proj_qkv, g.in_proj_z, g.in_proj_b, g.in_proj_a]),
                    g.conv1d.weight.squeeze(1).contiguous(), g.A_log, g.dt_bias, g.norm.weight,
                    g.out_proj.weight, mlp))
        self.final_norm = _norm_weight(model.norm, dtype)
        # the norm that reads layer i's output: layer i + 1's input norm, the final norm after the last
        self.next_norm = [layer.input_norm for layer in self.layers[1:]] + [self.final_norm]
        self._normed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # x, weight, norm

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The RMSNorm of x with weight: the one the step before computed with its residual add
        (when handed that same x, for that weight), or computed now; the same bits either way."""
        left, self._normed = self._normed, None
        if left is not None and left[0] is x and left[1] is weight:
            return left[2]
        return self.one_launch.add_rms_norm(x, None, weight, self.c.rms_norm_eps)[1]

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.one_launch.add_rms_norm(x, delta, weight, self.c.rms_norm_eps)

    # the steps ---------------------------------------------------------------------------------

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rotary_dim] in float32 (the norm-and-rope kernel rounds once, after)."""
        return rope_tables(self.c, positions, torch.float32)

    def _residual_and_mlp(self, i: int, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """x + delta (the mixer's output), then the MLP and its residual. Each residual add runs in
        one kernel with the norm that reads its result: the MLP's, then the next layer's input
        norm (or the final norm), which is left for `_norm` to hand to the next step."""
        w = self.layers[i].mlp
        x, normed = self._add_norm(x, delta, w.post_norm)
        down = F.linear(self.one_launch.swiglu(F.linear(normed, w.gate_up)), w.down)
        following = self.next_norm[i]
        x, normed = self._add_norm(x, down, following)
        self._normed = (x, following, normed)
        return x

    def batched_rule(self, rows: int, b: int) -> bool:
        """Whether a GDN layer of `b` entries and `rows` rows in all runs its convs in one launch and
        its rules in one call (then a layout reaches the kernels as device tensors, and one CUDA
        graph serves every layout of `b` entries)."""
        c = self.c
        return b > 1 and self.kernels.gdn_gated_batch is not None and \
            rows * max(c.linear_num_value_heads, c.linear_num_key_heads) <= GDN_BATCH_HEAD_ROWS

    def gdn(self, i: int, x: torch.Tensor, states: list[DeltaState], layout: LayoutTensors | None = None) -> torch.Tensor:
        """x [B*T, hidden]: B entries' rows stacked; the conv and the gated delta rule run on each
        session's own state (replaced in place), an entry after the entries before it in its run,
        everything else on the stacked rows. `states`: one an entry (a session's consecutive
        entries share its object); with `layout`, one slot an entry, a session's state in its run's
        first slot, the others spare (`ModuleSteps.gdn`). Where the kernels have a batched rule
        (`batched_rule`), the entries' convs are one launch and their rules one call; otherwise
        both run once an entry."""
        c, w = self.c, self.layers[i]
        proj = F.linear(self._norm(x, w.input_norm), w.in_proj)
        hv = c.linear_num_value_heads
        if self.batched_rule(x.shape[0], len(states)):
            if layout is None:
                states, layout = slots_for(states, x.shape[0] // len(states), x.device)
            out = self._gdn_batch(w, proj, states, layout)
            return self._residual_and_mlp(i, x, F.linear(out, w.out_proj))
        if layout is not None:
            states = [states[h] for h in layout.layout.home]
        outs = []
        for proj_b, state in zip(blocks(proj, len(states)), states):
            t = proj_b.shape[0]
            q, k, v, z, b, a, conv = self.one_launch.conv_split(proj_b, state.conv, w.conv_weight, self.key_dim,
                                                                c.value_dim, hv)
            out, recurrent = self.kernels.gdn_gated(
                q.view(t, c.linear_num_key_heads, c.linear_key_head_dim),
                k.view(t, c.linear_num_key_heads, c.linear_key_head_dim),
                v.view(t, hv, c.linear_value_head_dim), a, b, w.a_log, w.dt_bias, state.recurrent,
            )
            state.conv.copy_(conv)
            state.recurrent.copy_(recurrent)
            # normed per entry, on its output as the rule left it (see `GatedDeltaNet.forward`)
            outs.append(self.kernels.gated_norm(out.to(x.dtype), z.reshape(t, hv, c.linear_value_head_dim),
                                                w.norm_weight, c.rms_norm_eps))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self._residual_and_mlp(i, x, F.linear(out.reshape(x.shape[0], c.value_dim), w.out_proj))

    def _gdn_batch(self, w, proj: torch.Tensor, slots: list[DeltaState], layout: LayoutTensors) -> torch.Tensor:
        """`gdn`'s conv, rule and gated norm for B entries' stacked rows in one conv launch and one
        rule call; `slots` and `layout` as `gdn` takes them. An entry that continues its run
        convolves from the last rows of the entry before it (what that entry's conv state would
        hold); each run's rule starts from its first slot's state, and its final conv and
        recurrent state go back there. Every step reads the layout as device tensors (no host
        value), so a CUDA graph of it serves every layout. Returns [B*T, value_dim]."""
        c, b = self.c, len(slots)
        t, hv, hk = proj.shape[0] // b, c.linear_num_value_heads, c.linear_num_key_heads
        width = c.linear_conv_kernel_dim - 1
        conv_state = torch.stack([s.conv for s in slots])
        before = proj[:, : c.conv_dim].view(b, t, c.conv_dim)[:, t - width :].roll(1, 0).transpose(1, 2)
        conv_state = torch.where(layout.continues.bool(), before, conv_state)
        q, k, v, z, beta, a, conv = self.one_launch.conv_split(proj, conv_state.contiguous(), w.conv_weight,
                                                               self.key_dim, c.value_dim, hv)
        start = torch.stack([s.recurrent for s in slots]).index_select(0, layout.start_slot)
        out, recurrent = self.kernels.gdn_gated_batch(
            q.view(b, t, hk, c.linear_key_head_dim), k.view(b, t, hk, c.linear_key_head_dim),
            v.view(b, t, hv, c.linear_value_head_dim), a.view(b, t, hv), beta.view(b, t, hv), w.a_log, w.dt_bias,
            start, layout,
        )
        recurrent = torch.empty_like(recurrent).index_copy_(0, layout.start_slot, recurrent)
        conv = torch.empty_like(conv).index_copy_(0, layout.start_slot, conv.index_select(0, layout.last_entry))
        for j, state in enumerate(slots):
            state.conv.copy_(conv[j])
            state.recurrent.copy_(recurrent[j])
        # normed in one call: a row's bits do not depend on the rows beside it while the batch stays
        # in the rule's row bucket (fla's gated norm buckets rows as its l2norm does)
        dv = c.linear_value_head_dim
        normed = self.kernels.gated_norm(out.reshape(b * t, hv, dv).to(proj.dtype), z.view(b * t, hv, dv),
                                         w.norm_weight, c.rms_norm_eps)
        return normed.reshape(b * t, c.value_dim)

    def attention_in(self, i: int, x: torch.Tensor, rope) -> tuple[torch.Tensor, ...]:
        c, w, t = self.c, self.layers[i], x.shape[0]
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        proj = F.linear(self._norm(x, w.input_norm), w.qkv)
        q_gate = proj[:, : hq * 2 * d].view(t, hq, 2 * d)
        eps = c.rms_norm_eps
        q = self.one_launch.norm_rope(q_gate[..., :d], w.q_norm, *rope, eps)
        k = self.one_launch.norm_rope(proj[:, hq * 2 * d : (hq * 2 + hkv) * d].view(t, hkv, d), w.k_norm, *rope, eps)
        v = proj[:, (hq * 2 + hkv) * d :].view(t, hkv, d).transpose(0, 1)
        return q, k, v, q_gate[..., d:]  # the gate [T, Hq, D]: a view, read in place by attention_out

    def attention_out(self, i: int, x: torch.Tensor, attended: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self._residual_and_mlp(i, x, F.linear(self.one_launch.gate_mul(attended, gate), self.layers[i].o_proj))

    def final(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x, self.final_norm)


def slots_for(states: list[DeltaState], t: int, device: torch.device) -> tuple[list[DeltaState], LayoutTensors]:
    """One slot an entry for `states` (one an entry, a session's consecutive entries sharing its
    object): a session's own state in its run's first slot, a scratch state in each spare one;
    and their layout as device tensors (an eager forward's; the piecewise forward keeps both)."""
    layout = Layout.of(states)
    tensors = LayoutTensors(len(states), t, device)
    tensors.set(layout)
    homes = {first for first, _ in layout.firsts_and_runs}
    slots = [state if e in homes else DeltaState(torch.zeros_like(state.conv), torch.zeros_like(state.recurrent))
             for e, state in enumerate(states)]
    return slots, tensors
