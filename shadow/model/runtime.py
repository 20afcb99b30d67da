"""The one place a model's arithmetic is chosen: its kernel set, its steps (the modules' own or
the fused ones, with Triton's one-launch kernels on CUDA and their twins elsewhere), its forward
(piecewise CUDA graphs on a GPU, the plain forward elsewhere), fla's autotuning pinned, and the
name of the result (`arithmetic`): two states are bit-comparable only when their arithmetic names
are equal, so a session file records it and is refused by a reader whose name differs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from shadow.errors import ShadowInputError
from shadow.model.checkpoint import RANDOM_MARKER, LoadedModel, place_weights, read_config, read_weights, resolve_checkpoint
from shadow.model.kernels.reference import REFERENCE, Kernels
from shadow.model.qwen35 import ModuleSteps, Qwen35

# graphed row counts for fork pieces and decode steps: a fork reads any length in at most one of
# each below the grid (`Reader.fork_pieces`), so no step of a phrase runs an ungraphed forward
FORK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
BATCHES = (2, 4, 8)  # graphed batches of chunks read at once (`Reader.advance_batch`)
KERNEL_NAMES = ("auto", "reference", "fast", "fla-triton", "fla-fused", "fla")  # what choose_kernels takes
MIN_FAST_HEAD_DIM = 64  # fla 0.6.0 at the tiny preset's 16-dim GDN heads was off by ~12% on the H200


def fast_available() -> bool:
    """True when CUDA and flash-linear-attention are both there."""
    from shadow.model.kernels.fla import available

    return available()


def choose_kernels(name: str, device: str, head_dim: int = 128) -> Kernels:
    """'reference'; 'fast' = 'fla-triton' (the fused steps on fla and Triton: merged projections,
    one-launch kernels, Triton chunk attention); 'fla-fused' (the same with SDPA attention); 'fla'
    (fla's kernels inside the modules' own steps); or 'auto' (fast on CUDA when fla is installed
    and the GDN heads are at least MIN_FAST_HEAD_DIM wide, the reference kernels otherwise).
    Choosing a fast set pins fla's autotuning (`pin_autotuning`)."""
    if name == "reference":
        return REFERENCE
    if name not in KERNEL_NAMES:
        raise ShadowInputError(f"unknown kernels {name!r} ({', '.join(KERNEL_NAMES)})")
    wide = head_dim >= MIN_FAST_HEAD_DIM
    if name == "auto" and not (device.startswith("cuda") and fast_available() and wide):
        return REFERENCE
    if not fast_available():
        raise ShadowInputError("the fast kernels need CUDA and flash-linear-attention (pip install fla-core)")
    from shadow.model.kernels.sets import SETS

    pin_autotuning()
    return SETS["fast" if name == "auto" else name]


_pinned: int | None = None


def pin_autotuning() -> int:
    """Pin fla's autotuned configs from this GPU's committed recording (`kernels.pins`), once per
    process; returns the keys pinned (0: no recording for this GPU and these versions)."""
    global _pinned
    if _pinned is None:
        from shadow.model.kernels import pins

        _pinned = pins.apply()
    return _pinned


def pinned() -> int | None:
    """Keys pinned by `pin_autotuning` in this process; None when no fast set was chosen."""
    return _pinned


def steps_for(model: Qwen35):
    """The steps the model's kernel set runs: the fused ones (merged projections, built from the
    weights as they are now) for a fused set, the modules' own otherwise."""
    if not model.kernels.fused:
        return ModuleSteps(model)
    from shadow.model.fused import FusedSteps

    if model.device.type == "cuda":
        from shadow.model.kernels import triton as one_launch
    else:
        from shadow.model.kernels import twins as one_launch
    return FusedSteps(model, one_launch)


def load_model(name: str, *, dtype: torch.dtype | None = None, device: str = "cpu",
               kernels: Kernels | str = REFERENCE, seed: int = 0) -> LoadedModel:
    """A preset or checkpoint folder, ready to run: weights on `device` in `dtype` (None keeps the
    stored dtype), `kernels` (a set, or a name for `choose_kernels`) and its steps built now (not
    inside a first chunk's graph capture)."""
    folder = resolve_checkpoint(name, seed)
    config = read_config(folder)
    if isinstance(kernels, str):
        kernels = choose_kernels(kernels, device, config.linear_key_head_dim)
    tensors, weights_hash = read_weights(folder)
    with torch.device("meta"):
        model = Qwen35(config, kernels)
    place_weights(model, tensors, folder, device, dtype)
    model.steps = steps_for(model)
    return LoadedModel(model, folder, weights_hash, (folder / RANDOM_MARKER).exists())


def forward_for(model: Qwen35, sizes: Iterable[int], graphs: bool = True, batches: Iterable[int] = ()):
    """What runs the model on a state: on a GPU, the forward split at its attention layers with a
    CUDA graph per row count in `sizes`, and per batch of such chunks in `batches`
    (`PiecewiseForward`); elsewhere the plain forward."""
    if model.device.type != "cuda" or not graphs:
        return model
    from shadow.model.piecewise import PiecewiseForward

    return PiecewiseForward(model, sizes=set(sizes), batches=set(batches))


def warm_kernels(model: Qwen35, rows: Iterable[int]) -> int:
    """On a GPU, the compiles a kernel set's first calls would do for forwards of `rows` rows at any
    depth, done now (a first call at a new key-length class compiles for a tenth of a second or
    more: never mid-stream). Returns the launches it made (0 where there is nothing to compile)."""
    warm = model.kernels.warm_attention
    if warm is None or model.device.type != "cuda":
        return 0
    c = model.config
    return warm(c.num_attention_heads, c.num_key_value_heads, c.head_dim, list(rows), model.dtype, model.device)


def arithmetic(model: Qwen35) -> str:
    """The name of a model's arithmetic: the kernel set (with its revision, if any) and dtype, e.g.
    'reference/float32' or 'fla-triton.3/bfloat16'."""
    revision = f".{model.kernels.revision}" if model.kernels.revision else ""
    return f"{model.kernels.name}{revision}/{str(model.dtype).removeprefix('torch.')}"
