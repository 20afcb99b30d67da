"""What llama-server's logprobs cost it a generated token: the same greedy request with no logprobs,
with logprobs taken before sampling (a softmax over the whole vocabulary a token: llama.cpp's default,
what a client asking `logprobs` gets) and after it (`post_sampling_probs`: the sampler's own
candidates, what the proxy asks for), on one slot of a llama-server serving a random-weight GGUF
with the Qwen3.5 vocabulary (248,077 ids). The figure is the server's own `timings.predicted_per_token_ms`
(median over `--repeats`); the ids beside the logprobs of the two logprob arms are compared.

    python experiments/logprob_cost.py --template TEMPLATE.jinja [--llama-server PATH] [--repeats 7]

Prints one JSON line. On a CPU build the whole step is on the CPU; on a GPU build the logprobs'
pass stays on the host, beside every slot's step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shadow.engines.gguf import write_gguf  # noqa: E402

ARMS = {"none": {}, "logprobs": {"logprobs": True, "top_logprobs": 1},
        "post-sampling": {"logprobs": True, "top_logprobs": 1, "post_sampling_probs": True}}
DEFAULT_SERVER = Path.home() / ".cache/shadow/engines/llama-server-0.3.36/bin/llama-server"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--template", required=True, type=Path, help="the chat template the GGUF carries")
    p.add_argument("--llama-server", type=Path, default=DEFAULT_SERVER)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="llama-server's -t")
    p.add_argument("--port", type=int, default=18777)
    a = p.parse_args(argv)
    if a.repeats < 1 or a.max_tokens < 1 or not a.template.is_file() or not a.llama_server.is_file():
        p.error("--repeats and --max-tokens at least 1; --template and --llama-server existing files")
    url = f"http://127.0.0.1:{a.port}"
    with tempfile.TemporaryDirectory() as tmp:
        gguf = write_gguf(Path(tmp) / "engine.gguf", a.template.read_text())
        log = open(Path(tmp) / "engine.log", "w")
        proc = subprocess.Popen([str(a.llama_server), "-m", str(gguf), "--port", str(a.port), "-c", "4096",
                                 "--parallel", "1", "-t", str(a.threads)], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"llama-server did not come up (exit {proc.poll()})")
                time.sleep(0.5)
            per_token = {k: [] for k in ARMS}
            ids: dict[str, list[int]] = {}
            for _ in range(a.repeats):
                for arm, extra in ARMS.items():  # interleaved: a drift of the machine falls on every arm
                    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": a.max_tokens,
                            "ignore_eos": True, "temperature": 0, "cache_prompt": False, **extra}
                    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()
                    per_token[arm].append(r["timings"]["predicted_per_token_ms"])
                    content = (r["choices"][0].get("logprobs") or {}).get("content")
                    if content:
                        ids[arm] = [t["id"] for t in content]
        finally:
            proc.terminate()
            proc.wait()
    doc = {"ms_per_token": {k: round(statistics.median(v), 3) for k, v in per_token.items()},
           "runs": a.repeats, "max_tokens": a.max_tokens, "threads": a.threads,
           "same_ids": ids.get("logprobs") == ids.get("post-sampling") and bool(ids.get("logprobs"))}
    print(json.dumps(doc))
    return doc


if __name__ == "__main__":
    main()
