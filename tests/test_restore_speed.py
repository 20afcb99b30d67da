"""experiments/restore_speed.py runs on the CPU (a small session of the tiny preset), checks every
restore bit for bit, and ends with one JSON line (the GPU figures come from the same script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_restore_speed_runs_every_arm_on_the_cpu(tmp_path, shadow_cache):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SHADOW_CACHE": str(shadow_cache)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "restore_speed.py"), "--device", "cpu", "--preset", "tiny",
         "--tokens", "3000", "--checkpoints", "3", "--runs", "2", "--reread-runs", "1", "--folder", str(tmp_path / "f")],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["bit_equal"] and out["weights"] == "random" and out["committed"] == 2560
    assert set(out["arms"]) == {"host", "format3", "format3-buffered"}
    assert out["host_tier"]["bytes"] > 0 and out["host_tier"]["pinned_copy"] is None  # no GPU: no pinned copy
    assert all(len(a["restore_runs"]) == 2 and len(a["spill_runs"]) == 2 for a in out["arms"].values())
    assert out["reread_tokens"] == 3000 and out["reread_s"] > 0
    assert out["page_cache_resident_max"] in (None, 0.0) or out["page_cache_resident_max"] < 1
