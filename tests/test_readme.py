"""The README's library example runs as written (tiny, random weights) and leaves the session as a
fresh prefill of its committed ids would."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_library_example_runs_and_the_session_stays_exact(shadow_cache):
    text = README.read_text(encoding="utf-8")
    section = text.split("## As a library", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    s, reader, probs = scope["s"], scope["reader"], scope["probs"]
    assert s.committed > 0 and s.committed % reader.grid == 0 and len(s.ids) > s.committed
    assert probs.shape == (2,) and abs(float(probs.sum()) - 1) < 1e-5 and isinstance(scope["summary"], str)
    fresh = reader.prefill(s.ids[: s.committed])
    assert all(torch.equal(a, b) for a, b in zip(s.state.tensors().values(), fresh.tensors().values()))
