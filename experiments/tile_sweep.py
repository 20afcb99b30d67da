"""Tiles for the project's Triton kernels on this GPU: chunk attention and the causal conv.

For each candidate tile set, the GPU time of the kernel (20 calls captured in one CUDA graph,
replayed between two CUDA events after warm-up; median of 5 replays), its largest difference from a float32
reference, and whether two calls give the same bits. Attention is timed beside today's SDPA call
(flash) at the 0.8B's heads (8 query, 2 kv, 256 wide) for one 512-row chunk at several depths, on
the valid rows of a larger buffer as in a session; the conv at the 0.8B's GDN width (6,144
channels convolved and 2,080 copied out of the 8,224-wide merged projection). The chosen tiles go into TILES and
CONV_TILES and docs/BENCHMARKS.md.

    python3 experiments/tile_sweep.py [attention] [conv]   # on the H200; both when none named
"""

from __future__ import annotations

import statistics

import torch

from shadow.model.kernels import attention, reference, twins
from shadow.model.kernels import triton_attention as ta
from shadow.model.kernels import triton as tri

HQ, HKV, D, T = 8, 2, 256, 512
ATTENTION_TILES = [
    {"BM": 128, "BN": 64, "num_warps": 8, "num_stages": 2, "waves": 1},
    {"BM": 128, "BN": 64, "num_warps": 8, "num_stages": 2, "waves": 2},
    {"BM": 64, "BN": 64, "num_warps": 8, "num_stages": 2, "waves": 1},
    {"BM": 64, "BN": 64, "num_warps": 4, "num_stages": 2, "waves": 1},
    {"BM": 64, "BN": 32, "num_warps": 8, "num_stages": 3, "waves": 1},
    {"BM": 128, "BN": 32, "num_warps": 8, "num_stages": 3, "waves": 1},
]
CONV_TILES = [
    {"BT": 16, "BC": 128, "num_warps": 4},
    {"BT": 32, "BC": 128, "num_warps": 4},
    {"BT": 32, "BC": 128, "num_warps": 8},
    {"BT": 64, "BC": 128, "num_warps": 8},
    {"BT": 16, "BC": 256, "num_warps": 4},
    {"BT": 32, "BC": 256, "num_warps": 8},
    {"BT": 8, "BC": 128, "num_warps": 2},
    {"BT": 64, "BC": 64, "num_warps": 4},
]


def gpu_ms(fn, calls: int = 20, rounds: int = 5) -> float:
    """GPU ms of one call: `calls` calls captured in one CUDA graph, so host launch and allocation
    costs stay out (a 14 us conv is faster than its eager launch), replayed between two events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def attention_rows() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for depth in (0, 16384, 41472, 65536):
        length = depth + T
        capacity = -(-length // 8192) * 8192
        q = torch.randn(HQ, T, D, device="cuda", generator=g).bfloat16()
        k = torch.randn(HKV, capacity, D, device="cuda", generator=g).bfloat16()[:, :length]
        v = torch.randn(HKV, capacity, D, device="cuda", generator=g).bfloat16()[:, :length]
        attention_at(depth, q, k, v)


def attention_at(depth: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    scale = D ** -0.5
    want = reference.attention(q.float(), k.float(), v.float(), scale)
    flops = 4 * HQ * T * D * (k.shape[1] - T / 2)
    ways = [("sdpa (flash)", lambda: attention.attention_sdpa(q, k, v, scale))]
    ways += [(f"triton {t['BM']}x{t['BN']} w{t['num_warps']} s{t['num_stages']} x{t['waves']}",
              lambda t=t: ta.chunk_attention(q, k, v, scale, t)) for t in ATTENTION_TILES]
    for name, fn in ways:
        try:
            a, b = fn(), fn()
            ms = gpu_ms(fn)
        except Exception as e:  # noqa: BLE001 - a tile set this GPU refuses (e.g. too much shared memory): say so, go on
            print(f"attention depth {depth:>6}  {name:<30} failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        err = (a.float() - want).abs().max().item()
        print(f"attention depth {depth:>6}  {name:<30} {ms:7.3f} ms  {flops / ms / 1e9:5.0f} TFLOP/s  "
              f"max|diff| {err:.1e}  same bits twice: {torch.equal(a, b)}", flush=True)


def conv_rows() -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(T, 8224, device="cuda", generator=g).bfloat16()
    state = torch.randn(6144, 3, device="cuda", generator=g).bfloat16()
    w = torch.randn(6144, 4, device="cuda", generator=g).bfloat16()
    want = twins.conv_split(x, state, w, 2048, 2048, 16)
    floor = gpu_ms(lambda: x.clone())  # the same bytes read and written once: the bandwidth floor
    print(f"conv floor: a copy of the projection {floor * 1000:7.1f} us", flush=True)
    for tiles in CONV_TILES:
        name = f"{tiles['BT']}x{tiles['BC']} w{tiles['num_warps']}"
        got = tri.conv_split(x, state, w, 2048, 2048, 16, tiles)
        same = all(torch.equal(a, b) for a, b in zip(got, tri.conv_split(x, state, w, 2048, 2048, 16)))
        ms = gpu_ms(lambda tiles=tiles: tri.conv_split(x, state, w, 2048, 2048, 16, tiles))
        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
        print(f"conv {name:<16} {ms * 1000:7.1f} us  max|diff| vs twin {err:.1e}  same bits as default tiles: {same}",
              flush=True)


if __name__ == "__main__":
    import sys

    parts = sys.argv[1:] or ["attention", "conv"]  # e.g. `tile_sweep.py conv`
    if "attention" in parts:
        attention_rows()
    if "conv" in parts:
        conv_rows()
