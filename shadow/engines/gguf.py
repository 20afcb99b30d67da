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


def random_weights(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """f16 weights of random sign and mantissa, magnitude in [1/64, 1/32) (RMS about 0.024), drawn as
    random bits: 20x or more faster than a normal draw, so that a GGUF of tens of GB is written in
    about as long as the disk takes."""
    count = int(np.prod(shape))
    bits = rng.bit_generator.random_raw((count + 3) // 4).view(np.uint16)[:count].reshape(shape)
    bits &= 0x83FF  # the sign and the mantissa
    bits |= 0x2400  # exponent 9: 2**-6
    return bits.view(np.float16)


def write_gguf(path: Path | str, chat_template: str, *, seed: int = 0, hidden: int = 128, layers: int = 2,
               heads: int = 4, kv_heads: int = 2, intermediate: int = 256, rows: int = VOCAB_ROWS,
               context: int = 262_144, rope_theta: float = 1e7, add_bos: bool = False) -> Path:
    """Write a random-weight `qwen2` GGUF with the Qwen3.5 vocabulary and `chat_template` embedded
    (`tokenizer.chat_template`); eos `<|im_end|>`, pad and bos `<|endoftext|>`, no BOS added
    (`add_bos`: a vocabulary that adds it, as Llama's and Gemma's do).
    Weights are f16 (`random_weights`; norms f32), seeded: the same arguments give the same bytes.
    Embeddings are tied (no `output.weight`). Tensors are written one at a time, so memory stays
    at the largest one. Returns the path (about 70 MB at the defaults, mostly the embedding)."""
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
    tensors = [("token_embd.weight", (rows, hidden), np.float16), ("output_norm.weight", (hidden,), np.float32)]
    for i in range(layers):
        kv = kv_heads * head_dim
        tensors += [(f"blk.{i}.attn_norm.weight", (hidden,), np.float32), (f"blk.{i}.attn_q.weight", (hidden, hidden), np.float16),
                    (f"blk.{i}.attn_k.weight", (kv, hidden), np.float16), (f"blk.{i}.attn_v.weight", (kv, hidden), np.float16),
                    (f"blk.{i}.attn_q.bias", (hidden,), np.float32), (f"blk.{i}.attn_k.bias", (kv,), np.float32),
                    (f"blk.{i}.attn_v.bias", (kv,), np.float32), (f"blk.{i}.attn_output.weight", (hidden, hidden), np.float16),
                    (f"blk.{i}.ffn_norm.weight", (hidden,), np.float32),
                    (f"blk.{i}.ffn_gate.weight", (intermediate, hidden), np.float16),
                    (f"blk.{i}.ffn_up.weight", (intermediate, hidden), np.float16),
                    (f"blk.{i}.ffn_down.weight", (hidden, intermediate), np.float16)]
    for name, shape, dtype in tensors:  # numpy (out, in) is ggml's {in, out}
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, dtype in tensors:  # one tensor in memory at a time
        if dtype is np.float16:
            w.write_tensor_data(random_weights(rng, shape))
        elif name.endswith(".bias"):
            w.write_tensor_data(np.zeros(shape, dtype=np.float32))
        else:
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
    w.close()
    return path
