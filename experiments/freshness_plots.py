"""The figures of docs/FRESHNESS.md, drawn from the `--json` lines of `bash experiments/replay_tables.sh`
(out/freshness-*.txt): freshness and ask wait against the share and against the fleet size, the share
each target needs against the load, and the load over time.

    python3 experiments/freshness_plots.py --runs out --img docs/img
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


FLOOR = 0.1  # ms: where a p99 ask wait of 0 is drawn on the log scale


def save(fig, path: Path) -> None:
    """The figure written to `path` and closed, and a line that says where."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def doc(runs: Path, name: str) -> dict | None:
    path = runs / f"freshness-{name}.txt"
    if not path.is_file():
        return None
    return json.loads(path.read_text().strip().splitlines()[-1])


def share_arms(d: dict) -> list[tuple[float, dict]]:
    return sorted((a["share"], a["summary"]) for a in d["arms"])


def against_share(runs: Path, img: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for k in (24, 29):
        for cap in (4, 16):
            d = doc(runs, f"share-{k}-cap{cap}")
            if d is None:
                continue
            arms = share_arms(d)
            x = [100 * s for s, _ in arms]
            label = f"{k} active, cap {cap} GiB"
            left.plot(x, [s["turn_starts"]["fresh_pct"] for _, s in arms], marker="o", label=label)
            right.plot(x, [max(s["random"]["ask_wait_ms"]["p99"] or 0, FLOOR) for _, s in arms], marker="o", label=label)
    left.set_xlabel("share, % (0: idle only)")
    left.set_ylabel("turn starts fresh, %")
    left.set_title("freshness against the share")
    right.set_xlabel("share, % (0: idle only)")
    right.set_ylabel(f"p99 ask wait at a random time, ms (0 drawn at {FLOOR:g})")
    right.set_yscale("log")
    right.axhline(50, color="grey", lw=0.8, ls="--")
    right.set_title("ask wait against the share")
    left.legend(fontsize=8)
    fig.suptitle("the trajectories packed, one engine, the live service's limits (no disk)", fontsize=9)
    save(fig, img / "freshness-share.png")


def against_fleet(runs: Path, img: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for k in (24, 29):
        for route, suffix in (("affinity", ""), ("rendezvous", "-rendezvous")):
            rows = [(n, doc(runs, f"fleet-{k}-{n}{suffix}")) for n in range(1, 6)]
            rows = [(n, d) for n, d in rows if d is not None]
            if not rows:
                continue
            arm = [(n, next(a["summary"] for a in d["arms"] if a["share"] > 0)) for n, d in rows]
            label = f"{k} active, {route}"
            left.plot([n for n, _ in arm], [s["turn_starts"]["fresh_pct"] for _, s in arm], marker="o", label=label)
            right.plot([n for n, _ in arm], [max(s["random"]["ask_wait_ms"]["p99"] or 0, FLOOR) for _, s in arm], marker="o",
                       label=label)
    left.set_xlabel("engines (each with its shadow)")
    left.set_ylabel("turn starts fresh, %")
    left.set_title("freshness against the fleet (2 % share)")
    right.set_xlabel("engines")
    right.set_ylabel(f"p99 ask wait at a random time, ms (0 drawn at {FLOOR:g})")
    right.set_yscale("log")
    right.axhline(50, color="grey", lw=0.8, ls="--")
    right.set_title("ask wait against the fleet")
    for ax in (left, right):
        ax.set_xticks(range(1, 6))
    left.legend(fontsize=8)
    save(fig, img / "freshness-fleet.png")


def curve(runs: Path, img: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for target, marker in (("fresh", "o"), ("wait", "s")):
        pts = []
        for k in (4, 8, 16, 24, 29, 32, 48):
            d = doc(runs, f"curve-{k}-{target}")
            if d is None or not d["solve"] or d["solve"][0]["share"] is None:
                continue
            pts.append((d["load"]["new_tok_s"]["p90"], 100 * d["solve"][0]["share"], k, d["solve"][0]["target"]))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=pts[0][3])
            for x, y, k, _ in pts:
                ax.annotate(str(k), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("new tokens per second per engine, p90 of 60 s windows")
    ax.set_ylabel("share needed, %")
    ax.set_title("the share a target needs against the load (no cap; labels: sessions packed)")
    ax.legend(fontsize=8)
    save(fig, img / "freshness-curve.png")


def load_over_time(runs: Path, img: Path) -> None:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    for k in (24, 29):
        d = doc(runs, f"live-{k}")
        if d is None:
            continue
        w = [x for x in d["windows"] if x["engine"] == 0]
        top.step([x["start"] for x in w], [x["active"] for x in w], where="post", label=f"packed to {k}")
        bottom.step([x["start"] for x in w], [x["new_tok_s"] for x in w], where="post", label=f"packed to {k}")
    top.set_ylabel("sessions active")
    bottom.set_ylabel("new tokens/s")
    bottom.set_xlabel("time, s (60 s windows)")
    top.set_title("the load over time, one engine")
    top.legend(fontsize=8)
    save(fig, img / "freshness-load.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=Path("out"))
    ap.add_argument("--img", type=Path, default=Path("docs/img"))
    args = ap.parse_args()
    args.img.mkdir(parents=True, exist_ok=True)
    for draw in (against_share, against_fleet, curve, load_over_time):
        draw(args.runs, args.img)
        print(f"drew {draw.__name__}")


if __name__ == "__main__":
    main()
