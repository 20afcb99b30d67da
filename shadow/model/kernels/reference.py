"""Reference kernels: plain, readable PyTorch that runs anywhere (float32 on the CPU).

Every function is a pure function of its inputs: the same inputs at the same shapes give the
same bits, which is what exact grid reading rests on. A fast path (flash-linear-attention on
CUDA) must offer the same signatures; `Kernels` is the seam the model takes.

Shapes use T for the new rows, L for the rows attended over, H for heads, no batch dimension.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

GDN_BLOCK = 64  # the chunk rule's inner block; inputs are zero-padded to a multiple of it


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm, `x * (1 + w)`, computed in float32, returned in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm: RMSNorm(x) * w, then times silu(gate); float32 inside."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * xf.to(dtype)
    return (y * F.silu(gate.float())).to(dtype)


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv with silu, continuing from `state`.

    x: [T, C]; state: [C, K-1], the last K-1 inputs before x (zeros at a session's start);
    weight: [C, K]. Returns (y [T, C], new state [C, K-1]).
    """
    k = weight.shape[-1]
    seq = torch.cat([state.to(x.dtype), x.t()], dim=-1)  # [C, K-1+T]
    y = F.conv1d(seq.unsqueeze(0), weight.unsqueeze(1).to(x.dtype), groups=seq.shape[0]).squeeze(0)
    return F.silu(y).t(), seq[:, seq.shape[-1] - (k - 1):]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over T rows in blocks of 64, from `state`, all in float32.

    q, k: [T, H, Dk] (already l2-normalised, q scaled by Dk^-0.5); v: [T, H, Dv];
    g: [T, H] log-decay (<= 0); beta: [T, H]; state: [H, Dk, Dv].
    Returns (out [T, H, Dv], new state [H, Dk, Dv]). Same maths as `gdn_recurrent`.
    """
    t = q.shape[0]
    pad = (-t) % GDN_BLOCK
    q, k, v = (F.pad(x.float().transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # [H, T', D]
    g, beta = (F.pad(x.float().t(), (0, pad)) for x in (g, beta))  # [H, T']
    h, n = q.shape[0], q.shape[1] // GDN_BLOCK
    q, k, v = (x.reshape(h, n, GDN_BLOCK, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(h, n, GDN_BLOCK), beta.reshape(h, n, GDN_BLOCK)

    decay = g.cumsum(-1)  # log decay from the block start to each row
    future = torch.ones(GDN_BLOCK, GDN_BLOCK, dtype=torch.bool, device=q.device).triu(1)
    pair = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(future, float("-inf")).exp()
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    # Solve the block's delta-rule system (I + tril(A)) U = V, unit lower triangular.
    system = (k_beta @ k.transpose(-1, -2)) * pair
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * decay.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    inner = (q @ k.transpose(-1, -2)) * pair
    q_decayed = q * decay.exp().unsqueeze(-1)
    k_to_end = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    block_decay = decay[..., -1].exp()[..., None, None]

    s = state.float()
    out = torch.empty_like(v)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + inner[:, i] @ v_new
        s = s * block_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(h, n * GDN_BLOCK, -1)[:, :t].transpose(0, 1)
    return out, s


def gdn_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The GDN kernel contract, on raw projections: q, k [T, Hk, Dk] (not normalised), v [T, Hv, Dv],
    g [T, Hv] float32 log-decay, beta [T, Hv], state [Hv, Dk, Dv] float32. l2-normalises q and k,
    scales q by Dk^-0.5, maps value head h to key head h // (Hv / Hk), and runs `gdn_chunked`.
    Returns (out [T, Hv, Dv] float32, new state [Hv, Dk, Dv] float32)."""
    repeat = v.shape[1] // q.shape[1]
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
    q = l2norm(q.float()) * q.shape[-1] ** -0.5
    return gdn_chunked(q, l2norm(k.float()), v, g, beta, state)


def gdn_gated_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    a_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gdn_reference` from the raw gate inputs: a, b [T, Hv] (projections), a_log, dt_bias [Hv];
    the decay g = -exp(a_log) * softplus(a + dt_bias) and beta = sigmoid(b), in float32."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return gdn_reference(q, k, v, g, b.float().sigmoid(), state)


def gdn_gated_each(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    a_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, layout=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`Kernels.gdn_gated_batch`'s contract by `gdn_gated_reference` once an entry, a run's
    entries one after another from the state the one before left (the plain path beside fla's
    one call, for the batched steps' tests)."""
    runs = (1,) * q.shape[0] if layout is None else layout.layout.runs
    outs, finals = [], list(state.unbind(0))
    entry = 0
    for j, n in enumerate(runs):
        s = state[j]
        for e in range(entry, entry + n):
            o, s = gdn_gated_reference(q[e], k[e], v[e], a[e], b[e], a_log, dt_bias, s)
            outs.append(o)
        finals[j] = s
        entry += n
    return torch.stack(outs), torch.stack(finals)


def gdn_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one row at a time (the definition; slow). Same contract as `gdn_chunked`."""
    s = state.float().clone()
    out = []
    for i in range(q.shape[0]):
        s = s * g[i].float().exp()[:, None, None]
        kt, vt = k[i].float(), v[i].float()
        delta = (vt - (s * kt[:, :, None]).sum(1)) * beta[i].float()[:, None]
        s = s + kt[:, :, None] * delta[:, None, :]
        out.append((s * q[i].float()[:, :, None]).sum(1))
    return torch.stack(out), s


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of T new rows over L = P + T cached rows (the new ones last).

    q: [Hq, T, D]; k, v: [Hkv, L, D] (exactly the valid rows); returns [T, Hq, D].
    Row t sees cached rows 0 .. P + t (a lower-right causal mask). Query head h reads kv head
    h // (Hq / Hkv); the heads of one kv group are stacked so no kv row is copied.
    """
    hq, t, d = q.shape
    hkv, length, _ = k.shape
    groups = hq // hkv
    scores = ((q * scale).reshape(hkv, groups * t, d) @ k.transpose(-1, -2)).view(hkv, groups, t, length)
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    scores[..., length - t :].masked_fill_(future, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype).view(hkv, groups * t, length)
    return (probs @ v).view(hq, t, d).transpose(0, 1)


def attention_online(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, block: int = 2048
) -> torch.Tensor:
    """`attention` computed over blocks of cached rows with a running softmax (as flash attention
    does), so the scores stay in cache: about twice as fast on a CPU at long context. Blocks start
    at absolute row multiples of `block`, so the result is a pure function of (q, k, v)."""
    hq, t, d = q.shape
    hkv, length, _ = k.shape
    groups = hq // hkv
    qs = (q * scale).reshape(hkv, groups * t, d)
    row_pos = torch.arange(t, device=q.device).repeat(groups)[:, None] + (length - t)
    best = torch.full((hkv, groups * t, 1), float("-inf"), device=q.device)
    total = torch.zeros(hkv, groups * t, 1, device=q.device)
    acc = torch.zeros(hkv, groups * t, d, device=q.device)
    for lo in range(0, length, block):
        kb, vb = k[:, lo : lo + block], v[:, lo : lo + block]
        scores = (qs @ kb.transpose(-1, -2)).float()
        if lo + kb.shape[1] > length - t:  # this block holds new rows: mask the future
            cols = torch.arange(lo, lo + kb.shape[1], device=q.device)[None, :]
            scores.masked_fill_(cols > row_pos, float("-inf"))
        new_best = torch.maximum(best, scores.amax(-1, keepdim=True))
        probs = (scores - new_best).exp_()
        rescale = (best - new_best).exp()
        total = total * rescale + probs.sum(-1, keepdim=True)
        acc = acc * rescale + probs.to(vb.dtype) @ vb
        best = new_best
    return (acc / total).to(v.dtype).view(hq, t, d).transpose(0, 1)


GDN_BATCH_HEAD_ROWS = 65_536  # B * T * heads a batched GDN call takes at most (one row bucket of fla's l2norm)


def attention_batch_each(attention, q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], lengths: list[int],
                         scale: float, new: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """`Kernels.attention_batch`'s contract on a one-session `attention`: each session's new rows
    copied into its buffers, then attended alone; the rows stacked (into `out` where given)."""
    t = q.shape[1] // len(ks)
    k_new, v_new = new
    parts = []
    for j, (k, v, length) in enumerate(zip(ks, vs, lengths, strict=True)):
        rows = slice(j * t, (j + 1) * t)
        k[:, length - t : length] = k_new[:, rows]
        v[:, length - t : length] = v_new[:, rows]
        parts.append(attention(q[:, rows], k[:, :length], v[:, :length], scale))
    if out is None:
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    torch.cat(parts, out=out)
    return out


@dataclass(frozen=True)
class Kernels:
    """The kernels the model calls; the reference set, or a fast set with the same contracts."""

    name: str
    gdn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    conv: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    attention: Callable[..., torch.Tensor]
    norm: Callable[..., torch.Tensor] = rms_norm
    gated_norm: Callable[..., torch.Tensor] = gated_rms_norm
    gdn_gated: Callable[..., tuple[torch.Tensor, torch.Tensor]] = gdn_gated_reference
    # `gdn_gated` for B entries of T rows at once (`layout.Layout`: an entry is a session's chunk,
    # a run of entries one session's next chunks): q, k [B, T, H, Dk], v [B, T, Hv, Dv], a, b
    # [B, T, Hv], state [B, Hv, Dk, Dv] (sequence j's initial state: run j, then empty sequences),
    # layout (a `layout.LayoutTensors`, or None: every entry its own run) -> (out [B, T, Hv, Dv],
    # each sequence's final state [B, ...], an empty one's its initial), each entry's bits what
    # `gdn_gated` gives it read alone after the entries before it in its run, up to
    # `GDN_BATCH_HEAD_ROWS` (B T H) in all (None: none, the fused steps call `gdn_gated` once an entry)
    gdn_gated_batch: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    # B sessions' chunks of T rows at once: (q [Hq, B*T, D], key buffers, value buffers, lengths,
    # scale, new (k, v) [Hkv, B*T, D], out) -> [B*T, Hq, D]: each session's new rows written at rows
    # L - T .. L of its buffers, then attended; its bits what `attention` gives it alone (None:
    # `attention_batch_each` on `attention`)
    attention_batch: Callable[..., torch.Tensor] | None = None
    fused: bool = False  # the forward runs `fused.FusedSteps` (merged projections, one-launch kernels)
    revision: int = 0  # raised whenever the set's arithmetic changes, so state stored by an older one is not read
    # (heads, kv_heads, head_dim, rows, dtype, device) -> launches: the attention's kernels compiled
    # for every key length it may meet with those query rows (None: nothing to compile)
    warm_attention: Callable[..., int] | None = None


REFERENCE = Kernels(name="reference", gdn=gdn_reference, conv=causal_conv, attention=attention_online)
