"""The embedded generator: its tokens are greedy decoding's, round by round, and each token but the
last is handed out with the next round already launched (the caller's work between two rounds runs
while the device computes)."""

from __future__ import annotations

import torch

from shadow.server.generator import PREFILL_CHUNK, Generator

PROMPT = [(7 * i + 3) % 200 + 5 for i in range(PREFILL_CHUNK + 37)]  # two prefill chunks


def greedy_reference(model, prompt, max_tokens, stop=()):
    """Plain greedy decoding: prefill in the generator's chunks, then one forward per token, the
    next forward only after the token is known."""
    state = model.new_state()
    for lo in range(0, len(prompt), PREFILL_CHUNK):
        hidden = model(torch.tensor(prompt[lo : lo + PREFILL_CHUNK]), state)
    out = []
    while len(out) < max_tokens:
        token = int(model.logits(hidden[-1:])[0].argmax())
        out.append(token)
        if token in stop:
            break
        hidden = model(torch.tensor([token]), state)
    return out


class Counting:
    """The model's forward, counting its calls and the rows they read."""

    def __init__(self, model):
        self.model, self.calls, self.rows = model, 0, 0

    def __call__(self, ids, state):
        self.calls += 1
        self.rows += ids.shape[0]
        return self.model(ids, state)


def test_generated_tokens_are_greedy_decodings(tiny):
    model = tiny.model
    assert list(Generator(model).generate(PROMPT, 12)) == greedy_reference(model, PROMPT, 12)


def test_each_token_but_the_last_comes_with_the_next_round_launched(tiny):
    forward = Counting(tiny.model)
    steps = Generator(tiny.model, forward).steps(PROMPT, 5)
    assert next(steps) is None and forward.calls == 1  # between the two prefill chunks
    for k in range(5):
        token = next(steps)
        assert isinstance(token, int)
        # 2 prefill chunks, then one decode round per token handed out, none after the last
        assert forward.calls == 2 + min(k + 1, 4)
    assert next(steps, None) is None and forward.calls == 6 and forward.rows == len(PROMPT) + 4


def test_a_stop_token_launches_no_round_after_it(tiny):
    model = tiny.model
    first = greedy_reference(model, PROMPT, 3)
    stop = first[1]
    forward = Counting(model)
    out = list(Generator(model, forward).generate(PROMPT, 10, stop=[stop]))
    assert out == first[: first.index(stop) + 1] == greedy_reference(model, PROMPT, 10, stop=[stop])
    assert forward.rows == len(PROMPT) + len(out) - 1  # no round read after the stop token
