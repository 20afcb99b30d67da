"""The project's forward against transformers' Qwen3_5ForCausalLM on the same random tiny weights."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from shadow.offline.bench.reference import cache_keyword

MAX_REL = 1e-4


@pytest.fixture(scope="module")
def oracle(tiny):
    text = json.loads((tiny.path / "config.json").read_text())["text_config"]
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text)).float().eval()
    weights = {f"model.{k}": v for k, v in tiny.model.state_dict().items()}
    weights["lm_head.weight"] = tiny.model.embed_tokens.weight
    model.load_state_dict(weights, strict=True)
    return model


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.slow
def test_single_prefill_logits_agree(tiny, oracle):
    ids = torch.randint(0, 248044, (256,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = oracle(ids[None]).logits[0].float()
    state = tiny.model.new_state()
    ours = tiny.model.logits(tiny.model(ids, state))
    assert rel_err(ours, ref) <= MAX_REL


@pytest.mark.slow
def test_chunked_prefill_with_state_agrees(tiny, oracle):
    """Three chunks of 128 with state carried, both sides; every chunk's logits and the final states."""
    ids = torch.randint(0, 248044, (384,), generator=torch.Generator().manual_seed(2))
    cache = DynamicCache(config=oracle.config)
    state = tiny.model.new_state()
    for start in range(0, 384, 128):
        chunk = ids[start : start + 128]
        with torch.no_grad():
            ref = oracle(chunk[None], **{cache_keyword(oracle): cache}, use_cache=True).logits[0].float()
        ours = tiny.model.logits(tiny.model(chunk, state))
        assert rel_err(ours, ref) <= MAX_REL, f"chunk at {start}"
    for i, layer in enumerate(state.layers):
        hf = cache.layers[i]
        if tiny.model.config.layer_types[i] == "full_attention":
            assert rel_err(layer.k[:, :384], hf.keys[0]) <= MAX_REL
            assert rel_err(layer.v[:, :384], hf.values[0]) <= MAX_REL
        else:
            assert rel_err(layer.recurrent, hf.recurrent_states[0][0]) <= MAX_REL


def test_decode_steps_agree(tiny, oracle):
    """A prefill then single-token steps (the fork decode's shape) against the oracle's cache."""
    ids = torch.randint(0, 248044, (70,), generator=torch.Generator().manual_seed(3))
    cache = DynamicCache(config=oracle.config)
    state = tiny.model.new_state()
    with torch.no_grad():
        oracle(ids[None, :64], **{cache_keyword(oracle): cache}, use_cache=True)
    tiny.model(ids[:64], state)
    for t in range(64, 70):
        with torch.no_grad():
            ref = oracle(ids[None, t : t + 1], **{cache_keyword(oracle): cache}, use_cache=True).logits[0].float()
        ours = tiny.model.logits(tiny.model(ids[t : t + 1], state))
        assert rel_err(ours, ref) <= MAX_REL, f"step {t}"
