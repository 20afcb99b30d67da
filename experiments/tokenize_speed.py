"""How long the proxy takes to know a prompt's ids where the engine does not show them: the big
model's Jinja chat template rendered and the text tokenised (`ChatRenderer.prompt_ids`, what the
generic and `transformers serve` dialects run in a thread beside each request), on the prompts of
real agent trajectories. Median ms per 1,000 prompt tokens over `--repeats` runs of each prompt
(the last `--prompts` prompts of each trajectory). Last stdout line: one JSON object.

    python3 experiments/tokenize_speed.py --template ../shared/data/templates/qwen3.5.jinja \
        --trajectories ../shared/data/trajectories/mini-swe-agent --prompts 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from shadow.text.chat_template import ChatRenderer, default_hf_tokenizer, read_template


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--template", type=Path, required=True)
    ap.add_argument("--trajectories", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    renderer = ChatRenderer(read_template(args.template), default_hf_tokenizer())
    per_1k, rows = [], []
    for path in sorted(args.trajectories.glob("*.traj.json")):
        messages = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else str(m["content"])}
                    for m in json.loads(path.read_text())["messages"]]
        ends = [i for i, m in enumerate(messages) if m["role"] == "assistant"][-args.prompts:]
        for end in ends:
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                ids = renderer.prompt_ids(messages[:end])
                times.append(time.perf_counter() - start)
            ms = statistics.median(times) * 1000
            per_1k.append(ms / len(ids) * 1000)
            rows.append({"trajectory": path.name.split(".")[0], "tokens": len(ids), "ms": round(ms, 2)})
            print(f"{rows[-1]['trajectory']:40s} {len(ids):7,d} tokens {ms:8.1f} ms")
    print(json.dumps({"experiment": "tokenize-speed", "template": str(args.template), "prompts": len(rows),
                      "ms_per_1k_tokens_median": round(statistics.median(per_1k), 3),
                      "ms_per_1k_tokens_p90": round(sorted(per_1k)[int(0.9 * (len(per_1k) - 1))], 3),
                      "rows": rows}))


if __name__ == "__main__":
    main()
