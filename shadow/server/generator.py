"""The embedded generator: a Qwen3.5 checkpoint answering chat requests with the project's own
forward, greedy (on the service's device thread, in steps: `steps`). Between two decode rounds
the caller may run the shadow's share; between any two steps, another request's."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from shadow.model.qwen35 import Qwen35
from shadow.model.runtime import forward_for

PREFILL_CHUNK = 512  # prompt rows per forward, so attention memory stays bounded


class Generator:
    def __init__(self, model: Qwen35, forward=None):
        self.model = model
        self.forward = forward or model

    @classmethod
    def on(cls, model: Qwen35) -> Generator:
        """A generator whose prefill chunks and decode steps replay CUDA graphs on a GPU (as an
        engine's would); the plain forward elsewhere."""
        return cls(model, forward_for(model, {PREFILL_CHUNK, 1}))

    def generate(self, prompt: Sequence[int], max_tokens: int, stop: Sequence[int] = ()) -> Iterator[int]:
        """Greedy tokens after `prompt`, one per decode round, ending at a stop id (yielded) or max_tokens."""
        return (token for token in self.steps(prompt, max_tokens, stop) if token is not None)

    def steps(self, prompt: Sequence[int], max_tokens: int, stop: Sequence[int] = ()) -> Iterator[int | None]:
        """`generate`, one step at a time: None after each prefill chunk but the last, then the
        tokens; the caller may stop or pause between any two steps (another request's round can
        run between the chunks of a long prefill). Each token but the last is yielded with the
        next round already launched on the device (queued behind it: whatever the caller runs on
        the same device; a caller that times device work synchronises first)."""
        state = self.model.new_state()
        hidden = None
        for lo in range(0, len(prompt), PREFILL_CHUNK):
            if lo:
                yield None
            ids = torch.tensor(list(prompt[lo : lo + PREFILL_CHUNK]), device=self.model.device)
            hidden = self.forward(ids, state)
        for n in range(max_tokens):
            token = int(self.model.logits(hidden[-1:])[0].argmax())
            if token in stop or n + 1 == max_tokens:
                yield token
                return
            # the next round is launched before the token is handed out: the caller's work between
            # two rounds (streaming, the shadow's bookkeeping) runs while the device computes it
            hidden = self.forward(torch.tensor([token], device=self.model.device), state)
            yield token
