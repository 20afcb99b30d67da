"""Chunk attention in Triton: T new rows over L cached rows (the new ones last), split over the
cached rows so a 512-row chunk fills the GPU, the splits merged by their log-sum-exp.

`reference.attention`'s contract. Each program takes BM query rows of one query head and one slice of
the key rows: it keeps a running max and sum (flash attention's online softmax, base 2) and
writes its unnormalised float32 output with them; a second kernel merges the slices of each row
in slice order. The number of slices, the tiles and the reduction order are pure functions of
(T, L, heads, the GPU's SM count), and nothing is atomic, so a chunk gives the same bits every
time; the softmax weights are rounded to q's dtype before they multiply v, as flash does.
Tests compare it with `reference.attention` (float32) under Triton's interpreter on a CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# tiles, warps, pipeline stages and SM waves: chosen on the H200 (docs/BENCHMARKS.md)
TILES = {"BM": 128, "BN": 64, "num_warps": 8, "num_stages": 2, "waves": 1}


@triton.jit
def _attention_slice(
    q, k, v, o_part, m_part, l_part,
    T, L, P, q_head, q_row, k_head, k_row, v_head, v_row, slice_rows, qk_scale,
    GROUPS: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    pid_m, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    heads = tl.num_programs(1)
    kv = h // GROUPS
    rows = pid_m * BM + tl.arange(0, BM)
    d = tl.arange(0, D)
    live = rows < T
    qt = tl.load(q + h * q_head + rows[:, None] * q_row + d[None, :], mask=live[:, None], other=0.0)
    k_base = k + kv * k_head
    v_base = v + kv * v_head
    lo = s * slice_rows
    # keys this block of rows may see: row r sees keys 0 .. P + r; all rows see keys below P + pid_m * BM + 1
    hi = tl.minimum(tl.minimum(lo + slice_rows, L), P + tl.minimum((pid_m + 1) * BM, T))
    seen_by_all = tl.minimum(hi, P + pid_m * BM + 1)
    full_end = lo + tl.maximum(seen_by_all - lo, 0) // BN * BN
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for start in range(lo, full_end, BN):  # blocks every row sees whole: no mask
        cols = start + tl.arange(0, BN)
        kt = tl.load(k_base + cols[:, None] * k_row + d[None, :])
        sc = tl.dot(qt, tl.trans(kt)) * qk_scale
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        p = tl.math.exp2(sc - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_base + cols[:, None] * v_row + d[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new
    for start in range(full_end, hi, BN):  # the causal edge and the slice's end: masked
        cols = start + tl.arange(0, BN)
        in_range = cols < hi
        kt = tl.load(k_base + cols[:, None] * k_row + d[None, :], mask=in_range[:, None], other=0.0)
        sc = tl.dot(qt, tl.trans(kt)) * qk_scale
        visible = in_range[None, :] & (cols[None, :] <= P + rows[:, None])
        sc = tl.where(visible, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        p = tl.math.exp2(sc - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_base + cols[:, None] * v_row + d[None, :], mask=in_range[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new
    at = (s * heads + h) * T + rows
    tl.store(m_part + at, m_i, mask=live)
    tl.store(l_part + at, l_i, mask=live)
    tl.store(o_part + at[:, None] * D + d[None, :], acc, mask=live[:, None])


@triton.jit
def _attention_merge(o_part, m_part, l_part, out, T, S, D: tl.constexpr, BS: tl.constexpr):
    t, h = tl.program_id(0), tl.program_id(1)
    heads = tl.num_programs(1)
    s = tl.arange(0, BS)
    at = (s * heads + h) * T + t
    m = tl.load(m_part + at, mask=s < S, other=float("-inf"))
    top = tl.max(m, 0)  # finite: slice 0 holds key 0, which every row sees
    w = tl.math.exp2(m - top)  # 0 for empty slices (m = -inf)
    total = tl.sum(w * tl.load(l_part + at, mask=s < S, other=0.0), 0)
    d = tl.arange(0, D)
    o = tl.load(o_part + at[:, None] * D + d[None, :], mask=(s < S)[:, None], other=0.0)
    tl.store(out + (t * heads + h) * D + d, (tl.sum(o * w[:, None], 0) / total).to(out.dtype.element_ty))


def slice_rows(t: int, length: int, heads: int, sm_count: int, bm: int, bn: int, waves: int = 1) -> int:
    """Key rows per slice (a multiple of bn): as many slices as fill the SMs `waves` times beside
    the row blocks of every head, each at least 4 key blocks long. A pure function of its arguments."""
    programs = triton.cdiv(t, bm) * heads
    blocks = triton.cdiv(length, bn)
    slices = max(1, min(waves * sm_count // programs, blocks // 4))
    return triton.cdiv(blocks, slices) * bn


def chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, tiles: dict[str, int] | None = None,
) -> torch.Tensor:
    """`reference.attention` in two launches. q [Hq, T, D]; k, v [Hkv, L, D] with unit stride in D (heads
    and rows may be strided, e.g. the valid rows of a larger buffer); D a power of two. Returns
    [T, Hq, D] contiguous in q's dtype. `tiles` overrides TILES (tests, tile sweeps)."""
    tiles = TILES if tiles is None else tiles
    hq, t, d = q.shape
    hkv, length, _ = k.shape
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("chunk_attention needs unit stride in the head dimension")
    sm_count = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 132
    bm, bn = tiles["BM"], tiles["BN"]
    rows_per_slice = slice_rows(t, length, hq, sm_count, bm, bn, tiles.get("waves", 1))
    slices = triton.cdiv(length, rows_per_slice)
    o_part = torch.empty(slices, hq, t, d, dtype=torch.float32, device=q.device)
    m_part = torch.empty(slices, hq, t, dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    grid = (triton.cdiv(t, bm), hq, slices)
    _attention_slice[grid](
        q, k, v, o_part, m_part, l_part, t, length, length - t,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        rows_per_slice, scale * LOG2E, GROUPS=hq // hkv, D=d, BM=bm, BN=bn,
        num_warps=tiles["num_warps"], num_stages=tiles["num_stages"],
    )
    out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    _attention_merge[(t, hq)](o_part, m_part, l_part, out, t, slices, D=d, BS=max(2, triton.next_power_of_2(slices)))
    return out


def _int_class(n: int) -> int:
    """How Triton specialises an integer argument: 1, a multiple of 16, or neither (each compiles apart)."""
    return 1 if n == 1 else 16 if n % 16 == 0 else 0


def variant_lengths(t: int, longest: int, heads: int, sm_count: int, tiles: dict[str, int] | None = None) -> list[int]:
    """Key lengths L (t <= L <= longest) at which `chunk_attention` of t query rows launches every
    compiled variant of its two kernels: Triton compiles one per class of its integer arguments
    (L, L - t, the slice count) and per merge width BS, and a first launch in a new class compiles
    for a tenth of a second or more; these lengths let a load run them all first. The slice count
    is fixed within a key block, so each block's first lengths, its first L and first L - t that
    are multiples of 16 (and t + 1, where L - t is 1) stand for all of it."""
    tiles = TILES if tiles is None else tiles
    bn = tiles["BN"]
    seen, out = set(), []
    for block in range(-(-t // bn), -(-longest // bn) + 1):
        lo, hi = max(t, (block - 1) * bn + 1), min(longest, block * bn)
        firsts = {lo, lo + 1, lo + 2, lo + -lo % 16, lo + (t - lo) % 16, t + 1}
        for length in sorted(n for n in firsts if lo <= n <= hi):
            slices = triton.cdiv(length, slice_rows(t, length, heads, sm_count, tiles["BM"], bn, tiles.get("waves", 1)))
            key = (_int_class(length), _int_class(length - t), _int_class(slices), max(2, triton.next_power_of_2(slices)))
            if key not in seen:
                seen.add(key)
                out.append(length)
    return out


def warm(heads: int, kv_heads: int, head_dim: int, rows: list[int], dtype: torch.dtype, device: torch.device,
         longest: int = 32768) -> int:
    """Run `chunk_attention` once in every compiled variant for each of `rows` query rows (of at
    least 1), on zeros laid out as the model's are; returns the launches. What it computes is dropped."""
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    launches = 0
    for t in rows:
        lengths = variant_lengths(t, max(t, longest), heads, sm_count)
        kv = torch.zeros(kv_heads, max(lengths), head_dim, dtype=dtype, device=device)
        q = torch.zeros(t, heads, head_dim, dtype=dtype, device=device).transpose(0, 1)
        for length in lengths:
            chunk_attention(q, kv[:, :length], kv[:, :length], head_dim ** -0.5)
            launches += 1
    return launches
