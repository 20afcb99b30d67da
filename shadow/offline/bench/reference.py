"""The reference path a user reaches for first: transformers' Qwen3_5ForCausalLM fed a session in
grid-sized chunks through its DynamicCache (with flash-linear-attention's kernels when installed)."""

from __future__ import annotations

import inspect
import json
import time
import warnings

import torch

from shadow.offline.bench.timer import synchronize
from shadow.model import LoadedModel


def reference_model(loaded: LoadedModel):
    """transformers' model with the same weights, dtype and device as `loaded`."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    text = json.loads((loaded.path / "config.json").read_text())
    text = text.get("text_config", text)
    ours = loaded.model
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text))
    weights = {f"model.{k}": v for k, v in ours.state_dict().items() if k != "lm_head.weight"}
    weights["lm_head.weight"] = ours.state_dict().get("lm_head.weight", ours.embed_tokens.weight)
    model.load_state_dict(weights, assign=True, strict=True)
    model.model.rotary_emb.to_empty(device=ours.device)
    rotary = model.model.rotary_emb
    with warnings.catch_warnings():  # a transformers deprecation notice; the library never prints
        warnings.simplefilter("ignore")
        inv_freq, _ = rotary.compute_default_rope_parameters(rotary.config, device=ours.device)
    rotary.inv_freq = inv_freq
    rotary.original_inv_freq = inv_freq.clone()
    return model.eval()


def cache_keyword(model) -> str:
    """The keyword under which `model`'s forward takes its cache: `cache` where this transformers
    has it (`past_key_values`, its older name, is announced for removal in 5.40), else
    `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def uses_fla() -> bool:
    try:
        import fla  # noqa: F401
    except ImportError:
        return False
    return True


@torch.no_grad()
def reference_read_ms_per_1k(model, ids: list[int], grid: int, device: torch.device, runs: int = 2) -> float:
    """Milliseconds per 1,000 tokens to read `ids` from empty in `grid`-row chunks (median of runs,
    after one warm-up read of the first two chunks)."""
    from transformers import DynamicCache

    tensor = torch.tensor(ids, device=device)[None]
    keyword = cache_keyword(model)

    def read(n: int) -> float:
        cache = DynamicCache(config=model.config)
        synchronize(device)
        start = time.perf_counter()
        for lo in range(0, n, grid):
            model(input_ids=tensor[:, lo : lo + grid], **{keyword: cache}, use_cache=True, logits_to_keep=1)
        synchronize(device)
        return time.perf_counter() - start

    read(min(len(ids), 2 * grid))
    seconds = sorted(read(len(ids)) for _ in range(runs))[runs // 2]
    return seconds * 1e6 / len(ids)
