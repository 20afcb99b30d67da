"""Where a run's decode time went, arm by arm, from `round_timeline.py --raw` and the GPU clocks
`experiments/h200.sh timeline` samples beside it (`nvidia-smi ... -lms 20`, CSV; either file may
be gzipped): per run, the decode's span, the generator's steps, the bookkeeping of rounds without a
read, the rounds with a read and what they were charged, and the mean SM clock and power inside
the decode's wall-clock window. Prints the means over each arm's runs.

    python3 experiments/timeline_parts.py docs/results/cost/timeline-h200-share2-serial-raw.json.gz \
        docs/results/cost/gpu-clocks-h200-share2-serial.csv.gz
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import statistics


def text(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return f.read()


def clocks(path: str) -> list[tuple[float, float, float]]:
    """(epoch seconds, SM MHz, watts) of each sample; lines that are not samples are skipped."""
    out = []
    for line in text(path).splitlines():
        p = [x.strip() for x in line.split(",")]
        try:
            t = datetime.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=datetime.timezone.utc)
            out.append((t.timestamp(), float(p[1].split()[0]), float(p[3].split()[0])))
        except (IndexError, ValueError):
            continue
    return out


def parts(run: dict, samples: list) -> dict:
    reads = run["reads"][:-1]
    between = run["between"][:-1]
    read_rounds = sum(b for b, n in zip(between, reads) if n)
    lo, hi = run["wall"]
    inside = [s for s in samples if lo <= s[0] <= hi]
    return {"decode_ms": 1000 * (run["arrivals"][-1] - run["arrivals"][0]), "steps_ms": 1000 * sum(run["steps"]),
            "plain_bookkeeping_ms": 1000 * (sum(between) - read_rounds), "read_rounds_ms": 1000 * read_rounds,
            "charged_ms": 1000 * run["share_s"],
            "sm_mhz": statistics.mean(s[1] for s in inside) if inside else None,
            "watts": statistics.mean(s[2] for s in inside) if inside else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("raw", help="round_timeline.py --raw output")
    parser.add_argument("clocks", nargs="?", help="the nvidia-smi samples beside it")
    args = parser.parse_args()
    arms = json.loads(text(args.raw))
    samples = clocks(args.clocks) if args.clocks else []
    for arm, runs in arms.items():
        rows = [parts(r, samples) for r in runs]
        mean = {k: statistics.mean(r[k] for r in rows) if all(r[k] is not None for r in rows) else None
                for k in rows[0]}
        print(arm, " ".join(f"{k} {v:,.1f}" if v is not None else f"{k} -" for k, v in mean.items()))


if __name__ == "__main__":
    main()
