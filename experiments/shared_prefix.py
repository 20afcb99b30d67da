"""How many ids every session's first prompt shares with the others': mini-swe-agent trajectories
rendered and tokenised as `shadow replay-ledger` renders them for its ledger (the in-code Qwen3.5
template, the real Qwen3.5 vocabulary). The figure `replay-ledger --shared-prefix-tokens` takes.

    python3 experiments/shared_prefix.py ../shared/data/trajectories/mini-swe-agent
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shadow.core.reader import common_prefix
from shadow.text.chat import render_prompt
from shadow.text.conversations import load_conversation
from shadow.text.tokenizer import load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a folder of *.traj.json trajectories")
    parser.add_argument("--grid", type=int, default=512, help="the grid, for the shared prefix's last line")
    args = parser.parse_args()
    tok = load_tokenizer(None)
    firsts = []
    for path in sorted(args.folder.glob("*.traj.json")):
        history, _ = next(iter(load_conversation(path).requests()))
        firsts.append(tok.encode(render_prompt(history)))
    if len(firsts) < 2:
        raise SystemExit(f"{args.folder}: fewer than two trajectories")
    shared = min(common_prefix(firsts[0], f) for f in firsts[1:])
    print(f"{len(firsts)} first prompts of {min(map(len, firsts))} to {max(map(len, firsts))} ids; every one shares "
          f"its first {shared} ids with the others (the last grid line of {args.grid} at or below: "
          f"{shared // args.grid * args.grid})")


if __name__ == "__main__":
    main()
