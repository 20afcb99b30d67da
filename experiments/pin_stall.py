"""Does pinning host memory on one thread stall the GPU work of another, and which way of pinning
stalls it least?

Short GPU steps (a 4096-square bf16 matrix product, synchronised; with `--beside copies`, a 64 MiB
copy from the device to registered host memory and back, as a move out and a restore) run on this
thread, each timed, alone and then while a second thread pins `--total-gib` in pieces, one way at a
time:
- `torch-<size>`: torch's pinned allocator (`cudaHostAlloc`), pieces of `size`;
- `register-<size>`: anonymous memory mapped with its pages populated (`MAP_POPULATE`) on the
  pinning thread outside any CUDA call, then page-locked with `cudaHostRegister` (torch's binding);
- `ctypes-<size>`: the same, `cudaHostRegister` called through ctypes (which lets go of the GIL:
  tells a stall of the GIL from one of CUDA's);
- `populate-<size>`: the mapping alone, no CUDA call (the control).
Each way reports the steps beside it (count, median, p99, longest, ms), the seconds spent in CUDA's
pinning calls and in populating, and the GiB/s of each. Then, per way, one device-to-host copy of
`--copy-mib` into such memory (and into pageable memory): GiB/s and whether the bytes match, so a
registered span is shown to copy at pinned speed.

    python3 experiments/pin_stall.py --total-gib 2
    python3 experiments/pin_stall.py --total-gib 2 --beside copies --ways torch-256,ctypes-256,populate-256
Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import statistics
import threading
import time

import torch

from shadow.core import cudart

MIB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--total-gib", type=float, default=2.0)
    ap.add_argument("--ways", default="torch-256,torch-32,register-256,register-32,ctypes-256,ctypes-32,ctypes-4,populate-256")
    ap.add_argument("--copy-mib", type=int, default=256)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--beside", choices=("matmul", "copies"), default="matmul",
                    help="the timed step: a matrix product, or a 64 MiB copy to registered host memory and back")
    args = ap.parse_args()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    if args.beside == "copies":  # host memory registered before anything is timed, as a pool's slab
        held = populated(64 * MIB)
        register(held, "ctypes")
        host = torch.frombuffer(held, dtype=torch.uint8)
        dev = torch.randint(0, 255, (64 * MIB,), dtype=torch.uint8, device="cuda")

    def step() -> float:
        start = time.perf_counter()
        if args.beside == "copies":
            host.copy_(dev, non_blocking=True)
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
        else:
            (a @ a).sum().item()
        return (time.perf_counter() - start) * 1000

    for _ in range(20):
        step()
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "beside": args.beside,
           "alone_ms": summary([step() for _ in range(args.steps)]), "ways": {}}
    total = int(args.total_gib * 2**30)
    for way in args.ways.split(","):
        kind, size = way.split("-")
        piece = int(size) * MIB
        pinner = Pinner(kind, piece, total // piece)
        beside = []
        pinner.start()
        while pinner.is_alive():
            beside.append(step())
        pinner.join()
        copy = copy_speed(kind, args.copy_mib * MIB)
        pinner.release()
        out["ways"][way] = {"beside_ms": summary(beside) if beside else None, "pieces": pinner.count,
                            "cuda_s": round(pinner.cuda_s, 4), "populate_s": round(pinner.populate_s, 4),
                            "cuda_gib_per_s": round(total / 2**30 / pinner.cuda_s, 2) if pinner.cuda_s else None,
                            "longest_call_ms": round(pinner.longest * 1000, 2), "error": pinner.error, "copy": copy}
        print(way, json.dumps(out["ways"][way]), flush=True)
    print(json.dumps(out))


class Pinner(threading.Thread):
    """Pins `count` pieces of `piece` bytes one way; keeps them until `release`."""

    def __init__(self, kind: str, piece: int, count: int):
        super().__init__(daemon=True)
        self.kind, self.piece, self.count = kind, piece, count
        self.held: list = []
        self.cuda_s = self.populate_s = self.longest = 0.0
        self.error: str | None = None

    def run(self) -> None:
        try:
            for _ in range(self.count):
                if self.kind == "torch":
                    start = time.perf_counter()
                    self.held.append(torch.empty(self.piece, dtype=torch.uint8, pin_memory=True))
                    self._cuda(start)
                    continue
                start = time.perf_counter()
                m = populated(self.piece)
                self.populate_s += time.perf_counter() - start
                self.held.append(m)
                if self.kind in ("register", "ctypes"):
                    start = time.perf_counter()
                    register(m, self.kind)
                    self._cuda(start)
        except Exception as e:  # noqa: BLE001 - reported
            self.error = f"{type(e).__name__}: {e}"

    def _cuda(self, start: float) -> None:
        took = time.perf_counter() - start
        self.cuda_s += took
        self.longest = max(self.longest, took)

    def release(self) -> None:
        for m in self.held:
            if isinstance(m, mmap.mmap):
                if self.kind in ("register", "ctypes"):
                    torch.cuda.cudart().cudaHostUnregister(address(m))
                m.close()
        self.held.clear()


def populated(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)


def address(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def register(m: mmap.mmap, how: str = "register") -> None:
    if how == "ctypes":  # the library's own call (through ctypes, without the GIL)
        cudart.host_register(address(m), len(m))
        return
    err = torch.cuda.cudart().cudaHostRegister(address(m), len(m), cudart.HOST_REGISTER_PORTABLE)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")


def copy_speed(kind: str, nbytes: int) -> dict:
    """One device-to-host copy of `nbytes` into memory pinned `kind`'s way (pageable for
    `populate`): GiB/s (median of 5) and whether the bytes match."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    if kind == "torch":
        holder, dst = None, torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    else:
        holder = populated(nbytes)
        if kind in ("register", "ctypes"):
            register(holder, kind)
        dst = torch.frombuffer(holder, dtype=torch.uint8)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    equal = bool(torch.equal(dst, src.cpu()))
    pinned = bool(dst.is_pinned())
    del dst
    if holder is not None:
        if kind in ("register", "ctypes"):
            torch.cuda.cudart().cudaHostUnregister(address(holder))
        holder.close()
    return {"gib_per_s": round(nbytes / 2**30 / statistics.median(times), 2), "equal": equal, "is_pinned": pinned}


def summary(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"steps": len(times), "p50": round(statistics.median(times), 3),
            "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3), "max": round(max(times), 3)}


if __name__ == "__main__":
    main()
