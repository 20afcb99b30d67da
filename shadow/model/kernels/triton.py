"""Small Triton kernels for the fused fast path: each replaces a run of elementwise launches.

Every kernel computes in float32 and rounds once to the output dtype; every one is a pure
function of its inputs at given shapes (no atomics, no autotuning), so a chunk replays the same
bits. `fused.FusedSteps` calls them on CUDA; elsewhere it calls their plain PyTorch twins of the
same names in `kernel_twins`, which tests compare with these (under Triton's interpreter on a CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_kernel(
    x, x_row, state, weight, q, k, v, z, b, a, new_state, T, C, KEY, VALUE, Z, H, CONV_BLOCKS,
    K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    # Programs pid_c < CONV_BLOCKS convolve BC of the C channels; the rest copy z, b, a out.
    # Every branch below is on program ids, so a program runs straight-line code: no stores
    # masked off for most of its elements (the cost of one kernel doing every part at once).
    # Program axis 2 is the session: its T rows, its state, its rows of every output.
    pid_t, pid_c, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    x += pid_s * T * x_row
    state += pid_s * C * (K - 1)
    new_state += pid_s * C * (K - 1)
    q += pid_s * T * KEY
    k += pid_s * T * KEY
    v += pid_s * T * VALUE
    z += pid_s * T * Z
    b += pid_s * T * H
    a += pid_s * T * H
    rows = pid_t * BT + tl.arange(0, BT)[:, None]  # [BT, 1]
    in_rows = rows < T
    if pid_c < CONV_BLOCKS:
        c0 = pid_c * BC
        cols = c0 + tl.arange(0, BC)[None, :]  # [1, BC]
        in_c = cols < C
        live = in_rows & in_c
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for i in tl.static_range(K):
            src = rows + i - (K - 1)  # the input row, or (when < 0) state column src + K - 1
            tap = tl.load(x + src * x_row + cols, mask=live & (src >= 0), other=0.0).to(tl.float32)
            if pid_t * BT < K - 1:  # only the first rows reach back into the state
                tap += tl.load(state + cols * (K - 1) + (src + K - 1), mask=live & (src < 0), other=0.0).to(tl.float32)
            acc += tl.load(weight + cols * K + i, mask=in_c, other=0.0).to(tl.float32) * tap
        y = (acc * tl.sigmoid(acc)).to(q.dtype.element_ty)
        if c0 + BC <= KEY:
            tl.store(q + rows * KEY + cols, y, mask=in_rows)
        elif c0 >= KEY and c0 + BC <= 2 * KEY:
            tl.store(k + rows * KEY + (cols - KEY), y, mask=in_rows)
        elif c0 >= 2 * KEY:
            tl.store(v + rows * VALUE + (cols - 2 * KEY), y, mask=live)
        else:  # a block across a boundary (head widths that are not a multiple of BC)
            tl.store(q + rows * KEY + cols, y, mask=live & (cols < KEY))
            tl.store(k + rows * KEY + (cols - KEY), y, mask=live & (cols >= KEY) & (cols < 2 * KEY))
            tl.store(v + rows * VALUE + (cols - 2 * KEY), y, mask=live & (cols >= 2 * KEY))
        if pid_t == 0:  # the new state: the last K-1 rows of [state | x]
            channels = c0 + tl.arange(0, BC)
            in_range = channels < C
            for j in tl.static_range(K - 1):
                row = T + j - (K - 1)
                x_part = tl.load(x + row * x_row + channels, mask=in_range & (row >= 0), other=0.0)
                state_part = tl.load(state + channels * (K - 1) + (row + K - 1), mask=in_range & (row < 0), other=0.0)
                tl.store(new_state + channels * (K - 1) + j, tl.where(row >= 0, x_part, state_part), mask=in_range)
    else:  # z, then b, then a: the columns after the conv's, copied out as they are
        a0 = (pid_c - CONV_BLOCKS) * BC
        after = a0 + tl.arange(0, BC)[None, :]
        raw = tl.load(x + rows * x_row + C + after, mask=in_rows & (after < Z + 2 * H), other=0.0)
        if a0 + BC <= Z:
            tl.store(z + rows * Z + after, raw, mask=in_rows)
        else:
            tl.store(z + rows * Z + after, raw, mask=in_rows & (after < Z))
            tl.store(b + rows * H + (after - Z), raw, mask=in_rows & (after >= Z) & (after < Z + H))
            tl.store(a + rows * H + (after - Z - H), raw, mask=in_rows & (after >= Z + H) & (after < Z + 2 * H))


# chosen on the H200 (docs/results/conv-sweep-h200.txt); any tiles give the same bits (each output is its own sum)
CONV_TILES = {"BT": 8, "BC": 128, "num_warps": 2}


def conv_split(
    proj: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, key_dim: int, z_dim: int, heads: int,
    tiles: dict[str, int] | None = None,
) -> tuple[torch.Tensor, ...]:
    """The GDN causal conv (`reference.causal_conv` with silu) in one launch, split into q, k, v, with the
    projection's other parts (z, b, a) copied out beside it, so every later kernel reads
    contiguous rows.

    proj: [T, C + z_dim + 2 heads] rows of the merged input projection (any row stride, unit
    column stride): the conv's C channels (q, k, v), then z, b, a; state: [C, K-1] contiguous;
    weight: [C, K] contiguous. Returns q, k [T, key_dim], v [T, C - 2 key_dim], z [T, z_dim],
    b, a [T, heads] (contiguous, proj's dtype; z, b, a are proj's values bit for bit) and the new
    state [C, K-1]. `tiles` overrides CONV_TILES (tile sweeps).

    Several sessions at once: state [B, C, K-1] (contiguous), proj B sessions' T rows each
    stacked; the outputs stacked the same way, the new states [B, C, K-1]; each session's rows
    and state are what it alone gives (its programs run the same code on its own rows).
    """
    tiles = CONV_TILES if tiles is None else tiles
    c, kk = weight.shape
    sessions = state.shape[0] if state.dim() == 3 else 1
    t = proj.shape[0] // sessions
    if proj.shape[1] != c + z_dim + 2 * heads or proj.stride(1) != 1 or t * sessions != proj.shape[0]:
        raise ValueError("proj must hold the conv's channels, z, b and a, with unit column stride, "
                         "and one number of rows a session")
    if not state.is_contiguous():
        raise ValueError("the conv state must be contiguous")
    value_dim = c - 2 * key_dim
    out = {"dtype": proj.dtype, "device": proj.device}
    rows = t * sessions
    q, k = torch.empty(rows, key_dim, **out), torch.empty(rows, key_dim, **out)
    v, z = torch.empty(rows, value_dim, **out), torch.empty(rows, z_dim, **out)
    b, a = torch.empty(rows, heads, **out), torch.empty(rows, heads, **out)
    new_state = torch.empty_like(state)
    bt, bc = tiles["BT"], tiles["BC"]
    conv_blocks = triton.cdiv(c, bc)
    grid = (triton.cdiv(t, bt), conv_blocks + triton.cdiv(z_dim + 2 * heads, bc), sessions)
    _conv_kernel[grid](proj, proj.stride(0), state, weight, q, k, v, z, b, a, new_state, t, c, key_dim, value_dim,
                       z_dim, heads, conv_blocks, K=kk, BT=bt, BC=bc, num_warps=tiles["num_warps"])
    return q, k, v, z, b, a, new_state


@triton.jit
def _swiglu_kernel(gu, out, T, I, BT: tl.constexpr, BI: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)[:, None]
    cols = tl.program_id(1) * BI + tl.arange(0, BI)[None, :]
    m = (rows < T) & (cols < I)
    g = tl.load(gu + rows * (2 * I) + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu + rows * (2 * I) + I + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out + rows * I + cols, (g * tl.sigmoid(g) * u).to(out.dtype.element_ty), mask=m)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] (gate first, contiguous); [T, I] in its dtype."""
    t, two_i = gate_up.shape
    i = two_i // 2
    out = torch.empty(t, i, dtype=gate_up.dtype, device=gate_up.device)
    bt, bi = 8, 256
    _swiglu_kernel[(triton.cdiv(t, bt), triton.cdiv(i, bi))](gate_up, out, t, i, BT=bt, BI=bi)
    return out


@triton.jit
def _norm_rope_kernel(
    x, x_row, x_head, weight, cos, sin, out, T, H, eps,
    D: tl.constexpr, R: tl.constexpr,
):
    t, h = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, D)
    base = x + t * x_row + h * x_head
    row = tl.load(base + d).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(row * row, axis=0) / D + eps)
    y = row * rstd * tl.load(weight + d).to(tl.float32)
    half = R // 2
    partner = tl.where(d < half, d + half, d - half)
    rotating = d < R
    p = tl.load(base + partner, mask=rotating, other=0.0).to(tl.float32) * rstd
    p = p * tl.load(weight + partner, mask=rotating, other=0.0).to(tl.float32)
    p = tl.where(d < half, -p, p)
    c = tl.load(cos + t * R + d, mask=rotating, other=1.0).to(tl.float32)
    s = tl.load(sin + t * R + d, mask=rotating, other=0.0).to(tl.float32)
    y = tl.where(rotating, y * c + p * s, y)
    tl.store(out + h * T * D + t * D + d, y.to(out.dtype.element_ty))


def norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm (weight already 1 + w, float32) then RoPE on the first R features.

    x: [T, H, D] with unit stride in D (heads and rows may be strided, e.g. q inside the
    q-and-gate projection); cos, sin: [T, R] float32. Returns [H, T, D] contiguous in x's dtype.
    """
    t, h, d = x.shape
    out = torch.empty(h, t, d, dtype=x.dtype, device=x.device)
    _norm_rope_kernel[(t, h)](x, x.stride(0), x.stride(1), weight, cos, sin, out, t, h, eps, D=d, R=cos.shape[-1])
    return out


@triton.jit
def _add_norm_kernel(x, x_row, delta, delta_row, weight, out_sum, out_norm, D, eps,
                     HAS_DELTA: tl.constexpr, BD: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BD)
    m = cols < D
    s = tl.load(x + row * x_row + cols, mask=m, other=0.0)
    if HAS_DELTA:  # the residual add, rounded as a separate add would round it
        d = tl.load(delta + row * delta_row + cols, mask=m, other=0.0)
        s = (s.to(tl.float32) + d.to(tl.float32)).to(out_sum.dtype.element_ty)
        tl.store(out_sum + row * D + cols, s, mask=m)
    f = s.to(tl.float32)  # the norm reads the rounded rows either way, so both paths agree bit for bit
    rstd = tl.rsqrt(tl.sum(f * f, axis=0) / D + eps)
    y = f * rstd * tl.load(weight + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_norm + row * D + cols, y.to(out_norm.dtype.element_ty), mask=m)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm of it) in one launch; with delta None, (x, RMSNorm of x).

    x, delta: [T, D] with unit column stride; weight: [D] (already 1 + w). The sum is rounded to
    x's dtype before the norm reads it, so the norm of a sum equals the norm of that sum passed
    alone. Returns the sum (a new tensor, or x itself) and the norm [T, D], contiguous.
    """
    t, d = x.shape
    normed = torch.empty(t, d, dtype=x.dtype, device=x.device)
    total = x if delta is None else torch.empty(t, d, dtype=x.dtype, device=x.device)
    other = x if delta is None else delta
    block = triton.next_power_of_2(d)
    _add_norm_kernel[(t,)](x, x.stride(0), other, other.stride(0), weight, total, normed, d, eps,
                           HAS_DELTA=delta is not None, BD=block, num_warps=4 if block <= 2048 else 8)
    return total, normed


@triton.jit
def _gate_kernel(attended, gate, g_row, g_head, out, H, D: tl.constexpr):
    t, h = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, D)
    a = tl.load(attended + (t * H + h) * D + d).to(tl.float32)
    g = tl.load(gate + t * g_row + h * g_head + d).to(tl.float32)
    tl.store(out + (t * H + h) * D + d, (a * tl.sigmoid(g)).to(out.dtype.element_ty))


def gate_mul(attended: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """attended * sigmoid(gate), rounded once: attended [T, H, D] (copied if not contiguous), gate [T, H, D] with
    unit stride in D (e.g. a view into the q-and-gate projection). Returns [T, H * D]."""
    t, h, d = gate.shape
    attended = attended.reshape(t, h, d).contiguous()
    out = torch.empty(t, h * d, dtype=attended.dtype, device=attended.device)
    _gate_kernel[(t, h)](attended, gate, gate.stride(0), gate.stride(1), out, h, D=d)
    return out
