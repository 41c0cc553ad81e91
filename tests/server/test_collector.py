"""The daemon's cyclic garbage collection on its own tick (kvd/server/collector.py)."""

from __future__ import annotations

import gc
import weakref

import pytest

from kvd.server.collector import Collector
from support import FakeClock, wait_until


class Node:
    def __init__(self):
        self.other = None


def cycle() -> weakref.ref:
    """A garbage cycle: only the collector can free it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def collector():
    clock = FakeClock()
    c = Collector(full_every_s=600, longest_s=2400, clock=clock)
    c.start()
    try:
        yield c, clock
    finally:
        # `kvd serve` never gives collection back (the process ends); this
        # process runs other tests next, so it gets CPython's own again.
        gc.unfreeze()
        gc.enable()


def test_a_young_cycle_goes_at_the_next_tick_and_nothing_runs_between(collector):
    c, _ = collector
    assert not gc.isenabled() and gc.get_freeze_count() > 0  # start-up's objects are frozen
    young = cycle()
    for _ in range(10_000):  # allocations that would have set CPython's collector off
        Node()
    assert young() is not None
    c.tick()
    assert young() is None and c.young == 1 and c.young_found >= 2


def test_a_cycle_among_frozen_objects_waits_for_the_full_collection(collector):
    c, clock = collector
    a, b = Node(), Node()
    a.other = b
    c.tick()  # a and b survive: frozen
    b.other = a
    ref = weakref.ref(a)
    del a, b  # now garbage, but frozen: ticks do not look
    for _ in range(3):
        c.tick()
    assert ref() is not None and c.fulls == 0
    clock.advance(600)
    c.tick()
    assert ref() is None and c.fulls == 1 and c.full_found >= 2
    assert c.interval == 600  # it found some: the next in 10 minutes again


def test_the_full_collection_comes_less_often_while_it_finds_nothing(collector):
    c, clock = collector
    waits = []
    for _ in range(4):
        before = c.fulls
        waited = 0
        while c.fulls == before:
            clock.advance(60)
            waited += 60
            c.tick()
        waits.append(waited)
    assert waits == [600, 1200, 2400, 2400]  # doubling, up to longest_s
    assert c.full_found == 0 and c.stats()["last_full_ms"] > 0


def test_kvd_serve_collects_on_its_tick_and_says_so(daemon_factory):
    d = daemon_factory("--ram-mb", "64")
    with d.client("gc") as c:
        first = c.stats()["gc"]
        assert first["running"] and first["frozen"] > 1000 and first["full_collections"] == 0
        wait_until(lambda: c.stats()["gc"]["young_collections"] > first["young_collections"], what="a tick's collection")
        assert 0 < c.stats()["gc"]["next_full_s"] <= 600


def test_no_gc_on_tick_leaves_cpythons_collector(daemon_factory):
    d = daemon_factory("--ram-mb", "64", "--no-gc-on-tick")
    with d.client("gc") as c:
        gc_stats = c.stats()["gc"]
    assert not gc_stats["running"] and gc_stats["young_collections"] == 0 and gc_stats["next_full_s"] is None
