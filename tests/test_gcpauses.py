"""The garbage collector in the server: every collection timed by generation, shown in status,
and the load's objects frozen out of its walks."""

from __future__ import annotations

import gc

from serving import running
from shadow.server import gcpauses


def test_collections_are_timed_by_generation_and_status_shows_them(tiny):
    pauses = gcpauses.install()
    assert gcpauses.install() is pauses and gc.callbacks.count(pauses) == 1  # registered once
    before = list(pauses.collections)
    gc.collect(2)
    gc.collect(0)
    assert pauses.collections[2] >= before[2] + 1 and pauses.collections[0] >= before[0] + 1
    assert pauses.longest_ms[2] > 0 and pauses.total_s > 0
    with running() as (client, _):
        shown = client.get("/v1/shadow/status").json()["gc"]
    assert shown["collections"][2] >= before[2] + 1 and shown["longest_ms"][2] > 0
    assert set(shown) == {"collections", "longest_ms", "total_s", "frozen", "long_pauses"}
    assert all(p["ms"] >= gcpauses.GcPauses.LONG_MS and p["at"] > 1e9 for p in shown["long_pauses"])


def test_a_long_pause_is_kept_with_when_it_ended():
    import time

    pauses = gcpauses.GcPauses()
    pauses("start", {"generation": 1})
    time.sleep(0.01)
    pauses("stop", {"generation": 1})
    pauses("start", {"generation": 0})
    pauses("stop", {"generation": 0})  # short: counted, not kept
    (at, generation, ms), = pauses.long
    assert generation == 1 and ms >= 10 and abs(at - time.time()) < 5
    assert pauses.collections == [1, 1, 0] and pauses.status()["long_pauses"][0]["generation"] == 1


def test_freeze_takes_what_exists_out_of_the_collectors_walks():
    kept = [[i] for i in range(1000)]  # lists: objects the collector tracks
    try:
        frozen = gcpauses.freeze()
        assert frozen == gc.get_freeze_count() and frozen >= len(kept)
    finally:
        gc.unfreeze()  # the test process goes on collecting its own garbage
        gcpauses._froze = False
    assert gc.get_freeze_count() == 0


class Cycle:
    """An object that holds itself: only the collector frees it."""

    def __init__(self):
        self.me = self


def test_a_load_after_the_freeze_is_frozen_and_an_unload_lets_its_cycles_be_collected(tiny):
    """A server freezes once it listens; a shadow loaded later (in the background) is frozen at its
    load too, and its unload thaws, so what the model held in cycles is freed, not kept forever."""
    import weakref

    from shadow.core.reader import open_reader
    from shadow.core.store import SessionStore
    from shadow.server.device import DeviceThread
    from shadow.server.host import ModelHost, Shadow

    made = []

    def load() -> Shadow:
        _, reader = open_reader("tiny", grid=128)
        reader.held_in_a_cycle = Cycle()  # what a load may make: objects only the collector frees
        made.append(weakref.ref(reader.held_in_a_cycle))
        return Shadow(reader, SessionStore(reader, tiny.weights_hash, cap_gib=None), tiny.weights_label)

    device = DeviceThread("test-gc-device")
    try:
        assert gcpauses.refreeze() is None  # a process that never froze: nothing
        ModelHost(device, load).load_now()  # loads, freezes nothing
        assert gc.get_freeze_count() == 0
        gcpauses.freeze()  # the server listens
        listened = gc.get_freeze_count()
        host = ModelHost(device, load)
        device.run(host.load_now)
        assert host.ready.is_set() and gc.get_freeze_count() > listened  # the load's objects frozen too
        cycle = made[-1]
        gc.collect()
        assert cycle() is not None
        device.run(host.unload)
        assert gc.get_freeze_count() == 0  # thawed at the unload
        gc.collect()
        assert cycle() is None  # the model's cycle freed
        device.run(host.load_now)  # loaded again: frozen again
        assert host.ready.is_set() and gc.get_freeze_count() > 0
    finally:
        device.close()
        gc.unfreeze()
        gcpauses._froze = False


def test_status_never_breaks_when_a_collection_runs_while_it_is_built():
    """A collection that starts while status builds its answer (every allocation collects here)
    appends a long pause meanwhile: status still answers, as /v1/shadow/status must."""
    import gc

    from shadow.server.gcpauses import GcPauses

    pauses = GcPauses()
    pauses.LONG_MS = -1.0  # every collection is kept as long
    pauses.long = tuple((float(k), 0, 1.0) for k in range(GcPauses.KEEP))
    threshold = gc.get_threshold()
    gc.callbacks.append(pauses)
    try:
        gc.set_threshold(1)
        for _ in range(20):
            status = pauses.status()
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(pauses)
    assert len(status["long_pauses"]) == GcPauses.KEEP and pauses.collections[0] > 0
