"""Chunk attention in Triton: each of B sessions' T new rows over that session's own L cached rows
(the new ones last), in one launch for all of them, split over the cached rows so that even one
512-row chunk fills the GPU, the splits merged by their log-sum-exp.

`reference.attention`'s contract, per session. A small table names each session's key and value
buffers (addresses and head strides), its length and its slicing, so the sessions' buffers stay
where they are. Each program takes BM packed query rows of one key head: BM / GROUPS query rows
times the GROUPS query heads that share it (GQA packing: every key block loaded serves all of
them), and one slice of one session's key rows; it keeps a running max and sum (flash attention's
online softmax, base 2) and writes its unnormalised float32 output with them. A second kernel
merges a row's slices one after another in slice order. On Hopper the whole key blocks load
through tensor descriptors (TMA): the same values as plain loads, so the same bits, faster at depth.

Batch-invariant by construction: a session's slicing, tiles and reduction order are pure
functions of its own (T, L), the heads and the GPU's SM count, never of the other sessions in
the launch, and nothing is atomic, so a session's rows have the same bits alone or with any
others, every time. The softmax weights are rounded to q's dtype before they multiply v, as
flash does. Tests compare it with `reference.attention` (float32) under Triton's interpreter on a
CPU, and batched with alone on the GPU (`torch.equal`).
"""

from __future__ import annotations

import contextvars
import functools
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# tiles, warps, pipeline stages and SM waves: chosen on the H200 (docs/BENCHMARKS.md); whole blocks
# load through tensor descriptors where `descriptors` says so
TILES = {"BM": 128, "BN": 64, "num_warps": 8, "num_stages": 2, "waves": 1}
# A session's row of the table, eight int64 fields (the kernels index them by number): k and v
# addresses, their head strides, its length L, the key rows of a slice, its first slice's index
# among the launch's, its slice count.


@triton.jit
def _attention_slice(
    q, o_part, m_part, l_part, sessions, work, T, q_head, q_row, qk_scale,
    GROUPS: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DESC: tl.constexpr,
):
    pid_m, kv, z = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    heads = tl.num_programs(1) * GROUPS
    b = tl.load(work + 2 * z)
    s = tl.load(work + 2 * z + 1)
    row = sessions + b * 8
    k_base = tl.load(row).to(tl.pointer_type(q.dtype.element_ty))
    v_base = tl.load(row + 1).to(tl.pointer_type(q.dtype.element_ty))
    k_base = tl.multiple_of(k_base, 16) + kv * tl.multiple_of(tl.load(row + 2), 16)
    v_base = tl.multiple_of(v_base, 16) + kv * tl.multiple_of(tl.load(row + 3), 16)
    L = tl.load(row + 4).to(tl.int32)
    slice_rows = tl.load(row + 5).to(tl.int32)
    P = L - T  # the chunk's first row's position: row r sees keys 0 .. P + r
    QB: tl.constexpr = BM // GROUPS  # query rows in a block
    r = tl.arange(0, BM)
    t = pid_m * QB + r // GROUPS
    h = kv * GROUPS + r % GROUPS
    live = (t < T) & (r < QB * GROUPS)
    d = tl.arange(0, D)
    qt = tl.load(q + h[:, None] * q_head + (b * T + t)[:, None] * q_row + d[None, :], mask=live[:, None], other=0.0)
    lo = s * slice_rows
    # keys this block may see; all its rows see keys below P + pid_m * QB + 1
    hi = tl.minimum(tl.minimum(lo + slice_rows, L), P + tl.minimum((pid_m + 1) * QB, T))
    seen_by_all = tl.minimum(hi, P + pid_m * QB + 1)
    full_end = lo + tl.maximum(seen_by_all - lo, 0) // BN * BN
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    if DESC:  # the whole blocks' keys and values through tensor descriptors (TMA); the same values
        k_desc = tl.make_tensor_descriptor(k_base, shape=[L, D], strides=[D, 1], block_shape=[BN, D])
        v_desc = tl.make_tensor_descriptor(v_base, shape=[L, D], strides=[D, 1], block_shape=[BN, D])
    for start in range(lo, full_end, BN):  # blocks every row sees whole: no mask
        cols = start + tl.arange(0, BN)
        if DESC:
            kt = k_desc.load([start, 0])
        else:
            kt = tl.load(k_base + cols[:, None] * D + d[None, :])
        sc = tl.dot(qt, tl.trans(kt)) * qk_scale
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        p = tl.math.exp2(sc - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DESC:
            vt = v_desc.load([start, 0])
        else:
            vt = tl.load(v_base + cols[:, None] * D + d[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new
    for start in range(full_end, hi, BN):  # the causal edge and the slice's end: masked
        cols = start + tl.arange(0, BN)
        in_range = cols < hi
        kt = tl.load(k_base + cols[:, None] * D + d[None, :], mask=in_range[:, None], other=0.0)
        sc = tl.dot(qt, tl.trans(kt)) * qk_scale
        visible = in_range[None, :] & (cols[None, :] <= P + t[:, None])
        sc = tl.where(visible, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        p = tl.math.exp2(sc - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_base + cols[:, None] * D + d[None, :], mask=in_range[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new
    at = (z * heads + h) * T + t
    tl.store(m_part + at, m_i, mask=live)
    tl.store(l_part + at, l_i, mask=live)
    tl.store(o_part + at[:, None] * D + d[None, :], acc, mask=live[:, None])


@triton.jit
def _attention_merge(o_part, m_part, l_part, out, sessions, T, D: tl.constexpr):
    """One (row, head): its session's slices weighed by exp2(m - max) and summed in slice order."""
    row, h = tl.program_id(0), tl.program_id(1)
    heads = tl.num_programs(1)
    b = row // T
    first = tl.load(sessions + b * 8 + 6).to(tl.int32)
    count = tl.load(sessions + b * 8 + 7).to(tl.int32)
    base = (first * heads + h) * T + row % T  # slice j of this row: base + j * heads * T
    step = heads * T
    top = tl.load(m_part + base)  # finite: slice 0 holds key 0, which every row sees
    for j in range(1, count):
        top = tl.maximum(top, tl.load(m_part + base + j * step))
    d = tl.arange(0, D)
    total = 0.0
    acc = tl.zeros([D], tl.float32)
    for j in range(0, count):
        w = tl.math.exp2(tl.load(m_part + base + j * step) - top)  # 0 for an empty slice (m = -inf)
        total += w * tl.load(l_part + base + j * step)
        acc += w * tl.load(o_part + (base + j * step) * D + d)
    tl.store(out + (row * heads + h) * D + d, (acc / total).to(out.dtype.element_ty))


@triton.jit
def _write_rows(k, v, k_head, k_row, v_head, v_row, sessions, T, D: tl.constexpr):
    """Row t of session b's new keys and values (stacked rows b*T + t of k, v) into its buffers at
    rows L - T + t, for one key head."""
    row, kv = tl.program_id(0), tl.program_id(1)
    b, t = row // T, row % T
    entry = sessions + b * 8
    dest = tl.load(entry + 4) - T + t
    d = tl.arange(0, D)
    k_out = tl.load(entry).to(tl.pointer_type(k.dtype.element_ty)) + kv * tl.load(entry + 2)
    v_out = tl.load(entry + 1).to(tl.pointer_type(v.dtype.element_ty)) + kv * tl.load(entry + 3)
    tl.store(k_out + dest * D + d, tl.load(k + kv * k_head + row * k_row + d))
    tl.store(v_out + dest * D + d, tl.load(v + kv * v_head + row * v_row + d))


def descriptors(device: torch.device) -> bool:
    """Whether the slices load whole key and value blocks through tensor descriptors on `device`:
    on Hopper and later (TMA), compiled (not under Triton's interpreter). The loads' values, and so
    the bits, are the same either way (tested on the GPU); only their speed differs."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _hopper(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


# Triton keeps its allocator in a context variable; this one says whether it is ours in the same
# context (a new thread, an asyncio task or a copied context each start without it)
_allocator_set: contextvars.ContextVar[bool] = contextvars.ContextVar("shadow_descriptor_allocator", default=False)
_scratch: dict[tuple[int, int | None], torch.Tensor] = {}  # (device, stream) -> the descriptors' scratch


def use_workspace() -> None:
    """Make `_workspace` Triton's allocator in the current context, once a context."""
    if not _allocator_set.get():
        triton.set_allocator(_workspace)
        _allocator_set.set(True)


def _workspace(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory Triton asks for at a launch with tensor descriptors (each program writes its
    descriptors there), on the current device, where Triton launches: one buffer a device and
    stream, grown to the next power of two when too small, so launches of a size met before never
    allocate; launches on one stream run in order, so they never use it at once. Under CUDA graph
    capture a fresh buffer of the graph's pool (the graph keeps it)."""
    device = torch.cuda.current_device()
    if torch.cuda.is_current_stream_capturing():
        return torch.empty(size, dtype=torch.int8, device=device)
    key = (device, stream)
    buf = _scratch.get(key)
    if buf is None or buf.numel() < size:
        buf = _scratch[key] = torch.empty(max(1 << 16, 1 << (size - 1).bit_length()), dtype=torch.int8, device=device)
    return buf


def slice_rows(t: int, length: int, heads: int, sm_count: int, bm: int, bn: int, waves: int = 1) -> int:
    """Key rows per slice (a multiple of bn): as many slices as fill the SMs `waves` times beside
    the row blocks of every head, each at least 4 key blocks long. A pure function of its arguments."""
    programs = triton.cdiv(t, bm) * heads
    blocks = triton.cdiv(length, bn)
    slices = max(1, min(waves * sm_count // programs, blocks // 4))
    return triton.cdiv(blocks, slices) * bn


def _check_buffers(ks: list[torch.Tensor], vs: list[torch.Tensor], lengths: list[int], q: torch.Tensor) -> None:
    d, hkv = q.shape[-1], ks[0].shape[0]
    if hkv == 0 or q.shape[0] % hkv:
        raise ValueError("the key heads must divide q's heads")
    for k, v, length in zip(ks, vs, lengths, strict=True):
        for x in (k, v):
            if x.dtype != q.dtype or x.device != q.device or x.shape[0] != hkv:
                raise ValueError("every session's keys and values need q's dtype and device and the same key heads")
            if x.shape[-1] != d or x.stride(-1) != 1 or x.stride(1) != d or x.shape[1] < length:
                raise ValueError("a session's key and value rows must be contiguous rows of q's width, L of them at least")
            if x.data_ptr() % 16 or x.stride(0) % 16:  # as the kernels assume (and TMA needs)
                raise ValueError("a session's key and value buffers must be 16-byte aligned, their head strides multiples of 16")


def _tables(ks, vs, lengths, t, heads, device, tiles):
    """The sessions' table [B, 8] and the work list [Z, 2] of (session, slice), on `device`."""
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    rows, work = [], []
    for b, (k, v, length) in enumerate(zip(ks, vs, lengths)):
        per_slice = slice_rows(t, length, heads, sm_count, tiles["BM"], tiles["BN"], tiles.get("waves", 1))
        count = triton.cdiv(length, per_slice)
        rows.append([k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), length, per_slice, len(work), count])
        work.extend([b, s] for s in range(count))
    pinned = device.type == "cuda"
    table = torch.tensor(rows, dtype=torch.int64, pin_memory=pinned).to(device, non_blocking=True)
    work_list = torch.tensor(work, dtype=torch.int32, pin_memory=pinned).to(device, non_blocking=True)
    return table, work_list


def attend_sessions(
    q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], lengths: list[int], scale: float,
    new: tuple[torch.Tensor, torch.Tensor] | None = None, out: torch.Tensor | None = None,
    tiles: dict[str, int] | None = None,
) -> torch.Tensor:
    """B sessions' chunks of T rows, stacked: q [Hq, B*T, D]; session b's keys and values in ks[b],
    vs[b] ([Hkv, >= L_b, D], contiguous rows, unit stride in D; a buffer's head stride is its own),
    its chunk's rows the last T of its first L_b = lengths[b]. `new` = (k, v) [Hkv, B*T, D]: the
    chunks' own keys and values, first written into each buffer at rows L_b - T .. L_b. Returns
    [B*T, Hq, D] in q's dtype (into `out` where given, contiguous); each session's rows are the
    bits it gets alone. `tiles` overrides TILES (tests, tile sweeps; `desc`: force tensor
    descriptors on or off)."""
    tiles = TILES if tiles is None else tiles
    hq, rows, d = q.shape
    b = len(ks)
    t = rows // b
    if q.stride(-1) != 1 or t * b != rows or any(length < t for length in lengths):
        raise ValueError("attend_sessions needs unit stride in D, B chunks of T rows and L >= T for each")
    _check_buffers(ks, vs, lengths, q)
    hkv = ks[0].shape[0]
    table, work = _tables(ks, vs, lengths, t, hq, q.device, tiles)
    if new is not None:
        k_new, v_new = new
        if k_new.shape != (hkv, rows, d) or v_new.shape != k_new.shape or k_new.stride(-1) != 1 or v_new.stride(-1) != 1:
            raise ValueError("the new keys and values must be [Hkv, B*T, D] with unit stride in D")
        _write_rows[(rows, hkv)](k_new, v_new, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
                                 table, t, D=d)
    slices = work.shape[0]
    desc = tiles["desc"] if "desc" in tiles else descriptors(q.device)
    if desc:
        use_workspace()
    o_part = torch.empty(slices, hq, t, d, dtype=torch.float32, device=q.device)
    m_part = torch.empty(slices, hq, t, dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    groups = hq // hkv
    grid = (triton.cdiv(t, tiles["BM"] // groups), hkv, slices)
    _attention_slice[grid](
        q, o_part, m_part, l_part, table, work, t, q.stride(0), q.stride(1), scale * LOG2E,
        GROUPS=groups, D=d, BM=tiles["BM"], BN=tiles["BN"], DESC=desc,
        num_warps=tiles["num_warps"], num_stages=tiles["num_stages"],
    )
    if out is None:
        out = torch.empty(rows, hq, d, dtype=q.dtype, device=q.device)
    elif out.shape != (rows, hq, d) or not out.is_contiguous() or out.dtype != q.dtype:
        raise ValueError("out must be [B*T, Hq, D] contiguous in q's dtype")
    _attention_merge[(rows, hq)](o_part, m_part, l_part, out, table, t, D=d)
    return out


def chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, tiles: dict[str, int] | None = None,
) -> torch.Tensor:
    """`reference.attention`'s contract for one session: q [Hq, T, D]; k, v [Hkv, L, D] with
    contiguous rows and unit stride in D (the head stride may be a larger buffer's); D a power of
    two. Returns [T, Hq, D] contiguous in q's dtype."""
    return attend_sessions(q, [k], [v], [k.shape[1]], scale, tiles=tiles)


def warm(heads: int, kv_heads: int, head_dim: int, rows: list[int], dtype: torch.dtype, device: torch.device) -> int:
    """Run `chunk_attention` once for each of `rows` query rows (of at least 1), on zeros laid out as
    the model's are, so that its kernels are compiled; returns the launches. Lengths, slices and
    sessions come from a table in device memory, so no length or batch compiles anything anew:
    Triton specialises only on T (1, a multiple of 16, or neither) and the strides of q."""
    launches = 0
    kv = torch.zeros(kv_heads, max(max(rows), 1), head_dim, dtype=dtype, device=device)
    for t in rows:
        q = torch.zeros(t, heads, head_dim, dtype=dtype, device=device).transpose(0, 1)
        attend_sessions(q, [kv], [kv], [t], head_dim ** -0.5, new=(kv[:, :t], kv[:, :t]))
        launches += 1
    return launches
