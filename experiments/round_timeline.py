"""Where the shadow's cost to the embedded engine's decode goes, round by round, in one process.

The embedded generator decodes `--output` tokens after a `--prompt`-id prompt, exactly as serve's
embedded completions do (`ShadowService.between_rounds` between every two rounds), with the shadow
off and on alternating run by run (a fresh session each run, the idle reader catching up between
runs as in serve). Per round it times, on the host: the generator's step (from the end of the
bookkeeping to the next token on the host; the generator launches each round before it hands out
the token before it, so the bookkeeping runs while the device computes), the bookkeeping between
rounds (a read's own time is device synchronised), and the chunks read there. It reports per
arm the decode rate, the step time of rounds without a read, the gap after the one holding a read
against the gaps' p50 (what a read does to the rounds after it), the bookkeeping p50/p99, the
share charged and the longest gap.
Last stdout line: one JSON object.

    python3 experiments/round_timeline.py --shadow qwen3.5-0.8b --generator qwen3.5-4b --device cuda \
        --prompt 16350 --output 346 --runs 6 --share 0.02
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from shadow.core.reader import open_reader
from shadow.core.schedule import BandwidthRule
from shadow.core.store import SessionStore
from shadow.model.runtime import load_model
from shadow.server.generator import Generator
from shadow.server.host import Shadow
from shadow.server.service import ShadowService
from shadow.server.settings import ModelSettings, ServeSettings, StoreSettings
from shadow.text.sample import sample_conversation
from shadow.text.tokenizer import load_tokenizer


def prompt_ids(tokenizer, n: int, tag: int) -> list[int]:
    text = f"[run {tag}]\n" + "\n".join(m.content for m in sample_conversation(seed=7, turns=max(4, n // 700)).messages)
    ids = tokenizer.encode(text)
    while len(ids) < n:
        ids += ids
    return ids[:n]


def one_run(service: ShadowService, generator: Generator, prompt: list[int], output: int) -> dict:
    """One turn of the embedded engine; per round: step seconds, bookkeeping seconds, chunks read."""
    turn = service.begin_turn(f"run-{time.monotonic_ns()}", embedded=True)
    service.name_turn(turn, prompt)
    steps, between, reads, arrivals = [], [], [], []

    def job() -> None:
        service.set_prompt(turn, prompt)
        gen = generator.generate(prompt, output, ())
        t = time.perf_counter()
        for k, token in enumerate(gen):  # a token is out once the generator has it on the host
            now = time.perf_counter()
            arrivals.append(now)
            if k:
                steps.append(now - t)
            if k == 0:
                service.first_token(turn)
            b0 = time.perf_counter()
            reads.append(service.between_rounds(turn, (token,)))
            t = time.perf_counter()
            between.append(t - b0)

    try:
        service.run_request(job)
    finally:
        service.end_turn(turn)
    now, wall = time.perf_counter(), time.time()
    return {"steps": steps, "between": between, "reads": reads, "arrivals": arrivals, "share_s": turn.share_used,
            "wall": [wall - (now - arrivals[0]), wall - (now - arrivals[-1])] if arrivals else None}


def summarize(runs: list[dict]) -> dict:
    rates = [(len(r["arrivals"]) - 1) / (r["arrivals"][-1] - r["arrivals"][0]) for r in runs]
    after_read, plain, booking, gaps, read_rounds, charged = [], [], [], [], 0, []
    for r in runs:
        for k, s in enumerate(r["steps"]):  # steps[k] follows the round of token k (reads[k])
            if not r["reads"][k]:
                plain.append(s)
        arrivals = r["arrivals"]
        for k in range(len(arrivals) - 2):  # the gap after the one holding a read: what a read does next
            if r["reads"][k]:
                after_read.append(arrivals[k + 2] - arrivals[k + 1])
        booking += [b for b, n in zip(r["between"], r["reads"]) if not n]
        gaps += [b - a for a, b in zip(r["arrivals"], r["arrivals"][1:])]
        read_rounds += sum(1 for n in r["reads"] if n)
        decode = r["arrivals"][-1] - r["arrivals"][0]
        charged.append(100 * r["share_s"] / decode)
    q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] if xs else None  # noqa: E731
    ms = lambda x: None if x is None else round(1000 * x, 4)  # noqa: E731
    return {"decode_tok_s": statistics.median(rates), "rates": [round(x, 2) for x in rates],
            "step_ms_p50": ms(q(plain, 0.5)), "gap_after_read_ms_p50": ms(q(after_read, 0.5)),
            "rounds_with_a_read": read_rounds, "bookkeeping_us_p50": None if not booking else round(1e6 * q(booking, 0.5), 2),
            "bookkeeping_us_p99": None if not booking else round(1e6 * q(booking, 0.99), 2),
            "gap_ms_p50": ms(q(gaps, 0.5)), "gap_ms_p99": ms(q(gaps, 0.99)), "gap_ms_max": ms(max(gaps)),
            "share_charged_pct": statistics.median(charged)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shadow", default="tiny")
    parser.add_argument("--generator", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt", type=int, default=2000)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--share", type=float, default=0.02)
    parser.add_argument("--slice-chunks", type=int, default=1)
    parser.add_argument("--raw", help="write every run's per-round times (and wall-clock decode window) here, as JSON")
    args = parser.parse_args()

    loaded, reader = open_reader(args.shadow, grid=512, device=args.device)
    store = SessionStore(reader, loaded.weights_hash, cap_gib=None)
    settings = ServeSettings(model=ModelSettings(args.shadow, args.generator, 512, args.device),
                             store=StoreSettings(cap_gib=None),
                             schedule=BandwidthRule(share=args.share, slice_chunks=args.slice_chunks))
    service = ShadowService(settings, Shadow(reader, store, loaded.weights_label), reader.model.config)
    gen_model = loaded.model if args.generator == args.shadow else \
        load_model(args.generator, device=args.device, kernels=loaded.model.kernels).model
    generator = Generator.on(gen_model)
    tokenizer = load_tokenizer(None)
    service.start()
    try:
        one_run(service, generator, prompt_ids(tokenizer, args.prompt, -1), min(args.output, 16))  # warm-up
        arms: dict[str, list[dict]] = {"off": [], "on": []}
        for pair in range(args.runs):
            for arm in (("off", "on") if pair % 2 == 0 else ("on", "off")):
                service.shared.switch.shadow = service.shared.switch.voice = arm == "on"
                arms[arm].append(one_run(service, generator, prompt_ids(tokenizer, args.prompt, 2 * pair + (arm == "on")),
                                         args.output))
                time.sleep(1.5)  # as ab's pause: the idle reader catches up between runs
        service.shared.switch.shadow = True
        out = {a: summarize(rs) for a, rs in arms.items()}
        paired = [100 * (on - off) / off for off, on in zip(out["off"]["rates"], out["on"]["rates"])]
        doc = {"shadow": args.shadow, "generator": args.generator, "device": args.device, "prompt": args.prompt,
               "output": args.output, "runs": args.runs, "share": args.share, "slice_chunks": args.slice_chunks,
               "delta_pct": 100 * (out["on"]["decode_tok_s"] - out["off"]["decode_tok_s"]) / out["off"]["decode_tok_s"],
               "paired_deltas_pct": [round(x, 2) for x in paired], **out}
        for arm in ("off", "on"):
            o = out[arm]
            print(f"{arm:>3}: {o['decode_tok_s']:.2f} tok/s; step p50 {o['step_ms_p50']} ms, the gap after a read's "
                  f"{o['gap_after_read_ms_p50']} ms ({o['rounds_with_a_read']} rounds read); bookkeeping p50 "
                  f"{o['bookkeeping_us_p50']} us p99 {o['bookkeeping_us_p99']} us; gaps p50 {o['gap_ms_p50']} p99 "
                  f"{o['gap_ms_p99']} max {o['gap_ms_max']} ms; charged {o['share_charged_pct']:.2f} %")
        print(f"change {doc['delta_pct']:+.2f} % (pairs {doc['paired_deltas_pct']})")
        if args.raw:
            with open(args.raw, "w") as f:
                json.dump(arms, f)
        print(json.dumps(doc))
    finally:
        service.stop()


if __name__ == "__main__":
    main()
