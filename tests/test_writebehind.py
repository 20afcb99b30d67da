"""Host copies written to disk behind the reads (`core.writebehind`): the host tier's copies (one
leaving the tier later needs no write) and the copies of sessions leaving the device straight for
disk (they wait in host memory, within the staging bound, and come back from there while their
write is pending); a write on the store's thread always lands after the thread's own, a stop
flushes what is queued, and a process killed while it writes loses no session whose file was
acknowledged: real files, a real thread, a real SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from test_store import GRID, assert_same, fed, fingerprint

from shadow.core.hosttier import host_bytes
from shadow.core.reader import Reader, open_reader
from shadow.core.residency import GIB
from shadow.core.sessionfile import read_fields
from shadow.core.store import SessionStore, check_folder
from shadow.core.writebehind import Job, WriteBehind
from shadow.offline.verify import compare_states


@pytest.fixture()
def reader(tiny):
    return Reader(tiny.model, GRID)


def test_a_copy_moved_to_host_memory_is_written_behind_and_leaves_the_tier_without_a_second_write(reader, tmp_path):
    store = SessionStore(reader, "h", cap_gib=0, disk=tmp_path, host_cap_gib=1.0)
    before = fingerprint(fed(store, reader, "a"))
    fed(store, reader, "b", seed=2)
    store.settle(keep="b")  # a to host memory, its file queued
    assert store.host.peek("a") is not None
    store.behind.flush()
    store.settle(keep="b")  # collects what was written
    assert store.counters.written_behind == 1 and read_fields(store.path_of("a")).name == "a"
    written = store.counters.bytes_written
    assert store._host_out("a")  # the tier makes room: a leaves for disk
    assert store.counters.bytes_written == written and store.counters.host_to_disk == 1  # no second write
    assert_same(before, fingerprint(store.get("a")))  # from its file, bit for bit


def test_a_write_on_the_stores_thread_lands_after_the_write_behind_of_the_same_session(reader, tmp_path):
    """The thread is slow to write a's first copy; meanwhile a comes back, reads on, and is written
    on the store's thread: that file, the newer, is the one on disk."""
    store = SessionStore(reader, "h", cap_gib=0, disk=tmp_path, host_cap_gib=1.0)
    started, release = threading.Event(), threading.Event()
    write = store._write_job

    def slow(job: Job) -> int:
        started.set()
        release.wait(10)
        return write(job)

    store._write_job = slow
    a = fed(store, reader, "a")
    fed(store, reader, "b", seed=2)
    store.settle(keep="b")
    assert started.wait(10)  # the first copy of a is being written
    a = store.get("a")
    reader.feed_output(a, list(range(500, 500 + 2 * GRID)))
    reader.advance(a)
    newer = fingerprint(a)
    threading.Timer(0.3, release.set).start()
    assert store._write(a) is None  # waits for the thread's write, then writes the newer state
    assert read_fields(store.path_of("a")).committed == a.committed
    other = SessionStore(reader, "h", cap_gib=None, disk=tmp_path)
    assert_same(newer, fingerprint(other.get("a")))


def test_a_stop_flushes_what_is_queued_and_a_failed_write_behind_is_written_at_the_stop(reader, tmp_path):
    store = SessionStore(reader, "h", cap_gib=0, disk=tmp_path, host_cap_gib=1.0)
    fails = {"n": 1}
    write = store._write_job

    def flaky(job: Job) -> int:
        if fails["n"]:
            fails["n"] -= 1
            raise OSError(28, "No space left on device")
        return write(job)

    store._write_job = flaky
    sessions = {name: fingerprint(fed(store, reader, name, seed=k)) for k, name in enumerate("abc")}
    store.settle(keep="c")  # a and b to the host tier: a's write behind fails, b's is written
    assert store.close() == []  # the stop writes a from host memory, c from the device
    assert store.counters.write_failures == 1 and "behind" in store.counters.last_error
    rows = {r.session: r for r in check_folder(tmp_path)}
    assert set(rows) == set("abc") and all(r.valid for r in rows.values())
    again = SessionStore(reader, "h", cap_gib=None, disk=tmp_path)
    for name, before in sessions.items():
        assert_same(before, fingerprint(again.get(name)))


def gated(store: SessionStore) -> tuple[threading.Event, threading.Event]:
    """The store's writes behind wait for `release` once begun (`started` says one has)."""
    started, release = threading.Event(), threading.Event()
    write = store._write_job

    def slow(job: Job):
        started.set()
        release.wait(30)
        return write(job)

    store._write_job = slow
    return started, release


def test_a_session_spilled_from_the_device_is_written_behind_and_comes_back_from_its_copy_meanwhile(reader, tmp_path):
    store = SessionStore(reader, "h", cap_gib=0, disk=tmp_path)
    started, release = gated(store)
    try:
        before = fingerprint(fed(store, reader, "a"))
        fed(store, reader, "b", seed=2)
        store.settle(keep="b")  # a leaves the device at once: its copy waits in host memory for its write
        assert started.wait(10) and store.peek("a") is None and store.counters.spills == 1
        row = next(r for r in store.status() if r.name == "a")
        assert (row.tier, row.moving, row.resident) == ("host", "to disk", False) and not store.path_of("a").exists()
        assert store.totals()["staged_sessions"] == 1 and store.totals()["staged_bytes"] == row.bytes
        ahead = store.restore_ahead("a")  # brought back from the copy, not the file
        assert ahead is not None and ahead.copy is not None
        back = store.get("a", ahead)
        assert back is ahead.session and store.counters.restores == 1 and store.counters.back_before_written == 1
        assert_same(before, fingerprint(back))
    finally:
        release.set()
    store.flush()  # the write in flight when a came back lands whole: the file holds that copy
    assert read_fields(store.path_of("a")).committed == back.committed and store.totals()["staged_sessions"] == 0
    other = SessionStore(reader, "h", cap_gib=None, disk=tmp_path)
    assert_same(before, fingerprint(other.get("a")))


def test_copies_bound_for_disk_wait_within_the_staging_bound_and_one_past_it_is_written_at_once(reader, tmp_path):
    one = host_bytes(fed(SessionStore(reader, "h", cap_gib=None), reader, "probe")) / GIB
    store = SessionStore(reader, "h", cap_gib=0, disk=tmp_path / "staged", stage_cap_gib=one * 1.5)
    started, release = gated(store)
    try:
        for k, name in enumerate("abc"):
            fed(store, reader, name, seed=k)
        store.settle(keep="c")  # a waits for its write; b would pass the bound: it stays, past the cap
        assert started.wait(10) and store.peek("b") is not None and store.counters.stage_full == 1
    finally:
        release.set()
    store.flush()
    store.settle(keep="c")  # a's write landed: b leaves now
    store.flush()
    assert store.peek("b") is None and {r.session for r in check_folder(tmp_path / "staged")} == {"a", "b"}
    small = SessionStore(reader, "h", cap_gib=0, disk=tmp_path / "small", stage_cap_gib=one / 4)
    before = fingerprint(fed(small, reader, "a"))
    fed(small, reader, "b", seed=2)
    small.settle(keep="b")  # a is larger than the bound: written where the store runs, at once
    assert small.behind is None and read_fields(small.path_of("a")).name == "a" and small.counters.spills == 1
    assert_same(before, fingerprint(small.get("a")))


def test_a_stop_writes_every_session_spilled_behind_or_resident(reader, tmp_path):
    store = SessionStore(reader, "h", cap_gib=0, disk=tmp_path)
    started, release = gated(store)
    sessions = {}
    for k, name in enumerate("abcd"):
        sessions[name] = fingerprint(fed(store, reader, name, seed=k))
        store.settle(keep=name)  # each leaves in turn: its copy waits for the gated thread
    threading.Timer(0.3, release.set).start()
    assert store.close() == []
    rows = check_folder(tmp_path)
    assert {r.session for r in rows} == set("abcd") and all(r.valid for r in rows)
    again = SessionStore(reader, "h", cap_gib=None, disk=tmp_path)
    for name, before in sessions.items():
        assert_same(before, fingerprint(again.get(name)))


def test_the_thread_reports_every_error_and_ends_at_close():
    seen = []

    def write(job):
        if job.copy.name == "bad":
            raise RuntimeError("refused")
        seen.append(job.copy.name)
        return 1

    from shadow.core.reader import Session

    behind = WriteBehind(write)
    for name in ("a", "bad", "b"):
        behind.submit(Job(Session(name, state=None), None, 0.0))
    behind.close()
    done = behind.done()
    assert [w.name for w in done] == ["a", "bad", "b"] and seen == ["a", "b"]
    assert isinstance(done[1].error, RuntimeError) and done[0].error is None
    with pytest.raises(RuntimeError):
        behind.submit(Job(Session("c", state=None), None, 0.0))


CHURN = """
import sys
from shadow.core.reader import open_reader
from shadow.core.store import SessionStore
folder, grid, host = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
loaded, reader = open_reader("tiny", grid=grid)
store = SessionStore(reader, loaded.weights_hash, cap_gib=0, disk=folder, host_cap_gib=host)
told = set()
for turn in range(10_000):
    name = f"s{turn % 12}"
    s = store.get(name)
    reader.feed_output(s, [(turn * 7 + k) % 240_000 + 100 for k in range(grid)])
    reader.advance(s)
    store.settle(keep=name)
    written = store.counters.written_behind
    if written not in told:
        told.add(written)
        print("written", written, flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("host", [1.0, 0.0], ids=["host-tier", "device-to-disk"])
def test_a_kill_during_writes_behind_loses_no_session_whose_file_was_written(tmp_path, host):
    """A process churns 12 sessions past the cap (through the host tier, or straight from the
    device to disk), their copies written behind; it is killed (SIGKILL) once 20 files were
    acknowledged. Every file in the folder is whole and valid, none half written, and each
    restores to a state equal to a fresh prefill of its ids."""
    proc = subprocess.Popen([sys.executable, "-c", CHURN, str(tmp_path), str(GRID), str(host)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        acknowledged = 0
        while acknowledged < 20 and time.time() < deadline:
            line = proc.stdout.readline()
            assert line, "the churn ended early"
            if line.startswith("written "):
                acknowledged = int(line.split()[1])
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert acknowledged >= 20
    rows = check_folder(tmp_path)
    assert rows and all(r.valid for r in rows)  # temporary files of the write in flight are not sessions
    loaded, reader = open_reader("tiny", grid=GRID)
    store = SessionStore(reader, loaded.weights_hash, cap_gib=None, disk=tmp_path)
    for row in rows:
        s = store.get(row.session)
        assert s.committed > 0
        compared, mismatched, _ = compare_states(s.state, reader.prefill(s.ids[: s.committed]))
        assert compared > 0 and mismatched == []


def test_a_session_back_from_its_copy_before_its_write_is_as_its_file_would_give_it(reader, tmp_path):
    """An output held out of reading (`Session.hold`) is not in a session file: a session back from
    the disk tier's copy, before its file was read, holds none either, as a restore from the file."""
    store = SessionStore(reader, "h", cap_gib=0, disk=tmp_path)
    started, release = gated(store)
    try:
        a = fed(store, reader, "a")
        a.hold = len(a.ids)
        fed(store, reader, "b", seed=2)
        store.settle(keep="b")
        assert started.wait(10) and store.peek("a") is None
        back = store.get("a")
        assert back.hold is None and store.counters.back_before_written == 1
    finally:
        release.set()
    store.flush()
    assert SessionStore(reader, "h", cap_gib=None, disk=tmp_path).get("a").hold is None  # as from the file
