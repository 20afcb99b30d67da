"""Open a model and a reader on a device with the right kernels and forward."""

from __future__ import annotations

from shadow.model import LoadedModel, load_model, resolve_checkpoint
from shadow.model.checkpoint import read_config
from shadow.model.fast import pick
from shadow.model.piecewise import PiecewiseForward
from shadow.reader import Reader, check_grid

FORK_SIZES = (1, 64, 128, 256, 512)  # graphed row counts for fork pieces and decode steps


def open_reader(
    model: str, *, grid: int = 512, device: str = "cpu", dtype=None, kernels: str = "auto",
    seed: int = 0, graphs: bool = True,
) -> tuple[LoadedModel, Reader]:
    """A loaded model and a Reader. On CUDA the forward is piecewise-graphed for the grid and
    the fork sizes; on the CPU it is the plain forward with the reference kernels."""
    check_grid(grid)
    config = read_config(resolve_checkpoint(model, seed))
    chosen = pick(kernels, device, config.linear_key_head_dim)
    loaded = load_model(model, dtype=dtype, device=device, kernels=chosen, seed=seed)
    return loaded, reader_for(loaded, grid, graphs)


def reader_for(loaded: LoadedModel, grid: int, graphs: bool = True) -> Reader:
    """A Reader on `loaded` for `grid`: piecewise CUDA graphs on a GPU, the plain forward elsewhere."""
    check_grid(grid)
    forward = None
    if loaded.model.device.type == "cuda" and graphs:
        forward = PiecewiseForward(loaded.model, sizes={grid, *FORK_SIZES})
    return Reader(loaded.model, grid, forward=forward)
