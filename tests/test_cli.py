"""The `shadow` CLI through Typer's CliRunner: tables, the final JSON line, clear errors (exit 2)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import shared_file
from typer.testing import CliRunner

from shadow.cli.common import ShadowGroup, write_csv
from shadow.cli.main import app
from shadow.text.conversations import save_jsonl
from shadow.text.sample import sample_conversation

runner = CliRunner()


def last_json(output: str) -> dict:
    """The command's JSON line: the last line of the output that is a JSON object (a library's
    warning written to stderr after it, where pytest does not capture warnings, is not)."""
    return json.loads(next(line for line in reversed(output.strip().splitlines()) if line.startswith("{")))


@pytest.fixture(scope="module")
def small_conversation(tmp_path_factory):
    path = tmp_path_factory.mktemp("conv") / "small.jsonl"
    save_jsonl(sample_conversation(seed=5, turns=6), path)
    return path


def test_help_lists_the_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0 and "verify-exact" in result.output


@pytest.mark.slow
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


@pytest.mark.slow
def test_verify_exact_reads_at_80_columns(small_conversation):
    """A terminal of 80 columns: no line longer, every name and header whole (never cut into
    pieces of a few letters)."""
    run = subprocess.run([sys.executable, "-c", "from shadow.cli.main import main; main()", "verify-exact", "-c",
                          str(small_conversation), "--grid", "256", "--against-grid", "1024"],
                         capture_output=True, text=True, env=os.environ | {"COLUMNS": "80"}, timeout=600)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert max(map(len, lines)) <= 80, run.stdout
    for whole in (small_conversation.stem, "rollbacks", "bit-equal", "tokens"):
        assert any(whole in line for line in lines), (whole, run.stdout)


@pytest.mark.parametrize("rows", [1, 9])
def test_a_wide_table_is_shown_whole_at_80_columns(monkeypatch, rows):
    """Few rows: turned on its side; many: several tables that repeat the first column."""
    from rich.console import Console
    from rich.table import Table

    import shadow.cli.common

    console = Console(width=80, record=True, highlight=False)
    monkeypatch.setattr(shadow.cli.common, "console", console)
    table = Table(title="wide")
    headers = ["session", *[f"measure {i}" for i in range(12)]]
    for h in headers:
        table.add_column(h)
    for r in range(rows):
        table.add_row(f"django__django-{16950 + r}", *[f"{1000 * r + i:,}" for i in range(12)])
    shadow.cli.common.show(table)
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= 80
    for cell in headers + [f"django__django-{16950 + r}" for r in range(rows)] + [f"{1000 * (rows - 1) + 11:,}"]:
        assert cell in text, (cell, text)
    assert (text.count("django__django-16950") > 1) == (rows > 4)  # split tables repeat the first column


@pytest.mark.slow
def test_verify_exact_on_a_real_trajectory_rolls_back():
    path = shared_file("trajectories", "mini-swe-agent", "pydata__xarray-4629.traj.json")
    result = runner.invoke(app, ["verify-exact", "-c", str(path), "--json"])
    assert result.exit_code == 0, result.output
    doc = last_json(result.output)
    assert doc["same_grid_bit_equal"] is True and doc["rollbacks"] > 0 and doc["ids_reread"] > 0


def dense_ledger(path, sessions: int, turns: int):
    """A ledger of `sessions` sessions decoding all the time, `turns` turns each of 8,000 new ids
    and 300 output ids, 20 s apart; its path."""
    with path.open("w") as f:
        for s in range(sessions):
            prompt = 0
            for k in range(turns):
                start = 20.0 * k + 0.7 * s
                prompt += 8000 + (300 if k else 0)
                f.write(json.dumps({"session": f"s{s}", "start": start, "first_token": start + 0.5, "end": start + 19.0,
                                    "prompt_tokens": prompt, "new_prompt_tokens": 8000, "output_tokens": 300}) + "\n")
    return path


def test_replay_ledger_charges_a_share_read_at_most_the_costs_given_as_live_kept_them(tmp_path):
    """--charge-json: reads take the chunk table's time but a share read is charged at most the
    given costs (as `serve --share-charge alone` charges them), so the share reads more; a file
    that is not a read-rate document is refused with one line."""
    ledger = dense_ledger(tmp_path / "dense.ledger.jsonl", sessions=8, turns=4)
    slow, charge = tmp_path / "slow.json", tmp_path / "charge.json"
    slow.write_text(json.dumps(_rate_doc(3.0)) + "\n")
    charge.write_text(json.dumps(_rate_doc(1.0)) + "\n")
    base = ["replay-ledger", str(ledger), "--read-rate-json", str(slow), "--samples", "10", "--json"]

    def share_arm(*more):
        result = runner.invoke(app, [*base, *more])
        assert result.exit_code in (0, 1), result.output
        return last_json(result.output), next(a for a in last_json(result.output)["arms"] if a["share"])

    plain_doc, plain = share_arm()
    doc, charged = share_arm("--charge-json", str(charge))
    assert plain_doc["limits"]["charge"] is None and doc["limits"]["charge"] == "charge.json"
    # each share chunk took the slow table's time but was charged a third of it: about three times the chunks
    assert charged["chunks_share"] > 2 * plain["chunks_share"] > 0
    assert charged["share_s"] > 2 * plain["share_s"]  # the seconds the share's reads took, not what they were charged
    assert plain["share_charged_s"] == plain["share_s"]  # without the file: charged their seconds
    assert 0 < charged["share_charged_s"] < 0.5 * charged["share_s"]  # charged a third of a slow chunk's seconds
    one_row = tmp_path / "one.json"
    one_row.write_text(json.dumps({**_rate_doc(1.0), "rows": _rate_doc(1.0)["rows"][:1]}) + "\n")
    refused = runner.invoke(app, [*base, "--charge-json", str(one_row)])
    assert refused.exit_code == 2 and "needs chunk costs at two depths at least" in refused.output
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]\n")
    refused = runner.invoke(app, [*base, "--charge-json", str(bad)])
    assert refused.exit_code == 2 and "bad.json: not a read-rate --json output" in refused.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "nope"], "no checkpoint folder or preset"),
        (["--grid", "100"], "multiple of 64"),
        (["--against-grid", "96"], "multiple of 64"),
        (["-c", "/no/such/file.jsonl"], "no such file"),
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


@pytest.mark.slow
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
    assert f"wrote {plot}" in result.output and f"wrote {csv_path}" in result.output


@pytest.mark.slow
def test_read_rate_times_batches_and_the_replay_charges_by_them(tmp_path):
    rate = tmp_path / "rate.json"
    folder = shared_file("trajectories", "mini-swe-agent", "pydata__xarray-4629.traj.json")
    for _ in range(3):  # a loaded CPU can time a batch over 1.5x its chunks alone, which the replay refuses: time again
        result = runner.invoke(app, ["read-rate", "--contexts", "0,512", "--batches", "2,4", "--repeats", "1",
                                     "--full-read-tokens", "0", "--ask-tokens", "0", "--reference-tokens", "0", "--json"])
        assert result.exit_code == 0, result.output
        doc = last_json(result.output)
        assert [(r["context"], r["batch"], r["run"]) for r in doc["batch_rows"]] == \
            [(c, b, run) for c in (0, 512) for b, run in ((1, False), (2, False), (4, False), (2, True), (4, True))]
        assert all(r["ms_per_chunk"] == pytest.approx(r["ms_per_read"] / r["batch"]) for r in doc["batch_rows"])
        assert "batched reads" in result.output and "one session" in result.output
        rate.write_text(json.dumps(doc) + "\n")
        replayed = runner.invoke(app, ["replay-ledger", str(folder), "--read-rate-json", str(rate), "--batch", "4",
                                       "--samples", "10", "--json"])
        if not (replayed.exit_code == 2 and "slower than its chunks alone" in replayed.output):
            break
    assert replayed.exit_code == 0, replayed.output
    out = last_json(replayed.output)
    assert out["batch"] == 4 and out["batch_costs"] == "rate.json" and out["batch_ms"] == 10
    assert "batches of up to 4, at most 10 ms (rate.json)" in " ".join(replayed.output.split())
    longer = runner.invoke(app, ["replay-ledger", str(folder), "--read-rate-json", str(rate), "--batch", "4",
                                 "--batch-ms", "40", "--samples", "10", "--json"])
    assert longer.exit_code == 0, longer.output
    assert last_json(longer.output)["batch_ms"] == 40 and "at most 40 ms" in " ".join(longer.output.split())
    refused = runner.invoke(app, ["replay-ledger", str(folder), "--batch", "4", "--batch-ms", "0"])
    assert refused.exit_code == 2 and "--batch-ms" in refused.output
    pieced = runner.invoke(app, ["replay-ledger", str(folder), "--read-rate-json", str(rate), "--batch", "4",
                                 "--batch-read-ms", "50", "--batch-wait-ms", "1000", "--samples", "10", "--json"])
    assert pieced.exit_code == 0, pieced.output
    out = last_json(pieced.output)
    assert (out["batch_ms"], out["batch_read_ms"], out["batch_wait_ms"], out["batch_busy"]) == (10, 50, 1000, 0.4)
    assert "up to 50 ms in pieces of 10 ms between rounds, a batch short of the most waiting up to 1000 ms" \
        in " ".join(pieced.output.split())
    for bad in (["--batch-read-ms", "0"], ["--batch-wait-ms", "-1"], ["--batch-busy", "1.5"]):
        refused = runner.invoke(app, ["replay-ledger", str(folder), "--batch", "4", *bad])
        assert refused.exit_code == 2 and bad[0] in refused.output, bad


@pytest.mark.parametrize(
    "args, message",
    [(["--contexts", "a,b"], "whole numbers"), (["--contexts", "-5"], "non-negative"),
     (["--grid", "100"], "multiple of 64"), (["--kernels", "turbo"], "unknown kernels"),
     (["--batches", "3"], "--batches takes 2, 4 and 8"), (["--batches", "two"], "--batches must be whole numbers")],
    ids=["contexts-not-numbers", "negative-context", "bad-grid", "bad-kernels", "batch-size-without-graphs",
         "batches-not-numbers"],
)
def test_read_rate_bad_input(args, message):
    result = runner.invoke(app, ["read-rate", *args])
    assert result.exit_code == 2 and message in result.output


@pytest.mark.slow
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


@pytest.mark.slow
def test_verify_exact_batched_reads_of_three_real_conversations_stay_bit_equal():
    """Three real conversations' chunks read up to four sessions a forward, each at its own depth:
    every state bit-equal to its fresh prefill, as one session a forward gives."""
    args = ["verify-exact", "--batch", "4", "--against-grid", "0", "--json"]
    for n in ("pydata__xarray-4629", "django__django-14559", "django__django-13401"):
        args += ["--conversation", str(shared_file("trajectories", "mini-swe-agent", f"{n}.traj.json"))]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = last_json(result.output)
    assert doc["same_grid_bit_equal"] is True and doc["batch"] == 4 and len(doc["conversations"]) == 3
    assert all(c["same_grid_bit_equal"] and c["tensors_compared"] == 8 for c in doc["conversations"])
    assert all(c["chunks_batched"] > 0 for c in doc["conversations"]) and "batches of 4" in result.output


@pytest.mark.slow
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
    assert result.exit_code == 2 and "--cap-gib must be >= 0 (got -1)" in result.output


@pytest.mark.slow
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
    assert f"wrote {plot}" in result.output and f"wrote {ledger_out}" in result.output
    again = runner.invoke(app, ["replay-ledger", str(ledger_out), "--read-ms-per-1k", "87", "--json"])
    assert last_json(again.output)["arms"][0] == doc["arms"][0]  # the written ledger replays the same


def _rate_doc(scale: float) -> dict:
    """A read-rate --json document: chunks 3 to 6 ms by depth and batches reading a chunk for 0.6 of
    that at 8, times `scale`."""
    rows = [{"context": c, "ms_per_chunk": ms * scale} for c, ms in ((0, 3.0), (65536, 6.0))]
    batches = [{"context": c, "batch": b, "ms_per_read": ms * scale * b * r}
               for c, ms in ((0, 3.0), (65536, 6.0)) for b, r in ((1, 1.0), (2, 0.8), (4, 0.7), (8, 0.6))]
    return {"model": "m", "kernels": "k", "grid": 512, "rows": rows, "batch_rows": batches}


def test_replay_ledger_charges_each_read_rate_file_its_own_costs(tmp_path):
    """--read-rate-json repeated: an arm for each file, each charged that file's chunk and batch
    rows (several device calls' costs side by side); two files of one name are told apart by path."""
    ledger = dense_ledger(tmp_path / "dense.ledger.jsonl", sessions=16, turns=6)
    fast, slow = tmp_path / "fast.json", tmp_path / "slow.json"
    fast.write_text("a table\n" + json.dumps(_rate_doc(1.0)) + "\n")
    slow.write_text(json.dumps(_rate_doc(3.0)) + "\n")
    result = runner.invoke(app, ["replay-ledger", str(ledger), "--read-rate-json", str(fast), "--read-rate-json",
                                 str(slow), "--batch", "8", "--samples", "10", "--json"])
    assert result.exit_code == 0, result.output
    doc = last_json(result.output)
    assert [(c["label"], c["batch_costs"]) for c in doc["costs"]] == [("fast.json", "fast.json"), ("slow.json", "slow.json")]
    assert [c["ms_per_chunk"] for c in doc["costs"]] == [[3.0, 6.0], [9.0, 18.0]]
    assert doc["batch_costs"] == "fast.json, slow.json"
    assert [(a["arm"], a["cost"]) for a in doc["arms"]] == [
        ("idle only", "fast.json"), ("idle only", "slow.json"), ("idle + 2% share", "fast.json"), ("idle + 2% share", "slow.json")]
    fast_share, slow_share = doc["arms"][2], doc["arms"][3]
    assert fast_share["chunks_share"] > 0 and fast_share["fresh_pct"] > slow_share["fresh_pct"]
    twins = [tmp_path / "a" / "rate.json", tmp_path / "b" / "rate.json"]
    for path, scale in zip(twins, (1.0, 2.0)):
        path.parent.mkdir()
        path.write_text(json.dumps(_rate_doc(scale)) + "\n")
    result = runner.invoke(app, ["replay-ledger", str(ledger), "--read-rate-json", str(twins[0]), "--read-rate-json",
                                 str(twins[1]), "--samples", "10", "--json"])
    assert result.exit_code == 0, result.output
    assert [c["label"] for c in last_json(result.output)["costs"]] == [str(p) for p in twins]
    twice = runner.invoke(app, ["replay-ledger", str(ledger), "--read-rate-json", str(fast), "--read-rate-json",
                                str(tmp_path / "a" / ".." / "fast.json")])
    assert twice.exit_code == 2 and "names the same file twice" in twice.output


@pytest.mark.parametrize(
    "content, args, message",
    [
        ('{"session": "a", "start": 2, "first_token": 1, "end": 3, "prompt_tokens": 1, "new_prompt_tokens": 1, "output_tokens": 1}\n',
         [], "x.jsonl:1: times out of order"),
        ('{"what": 1}\n', [], "unknown format"),
        ("not json\n", [], "cannot tell the format"),
        ("{}\n", ["--format", "csv"], "unknown format 'csv'"),
        ("{}\n", ["--share", "1.5"], "--share must be between 0 and 1 (a fraction: 0.02 is 2 %) (got 1.5)"),
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


def test_serve_refuses_a_read_rate_file_it_cannot_start_from(tmp_path):
    """--read-rate-json must be a read-rate --json output of the serve's model at its grid, with
    positive costs; anything else exits 2 naming the file, before anything loads or binds."""
    rate = tmp_path / "rate.json"
    row = {"grid": 512, "context": 0, "ms_per_chunk": 3.0}
    cases = [
        ("not json", "not readable JSON"),
        (json.dumps([1, 2]), "its last line is not a JSON object"),
        (json.dumps({"model": "qwen3.5-0.8b", "rows": [row]}), "measured for model 'qwen3.5-0.8b', not this serve's 'tiny'"),
        (json.dumps({"model": "tiny", "rows": [{**row, "grid": 256}]}), "no rows at grid 512"),
        (json.dumps({"model": "tiny", "rows": [{**row, "ms_per_chunk": -1}]}), "costs are positive"),
        (json.dumps({"model": "tiny", "rows": [row], "batch_rows": [{"grid": 512, "context": 0, "batch": 2}]}),
         "not a read-rate --json output at grid 512 (KeyError"),
        (json.dumps({"model": "tiny", "rows": [row],
                     "batch_rows": [{"grid": 512, "context": -512, "batch": 2, "ms_per_read": 5.0}]}), "its context is negative"),
    ]
    for text, message in cases:
        rate.write_text(text + "\n")
        result = runner.invoke(app, ["serve", "--read-rate-json", str(rate)])
        assert result.exit_code == 2 and message in result.output, (text, result.output)
    result = runner.invoke(app, ["serve", "--read-rate-json", str(tmp_path / "none.json")])
    assert result.exit_code == 2 and "no such file" in result.output
    result = runner.invoke(app, ["serve", "--batch", "3"])
    assert result.exit_code == 2 and "--batch is 1, 2, 4 or 8" in result.output


def test_serve_refuses_an_unload_slack_it_cannot_honour(tmp_path):
    result = runner.invoke(app, ["serve", "--unload-slack-gib", "2"])  # embedded: the generator needs the model
    assert result.exit_code == 2 and "--unload-slack-gib needs proxy mode" in result.output
    result = runner.invoke(app, ["serve", "--unload-slack-gib", "2", "--upstream", "http://127.0.0.1:9/v1", "--no-disk"])
    assert result.exit_code == 2 and "a disk to park sessions on" in result.output  # nowhere to park sessions
    result = runner.invoke(app, ["serve", "--upstream", "http://127.0.0.1:9/v1", "--label-from-upstream"])
    assert result.exit_code == 2 and "a --standing-question" in result.output
    result = runner.invoke(app, ["serve", "--upstream", "http://127.0.0.1:9/v1", "--kernels", "fast"])
    assert result.exit_code == 2 and "need CUDA" in result.output  # refused at start, not in the background


# ------------------------------------------------------------------------------------------------
# The contract (README): bad input gets one clear line on stderr and exit code 2, found before any
# work, and nothing is created or changed; an internal error is one line and exit code 3.


def tree(folder: Path) -> dict:
    """Every path under `folder` with its size and modification time."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


@pytest.fixture()
def workdir(tmp_path, monkeypatch):
    """A folder to run in, holding a binary file, a plain file, a folder and two conversation
    files whose JSON is not a conversation's."""
    (tmp_path / "binary.dat").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "afile").write_text("not a folder\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "numbers.traj.json").write_text(json.dumps({"messages": [1, 2]}))
    (tmp_path / "strings.traj").write_text(json.dumps({"history": ["x"]}))
    (tmp_path / "list.json").write_text("[1, 2]")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def refused(args: list[str], folder: Path, message: str, cli=None) -> None:
    """`shadow ARGS` exits 2 with one line on stderr holding `message`, no traceback, and leaves
    `folder` (and the cache) as it was."""
    cache = Path(os.environ["SHADOW_CACHE"])
    before, cached = tree(folder), tree(cache)
    result = runner.invoke(cli or app, args)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.stderr
    assert "Traceback" not in result.output and (result.exception is None or isinstance(result.exception, SystemExit))
    assert tree(folder) == before and tree(cache) == cached  # nothing created or changed


def one_line_app():
    """`cli.main.app` with the group class that prints click's own usage errors (a callback's
    BadParameter, a value of the wrong type) on one line, as main.py builds it with
    `typer.Typer(cls=ShadowGroup)`."""
    wired = copy.copy(app)
    wired.info = copy.copy(app.info)
    wired.info.cls = ShadowGroup
    return wired


@pytest.mark.parametrize("args, message", [
    (["-c", "numbers.traj.json"], "numbers.traj.json: message 0 is not an object"),
    (["-c", "strings.traj"], "strings.traj: message 0 is not an object"),
    (["--disk", "afile"], "--disk afile: is a file, not a folder"),
    (["--disk", "afile/sub"], "afile is a file, not a folder"),
    (["--csv", "folder"], "--csv folder: is a folder"),
    (["--csv", "nowhere/x.csv"], "no folder nowhere"),
    (["--cap-gib", "-1"], "--cap-gib must be >= 0 (got -1)"),
    (["--cap-gib", "nan"], "--cap-gib must be >= 0 (got nan)"),
    (["--disk-cap-gib", "-1"], "--disk-cap-gib must be > 0"),
    (["--kernels", "fast"], "--kernels fast needs --device cuda"),
    (["--device", "gpu"], "--device 'gpu': not a device"),
    (["--batch", "0"], "--batch must be >= 1 and <= 8 (got 0)"),
    (["--batch", "9"], "--batch must be >= 1 and <= 8 (got 9)"),
    (["--batch", "2", "--cap-gib", "1"], "give --batch without --cap-gib"),
], ids=["messages-not-objects", "history-not-objects", "disk-is-a-file", "disk-under-a-file", "csv-folder",
        "csv-no-parent", "negative-cap", "nan-cap", "negative-disk-cap", "fast-kernels-on-cpu", "unknown-device",
        "batch-zero", "batch-nine", "batch-with-cap"])
def test_verify_exact_refuses_before_any_work(workdir, args, message):
    refused(["verify-exact", *args], workdir, message)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused_before_loading(workdir):
    refused(["verify-exact", "--device", "cuda"], workdir, "--device cuda: CUDA is not available here")
    refused(["read-rate", "--device", "cuda:1"], workdir, "CUDA is not available")


@pytest.mark.parametrize("args, message", [
    (["--full-read-tokens", "-1"], "--full-read-tokens must be >= 0 (got -1)"),
    (["--full-read-tokens", "100"], "--full-read-tokens must be 0 (skip) or at least the grid, 512 (got 100)"),
    (["--ask-tokens", "-3"], "--ask-tokens must be >= 0 (got -3)"),
    (["--reference-tokens", "-5"], "--reference-tokens must be >= 0 (got -5)"),
    (["--reference-tokens", "100"], "--reference-tokens must be 0 (skip) or at least the grid"),
    (["--decode-tokens", "-4"], "--decode-tokens must be >= 1 (got -4)"),
    (["--decode-tokens", "0"], "--decode-tokens must be >= 1 (got 0)"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--plot", "x.xyz"], "--plot x.xyz: unknown suffix '.xyz'"),
    (["--plot", "folder"], "--plot folder: is a folder"),
    (["--csv", "folder"], "--csv folder: is a folder"),
    (["--also-model", "qwen9"], "--also-model 'qwen9': no checkpoint folder or preset"),
    (["--also-model", "folder"], "folder: the checkpoint folder has no config.json"),
    (["--also-kernels", "turbo"], "unknown kernels 'turbo'"),
    (["--grid", "512", "--grid", "100"], "--grid must be a positive multiple of 64 (got 100)"),
], ids=["negative-full-read", "full-read-under-a-chunk", "negative-ask", "negative-reference",
        "reference-under-a-chunk", "negative-decode", "zero-decode", "zero-repeats", "unknown-plot-suffix",
        "plot-folder", "csv-folder", "unknown-also-model", "also-model-without-config", "unknown-also-kernels",
        "second-grid"])
def test_read_rate_refuses_before_any_timing(workdir, args, message):
    refused(["read-rate", *args], workdir, message)


@pytest.mark.parametrize("fmt", ["auto", "ledger", "mooncake", "trajectory"])
def test_replay_ledger_refuses_a_binary_file(workdir, fmt):
    message = "binary.dat:1: not JSON" if fmt == "auto" else "binary.dat: not a text"
    refused(["replay-ledger", "binary.dat", "--format", fmt], workdir, message)


@pytest.mark.parametrize("args, message", [
    (["--write-ledger", "folder"], "--write-ledger folder: is a folder"),
    (["--plot", "cdf.gif"], "--plot cdf.gif: unknown suffix"),
    (["--read-rate-json", "binary.dat"], "binary.dat: not a read-rate --json output"),
    (["--read-rate-json", "folder"], "--read-rate-json folder: is a folder"),
    (["--read-ms-per-1k", "nan"], "--read-ms-per-1k must be > 0 (got nan)"),
    (["--engines", "0"], "--engines is at least 1 (got 0)"),
    (["--batch", "3"], "--batch is 1, 2, 4 or 8"),
], ids=["write-ledger-folder", "plot-suffix", "binary-rate-file", "rate-file-folder", "nan-rate", "no-engines",
        "batch-size-without-graphs"])
def test_replay_ledger_refuses_bad_options(workdir, args, message):
    ledger = workdir / "x.ledger.jsonl"
    ledger.write_text(json.dumps({"session": "a", "start": 0, "first_token": 1, "end": 2, "prompt_tokens": 600,
                                  "new_prompt_tokens": 600, "output_tokens": 10}) + "\n")
    refused(["replay-ledger", str(ledger), *args], workdir, message)


@pytest.mark.parametrize("args, message", [
    (["--journal", "binary.dat", "--sessions", "folder"], "binary.dat: not a text journal"),
    (["--journal", "nope.jsonl", "--sessions", "folder"], "--journal nope.jsonl: no such file"),
    (["--journal", "afile", "--sessions", "afile"], "--sessions afile: no such folder"),
    (["--journal", "afile", "--sessions", "folder", "--question", "binary.dat"], "binary.dat: not a text question file"),
    (["--journal", "afile", "--sessions", "folder", "--question", "list.json"], "list.json: not 'journal' nor a question file"),
    (["--journal", "afile", "--sessions", "folder", "--csv", "folder"], "--csv folder: is a folder"),
    (["--journal", "afile", "--sessions", "folder", "--model", "qwen9"], "no checkpoint folder or preset"),
], ids=["binary-journal", "missing-journal", "sessions-not-a-folder", "binary-question", "question-not-an-object",
        "csv-folder", "unknown-model"])
def test_router_eval_refuses_bad_input(workdir, args, message):
    if "--question" in args:  # a journal with one labelled ask, so the questions are read
        (workdir / "afile").write_text(json.dumps({"session": "s", "insertion": 1, "question_ids": [1],
                                                   "choices": ["A"], "probs": [1.0], "reference": "A",
                                                   "weights_hash": "x", "grid": 512}) + "\n")
    refused(["router-eval", *args], workdir, message)


# input the checks had not seen: files nested 100,000 deep or with a number of 5,000 digits,
# numbers past any bound, options that were accepted and ignored

DEEP = "[" * 100_000 + "]" * 100_000
HUGE = "9" * 5000


@pytest.fixture()
def bad_files(workdir):
    """Conversation, journal, ledger and question files nested 100,000 deep or holding a number of
    5,000 digits; a ledger of three sessions; a standing question whose choices repeat; a TOML
    config nested 5,000 deep; a folder holding no tokenizer.json."""
    (workdir / "deep.traj.json").write_text('{"messages": ' + DEEP + "}")
    (workdir / "huge.traj.json").write_text('{"messages": [{"role": "user", "content": "x", "n": ' + HUGE + "}]}")
    (workdir / "deep.jsonl").write_text(DEEP + "\n")
    (workdir / "huge.jsonl").write_text('{"session": "a", "n": ' + HUGE + "}\n")
    (workdir / "deep-q.json").write_text('{"text": "A?", "choices": ' + DEEP + "}")
    (workdir / "deep-template.json").write_text(DEEP)
    rows = [{"session": s, "start": i * 10.0, "first_token": i * 10 + 1.0, "end": i * 10 + 5.0, "prompt_tokens": 600,
             "new_prompt_tokens": 600, "output_tokens": 10} for i, s in enumerate("abc")]
    (workdir / "three.ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (workdir / "repeated.json").write_text(json.dumps({"name": "r", "text": "A or B?", "choices": ["A", "A"]}))
    (workdir / "deep.toml").write_text("a = " + "[" * 5000 + "1" + "]" * 5000 + "\n")
    (workdir / "notok").mkdir()
    return workdir


@pytest.mark.parametrize("args, message", [
    (["verify-exact", "-c", "deep.traj.json"], "deep.traj.json: nests too deeply"),
    (["verify-exact", "-c", "huge.traj.json"], "huge.traj.json: not readable JSON"),
    (["voice-replay", "-c", "deep.traj.json"], "deep.traj.json: nests too deeply"),
    (["voice-replay", "-c", "huge.traj.json"], "huge.traj.json: not readable JSON"),
    (["replay-ledger", "deep.jsonl"], "deep.jsonl:1: not JSON"),
    (["replay-ledger", "huge.jsonl"], "huge.jsonl:1: not JSON"),
    (["replay-ledger", "deep.jsonl", "--format", "ledger"], "deep.jsonl: nests too deeply"),
    (["replay-ledger", "huge.jsonl", "--format", "mooncake"], "huge.jsonl"),
    (["replay-ledger", "deep.traj.json", "--format", "trajectory"], "deep.traj.json"),
    (["router-eval", "--journal", "deep.jsonl", "--sessions", "folder"], "deep.jsonl: nests too deeply"),
    (["router-eval", "--journal", "huge.jsonl", "--sessions", "folder"], "huge.jsonl"),
    (["verify-exact", "--seed", "99999999999999999999999"], "--seed must be an integer from 0 to 2**63 - 1"),
    (["verify-exact", "--seed", "1" + "0" * 400], "--seed must be an integer from 0 to 2**63 - 1"),
    (["voice-replay", "--seed", "99999999999999999999999"], "--seed must be an integer from 0 to 2**63 - 1"),
    (["replay-ledger", "three.ledger.jsonl", "--pack", "1e308"],
     "--pack needs a positive number of active sessions, at most 10,000"),
    (["replay-ledger", "three.ledger.jsonl", "--pack", "inf"], "--pack needs a positive number"),
    (["serve", "--max-body-mb", "inf"], "--max-body-mb must be a finite number"),
    (["serve", "--batch", "8", "--batch-ms", "inf"], "--batch-ms must be a finite number"),
    (["serve", "--batch", "8", "--batch-read-ms", "inf"], "--batch-read-ms must be a finite number"),
    (["serve", "--priorities", "speed"], "--priorities: priorities are 'all', 'none' or steps among"),
    (["serve", "--standing-question", "repeated.json"], "repeated.json: not a standing question file"),
    (["serve", "--session-headers", ""], "--session-headers names no header"),
    (["serve", "--session-headers", " , "], "--session-headers names no header"),
    (["serve", "--tokenizer", "notok"], "--tokenizer notok: the folder has no tokenizer.json"),
    (["serve", "--tokenizer", "nowhere"], "--tokenizer nowhere: no such file or folder"),
    (["serve", "--upstream", "http://127.0.0.1:9/v1", "--tokenizer", "notok"], "the folder has no tokenizer.json"),
    (["serve", "--tokenizer", "binary.dat"], "--tokenizer in embedded mode needs --chat-template"),
    (["serve", "--chat-template", "nowhere.jinja"], "--chat-template nowhere.jinja: no such file or folder"),
    (["serve", "--chat-template-kwargs", DEEP], "--chat-template-kwargs is not readable JSON"),
    (["serve", "--chat-template", "deep-template.json"], "deep-template.json is not a chat template: JSON nested too deeply"),
    (["serve", "--max-generating", "3", "--max-queued", "2"],
     "--max-generating must be at least 1 and at most --max-queued"),
    (["serve", "--generator-model", "qwen9"], "--generator-model 'qwen9': no checkpoint folder or preset"),
    (["serve", "--voice-model", "folder"], "folder: the checkpoint folder has no config.json"),
    (["serve", "--grid", "100"], "--grid must be a positive multiple of 64 (got 100)"),
    (["serve", "--dtype", "int7"], "unknown dtype 'int7'"),
    (["serve", "--device", "gpu"], "--device 'gpu': not a device"),
    (["check-engine", "http://127.0.0.1:9/v1", "--tokenizer", "notok"], "the folder has no tokenizer.json"),
    (["check-engine", "http://127.0.0.1:9/v1", "--chat-template-kwargs", DEEP],
     "--chat-template-kwargs is not readable"),
], ids=["deep-conversation", "huge-conversation", "deep-voice-conversation", "huge-voice-conversation",
        "deep-ledger-detect", "huge-ledger-detect", "deep-ledger", "huge-mooncake", "deep-trajectory",
        "deep-journal", "huge-journal", "huge-seed", "seed-past-any-float", "huge-voice-seed", "pack-1e308",
        "pack-inf", "max-body-inf", "batch-ms-inf", "batch-read-ms-inf", "bad-priorities", "repeated-choices", "empty-session-headers", "blank-session-headers",
        "tokenizer-folder-without-one", "missing-tokenizer", "proxy-tokenizer-folder-without-one",
        "embedded-tokenizer-alone", "missing-template", "deep-template-kwargs", "deep-template", "generating-past-queued",
        "unknown-generator", "voice-model-without-config", "serve-bad-grid", "serve-bad-dtype",
        "serve-unknown-device", "check-engine-tokenizer", "check-engine-deep-kwargs"])
def test_input_the_checks_had_not_seen_exits_2_before_any_work(bad_files, args, message):
    refused(args, bad_files, message)


def test_serve_refuses_a_deep_config_on_one_line(bad_files):
    refused(["serve", "--config", "deep.toml"], bad_files, "cannot read deep.toml as TOML", cli=one_line_app())


def test_router_eval_refuses_a_deep_question_file(bad_files):
    (bad_files / "afile").write_text(json.dumps({"session": "s", "insertion": 1, "question_ids": [1], "choices": ["A"],
                                                 "probs": [1.0], "reference": "A", "weights_hash": "x",
                                                 "grid": 512}) + "\n")
    refused(["router-eval", "--journal", "afile", "--sessions", "folder", "--question", "deep-q.json"], bad_files,
            "deep-q.json")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_serve_on_cuda_without_cuda_is_refused_before_loading(bad_files):
    refused(["serve", "--device", "cuda"], bad_files, "--device cuda: CUDA is not available here")
    refused(["serve", "--upstream", "http://127.0.0.1:9/v1", "--device", "cuda:0"], bad_files, "CUDA is not available")


def test_serve_refuses_a_binary_config_on_one_line(workdir):
    refused(["serve", "--config", "binary.dat"], workdir, "cannot read binary.dat as TOML", cli=one_line_app())


def test_click_errors_are_one_line_with_the_shadow_group(workdir):
    refused(["verify-exact", "--grid", "abc"], workdir, "'--grid'", cli=one_line_app())
    refused(["verify-exact", "--no-such-option"], workdir, "No such option", cli=one_line_app())


def test_store_refuses_an_unknown_model_before_reading(workdir):
    refused(["store", "folder", "--model", "qwen9"], workdir, "--model 'qwen9': no checkpoint folder or preset")


@pytest.mark.parametrize("args, message", [
    (["--runs", "0"], "--runs must be >= 1"),
    (["--output-tokens", "1"], "--output-tokens must be >= 2"),
    (["--pause", "-1"], "--pause must be >= 0"),
    (["--url", "localhost:8000"], "not an http(s) URL"),
    (["--plot", "folder"], "--plot folder: is a folder"),
    (["--url", "http://127.0.0.1:9/v1"], "no shadow serve at http://127.0.0.1:9/v1"),
], ids=["no-runs", "one-output-token", "negative-pause", "url-without-scheme", "plot-folder", "no-server"])
def test_ab_refuses_bad_input(workdir, args, message):
    refused(["ab", *args], workdir, message)


@pytest.mark.slow
def test_a_bad_input_in_a_real_process_is_one_line(workdir):
    """The console script itself (no CliRunner): one line, exit 2, nothing written."""
    before = tree(workdir)
    done = subprocess.run([sys.executable, "-c", "from shadow.cli.main import main; main()", "read-rate",
                           "--decode-tokens", "-4", "--plot", "rate.png"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip() == "error: --decode-tokens must be >= 1 (got -4)"
    assert done.stdout == "" and tree(workdir) == before


def test_an_internal_error_is_one_line_and_exit_3(workdir, monkeypatch):
    """An injected bug in the library: one line and exit 3; the traceback only under --debug or
    SHADOW_DEBUG (still exit 3: 1 means only that the check failed)."""
    import shadow.core.store

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(shadow.core.store, "check_folder", broken)
    plain = runner.invoke(app, ["store", "folder"])
    assert plain.exit_code == 3 and "Traceback" not in plain.output
    assert plain.stderr.strip().splitlines() == [
        "internal error: RuntimeError: injected (`shadow --debug ...` shows the traceback)"]
    for args, env in ((["--debug", "store", "folder"], {}), (["store", "folder"], {"SHADOW_DEBUG": "1"})):
        debug = runner.invoke(app, args, env=env)
        assert debug.exit_code == 3 and "Traceback (most recent call last)" in debug.stderr
        assert debug.stderr.strip().splitlines()[-1] == "internal error: RuntimeError: injected"


def test_ctrl_c_exits_130(workdir, monkeypatch):
    import shadow.core.store

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(shadow.core.store, "check_folder", interrupted)
    result = runner.invoke(app, ["store", "folder"])
    assert result.exit_code == 130 and result.stderr.strip() == "interrupted"


def test_write_csv_is_a_pandas_table(tmp_path):
    import pandas as pd

    rows = [{"arm": "idle only", "fresh_pct": 8.4, "tried": [[0.01, 96.9]]}, {"arm": "idle + 2% share", "fresh_pct": 99.8,
                                                                             "tried": []}]
    write_csv(tmp_path / "t.csv", rows)
    back = pd.read_csv(tmp_path / "t.csv")
    assert list(back.columns) == ["arm", "fresh_pct", "tried"] and back["fresh_pct"].tolist() == [8.4, 99.8]


# ------------------------------------------------------------------------------------------------
# shadow ab against a real embedded `shadow serve --model tiny` on loopback


@pytest.fixture()
def embedded(tiny):
    from serving import running

    with running(status_timing={"quiet_s": 0.0, "thinking_from_s": 0.0}) as pair:
        yield pair


@pytest.mark.slow
def test_ab_with_the_voice_switches_shadow_and_voice_per_arm_and_back(embedded, tmp_path):
    """--voice: the off runs have shadow and voice off and ask for no status lines (so they get
    none); the on runs have both on and send Open WebUI's header; the switch is as it was after."""
    client, service = embedded
    client.post("/v1/shadow/switch", json={"on": True, "voice": True})
    base = str(client.base_url).rstrip("/") + "/v1"
    csv_path = tmp_path / "ab.csv"
    result = runner.invoke(app, ["ab", "--url", base, "--voice", "--prompt-tokens", "300", "--output-tokens", "5",
                                 "--runs", "2", "--pause", "0", "--gate-pct", "1000", "--csv", str(csv_path),
                                 "--json", "--allow-insignificant"])  # two pairs: not significant, and said so
    assert result.exit_code == 0, result.output
    doc = last_json(result.output)
    assert doc["voice"] is True and doc["runs"] == 2 and doc["passed"] is True
    runs = doc["per_run"]
    assert [r["arm"] for r in runs] == ["off", "on", "on", "off"]
    assert all(r["voice"] is (r["arm"] == "on") for r in runs)  # as the server's switch answered
    assert all(r["tokens"] == 5 for r in runs)  # status lines are never counted as tokens
    assert all(r["lines"] == 0 for r in runs if r["arm"] == "off") and doc["status_lines"]["off"] == 0
    assert all(r["share_s"] == 0 for r in runs if r["arm"] == "off")
    for r in runs:  # where the longest gap and the first line came, after the first token
        assert (r["line_at_s"] is None) == (r["lines"] == 0)
        assert 0 < r["itl_max_at_s"] <= (r["tokens"] - 1) / r["decode_tok_s"] + 1e-6
        assert abs(r["itl_max_at"] - time.time()) < 600
        assert 0 <= r["gaps_over_10ms"] <= r["tokens"] - 1
    assert doc["itl"]["on"]["gaps_over_10ms"] == sum(r["gaps_over_10ms"] for r in runs if r["arm"] == "on")
    for arm in ("off", "on"):  # the server's own long gaps, each inside its run, counted by place
        kept = [g for r in runs if r["arm"] == arm for g in r["server_gaps"]]
        assert all(g["place"] in ("round", "write") and g["ms"] >= 10 for g in kept)
        assert doc["server_gaps"][arm] == {p: sum(g["place"] == p for g in kept) for p in ("round", "write")}
    assert service.shared.switch.shadow is True and service.shared.switch.voice is True  # switched back
    assert csv_path.read_text().splitlines()[0].startswith("arm,pair,ttft_s,decode_tok_s,tokens,fields,share_s,lines,voice")


@pytest.mark.slow
def test_ab_sets_the_switch_back_after_an_error(embedded, workdir):
    """The server refuses the first run (max_tokens over its limit) after the shadow was switched
    off: exit 2 with the server's reason on one line, and the shadow is on again."""
    client, service = embedded
    base = str(client.base_url).rstrip("/") + "/v1"
    result = runner.invoke(app, ["ab", "--url", base, "--voice", "--output-tokens", "100000", "--runs", "1",
                                 "--pause", "0"])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: the server refused the request (400)") and "max_tokens" in line
    assert service.shared.switch.shadow is True and service.shared.switch.voice is True


@pytest.mark.slow
def test_ab_sets_the_switch_back_on_ctrl_c(embedded, tokenizer):
    """Ctrl-C (a KeyboardInterrupt raised by the progress callback after the first, "off", run):
    the interrupt goes on, and the shadow is on again."""
    from shadow.offline.bench.ab import run_ab

    client, service = embedded
    base = str(client.base_url).rstrip("/") + "/v1"
    seen = []

    def interrupt(done, total, run):
        seen.append((run.arm, service.shared.switch.shadow))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_ab(base, tokenizer, 200, 3, 2, 0.0, progress=interrupt, voice=True, restore=(True, None))
    assert seen == [("off", False)] and service.shared.switch.shadow is True and service.shared.switch.voice is True


def test_doctor_says_ok_on_the_cpu(workdir):
    """The install check: packages, vocabulary, cache, device, kernels, and a short exactness run
    (two turns with a rollback and an ask, bit-equal to a fresh prefill)."""
    result = CliRunner().invoke(app, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    doc = last_json(result.output)
    assert doc["ok"] is True
    checks = {c["name"]: c for c in doc["checks"]}
    assert checks["exactness"]["ok"] is True and "bit-equal" in checks["exactness"]["detail"]
    assert checks["vocabulary"]["ok"] is True and checks["device"]["ok"] is True


def test_the_cpu_thread_default_is_one_on_small_machines():
    from shadow.cli.main import default_threads

    assert default_threads(1) == 1 and default_threads(2) == 1 and default_threads(16) == 8 and default_threads(6) == 3


@pytest.mark.slow
def test_the_first_use_of_a_preset_says_it_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("SHADOW_CACHE", str(tmp_path / "cache"))
    talk = tmp_path / "talk.jsonl"
    talk.write_text('{"role": "user", "content": "hello there"}\n{"role": "assistant", "content": "hi"}\n')
    args = ["verify-exact", "--model", "tiny", "--grid", "64", "--against-grid", "0", "--conversation", str(talk)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "first use of the 'tiny' preset" in result.output  # said on stderr before the checkpoint is written
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and "first use" not in again.output


@pytest.mark.slow
def test_check_engine_exits_1_and_names_each_request_an_engine_refused():
    """A real engine on loopback that answers /v1/models and refuses every completion with 400:
    check-engine says which requests failed and why, counts them, and exits 1 (never "ok")."""
    from engines import refusing_engine
    from serving import serving

    engine = refusing_engine({"error": {"message": "no such model", "type": "invalid_request_error"}}, 400)
    with serving(engine) as client:
        result = CliRunner().invoke(app, ["check-engine", f"{client.base_url}/v1", "--engine", "openai",
                                                "--long-words", "100", "--json"])
    assert result.exit_code == 1, result.output
    assert "failed: plain/whole #1: HTTP 400" in result.output and "14 failed" in result.output
    summary = json.loads(result.output.strip().splitlines()[-1])["summary"]
    assert summary["failed"] == summary["requests"] > 0 and summary["answered"] == 0


def test_check_engine_refuses_a_url_it_cannot_parse_in_one_line():
    result = CliRunner().invoke(app, ["check-engine", "http://127.0.0.1:44987v1"])
    assert result.exit_code == 2 and "no engine answers at" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("command", ["verify-exact", "serve"])
def test_a_model_name_no_file_system_can_take_is_one_line(command):
    result = CliRunner().invoke(app, [command, "--model", "a" * 300])
    assert result.exit_code == 2 and "no checkpoint folder can be named so" in result.output
    assert "Traceback" not in result.output
