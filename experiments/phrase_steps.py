"""The longest step of a phrase, as the embedded stream sees it: first the first phrase at depth
after a load's warm-up (with or without `Reader.warm_kernels`: run each in a process with an empty
Triton cache to see a first call compile), then a session at `--depth` with an unread tail, a 30-id question and 12 greedy tokens from a fork (`Reader.decode_steps`), each step
device synchronised. Beside it, the way a fork read its tail and question before: one forward of
all of them at an ungraphed row count, timed at a length it has not run at before (as each phrase's
length is new in a live session) and again at that length. Last stdout line: one JSON object.

    python3 experiments/phrase_steps.py --model qwen3.5-0.8b --device cuda --depth 16384
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from shadow.core.reader import open_reader
from shadow.offline.bench.readrate import sessions_at

QUESTION = list(range(2000, 2030))  # a question's length; its values do not change a step's cost


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def stepped(reader, session, device: str) -> list[float]:
    """Each step's seconds of one phrase (prefill pieces, then tokens)."""
    steps, times = reader.decode_steps(session, QUESTION, 12), []
    while True:
        sync(device)
        start = time.perf_counter()
        try:
            next(steps)
        except StopIteration:
            sync(device)
            times.append(time.perf_counter() - start)
            return times
        sync(device)
        times.append(time.perf_counter() - start)


def one_forward(reader, session, n_extra: int, device: str) -> float:
    """The tail and question (and `n_extra` more ids) in one unpadded forward, in a fork."""
    ids = session.ids[session.committed :] + QUESTION + [7] * n_extra
    with reader.fork(session.state) as state:
        sync(device)
        start = time.perf_counter()
        reader.forward(reader._ids(ids), state)
        sync(device)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--depth", type=int, default=16384)
    parser.add_argument("--tails", default="0,100,300,500,1000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warm-kernels", action=argparse.BooleanOptionalAction, default=True,
                        help="compile the kernels for every depth first (Reader.warm_kernels), as a load does")
    args = parser.parse_args()
    _, reader = open_reader(args.model, grid=512, device=args.device)
    cover = max(0, reader.fork_cover() - len(QUESTION))
    scratch = reader.new_session("warm")  # as the voice warms at load: every graphed fork size, at depth 0
    scratch.ids = [5] * cover
    stepped(reader, scratch, args.device)
    start = time.perf_counter()
    launches = reader.warm_kernels() if args.warm_kernels else 0
    warm_s = time.perf_counter() - start
    session = sessions_at(reader, args.depth, 1)[0]
    for layer in session.state.attention:
        layer.reserve(args.depth + 2 * reader.grid + 64)
    base = session.ids[: args.depth]
    session.ids = base + [5] * 301  # the first phrase at depth, at lengths no forward has met
    first = stepped(reader, session, args.device)
    print(f"first phrase at depth {args.depth} (kernels warmed: {args.warm_kernels}, {launches} launches in "
          f"{warm_s:.2f} s): longest step {1000 * max(first):.2f} ms, phrase {1000 * sum(first):.2f} ms", flush=True)
    session.ids = base + [5] * cover
    stepped(reader, session, args.device)  # every fork size at this depth once
    rows, fresh = [], 0
    for tail in (int(x) for x in args.tails.split(",")):
        session.ids = base + [5] * tail
        stepped(reader, session, args.device)
        runs = [stepped(reader, session, args.device) for _ in range(args.repeats)]
        longest = statistics.median(max(r) for r in runs)
        pieces = len(reader.fork_pieces(tail + len(QUESTION)))
        prefill = statistics.median(sum(r[:pieces]) for r in runs)
        total = statistics.median(sum(r) for r in runs)
        new_len, again = [], []
        for _ in range(args.repeats):
            fresh += 1  # a row count no forward has run at
            new_len.append(one_forward(reader, session, fresh, args.device))
            again.append(one_forward(reader, session, fresh, args.device))
        row = {"tail": tail, "pieces": pieces, "longest_step_ms": round(1000 * longest, 2),
               "prefill_ms": round(1000 * prefill, 2), "phrase_ms": round(1000 * total, 2),
               "one_forward_new_length_ms": round(1000 * statistics.median(new_len), 2),
               "one_forward_again_ms": round(1000 * statistics.median(again), 2)}
        rows.append(row)
        print(f"tail {tail}: {pieces} pieces, longest step {row['longest_step_ms']} ms, prefill {row['prefill_ms']} ms, "
              f"phrase {row['phrase_ms']} ms | one forward: new length {row['one_forward_new_length_ms']} ms, "
              f"again {row['one_forward_again_ms']} ms", flush=True)
    print(json.dumps({"model": args.model, "device": args.device, "depth": args.depth,
                      "kernels": reader.model.kernels.name, "warm_kernels": args.warm_kernels,
                      "warm_launches": launches, "warm_s": round(warm_s, 3),
                      "first_phrase": {"longest_step_ms": round(1000 * max(first), 2),
                                       "phrase_ms": round(1000 * sum(first), 2)}, "rows": rows}))


if __name__ == "__main__":
    main()
