"""The model layer: Qwen3.5 config, checkpoints, the project's own forward on explicit state, its
kernels, and the runtime that chooses them."""

from shadow.model.checkpoint import LoadedModel, resolve_checkpoint, write_random_checkpoint
from shadow.model.config import PRESETS, ModelConfig
from shadow.model.qwen35 import Qwen35
from shadow.model.runtime import load_model

__all__ = ["LoadedModel", "ModelConfig", "PRESETS", "Qwen35", "load_model", "resolve_checkpoint", "write_random_checkpoint"]
