"""Tokens read per GPU-second by batch size: B sessions at the same context depth, their next chunks
read one session at a time (the graphed reader) or all in one batched forward (`advance_batch`),
device synchronised, median of `--repeats`; with `--runs`, also one session's next B chunks in one
batched forward (a run: its GDN layers read them as one sequence) against reading them one at a time. The sessions' rows are zeros at the depth (a chunk's
cost depends on its depth and shape, not on the values). `--profile B` then profiles one batched read
of B sessions without graphs (the torch profiler's GPU kernels, top 20 by time). Last stdout line: one
JSON object.

    python3 experiments/batch_rate.py --model qwen3.5-0.8b --device cuda --depth 16384 --batches 1,2,4,8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from shadow.core.reader import open_reader, reader_for
from shadow.offline.bench.readrate import sessions_at


def timed(fn, sessions, depth: int, repeats: int, device: str) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        for s in sessions:
            s.state.length = depth
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(sessions)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--depth", type=int, default=16384)
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", type=int, default=0, help="profile one ungraphed batched read of this many sessions")
    parser.add_argument("--runs", action="store_true", help="also time one session's next B chunks as one run")
    args = parser.parse_args()
    if args.profile < 0:
        parser.error("--profile is a number of sessions (0: no profile)")
    loaded, reader = open_reader(args.model, grid=512, device=args.device)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        ss = sessions_at(reader, args.depth, b)
        one = timed(lambda group: [reader.advance(s, max_chunks=1) for s in group], ss, args.depth, args.repeats,
                    args.device)
        many = timed(reader.advance_batch, ss, args.depth, args.repeats, args.device)
        row = {"batch": b, "alone_ms": round(1000 * one, 3), "batched_ms": round(1000 * many, 3),
               "alone_tok_s": round(b * reader.grid / one), "batched_tok_s": round(b * reader.grid / many),
               "speedup": round(one / many, 3)}
        print(f"B={b}: alone {1000 * one:.2f} ms ({b * reader.grid / one:,.0f} tok/s), batched {1000 * many:.2f} ms "
              f"({b * reader.grid / many:,.0f} tok/s), x{one / many:.2f}", flush=True)
        del ss
        if args.runs and b > 1:  # one session's b chunks: one at a time, then as one run of a batch
            run = sessions_at(reader, args.depth, 1, chunks=b)
            chunked = timed(lambda group: reader.advance(group[0], max_chunks=b), run, args.depth, args.repeats, args.device)
            as_run = timed(lambda group: reader.advance_batch(group * b), run, args.depth, args.repeats, args.device)
            row.update(run_chunked_ms=round(1000 * chunked, 3), run_batched_ms=round(1000 * as_run, 3))
            print(f"   one session's {b} chunks: one at a time {1000 * chunked:.2f} ms, as one run {1000 * as_run:.2f} ms "
                  f"({b * reader.grid / as_run:,.0f} tok/s), x{chunked / as_run:.2f}", flush=True)
            del run
        rows.append(row)
    profiled = profile_batch(loaded, args.depth, args.profile, args.device) if args.profile else None
    print(json.dumps({"model": args.model, "device": args.device, "depth": args.depth,
                      "kernels": loaded.model.kernels.name, "rows": rows,
                      "profile": profiled}))


def profile_batch(loaded, depth: int, b: int, device: str) -> dict:
    """One batched read of `b` sessions at `depth` under the torch profiler, graphs off (so that every
    kernel shows): prints the top kernels; returns the kernels' busy ms in that read and the
    ungraphed read's wall ms (median of 3)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    reader = reader_for(loaded, 512, graphs=False)
    ss = sessions_at(reader, depth, b)
    eager = timed(reader.advance_batch, ss, depth, 3, device)
    for s in ss:
        s.state.length = depth
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])) as prof:
        reader.advance_batch(ss)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    events = prof.key_averages()
    # the kernels' own rows (an op's row repeats its kernels' time): what the table's "Self CUDA time total" sums
    busy = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1000
    print(f"B={b} ungraphed: wall {1000 * eager:.2f} ms, GPU busy {busy:.2f} ms")
    print(events.table(sort_by="self_device_time_total" if device.startswith("cuda") else "self_cpu_time_total", row_limit=20, max_name_column_width=70))
    return {"batch": b, "ungraphed_ms": round(1000 * eager, 3), "gpu_busy_ms": round(busy, 3)}


if __name__ == "__main__":
    main()
