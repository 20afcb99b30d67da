"""One markdown table row per `shadow ab --json` file, as docs/BENCHMARKS.md sets them out: decode
off / on, the change of the medians, the paired median and the pairs, the share charged (and the
voice's), inter-token p99 and longest gap per arm, the streamed gaps over 10 ms per arm and the
server's own long gaps in the on runs (device thread / stream writes).

    python3 experiments/ab_rows.py docs/results/cost/ab-h200-share2.json [...]
"""

from __future__ import annotations

import json
import statistics
import sys


def row(doc: dict) -> str:
    d, itl = doc["decode_tok_s"], doc["itl"]
    paired = doc["paired_deltas_pct"]
    charged = f"{doc['share_pct']:.2f} %" if doc.get("share_pct") is not None else "n/a"
    if doc.get("voice") and doc.get("share_pct") is not None and doc.get("voice_pct") is not None:
        charged = f"{doc['share_pct']:.2f} + {doc['voice_pct']:.2f} = {doc['share_pct'] + doc['voice_pct']:.2f} %"
    gaps = doc.get("server_gaps", {}).get("on", {})
    over = {a: itl[a].get("gaps_over_10ms", "n/a") for a in ("off", "on")}
    return " | ".join([
        "", f"{d['off']:.2f} / {d['on']:.2f} tok/s", f"{doc['delta_pct']:+.2f} %",
        f"**{statistics.median(paired):+.2f} %**", ", ".join(f"{x:+.1f}" for x in paired), charged,
        f"{itl['off']['p99_ms']:.2f} / {itl['on']['p99_ms']:.2f} ms", f"{itl['off']['max_ms']:.1f} / {itl['on']['max_ms']:.1f} ms",
        f"{over['off']} / {over['on']}", f"{gaps.get('round', 'n/a')} / {gaps.get('write', 'n/a')}", ""]).strip()


if __name__ == "__main__":
    print("| file | decode off / on | change (medians) | paired median | pairs | charged | ITL p99 off / on "
          "| longest gap off / on | gaps > 10 ms off / on | server gaps on: round / write |")
    print("|---" * 10 + "|")
    for path in sys.argv[1:]:
        with open(path) as f:
            print(f"| `{path.rsplit('/', 1)[-1]}` {row(json.load(f))}")
