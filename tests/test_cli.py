"""The `shadow` CLI through Typer's CliRunner: tables, the final JSON line, clear errors (exit 2)."""

from __future__ import annotations

import json

import pytest
from conftest import shared_file
from typer.testing import CliRunner

from cli.main import app
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


def test_read_rate_on_cpu_with_tiny(tmp_path):
    from shadow.model import PRESETS, write_random_checkpoint

    other = write_random_checkpoint(tmp_path / "tiny2", PRESETS["tiny"], seed=3)
    plot, csv_path = tmp_path / "rate.png", tmp_path / "rate.csv"
    result = runner.invoke(app, [
        "read-rate", "--also-model", str(other), "--also-kernels", "reference", "--grid", "256", "--grid", "512",
        "--contexts", "0,1024", "--repeats", "1",
        "--full-read-tokens", "1500", "--ask-tokens", "900", "--decode-tokens", "2",
        "--reference-tokens", "512", "--plot", str(plot), "--csv", str(csv_path), "--json",
    ])
    assert result.exit_code == 0, result.output
    doc = last_json(result.output)
    for key in ("device", "model", "grid", "context", "ms_per_chunk", "ms_per_1k_tokens",
                "reference_ms_per_1k_tokens", "speedup_vs_reference", "ask_ms",
                "fork_decode_ms_per_token", "full_read_s", "weights"):
        assert doc[key] is not None, key
    assert doc["device"] == "cpu" and doc["weights"] == "random" and doc["grid"] == 256
    assert [(r["model"], r["grid"], r["context"]) for r in doc["rows"]][:4] == [
        ("tiny", 256, 0), ("tiny", 256, 1024), ("tiny", 512, 0), ("tiny", 512, 1024)]
    assert [(r["grid"], r["context"]) for r in doc["rows"][4:8]] == [(256, 0), (256, 1024), (512, 0), (512, 1024)]
    assert {r["model"] for r in doc["rows"][4:8]} == {str(other)}
    assert [(r["model"], r["kernels"]) for r in doc["rows"][8:]] == [("tiny", "reference")] * 4  # --also-kernels
    assert doc["kernels"] == "reference" and all(r["kernels"] == "reference" for r in doc["rows"])
    assert all(r["ms_per_chunk"] > 0 for r in doc["rows"])
    assert plot.read_bytes()[:4] == b"\x89PNG" and csv_path.read_text().startswith("model,grid,context")


@pytest.mark.parametrize(
    "args, message",
    [(["--contexts", "a,b"], "whole numbers"), (["--contexts", "-5"], "non-negative"),
     (["--grid", "100"], "multiple of 64"), (["--kernels", "turbo"], "unknown kernels")],
    ids=["contexts-not-numbers", "negative-context", "bad-grid", "bad-kernels"],
)
def test_read_rate_bad_input(args, message):
    result = runner.invoke(app, ["read-rate", *args])
    assert result.exit_code == 2 and message in result.output


def test_verify_exact_spills_and_restores_three_real_conversations_exactly(tmp_path):
    """The store's done-when: three real conversations interleaved under a tiny cap with a disk."""
    files = [shared_file("trajectories", "mini-swe-agent", f"{n}.traj.json")
             for n in ("pydata__xarray-4629", "django__django-14559", "django__django-13401")]
    args = ["verify-exact", "--cap-gib", "0.001", "--disk", str(tmp_path / "disk"), "--json"]
    for f in files:
        args += ["--conversation", str(f)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = last_json(result.output)
    assert doc["same_grid_bit_equal"] is True and len(doc["conversations"]) == 3
    assert doc["spills"] > 0 and doc["restores"] > 0 and doc["bytes_written"] > 0
    assert doc["restore_gib_per_s"] > 0 and doc["files_refused"] == []
    assert doc["store"]["files"] == 3 and doc["store"]["cap_bytes"] == int(0.001 * 2**30)
    assert sorted(s["name"] for s in doc["sessions"]) == sorted(p.name.split(".")[0] for p in files)
    listed = runner.invoke(app, ["store", str(tmp_path / "disk"), "--model", "tiny", "--json"])
    assert listed.exit_code == 0, listed.output
    files_doc = last_json(listed.output)
    assert files_doc["valid"] == 3 and files_doc["invalid"] == 0
    assert sorted(f["session"] for f in files_doc["files"]) == sorted(p.name.split(".")[0] for p in files)


def test_verify_exact_refuses_a_disk_that_holds_its_sessions_and_changes_nothing(small_conversation, tmp_path):
    """A second run into the same folder would continue the first run's session (and add its counters)."""
    args = ["verify-exact", "-c", str(small_conversation), "--against-grid", "0", "--cap-gib", "0",
            "--disk", str(tmp_path / "disk"), "--json"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    files = {p: p.read_bytes() for p in (tmp_path / "disk").iterdir()}
    assert files
    again = runner.invoke(app, args)
    assert again.exit_code == 2 and "already holds a session named 'small'" in again.output
    assert {p: p.read_bytes() for p in (tmp_path / "disk").iterdir()} == files


def test_store_command_on_a_missing_folder_exits_2(tmp_path):
    result = runner.invoke(app, ["store", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "no store folder" in result.output


def test_negative_cap_exits_2():
    result = runner.invoke(app, ["verify-exact", "--cap-gib", "-1"])
    assert result.exit_code == 2 and "must not be negative" in result.output


def test_replay_ledger_on_trajectories_with_a_read_rate_file(tmp_path):
    rate_file = tmp_path / "rate.json"
    rate_file.write_text("table\n" + json.dumps({"ms_per_1k_tokens": 16.7}) + "\n")
    folder = shared_file("trajectories", "mini-swe-agent", "pydata__xarray-4629.traj.json")
    ledger_out, plot = tmp_path / "out.ledger.jsonl", tmp_path / "cdf.png"
    result = runner.invoke(app, [
        "replay-ledger", str(folder), "--read-ms-per-1k", "87", "--read-rate-json", str(rate_file),
        "--share", "0.02", "--share", "0.05", "--write-ledger", str(ledger_out), "--plot", str(plot), "--json",
    ])
    assert result.exit_code == 0, result.output
    doc = last_json(result.output)
    assert doc["turns"] == 17 and doc["sessions"] == 1 and doc["read_ms_per_1k"] == [87.0, 16.7]
    assert [a["arm"] for a in doc["arms"]] == ["idle only"] * 2 + ["idle + 2% share", "idle + 5% share"] * 2
    for arm in doc["arms"]:
        assert {"fresh_pct", "p50_behind", "p90_behind"} <= set(arm)
    assert plot.read_bytes()[:4] == b"\x89PNG"
    again = runner.invoke(app, ["replay-ledger", str(ledger_out), "--read-ms-per-1k", "87", "--json"])
    assert last_json(again.output)["arms"][0] == doc["arms"][0]  # the written ledger replays the same


@pytest.mark.parametrize(
    "content, args, message",
    [
        ('{"session": "a", "start": 2, "first_token": 1, "end": 3, "prompt_tokens": 1, "new_prompt_tokens": 1, "output_tokens": 1}\n',
         [], "x.jsonl:1: times out of order"),
        ('{"what": 1}\n', [], "unknown format"),
        ("not json\n", [], "cannot tell the format"),
        ("{}\n", ["--format", "csv"], "unknown format 'csv'"),
        ("{}\n", ["--share", "1.5"], "shares between 0 and 1"),
    ],
    ids=["out-of-order", "unknown-format", "not-json", "bad-format-option", "bad-share"],
)
def test_replay_ledger_bad_input(tmp_path, content, args, message):
    path = tmp_path / "x.jsonl"
    path.write_text(content)
    result = runner.invoke(app, ["replay-ledger", str(path), *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_serve_help_and_config_errors(tmp_path):
    help_text = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "400"}).output
    assert "--upstream" in help_text and "--config" in help_text and "SHADOW_SERVE_UPSTREAM" in help_text
    bad = tmp_path / "serve.toml"
    bad.write_text('cap_gb = 2\n')
    result = runner.invoke(app, ["serve", "--config", str(bad)])
    assert result.exit_code == 2 and "unknown settings cap_gb" in result.output
    result = runner.invoke(app, ["serve", "--share", "1.5"])
    assert result.exit_code == 2 and "--share must be between 0 and 1" in result.output
    bad.write_text("share = 1.5\n")  # the file's value is used ...
    result = runner.invoke(app, ["serve", "--config", str(bad)])
    assert result.exit_code == 2 and "--share must be between 0 and 1" in result.output
    result = runner.invoke(app, ["serve", "--config", str(bad), "--model", "nope"], env={"SHADOW_SERVE_SHARE": "0.05"})
    assert result.exit_code == 2 and "no checkpoint folder" in result.output  # ... the variable wins over it


def test_serve_refuses_an_unload_slack_it_cannot_honour(tmp_path):
    result = runner.invoke(app, ["serve", "--unload-slack-gib", "2"])  # embedded: the generator needs the model
    assert result.exit_code == 2 and "--unload-slack-gib needs proxy mode" in result.output
    result = runner.invoke(app, ["serve", "--unload-slack-gib", "2", "--upstream", "http://127.0.0.1:9/v1"])
    assert result.exit_code == 2 and "a --disk" in result.output  # nowhere to park sessions
    result = runner.invoke(app, ["serve", "--upstream", "http://127.0.0.1:9/v1", "--label-from-upstream"])
    assert result.exit_code == 2 and "a --standing-question" in result.output
    result = runner.invoke(app, ["serve", "--upstream", "http://127.0.0.1:9/v1", "--kernels", "fast"])
    assert result.exit_code == 2 and "need CUDA" in result.output  # refused at start, not in the background
