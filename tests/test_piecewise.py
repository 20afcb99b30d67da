"""The piecewise forward (what CUDA graphs capture) gives the plain forward's bits; on CPU, eagerly,
and under an emulation of a graph's replays (the tensors a capture made are the ones replays write)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shadow.model import PRESETS, load_model, write_random_checkpoint
from shadow.model.kernels import reference
from shadow.model.piecewise import PiecewiseForward
from shadow.core.reader import Reader
from shadow.offline.verify import compare_states


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


def _rebuilt(value):
    """The containers of a plan attribute copied, the tensors in them shared."""
    if isinstance(value, dict):
        return {k: _rebuilt(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_rebuilt(v) for v in value)
    return value


def _tensors(value, path=()):
    """(path, tensor) for every tensor inside a plan attribute's containers."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors(v, (*path, k))
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from _tensors(v, (*path, i))


def _bindings(plan) -> dict:
    return {k: _rebuilt(v) for k, v in vars(plan).items() if k != "graphs"}


def _bind(plan, bindings: dict) -> None:
    for k, v in bindings.items():
        setattr(plan, k, _rebuilt(v))


class _EmulatedGraph:
    """A CUDA graph's address semantics on the CPU. A real replay runs no Python: every kernel
    reads and writes the tensors it met at capture, and the plan's attributes keep whatever the
    last capture bound them to. So a replay here binds the plan as its capture found it (the
    inputs it read), runs the piece, writes each new value into the tensor its capture made, and
    binds the plan back as the last capture left it."""

    def __init__(self, forward, plan, piece: int, before: dict, after: dict):
        self.forward, self.plan, self.piece, self.before, self.after = forward, plan, piece, before, after

    def replay(self) -> None:
        last = _bindings(self.plan)
        _bind(self.plan, self.before)
        self.forward._piece(self.plan, self.piece)
        fresh = dict(_tensors(_bindings(self.plan)))
        found_before = dict(_tensors(self.before))
        for path, made in _tensors(self.after):
            if found_before.get(path) is not made:  # a tensor this capture made: the replay writes it
                made.copy_(fresh[path])
        _bind(self.plan, last)


class _EmulatedGraphs(PiecewiseForward):
    def _capture(self, plan) -> None:
        pieces = range(len(self.attention_layers) + 1)
        for _ in range(2):  # warm-up, as the real capture does
            for piece in pieces:
                self._piece(plan, piece)
        graphs = []
        for piece in pieces:
            before = _bindings(plan)
            self._piece(plan, piece)
            graphs.append(_EmulatedGraph(self, plan, piece, before, _bindings(plan)))
        plan.graphs = graphs


@pytest.mark.parametrize("fused", [False, True], ids=["module-steps", "fused-steps"])
def test_graph_replays_hand_each_attention_its_own_pieces_tensors(shadow_cache, tmp_path, fused):
    """Graphed pieces (emulated: the plan keeps the captures' tensors, replays write into them)
    against the same pieces run eagerly, with another row count's graphs replayed in between, on
    eight layers (two attention layers, so three pieces). Fails if the attention between two
    replays reads any tensor but its own piece's, as it did when a plan kept one hand-off slot."""
    layers = ("linear_attention",) * 3 + ("full_attention",)
    config = dataclasses.replace(PRESETS["tiny"], num_hidden_layers=8, layer_types=layers * 2)
    kernels = dataclasses.replace(reference.REFERENCE, name="reference-fused", fused=True) if fused else reference.REFERENCE
    model = load_model(str(write_random_checkpoint(tmp_path / "eight", config)), kernels=kernels).model
    assert len(model.config.attention_layers) == 2
    graphed = _EmulatedGraphs(model, sizes={64, 16}, graphs=True)
    eager = PiecewiseForward(model, sizes={64, 16}, graphs=False)
    ids = torch.randint(0, 248044, (240,), generator=torch.Generator().manual_seed(4))
    a, b = model.new_state(), model.new_state()
    for lo, hi in ((0, 64), (64, 80), (80, 144), (144, 208), (208, 224)):
        assert torch.equal(graphed(ids[lo:hi], a), eager(ids[lo:hi], b)), (lo, hi)
    assert compare_states(a, b)[1] == []


def test_a_reader_on_emulated_graphs_keeps_the_contract_through_turns_rollback_and_forks(shadow_cache, tmp_path):
    """The reader as it runs on a GPU (graphs for the grid and the fork sizes), with the graphs
    emulated, on eight layers: turns, a rollback, an ask and a fork decode, then the session's
    state against a fresh prefill, bit for bit, and the ask against the eager reader's."""
    from shadow.model.runtime import FORK_SIZES

    layers = ("linear_attention",) * 3 + ("full_attention",)
    config = dataclasses.replace(PRESETS["tiny"], num_hidden_layers=8, layer_types=layers * 2)
    model = load_model(str(write_random_checkpoint(tmp_path / "eight", config))).model
    graphed = Reader(model, 64, forward=_EmulatedGraphs(model, sizes={64, *FORK_SIZES}, graphs=True))
    eager = Reader(model, 64, forward=PiecewiseForward(model, sizes={64, *FORK_SIZES}, graphs=False))
    ids = torch.randint(0, 248044, (900,), generator=torch.Generator().manual_seed(7)).tolist()
    sessions = []
    for reader in (graphed, eager):
        s = reader.new_session("a")
        reader.feed_prompt(s, ids[:300])
        reader.advance(s)
        reader.feed_output(s, ids[300:420])
        reader.advance(s)
        reader.feed_prompt(s, ids[:300] + ids[500:900])  # differs at 300: back to a checkpoint
        reader.advance(s)
        sessions.append(s)
    g, e = sessions
    assert g.rollbacks == 1 and g.committed == e.committed
    assert torch.equal(graphed.ask(g, ids[:37], [11, 12, 13]), eager.ask(e, ids[:37], [11, 12, 13]))
    assert graphed.decode(g, ids[:20], 4) == eager.decode(e, ids[:20], 4)
    assert compare_states(g.state, graphed.prefill(g.ids[: g.committed]))[1] == []
    assert compare_states(g.state, e.state)[1] == []


def test_fork_pieces_are_graphed_sizes_that_sum_to_the_length():
    """Any length a fork reads is split into graphed row counts, at most one of each below the grid."""
    from shadow.model.runtime import FORK_SIZES

    class Sized:
        sizes = {512, *FORK_SIZES}

    reader = Reader.__new__(Reader)
    reader.forward = Sized()
    for n in [1, 2, 3, 31, 63, 64, 65, 330, 511, 512, 513, 1023, 1054, 2100]:
        pieces = reader.fork_pieces(n)
        assert sum(pieces) == n and set(pieces) <= Sized.sizes, n
        below = [p for p in pieces if p < 512]
        assert len(below) == len(set(below)), (n, pieces)
    assert reader.fork_cover() == 1023 and sorted(reader.fork_pieces(1023)) == sorted(Sized.sizes)
    reader.forward = object()  # no graphed sizes: one piece
    assert reader.fork_pieces(330) == [330] and reader.fork_cover() == 0


def test_a_fork_decode_reads_only_graphed_row_counts_one_forward_a_step(tiny):
    """A phrase's steps on a pieced reader: every forward is at a graphed row count (none eager),
    one forward between two yields, the session bit-equal afterwards and the ids the plain reader's."""
    from shadow.model.runtime import FORK_SIZES

    sizes = {64, *FORK_SIZES}
    seen: list[int] = []

    class Recording(PiecewiseForward):
        def forward_batch(self, ids, states):
            seen.append(ids.shape[0])
            return super().forward_batch(ids, states)

    plain = Reader(tiny.model, 64)
    pieced = Reader(tiny.model, 64, forward=Recording(tiny.model, sizes=sizes, graphs=False))
    ids = torch.randint(0, 248044, (250,), generator=torch.Generator().manual_seed(3)).tolist()
    sessions = []
    for reader in (plain, pieced):
        s = reader.new_session("a")
        reader.feed_prompt(s, ids)
        reader.advance(s)
        sessions.append(s)
    before = sessions[1].state.snapshot()
    seen.clear()
    steps, yields = pieced.decode_steps(sessions[1], ids[:45], 5), 0
    while True:
        calls = len(seen)
        try:
            next(steps)
        except StopIteration as done:
            out = done.value
            break
        yields += 1
        assert len(seen) - calls == 1  # one forward a step
    pending = 250 - sessions[1].committed + 45  # 58 + 45 = 103: 64 + 32 + 4 + 2 + 1
    assert seen[:4] == [64, 32, 4, 2] and seen[4] == 1 and set(seen) <= sizes
    assert yields == len(pieced.fork_pieces(pending)) + len(out) - 1
    assert out == plain.decode(sessions[0], ids[:45], 5)
    assert compare_states(sessions[1].state, sessions[0].state)[1] == []
    state = sessions[1].state
    assert state.length == before.position
    assert torch.equal(state.arena.conv, before.conv) and torch.equal(state.arena.recurrent, before.recurrent)


def test_eager_plans_are_kept_only_for_the_last_few_lengths(tiny):
    """Ungraphed row counts each get a plan (with a session's GDN state); only the last few stay."""
    from shadow.model.piecewise import EAGER_PLANS

    pieces = PiecewiseForward(tiny.model, sizes={64}, graphs=False)
    state = tiny.model.new_state()
    for t in range(1, 12):
        pieces(torch.zeros(t, dtype=torch.long), state)
    assert len(pieces._plans) == EAGER_PLANS
    assert (1, 11) in pieces._plans and (1, 1) not in pieces._plans
