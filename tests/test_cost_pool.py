"""`experiments/cost_pool.py`: live runs' drift fits of the engine's cost pooled by inverse variance,
on run documents written by hand (windows as the density driver writes them)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import cost_pool  # noqa: E402


def write_run(folder: Path, lost_pct: float, noise: list[float], charged: float = 2.0, charge: str | None = "alone") -> Path:
    """A run of 2 x len(noise) // 2 + 1 windows of 10 s, off, on, ..., off: 1,000 tok/s off, less
    `lost_pct` on, each window moved by its `noise` (%)."""
    rows = []
    for i, n in enumerate(noise):
        on = i % 2 == 1
        rate = 1000 * (1 - (lost_pct / 100 if on else 0)) * (1 + n / 100)
        rows.append({"shadow": "on" if on else "off", "start": 10.0 * i, "end": 10.0 * i + 10, "tok_s": rate,
                     "share_charged_pct": charged if on else 0.0, "share_read_pct": 3 * charged if on else 0.0})
    folder.mkdir(parents=True)
    settings = {"sessions": 30, "hidden": 8192, "layers": 16, "heads": 64, "kv_heads": 1, "model": "qwen3.5-0.8b",
                "share": 0.02, "serve_arg": [f"--share-charge={charge}"] if charge else [], "cost_load": "turns",
                "cost_grow": 1024, "cost_output": 128, "window": 10.0}
    (folder / "live-density.json").write_text(json.dumps({"settings": settings, "engine": {"windows": rows}}))
    return folder


NOISE_A = [0.5, -0.4, 0.9, 0.1, -0.7, 0.3, -0.2, 0.6, -0.5, 0.2, 0.4]
NOISE_B = [1.5, -2.0, 0.7, 2.2, -1.1, 0.4, -1.8, 1.2, 0.3, -0.9, 1.6, -0.6, 0.8]


def test_runs_pool_by_inverse_variance_beside_the_share_charged(tmp_path, capsys):
    a = write_run(tmp_path / "a", 2.0, NOISE_A)
    b = write_run(tmp_path / "b", 1.0, NOISE_B, charged=1.5)
    doc = cost_pool.main([str(a), str(b), "--json"])
    ra, rb = doc["runs"]
    # each run is its own drift fit: the quieter run's error is the smaller and it weighs the more
    assert ra["lost_se_pts"] < rb["lost_se_pts"] and abs(ra["lost_pct"] - 2.0) < 1.0 and abs(rb["lost_pct"] - 1.0) < 3.0
    wa, wb = 1 / ra["lost_se_pts"] ** 2, 1 / rb["lost_se_pts"] ** 2
    assert doc["lost_pct"] == pytest.approx((wa * ra["lost_pct"] + wb * rb["lost_pct"]) / (wa + wb), abs=1e-3)
    assert doc["se_pts"] == pytest.approx(1 / math.sqrt(wa + wb), abs=1e-3) and doc["se_pts"] < ra["lost_se_pts"]
    assert doc["beyond_share_pts"] == pytest.approx(
        (wa * (ra["lost_pct"] - 2.0) + wb * (rb["lost_pct"] - 1.5)) / (wa + wb), abs=2e-3)
    assert doc["n"] == 2 and doc["windows"] == len(NOISE_A) + len(NOISE_B) and doc["differ"] == []
    assert json.loads(capsys.readouterr().out)["n"] == 2  # --json prints the document


def test_runs_of_another_charge_pool_only_when_mixed_and_say_so(tmp_path, capsys):
    a = write_run(tmp_path / "a", 2.0, NOISE_A)
    b = write_run(tmp_path / "b", 2.0, NOISE_B, charge=None)  # a run that did not say: the earlier default, wall
    with pytest.raises(SystemExit) as e:
        cost_pool.main([str(a), str(b)])
    assert e.value.code == 2 and "differ in charge" in capsys.readouterr().err
    doc = cost_pool.main([str(a), str(b), "--mixed"])
    assert doc["differ"] == ["charge"] and [r["settings"]["charge"] for r in doc["runs"]] == ["alone", "wall"]
    assert "mixed: the runs differ in charge" in capsys.readouterr().out


@pytest.mark.parametrize("case", ["missing", "not json", "no engine", "few windows"])
def test_a_run_that_cannot_be_pooled_is_refused_with_one_line(case, tmp_path, capsys):
    good = write_run(tmp_path / "good", 2.0, NOISE_A)
    bad = tmp_path / "bad"
    if case == "few windows":
        write_run(bad, 2.0, NOISE_A[:5])
    elif case != "missing":
        bad.mkdir()
        (bad / "live-density.json").write_text("{" if case == "not json" else json.dumps({"settings": {}}))
    with pytest.raises(SystemExit) as e:
        cost_pool.main([str(good), str(bad)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("cost_pool.py: error: ") and err.count("\n") == 1 and str(bad) in err


def test_the_share_charge_a_run_was_given_is_read_from_its_serve_args():
    assert cost_pool.charge_of([]) == "wall"
    assert cost_pool.charge_of(["--share-charge=alone"]) == "alone"
    assert cost_pool.charge_of(["--batch", "8", "--share-charge", "alone"]) == "alone"


def test_the_charge_the_service_said_it_ran_wins_over_its_arguments(tmp_path):
    assert cost_pool.charge_of([], "alone") == "alone" and cost_pool.charge_of(["--share-charge=alone"], "wall") == "wall"
    a = write_run(tmp_path / "a", 2.0, NOISE_A, charge=None)  # no --share-charge given ...
    doc = json.loads((a / "live-density.json").read_text())
    doc["engine"]["charge"] = "alone"  # ... and the service's status said alone (its default)
    (a / "live-density.json").write_text(json.dumps(doc))
    b = write_run(tmp_path / "b", 2.0, NOISE_B)
    assert cost_pool.main([str(a), str(b)])["differ"] == []


def test_a_run_that_never_read_its_services_charge_is_refused_not_taken_for_wall(tmp_path, capsys):
    a = write_run(tmp_path / "a", 2.0, NOISE_A, charge=None)
    doc = json.loads((a / "live-density.json").read_text())
    doc["engine"]["charge"] = None  # the driver recorded the charge, but no status came
    (a / "live-density.json").write_text(json.dumps(doc))
    with pytest.raises(SystemExit) as e:
        cost_pool.main([str(a), str(write_run(tmp_path / "b", 2.0, NOISE_B))])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "did not learn its service's --share-charge" in err and err.count("\n") == 1
