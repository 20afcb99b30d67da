"""A random-weight GGUF for llama.cpp that carries the real Qwen3.5 vocabulary and a chat template,
so that a real `llama-server` reads, renders and tokenizes exactly as it would for a Qwen3.5 model.

The weights are a small `qwen2` transformer (the architecture only has to load and run; answer
quality is not the point). The vocabulary is written as llama.cpp's converter writes a Qwen3.5
checkpoint's: model `gpt2` (byte-level BPE), pre-tokenizer `qwen35`, the 248,044 ranks as NORMAL
tokens, the 33 added tokens from id 248,044 (CONTROL, or USER_DEFINED for the added tokens that
are text, see `token_type`), and `[PAD{i}]` UNUSED tokens up to the model's 248,320 embedding rows
(llama.cpp takes the vocabulary size from the token list and wants the embedding to match).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shadow.text.vocab import TEXT_SPECIALS, Vocabulary, qwen_vocabulary

VOCAB_ROWS = 248_320
EOS = "<|im_end|>"
PAD = "<|endoftext|>"


def token_type(text: str, special: bool):
    """The GGUF token type llama.cpp's converter (`get_vocab_base`) gives a token: an added token is
    CONTROL when the tokenizer marks it special or it looks special (`<|...|>`), else USER_DEFINED
    (matched in text even without parse_special, and kept in output text). So `<think>`,
    `<tool_call>`, `<tool_response>` (and their closers) are USER_DEFINED; `<|im_end|>` and, as in a
    real conversion, the text-but-`<|...|>` FIM tokens are CONTROL."""
    from gguf import TokenType

    if not special:
        return TokenType.NORMAL
    if text not in TEXT_SPECIALS or (text.startswith("<|") and text.endswith("|>")):
        return TokenType.CONTROL
    return TokenType.USER_DEFINED


def vocabulary_lists(vocab: Vocabulary, rows: int = VOCAB_ROWS) -> tuple[list[str], list[int]]:
    """Token strings and types for ids 0..rows-1 (rows past the vocabulary are `[PAD{i}]`, UNUSED)."""
    from gguf import TokenType

    if rows < len(vocab.tokens):
        raise ValueError(f"rows {rows} < vocabulary size {len(vocab.tokens)}")
    tokens = list(vocab.tokens) + [f"[PAD{i}]" for i in range(len(vocab.tokens), rows)]
    types = [int(token_type(t, i in vocab.specials)) for i, t in enumerate(vocab.tokens)]
    types += [int(TokenType.UNUSED)] * (rows - len(vocab.tokens))
    return tokens, types


def write_gguf(path: Path | str, chat_template: str, *, seed: int = 0, hidden: int = 128, layers: int = 2,
               heads: int = 4, kv_heads: int = 2, intermediate: int = 256, rows: int = VOCAB_ROWS,
               context: int = 262_144, rope_theta: float = 1e7, add_bos: bool = False) -> Path:
    """Write a random-weight `qwen2` GGUF with the Qwen3.5 vocabulary and `chat_template` embedded
    (`tokenizer.chat_template`); eos `<|im_end|>`, pad and bos `<|endoftext|>`, no BOS added
    (`add_bos`: a vocabulary that adds it, as Llama's and Gemma's do).
    Weights are f16 (norms f32), seeded: the same arguments give the same bytes. Embeddings are tied
    (no `output.weight`). Returns the path (about 70 MB at the defaults, mostly the embedding)."""
    import gguf

    if hidden % heads or heads % kv_heads:
        raise ValueError("hidden must divide by heads, heads by kv_heads")
    vocab = qwen_vocabulary()
    tokens, types = vocabulary_lists(vocab, rows)
    ids = {t: i for i, t in vocab.specials.items()}
    head_dim = hidden // heads
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("shadow random-weight qwen2 (Qwen3.5 vocabulary)")
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(vocab.merges))
    w.add_eos_token_id(ids[EOS])
    w.add_bos_token_id(ids[PAD])
    w.add_pad_token_id(ids[PAD])
    w.add_add_bos_token(add_bos)
    w.add_chat_template(chat_template)

    rng = np.random.default_rng(seed)

    def dense(rows_: int, cols: int) -> np.ndarray:  # numpy (out, in) is ggml's {in, out}
        return (rng.standard_normal((rows_, cols), dtype=np.float32) * 0.02).astype(np.float16)

    w.add_tensor("token_embd.weight", dense(rows, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", dense(hidden, hidden))
        w.add_tensor(f"blk.{i}.attn_k.weight", dense(kv_heads * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_v.weight", dense(kv_heads * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_q.bias", np.zeros(hidden, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_k.bias", np.zeros(kv_heads * head_dim, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_v.bias", np.zeros(kv_heads * head_dim, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_output.weight", dense(hidden, hidden))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", dense(intermediate, hidden))
        w.add_tensor(f"blk.{i}.ffn_up.weight", dense(intermediate, hidden))
        w.add_tensor(f"blk.{i}.ffn_down.weight", dense(hidden, intermediate))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
