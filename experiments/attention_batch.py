"""The chunk attention kernel against an earlier one, alone and in batches, on the GPU.

For one 512-row chunk of the 0.8B's heads (8 query, 2 kv, 256 wide) over the valid rows of a
larger buffer, as in a session: the GPU time of `triton_attention.attend_sessions` (one launch for
B sessions, GQA-packed, writing the new rows too) and, where `--old FILE` names an earlier build's
`triton_attention.py`, of its `chunk_attention` called once a session (and the rows written by
copies, as that build did), side by side in the same run. 20 back-to-back eager calls between CUDA
events after warm-up (attention runs eagerly in a read), median of 5 rounds. Checked each time:
every session's rows in a batch are the bits it gets alone (`torch.equal`), and the largest
difference from a float32 reference. `--tiles` adds tile sets for the new kernel.

    python3 experiments/attention_batch.py --old OLD.py --depths 0,16384,65536 --batches 1,2,4,8
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics

import torch

from shadow.model.kernels import reference
from shadow.model.kernels import triton_attention as ta

HQ, HKV, D, T = 8, 2, 256, 512
SCALE = D ** -0.5


def gpu_ms(fn, calls: int = 20, rounds: int = 5) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def sessions(depths: list[int], g: torch.Generator):
    """Per session: key and value buffers (capacity a multiple of 8,192 rows, as a session's) holding
    depth + T valid rows; and the batch's q and new rows, stacked."""
    bufs = []
    for depth in depths:
        capacity = -(-(depth + T) // 8192) * 8192
        bufs.append((torch.randn(HKV, capacity, D, device="cuda", generator=g).bfloat16(),
                     torch.randn(HKV, capacity, D, device="cuda", generator=g).bfloat16()))
    q = torch.randn(HQ, len(depths) * T, D, device="cuda", generator=g).bfloat16()
    new = torch.randn(2, HKV, len(depths) * T, D, device="cuda", generator=g).bfloat16().unbind(0)
    return bufs, q, new


def row(depths: list[int], old, tiles_list: list[dict], check_reference: bool) -> dict:
    g = torch.Generator(device="cuda").manual_seed(sum(depths) + len(depths))
    bufs, q, new = sessions(depths, g)
    lengths = [d + T for d in depths]
    ks, vs = [k for k, _ in bufs], [v for _, v in bufs]
    out = torch.empty(len(depths) * T, HQ, D, dtype=torch.bfloat16, device="cuda")
    result, first = {"depths": depths}, None
    for i, tiles in enumerate(tiles_list):
        name = "new" if i == 0 else f"new {tiles}"
        fn = lambda tiles=tiles: ta.attend_sessions(q, ks, vs, lengths, SCALE, new=new, out=out, tiles=tiles)
        try:
            result[name + " ms"] = round(gpu_ms(fn), 4)
        except Exception as e:  # a tile set past the GPU's shared memory or registers
            result[name + " ms"] = f"{type(e).__name__}: {str(e)[:80]}"
            continue
        batched = fn().clone()
        alone = [ta.attend_sessions(q[:, j * T : (j + 1) * T], [ks[j]], [vs[j]], [lengths[j]], SCALE, tiles=tiles)
                 for j in range(len(depths))]
        result[name + " batched == alone"] = all(torch.equal(batched[j * T : (j + 1) * T], a) for j, a in enumerate(alone))
        result[name + " same bits twice"] = torch.equal(batched, fn())
        if i == 0:
            first = batched
            if check_reference:
                ref = reference.attention(q[:, :T].float(), ks[0][:, : lengths[0]].float(), vs[0][:, : lengths[0]].float(), SCALE)
                result["new max |diff| vs float32"] = float((batched[:T].float() - ref).abs().max())
    if old is not None:
        def old_fn():
            parts = []
            for j, (k, v) in enumerate(bufs):
                k[:, lengths[j] - T : lengths[j]] = new[0][:, j * T : (j + 1) * T]
                v[:, lengths[j] - T : lengths[j]] = new[1][:, j * T : (j + 1) * T]
                parts.append(old.chunk_attention(q[:, j * T : (j + 1) * T], k[:, : lengths[j]], v[:, : lengths[j]], SCALE))
            out.copy_(torch.cat(parts))  # as the reader then copied them into its buffer
            return out
        result["old ms"] = round(gpu_ms(old_fn), 4)
        result["new == old (bits)"] = first is not None and torch.equal(old_fn().clone(), first)
        result["speed-up"] = round(result["old ms"] / result["new ms"], 3)
    flops = sum(4 * T * (d + T / 2) * D * HQ for d in depths)
    result["new TFLOP/s"] = round(flops / result["new ms"] / 1e9, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", help="an earlier build's triton_attention.py, timed beside")
    parser.add_argument("--depths", default="0,16384,65536")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--mixed", default="0,4096,16384,30000,512,65536,8192,20480", help="depths of a mixed batch of 8")
    parser.add_argument("--tiles", default="[]", help="JSON list of extra tile sets for the new kernel")
    args = parser.parse_args()
    old = None
    if args.old:
        spec = importlib.util.spec_from_file_location("old_triton_attention", args.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    tiles_list = [ta.TILES, *json.loads(args.tiles)]
    rows = []
    for depth in (int(x) for x in args.depths.split(",")):
        for b in (int(x) for x in args.batches.split(",")):
            rows.append(row([depth] * b, old, tiles_list if b in (1, 8) else tiles_list[:1], b == 1))
            print(json.dumps(rows[-1]), flush=True)
    rows.append(row([int(x) for x in args.mixed.split(",")], old, tiles_list[:1], False))
    print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
