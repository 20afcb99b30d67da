"""The `shadow` CLI through Typer's CliRunner: tables, the final JSON line, clear errors (exit 2)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cli.main import app
from conftest import shared_file
from shadow.conversations import save_jsonl
from shadow.sample import sample_conversation

runner = CliRunner()


def last_json(output: str) -> dict:
    return json.loads(output.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def small_conversation(tmp_path_factory):
    path = tmp_path_factory.mktemp("conv") / "small.jsonl"
    save_jsonl(sample_conversation(seed=5, turns=6), path)
    return path


def test_help_lists_the_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0 and "verify-exact" in result.output


def test_verify_exact_json_on_own_format(small_conversation, tmp_path):
    csv_path = tmp_path / "out.csv"
    result = runner.invoke(
        app, ["verify-exact", "-c", str(small_conversation), "--grid", "256", "--against-grid", "1024",
              "--csv", str(csv_path), "--json"],
    )
    assert result.exit_code == 0, result.output
    doc = last_json(result.output)
    assert doc["same_grid_bit_equal"] is True
    assert doc["turns"] == 7 and doc["tokens"] > 1000 and doc["tensors_compared"] == 8
    assert doc["weights"] == "random" and doc["grid"] == 256
    assert set(doc["other_grid"]["max_abs_diff"]) == {"k", "v", "recurrent", "conv"}
    assert doc["other_grid"]["probes"] == 4
    assert "weights are random" in result.output
    assert csv_path.read_text().startswith("conversation,")


def test_verify_exact_on_a_real_trajectory_rolls_back():
    path = shared_file("trajectories", "mini-swe-agent", "pydata__xarray-4629.traj.json")
    result = runner.invoke(app, ["verify-exact", "-c", str(path), "--json"])
    assert result.exit_code == 0, result.output
    doc = last_json(result.output)
    assert doc["same_grid_bit_equal"] is True and doc["rollbacks"] > 0 and doc["ids_reread"] > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "nope"], "no checkpoint folder or preset"),
        (["--grid", "100"], "multiple of 64"),
        (["--against-grid", "96"], "multiple of 64"),
        (["-c", "/no/such/file.jsonl"], "no conversation file"),
        (["--dtype", "int7"], "unknown dtype"),
    ],
    ids=["unknown-preset", "bad-grid", "bad-other-grid", "missing-conversation", "bad-dtype"],
)
def test_bad_input_exits_2_with_one_clear_line(args, message):
    result = runner.invoke(app, ["verify-exact", *args])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_empty_conversation_file_exits_2(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    result = runner.invoke(app, ["verify-exact", "-c", str(path)])
    assert result.exit_code == 2 and "is empty" in result.output
