"""Restore speed of one spilled session: a 58,278-token session of the 0.8B shape (about 0.9 GiB:
KV rows up to 57,856, GDN state, six checkpoints), written through the store and read back onto
the model's device. The state is random (speed does not depend on values); the restore is checked
bit for bit. The file was just written, so it is read from the page cache: this times decoding,
the SHA-256 of every byte and the copy to the device, not the disk. With `--compare-whole-read`
the runs alternate with the reference way of reading: the whole file first, its digest after
(overlapped only with the copy to the device), against the digest of each 32 MiB block as it is
read (`shadow.core.sessionfile.READ_BLOCK`).

    python3 experiments/restore_speed.py [--device cuda] [--runs 3] [--folder /tmp/restore] [--compare-whole-read]
Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import shadow.core.sessionfile as sessionfile
from shadow.core.reader import open_reader
from shadow.core.store import SessionStore, session_bytes

TOKENS = 58_278


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--folder", default="/tmp/shadow-restore")
    ap.add_argument("--compare-whole-read", action="store_true",
                    help="alternate each run with the whole-file read (digest after the read)")
    args = ap.parse_args()
    loaded, reader = open_reader("qwen3.5-0.8b", device=args.device)
    gen = torch.Generator().manual_seed(0)
    session = reader.new_session("restore-58k")
    session.ids = torch.randint(0, 248044, (TOKENS,), generator=gen).tolist()
    committed = TOKENS // reader.grid * reader.grid
    for layer in session.state.attention:
        layer.reserve(committed)
        layer.k[:, :committed] = torch.randn(layer.k[:, :committed].shape, generator=gen).to(layer.k)
        layer.v[:, :committed] = torch.randn(layer.v[:, :committed].shape, generator=gen).to(layer.v)
    for layer in session.state.delta:
        layer.conv.copy_(torch.randn(layer.conv.shape, generator=gen))
        layer.recurrent.copy_(torch.randn(layer.recurrent.shape, generator=gen))
    session.state.length = committed
    session.checkpoints = [session.state.snapshot() for _ in range(6)]
    for i, snap in enumerate(session.checkpoints):
        snap.position = (i + 1) * 8192
    before = {k: v.clone() for k, v in session.state.tensors().items()}

    blocks = sessionfile.READ_BLOCK
    arms = ["whole", "blocks"] if args.compare_whole_read else ["blocks"]
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    written = 0
    for run in range(args.runs * len(arms)):
        arm = arms[run % len(arms)] if run // len(arms) % 2 == 0 else arms[::-1][run % len(arms)]  # ABBA
        sessionfile.READ_BLOCK = blocks if arm == "blocks" else 1 << 62
        store = SessionStore(reader, loaded.weights_hash, cap_gib=0, disk=args.folder)
        store._resident[session.name] = session
        store.settle()  # spill
        written = store.counters.bytes_written
        start = time.perf_counter()
        back = store.get(session.name)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times[arm].append(time.perf_counter() - start)
        session = back
        if not all(torch.equal(before[k], v) for k, v in session.state.tensors().items()):
            raise SystemExit(f"run {run} ({arm}): the restored state is not bit-equal")
    exact = True
    seconds = statistics.median(times["blocks"])
    print(json.dumps({
        "experiment": "restore-speed", "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "model": "qwen3.5-0.8b", "tokens": TOKENS, "committed": committed, "file_bytes": written,
        "file_gib": round(written / 2**30, 3), "resident_gib": round(session_bytes(session) / 2**30, 3),
        "restore_s": round(seconds, 3), "restore_gib_per_s": round(written / 2**30 / seconds, 2),
        "runs": [round(t, 3) for t in times["blocks"]], "bit_equal": exact,
        "read_block_bytes": blocks,
    } | ({"whole_read_s": round(statistics.median(times["whole"]), 3),
          "whole_read_runs": [round(t, 3) for t in times["whole"]]} if "whole" in times else {})))


if __name__ == "__main__":
    main()
