"""The engine's cost pooled over several live runs of `experiments/live_density.py`: each run's
drift fit of its off/on windows (`live_figures.drift_fit`, recomputed from the windows it kept),
pooled by inverse variance, the decode lost set beside the share charged.

    python experiments/cost_pool.py docs/results/live/h100-2026-12-07-6 docs/results/live/h100-2026-12-07-7

One run's windows hold a loss to about its noise over the square root of their seconds; runs of
the same service settings (share, `--share-charge`, shadow model) beside the same engine (GGUF
shape, slots) measure the same thing, so their fits pool: the loss beyond the share charged,
`lost - charged` in points (the charge is counted, not sampled), weighted by 1 / se^2 of each run's
loss, with the pooled standard error 1 / sqrt(sum of the weights). Runs of other settings are
refused (exit 2, one line) unless `--mixed`. A folder without `live-density.json`, a file that is
not a run's document, or a run with too few windows to fit (fewer than six with a rate) is refused
the same way. `--json` prints the document instead of the table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]

import live_figures as fig  # noqa: E402

SAME = ("sessions", "hidden", "layers", "heads", "kv_heads", "model", "share", "charge")  # what must match to pool


class PoolError(ValueError):
    """A run that cannot be pooled: why, in one line."""


def charge_of(serve_args: list[str], said: str | None = None) -> str:
    """The `--share-charge` a run's service had: as its status said (`said`, the driver's
    `engine.charge`), else as it was given (`--serve-arg`), else `wall`, the default of the builds
    whose runs did not say."""
    if said:
        return said
    for i, arg in enumerate(serve_args):
        if arg.startswith("--share-charge="):
            return arg.split("=", 1)[1]
        if arg == "--share-charge" and i + 1 < len(serve_args):
            return serve_args[i + 1]
    return "wall"


def run_cost(folder: Path) -> dict:
    """One run's drift fit and the settings it ran at; PoolError where it cannot be pooled."""
    path = folder / "live-density.json"
    try:
        doc = json.loads(path.read_text())
        settings, windows, engine = doc["settings"], doc["engine"]["windows"], doc["engine"]
        said = engine.get("charge")
        key = {k: settings[k] for k in SAME if k != "charge"} | {"charge": charge_of(list(settings.get("serve_arg") or []), said)}
    except OSError as e:
        raise PoolError(f"{path}: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise PoolError(f"{path}: not a live density run's document ({type(e).__name__}: {e})") from None
    if "charge" in engine and not said:  # a build that records it, whose service's status was never read
        raise PoolError(f"{path}: the run did not learn its service's --share-charge (no status was read)")
    try:
        fit = fig.drift_fit(windows)
    except (KeyError, TypeError, ValueError) as e:
        raise PoolError(f"{path}: its windows are not as the driver writes them ({type(e).__name__}: {e})") from None
    if fit is None or fit["lost_se_pts"] is None or not fit["lost_se_pts"] > 0 or fit["share_charged_pct"] is None:
        raise PoolError(f"{path}: too few windows to fit the engine's drift (six with a rate, of both kinds, are needed)")
    return {"run": str(folder), "settings": key, "load": {k: settings.get(k) for k in ("cost_load", "cost_grow", "cost_output", "window")},
            "windows": fit["windows"], "lost_pct": fit["lost_pct"], "lost_se_pts": fit["lost_se_pts"],
            "share_charged_pct": fit["share_charged_pct"], "share_read_pct": fit["share_read_pct"],
            "beyond_share_pts": round(fit["lost_pct"] - fit["share_charged_pct"], 3)}


def pooled(runs: list[dict], mixed: bool = False) -> dict:
    """The runs' losses pooled by inverse variance: the loss, the share charged (weighted alike), the
    loss beyond it, each with the pooled standard error. PoolError where the runs' settings differ
    and `mixed` is not set."""
    if not runs:
        raise PoolError("no runs to pool")
    differ = sorted(k for k in SAME if len({json.dumps(r["settings"][k]) for r in runs}) > 1)
    if differ and not mixed:
        raise PoolError(f"the runs differ in {', '.join(differ)}: pool runs of one setting, or pass --mixed")
    weights = [1 / r["lost_se_pts"] ** 2 for r in runs]
    total = sum(weights)

    def mean(key: str) -> float:
        return round(sum(w * r[key] for w, r in zip(weights, runs)) / total, 3)

    se = round(1 / math.sqrt(total), 3)
    return {"runs": runs, "n": len(runs), "windows": sum(r["windows"] for r in runs), "differ": differ,
            "lost_pct": mean("lost_pct"), "share_charged_pct": mean("share_charged_pct"),
            "beyond_share_pts": mean("beyond_share_pts"), "se_pts": se}


def table(doc: dict) -> str:
    lines = [f"{'run':48} {'windows':>7} {'lost %':>8} {'se pts':>7} {'charged %':>9} {'beyond pts':>10}"]
    for r in doc["runs"]:
        lines.append(f"{r['run'][-48:]:48} {r['windows']:>7} {r['lost_pct']:>8.2f} {r['lost_se_pts']:>7.2f} "
                     f"{r['share_charged_pct']:>9.2f} {r['beyond_share_pts']:>10.2f}")
    lines.append(f"{'pooled (inverse variance)':48} {doc['windows']:>7} {doc['lost_pct']:>8.2f} {doc['se_pts']:>7.2f} "
                 f"{doc['share_charged_pct']:>9.2f} {doc['beyond_share_pts']:>10.2f}")
    if doc["differ"]:
        lines.append(f"mixed: the runs differ in {', '.join(doc['differ'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="folders of live density runs (each with its live-density.json)")
    p.add_argument("--mixed", action="store_true", help="pool runs of different settings (listed in the output)")
    p.add_argument("--json", action="store_true", help="print the document as JSON instead of the table")
    a = p.parse_args(argv)
    try:
        doc = pooled([run_cost(Path(r)) for r in a.runs], a.mixed)
    except PoolError as e:
        print(f"cost_pool.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(doc, indent=1) if a.json else table(doc))
    return doc


if __name__ == "__main__":
    main()
