"""Variants of the chunk attention's inner loop, timed beside the library's kernel on the GPU.

The library's `triton_attention.attend_sessions` (the session table, the work list of slices, the
merge) with its slice kernel replaced by one whose unmasked key loop can, switch by switch:
- `fma`: scale the scores inside the max and the exponent (one multiply-add a score, as the Triton
  tutorial does) instead of scaling them first;
- `acc`: accumulate P V into the rescaled accumulator inside the matrix multiply (`tl.dot(p, v,
  acc * alpha)`) instead of adding the product after it;
- `ws`: ask Triton to warp-specialise the loop (`tl.range(..., warp_specialize=True)`);
- `desc`: load key and value blocks through tensor descriptors (TMA on Hopper);
- `stages`: the loop's software pipeline depth.
The masked edge loop is the library's. Each variant is checked against a float32 reference (its
largest difference), against itself (the same bits twice) and batched against alone (a session's
bits must not depend on the batch) and the library's (a change of arithmetic changes them; a
change of loads alone need not). 20 eager calls between CUDA events after warm-up, median of 5 rounds.

    python3 experiments/attention_variants.py --depths 16384,65536 --batches 1,8
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from shadow.model.kernels import reference
from shadow.model.kernels import triton_attention as ta

from attention_batch import gpu_ms  # run as a script: experiments/ is on the path

HQ, HKV, D, T = 8, 2, 256, 512
SCALE = D ** -0.5


@triton.jit
def _slice_variant(
    q, o_part, m_part, l_part, sessions, work, T, q_head, q_row, qk_scale,
    GROUPS: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    FMA: tl.constexpr, ACC: tl.constexpr, WS: tl.constexpr, DESC: tl.constexpr, STAGES: tl.constexpr,
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
    P = L - T
    QB: tl.constexpr = BM // GROUPS
    r = tl.arange(0, BM)
    t = pid_m * QB + r // GROUPS
    h = kv * GROUPS + r % GROUPS
    live = (t < T) & (r < QB * GROUPS)
    d = tl.arange(0, D)
    qt = tl.load(q + h[:, None] * q_head + (b * T + t)[:, None] * q_row + d[None, :], mask=live[:, None], other=0.0)
    lo = s * slice_rows
    hi = tl.minimum(tl.minimum(lo + slice_rows, L), P + tl.minimum((pid_m + 1) * QB, T))
    seen_by_all = tl.minimum(hi, P + pid_m * QB + 1)
    full_end = lo + tl.maximum(seen_by_all - lo, 0) // BN * BN
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    if DESC:
        k_desc = tl.make_tensor_descriptor(k_base, shape=[L, D], strides=[D, 1], block_shape=[BN, D])
        v_desc = tl.make_tensor_descriptor(v_base, shape=[L, D], strides=[D, 1], block_shape=[BN, D])
    for start in tl.range(lo, full_end, BN, num_stages=STAGES, warp_specialize=WS):
        cols = start + tl.arange(0, BN)
        if DESC:
            kt = k_desc.load([start, 0])
        else:
            kt = tl.load(k_base + cols[:, None] * D + d[None, :])
        raw = tl.dot(qt, tl.trans(kt))
        if FMA:
            m_new = tl.maximum(m_i, tl.max(raw, 1) * qk_scale)
            p = tl.math.exp2(raw * qk_scale - m_new[:, None])
        else:
            sc = raw * qk_scale
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            p = tl.math.exp2(sc - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DESC:
            vt = v_desc.load([start, 0])
        else:
            vt = tl.load(v_base + cols[:, None] * D + d[None, :])
        if ACC:
            acc = tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None])
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new
    for start in range(full_end, hi, BN):  # the causal edge and the slice's end: masked (the library's)
        cols = start + tl.arange(0, BN)
        in_range = cols < hi
        kt = tl.load(k_base + cols[:, None] * D + d[None, :], mask=in_range[:, None], other=0.0)
        sc = tl.dot(qt, tl.trans(kt)) * qk_scale
        visible = in_range[None, :] & (cols[None, :] <= P + t[:, None])
        sc = tl.where(visible, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
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


def attend_variant(q, ks, vs, lengths, out, variant: dict) -> torch.Tensor:
    """`ta.attend_sessions` (without `new`) with the slice kernel of `variant`."""
    tiles = {**ta.TILES, **{k: variant[k] for k in ("BM", "BN", "num_warps", "num_stages") if k in variant}}
    hq, rows, d = q.shape
    t = rows // len(ks)
    table, work = ta._tables(ks, vs, lengths, t, hq, q.device, tiles)
    slices = work.shape[0]
    o_part = torch.empty(slices, hq, t, d, dtype=torch.float32, device=q.device)
    m_part = torch.empty(slices, hq, t, dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    groups = hq // HKV
    grid = (triton.cdiv(t, tiles["BM"] // groups), HKV, slices)
    _slice_variant[grid](
        q, o_part, m_part, l_part, table, work, t, q.stride(0), q.stride(1), SCALE * ta.LOG2E,
        GROUPS=groups, D=d, BM=tiles["BM"], BN=tiles["BN"],
        FMA=variant.get("fma", False), ACC=variant.get("acc", False), WS=variant.get("ws", False),
        DESC=variant.get("desc", False), STAGES=variant.get("stages", tiles["num_stages"]),
        num_warps=tiles["num_warps"], num_stages=tiles["num_stages"],
    )
    ta._attention_merge[(rows, hq)](o_part, m_part, l_part, out, table, t, D=d)
    return out


VARIANTS = {
    "library": None,
    "plain": {},
    "desc": {"desc": True},
    "desc ws": {"desc": True, "ws": True},
    "desc BN32 stages 3": {"desc": True, "stages": 3, "BN": 32, "num_stages": 3},
    "fma": {"fma": True},
    "acc": {"acc": True},
    "fma+acc": {"fma": True, "acc": True},
    "fma+acc BN32 stages 3": {"fma": True, "acc": True, "stages": 3, "BN": 32, "num_stages": 3},
    "fma+acc ws": {"fma": True, "acc": True, "ws": True},
    "fma+acc desc": {"fma": True, "acc": True, "desc": True},
    "fma+acc desc ws": {"fma": True, "acc": True, "desc": True, "ws": True},
}


def row(depths: list[int], names: list[str], check: bool) -> dict:
    g = torch.Generator(device="cuda").manual_seed(sum(depths) + len(depths))
    ks, vs = [], []
    for depth in depths:
        capacity = -(-(depth + T) // 8192) * 8192
        ks.append(torch.randn(HKV, capacity, D, device="cuda", generator=g).bfloat16())
        vs.append(torch.randn(HKV, capacity, D, device="cuda", generator=g).bfloat16())
    q = torch.randn(HQ, len(depths) * T, D, device="cuda", generator=g).bfloat16()
    lengths = [x + T for x in depths]
    out = torch.empty(len(depths) * T, HQ, D, dtype=torch.bfloat16, device="cuda")
    ref = None
    if check:
        ref = reference.attention(q[:, :T].float(), ks[0][:, : lengths[0]].float(), vs[0][:, : lengths[0]].float(), SCALE)
    flops = sum(4 * T * (x + T / 2) * D * HQ for x in depths)
    result = {"depths": depths if len(set(depths)) > 1 else f"{depths[0]} x {len(depths)}"}
    library = None
    for name in names:
        variant = VARIANTS[name]
        if variant is None:
            fn = lambda: ta.attend_sessions(q, ks, vs, lengths, SCALE, out=out)
            alone_fn = lambda j: ta.attend_sessions(q[:, j * T:(j + 1) * T], [ks[j]], [vs[j]], [lengths[j]], SCALE)
        else:
            fn = lambda variant=variant: attend_variant(q, ks, vs, lengths, out, variant)
            alone_fn = lambda j, variant=variant: attend_variant(
                q[:, j * T:(j + 1) * T].contiguous(), [ks[j]], [vs[j]], [lengths[j]],
                torch.empty(T, HQ, D, dtype=torch.bfloat16, device="cuda"), variant)
        try:
            ms = gpu_ms(fn)
        except Exception as e:  # a variant this Triton or this GPU cannot build
            result[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            continue
        batched = fn().clone()
        if variant is None:
            library = batched
        entry = {"ms": round(ms, 4), "TFLOP/s": round(flops / ms / 1e9, 1),
                 "same bits twice": torch.equal(batched, fn())}
        if variant is not None and library is not None:
            entry["library's bits"] = torch.equal(batched, library)
        if len(depths) > 1:
            entry["batched == alone"] = all(torch.equal(batched[j * T:(j + 1) * T], alone_fn(j)) for j in range(len(depths)))
        if ref is not None:
            entry["max |diff| vs float32"] = float((batched[:T].float() - ref).abs().max())
        result[name] = entry
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", default="16384,65536")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    names = [x.strip() for x in args.variants.split(",")]
    if any("desc" in VARIANTS[n] for n in names if VARIANTS[n]):
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    rows = []
    for depth in (int(x) for x in args.depths.split(",")):
        for b in (int(x) for x in args.batches.split(",")):
            rows.append(row([depth] * b, names, b == 1))
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
