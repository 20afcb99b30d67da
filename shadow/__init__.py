"""Shadow reader: a small Qwen3.5 model that keeps an exact state of every session."""

__version__ = "0.1.0"
