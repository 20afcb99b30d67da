"""How fast the embedded generator decodes alone, and through `shadow serve`: which one is slow.

The H200 ab run (docs/BENCHMARKS.md) saw a 4B-shape generator decode at 18 tok/s through serve,
about a tenth of what its weights' bytes allow. This times, for one preset, a prompt of
--prompt ids and --tokens greedy tokens: (1) `Generator.on(model).generate` in this process
(graphed on a GPU), (2) the plain eager forward, (3) a streamed request to a `shadow serve` of
the same preset started here (shadow switched off, then on). Decode rates exclude the first token.

    python3 experiments/generator_speed.py --model qwen3.5-4b --device cuda     # on the H200
    python3 experiments/generator_speed.py --model tiny --prompt 2000 --tokens 40   # on a CPU
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import time
import uuid

import httpx

from shadow.offline.bench.ab import prompt_text, stream_once, switch
from shadow.offline.bench.readrate import random_ids
from shadow.model import load_model
from shadow.model.checkpoint import read_config, resolve_checkpoint
from shadow.model.runtime import choose_kernels as pick
from shadow.server.generator import Generator
from shadow.text.tokenizer import load_tokenizer


def in_process(generator: Generator, prompt: list[int], tokens: int) -> tuple[float, float, list[float]]:
    """(seconds to the first token, decode tok/s after it, ms of each decode step), EOS ignored."""
    start = time.perf_counter()
    stamps = []
    for _ in generator.generate(prompt, tokens):
        stamps.append(time.perf_counter())
    steps = [(b - a) * 1000 for a, b in itertools.pairwise(stamps)]
    return stamps[0] - start, (len(stamps) - 1) / (stamps[-1] - stamps[0]), steps


def step_segments(steps: list[float], bounds=(0, 16, 32, 48, 64, 128)) -> str:
    """Median step ms over decode steps [a, b) for consecutive bounds, then the rest."""
    edges = [b for b in bounds if b < len(steps)] + [len(steps)]
    parts = [f"{a + 1}-{b}: {statistics.median(steps[a:b]):.1f}" for a, b in itertools.pairwise(edges) if b > a]
    return "step ms by decode step: " + ", ".join(parts)


def profile_decode(generator: Generator, prompt: list[int], name: str, steps: int = 16) -> None:
    """The torch profiler over `steps` decode steps after the prompt: where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    tokens = generator.generate(prompt, steps + 2)
    next(tokens)  # the prompt is read and the first token out: what follows is decode
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in tokens:
            pass
    print(f"-- {name}: {steps} decode steps, {(time.perf_counter() - started) * 1000 / (steps + 1):.1f} ms a step under the profiler")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18, max_name_column_width=50), flush=True)
    import cProfile
    import pstats

    tokens = generator.generate(prompt, steps + 2)
    next(tokens)
    python = cProfile.Profile()
    started = time.perf_counter()
    python.enable()
    for _ in tokens:
        pass
    python.disable()
    print(f"-- {name}: {(time.perf_counter() - started) * 1000 / (steps + 1):.1f} ms a step under cProfile")
    pstats.Stats(python).sort_stats("tottime").print_stats(14)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt", type=int, default=16350)
    parser.add_argument("--tokens", type=int, default=346)
    parser.add_argument("--port", type=int, default=8795)
    parser.add_argument("--profile", action="store_true", help="profile 16 decode steps each way in process, skip serve")
    args = parser.parse_args()

    kernels = pick("auto", args.device, read_config(resolve_checkpoint(args.model)).linear_key_head_dim)
    model = load_model(args.model, device=args.device, kernels=kernels).model
    prompt = random_ids(args.prompt, seed=3)
    ways = [("graphed", Generator.on(model)), ("eager", Generator(model))] if model.device.type == "cuda" \
        else [("eager", Generator(model))]
    for name, generator in ways:
        in_process(generator, prompt[:600], 4)  # warm-up: graphs captured, kernels tuned
        ttft, rate, steps = in_process(generator, prompt, args.tokens)
        print(f"in process, {name:<8}: TTFT {ttft:.3f} s, decode {rate:.1f} tok/s; {step_segments(steps)}", flush=True)
        if args.profile:
            profile_decode(generator, prompt, name)
    if args.profile:
        return
    del model, generator

    log = open(os.environ.get("SERVE_LOG", "/tmp/generator-speed-serve.log"), "w")
    server = subprocess.Popen([sys.executable, "-c", "from shadow.cli.main import main; main()", "serve", "--model", args.model,
                               "--device", args.device, "--port", str(args.port)], stdout=log, stderr=log)
    base = f"http://127.0.0.1:{args.port}/v1"
    try:
        deadline = time.time() + 600
        while True:
            try:
                httpx.get(base + "/models", timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                if server.poll() is not None or time.time() > deadline:
                    raise SystemExit("shadow serve did not come up; see its log")
                time.sleep(0.5)
        tokenizer = load_tokenizer(None)
        with httpx.Client(timeout=600) as client:
            stream_once(client, base, prompt_text(tokenizer, 600, "warm"), 4, "warm", "off", pair=0)
            for arm in ("off", "on"):
                switch(client, base, arm == "on")
                tag = uuid.uuid4().hex[:12]
                run = stream_once(client, base, prompt_text(tokenizer, args.prompt, tag), args.tokens, f"g-{tag}", arm, pair=0)
                print(f"through serve, shadow {arm:<3}: TTFT {run.ttft_s:.3f} s, decode {run.decode_tok_s:.1f} tok/s "
                      f"({run.tokens} tokens)", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
