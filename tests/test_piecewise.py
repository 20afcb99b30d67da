"""The piecewise forward (what CUDA graphs capture) gives the plain forward's bits; on CPU, eagerly."""

from __future__ import annotations

import torch

from shadow.model.piecewise import PiecewiseForward
from shadow.reader import Reader
from shadow.verify import compare_states


def test_pieces_equal_the_plain_forward_bit_for_bit(tiny):
    model = tiny.model
    pieces = PiecewiseForward(model, sizes={64}, graphs=False)
    ids = torch.randint(0, 248044, (192,), generator=torch.Generator().manual_seed(0))
    plain, split = model.new_state(), model.new_state()
    for lo in range(0, 192, 64):
        a = model(ids[lo : lo + 64], plain)
        b = pieces(ids[lo : lo + 64], split)
        assert torch.equal(a, b)
    _, mismatched, _ = compare_states(plain, split)
    assert mismatched == []


def test_reader_with_pieces_pads_fork_reads_and_stays_exact(tiny):
    """With graphed sizes, a question is read in padded pieces; answers match the plain reader
    closely and the session's state is untouched."""
    plain = Reader(tiny.model, 64)
    pieced = Reader(tiny.model, 64, forward=PiecewiseForward(tiny.model, sizes={64, 128}, graphs=False))
    ids = torch.randint(0, 248044, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    sessions = []
    for reader in (plain, pieced):
        s = reader.new_session("a")
        reader.feed_prompt(s, ids)
        reader.advance(s)
        sessions.append(s)
    _, mismatched, _ = compare_states(sessions[0].state, sessions[1].state)
    assert mismatched == []
    question = ids[:37]
    p = plain.ask(sessions[0], question, [11, 12, 13])
    q = pieced.ask(sessions[1], question, [11, 12, 13])
    assert torch.allclose(p, q, atol=1e-5)
    assert pieced.decode(sessions[1], question, 4) == plain.decode(sessions[0], question, 4)
