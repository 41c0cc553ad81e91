"""The RAM tier on its own: LRU order, byte budget, tails, drop, accounting."""

from __future__ import annotations

from kvd.store import BOUNDARY, PutOutcome, RamStore

from support import entry


def test_lru_evicts_oldest_and_get_refreshes():
    evicted = []
    s = RamStore(300, on_evict=evicted.append, clock=lambda: 0.0)
    for i in range(3):
        assert s.put(entry(i)) is PutOutcome.STORED
    assert s.get(entry(0).id) is not None  # 0 is now the youngest
    s.put(entry(3))
    assert [e.key for e in evicted] == [entry(1).key]
    assert s.bytes == 300 and len(s) == 3
    assert s.stats()["tiers"]["ram"]["evictions"] == 1


def test_duplicate_put_keeps_the_first_and_counts():
    s = RamStore(1000)
    assert s.put(entry(1)) is PutOutcome.STORED
    assert s.put(entry(1)) is PutOutcome.DUPLICATE
    assert s.bytes == 100 and s.counters["duplicates"] == 1


def test_too_big_is_refused_without_evicting_anything():
    s = RamStore(150)
    s.put(entry(1))
    assert s.put(entry(2, nbytes=200)) is PutOutcome.TOO_BIG
    assert s.contains(entry(1).id)


def test_tail_index_follows_puts_and_evictions():
    s = RamStore(250)
    s.put(entry(1, tail=True))
    assert list(s.tails(b"p" * 32)) == [(10, entry(1).key)]
    s.put(entry(2))
    s.put(entry(3))  # evicts 1
    assert list(s.tails(b"p" * 32)) == []


def test_drop_by_namespace_and_age():
    now = [100.0]
    s = RamStore(10_000, clock=lambda: now[0])
    s.put(entry(1, ns="a"))
    s.put(entry(2, ns="b"))
    now[0] = 200.0
    s.put(entry(3, ns="b"))
    assert s.drop(namespace="b", dry_run=True) == (2, 200) and len(s) == 3
    assert s.drop(older_than=50) == (2, 200)
    assert [e.key for e in (s.get(entry(3).id),)] == [entry(3).key]
    assert s.stats()["namespaces"] == {"b": {"entries": 1, "bytes": 100, "tokens": 10, "last_used": 200.0}}


def test_chunk_and_boundary_are_distinct_entries():
    s = RamStore(1000)
    s.put(entry(1))
    assert not s.contains(entry(1, kind=BOUNDARY).id)
    s.put(entry(1, kind=BOUNDARY))
    assert s.contains(entry(1, kind=BOUNDARY).id) and len(s) == 2


def test_two_tails_of_equal_length_under_one_parent_are_both_found():
    # Two questions of the same length after one system prompt: each tail
    # must stay matchable (the index once kept one per length).
    from kvd.store.base import CHUNK, Entry
    from kvd.store.ram import RamStore

    store = RamStore(1 << 20)
    parent = b"p" * 32
    for key in (b"a" * 32, b"b" * 32):
        store.put(Entry(namespace="ns", key=key, kind=CHUNK, parent=parent, start=256, length=33,
                        tensors=(), meta=b"", tail=True))
    assert sorted(store.tails(parent)) == [(33, b"a" * 32), (33, b"b" * 32)]
