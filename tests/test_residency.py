"""The resident cap's rules without tensors: a session's bytes from the model's shapes equal what
its real state holds, and a settle's plan leaves the least recently used first."""

from __future__ import annotations

import random

import pytest
import torch

from shadow.core.reader import open_reader
from shadow.core.residency import Settle, StateSize
from shadow.core.sessionfile import file_bytes
from shadow.core.store import session_bytes
from shadow.model.config import PRESETS
from shadow.model.state import ModelState


def test_a_read_sessions_bytes_are_its_shapes(tiny):
    _, reader = open_reader("tiny", grid=512)
    size = StateSize.of(reader.model.config, torch.finfo(reader.model.dtype).bits // 8)
    rng = random.Random(1)
    s = reader.new_session("s")
    ids, peak = [], 0
    for _ in range(4):
        ids += [rng.randrange(1000, 100_000) for _ in range(rng.randrange(300, 1500))]
        reader.feed_prompt(s, ids)
        reader.advance(s)
        peak = max(peak, s.committed)
        assert session_bytes(s) == size.resident(size.capacity(peak), len(s.checkpoints))
        assert file_bytes(s) == size.file(s.committed, len(s.ids), len(s.checkpoints))
    assert s.checkpoints  # checkpoints counted


@pytest.mark.parametrize("preset", ["qwen3.5-0.8b", "qwen3.5-4b"])
def test_the_sizes_of_a_real_shape_are_its_states(preset):
    """On the meta device (no memory): a 58k-token 0.8B session with six checkpoints is 0.88 GiB."""
    config = PRESETS[preset]
    state = ModelState(config, torch.bfloat16, "meta")
    for layer in state.attention:
        layer.reserve(57_856)
    size = StateSize.of(config, 2)
    assert state.allocated_bytes() == size.resident(size.capacity(57_856), 0)
    assert size.checkpoint == state.snapshot().nbytes()
    if preset == "qwen3.5-0.8b":
        assert size.resident(size.capacity(57_856), 6) / 2**30 == pytest.approx(0.88, abs=0.005)


def test_a_settle_moves_out_the_least_recently_used_until_the_rest_fit():
    plan = Settle([("a", 5), ("b", 4), ("keep", 9), ("c", 3), ("d", 1)], cap=10, keep="keep", skip={"b"})
    out = []
    for name, size in plan:
        out.append(name)
        if name != "c":  # c's write fails: it stays, and the total with it
            plan.left(size)
    assert out == ["a", "c", "d"] and plan.total == 16
    assert list(Settle([("a", 5)], cap=5)) == []




def test_the_default_cap_is_stated_per_mode_and_an_embedded_gpu_shadow_sizes_its_own():
    from shadow.core.residency import CAP_GIB, GIB, embedded_cap_gib
    from shadow.server.settings import StoreSettings

    default, told = StoreSettings(), StoreSettings(cap_gib=2.5)
    assert default.cap_for("cuda", proxy=True) == CAP_GIB == 4.0  # beside an engine: the stated default
    assert default.cap_for("cpu", proxy=False) == default.cap_for("cpu", proxy=True) == 4.0  # no device memory to size from
    assert told.cap_for("cuda", proxy=False) == told.cap_for("cpu", proxy=True) == 2.5  # --cap-gib wins everywhere
    with pytest.raises(ValueError):
        default.cap_for("cuda", proxy=False)  # sized once the generator is loaded
    # 0.8 of the free memory the generator's requests and the prefix cache leave, less 1 GiB; at least 0.5 GiB
    assert embedded_cap_gib(40 * GIB, 6 * GIB, 2 * GIB) == pytest.approx(0.8 * 32 - 1)
    assert embedded_cap_gib(4 * GIB, 6 * GIB) == 0.5
