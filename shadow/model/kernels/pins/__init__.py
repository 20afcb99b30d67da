"""fla's autotuned kernel configs pinned from a committed file, so that a cleared Triton cache
cannot change the configs a chunk runs with (and with them its bits).

fla tunes each kernel once per shape key and caches the choice on disk (FLA_CACHE_RESULTS), which
keeps two processes on one machine in step; a cleared cache tunes again and may choose other
configs. `record()` reads the choice every fla autotuner in this process has made; `apply()` puts
a recording back into the autotuners before they run, when the GPU, Triton and fla versions are
the recording's. Keys a recording lacks are tuned (and disk-cached) as before.

A recording lives in `<GPU name>.json` in this package's folder (`experiments/pin_autotune.py`
writes one).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

PINS_DIR = Path(__file__).parent
PREFIX = "fla."  # the modules whose autotuners are pinned


def _autotuners(prefix: str = PREFIX) -> dict[str, Any]:
    """Every Triton Autotuner held at module level by an imported module under `prefix`, by the
    full name of the kernel it tunes (one entry however many modules import it; an autotuner
    wrapped by heuristics is found through the wrapper)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    found = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name + ".").startswith(prefix):
            continue
        for value in list(vars(module).values()):
            for _ in range(4):  # heuristics and other wrappers keep the wrapped function in .fn
                if isinstance(value, Autotuner) or value is None:
                    break
                value = getattr(value, "fn", None)
            if not isinstance(value, Autotuner):
                continue
            kernel = value.fn
            for _ in range(4):
                if isinstance(kernel, JITFunction):
                    break
                kernel = getattr(kernel, "fn", None)
            if isinstance(kernel, JITFunction):
                found[f"{kernel.__module__}.{kernel.__qualname__}"] = value
    return found


def identity() -> dict[str, str]:
    """The GPU and versions a recording is valid for."""
    import fla
    import torch
    import triton

    return {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "fla": fla.__version__}


def pins_path(gpu: str) -> Path:
    return PINS_DIR / (re.sub(r"[^0-9A-Za-z]+", "_", gpu).strip("_") + ".json")


def _config_dict(config) -> dict[str, Any]:
    return {k: v for k, v in config.__dict__.items() if k != "pre_hook"}


def record(prefix: str = PREFIX) -> dict[str, list[dict[str, Any]]]:
    """The configs chosen so far: {autotuner name: [{"key": [...], "config": {...}}, ...]}."""
    out = {}
    for name, tuner in sorted(_autotuners(prefix).items()):
        entries = [{"key": list(key), "config": _config_dict(config)} for key, config in tuner.cache.items()]
        if entries:
            out[name] = sorted(entries, key=lambda e: json.dumps(e["key"]))
    return out


def apply_recording(kernels: dict[str, list[dict[str, Any]]], prefix: str = PREFIX) -> int:
    """Put recorded configs into the live autotuners; returns how many keys were pinned. A name
    no live autotuner has is skipped (its module is not imported, or fla renamed it)."""
    import triton

    tuners = _autotuners(prefix)
    pinned = 0
    for name, entries in kernels.items():
        tuner = tuners.get(name)
        if tuner is None:
            continue
        for entry in entries:
            tuner.cache[tuple(entry["key"])] = triton.Config(**entry["config"])
            pinned += 1
    return pinned


def apply() -> int:
    """Pin this GPU's recording, if there is one made with these Triton and fla versions;
    returns the keys pinned (0 when there is none). Imports the fla modules the fast path uses."""
    import fla.modules.norm.fused_norm_gate
    import fla.ops.gated_delta_rule  # noqa: F401

    here = identity()
    path = pins_path(here["gpu"])
    if not path.exists():
        return 0
    data = json.loads(path.read_text())
    if data.get("identity") != here:
        return 0
    return apply_recording(data["kernels"])


def write(path: Path) -> int:
    """Write this process's recording to `path`; returns the keys written."""
    kernels = record()
    path.write_text(json.dumps({"identity": identity(), "kernels": kernels}, indent=1, sort_keys=True) + "\n")
    return sum(len(v) for v in kernels.values())
