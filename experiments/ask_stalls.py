"""Do a live run's slow asks coincide with responses ending? From `shadow serve`'s access log.

    tar -xzf docs/results/live/h100-2026-12-06/density-more.tgz -C /tmp/d ./serve.log
    python experiments/ask_stalls.py /tmp/d/serve.log

For the asks slower than `--slow-ms`: the fraction whose span (the access line's end less its
seconds) holds the end of a chat completion, of any size and of one over `--big-bytes`, beside
the same spans shifted by a seeded random offset within +-20 s (the rate by chance). Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import re
import sys

LINE = re.compile(r"(\S+ \S+),(\d+) shadow\.access INFO: POST (\S+) 200 ([\d.]+) s (\d+) bytes")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log", help="shadow serve's log (its access lines)")
    p.add_argument("--slow-ms", type=float, default=150.0)
    p.add_argument("--big-bytes", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    ends, asks = [], []
    try:
        text = open(a.log, encoding="utf-8", errors="replace").read()
    except OSError as e:
        p.error(str(e))
    for m in LINE.finditer(text):
        t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(m.group(2)) / 1000
        if m.group(3) == "/v1/chat/completions":
            ends.append((t, int(m.group(5))))
        elif m.group(3) == "/v1/shadow/ask":
            asks.append((t - float(m.group(4)), t, 1000 * float(m.group(4))))
    slow = [(x, y) for x, y, ms in asks if ms > a.slow_ms]
    if not slow:
        p.error(f"no ask slower than {a.slow_ms:g} ms in {a.log}")
    rng = random.Random(a.seed)
    shifts = [rng.uniform(-20, 20) for _ in slow]

    def share(big: int, shift: bool) -> float:
        hits = sum(any(x + d <= t <= y + d and size >= big for t, size in ends)
                   for (x, y), d in zip(slow, shifts if shift else [0.0] * len(slow)))
        return round(hits / len(slow), 3)

    out = {"asks": len(asks), "slow": len(slow), "responses": len(ends),
           "with_an_end": share(0, False), "with_an_end_shifted": share(0, True),
           "with_a_big_end": share(a.big_bytes, False), "with_a_big_end_shifted": share(a.big_bytes, True)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
