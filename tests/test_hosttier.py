"""The host tier between the device and the disk: moves bit for bit both ways, the oldest copies
to disk (or dropped) when it is full, a full host tier or a failed write degrading to the next
choice, a planned stop writing its copies, memory bounded under a churn of sessions."""

from __future__ import annotations

import re

import pytest
import torch
from test_store import GRID, assert_same, fed, fingerprint, ids

from shadow.core.hosttier import HostTier, host_bytes, to_host
from shadow.core.reader import Reader
from shadow.core.residency import GIB
from shadow.core.store import SessionStore, session_bytes


@pytest.fixture()
def reader(tiny):
    return Reader(tiny.model, GRID)


def one_session_gib(reader) -> float:
    """The host bytes of one session as `fed` makes it, in GiB."""
    probe = SessionStore(reader, "h", cap_gib=None)
    return host_bytes(fed(probe, reader, "probe")) / GIB


def test_a_session_moves_to_host_memory_and_back_bit_for_bit_and_reading_continues(reader):
    store = SessionStore(reader, "h", cap_gib=0, host_cap_gib=1.0)
    a = fed(store, reader, "a", seed=1)
    before = fingerprint(a)
    fed(store, reader, "b", seed=2)
    store.settle(keep="b")
    assert "a" not in store._resident and "a" in store.host and store.counters.to_host == 1
    assert store.holds("a") and "a" in store.names()
    back = store.get("a")
    assert store.counters.from_host == 1 and "a" not in store.host
    assert_same(before, fingerprint(back))
    reader.feed_output(back, ids(200, 3))
    reader.advance(back)
    fresh = reader.prefill(back.ids[: back.committed])
    assert all(torch.equal(x, fresh.tensors()[k]) for k, x in back.state.tensors().items())


def test_the_host_copy_is_its_own_memory_not_a_view_of_the_device_rows(reader):
    store = SessionStore(reader, "h", cap_gib=None)
    a = fed(store, reader, "a", seed=4)
    copy = to_host(a)
    for name, t in a.state.tensors().items():
        host = copy.state.tensors()[name]
        assert torch.equal(t, host) and host.data_ptr() != t.data_ptr()
    a.state.arena.recurrent.add_(1.0)  # the session changes after the move: the copy does not
    assert not torch.equal(a.state.tensors()["layers.0.recurrent"], copy.state.tensors()["layers.0.recurrent"])


def test_a_full_host_tier_sends_its_oldest_copy_to_disk_from_host_memory(reader, tmp_path):
    one = one_session_gib(reader)
    store = SessionStore(reader, "h", cap_gib=0, host_cap_gib=one * 1.5, disk=tmp_path)
    before = {}
    for k, name in enumerate("abc"):
        before[name] = fingerprint(fed(store, reader, name, seed=10 + k))
        store.settle(keep=name)
    # a went to host, then b to host pushed a to disk; c stays on the device
    assert store.host.names() == ["b"] and store.counters.host_to_disk == 1 and store.counters.spills == 1
    rows = {r.name: r.tier for r in store.status()}
    assert rows == {"a": "disk", "b": "host", "c": "device"}
    assert_same(before["a"], fingerprint(store.get("a")))  # restored from the file written from host memory
    assert_same(before["b"], fingerprint(store.get("b")))


def test_a_session_past_the_host_cap_goes_straight_to_disk(reader, tmp_path):
    store = SessionStore(reader, "h", cap_gib=0, host_cap_gib=one_session_gib(reader) / 4, disk=tmp_path)
    a = fed(store, reader, "a", seed=20)
    before = fingerprint(a)
    fed(store, reader, "b", seed=21)
    store.settle(keep="b")
    assert len(store.host) == 0 and store.counters.to_host == 0 and store.counters.spills == 1
    assert_same(before, fingerprint(store.get("a")))


def test_without_a_disk_the_host_tiers_oldest_copy_is_dropped_and_counted(reader):
    store = SessionStore(reader, "h", cap_gib=0, host_cap_gib=one_session_gib(reader) * 1.5)
    for k, name in enumerate("abc"):
        fed(store, reader, name, seed=30 + k)
        store.settle(keep=name)
    assert store.host.names() == ["b"] and store.counters.drops == 1
    assert not store.holds("a") and store.holds("b") and store.holds("c")
    assert store.get("a").committed == 0  # gone: it starts over


def test_a_failed_write_keeps_the_copy_in_host_memory_until_a_later_settle_writes_it(reader, tmp_path, monkeypatch):
    """The disk is full: a's copy is written behind and fails; when the tier needs its room, a's
    copy waits in host memory for its write (status says so, with the error) and no session leaves
    for disk before `retry_s`; once the disk answers, a later settle writes it, bit for bit."""
    import shadow.core.store as store_module

    now = [1000.0]
    store = SessionStore(reader, "h", cap_gib=0, host_cap_gib=one_session_gib(reader) * 1.5, disk=tmp_path,
                         clock=lambda: now[0], retry_s=10)
    real = store_module.write_session

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_module, "write_session", full)
    before = fingerprint(fed(store, reader, "a", seed=40))
    fed(store, reader, "b", seed=41)
    store.settle(keep="b")  # a to host memory; its write behind fails
    store.flush()
    fed(store, reader, "c", seed=42)
    store.settle(keep="c")  # b needs a's room: a's copy waits in host memory for its write
    store.flush()  # (b's write behind fails too)
    assert store.host.names() == ["b"] and "c" in store._resident and store.counters.write_failures == 3
    row = next(r for r in store.status() if r.name == "a")
    assert (row.tier, row.moving, row.resident) == ("host", "to disk", False) and "No space" in row.write_error
    assert all(store.holds(n) for n in "abc") and not store.path_of("a").exists()
    fed(store, reader, "d", seed=43)
    store.settle(keep="d")  # c needs b's room: b's copy waits beside a's (within the staging bound)
    store.flush()
    assert store.host.names() == ["c"] and {r.name for r in store.status() if r.moving == "to disk"} == {"a", "b"}
    failures = store.counters.write_failures  # (c's write behind failed too)
    monkeypatch.setattr(store_module, "write_session", real)
    store.settle(keep="d")  # too soon: not tried again
    store.flush()
    assert store.counters.write_failures == failures and not store.path_of("a").exists()
    now[0] += 10
    store.settle(keep="d")  # the disk answers: both written
    store.flush()
    rows = {r.name: r for r in store.status()}
    assert [(rows[n].tier, rows[n].moving, rows[n].write_error) for n in "ab"] == [("disk", None, None)] * 2
    assert_same(before, fingerprint(store.get("a")))


def test_a_planned_stop_writes_the_host_tiers_copies_too(reader, tmp_path):
    store = SessionStore(reader, "h", cap_gib=0, host_cap_gib=1.0, disk=tmp_path)
    a = fed(store, reader, "a", seed=50)
    before = fingerprint(a)
    fed(store, reader, "b", seed=51)
    store.settle(keep="b")
    assert store.host.names() == ["a"]
    assert store.close() == []
    again = SessionStore(reader, "h", cap_gib=0, disk=tmp_path)  # a restart on the same folder
    assert_same(before, fingerprint(again.get("a")))


def test_memory_stays_bounded_under_a_churn_of_200_sessions(reader, tmp_path):
    probe = SessionStore(reader, "h", cap_gib=None)
    s = probe.get("probe")
    reader.feed_prompt(s, ids(130, 0))
    reader.advance(s)
    on_device, in_host = session_bytes(s) / GIB, host_bytes(s) / GIB  # device bytes count the buffers' capacity
    store = SessionStore(reader, "h", cap_gib=on_device * 2.5, host_cap_gib=in_host * 3.5, disk=tmp_path)
    most_host = most_device = 0
    for k in range(200):
        s = store.get(f"s{k}")
        reader.feed_prompt(s, ids(130, k))
        reader.advance(s)
        store.settle(keep=s.name)
        most_host, most_device = max(most_host, store.host_bytes()), max(most_device, store.resident_bytes())
    assert most_host <= store.host.cap and most_device <= store.cap
    assert len(store.host) <= 3 and store.counters.to_host == 200 - len(store._resident)
    assert len(store.names()) == 200  # none lost: every session on the device, in host memory or on disk


def test_the_host_tier_is_bounded_by_bytes_and_reports_them(reader):
    tier = HostTier(cap=1000)
    assert tier.fits(1000) and not tier.fits(1001) and tier.room() == 1000 and tier.oldest() is None
    a, b, c = reader.new_session("a"), reader.new_session("b"), reader.new_session("c")
    tier.put(a, 300)
    tier.put(b, 500)
    tier.put(a, 400)  # the same name again replaces it, and is newest
    assert tier.used() == 900 and tier.room() == 100 and tier.names() == ["b", "a"] and tier.oldest() == "b"
    assert tier.take("b") is b and tier.take("b") is None and tier.used() == 400
    tier.reserve("c", 200)  # a move in flight: its room and its place held, no copy yet
    tier.put(b, 100)
    assert tier.used() == 700 and "c" not in tier and tier.reserved("c") and tier.names() == ["a", "b"]
    tier.put(c, 250)  # the copy takes its reservation's place, before b
    assert tier.used() == 750 and list(tier._copies) == ["a", "c", "b"] and len(tier) == 3


def test_a_move_back_that_fails_keeps_the_copy_in_host_memory(reader, monkeypatch):
    import shadow.core.store as store_module

    store = SessionStore(reader, "h", cap_gib=0, host_cap_gib=1.0)
    before = fingerprint(fed(store, reader, "a", seed=60))
    fed(store, reader, "b", seed=61)
    store.settle(keep="b")
    real = store_module.from_host

    def out_of_memory(*args):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(store_module, "from_host", out_of_memory)
    with pytest.raises(RuntimeError):
        store.get("a")
    assert "a" in store.host and store.holds("a") and store.counters.from_host == 0
    monkeypatch.setattr(store_module, "from_host", real)
    assert_same(before, fingerprint(store.get("a")))


def test_the_served_host_tier_is_none_on_a_cpu_and_at_most_half_the_machines_memory():
    from shadow.server.http.build import host_cap_gib

    assert host_cap_gib(32.0, "cpu", memory=64 * GIB) == 0.0
    assert host_cap_gib(0.0, "cuda", memory=64 * GIB) == 0.0
    assert host_cap_gib(16.0, "cuda", memory=64 * GIB) == 16.0
    assert host_cap_gib(48.0, "cuda", memory=64 * GIB) == 32.0


@pytest.mark.slow
def test_the_service_reports_the_host_tier_in_status_and_metrics(tiny, tmp_path):
    """A served store with a host tier: status's store totals and /metrics name its bytes and moves."""
    from serving import running

    with running() as (client, service):
        service.store.cap, service.store.host = 0, HostTier(GIB)  # a CPU has no tier by default: one set here
        for k in range(3):
            r = client.post("/v1/completions", json={"prompt": "hello " * (100 + k), "max_tokens": 2},
                            headers={"x-session-id": f"host-{k}"})
            assert r.status_code == 200
        status = client.get("/v1/shadow/status").json()
        metrics = client.get("/metrics").text
        # an ask about a session in the tier says what it brought back: the bytes the move counted
        assert "host-0" in service.store.host
        moved = service.store.host.nbytes("host-0")
        answer = client.post("/v1/shadow/ask", json={"session": "host-0", "question": "A or B?",
                                                      "choices": ["A", "B"]}).json()
    assert answer["brought_back"] == {"tier": "host", "bytes": moved} and moved > 0
    assert status["store"]["host_sessions"] >= 1 and status["store"]["host_bytes"] > 0
    assert re.search(r"^shadow_sessions_in_host[{ ]", metrics, re.M) and re.search(r"^shadow_to_host_total[{ ]", metrics, re.M)
    for name in ("sessions_moving", "moving_bytes", "sessions_staged", "staged_bytes", "write_behind_queue",
                 "written_behind_total"):  # the moves in flight and the copies waiting for disk
        assert re.search(rf"^shadow_{name}[{{ ]", metrics, re.M), name


# moves beside the reads: a copy out in flight ----------------------------------------------------


class InFlight:
    """Stands for a copy's CUDA event on the CPU (where every copy is whole at once): not done until
    `land()` or `synchronize()`, so the store's handling of a move in flight runs here as on a GPU."""

    def __init__(self):
        self.landed = False

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.landed = True

    land = synchronize


@pytest.fixture()
def in_flight(monkeypatch):
    """Every move out the store begins stays in flight until its event lands: the events, in order."""
    import shadow.core.hosttier as hosttier
    import shadow.core.store as store_module

    events = []

    def held(session, stream=None, pool=None):
        move = hosttier.move_to_host(session, stream, pool)
        move.event = InFlight()
        events.append(move.event)
        return move

    monkeypatch.setattr(store_module, "move_to_host", held)
    return events


def test_a_session_moving_out_holds_its_device_rows_until_its_copy_is_whole(reader, in_flight):
    store = SessionStore(reader, "h", cap_gib=0, host_cap_gib=1.0)
    a = fed(store, reader, "a", seed=70)
    before, device_bytes = fingerprint(a), session_bytes(a)
    fed(store, reader, "b", seed=71)
    store.settle(keep="b")
    row = next(r for r in store.status() if r.name == "a")
    assert (row.tier, row.moving, row.resident) == ("device", "to host memory", True)
    assert store.peek("a") is None and store.holds("a") and "a" not in store.host  # left, not yet in the tier
    assert store.resident_bytes() == device_bytes + session_bytes(store.peek("b"))  # its rows still held
    assert store.host_bytes() == host_bytes(a) and store.restore_ahead("a") is None  # its room held; get keeps it
    store.settle(keep="b")  # the copy is not whole yet: still moving
    assert store.totals()["moving_sessions"] == 1
    in_flight[0].land()
    store.settle(keep="b")  # between reads: the copy takes its place, the rows are let go
    assert "a" in store.host and store.totals()["moving_sessions"] == 0
    assert store.resident_bytes() == session_bytes(store.peek("b"))
    assert_same(before, fingerprint(store.get("a")))


def test_a_session_asked_for_while_it_moves_out_stays_on_the_device(reader, in_flight):
    store = SessionStore(reader, "h", cap_gib=0, host_cap_gib=1.0)
    a = fed(store, reader, "a", seed=72)
    fed(store, reader, "b", seed=73)
    store.settle(keep="b")
    assert store.get("a") is a  # the same session, its rows never left
    c = store.counters
    assert (c.to_host, c.from_host, c.moves_kept) == (1, 1, 1) and store.host_bytes() == 0 and len(store.host) == 0
    in_flight[0].land()  # the copy let go lands: nothing takes it
    store.settle(keep="a")
    assert "a" not in store.host and store.peek("a") is a
    reader.feed_output(a, ids(2 * GRID, 74))
    reader.advance(a)
    fresh = reader.prefill(a.ids[: a.committed])
    assert all(torch.equal(x, fresh.tensors()[k]) for k, x in a.state.tensors().items())


def test_a_planned_stop_waits_for_the_moves_in_flight_and_writes_them(reader, tmp_path, in_flight):
    store = SessionStore(reader, "h", cap_gib=0, host_cap_gib=1.0, disk=tmp_path)
    before = {n: fingerprint(fed(store, reader, n, seed=80 + k)) for k, n in enumerate("ab")}
    store.settle(keep="b")  # a moving to host memory
    assert store.totals()["moving_sessions"] == 1
    assert store.close() == []
    again = SessionStore(reader, "h", cap_gib=None, disk=tmp_path)
    for name, fp in before.items():
        assert_same(fp, fingerprint(again.get(name)))


@pytest.mark.parametrize("disk", [True, False], ids=["spill", "drop"])
def test_a_move_in_flight_whose_room_the_tier_needs_leaves_as_its_copy_would(reader, tmp_path, in_flight, disk):
    """a's move into the tier is in flight when b needs its room: a leaves the tier as a copy would,
    bound for disk (its copy waits for its write once whole) or, without a disk, dropped; either
    way its rows are held until its copy is done, and only then let go."""
    one = one_session_gib(reader)
    store = SessionStore(reader, "h", cap_gib=0, host_cap_gib=one * 1.5, disk=tmp_path if disk else None)
    a = fed(store, reader, "a", seed=90)
    before, a_bytes = fingerprint(a), session_bytes(a)
    fed(store, reader, "b", seed=91)
    store.settle(keep="b")  # a moving into the tier
    fed(store, reader, "c", seed=92)
    store.settle(keep="c")  # b needs the room a's move holds
    assert store.counters.host_to_disk == int(disk) and store.counters.drops == int(not disk)
    assert store.holds("a") is disk and "a" not in store.host and store.resident_bytes() >= a_bytes  # a's rows held
    for event in in_flight:
        event.land()
    store.settle(keep="c")
    store.flush()
    assert store.resident_bytes() == session_bytes(store.peek("c")) and store.host.names() == ["b"]
    if disk:
        assert next(r for r in store.status() if r.name == "a").tier == "disk"
        assert_same(before, fingerprint(store.get("a")))
    else:
        assert store.get("a").committed == 0  # dropped: it starts over


def test_a_host_copy_keeps_every_field_of_the_session_a_held_output_included(reader):
    store = SessionStore(reader, "h", cap_gib=0, host_cap_gib=1.0)
    a = fed(store, reader, "a", seed=95)
    a.hold, a.rollbacks, a.ids_reread = len(a.ids) - 3, 2, 7
    fed(store, reader, "b", seed=96)
    store.settle(keep="b")
    back = store.get("a")
    assert back is not a and (back.hold, back.rollbacks, back.ids_reread) == (len(a.ids) - 3, 2, 7)
