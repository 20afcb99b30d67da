"""Checkpoint folders: random presets, real layouts, weights hash, and bad folders."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from shadow.errors import ShadowInputError
from shadow.model import PRESETS, load_model
from shadow.model.checkpoint import RANDOM_MARKER, random_weights, write_random_checkpoint


def test_preset_folder_has_real_layout_and_is_marked_random(tiny):
    config = json.loads((tiny.path / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["text_config"]["vocab_size"] == 248320
    keys = load_file(tiny.path / "model.safetensors").keys()
    assert all(k.startswith("model.language_model.") for k in keys)
    assert tiny.random and tiny.weights_label == "random" and len(tiny.weights_hash) == 64


def test_same_seed_same_hash_other_seed_other_hash(tiny):
    assert load_model("tiny").weights_hash == tiny.weights_hash
    assert load_model("tiny", seed=1).weights_hash != tiny.weights_hash


def test_random_checkpoint_bytes_repeat_whatever_the_safetensors_version(tmp_path):
    """The weights hash is of the file's bytes; safetensors before 0.6 writes a metadata map's keys
    in a per-process order, so the file carries one key (its bytes then repeat on any version)."""
    a = write_random_checkpoint(tmp_path / "a", PRESETS["tiny"]) / "model.safetensors"
    b = write_random_checkpoint(tmp_path / "b", PRESETS["tiny"]) / "model.safetensors"
    assert a.read_bytes() == b.read_bytes()
    raw = a.read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert header["__metadata__"] == {"format": "pt"}


def test_text_form_checkpoint_with_model_prefix_loads(tmp_path, tiny):
    """A text-only folder (model_type qwen3_5_text, weights under `model.`, vision/MTP extras) loads the same."""
    config = PRESETS["tiny"]
    weights = {f"model.{k}": v for k, v in random_weights(config, 0, torch.float32).items()}
    weights["mtp.fc.weight"] = torch.zeros(2, 2)
    weights["model.visual.patch.weight"] = torch.zeros(2, 2)
    save_file(weights, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_text()))
    loaded = load_model(str(tmp_path))
    assert not loaded.random
    ids = torch.arange(100, 164)
    a = loaded.model(ids, loaded.model.new_state())
    b = tiny.model(ids, tiny.model.new_state())
    assert torch.equal(a, b)


def test_bfloat16_dtype_keeps_decay_parameters_float32(tiny):
    loaded = load_model("tiny", dtype=torch.bfloat16)
    assert loaded.model.dtype == torch.bfloat16
    gdn = loaded.model.layers[0].linear_attn
    assert gdn.A_log.dtype == torch.float32 and gdn.dt_bias.dtype == torch.float32


def test_unknown_preset_or_missing_folder(tmp_path):
    with pytest.raises(ShadowInputError, match="no checkpoint folder or preset"):
        load_model("qwen9-huge")
    with pytest.raises(ShadowInputError, match="no config.json"):
        load_model(str(tmp_path))


def test_config_that_is_not_qwen35(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ShadowInputError, match="not a Qwen3.5 config"):
        load_model(str(tmp_path))


def test_weights_that_do_not_fit_the_config(tmp_path):
    write_random_checkpoint(tmp_path / "ck", PRESETS["tiny"])
    config = json.loads((tmp_path / "ck" / "config.json").read_text())
    config["text_config"]["num_hidden_layers"] = 8
    config["text_config"].pop("layer_types")
    (tmp_path / "ck" / "config.json").write_text(json.dumps(config))
    (tmp_path / "ck" / RANDOM_MARKER).unlink()
    with pytest.raises(ShadowInputError, match="do not fit the config"):
        load_model(str(tmp_path / "ck"))
