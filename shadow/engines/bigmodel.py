"""A random-weight "big model" folder that a real engine serves (`transformers serve`): the text
layout (`Qwen3_5ForCausalLM`, weights under `model.`), the real Qwen3.5 vocabulary as
`tokenizer.json` (from `shadow.text.vocab`), and a given chat template as `chat_template.jinja`.

Tests and experiments stand it up as the engine the shadow sits beside; its answers are noise
(random weights), its ids are the real vocabulary's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shadow.errors import ShadowInputError
from shadow.model.checkpoint import write_random_checkpoint
from shadow.model.config import PRESETS
from shadow.text.vocab import tokenizer_files


def write_engine_folder(folder: Path, template: Path, preset: str = "tiny", seed: int = 0,
                        dtype: torch.dtype = torch.float32) -> Path:
    """Write the folder (atomically, replacing one there) and return it. `template` is a Jinja chat
    template file, read by path."""
    if preset not in PRESETS:
        raise ShadowInputError(f"no preset {preset!r} (presets: {', '.join(PRESETS)})")
    try:
        chat_template = Path(template).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ShadowInputError(f"cannot read the chat template {template}: {e}") from None
    config = PRESETS[preset]
    generation = {"eos_token_id": config.eos_token_id, "pad_token_id": 248044, "do_sample": False}
    folder = write_random_checkpoint(
        Path(folder), config, seed=seed, dtype=dtype, preset=preset, text_layout=True,
        extra_files={"chat_template.jinja": chat_template, "generation_config.json": json.dumps(generation)}
        | tokenizer_files(),
    )
    return folder
