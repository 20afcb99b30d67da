"""Qwen3.5 config, checkpoints, and the project's own forward."""

from shadow.model.checkpoint import LoadedModel, load_model, resolve_checkpoint, write_random_checkpoint
from shadow.model.config import PRESETS, ModelConfig
from shadow.model.qwen35 import Qwen35

__all__ = ["LoadedModel", "ModelConfig", "PRESETS", "Qwen35", "load_model", "resolve_checkpoint", "write_random_checkpoint"]
