"""Attention for a chunk at depth, three ways, timed and checked (the next lever on the chunk time).

A chunk's T new rows attend to P cached rows (no mask) and to themselves (causal). Today one
SDPA call with a lower-right causal mask does both (flash's split-KV kernel on the H200). Split,
the P-row part is a plain unmasked attention, which more backends take (cuDNN among them), and the
T x T part is a small causal square; the two merge exactly by their log-sum-exp.

    python3 experiments/attention_split.py --device cuda          # on the H200: times and checks
    python3 experiments/attention_split.py --device cpu --depth 2048   # the merge, checked on a CPU

Prints, per depth: ms (median of 20 after warm-up, CUDA events) and the largest difference from
a float32 reference for each way, and whether two runs of a way give the same bits.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from shadow.model import ops

HQ, HKV, D, T = 8, 2, 256, 512  # the 0.8B's attention heads; one 512-row chunk


def one_call(q, k, v, scale):
    """What the fast path does now: one SDPA call with a lower-right causal mask."""
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(q.shape[1], k.shape[1])
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True)[0]


def with_lse(q, k, v, scale, causal):
    """(out [Hq, T, D], log-sum-exp [Hq, T] float32) of plain attention, by the best way at hand:
    flash's aten op on CUDA, the math elsewhere."""
    if q.is_cuda:
        try:  # the flash kernel reads grouped kv heads itself
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
                q[None], k[None], v[None], 0.0, causal, False, scale=scale)[:2]
        except RuntimeError:  # this build wants equal heads: repeat them (the copy is timed too)
            groups = q.shape[0] // k.shape[0]
            k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
                q[None], k[None], v[None], 0.0, causal, False, scale=scale)[:2]
        return out[0], lse[0]
    groups = q.shape[0] // k.shape[0]
    kf, vf = k.float().repeat_interleave(groups, 0), v.float().repeat_interleave(groups, 0)
    scores = (q.float() @ kf.transpose(-1, -2)) * scale
    if causal:
        future = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).triu(1)
        scores.masked_fill_(future, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return (torch.softmax(scores, -1) @ vf).to(q.dtype), lse


def split(q, k, v, scale):
    """The cached rows (no mask) and the new rows (causal square) apart, merged by log-sum-exp."""
    t = q.shape[1]
    o1, l1 = with_lse(q, k[:, :-t], v[:, :-t], scale, causal=False)
    o2, l2 = with_lse(q, k[:, -t:], v[:, -t:], scale, causal=True)
    m = torch.maximum(l1, l2)
    w1, w2 = (l1 - m).exp()[..., None], (l2 - m).exp()[..., None]
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(q.dtype)


def cudnn_split(q, k, v, scale):
    """As `split`, the cached rows through cuDNN's attention (unmasked, with log-sum-exp)."""
    t, groups = q.shape[1], q.shape[0] // k.shape[0]
    kp, vp = k[:, :-t].repeat_interleave(groups, 0), v[:, :-t].repeat_interleave(groups, 0)
    o1, l1 = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q[None], kp[None], vp[None], None, True, 0.0, False, False, scale=scale)[:2]
    o1, l1 = o1[0], l1[0].reshape(q.shape[0], t)
    o2, l2 = with_lse(q, k[:, -t:], v[:, -t:], scale, causal=True)
    m = torch.maximum(l1, l2)
    w1, w2 = (l1 - m).exp()[..., None], (l2 - m).exp()[..., None]
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(q.dtype)


def timed(fn, *args, runs: int = 20) -> float:
    if not args[0].is_cuda:
        return float("nan")
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--depth", type=int, action="append", help="cached rows before the chunk (repeatable)")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    gen = torch.Generator(device=args.device).manual_seed(0)
    scale = D ** -0.5
    ways = {"one call (now)": one_call, "split, flash": split, "split, cuDNN": cudnn_split}
    for depth in args.depth or [16384, 41472, 65536]:
        length = depth + T
        capacity = -(-length // 8192) * 8192  # the session's buffer: a slice of a larger one, as live
        q = torch.randn(HQ, T, D, device=args.device, generator=gen, dtype=dtype)
        k_buf = torch.randn(HKV, capacity, D, device=args.device, generator=gen, dtype=dtype)
        v_buf = torch.randn(HKV, capacity, D, device=args.device, generator=gen, dtype=dtype)
        k, v = k_buf[:, :length], v_buf[:, :length]
        want = ops.attention(q.float(), k.float(), v.float(), scale).transpose(0, 1)  # [Hq, T, D]
        for name, fn in ways.items():
            try:
                first, second = fn(q, k, v, scale), fn(q, k, v, scale)
                err = (first.float() - want).abs().max().item()
                same = torch.equal(first, second)
                print(f"depth {depth:>6}  {name:<16} {timed(fn, q, k, v, scale):7.3f} ms  "
                      f"max |diff| {err:.2e}  same bits twice: {same}")
            except Exception as e:  # a backend this build lacks: say so and go on
                print(f"depth {depth:>6}  {name:<16} not available: {type(e).__name__}: {str(e)[:120]}")


if __name__ == "__main__":
    main()
