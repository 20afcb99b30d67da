"""Which attention kernel is fastest for a chunk's rows over a long context, on this GPU?

The 0.8B's full-attention shape: a 512-row chunk of 8 query heads over one session's cached rows
(2 key heads, 256 wide, bf16), B sessions at the same depth. Timed side by side in one run, on the
same data: the project's chunk attention (`triton_attention.attend_sessions`: lower-right causal,
GQA-packed, split over the cached rows, merged), and PyTorch's fused kernels through
`scaled_dot_product_attention` restricted to one backend each (cuDNN, flash, memory-efficient),
over the same rows without a mask (so they do a little more work: the chunk's own 512 x 512
square whole; their rate is counted by that work), their key heads repeated to the query heads
outside the timing where the backend takes no GQA; cuDNN also with the rows split into 4 slices
as a batch of 4 (how a kernel with no split of its own would fill the GPU for one session, merge
not timed); cuDNN as the library would have to call it (`cudnn_chunk`: a session at a time, its
cached rows in 4 slices as a batch, the rows left over, the chunk's causal square, merged by
log-sum-exp; with its float32 difference and the time of a first call at shapes no call met,
which builds cuDNN graphs), and its calls alone; FlexAttention (compiled, lower-right causal
block mask, GQA); and FlashAttention-4's CuTe forward where `flash_attn.cute` is installed
(varlen, the cached rows packed and in 512-row pages, copied to its layout or read in place as
strided views of one head-major pool; for one session also its cached rows cut into 4 or 8 slices
by its own depth and merged by log-sum-exp; its first call's compile time, and its difference from
the library's kernel). 20 back-to-back calls between CUDA events after warm-up, median of 5 rounds.
Each row also says whether the kernel gave a session the same bits alone and in the batch, and
twice.

    python3 experiments/attention_kernels.py --depths 16384,65536 --batches 1,8
    python3 experiments/attention_kernels.py --arms fa4     # the library's kernel beside FA4 alone
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from shadow.model.kernels import reference
from shadow.model.kernels import triton_attention as ta
from shadow.model.kernels.lse_merge import merge_parts, merge_table, split_rows

from attention_batch import gpu_ms  # run as a script: experiments/ is on the path

HQ, HKV, D, T = 8, 2, 256, 512
SCALE = D ** -0.5


def tflops(flops: float, ms: float) -> float:
    return round(flops / ms / 1e9, 1)


def measure(name: str, fn, flops: float, alone=None) -> dict:
    """Time `fn`; where `alone` (a function giving session 0's rows computed alone) is given, compare."""
    try:
        ms = gpu_ms(fn)
    except Exception as e:  # a backend that refuses the shape says so, and the survey goes on
        return {"kernel": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    out = fn().clone()
    row = {"kernel": name, "ms": round(ms, 4), "TFLOP/s": tflops(flops, ms), "same bits twice": torch.equal(out, fn())}
    if alone is not None:
        row["session 0 alone == in batch"] = torch.equal(alone(), out[0] if out.dim() == 4 else out[:T])
    return row


def cudnn_chunk(q1: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, merge: bool = True) -> torch.Tensor:
    """One session's chunk through PyTorch's cuDNN attention op: q1 [Hq, T, D], the session's key and
    value buffers [Hkv, >= length, D]; the cached rows before the chunk in 4 slices as a batch
    (and the rows left over), the chunk's own square with the causal mask, merged by log-sum-exp."""
    op = torch.ops.aten._scaled_dot_product_cudnn_attention
    start = length - T
    per = max(T, start // 4 // T * T)
    count = start // per
    qb = q1.unsqueeze(0)
    parts = []
    if count:
        kk = k[:, : count * per].unflatten(1, (count, per)).transpose(0, 1)
        vv = v[:, : count * per].unflatten(1, (count, per)).transpose(0, 1)
        parts.append(op(qb.expand(count, -1, -1, -1), kk, vv, None, True, 0.0, False, False, scale=SCALE)[:2])
    if start > count * per:
        parts.append(op(qb, k[None, :, count * per : start], v[None, :, count * per : start], None, True, 0.0, False,
                        False, scale=SCALE)[:2])
    parts.append(op(qb, k[None, :, start:length], v[None, :, start:length], None, True, 0.0, True, False, scale=SCALE)[:2])
    if not merge:
        return parts[-1][0]
    out = torch.cat([o for o, _ in parts]).float()  # [N, Hq, T, D]
    lse = torch.cat([m.reshape(o.shape[:3]) for o, m in parts])  # [N, Hq, T]
    weight = torch.softmax(lse, dim=0)
    return (weight[..., None] * out).sum(0).transpose(0, 1).to(q1.dtype)


def survey(depth: int, batch: int, arms: str = "all") -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(depth + batch)
    length = depth + T
    ks = [torch.randn(HKV, length, D, device="cuda", generator=g).bfloat16() for _ in range(batch)]
    vs = [torch.randn(HKV, length, D, device="cuda", generator=g).bfloat16() for _ in range(batch)]
    q = torch.randn(HQ, batch * T, D, device="cuda", generator=g).bfloat16()
    causal_flops = batch * 4 * T * (depth + T / 2) * D * HQ
    full_flops = batch * 4 * T * length * D * HQ
    rows = []
    out = torch.empty(batch * T, HQ, D, dtype=torch.bfloat16, device="cuda")
    rows.append(measure(
        "shadow triton (causal, GQA-packed, split)",
        lambda: ta.attend_sessions(q, ks, vs, [length] * batch, SCALE, out=out), causal_flops,
        (lambda: ta.attend_sessions(q[:, :T], ks[:1], vs[:1], [length], SCALE)) if batch > 1 else None,
    ))
    if arms == "fa4":  # the library's kernel and FlashAttention-4 alone
        rows += flash_attn_4(q, ks, vs, out, depth, batch, causal_flops)
        for row in rows:
            row.update(depth=depth, batch=batch)
        return rows
    # SDPA's layout: [B, H, L, D]
    qb = q.view(HQ, batch, T, D).transpose(0, 1).contiguous()
    kb, vb = torch.stack(ks), torch.stack(vs)
    kx, vx = kb.repeat_interleave(HQ // HKV, dim=1), vb.repeat_interleave(HQ // HKV, dim=1)
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    for label, backend in backends.items():
        def call(qq=qb, kk=kx, vv=vx, backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qq, kk, vv, scale=SCALE)
        rows.append(measure(f"sdpa {label} (no mask, heads repeated)", call, full_flops,
                            (lambda call=call: call(qb[:1], kx[:1], vx[:1])[0]) if batch > 1 else None))
    if batch == 1 and length % 4 == 0:  # the rows as 4 slices, a batch of 4 of the same queries
        qs = qb.expand(4, -1, -1, -1).contiguous()
        ksl = kx.view(HQ, 4, length // 4, D).transpose(0, 1).contiguous()
        vsl = vx.view(HQ, 4, length // 4, D).transpose(0, 1).contiguous()

        def sliced():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(qs, ksl, vsl, scale=SCALE)
        rows.append(measure("sdpa cudnn, 4 slices as a batch (merge not timed)", sliced, full_flops))
    sliced_session = lambda j: cudnn_chunk(q[:, j * T : (j + 1) * T], ks[j], vs[j], length)
    rows.append(measure("cudnn sliced: 4 slices + rest + causal square, merged (a session a call)",
                        lambda: torch.cat([sliced_session(j) for j in range(batch)]), causal_flops,
                        (lambda: sliced_session(0)) if batch > 1 else None))
    rows.append(measure("cudnn sliced, the calls alone (no merge)",
                        lambda: [cudnn_chunk(q[:, j * T : (j + 1) * T], ks[j], vs[j], length, False) for j in range(batch)][-1],
                        causal_flops))
    try:
        mine = ta.attend_sessions(q[:, :T], ks[:1], vs[:1], [length], SCALE).float()
        theirs = sliced_session(0).float()
        rows[-2]["max |diff| from shadow triton"] = float((theirs - mine).abs().max())
        if batch == 1:
            exact = reference.attention(q[:, :T].float(), ks[0].float(), vs[0].float(), SCALE)
            rows[-2]["max |diff| from float32"] = float((theirs - exact).abs().max())
            rows[0]["max |diff| from float32"] = float((mine - exact).abs().max())
        t0 = time.perf_counter()
        cudnn_chunk(q[:, :T], ks[0], vs[0], length - T)  # shapes no call met: a graph built for each
        torch.cuda.synchronize()
        rows[-2]["first call at new shapes, ms"] = round((time.perf_counter() - t0) * 1000, 1)
    except Exception as e:
        rows[-2]["check error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        offset = depth

        def lower_right(b, h, qi, ki):
            return ki <= qi + offset
        mask = create_block_mask(lower_right, batch, None, T, length, device="cuda")
        flex = torch.compile(flex_attention, dynamic=False)
        rows.append(measure("flex attention (compiled, lower-right causal, GQA)",
                            lambda: flex(qb, kb, vb, block_mask=mask, scale=SCALE, enable_gqa=True), causal_flops))
    except Exception as e:
        rows.append({"kernel": "flex attention", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
    rows += flash_attn_4(q, ks, vs, out, depth, batch, causal_flops)
    for row in rows:
        row.update(depth=depth, batch=batch)
    return rows


def flash_attn_4(q, ks, vs, mine, depth: int, batch: int, flops: float) -> list[dict]:
    """FlashAttention-4's CuTe forward (`flash_attn.cute`, SM90 for head dim 256) on the same rows,
    in its layout ([rows, heads, 256], sessions as variable-length sequences, the causal mask
    aligned bottom-right): the cached rows packed, and in 512-row pages through a page table. The
    layout change is made before the timing. `mine`: the library's output of the same call."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001 - not installed here: said so, the survey goes on
        return [{"kernel": "flash-attn-4", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}]
    length = depth + T
    qf = q.view(HQ, batch * T, D).transpose(0, 1).contiguous()  # [B*T, Hq, D]
    kf = torch.cat([k.transpose(0, 1) for k in ks]).contiguous()  # [B*length, Hkv, D]
    vf = torch.cat([v.transpose(0, 1) for v in vs]).contiguous()
    cu_q = torch.arange(0, (batch + 1) * T, T, dtype=torch.int32, device="cuda")
    cu_k = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device="cuda")
    pages = length // T
    kp, vp = kf.view(batch * pages, T, HKV, D), vf.view(batch * pages, T, HKV, D)
    table = torch.arange(batch * pages, dtype=torch.int32, device="cuda").view(batch, pages)
    used = torch.full((batch,), length, dtype=torch.int32, device="cuda")

    def packed(n=batch):
        return flash_attn_varlen_func(qf[: n * T], kf[: n * length], vf[: n * length], cu_seqlens_q=cu_q[: n + 1],
                                      cu_seqlens_k=cu_k[: n + 1], max_seqlen_q=T, max_seqlen_k=length,
                                      softmax_scale=SCALE, causal=True)[0]

    def paged(n=batch):
        return flash_attn_varlen_func(qf[: n * T], kp, vp, cu_seqlens_q=cu_q[: n + 1], seqused_k=used[:n],
                                      page_table=table[:n], max_seqlen_q=T, max_seqlen_k=length,
                                      softmax_scale=SCALE, causal=True)[0]
    # the rows where the library keeps them, head-major ([Hkv, rows, D]), in one pool for the sessions:
    # FA4 reads strided views of it (its layout asks only unit stride in D and aligned strides), no copy
    kpool = torch.stack(ks, dim=1).view(HKV, batch * length, D)
    vpool = torch.stack(vs, dim=1).view(HKV, batch * length, D)
    kpages = kpool.view(HKV, batch * pages, T, D).permute(1, 2, 0, 3)  # [pages, T, Hkv, D]
    vpages = vpool.view(HKV, batch * pages, T, D).permute(1, 2, 0, 3)

    def strided(n=batch):
        return flash_attn_varlen_func(qf[: n * T], kpool.transpose(0, 1)[: n * length], vpool.transpose(0, 1)[: n * length],
                                      cu_seqlens_q=cu_q[: n + 1], cu_seqlens_k=cu_k[: n + 1], max_seqlen_q=T,
                                      max_seqlen_k=length, softmax_scale=SCALE, causal=True)[0]

    def strided_pages(n=batch):
        return flash_attn_varlen_func(qf[: n * T], kpages, vpages, cu_seqlens_q=cu_q[: n + 1], seqused_k=used[:n],
                                      page_table=table[:n], max_seqlen_q=T, max_seqlen_k=length,
                                      softmax_scale=SCALE, causal=True)[0]
    arms = [("flash-attn-4 varlen (causal bottom-right, GQA)", packed),
            ("flash-attn-4 varlen, 512-row pages", paged),
            ("flash-attn-4 varlen over the head-major pool (strided, no copy)", strided),
            ("flash-attn-4 512-row pages over the head-major pool (strided, no copy)", strided_pages)]
    starts = [j * length for j in range(batch)]
    split = fa4_split_sessions(qf, kpool, vpool, starts, [length] * batch)
    fused = fa4_split_sessions(qf, kpool, vpool, starts, [length] * batch, merge="triton")
    arms += [("flash-attn-4 split by depth, the batch in 2 varlen calls + merge (strided, no copy)", split),
             ("the same, one CUDA graph", graphed(split)),
             ("flash-attn-4 split by depth, merged in one Triton launch (lse_merge)", fused),
             ("the same (Triton merge), one CUDA graph", graphed(fused))]
    if batch == 1:
        for slices in (4, 8):
            arms.append((f"flash-attn-4 one session split in {slices} (cached slices + causal tail, merged by lse)",
                         functools.partial(fa4_split, qf[:T], ks[0], vs[0], slices)))
    rows = []
    first_bits = None
    for name, fn in arms:
        t0 = time.perf_counter()
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a refused shape is a finding
            rows.append({"kernel": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
            continue
        first = round(time.perf_counter() - t0, 2)
        row = measure(name, fn, flops, (lambda fn=fn: fn(1)) if batch > 1 else None)
        row["first call (compiles), s"] = first
        if "error" not in row:
            got = fn()
            row["max |diff| from shadow triton"] = float((got.float() - mine.float()).abs().max())
            first_bits = got if first_bits is None else first_bits
            row["same bits as the first FA4 arm"] = torch.equal(got, first_bits)
        rows.append(row)
    return rows


def fa4_split_sessions(qf: torch.Tensor, kpool: torch.Tensor, vpool: torch.Tensor, starts: list[int],
                       lengths: list[int], merge: str = "torch"):
    """B sessions' chunks through FA4, each session's cached rows cut by its own depth
    (`lse_merge.split_rows`): every session's slices in one varlen call without a mask (the queries
    repeated a slice), every session's tail (the rows left and the chunk's own) in one varlen call
    with the causal mask aligned bottom-right, the parts merged by their log-sum-exp in float32 in
    part order: a session at a time in torch ops (`merge="torch"`), or all in the library's one
    Triton launch (`"triton"`: `lse_merge.merge_parts`). qf [B*T, Hq, D]; session b's rows at starts[b] .. starts[b] + lengths[b] of
    the head-major pools [Hkv, rows, D], read in place (`seqused_k`: sessions need not touch).
    Returns a call giving [B*T, Hq, D] (`call(n)`: the first n sessions alone); the index tables are
    built here, once, so that the call can be captured in a CUDA graph."""
    from flash_attn.cute import flash_attn_varlen_func

    k_rows, v_rows = kpool.transpose(0, 1), vpool.transpose(0, 1)
    dev = qf.device
    ints = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)

    def plan(b: int) -> dict:
        plans = [split_rows(lengths[j] - T, T) for j in range(b)]
        picks, cu_k, used = [], [], []
        for j, (per, count) in enumerate(plans):
            for i in range(count):
                picks.append(j)
                cu_k.append(starts[j] + i * per)
                used.append(per)
        tail_k = [starts[j] + per * count for j, (per, count) in enumerate(plans)]
        tail_used = [lengths[j] - (tail_k[j] - starts[j]) for j in range(b)]
        return {"plans": plans, "picks": torch.tensor(picks, dtype=torch.int64, device=dev), "slices": len(picks),
                "cu_q": ints(list(range(0, (len(picks) + 1) * T, T))), "cu_k": ints(cu_k + [cu_k[-1] + used[-1]] if cu_k else [0]),
                "used": ints(used), "max_used": max(used, default=0),
                "tail_cu_q": ints(list(range(0, (b + 1) * T, T))), "tail_cu_k": ints(tail_k + [tail_k[-1] + tail_used[-1]]),
                "tail_used": ints(tail_used), "max_tail": max(tail_used),
                "table": merge_table([count for _, count in plans], dev)}
    plans = {}

    def call(n: int | None = None) -> torch.Tensor:
        b = len(lengths) if n is None else n
        if b not in plans:
            plans[b] = plan(b)
        p = plans[b]
        q = qf[: b * T]
        if p["slices"]:
            q_rep = q.view(b, T, HQ, D).index_select(0, p["picks"]).view(-1, HQ, D)
            o1, lse1 = flash_attn_varlen_func(q_rep, k_rows, v_rows, cu_seqlens_q=p["cu_q"], cu_seqlens_k=p["cu_k"],
                                              seqused_k=p["used"], max_seqlen_q=T, max_seqlen_k=p["max_used"],
                                              softmax_scale=SCALE, causal=False, return_lse=True)[:2]
        o2, lse2 = flash_attn_varlen_func(q, k_rows, v_rows, cu_seqlens_q=p["tail_cu_q"], cu_seqlens_k=p["tail_cu_k"],
                                          seqused_k=p["tail_used"], max_seqlen_q=T, max_seqlen_k=p["max_tail"],
                                          softmax_scale=SCALE, causal=True, return_lse=True)[:2]
        if merge == "triton":
            counts = [count for _, count in p["plans"]]
            if not p["slices"]:
                o1, lse1 = o2[:0], lse2[:, :0]
            return merge_parts(o1, lse1, o2, lse2, counts, T, table=p["table"])
        out = torch.empty(b * T, HQ, D, dtype=qf.dtype, device=dev)
        first = 0
        for j, (per, count) in enumerate(p["plans"]):  # a session's parts: its slices in order, then its tail
            tail_o, tail_lse = o2[j * T : (j + 1) * T][None], lse2[:, j * T : (j + 1) * T][:, None]
            if count:
                rows = slice(first * T, (first + count) * T)
                o = torch.cat([o1[rows].view(count, T, HQ, D), tail_o])
                lse = torch.cat([lse1[:, rows].view(HQ, count, T), tail_lse], 1)
            else:
                o, lse = tail_o, tail_lse
            weight = torch.softmax(lse.permute(1, 2, 0), dim=0)  # [parts, T, Hq]
            out[j * T : (j + 1) * T] = (weight[..., None] * o.float()).sum(0)
            first += count
        return out
    return call


def graphed(fn):
    """`fn` captured in one CUDA graph after warm-up (its host work, tables included, done once at
    capture); the replay returns the captured output. Accepts `n` as `fn` does (then runs `fn` eager)."""
    state = {}

    def call(n=None):
        if n is not None:
            return fn(n)
        if "graph" not in state:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                state["out"] = fn()
            state["graph"] = graph
        state["graph"].replay()
        return state["out"]
    return call


def fa4_split(q1: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slices: int, n: int = 1) -> torch.Tensor:
    """One session's chunk through FA4 with its cached rows cut into at most `slices` slices of whole
    chunks (`split_rows`, a function of its own depth alone), so that one chunk fills the GPU: q1 [T, Hq, D]; k, v the session's
    head-major buffers [Hkv, L, D], read in place. The slices, as a batch of the same queries, without
    a mask; the rest and the chunk's own rows with the causal mask aligned bottom-right; the parts
    merged by their log-sum-exp in float32. Returns [T, Hq, D]. (`n` is a batch of one: the survey's
    call shape.)"""
    from flash_attn.cute import flash_attn_func

    length = k.shape[1]
    per, count = split_rows(length - T, T, slices, least=T)
    parts, lses = [], []
    if count:
        kk = k[:, : count * per].view(HKV, count, per, D).permute(1, 2, 0, 3)
        vv = v[:, : count * per].view(HKV, count, per, D).permute(1, 2, 0, 3)
        o, lse = flash_attn_func(q1.expand(count, -1, -1, -1), kk, vv, softmax_scale=SCALE, causal=False,
                                 return_lse=True)[:2]
        parts.append(o)
        lses.append(lse)
    o, lse = flash_attn_func(q1[None], k[:, count * per : length].transpose(0, 1)[None],
                             v[:, count * per : length].transpose(0, 1)[None], softmax_scale=SCALE, causal=True,
                             return_lse=True)[:2]
    parts.append(o)
    lses.append(lse)
    weight = torch.softmax(torch.cat(lses).transpose(1, 2), dim=0)  # [parts, T, Hq]
    return (weight[..., None] * torch.cat(parts).float()).sum(0).to(q1.dtype)


def fa4_in_place(qf: torch.Tensor, kpool: torch.Tensor, vpool: torch.Tensor, starts: list[int], lengths: list[int]):
    """B sessions' chunks through one FA4 varlen call over the head-major pools in place (no split),
    each session's rows at starts[b] .. starts[b] + lengths[b]; returns a call giving [B*T, Hq, D]."""
    from flash_attn.cute import flash_attn_varlen_func

    b, dev = len(lengths), qf.device
    cu_q = torch.arange(0, (b + 1) * T, T, dtype=torch.int32, device=dev)
    cu_k = torch.tensor(starts + [starts[-1] + lengths[-1]], dtype=torch.int32, device=dev)
    used = torch.tensor(lengths, dtype=torch.int32, device=dev)
    return lambda: flash_attn_varlen_func(qf, kpool.transpose(0, 1), vpool.transpose(0, 1), cu_seqlens_q=cu_q,
                                          cu_seqlens_k=cu_k, seqused_k=used, max_seqlen_q=T, max_seqlen_k=max(lengths),
                                          softmax_scale=SCALE, causal=True)[0]


def survey_mixed(depths: list[int]) -> list[dict]:
    """One batch of sessions at the given depths (a chunk of T rows each), their rows in one
    head-major pool: the library's kernel, FA4 in place unsplit, and FA4 split by each session's
    depth and merged by `lse_merge` (eager and graphed); each row says whether every session alone
    (its own call, its own sizes) has the bits of its rows in the batch."""
    g = torch.Generator(device="cuda").manual_seed(len(depths))
    lengths = [d + T for d in depths]
    starts = [sum(lengths[:j]) for j in range(len(lengths))]
    kpool = torch.randn(HKV, sum(lengths), D, device="cuda", generator=g).bfloat16()
    vpool = torch.randn(HKV, sum(lengths), D, device="cuda", generator=g).bfloat16()
    qf = torch.randn(len(depths) * T, HQ, D, device="cuda", generator=g).bfloat16()
    q = qf.transpose(0, 1).contiguous()  # the library's layout, [Hq, B*T, D]
    ks = [kpool[:, a : a + n] for a, n in zip(starts, lengths)]
    vs = [vpool[:, a : a + n] for a, n in zip(starts, lengths)]
    flops = sum(4 * T * (d + T / 2) * D * HQ for d in depths)

    def library(js):
        return ta.attend_sessions(q[:, [i for j in js for i in range(j * T, (j + 1) * T)]].contiguous() if js != all_
                                  else q, [ks[j] for j in js], [vs[j] for j in js], [lengths[j] for j in js], SCALE)
    all_ = list(range(len(depths)))
    arms = [("shadow triton (causal, GQA-packed, split)", lambda js: library(js))]
    for label, make in (("flash-attn-4 in place, unsplit", fa4_in_place),
                        ("flash-attn-4 split by depth, lse_merge", functools.partial(fa4_split_sessions, merge="triton"))):
        def arm(js, make=make):
            rows = torch.cat([qf[j * T : (j + 1) * T] for j in js]) if js != all_ else qf
            return make(rows, kpool, vpool, [starts[j] for j in js], [lengths[j] for j in js])()
        arms.append((label, arm))
    batched_split = fa4_split_sessions(qf, kpool, vpool, starts, lengths, merge="triton")
    arms.append(("flash-attn-4 split by depth, lse_merge, one CUDA graph", lambda js, fn=graphed(batched_split):
                 fn() if js == all_ else arms[2][1](js)))
    rows = []
    for name, fn in arms:
        try:
            whole = lambda fn=fn: fn(all_)
            ms = gpu_ms(whole)
            out = whole().clone()
            row = {"kernel": name, "ms": round(ms, 4), "TFLOP/s": tflops(flops, ms), "same bits twice": torch.equal(out, whole()),
                   "every session alone == in batch": all(torch.equal(fn([j]), out[j * T : (j + 1) * T]) for j in all_)}
            if rows:
                row["max |diff| from shadow triton"] = float((out.float() - rows[0]["_out"].float()).abs().max())
            row["_out"] = out
        except Exception as e:  # noqa: BLE001 - a refused shape is a finding
            row = {"kernel": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
        rows.append(row)
    for row in rows:
        row.pop("_out", None)
        row.update(depths=depths, batch=len(depths))
    return rows


def whole_numbers(least: int):
    """An argparse type: whole numbers >= `least`, comma-separated (a refusal is one line, exit 2)."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            values = []
        if not values or min(values) < least:
            raise argparse.ArgumentTypeError(f"whole numbers >= {least}, comma-separated, not {text!r}")
        return values
    return parse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", default=[16384, 65536], type=whole_numbers(0), help="cached rows a session")
    parser.add_argument("--batches", default=[1, 8], type=whole_numbers(1), help="sessions a call")
    parser.add_argument("--arms", choices=("all", "fa4"), default="all",
                        help="fa4: the library's kernel and FlashAttention-4 only")
    parser.add_argument("--mixed", default=[], type=lambda t: whole_numbers(0)(t) if t else [],
                        help="depths of one batch of sessions at mixed depths (FA4 arms), e.g. 0,4096,...,65536")
    args = parser.parse_args(argv)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), flush=True)
    every = []
    for depth in args.depths:
        for batch in args.batches:
            for row in survey(depth, batch, args.arms):
                every.append(row)
                print(json.dumps(row), flush=True)
    if args.mixed:
        for row in survey_mixed(args.mixed):
            every.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({"rows": every}))


if __name__ == "__main__":
    main()
