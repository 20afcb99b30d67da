"""Which gated-delta-rule kernel is fastest for a chunk's rows, on this GPU, and which keeps a
session's bits whatever the batch?

The 0.8B's GDN shape: a 512-row chunk of 16 key and 16 value heads of 128 (bf16 q, k, v and gate
projections; a float32 state of 16 x 128 x 128 per session), B sessions in one call. Timed side by
side in one run, on the same data, from the raw projections (the decay's and beta's gates
included, as a chunk's forward needs them):
- the library's call (`kernels.fla.gdn_fla_gated_batch`: fla's chunked rule, gates in its kernels,
  the session as fla's batch dimension), eager and under one CUDA graph;
- FlashInfer's SM90 prefill (`flashinfer.gdn_prefill.chunk_gated_delta_rule`: varlen, the decay
  given as alpha = exp(g) and beta as sigmoid(b), both in float32, computed before it), with
  `use_cp` False, True and "auto", the states packed in sequence order; and with `use_cp=False`
  from a state pool addressed by `state_indices`, written in place (no gather, no scatter), eager
  and graphed.
Each row says whether the kernel gave the same bits twice, whether session 0 alone had the bits of
its rows in the batch (output and final state, compared as integers, so NaN equals NaN), and its
largest difference from the library's call and from the float32 reference
(`reference.gdn_gated_reference`) on session 0. 20 back-to-back calls between CUDA events after
warm-up, median of 5 rounds.

    python3 experiments/gdn_kernels.py --batches 1,8
Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from shadow.model.config import PRESETS
from shadow.model.kernels import fla as fla_kernels
from shadow.model.kernels import reference

from attention_batch import gpu_ms  # run as a script: experiments/ is on the path

T = 512


def bits(x: torch.Tensor) -> torch.Tensor:
    """`x`'s bits as integers of its width (NaN compares equal to the same NaN)."""
    return x.contiguous().view({2: torch.int16, 4: torch.int32}[x.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def inputs(batch: int, seed: int) -> dict:
    c = PRESETS["qwen3.5-0.8b"]
    hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    g = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *s: torch.randn(*s, device="cuda", generator=g)
    return {
        "q": rand(batch, T, hk, dk).bfloat16(), "k": rand(batch, T, hk, dk).bfloat16(),
        "v": rand(batch, T, hv, dv).bfloat16(), "a": rand(batch, T, hv).bfloat16(), "b": rand(batch, T, hv).bfloat16(),
        "a_log": (rand(hv) * 0.5).float(), "dt_bias": rand(hv).float(),
        "state": (rand(batch, hv, dk, dv) * 0.05).float(),  # fla's layout: [B, H, K, V]
    }


def library(x: dict):
    return lambda: fla_kernels.gdn_fla_gated_batch(x["q"], x["k"], x["v"], x["a"], x["b"], x["a_log"], x["dt_bias"],
                                                   x["state"])


def gates(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's gates from the raw projections: alpha = exp(g) (the decay itself, not its log)
    and beta = sigmoid(b), float32, [B*T, Hv]."""
    g = -x["a_log"].exp() * F.softplus(x["a"].float() + x["dt_bias"])
    return g.exp().flatten(0, 1).contiguous(), x["b"].float().sigmoid().flatten(0, 1).contiguous()


def flashinfer_call(x: dict, use_cp, pool: torch.Tensor | None = None, slots: torch.Tensor | None = None):
    """FlashInfer's rule on `x` (its states [B, H, V, K] packed, or rows `slots` of `pool`, in
    place); returns (out [B, T, Hv, V], final states in fla's layout [B, H, K, V])."""
    from flashinfer.gdn_prefill import chunk_gated_delta_rule

    batch = x["q"].shape[0]
    q, k, v = (x[n].flatten(0, 1) for n in ("q", "k", "v"))
    cu = torch.arange(0, (batch + 1) * T, T, dtype=torch.int32, device="cuda")
    packed = x["state"].transpose(-1, -2).contiguous()

    def call():
        alpha, beta = gates(x)
        if pool is None:
            out, final = chunk_gated_delta_rule(q, k, v, g=alpha, beta=beta, initial_state=packed,
                                                output_final_state=True, cu_seqlens=cu,
                                                use_qk_l2norm_in_kernel=True, use_cp=use_cp, max_seqlen=T)
            return out.view(batch, T, *out.shape[1:]), final.transpose(-1, -2)
        out, _ = chunk_gated_delta_rule(q, k, v, g=alpha, beta=beta, initial_state=pool, output_state=pool,
                                        output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                        use_cp=use_cp, state_indices=slots, max_seqlen=T)
        return out.view(batch, T, *out.shape[1:]), pool.index_select(0, slots).transpose(-1, -2)
    return call


def graphed(fn):
    """`fn` captured in one CUDA graph after warm-up; the replay, and the captured outputs."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    return lambda: (graph.replay(), outs)[1]


def session0(x: dict) -> dict:
    return {n: (t[:1] if t.dim() > 1 else t) for n, t in x.items()}


def row(name: str, make, x: dict, lib_out, ref_out, fresh_state: bool = False) -> dict:
    """Time `make(x)`'s call, then check it: twice, session 0 alone against the batch, and its
    difference from the library's and the float32 reference's session 0. `make` builds a call from
    inputs; `fresh_state`: the call writes its state in place, so each check gets its own copy."""
    try:
        ms = gpu_ms(make(x))
        out, final = (t.clone() for t in make(x)())
        again = [t.clone() for t in make(x)()]
        alone_out, alone_final = make(session0(x))()
    except Exception as e:  # a kernel that refuses the shape says so, and the survey goes on
        return {"kernel": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    batch = x["q"].shape[0]
    flops = batch * T * x["q"].shape[2] * x["q"].shape[3] * x["v"].shape[3] * 2 * 4  # a rough count: 4 matrix products a row
    return {
        "kernel": name, "ms": round(ms, 4), "TFLOP/s (4 products a row)": round(flops / ms / 1e9, 1),
        "same bits twice": same(out, again[0]) and same(final, again[1]),
        "session 0 alone == in batch": same(alone_out[0], out[0]) and same(alone_final[0], final[0]),
        "max |diff| from the library, out": float((out[0].float() - lib_out[0][0].float()).abs().max()),
        "max |diff| from the library, state": float((final[0].float() - lib_out[1][0].float()).abs().max()),
        "max |diff| from float32, out": float((out[0].float() - ref_out[0].float()).abs().max()),
        "max |diff| from float32, state": float((final[0].float() - ref_out[1].float()).abs().max()),
    }


def survey(batch: int) -> list[dict]:
    x = inputs(batch, seed=batch)
    lib = library(x)()
    s0 = session0(x)
    ref = reference.gdn_gated_reference(s0["q"][0], s0["k"][0], s0["v"][0], s0["a"][0], s0["b"][0], s0["a_log"],
                                        s0["dt_bias"], s0["state"][0])
    rows = [row("library: fla, gates in its kernels (eager)", library, x, lib, ref),
            row("library: fla, one CUDA graph", lambda y: graphed(library(y)), x, lib, ref)]
    for use_cp in (False, True, "auto"):
        rows.append(row(f"flashinfer use_cp={use_cp}, states packed", lambda y, c=use_cp: flashinfer_call(y, c),
                        x, lib, ref))

    def pooled(y, graph=False):
        n = y["q"].shape[0]
        pool = torch.zeros(4 + 2 * n, *y["state"].shape[1:], device="cuda")  # more slots than sessions
        slots = torch.arange(3, 3 + 2 * n, 2, dtype=torch.int64, device="cuda")  # spread through the pool
        pool.index_copy_(0, slots, y["state"].transpose(-1, -2).contiguous())
        call = flashinfer_call(y, False, pool, slots)

        def once():  # the pool written in place: each call starts from the same states
            pool.index_copy_(0, slots, y["state"].transpose(-1, -2).contiguous())
            return call()
        return graphed(once) if graph else once
    rows.append(row("flashinfer use_cp=False, a state pool by index (eager)", pooled, x, lib, ref))
    rows.append(row("flashinfer use_cp=False, a state pool by index, one CUDA graph",
                    lambda y: pooled(y, graph=True), x, lib, ref))
    for r in rows:
        r["batch"] = batch
    return rows


def batch_sizes(text: str) -> list[int]:
    """`--batches`: positive whole numbers, comma-separated (argparse turns a refusal into one line, exit 2)."""
    try:
        sizes = [int(b) for b in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes are positive whole numbers, comma-separated, not {text!r}")
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default=[1, 8], type=batch_sizes, help="sessions per call, comma-separated (1,8)")
    args = parser.parse_args()
    versions = {"torch": torch.__version__}
    for module in ("fla", "flashinfer"):
        try:
            versions[module] = __import__(module).__version__
        except Exception as e:  # noqa: BLE001 - reported, the other arms still run
            versions[module] = f"not importable: {type(e).__name__}: {e}"
    print(torch.cuda.get_device_name(), json.dumps(versions), flush=True)
    every = []
    for batch in args.batches:
        for r in survey(batch):
            every.append(r)
            print(json.dumps(r), flush=True)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "versions": versions, "rows": every}))


if __name__ == "__main__":
    main()
