"""The exactness contract of the reader: grid, pending tail, rollback, checkpoints, forks."""

from __future__ import annotations

import pytest
import torch

from shadow.errors import ShadowInputError
from shadow.core.reader import MAX_CHECKPOINTS, Reader
from shadow.model.state import KV_STEP
from shadow.offline.verify import compare_states

GRID = 64


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 248044, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_exact(reader: Reader, session) -> None:
    """The session's state equals a fresh prefill of its committed ids, every tensor bit for bit."""
    fresh = reader.prefill(session.ids[: session.committed])
    compared, mismatched, _ = compare_states(session.state, fresh)
    assert compared > 0 and mismatched == []


def snapshot(session) -> dict:
    return {k: v.clone() for k, v in session.state.tensors().items()} | {
        "length": session.committed, "ids": list(session.ids), "checkpoints": len(session.checkpoints)
    }


def assert_unchanged(before: dict, session) -> None:
    after = snapshot(session)
    assert before.keys() == after.keys()
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, after[key]), key
        else:
            assert value == after[key], key


@pytest.fixture()
def reader(tiny):
    return Reader(tiny.model, GRID)


def test_commits_whole_chunks_only_and_keeps_pending_tail(reader):
    s = reader.new_session("a")
    reader.feed_prompt(s, ids(200, 0))
    assert reader.advance(s) == 3
    assert (s.committed, s.pending) == (192, 8)
    reader.feed_output(s, ids(60, 1))
    reader.advance(s)
    assert (s.committed, s.pending) == (256, 4)
    assert_exact(reader, s)


def test_turns_with_growing_prompts_stay_exact(reader):
    s = reader.new_session("a")
    history: list[int] = []
    for turn in range(4):
        history = history + ids(90 + 17 * turn, 10 + turn)
        reader.feed_prompt(s, history)
        reader.advance(s)
        out = ids(33, 20 + turn)
        reader.feed_output(s, out)
        reader.advance(s)
        history = history + out
    assert s.rollbacks == 0
    assert_exact(reader, s)


def test_divergence_rolls_back_to_checkpoint_and_rereads(reader):
    s = reader.new_session("a")
    prompt = ids(300, 0)  # prompt end 300: checkpoint at 256
    reader.feed_prompt(s, prompt)
    reader.advance(s)
    reader.feed_output(s, ids(200, 1))  # 500 ids: committed 448
    reader.advance(s)
    assert s.committed == 448 and [c.position for c in s.checkpoints] == [256]
    # the next prompt re-renders the answer: it differs from id 300 on
    feed = reader.feed_prompt(s, prompt + ids(400, 2))
    assert (feed.first_diff, feed.rolled_back_to, feed.reread) == (300, 256, 192)
    assert (s.rollbacks, s.ids_reread, s.committed) == (1, 192, 256)
    reader.advance(s)
    assert s.committed == 640
    assert_exact(reader, s)


def test_divergence_without_checkpoint_starts_over(reader):
    s = reader.new_session("a")
    reader.feed_prompt(s, ids(40, 0))  # prompt end below the first grid line: no checkpoint
    reader.feed_output(s, ids(200, 1))
    reader.advance(s)
    assert s.committed == 192 and s.checkpoints == []
    reader.feed_prompt(s, ids(40, 0) + ids(100, 3))
    assert (s.committed, s.rollbacks, s.ids_reread) == (0, 1, 192)
    reader.advance(s)
    assert_exact(reader, s)


def test_divergence_in_pending_tail_needs_no_rollback(reader):
    s = reader.new_session("a")
    reader.feed_prompt(s, ids(100, 0))
    reader.advance(s)
    feed = reader.feed_prompt(s, ids(100, 0)[:80] + ids(50, 5))
    assert feed.first_diff == 80 and feed.rolled_back_to is None and s.rollbacks == 0
    reader.advance(s)
    assert_exact(reader, s)


def test_at_most_six_checkpoints_newest_kept(reader):
    s = reader.new_session("a")
    history: list[int] = []
    for turn in range(MAX_CHECKPOINTS + 3):
        history = history + ids(70, turn)
        reader.feed_prompt(s, history)
        reader.advance(s)
    positions = [c.position for c in s.checkpoints]
    assert len(positions) == MAX_CHECKPOINTS
    assert positions == sorted(positions) and positions[-1] == len(history) // GRID * GRID


def test_ask_is_a_fork_that_changes_nothing(reader):
    s = reader.new_session("a")
    reader.feed_prompt(s, ids(230, 0))
    reader.advance(s)
    before = snapshot(s)
    probs = reader.ask(s, ids(29, 1), [32, 33, 34])
    assert probs.shape == (3,) and abs(probs.sum().item() - 1) < 1e-6
    assert_unchanged(before, s)
    again = reader.ask(s, ids(29, 1), [32, 33, 34])
    assert torch.equal(probs, again)
    reader.feed_output(s, ids(100, 2))
    reader.advance(s)
    assert_exact(reader, s)


def test_decode_is_a_fork_and_greedy(reader):
    s = reader.new_session("a")
    reader.feed_prompt(s, ids(150, 0))
    reader.advance(s)
    before = snapshot(s)
    prompt = ids(5, 1)
    out = reader.decode(s, prompt, max_new_tokens=6)
    assert len(out) == 6
    assert_unchanged(before, s)
    assert out[0] == int(reader.next_logits(s, prompt).argmax())
    assert reader.decode(s, prompt, max_new_tokens=6) == out
    assert reader.decode(s, prompt, max_new_tokens=6, stop=[out[1]]) == out[:2]


def test_decode_in_steps_is_decode_and_a_fork_closed_early_is_undone(reader):
    s = reader.new_session("a")
    reader.feed_prompt(s, ids(150, 0))
    reader.advance(s)
    before, prompt = snapshot(s), ids(5, 1)
    steps = reader.decode_steps(s, prompt, max_new_tokens=6)
    yielded = 0
    while True:
        try:
            next(steps)
            yielded += 1
        except StopIteration as done:
            out = done.value
            break
    assert yielded == 6 and out == reader.decode(s, prompt, max_new_tokens=6)  # the prefill, then a token a step
    assert_unchanged(before, s)
    early = reader.decode_steps(s, prompt, max_new_tokens=6)
    next(early), next(early)  # the fork is open on the session's state here: its rows are not read
    assert s.state.length > before["length"] == s.committed == s.state.fork_base
    assert s.pending == len(s.ids) - before["length"]
    with pytest.raises(ValueError, match="fork open"):  # no read of the session meanwhile
        reader.advance(s)
    with pytest.raises(ValueError, match="fork open"):
        reader.advance_batch([s, reader.new_session("b")])
    early.close()
    assert_unchanged(before, s)
    assert s.state.fork_base is None


def test_a_fork_inside_a_fork_keeps_the_outer_base(reader):
    s = reader.new_session("a")
    reader.feed_prompt(s, ids(150, 0))
    reader.advance(s)
    base = s.committed
    with reader.fork(s.state) as state:
        reader._fork_read(ids(7, 3), state)  # the outer fork's own rows
        grown = state.length
        with reader.fork(state) as inner:
            reader._fork_read(ids(5, 2), inner)
            assert inner.length == grown + 5 and inner.fork_base == s.committed == base
        assert state.length == grown > base and state.fork_base == s.committed == base
    assert s.state.fork_base is None and s.committed == s.state.length == base


def test_kv_capacity_grows_in_steps_and_never_changes_a_result(reader):
    s = reader.new_session("a")
    reader.feed_prompt(s, ids(KV_STEP + 2 * GRID, 0))
    reader.advance(s)
    assert s.state.attention[0].capacity == 2 * KV_STEP
    roomy = reader.model.new_state()
    for layer in roomy.attention:
        layer.reserve(4 * KV_STEP)
    for start in range(0, s.committed, GRID):
        reader.model(torch.tensor(s.ids[start : start + GRID]), roomy)
    compared, mismatched, _ = compare_states(s.state, roomy)
    assert mismatched == []


@pytest.mark.parametrize(
    "action",
    [
        lambda r, s: r.feed_prompt(s, [1, 2, 248320]),
        lambda r, s: r.feed_output(s, [-1]),
        lambda r, s: r.ask(s, [1, 2], []),
        lambda r, s: r.ask(s, [1, 2], [5, 5]),
        lambda r, s: r.ask(s, [], [5, 6]),
        lambda r, s: r.ask(s, [1, 2], [10**9]),
    ],
    ids=["prompt-id-out-of-vocab", "output-negative-id", "no-choices", "repeated-choice", "empty-question", "choice-out-of-vocab"],
)
def test_bad_input_is_refused_and_changes_nothing(reader, action):
    s = reader.new_session("a")
    reader.feed_prompt(s, ids(150, 0))
    reader.advance(s)
    before = snapshot(s)
    with pytest.raises(ShadowInputError):
        action(reader, s)
    assert_unchanged(before, s)


@pytest.mark.parametrize("grid", [0, -64, 100, 32])
def test_grid_must_be_positive_multiple_of_64(tiny, grid):
    with pytest.raises(ShadowInputError, match="multiple of 64"):
        Reader(tiny.model, grid)


def test_compare_states_sees_a_one_ulp_change(reader):
    """The bit-for-bit check can fail: one float nudged by one ulp is reported by name and kind."""
    s = reader.new_session("a")
    reader.feed_prompt(s, ids(128, 0))
    reader.advance(s)
    fresh = reader.prefill(s.ids)
    recurrent = fresh.delta[0].recurrent
    recurrent.view(-1)[7] = torch.nextafter(recurrent.view(-1)[7], torch.tensor(1e9))
    _, mismatched, diffs = compare_states(s.state, fresh)
    assert mismatched == ["layers.0.recurrent"] and 0 < diffs["recurrent"] < 1e-6


@pytest.mark.parametrize("a, b, n", [([], [], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2),
                                     ([1, 2, 3], [1, 9, 3], 1), ([5], [6], 0), (list(range(1000)), list(range(999)) + [0], 999)])
def test_common_prefix(a, b, n):
    from shadow.core.reader import common_prefix

    assert common_prefix(a, b) == n == common_prefix(b, a)


def test_the_replays_modelled_sessions_follow_the_readers_rules(reader):
    """The replay's sessions (`offline.modelled`, counts without tensors) and the reader's go by the
    same grid rules (`core.driving`): after the same prompts (some rolling back), output and
    reads, the same read position, marks and checkpoint positions, and the same rollbacks."""
    import random

    from shadow.offline.costs import ChunkTable, CostTable
    from shadow.offline.modelled import ModelledStore

    rng = random.Random(3)
    held = ModelledStore(GRID, CostTable(ChunkTable.flat(1.0, GRID)),
                        max_checkpoints=reader.max_checkpoints)
    s, (h, _) = reader.new_session("s"), held.get("s")
    rollbacks, to_checkpoint = 0, 0
    for turn in range(24):
        keep = rng.randrange(len(s.ids) + 1) if rng.random() < 0.3 else len(s.ids)
        fresh = ids(rng.randrange(1, 300), seed=100 + turn)
        if keep < len(s.ids):
            fresh[0] = (s.ids[keep] + 1) % 248044  # differs right at `keep`
        prompt = s.ids[:keep] + fresh
        feed = reader.feed_prompt(s, prompt)
        modelled = held.feed_prompt(h, len(prompt), keep)
        assert modelled == feed
        rollbacks += feed.rolled_back_to is not None
        to_checkpoint += bool(feed.rolled_back_to)
        output = rng.randrange(0, 80)
        reader.feed_output(s, ids(output, seed=200 + turn))
        h.ids += output
        for _ in range(min(rng.randrange(0, 12), (len(s.ids) - s.committed) // GRID)):
            reader.advance(s, max_chunks=1)
            held.advance(h)
        assert (h.committed, h.ids, h.marks, h.checkpoints) == (s.committed, len(s.ids), s.marks, s.checkpoint_positions)
    assert rollbacks >= 3 and to_checkpoint >= 1, (rollbacks, to_checkpoint)  # to the start and to a checkpoint
    assert_exact(reader, s)
