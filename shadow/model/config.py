"""Qwen3.5 text configuration: one dataclass, read from a checkpoint's config.json or a preset."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from shadow.errors import ShadowInputError

QWEN35_VOCAB = 248320  # padded vocabulary of every Qwen3.5 size; tiny keeps it so real ids stay valid


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of a Qwen3.5 text model. `layer_types[i]` is "full_attention" or "linear_attention"."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    vocab_size: int = QWEN35_VOCAB
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, ...] = (11, 11, 10)
    tie_word_embeddings: bool = True
    full_attention_interval: int = 4
    layer_types: tuple[str, ...] = field(default=())
    eos_token_id: int = 248046  # <|im_end|>

    def __post_init__(self) -> None:
        if not self.layer_types:
            every = self.full_attention_interval
            types = tuple(
                "full_attention" if (i + 1) % every == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)
            )
            object.__setattr__(self, "layer_types", types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    def to_hf_text(self) -> dict:
        """The `text_config` dict a Hugging Face Qwen3.5 checkpoint carries."""
        d = asdict(self)
        for key in ("rope_theta", "partial_rotary_factor", "mrope_section", "full_attention_interval"):
            d.pop(key)
        d["layer_types"] = list(self.layer_types)
        d["model_type"] = "qwen3_5_text"
        d["hidden_act"] = "silu"
        d["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor,
            "mrope_section": list(self.mrope_section),
            "mrope_interleaved": True,
        }
        return d

    @classmethod
    def from_hf(cls, config: dict) -> "ModelConfig":
        """Read a Qwen3.5 config.json (the multimodal form with `text_config`, or the text form)."""
        model_type = config.get("model_type", "")
        text = config.get("text_config") if model_type == "qwen3_5" else config
        if model_type not in ("qwen3_5", "qwen3_5_text") or not isinstance(text, dict):
            raise ShadowInputError(
                f"not a Qwen3.5 config (model_type {model_type!r}); expected 'qwen3_5' or 'qwen3_5_text'"
            )
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        try:
            return cls(
                hidden_size=text["hidden_size"],
                num_hidden_layers=text["num_hidden_layers"],
                intermediate_size=text["intermediate_size"],
                num_attention_heads=text["num_attention_heads"],
                num_key_value_heads=text["num_key_value_heads"],
                head_dim=text.get("head_dim", 256),
                linear_num_key_heads=text["linear_num_key_heads"],
                linear_num_value_heads=text["linear_num_value_heads"],
                linear_key_head_dim=text["linear_key_head_dim"],
                linear_value_head_dim=text["linear_value_head_dim"],
                linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
                vocab_size=text.get("vocab_size", QWEN35_VOCAB),
                rms_norm_eps=text.get("rms_norm_eps", 1e-6),
                rope_theta=rope.get("rope_theta", text.get("rope_theta", 1e7)),
                partial_rotary_factor=rope.get(
                    "partial_rotary_factor", text.get("partial_rotary_factor", 0.25)
                ),
                mrope_section=tuple(rope.get("mrope_section", (11, 11, 10))),
                tie_word_embeddings=config.get(
                    "tie_word_embeddings", text.get("tie_word_embeddings", True)
                ),
                layer_types=tuple(text.get("layer_types") or ()),
                full_attention_interval=text.get("full_attention_interval", 4),
                eos_token_id=_first(text.get("eos_token_id", config.get("eos_token_id", 248046))),
            )
        except KeyError as missing:
            raise ShadowInputError(f"Qwen3.5 config lacks {missing}") from None


def _first(value) -> int:
    return value[0] if isinstance(value, list) else int(value)


PRESETS: dict[str, ModelConfig] = {
    # a few layers, for CPU tests: 3 GDN layers and 1 attention layer, GQA in both kinds
    "tiny": ModelConfig(
        hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16,
        mrope_section=(2, 1, 1),
    ),
    "qwen3.5-0.8b": ModelConfig(
        hidden_size=1024, num_hidden_layers=24, intermediate_size=3584,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128,
    ),
    "qwen3.5-2b": ModelConfig(
        hidden_size=2048, num_hidden_layers=24, intermediate_size=6144,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128,
    ),
    "qwen3.5-4b": ModelConfig(
        hidden_size=2560, num_hidden_layers=32, intermediate_size=9216,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128,
    ),
}
