"""Where a grid chunk's time goes on the GPU (0.8B shape, random weights), and whether two
processes compute the same state (and a third with an empty Triton cache). Run on the device: python3 experiments/profile_chunk.py
Prints: ms per chunk (advance over 32 chunks at 16k), GPU busy time per chunk from the torch
profiler with the top kernels, attention alone at two depths, and a cross-process state hash."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from shadow.offline.bench.readrate import random_ids
from shadow.core.reader import open_reader
from shadow.model import runtime
from shadow.model.kernels import triton_attention


def state_hash(state) -> str:
    h = hashlib.sha256()
    for name, t in state.tensors().items():
        h.update(name.encode())
        h.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    if sys.argv[1:] == ["hash"]:
        loaded, reader = open_reader("qwen3.5-0.8b", device="cuda")
        s = reader.new_session("h")
        reader.feed_prompt(s, random_ids(16384, seed=9))
        reader.advance(s)
        print(state_hash(s.state))
        return
    loaded, reader = open_reader("qwen3.5-0.8b", device="cuda")
    s = reader.new_session("p")
    reader.feed_prompt(s, random_ids(16384 + 64 * 512, seed=1))
    reader.advance(s, max_chunks=32)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    reader.advance(s, max_chunks=24)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1000 / 24
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        reader.advance(s, max_chunks=4)
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_total = sum(e.self_device_time_total for e in events) / 1000 / 4
    print(f"wall ms per chunk (16k..28k): {wall:.2f}; GPU busy ms per chunk: {gpu_total:.2f}")
    print(events.table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=60))

    q = torch.randn(8, 512, 256, device="cuda", dtype=torch.bfloat16)
    for length in (16896, 100352):
        k = torch.randn(2, length, 256, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        for _ in range(3):
            triton_attention.chunk_attention(q, k, v, 0.0625)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            triton_attention.chunk_attention(q, k, v, 0.0625)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1000 / 20
        flops = 4 * 512 * length * 256 * 8
        print(f"attention T=512 L={length}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s")

    def hash_in_child(env: dict[str, str]) -> str:
        run = subprocess.run([sys.executable, __file__, "hash"], capture_output=True, text=True, env=env)
        return (run.stdout.strip().splitlines() or ["failed: " + run.stderr[-300:]])[-1]

    hashes = [hash_in_child(dict(os.environ)) for _ in range(2)]
    # a third process with an empty Triton cache: fla tunes again unless its configs are pinned
    with tempfile.TemporaryDirectory() as empty:
        cleared = hash_in_child({**os.environ, "TRITON_CACHE_DIR": empty})
    print(json.dumps({"cross_process_hashes": hashes, "cross_process_equal": hashes[0] == hashes[1],
                      "cleared_cache_hash": cleared, "cleared_cache_equal": cleared == hashes[0],
                      "autotune_pins": runtime.pin_autotuning()}))


if __name__ == "__main__":
    main()
