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
    assert set(shown) == {"collections", "longest_ms", "total_s", "frozen"}


def test_freeze_takes_what_exists_out_of_the_collectors_walks():
    kept = [[i] for i in range(1000)]  # lists: objects the collector tracks
    try:
        frozen = gcpauses.freeze()
        assert frozen == gc.get_freeze_count() and frozen >= len(kept)
    finally:
        gc.unfreeze()  # the test process goes on collecting its own garbage
    assert gc.get_freeze_count() == 0
