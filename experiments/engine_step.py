"""llama-server's decode step with N slots decoding at once, by how a request asks for its ids: how
much of a step the GPU bounds. The shadow's cost to an engine's decode shows only where the GPU
bounds the engine's step; in front of llama.cpp the proxy needs logprobs (the only place its chat
endpoint shows output ids), so the arms are the ways of asking for them:

- `none`: no logprobs (the ids cannot be had: the floor);
- `logprobs`: logprobs as clients ask (a softmax over the whole vocabulary for every token, on the host);
- `post-sampling`: `post_sampling_probs` (the sampler's own candidates: what the proxy asks);
- `backend`: `post_sampling_probs` with `backend_sampling` (the sampler run by the backend, on the GPU).

Each arm streams N greedy requests at once (distinct prompts of `--prompt` words, `--tokens` ids
each, the end token ignored); its figures are taken over the window in which all N decode: the
streamed tokens a second, llama-server's decode calls a second and ids a call (its `--metrics`), and
the GPU's busy % (`nvidia-smi`, every 250 ms, where it is). Arms are interleaved `--repeats` times
(medians), each repeat's prompts read once before its arms (so no arm's window holds a prefill).
The server runs as the density driver runs it (`--reasoning-format none`: no token held
back by a reasoning parser). Ids are compared between the logprob arms, and each stream's logprob entries against its
`usage.completion_tokens` (`short`: streams whose logprobs held fewer ids than the engine counted).

    python experiments/engine_step.py --template TEMPLATE.jinja [--llama-server PATH] [--slots 28]
        [--hidden 4096 --layers 16 --heads 32 --kv-heads 1] [--engine-arg=-ngl --engine-arg=999]

Prints one JSON document (and writes it to `--out` when given).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shadow.engines.gguf import write_gguf  # noqa: E402

ARMS = {"none": {},
        "logprobs": {"logprobs": True, "top_logprobs": 1},
        "post-sampling": {"logprobs": True, "top_logprobs": 1, "post_sampling_probs": True},
        "backend": {"logprobs": True, "top_logprobs": 1, "post_sampling_probs": True, "backend_sampling": True}}
WORDS = ("cache", "reader", "grid", "chunk", "state", "token", "session", "row", "engine", "slot")
DEFAULT_SERVER = Path.home() / ".cache/shadow/engines/llama-server-0.3.36/bin/llama-server"


class GpuBusy:
    """The GPU's busy % every 250 ms from `nvidia-smi` in a thread (nothing where it is not)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        exe = shutil.which("nvidia-smi")
        self.proc = None if exe is None else subprocess.Popen(
            [exe, "-i", "0", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "250"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if self.proc is not None:
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.samples.append((time.monotonic(), float(line.strip())))
            except ValueError:
                continue

    def mean(self, start: float, end: float) -> float | None:
        inside = [v for t, v in self.samples if start <= t <= end]
        return round(statistics.fmean(inside), 2) if inside else None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


async def counters(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    return {k: float(v) for k, v in (line.split()[:2] for line in text.splitlines()
                                     if line.startswith("llamacpp:") and len(line.split()) >= 2)}


async def stream(client: httpx.AsyncClient, k: int, a, extra: dict, salt: int) -> dict:
    """One greedy stream: its logprob ids, the engine's completion count, its own `timings` (prompt and
    decode ms, ids decoded) and when its last event came."""
    words = " ".join(WORDS[(k * 7 + i * 3 + salt) % len(WORDS)] for i in range(a.prompt))
    body = {"messages": [{"role": "user", "content": f"slot {k} run {salt}: {words}"}], "max_tokens": a.tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **extra}
    ids, counted, timings = [], None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or ():
                ids += [t["id"] for t in ((choice.get("logprobs") or {}).get("content") or ()) if "id" in t]
            if event.get("usage"):
                counted = event["usage"].get("completion_tokens")
            timings = event.get("timings") or timings
    if not timings:
        raise SystemExit("llama-server gave no `timings` on a stream (an older build?)")
    return {"ids": ids, "counted": counted, "end": time.monotonic(), "prompt_ms": timings["prompt_ms"],
            "predicted_ms": timings["predicted_ms"], "predicted_n": timings["predicted_n"]}


async def run_arm(client: httpx.AsyncClient, a, extra: dict, gpu: GpuBusy, salt: int) -> dict:
    """The N streams at once. Every slot decodes from the last prompt's end (its `prompt_ms` after
    the start) to the first stream's end: the GPU's busy % is taken there; the decode rate is the
    streams' own rates (ids over decode time, the engine's `timings`) summed."""
    before = await counters(client)
    t0 = time.monotonic()
    streams = await asyncio.gather(*(stream(client, k, a, extra, salt) for k in range(a.slots)))
    wall = time.monotonic() - t0
    after = await counters(client)
    start = t0 + max(s["prompt_ms"] for s in streams) / 1000
    end = min(s["end"] for s in streams)
    decodes = after.get("llamacpp:n_decode_total", 0.0) - before.get("llamacpp:n_decode_total", 0.0)
    predicted = after.get("llamacpp:tokens_predicted_total", 0.0) - before.get("llamacpp:tokens_predicted_total", 0.0)
    return {"tok_s": round(sum(1000 * s["predicted_n"] / s["predicted_ms"] for s in streams if s["predicted_ms"] > 0), 2),
            "ms_per_token": round(statistics.median(s["predicted_ms"] / s["predicted_n"] for s in streams
                                                    if s["predicted_n"]), 3),
            "window_s": round(end - start, 3), "wall_s": round(wall, 3), "gpu_busy_pct": gpu.mean(start, end),
            "decodes": int(decodes), "ids_per_decode": round(predicted / decodes, 2) if decodes else None,
            "short": sum(1 for s in streams if extra and s["counted"] is not None and len(s["ids"]) < s["counted"]),
            "ids": [s["ids"] for s in streams]}


async def measure(url: str, a) -> dict:
    gpu = GpuBusy()
    try:
        async with httpx.AsyncClient(base_url=url, timeout=600,
                                     limits=httpx.Limits(max_connections=a.slots + 4, max_keepalive_connections=0)) as client:
            runs: dict[str, list[dict]] = {arm: [] for arm in a.arms}
            for r in range(a.repeats):
                # the repeat's prompts read once first (the engine's prefix cache holds them after): no arm's
                # window holds another slot's prefill; the first also warms the graphs
                await run_arm(client, a, {}, gpu, salt=r)
                for arm in a.arms:  # interleaved: a drift of the machine falls on every arm
                    runs[arm].append(await run_arm(client, a, ARMS[arm], gpu, salt=r))
    finally:
        gpu.stop()
    out = {}
    first_ids = None
    for arm, rs in runs.items():
        med = {k: _median([x[k] for x in rs]) for k in ("tok_s", "ms_per_token", "gpu_busy_pct", "ids_per_decode",
                                                          "window_s")}
        out[arm] = {**med, "decodes_per_s": _median([x["decodes"] / x["wall_s"] for x in rs]),
                    "short_streams": sum(x["short"] for x in rs), "streams": a.slots * len(rs)}
        if ARMS[arm]:
            ids = rs[0]["ids"]
            out[arm]["same_ids_as_first_logprob_arm"] = None if first_ids is None else ids == first_ids
            first_ids = ids if first_ids is None else first_ids
    return out


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--template", required=True, type=Path, help="the chat template the GGUF carries")
    p.add_argument("--llama-server", type=Path, default=DEFAULT_SERVER)
    p.add_argument("--slots", type=int, default=4, help="streams at once (llama-server's --parallel)")
    p.add_argument("--prompt", type=int, default=256, help="words of each stream's prompt")
    p.add_argument("--tokens", type=int, default=64, help="ids each stream decodes")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="llama-server's -t")
    p.add_argument("--engine-arg", action="append", default=[], help="more llama-server arguments (repeatable)")
    p.add_argument("--port", type=int, default=18779)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    a.arms = [x for x in a.arms.split(",") if x]
    if any(x not in ARMS for x in a.arms) or not a.arms:
        p.error(f"--arms: a comma-separated list of {', '.join(ARMS)}")
    if min(a.slots, a.prompt, a.tokens, a.repeats) < 1 or a.tokens < 4:
        p.error("--slots, --prompt and --repeats at least 1, --tokens at least 4")
    if not a.template.is_file() or not a.llama_server.is_file():
        p.error("--template and --llama-server must be existing files")
    if min(a.hidden, a.layers, a.heads, a.kv_heads) < 1 or a.hidden % a.heads or a.heads % a.kv_heads:
        p.error("--hidden, --layers, --heads, --kv-heads at least 1; --hidden a multiple of --heads, --heads of --kv-heads")
    if a.out is not None and not a.out.parent.is_dir():
        p.error(f"--out: no folder {a.out.parent}")
    url = f"http://127.0.0.1:{a.port}"
    ctx = a.slots * (2 * a.prompt + a.tokens + 256)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        gguf = write_gguf(Path(tmp) / "engine.gguf", a.template.read_text(), hidden=a.hidden, layers=a.layers,
                          heads=a.heads, kv_heads=a.kv_heads, intermediate=4 * a.hidden)
        written = time.monotonic() - started
        log_path = Path(tmp) / "engine.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen([str(a.llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(a.port),
                                     "--jinja", "-c", str(ctx), "-np", str(a.slots), "-t", str(a.threads), "--metrics",
                                     "--reasoning-format", "none", "--no-webui", *a.engine_arg], stdout=log, stderr=subprocess.STDOUT)
            try:
                _wait(proc, url, log_path)
                arms = asyncio.run(measure(url, a))
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    doc = {"experiment": "engine-step", "slots": a.slots, "prompt_words": a.prompt, "tokens": a.tokens,
           "repeats": a.repeats, "gguf": {"hidden": a.hidden, "layers": a.layers, "heads": a.heads,
                                          "kv_heads": a.kv_heads, "written_s": round(written, 1)},
           "engine_args": a.engine_arg, "threads": a.threads, "arms": arms}
    text = json.dumps(doc)
    if a.out is not None:
        a.out.write_text(text + "\n")
    print(text)
    return doc


def _wait(proc: subprocess.Popen, url: str, log_path: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    raise SystemExit(f"llama-server did not come up (exit {proc.poll()}):\n" + log_path.read_text()[-2000:])


if __name__ == "__main__":
    main()
