"""Restores started when a request arrives (`server.restores`): a session past the device cap, in
the host tier or on disk, is brought back on a thread of its own as soon as a request names it,
and the store takes it when the prompt is fed, bit for bit; a copy that changed meanwhile is not
taken. A real service on loopback (embedded generator), real files."""

from __future__ import annotations

import pytest

from serving import GRID, assert_exact, long_text, running, settled
from shadow.core.hosttier import HostTier
from shadow.core.reader import open_reader
from shadow.core.residency import GIB
from shadow.core.store import SessionStore
from shadow.offline.verify import compare_states
from shadow.server.restores import RestoresAhead

pytestmark = pytest.mark.slow  # real servers


def turn(client, name: str, prompt: str):
    r = client.post("/v1/completions", headers={"x-session-id": name}, json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_session_past_the_cap_comes_back_from_its_tier_when_its_request_arrives(tiny, tmp_path, tier):
    with running(disk=tmp_path) as (client, service):
        service.store.cap = 0  # every session leaves the device after its turn
        if tier == "host":
            service.store.host = HostTier(GIB)
        first = {"a": long_text(1, 120), "b": long_text(2, 120)}
        for name, prompt in (("a", first["a"]), ("b", first["b"]), ("a", first["a"] + " " + long_text(3, 60)),
                             ("b", first["b"] + " " + long_text(4, 60))):  # each session's next turn extends it
            turn(client, name, prompt)
            settled(service)
        def flushed() -> None:  # the files written behind are on disk, their copies out of host memory
            with service.state_lock:
                service.store.flush()

        service.device.run(flushed)
        status = client.get("/v1/shadow/status").json()
        rows = {row["name"]: row for row in status["sessions"]}
        assert rows["a"]["tier"] == tier  # (b, worked on last, is kept on the device)
        ahead = status["restores_ahead"]
        assert ahead["started"] == 2 and ahead["taken"] == 2 and ahead["missed"] == 0
        for name in ("a", "b"):
            assert_exact(service, name)  # brought back, read on, and equal to a fresh prefill


def test_a_session_that_changed_while_it_came_back_is_not_taken(tiny, tmp_path):
    loaded, reader = open_reader("tiny", grid=GRID)
    store = SessionStore(reader, loaded.weights_hash, cap_gib=0, disk=tmp_path, host_cap_gib=1)
    s = store.get("a")
    reader.feed_prompt(s, list(range(100, 100 + 3 * GRID)))
    reader.advance(s)
    store.get("b")
    store.settle(keep="b")  # a goes to the host tier
    ahead = RestoresAhead()
    try:
        future = ahead.start(store, "a")
        brought = ahead.take(future, "a")
        assert brought is not None and brought.copy is not None
        moved = store.get("a")  # the prompt of another request fed it first: the copy left the tier
        reader.feed_output(moved, [7] * GRID)
        reader.advance(moved)
        store.settle(keep="b")  # and it is back in the tier, a newer copy
        again = store.get("a", brought)
        assert again is not brought.session and again.committed == 4 * GRID  # the newer copy, not the old one
        fresh = reader.prefill(again.ids[: again.committed])
        compared, mismatched, _ = compare_states(again.state, fresh)
        assert compared > 0 and mismatched == []
        assert ahead.start(store, "a") is None  # resident: nothing to bring back
    finally:
        ahead.close()


def test_no_restore_starts_for_a_session_still_leaving_the_device(tiny, tmp_path, monkeypatch):
    """A session whose copy out is in flight is still on the device: a request for it starts no
    restore (the store keeps it where it is when its prompt is fed)."""
    import shadow.core.hosttier as hosttier
    import shadow.core.store as store_module

    class InFlight:  # stands for the copy's CUDA event on the CPU: not done until synchronized
        landed = False

        def query(self):
            return self.landed

        def synchronize(self):
            self.landed = True

    def held(session, stream=None, pool=None):
        move = hosttier.move_to_host(session, stream, pool)
        move.event = InFlight()
        return move

    monkeypatch.setattr(store_module, "move_to_host", held)
    loaded, reader = open_reader("tiny", grid=GRID)
    store = SessionStore(reader, loaded.weights_hash, cap_gib=0, disk=tmp_path, host_cap_gib=1)
    a = store.get("a")
    reader.feed_prompt(a, list(range(100, 100 + 2 * GRID)))
    reader.advance(a)
    store.get("b")
    store.settle(keep="b")
    assert store.moving("a") and store.holds("a")
    ahead = RestoresAhead()
    try:
        assert ahead.start(store, "a") is None and ahead.counts.started == 0
    finally:
        ahead.close()
    assert store.get("a") is a and not store.moving("a")


def left_the_device(store: SessionStore, reader) -> None:
    """Session "a" read three chunks deep, then moved off the device (b kept there)."""
    a = store.get("a")
    reader.feed_prompt(a, list(range(100, 100 + 3 * GRID)))
    reader.advance(a)
    del a
    store.get("b")
    store.settle(keep="b")


@pytest.mark.parametrize("tier", ["staging", "host"])
def test_a_copy_brought_back_is_taken_though_its_file_was_written_meanwhile(tiny, tmp_path, tier):
    """A session brought back from its host copy (in the host tier, or waiting in staging for its
    write) whose copy has since left host memory because its file was written: the file holds that
    copy, so the store takes what was brought back (no second restore from the file), bit for bit."""
    loaded, reader = open_reader("tiny", grid=GRID)
    store = SessionStore(reader, loaded.weights_hash, cap_gib=0, disk=tmp_path,
                         host_cap_gib=1 if tier == "host" else 0)
    left_the_device(store, reader)
    if tier == "host":
        store.flush()  # its file written behind
    copy = store.host.peek("a") if tier == "host" else store._staged.get("a")
    ahead = store.restore_ahead("a")
    assert copy is not None and ahead is not None and ahead.copy is copy
    if tier == "host":  # the tier's copy leaves for disk: its file was written behind, so it just goes
        assert store._host_out("a") and store.host.peek("a") is None
    else:
        store.flush()  # the write lands and the copy leaves staging
        assert "a" not in store._staged
    restores = store.counters.restores
    got = store.get("a", ahead)
    assert got is ahead.session and store.counters.restores == restores + 1
    fresh = reader.prefill(got.ids[: got.committed])
    compared, mismatched, _ = compare_states(got.state, fresh)
    assert compared > 0 and mismatched == []


def test_a_copy_brought_back_is_not_taken_once_a_newer_version_was_written(tiny, tmp_path):
    """A copy brought back from staging, then the session fed by another request, read on, moved
    out again and its newer file written: the copy brought back is not taken (the newer is)."""
    loaded, reader = open_reader("tiny", grid=GRID)
    store = SessionStore(reader, loaded.weights_hash, cap_gib=0, disk=tmp_path)
    left_the_device(store, reader)
    ahead = store.restore_ahead("a")  # from its copy waiting in staging
    assert ahead is not None and ahead.copy is not None
    moved = store.get("a")  # another request fed it first, read on, and it left again
    reader.feed_output(moved, [7] * GRID)
    reader.advance(moved)
    del moved
    store.settle(keep="b")
    store.flush()  # its newer file written, no copy of it left in memory
    assert "a" not in store._staged
    newer = store.get("a", ahead)
    assert newer is not ahead.session and newer.committed == 4 * GRID
