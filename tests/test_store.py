"""The session store: exact spill and restore, LRU, retention, bad files refused, atomic writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open
from test_sessionfile_attacks import rebuild, split

import shadow.core.sessionfile as sessionfile
from shadow.model import load_model
from shadow.core.reader import Reader
from shadow.core.sessionfile import read_header, read_session, write_session
from shadow.core.store import SessionStore, check_folder, session_bytes

GRID = 64


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 248044, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture()
def reader(tiny):
    return Reader(tiny.model, GRID)


def fed(store: SessionStore, reader: Reader, name: str, n: int = 300, seed: int = 0):
    s = store.get(name)
    reader.feed_prompt(s, ids(n, seed))
    reader.advance(s)
    reader.feed_output(s, ids(40, seed + 100))
    reader.advance(s)
    return s


def fingerprint(session) -> dict:
    out = {k: v.clone() for k, v in session.state.tensors().items()}
    out["ids"] = list(session.ids)
    out["checkpoints"] = [(c.position, [t.clone() for t in (*c.conv, *c.recurrent)]) for c in session.checkpoints]
    out["marks"] = list(session.marks)
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if key == "checkpoints":
            assert [p for p, _ in a[key]] == [p for p, _ in b[key]]
            for (_, x), (_, y) in zip(a[key], b[key]):
                assert all(torch.equal(u, v) for u, v in zip(x, y))
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def test_spill_and_restore_are_bit_exact_and_reading_continues(reader, tmp_path):
    store = SessionStore(reader, "h", cap_gib=0, disk=tmp_path)
    a = fed(store, reader, "a", seed=1)
    before = fingerprint(a)
    fed(store, reader, "b", seed=2)
    store.settle(keep="b")
    assert store.counters.spills == 1 and "a" not in store._resident
    back = store.get("a")
    assert store.counters.restores == 1
    assert_same(before, fingerprint(back))
    reader.feed_output(back, ids(200, 3))
    reader.advance(back)
    fresh = reader.prefill(back.ids[: back.committed])
    assert all(torch.equal(x, fresh.tensors()[k]) for k, x in back.state.tensors().items())


def test_a_file_read_ahead_is_taken_by_get_only_while_it_is_still_the_file(reader, tmp_path):
    """`restore_ahead` reads a spilled session without changing the store; `get` takes it (one
    restore counted, bit-equal) while its file is unchanged, and reads the file again when the file
    was written anew in between."""
    store = SessionStore(reader, "h", cap_gib=0, disk=tmp_path)
    before = fingerprint(fed(store, reader, "a", seed=1))
    fed(store, reader, "b", seed=2)
    store.settle(keep="b")
    assert store.restore_ahead("b") is None  # resident: nothing to read
    assert store.restore_ahead("nobody") is None  # no file
    ahead = store.restore_ahead("a")
    assert ahead is not None and store.counters.restores == 0 and "a" not in store._resident
    back = store.get("a", ahead)
    assert back is ahead.session and store.counters.restores == 1
    assert_same(before, fingerprint(back))

    reader.feed_output(back, ids(70, 4))  # a changes, and its file is written anew after the read ahead
    reader.advance(back)
    changed = fingerprint(back)
    store.get("b")
    store.settle(keep="b")
    stale = store.restore_ahead("a")
    store.get("a")
    store.get("b")
    store.settle(keep="b")  # "a" spilled again: its file is a new one
    again = store.get("a", stale)
    assert again is not stale.session and store.counters.restores == 3
    assert_same(changed, fingerprint(again))


def test_least_recently_used_goes_first(reader, tmp_path):
    store = SessionStore(reader, "h", cap_gib=None, disk=tmp_path)
    for name in "abc":
        fed(store, reader, name)
    store.get("a")  # a is now the most recent; b is the least recent
    store.cap = 2 * session_bytes(store.get("c"))  # room for two; c touched last
    store.settle(keep="c")
    assert sorted(store._resident) == ["a", "c"]
    assert [r.name for r in store.status() if not r.resident] == ["b"]


def test_without_disk_past_the_cap_is_dropped_and_read_again(reader):
    store = SessionStore(reader, "h", cap_gib=0)
    fed(store, reader, "a")
    fed(store, reader, "b", seed=5)
    store.settle(keep="b")
    assert store.counters.drops == 1
    again = store.get("a")
    assert again.committed == 0 and again.ids == []


def test_close_writes_every_resident_session(reader, tmp_path):
    store = SessionStore(reader, "h", cap_gib=None, disk=tmp_path)
    fed(store, reader, "a")
    fed(store, reader, "b", seed=3)
    store.close()
    rows = check_folder(tmp_path, reader, "h")
    assert sorted(r.session for r in rows) == ["a", "b"] and all(r.valid for r in rows)


def test_status_reports_resident_and_spilled(reader, tmp_path):
    store = SessionStore(reader, "h", cap_gib=0, disk=tmp_path, clock=lambda: 1000.0)
    fed(store, reader, "a", n=300)
    fed(store, reader, "b", n=100, seed=4)
    store.settle(keep="b")
    rows = {r.name: r for r in store.status()}
    assert not rows["a"].resident and rows["b"].resident
    assert (rows["a"].committed, rows["a"].pending) == (320, 20)
    assert rows["a"].checkpoints == 1 and rows["a"].last_use == 1000.0 and rows["a"].bytes > 0


def test_status_polls_read_each_unchanged_file_header_once(reader, tmp_path, monkeypatch):
    """Status runs under the service's lock: a poll reads the header of a file only where the file
    changed since the last one (a new file, one rewritten), never every spilled file every time."""
    import shadow.core.store as store_module

    store = SessionStore(reader, "h", cap_gib=0, disk=tmp_path)
    for i, name in enumerate("abc"):
        fed(store, reader, name, seed=i)
    store.settle()
    store.flush()
    read = []
    real = store_module.read_fields
    monkeypatch.setattr(store_module, "read_fields", lambda path, key=None: read.append(path.name) or real(path, key))
    first = [(r.name, r.tier) for r in store.status()]
    assert first == [("a", "disk"), ("b", "disk"), ("c", "disk")] and len(read) == 3
    store.totals(), store.status(), store.names()  # polls again: nothing changed, nothing read
    assert len(read) == 3
    fed(store, reader, "a", n=400, seed=7)  # back, read further, written again: a new file
    store.settle()
    store.flush()
    rows = {r.name: r for r in store.status()}
    assert read[3:] == [store.path_of("a").name] and rows["a"].committed == 384
    store.path_of("b").write_bytes(b"not a session file")  # a file changed in place: read again, refused
    assert "b" not in {r.name for r in store.status()} and read[-1] == store.path_of("b").name


def test_unread_is_what_the_store_holds_unread_wherever_the_session_is(reader, tmp_path):
    """`unread`: a session's ids not read yet (a held output counted), resident, in host memory or on
    disk; None for a session the store does not hold. It moves nothing."""
    from shadow.core.hosttier import HostTier

    store = SessionStore(reader, "h", cap_gib=None, disk=tmp_path)
    s = fed(store, reader, "a", n=300)  # 340 ids, 320 read
    assert store.unread("a") == 20 and store.unread("nobody") is None
    reader.feed_output(s, ids(100, 9))
    s.hold = 340  # an output held out of reading still counts as unread
    assert store.unread("a") == 120
    store.cap, store.host = 0, HostTier(1 << 30)
    store.settle()
    assert store.peek("a") is None and "a" in store.host and store.unread("a") == 120
    assert store.get("a").pending == 120  # back from host memory, then to disk alone
    store.host = None
    store.settle()
    store.flush()  # now on disk only: its file's header says it
    assert store.peek("a") is None and store.path_of("a").exists() and store.unread("a") == 120
    assert store.peek("a") is None  # still on disk: nothing moved


def test_retention_by_age_and_disk_cap(reader, tmp_path):
    now = [time.time()]
    store = SessionStore(reader, "h", cap_gib=None, disk=tmp_path, clock=lambda: now[0])
    for i, name in enumerate("abc"):
        fed(store, reader, name, seed=i)
    store.close()
    paths = {n: store.path_of(n) for n in "abc"}
    os.utime(paths["a"], (now[0] - 49 * 3600,) * 2)  # past 48 h
    os.utime(paths["b"], (now[0] - 3600,) * 2)
    store.sweep()
    assert not paths["a"].exists() and paths["b"].exists() and paths["c"].exists()
    store.disk_cap = paths["c"].stat().st_size  # room for one file: the oldest (b) goes
    store.sweep()
    assert not paths["b"].exists() and paths["c"].exists()
    assert store.counters.removed == 2


def _truncate(path, reader):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path, reader):
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x40
    path.write_bytes(bytes(data))


def _resigned(path, change):
    """Rewrite the file with `change(meta, tensors)` applied and its digests made valid again."""
    meta, _, _ = split(path.read_bytes())
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    change(meta, tensors)
    path.write_bytes(rebuild(meta, tensors))


def _version(path, reader):
    _resigned(path, lambda m, t: m.update(version="99"))


def _not_a_session(path, reader):
    _resigned(path, lambda m, t: m.update(format="something-else"))


def _checkpoint_of_another_shape(path, reader):
    """A checkpoint tensor cut short, its digests made to match: valid bytes, wrong shape."""
    def cut(meta, tensors):
        name = next(k for k in tensors if k.startswith("checkpoints.") and k.endswith(".conv"))
        tensors[name] = tensors[name][:-1].contiguous()
    _resigned(path, cut)


BAD = {
    "truncated": (_truncate, "truncated"),
    "flipped-byte": (_flip, "data digest mismatch"),
    "future-version": (_version, "format version '99'"),
    "foreign-format": (_not_a_session, "not a shadow session file"),
    "checkpoint-shape": (_checkpoint_of_another_shape, "this model needs"),
}


@pytest.mark.parametrize("kind", list(BAD) + ["other-weights", "other-grid", "other-arithmetic"])
def test_bad_files_are_refused_reported_once_and_reread(reader, tiny, tmp_path, kind, caplog):
    writer = SessionStore(reader, "h", cap_gib=None, disk=tmp_path)
    original = fed(writer, reader, "a")
    final_ids = list(original.ids)
    writer.close()
    path = writer.path_of("a")
    weights, grid_reader = "h", reader
    if kind in BAD:
        BAD[kind][0](path, reader)
        expected = BAD[kind][1]
    elif kind == "other-weights":
        weights, expected = "another", "another model"
    elif kind == "other-arithmetic":  # the same weights, computed in another dtype
        bf16 = load_model("tiny", dtype=torch.bfloat16)
        grid_reader, expected = Reader(bf16.model, GRID), "other kernels"
    else:
        grid_reader, expected = Reader(tiny.model, 2 * GRID), "another grid"
    store = SessionStore(grid_reader, weights, cap_gib=None, disk=tmp_path)
    with caplog.at_level("WARNING", logger="shadow.core.store"):
        s = store.get("a")
    assert s.committed == 0 and s.ids == []  # nothing served from the file
    assert len(store.counters.rejected) == 1 and expected in store.counters.rejected[0][1]
    assert any(expected in r.getMessage() for r in caplog.records)
    assert not path.exists() and path.with_name(path.name + ".rejected").exists()
    store.get("a")  # asked again: not reported twice
    assert len(store.counters.rejected) == 1
    grid_reader.feed_prompt(s, final_ids)  # read again from its ids
    grid_reader.advance(s)
    fresh = grid_reader.prefill(s.ids[: s.committed])
    assert all(torch.equal(x, fresh.tensors()[k]) for k, x in s.state.tensors().items())
    listed = {r.file: r for r in check_folder(tmp_path)}
    assert not listed[path.name + ".rejected"].valid


KILL_WRITER = r"""
import sys, torch
from shadow.model import load_model
from shadow.core.reader import Reader
from shadow.core.store import SessionStore
reader = Reader(load_model("tiny").model, 64)
store = SessionStore(reader, "h", cap_gib=None, disk=sys.argv[1])
s = store.get("big")
reader.feed_prompt(s, torch.randint(0, 248044, (20000,)).tolist())
reader.advance(s)
print("ready", flush=True)
n = 0
while True:
    s.rollbacks = n  # each write differs from the last
    store.close()
    n += 1
"""


@pytest.mark.slow
def test_sigkill_during_writes_never_leaves_a_file_read_as_valid_but_broken(reader, tmp_path):
    """A writer rewriting one session in a loop is killed with SIGKILL until a kill has landed
    mid-write (a temporary file left behind); every time, the file there is complete and valid."""
    killed_mid_write = 0
    for attempt in range(30):  # a kill lands mid-write about one time in four
        folder = tmp_path / f"kill{attempt}"
        proc = subprocess.Popen([sys.executable, "-c", KILL_WRITER, str(folder)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.1 + 0.037 * (attempt % 12))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed_mid_write += any(p.name.endswith(".tmp") for p in folder.iterdir())
        store = SessionStore(reader, "h", cap_gib=None, disk=folder)
        assert not any(p.name.endswith(".tmp") for p in folder.iterdir())  # cleaned, never read
        rows = check_folder(folder, reader, "h")
        assert all(r.valid for r in rows), rows
        if rows:  # the old file or the new one, complete
            s = store.get("big")
            assert s.committed == 19968 and len(s.ids) == 20000
        if killed_mid_write and attempt >= 2:
            break
    assert killed_mid_write, "no kill landed during a write; the test proved nothing"


def test_header_names_the_session_and_identity(reader, tmp_path):
    store = SessionStore(reader, "hash-x", cap_gib=None, disk=tmp_path, model="tiny")
    fed(store, reader, "conv/1")
    store.close()
    meta = read_header(store.path_of("conv/1"))
    assert meta["name"] == "conv/1" and meta["weights_hash"] == "hash-x" and meta["grid"] == "64"
    assert json.loads(meta["checkpoints"]) == [256] and meta["model"] == "tiny"


def test_a_session_through_rollbacks_forks_and_a_backlog_round_trips_exactly(reader, tmp_path):
    """A real history (turns, a divergence back to a checkpoint, an ask, a backlog of more than a
    chunk) makes a file every field check accepts, and it restores bit for bit."""
    store = SessionStore(reader, "h", cap_gib=0, disk=tmp_path)
    s = store.get("a")
    prompt = ids(200, 1)
    for turn in range(4):
        reader.feed_prompt(s, prompt)
        reader.advance(s)
        out = ids(70, 10 + turn)
        reader.feed_output(s, out)
        reader.advance(s)
        prompt = prompt + out + ids(50, 20 + turn)
    assert len(s.checkpoints) >= 3
    edited = list(prompt)
    edited[300] = (edited[300] + 1) % 248044  # a template that rewrote an earlier turn
    feed = reader.feed_prompt(s, edited)
    assert feed.rolled_back_to is not None and s.rollbacks == 1
    reader.advance(s, max_chunks=1)  # a backlog of more than a chunk stays
    reader.feed_output(s, ids(150, 99))
    reader.ask(s, ids(5, 7), [32, 33])  # a fork leaves no trace
    assert s.pending > GRID and s.marks
    before = fingerprint(s)
    store.get("b")
    store.settle(keep="b")
    back = store.get("a")
    assert store.counters.rejected == [] and store.counters.restores == 1
    assert_same(before, fingerprint(back))
    assert (back.rollbacks, back.ids_reread) == (s.rollbacks, s.ids_reread)
    reader.advance(back)
    fresh = reader.prefill(back.ids[: back.committed])
    assert all(torch.equal(x, fresh.tensors()[k]) for k, x in back.state.tensors().items())


def test_store_command_exits_0_when_every_file_is_valid_1_when_one_is_not_2_on_bad_input(tiny, tmp_path):
    from typer.testing import CliRunner

    from shadow.cli.main import app

    runner = CliRunner()
    reader = Reader(tiny.model, GRID)
    store = SessionStore(reader, tiny.weights_hash, cap_gib=None, disk=tmp_path)
    for name in ("a", "[b]"):
        fed(store, reader, name)
    assert store.close() == []
    (tmp_path / "model.safetensors").write_bytes(b"foreign")  # not listed, not counted
    for args in ([], ["--model", "tiny", "--grid", str(GRID)]):
        ok = runner.invoke(app, ["store", str(tmp_path), *args, "--json"])
        assert ok.exit_code == 0, ok.output
        assert json.loads(ok.output.strip().splitlines()[-1])["valid"] == 2
    assert runner.invoke(app, ["store", str(tmp_path), "--model", "tiny"]).exit_code == 1  # another grid
    path = store.path_of("a")
    path.write_bytes(path.read_bytes()[:-1])
    bad = runner.invoke(app, ["store", str(tmp_path), "--json"])
    assert bad.exit_code == 1 and "Traceback" not in bad.output
    doc = json.loads(bad.output.strip().splitlines()[-1])
    assert (doc["valid"], doc["invalid"]) == (1, 1)
    assert next(f for f in doc["files"] if not f["valid"])["reason"].startswith("truncated")
    for args in (["store", str(tmp_path / "nope")], ["store", str(tmp_path), "--model", "no-such-model"],
                 ["store", str(path)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output


def test_disk_cap_none_keeps_every_file_and_totals_report_failures(reader, tmp_path):
    store = SessionStore(reader, "h", cap_gib=0, disk=tmp_path, disk_cap_gib=None)
    for i, name in enumerate("abc"):
        fed(store, reader, name, seed=i)
        store.settle(keep=name)
    store.flush()  # the files written behind are on disk
    t = store.totals()
    assert t["files"] == 2 and t["disk_cap_bytes"] is None and store.counters.removed == 0
    assert (t["write_failures"], t["unwritten_sessions"], t["last_error"]) == (0, 0, None)


# the I/O: blocks, O_DIRECT or the page cache, threads ------------------------------------------


@pytest.mark.parametrize("direct,workers,block", [(True, None, 4096), (False, 1, 16 << 10), (True, 3, 8 << 20)])
def test_write_and_read_are_bit_exact_whatever_the_blocks_and_threads(reader, tmp_path, monkeypatch, direct, workers, block):
    monkeypatch.setattr(sessionfile, "BLOCK_BYTES", block)
    store = SessionStore(reader, "h", cap_gib=None, disk=tmp_path)
    s = fed(store, reader, "a", n=1200)
    identity = store.identity
    path = tmp_path / "a.safetensors"
    written = write_session(path, s, identity, 5.0, direct=direct, workers=workers)
    assert written == path.stat().st_size and sessionfile.read_fields(path).block_bytes == block
    back = read_session(path, identity, reader.model.new_state(), direct=direct, workers=workers)
    assert_same(fingerprint(s), fingerprint(back))


def test_a_state_of_several_kv_heads_goes_to_and_from_its_own_buffers_bit_for_bit(tmp_path, monkeypatch):
    """The 0.8B shape (KV of two heads, cut to the valid rows: one piece per head, not one copy of
    the whole tensor), random values, read back into a fresh state's own tensors in small blocks."""
    from dataclasses import replace

    from shadow.core.reader import Session
    from shadow.model.config import PRESETS
    from shadow.model.state import ModelState

    monkeypatch.setattr(sessionfile, "BLOCK_BYTES", 1 << 20)
    config = replace(PRESETS["qwen3.5-0.8b"], num_hidden_layers=8, layer_types=())
    gen = torch.Generator().manual_seed(3)
    state = ModelState(config, torch.bfloat16)
    for layer in state.attention:
        layer.reserve(192)
        layer.k.copy_(torch.randn(layer.k.shape, generator=gen))
        layer.v.copy_(torch.randn(layer.v.shape, generator=gen))
    for layer in state.delta:
        layer.conv.copy_(torch.randn(layer.conv.shape, generator=gen))
        layer.recurrent.copy_(torch.randn(layer.recurrent.shape, generator=gen))
    state.length = 192
    assert not state.tensors()["layers.3.k"].is_contiguous()
    snap = state.snapshot()
    snap.position = 128
    s = Session("big", state, ids=ids(200, 1), checkpoints=[snap], marks=[])
    identity = sessionfile.Identity("h", 64, "x")
    write_session(tmp_path / "s.safetensors", s, identity, 0.0)
    fresh = ModelState(config, torch.bfloat16)
    back = read_session(tmp_path / "s.safetensors", identity, fresh)
    assert back.state is fresh and back.ids == s.ids
    assert_same(fingerprint(s), fingerprint(back))
    with safe_open(str(tmp_path / "s.safetensors"), framework="pt") as f:  # still a plain safetensors file
        assert torch.equal(f.get_tensor("layers.3.v"), state.tensors()["layers.3.v"])


# spill or drop ----------------------------------------------------------------------------------


def test_a_session_past_the_cap_is_spilled_whenever_a_disk_holds_it_and_says_why(reader, tmp_path):
    """A restore costs disk time and a copy, reading again costs the shadow's device time: with a
    disk every session past the cap is spilled, however slow the disk, and dropped only without."""
    store = SessionStore(reader, "h", cap_gib=0, disk=tmp_path)
    store.restore_rate.warm(1e-9)  # restores crawl
    before = fingerprint(fed(store, reader, "a"))
    fed(store, reader, "b", seed=2)
    store.settle(keep="b")
    store.flush()
    row = next(r for r in store.status() if r.name == "a")
    assert not row.resident and row.tier == "disk" and row.left_memory == "spilled: past the device cap"
    assert (store.counters.spills, store.counters.drops) == (1, 0)
    assert_same(before, fingerprint(store.get("a")))
    alone = SessionStore(reader, "h", cap_gib=0)
    fed(alone, reader, "a")
    fed(alone, reader, "b", seed=2)
    alone.settle(keep="b")
    assert alone.peek("a") is None and not alone.holds("a") and alone.counters.drops == 1
    assert alone.totals()["recent_drops"] == {"a": "dropped: no tier had room (no disk folder: --no-disk); its next turn reads it again"}

def test_measure_restore_times_a_scratch_session_and_leaves_nothing(reader, tmp_path):
    store = SessionStore(reader, "h", cap_gib=0, disk=tmp_path)
    rate = store.measure_restore(gib=0.002)
    assert rate > 0 and store.restore_rate.gib_per_s == pytest.approx(rate)
    assert list(tmp_path.iterdir()) == [] and store.counters.restores == 0
    assert SessionStore(reader, "h", cap_gib=0).measure_restore() is None  # no disk: nothing to measure


def test_store_command_checks_files_against_the_store_key(tiny, tmp_path):
    from typer.testing import CliRunner

    from shadow.cli.main import app

    reader = Reader(tiny.model, GRID)
    store = SessionStore(reader, tiny.weights_hash, cap_gib=None, disk=tmp_path, key="k1")
    fed(store, reader, "a")
    assert store.close() == []
    runner = CliRunner()
    cases = [([], {}, 0), (["--store-key", "k1"], {}, 0), (["--store-key", "k2"], {}, 1),
             ([], {"SHADOW_STORE_KEY": "k2"}, 1), (["--model", "tiny", "--grid", str(GRID), "--store-key", "k1"], {}, 0)]
    for args, env, code in cases:
        result = runner.invoke(app, ["store", str(tmp_path), "--json", *args], env=env)
        assert result.exit_code == code, (args, env, result.output)
        if code:
            assert "keyed digest mismatch" in json.loads(result.output.strip().splitlines()[-1])["files"][0]["reason"]


def test_serve_without_disk_writes_under_the_cache_folder_and_sweeps_only_its_own_files(reader, monkeypatch):
    """`shadow serve` without --disk spills to 'sessions' in the cache folder (here the test run's own
    $SHADOW_CACHE, never the user's): the disk cap and the sweeps hold there as in any folder, and
    nothing else in the cache (the random checkpoints, a foreign file, a link) is touched;
    --no-disk has none."""
    from shadow.model.checkpoint import cache_dir
    from shadow.server.http.build import store_for
    from shadow.server.settings import ServeSettings, StoreSettings

    monkeypatch.delenv("SHADOW_SERVE_DISK", raising=False)
    folder = cache_dir() / "sessions"
    assert StoreSettings().folder == folder and StoreSettings(no_disk=True, disk=folder).folder is None
    probe = SessionStore(reader, "h", cap_gib=None)
    one = sessionfile.file_bytes(fed(probe, reader, "probe")) / 2**30  # about a file of one of these sessions
    store = store_for(ServeSettings(store=StoreSettings(disk_cap_gib=one * 2.5)), reader, "h", cap_gib=0)
    assert store.disk == folder and folder.is_dir()
    foreign = {folder / "model.safetensors": b"weights", folder / ("ab" * 16 + ".safetensors"): b"not a session"}
    for path, data in foreign.items():
        path.write_bytes(data)
    (folder / ("cd" * 16 + ".safetensors")).symlink_to(cache_dir())
    checkpoints = sorted(p for p in cache_dir().rglob("*") if p.is_file() and folder not in p.parents)
    for k, name in enumerate("abcde"):
        fed(store, reader, name, seed=k)
        store.settle(keep=name)
    store.flush()
    assert all(path.read_bytes() == data for path, data in foreign.items()) and (folder / ("cd" * 16 + ".safetensors")).is_symlink()
    assert sorted(p for p in cache_dir().rglob("*") if p.is_file() and folder not in p.parents) == checkpoints
    own = [r.session for r in check_folder(folder) if r.valid]
    assert 0 < len(own) <= 2 and store.counters.removed >= 2  # the oldest past the disk cap, removed
    assert store_for(ServeSettings(store=StoreSettings(no_disk=True)), reader, "h").disk is None
