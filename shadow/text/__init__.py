"""Text and ids: chat templates (the in-code one and the big model's own), tokenizers, the real Qwen3.5 vocabulary, conversation files and the seeded sample session. No model."""
