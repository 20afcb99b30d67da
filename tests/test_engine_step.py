"""`experiments/engine_step.py` against a real llama-server (the CPU build): every arm measured, the
logprob arms' ids the same (greedy: asking for ids after sampling, or sampling on the backend, gives
the same ids), no stream short of the engine's count."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import shared_file
from llama_server import require_binary

pytestmark = pytest.mark.slow  # real servers, engines or clients: `pytest -m 'not slow'` leaves them out

ROOT = Path(__file__).resolve().parents[1]


def test_every_arm_decodes_the_same_ids_at_once_on_a_real_llama_server(tmp_path):
    exe, template = require_binary(), shared_file("templates", "qwen3.5.jinja")
    sys.path.insert(0, str(ROOT / "experiments"))
    import engine_step

    out = tmp_path / "step.json"
    doc = engine_step.main(["--template", str(template), "--llama-server", str(exe), "--slots", "2",
                            "--prompt", "32", "--tokens", "12", "--repeats", "1", "--out", str(out)])
    assert out.read_text().strip()
    arms = doc["arms"]
    assert list(arms) == ["none", "logprobs", "post-sampling", "backend"]
    for arm in arms.values():
        assert arm["tok_s"] > 0 and arm["ms_per_token"] > 0 and arm["streams"] == 2 and arm["short_streams"] == 0
        assert arm["gpu_busy_pct"] is None  # no nvidia-smi on a CPU machine: no figure rather than a wrong one
    assert arms["logprobs"]["same_ids_as_first_logprob_arm"] is None  # the first: what the others are held to
    assert arms["post-sampling"]["same_ids_as_first_logprob_arm"] is True
    assert arms["backend"]["same_ids_as_first_logprob_arm"] is True
