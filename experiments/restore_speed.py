"""Spill and restore speed of one session, against reading it again from its ids.

A 58,278-token session of the 0.8B shape by default (KV rows up to 57,856, GDN state, six
checkpoints: a 0.79 GiB file, 0.88 GiB resident), its state random (speed does not depend on
values; the weights are random too), spilled through the store and restored onto the model's
device, `--runs` times; every restore is checked bit for bit against the state that was spilled
(every tensor, the ids, every checkpoint). The page cache is out of every restore: each written
file (fsynced) is dropped from it with posix_fadvise(POSIX_FADV_DONTNEED) before it is read, and
the share of its pages still cached is measured (mincore) and reported; format-3 reads also use
O_DIRECT where the folder's file system takes it (`direct_io`), which bypasses the cache anyway.

Arms, interleaved run by run: `host` (the store's host tier: the session moved to host copies of
its tensors, pinned on a GPU from the store's pool, filled ahead before each run as a service's is
soon after it starts, and back; beside it, in the same run, `pinned_copy`: a plain copy of
the same tensors to pinned buffers allocated beforehand and back, the copy engine's speed on these
bytes, with no store around it), `format3` (this build's files: blocks verified as they are read,
O_DIRECT, pinned copies), `format3-buffered` (the same through the page cache). Then the same session's
ids read again from the start on the same device (`--reread-runs`, median; one chunk first to
warm graphs and caches), unless `--no-reread`; `--reread-tokens N` reads only the first N (the
0.8B shape on a CPU cannot read 58k tokens in minutes). `where_the_time_goes`: a format-3
restore's parts, each timed alone (`phases`). On a GPU, `steps_beside_pinning`: short GPU steps on
this thread timed alone and while a pinned pool pins 2 GiB on its own thread (does pinning stall the
device thread?); `pinned_pool`: each run's pool, its fallbacks (moves that pinned where they began).
Each arm's `spill_begun_runs`: the settle alone, before the move is waited for (what a move out
holds the device thread).

    python3 experiments/restore_speed.py --device cuda --runs 5
    python3 experiments/restore_speed.py --device cpu --runs 5 --reread-tokens 1024
    python3 experiments/restore_speed.py --device cpu --preset tiny --tokens 20000 --runs 1
Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from shadow.core import blockio, sessionfile
from shadow.core.reader import open_reader
from shadow.core.sessionfile import BLOCK_BYTES
from shadow.core.pinnedpool import PinnedPool
from shadow.core.store import SessionStore, session_bytes

ARMS = ("host", "format3", "format3-buffered")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default="qwen3.5-0.8b")
    ap.add_argument("--tokens", type=int, default=58_278)
    ap.add_argument("--checkpoints", type=int, default=6)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--reread-runs", type=int, default=3)
    ap.add_argument("--reread-tokens", type=int, default=None, help="read only this many ids again (default: all)")
    ap.add_argument("--no-reread", action="store_true")
    ap.add_argument("--folder", default="/tmp/shadow-restore")
    ap.add_argument("--pool-gib", type=float, default=None,
                    help="a pinned pool of exactly this many GiB, filled before each run and never grown in it "
                         "(default: the store's own, which pins ahead again as a move takes its memory)")
    args = ap.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    if unknown := set(arms) - set(ARMS):
        raise SystemExit(f"unknown arms {sorted(unknown)}")
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)  # as the store makes its folder
    cuda = args.device.startswith("cuda")

    loaded, reader = open_reader(args.preset, device=args.device)
    session = random_session(reader, args.tokens, args.checkpoints)
    before = snapshot(session)
    committed = session.committed

    times: dict[str, dict[str, list[float]]] = {a: {"spill": [], "restore": []} for a in arms}
    sizes: dict[str, int] = {}
    cached: list[float] = []
    pools: dict[str, list[dict]] = {}  # each run's pinned pool, after its move out and back
    for run in range(args.runs):
        for arm in arms if run % 2 == 0 else arms[::-1]:
            spill_s, restore_s, nbytes, still, session, pool = one_run(arm, session, reader, loaded.weights_hash,
                                                                       folder, cuda, args.pool_gib)
            if pool is not None:
                pools.setdefault(arm, []).append(pool)
            if not same(before, session):
                raise SystemExit(f"run {run} ({arm}): the restored state is not bit-equal")
            times[arm]["spill"].append(spill_s)
            times[arm]["restore"].append(restore_s)
            sizes[arm] = nbytes
            if still is not None:
                cached.append(still)

    plain = pinned_copy(session, args.runs, cuda)
    where = phases(session, reader, loaded.weights_hash, folder, cuda)
    reread = None if args.no_reread else reread_times(reader, session.ids, args.reread_tokens or len(session.ids),
                                                      args.reread_runs, cuda)
    headline = next((a for a in arms if a != "host"), arms[0])
    file_bytes = sizes[headline]
    restore_s = statistics.median(times[headline]["restore"])
    out = {
        "experiment": "restore-speed", "device": torch.cuda.get_device_name() if cuda else "cpu",
        "model": args.preset, "weights": "random", "state": "random", "tokens": args.tokens, "committed": committed,
        "checkpoints": args.checkpoints, "file_bytes": file_bytes, "file_gib": round(file_bytes / 2**30, 3),
        "resident_gib": round(session_bytes(session) / 2**30, 3), "block_bytes": BLOCK_BYTES,
        "workers": blockio.default_workers(), "folder": str(folder), "filesystem": filesystem(folder),
        "direct_io": blockio.direct_supported(folder),
        "page_cache": "posix_fadvise(POSIX_FADV_DONTNEED) after each write's fsync; O_DIRECT reads where direct_io",
        "page_cache_resident_max": round(max(cached), 4) if cached else None,
        "gds": dict(zip(("available", "why"), blockio.gds_status())),
        "restore_s": round(restore_s, 4), "restore_gib_per_s": round(file_bytes / 2**30 / restore_s, 2),
        "spill_s": round(statistics.median(times[headline]["spill"]), 4),
        "spill_gib_per_s": round(file_bytes / 2**30 / statistics.median(times[headline]["spill"]), 2),
        "runs": [round(t, 4) for t in times[headline]["restore"]], "bit_equal": True, "pool_gib": args.pool_gib,
        "arms": {arm: arm_summary(arm, times[arm], sizes[arm]) for arm in arms},
        "where_the_time_goes": where,
        "pinned_pool": {arm: {"fallbacks": [p["fallbacks"] for p in runs], "pinned_bytes": runs[-1]["pinned_bytes"],
                              "pin_seconds": [p["pin_seconds"] for p in runs],
                              "quiet_seconds": [p["quiet_seconds"] for p in runs]} for arm, runs in pools.items()},
        "steps_beside_pinning": steps_beside_pinning() if cuda else None,
    }
    if "host" in times:
        host_bytes = sizes["host"]
        host_out, host_in = statistics.median(times["host"]["spill"]), statistics.median(times["host"]["restore"])
        out["host_tier"] = {"bytes": host_bytes, "out_s": round(host_out, 5), "in_s": round(host_in, 5),
                            "out_gib_per_s": round(host_bytes / 2**30 / host_out, 2),
                            "in_gib_per_s": round(host_bytes / 2**30 / host_in, 2), "pinned_copy": plain}
        if plain is not None:
            out["host_tier"]["in_share_of_pinned_copy"] = round(plain["in_s"] / host_in, 3)
            out["host_tier"]["out_share_of_pinned_copy"] = round(plain["out_s"] / host_out, 3)
    if reread is not None:
        tokens_read, runs = reread
        out |= {"reread_tokens": tokens_read, "reread_s": round(statistics.median(runs), 4),
                "reread_runs": [round(t, 4) for t in runs]}
    print(json.dumps(out))


def random_session(reader, tokens: int, checkpoints: int):
    """A session of `tokens` random ids whose state is random at the last grid line below them,
    with `checkpoints` checkpoints (random GDN state) on grid lines below it."""
    gen = torch.Generator().manual_seed(0)
    session = reader.new_session("restore-speed")
    session.ids = torch.randint(0, reader.model.config.vocab_size, (tokens,), generator=gen).tolist()
    committed = tokens // reader.grid * reader.grid
    state = session.state
    for layer in state.attention:
        layer.reserve(committed)
        for t in (layer.k, layer.v):
            t[:, :committed] = torch.randn(t[:, :committed].shape, generator=gen).to(t)
    for layer in state.delta:
        layer.conv.copy_(torch.randn(layer.conv.shape, generator=gen))
        layer.recurrent.copy_(torch.randn(layer.recurrent.shape, generator=gen))
    state.length = committed
    count = min(checkpoints, reader.max_checkpoints, committed // reader.grid)
    for p in sorted({committed * (j + 1) // count // reader.grid * reader.grid for j in range(count)} - {0}):
        snap = state.snapshot()
        snap.conv.copy_(torch.randn(snap.conv.shape, generator=gen))
        snap.position = p
        session.checkpoints.append(snap)
    return session


begun: dict[str, list[float]] = {}  # by arm, each run's settle alone: the time a move out holds the device thread


def one_run(arm: str, session, reader, weights_hash: str, folder: Path, cuda: bool, pool_gib: float | None = None):
    """Spill `session` and restore it by `arm`'s way: (spill s, restore s, bytes moved, share of the
    file's pages cached before the restore (None: no file), the restored session)."""
    host = arm == "host"
    store = SessionStore(reader, weights_hash, cap_gib=0, host_cap_gib=1024) if host else \
        SessionStore(reader, weights_hash, cap_gib=0, disk=folder, direct=arm == "format3")
    store._resident[session.name] = session  # the experiment's session, as if it had been read
    del session
    c = store.counters
    if store.pinned is not None and pool_gib:
        store.pinned.close()
        store.pinned = PinnedPool(int(pool_gib * 2**30), int(pool_gib * 2**30))
    if store.pinned is not None and not store.pinned.wait_filled(60):  # as a service's is, soon after it starts
        raise SystemExit(f"{arm}: the pinned pool did not fill ({store.pinned.stats().error})")
    sync(cuda)
    start = time.perf_counter()
    store.settle()
    settled_s = time.perf_counter() - start  # what the device thread spends: the move begun
    store.flush()  # the move out (on a stream of its own) whole, and a file written behind on disk
    spill_s = time.perf_counter() - start
    begun.setdefault(arm, []).append(settled_s)
    if (c.to_host if host else c.spills) != 1:
        raise SystemExit(f"{arm}: the session did not leave the device ({store.totals()['last_error']})")
    still = None if host else drop_cache(store.path_of("restore-speed"))
    start = time.perf_counter()
    back = store.get("restore-speed")
    sync(cuda)
    restore_s = time.perf_counter() - start
    if (c.from_host if host else c.restores) != 1:
        raise SystemExit(f"{arm}: the session did not come back ({c.rejected})")
    pool = asdict(store.pinned.stats()) if store.pinned is not None else None
    return spill_s, restore_s, c.bytes_to_host if host else c.bytes_written, still, back, pool


def steps_beside_pinning(steps: int = 400, limit_s: float = 30.0) -> dict:
    """Whether pinning on the pool's thread stalls the device thread: short GPU steps (a 4096-square
    bf16 matrix product, synchronised: about a read's piece) on this thread, each timed, `steps`
    alone, then for as long as a fresh pool pins 2 GiB ahead on its thread; the steps' count,
    median, p99 and longest, ms, and the pool's pinning seconds."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def step() -> float:
        start = time.perf_counter()
        (a @ a).sum().item()
        return (time.perf_counter() - start) * 1000

    def summary(times: list[float]) -> dict:
        ordered = sorted(times)
        return {"steps": len(times), "p50": round(statistics.median(times), 3),
                "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3), "max": round(max(times), 3)}

    for _ in range(20):  # warm
        step()
    alone = [step() for _ in range(steps)]
    pool = PinnedPool(limit=2 << 30, ahead=2 << 30)
    beside, start = [], time.perf_counter()
    while pool.stats().pinned_bytes < pool.limit and time.perf_counter() - start < limit_s:
        beside.append(step())
    filled = pool.wait_filled(60)
    stats = pool.stats()
    pool.close()
    return {"alone_ms": summary(alone), "beside_ms": summary(beside) if beside else None,
            "pinned_bytes": stats.pinned_bytes, "pin_seconds": stats.pin_seconds, "filled": filled}


def pinned_copy(session, runs: int, cuda: bool) -> dict | None:
    """The copy engine's own speed on the session's bytes: every tensor the host tier moves (the
    state's valid rows, the checkpoints) copied into pinned buffers allocated beforehand, then back
    into device buffers allocated beforehand; median seconds each way over `runs`. None off a GPU."""
    if not cuda:
        return None
    tensors = [*session.state.tensors().values(), *(t for c in session.checkpoints for t in (c.conv, c.recurrent))]
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    device = [torch.empty_like(t) for t in tensors]
    nbytes = sum(t.nbytes for t in tensors)
    outs, ins = [], []
    for _ in range(runs):
        sync(cuda)
        start = time.perf_counter()
        for h, t in zip(host, tensors):
            h.copy_(t, non_blocking=True)
        sync(cuda)
        outs.append(time.perf_counter() - start)
        start = time.perf_counter()
        for d, h in zip(device, host):
            d.copy_(h, non_blocking=True)
        sync(cuda)
        ins.append(time.perf_counter() - start)
    if not all(torch.equal(d, t) for d, t in zip(device, tensors)):
        raise SystemExit("pinned copy: the bytes back are not the bytes out")
    out_s, in_s = statistics.median(outs), statistics.median(ins)
    return {"bytes": nbytes, "tensors": len(tensors), "out_s": round(out_s, 5), "in_s": round(in_s, 5),
            "out_gib_per_s": round(nbytes / 2**30 / out_s, 2), "in_gib_per_s": round(nbytes / 2**30 / in_s, 2)}


def phases(session, reader, weights_hash: str, folder: Path, cuda: bool) -> dict:
    """Where a format-3 restore's time goes, each part timed alone on the session's file (page
    cache dropped before each read): the blocks read (O_DIRECT where it works) and nothing else;
    read and hashed on the pool (the I/O part); the fresh state's allocation for the committed length;
    on a GPU the same bytes copied from pinned host memory to the device (the copy part); one core's
    SHA-256 over bytes in memory (what a single digest over the whole file, format 2, runs at)."""
    store = SessionStore(reader, weights_hash, cap_gib=0, disk=folder)
    store._resident[session.name] = session
    store.settle()
    store.flush()  # its file, written behind, on disk
    path = store.path_of(session.name)
    header = sessionfile.read_fields(path)
    total = path.stat().st_size - header.start
    out = {}
    for name, check in (("read_s", lambda i, v: None), ("read_and_digest_s", lambda i, v: blockio.sha256(v))):
        drop_cache(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            start = time.perf_counter()
            blockio.read_blocks(fd, header.start, total, header.block_bytes, check, lambda i, b, v: None, pinned=cuda)
            out[name] = round(time.perf_counter() - start, 4)
        finally:
            os.close(fd)
    sync(cuda)
    start = time.perf_counter()
    state = reader.model.new_state()
    sessionfile._targets(header, state)
    sync(cuda)
    out["allocate_state_s"] = round(time.perf_counter() - start, 4)
    del state
    if cuda:  # the copy part of a restore: the file's bytes from pinned host memory to the device, alone
        host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        device = torch.empty(total, dtype=torch.uint8, device="cuda")
        device.copy_(host, non_blocking=True)
        sync(cuda)
        start = time.perf_counter()
        device.copy_(host, non_blocking=True)
        sync(cuda)
        out["copy_to_device_s"] = round(time.perf_counter() - start, 4)
        del host, device
    block = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8).numpy()
    start = time.perf_counter()
    blockio.sha256(memoryview(block))
    out["sha256_one_core_gib_per_s"] = round(0.25 / (time.perf_counter() - start), 2)
    return out


def snapshot(session) -> dict:
    out = {k: v.clone() for k, v in session.state.tensors().items()}
    out["ids"] = torch.tensor(session.ids)
    for j, c in enumerate(session.checkpoints):
        out[f"checkpoint.{j}"] = (c.position, c.conv.clone(), c.recurrent.clone())
    return out


def same(before: dict, session) -> bool:
    now = snapshot(session)
    if now.keys() != before.keys():
        return False
    for key, want in before.items():
        got = now[key]
        if isinstance(want, tuple):
            if want[0] != got[0] or not all(torch.equal(a, b) for a, b in zip(want[1:], got[1:])):
                return False
        elif not (want.dtype == got.dtype and torch.equal(want, got)):
            return False
    return True


def reread_times(reader, ids: list[int], tokens: int, runs: int, cuda: bool) -> tuple[int, list[float]]:
    """Seconds to read the first `tokens` ids again from the start (whole grid chunks), `runs` times."""
    warm = reader.new_session("warm")
    reader.feed_prompt(warm, ids[: reader.grid])
    reader.advance(warm)
    out = []
    for _ in range(runs):
        s = reader.new_session("reread")
        sync(cuda)
        start = time.perf_counter()
        reader.feed_prompt(s, ids[:tokens])
        reader.advance(s)
        sync(cuda)
        out.append(time.perf_counter() - start)
        del s
    return tokens, out


def arm_summary(arm: str, t: dict[str, list[float]], nbytes: int) -> dict:
    restore, spill = statistics.median(t["restore"]), statistics.median(t["spill"])
    return {"file_bytes": nbytes, "restore_s": round(restore, 4), "restore_gib_per_s": round(nbytes / 2**30 / restore, 2),
            "restore_runs": [round(x, 4) for x in t["restore"]], "spill_s": round(spill, 4),
            "spill_gib_per_s": round(nbytes / 2**30 / spill, 2), "spill_runs": [round(x, 4) for x in t["spill"]],
            "spill_begun_runs": [round(x, 5) for x in begun.get(arm, [])]}


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def drop_cache(path: Path) -> float | None:
    """Drop a written, fsynced file from the page cache; the share of its pages still cached."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return cached_share(path)


def cached_share(path: Path) -> float | None:
    """The share of a file's pages in the page cache (mincore on a mapping that faults nothing in)."""
    size = path.stat().st_size
    if size == 0:
        return 0.0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            buf = (ctypes.c_char * size).from_buffer(mapped)
            try:
                if libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec) != 0:
                    return None
            finally:
                del buf
            return sum(v & 1 for v in vec) / pages
        finally:
            mapped.close()
    except (OSError, AttributeError, ValueError):
        return None


def filesystem(folder: Path) -> str | None:
    """The type of the file system `folder` is on (from /proc/mounts), where known."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return None
    real = str(folder.resolve())
    best = max((m for m in mounts if real == m[0] or real.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=None)
    return best[1] if best else None


if __name__ == "__main__":
    main()
