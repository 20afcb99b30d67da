"""Pinned autotuning: a recording of autotuner choices goes back into the autotuners as it was."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

if importlib.util.find_spec("triton") is not None:
    import triton
    import triton.language as tl

    @triton.autotune(
        configs=[triton.Config({"B": 16}), triton.Config({"B": 32}, num_warps=8, num_stages=2)], key=["n"],
    )
    @triton.jit
    def _tuned(x, n, B: tl.constexpr):
        tl.store(x + tl.arange(0, B), tl.zeros([B], dtype=tl.float32), mask=tl.arange(0, B) < n)


def test_a_recording_round_trips_through_json_into_the_autotuner():
    from shadow.model.kernels import pins as autotune_pins

    prefix = __name__ + "."
    chosen = _tuned.configs[1]
    _tuned.cache.clear()
    _tuned.cache[(4096, "torch.float32")] = chosen
    recording = json.loads(json.dumps(autotune_pins.record(prefix)))
    assert list(recording) == [f"{__name__}._tuned"]
    _tuned.cache.clear()
    assert autotune_pins.apply_recording(recording, prefix) == 1
    assert autotune_pins.apply_recording({"gone.kernel": recording[f"{__name__}._tuned"]}, prefix) == 0
    (key, config), = _tuned.cache.items()
    assert key == (4096, "torch.float32")
    assert (config.kwargs, config.num_warps, config.num_stages) == ({"B": 32}, 8, 2)


def test_pins_path_names_the_gpu_as_a_file():
    from shadow.model.kernels import pins as autotune_pins

    assert autotune_pins.pins_path("NVIDIA H200").name == "NVIDIA_H200.json"
