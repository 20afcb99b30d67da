"""What the embedded engine's decode loop itself adds to a round, beside the model's step and the
shadow's `between_rounds`: the loop of a generation in slices (`Generation._slice`: the cancel
check, the step, the device's queue looked at) against a plain loop over the generator's tokens,
on tokens that come at once (no model), so only the loop is timed. Median ns a round of `--rounds`
rounds, `--repeats` times. Last stdout line: one JSON object.

    python3 experiments/round_overhead.py --rounds 200000 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from shadow.server.device import DeviceThread

END = object()


class Turn:
    cancelled = False


def tokens(n: int):
    yield from range(n)


def plain(n: int) -> float:
    out, sink = [], []
    start = time.perf_counter_ns()
    for token in tokens(n):
        if not out:
            pass
        out.append(token)
        sink.append(token)
    return (time.perf_counter_ns() - start) / n


def sliced(n: int, device: DeviceThread) -> float:
    turn, out, sink, steps = Turn(), [], [], tokens(n)
    start = time.perf_counter_ns()
    begun = time.perf_counter()
    while not turn.cancelled:
        token = next(steps, END)
        if token is END:
            break
        if token is not None:
            if not out:
                pass
            out.append(token)
            sink.append(token)
        if device.queued() and time.perf_counter() - begun >= 0.1:
            break
    return (time.perf_counter_ns() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    device = DeviceThread()
    a = statistics.median(plain(args.rounds) for _ in range(args.repeats))
    b = statistics.median(sliced(args.rounds, device) for _ in range(args.repeats))
    device.close()
    print(f"plain loop {a:.0f} ns a round, in slices {b:.0f} ns: {b - a:+.0f} ns a round")
    print(json.dumps({"plain_ns": round(a, 1), "sliced_ns": round(b, 1), "added_ns": round(b - a, 1),
                      "rounds": args.rounds, "repeats": args.repeats}))


if __name__ == "__main__":
    main()
