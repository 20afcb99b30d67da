"""Checkpoint folders: read a Hugging Face Qwen3.5 folder, or write a random-weight one for a preset
(`runtime.load_model` builds a runnable model from one).

A folder holds `config.json` and `*.safetensors` (text weights under `model.language_model.`
or `model.`; vision and MTP weights are skipped). A random folder, written by this module,
has the same layout plus `shadow_random.json`, so every report can say the weights are random.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shadow.errors import ShadowInputError
from shadow.model.config import PRESETS, ModelConfig
from shadow.model.qwen35 import Qwen35

RANDOM_MARKER = "shadow_random.json"
TEXT_PREFIXES = ("model.language_model.", "model.")
SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")


@dataclass
class LoadedModel:
    """A model ready to run, with what identifies its weights."""

    model: Qwen35
    path: Path
    weights_hash: str  # sha256 of the safetensors files, in name order
    random: bool  # written by `write_random_checkpoint`: answer quality means nothing

    @property
    def weights_label(self) -> str:
        return "random" if self.random else self.weights_hash


# Called as (preset, folder) right before a preset's random checkpoint is first written, which
# takes a while (a CLI tells its user then); None: nobody is told.
before_writing_preset: Callable[[str, Path], None] | None = None


def cache_dir() -> Path:
    return Path(os.environ.get("SHADOW_CACHE", Path.home() / ".cache" / "shadow"))


def preset_folder(name: str, seed: int = 0) -> Path:
    """Where a preset's random checkpoint lives in the cache (written there on first use)."""
    return cache_dir() / "checkpoints" / f"{name}-random-seed{seed}"


def preset_written(name: str, seed: int = 0) -> bool:
    """Whether a preset's random checkpoint is in the cache already."""
    return (preset_folder(name, seed) / RANDOM_MARKER).exists()


def resolve_checkpoint(name: str, seed: int = 0) -> Path:
    """A preset name gives its random folder in the cache (written on first use); else a folder path."""
    if name in PRESETS:
        folder = preset_folder(name, seed)
        if not (folder / RANDOM_MARKER).exists():
            if before_writing_preset is not None:
                before_writing_preset(name, folder)
            dtype = torch.float32 if name == "tiny" else torch.bfloat16
            write_random_checkpoint(folder, PRESETS[name], seed=seed, dtype=dtype, preset=name)
        return folder
    folder = Path(name)
    try:
        is_dir, has_config = folder.is_dir(), (folder / "config.json").is_file()
    except OSError as e:  # a name the file system cannot take (too long, say)
        raise ShadowInputError(f"no checkpoint folder or preset named {name[:80]!r}...: {e.strerror}") from None
    if not is_dir:
        raise ShadowInputError(
            f"no checkpoint folder or preset named {name!r} (presets: {', '.join(PRESETS)})"
        )
    if not has_config:
        raise ShadowInputError(f"{folder} has no config.json")
    return folder


def read_config(folder: Path) -> ModelConfig:
    try:
        raw = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ShadowInputError(f"{folder / 'config.json'} is not valid JSON: {e}") from None
    return ModelConfig.from_hf(raw)


def read_weights(folder: Path) -> tuple[dict[str, torch.Tensor], str]:
    """The text model's tensors of a checkpoint folder (keys without their prefix; vision and MTP
    weights skipped) and the weights hash (sha256 of its safetensors files, in name order)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ShadowInputError(f"{folder} has no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        for key, t in load_file(f).items():
            text_key = _text_key(key)
            if text_key is not None:
                tensors[text_key] = t
    return tensors, _hash_files(files)


def place_weights(model: Qwen35, tensors: dict[str, torch.Tensor], folder: Path, device: str,
                  dtype: torch.dtype | None) -> None:
    """Load `tensors` into `model` (built on the meta device) on `device`, in `dtype` (None: as
    stored); ShadowInputError when they do not fit the config."""
    expected = set(model.state_dict())
    missing, extra = expected - set(tensors), set(tensors) - expected
    if missing or extra:
        raise ShadowInputError(
            f"{folder}: weights do not fit the config (missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]})"
        )
    target = dtype or tensors["embed_tokens.weight"].dtype
    model.load_state_dict({k: t.to(device=device, dtype=_param_dtype(k, target)) for k, t in tensors.items()}, assign=True)
    model.eval()


def _param_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    # GDN decay parameters stay float32 (the recurrence is float32 whatever the model dtype)
    return torch.float32 if name.endswith(("A_log", "dt_bias")) else dtype


def _text_key(key: str) -> str | None:
    if key.startswith(SKIPPED_PREFIXES):
        return None
    if key == "lm_head.weight":
        return key
    for prefix in TEXT_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return None


def _hash_files(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            while block := fh.read(1 << 24):
                h.update(block)
    return h.hexdigest()


def random_weights(config: ModelConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Seeded random weights for `config`, keyed like the text model (no prefix)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Qwen35(config).state_dict().items()}
    out = {}
    for name, shape in shapes.items():
        if name.endswith("A_log"):
            t = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
        elif name.endswith("dt_bias"):
            t = torch.empty(shape).uniform_(-1.0, 1.0, generator=gen)
        elif name.endswith("linear_attn.norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("norm.weight"):  # zero-centred norms: the stored weight is w in x * (1 + w)
            t = 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("conv1d.weight"):
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        elif name == "embed_tokens.weight":
            t = 0.05 * torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        out[name] = t.to(_param_dtype(name, dtype))
    return out


def write_random_checkpoint(
    folder: Path, config: ModelConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32,
    preset: str = "custom", text_layout: bool = False, extra_files: dict[str, str] | None = None,
) -> Path:
    """Write a random-weight checkpoint in the layout of a real multimodal Qwen3.5 folder (or, with
    `text_layout`, of a text-only one: `Qwen3_5ForCausalLM`, weights under `model.`), plus
    `extra_files` (name -> text); atomic."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        prefix = "model." if text_layout else "model.language_model."
        weights = {(k if k == "lm_head.weight" else prefix + k): v
                   for k, v in random_weights(config, seed, dtype).items()}
        # one metadata key: safetensors before 0.6 writes a map's keys in a per-process order,
        # and the weights hash is of the file's bytes
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        text = config.to_hf_text() | {"dtype": str(dtype).removeprefix("torch.")}
        if text_layout:
            hf = text | {"architectures": ["Qwen3_5ForCausalLM"], "tie_word_embeddings": config.tie_word_embeddings}
        else:
            hf = {
                "architectures": ["Qwen3_5ForConditionalGeneration"],
                "model_type": "qwen3_5",
                "tie_word_embeddings": config.tie_word_embeddings,
                "text_config": text,
            }
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        for name, body in (extra_files or {}).items():
            (tmp / name).write_text(body, encoding="utf-8")
        (tmp / RANDOM_MARKER).write_text(json.dumps({"random": True, "preset": preset, "seed": seed}))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return folder
