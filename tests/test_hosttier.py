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


def test_a_failed_write_keeps_the_copy_in_host_memory_and_the_session_on_the_device(reader, tmp_path, monkeypatch):
    store = SessionStore(reader, "h", cap_gib=0, host_cap_gib=one_session_gib(reader) * 1.5, disk=tmp_path)
    fed(store, reader, "a", seed=40)
    fed(store, reader, "b", seed=41)
    store.settle(keep="b")  # a to host
    import shadow.core.store as store_module

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_module, "write_session", full)
    fed(store, reader, "c", seed=42)
    store.settle(keep="c")  # b cannot go to host (a cannot leave it), nor to disk: it stays
    assert store.host.names() == ["a"] and "b" in store._resident and store.counters.write_failures >= 1
    assert all(store.holds(n) for n in "abc")


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
    a, b = reader.new_session("a"), reader.new_session("b")
    tier.put(a, 300)
    tier.put(b, 500)
    tier.put(a, 400)  # the same name again replaces it, and is newest
    assert tier.used() == 900 and tier.room() == 100 and tier.names() == ["b", "a"] and tier.oldest() is b
    assert tier.take("b") is b and tier.take("b") is None and tier.used() == 400


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
    assert status["store"]["host_sessions"] >= 1 and status["store"]["host_bytes"] > 0
    assert re.search(r"^shadow_sessions_in_host[{ ]", metrics, re.M) and re.search(r"^shadow_to_host_total[{ ]", metrics, re.M)
