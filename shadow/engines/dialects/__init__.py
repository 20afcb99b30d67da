"""Engine dialects: how each serving engine is asked for the ids it read and wrote, where they come
back, and what the proxy strips again before the client sees the response.

| dialect | prompt ids | output ids |
|---|---|---|
| `vllm` | `prompt_token_ids` (asked with `return_token_ids`) | `choices[].token_ids` |
| `sglang` | `prompt_token_ids` / `sglext` on non-streamed chat and on completions; else the template | the same, else logprobs, else not read |
| `llamacpp` | the engine's own `/apply-template` and `/tokenize` | the `id` beside each logprob (asked with `logprobs`) |
| `transformers` | the big model's template over the messages as `transformers serve` passes them | not read (it shows no ids) |
| `openai` | the big model's template over the messages as the request carries them | logprobs' bytes, else not read |

An output is read only as the engine's own ids (its id list, or its logprob tokens): text is never
re-tokenised (an equal count is not equal ids), and an output the engine shows no ids for is not
read; the next prompt brings the reply as the engine renders it. Every dialect asks for `usage`
where the engine accepts the request field, and strips what it
added (fields and the usage chunk) when the client did not ask for it. A dialect is chosen at
start by `probe` (or `--engine`); the choice and its id sources are said once.
"""

from shadow.engines.dialects.base import Asked, Dialect, Prompt, as_carried, normalise_message, post
from shadow.engines.dialects.choice import DIALECTS, ENGINES, EngineChoice, engine_root, probe
from shadow.engines.dialects.engines import VLLM, LlamaCpp, SGLang, Transformers

__all__ = ["Asked", "Dialect", "Prompt", "as_carried", "normalise_message", "post", "DIALECTS", "ENGINES",
           "EngineChoice", "engine_root", "probe", "VLLM", "LlamaCpp", "SGLang", "Transformers"]
