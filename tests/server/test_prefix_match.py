"""Prefix matching asks the store in blocks (`Store.held`): it must say what
one `contains` per entry would, across both tiers, the spill queue and a hole."""

from __future__ import annotations

import numpy as np

from kvd.protocol import keys
from kvd.server import prefix
from kvd.server.chains import Chains
from kvd.server.prefix import match
from kvd.store.base import BOUNDARY, CHUNK, Entry, Tensor, entry_id
from kvd.store.tiered import open_store

CT = 16


def chain_entries(ns: str, tokens_le: bytes) -> list[Entry]:
    out, parent = [], keys.root_key(ns, CT)
    for i, key in enumerate(keys.chain(ns, CT, tokens_le)):
        out.append(Entry(ns, key, CHUNK, parent, i * CT, CT, (Tensor("t", "uint8", (200,), bytes([i % 256] * 200)),)))
        parent = key
    return out


def test_held_agrees_with_contains_and_match_stops_at_the_first_hole(tmp_path, monkeypatch):
    monkeypatch.setattr(prefix, "_BLOCKS", (3, 8))  # several blocks, a hole inside one
    tokens = keys.token_bytes(np.arange(40 * CT) % 5000)
    entries = chain_entries("ns", tokens)
    store = open_store(10 * 200, tmp_path, ssd_bytes=64 << 20, min_free_bytes=0)
    try:
        for e in entries[:20] + entries[21:30]:  # no chunk 20: a hole; RAM keeps ~the last ten, the rest spill
            store.put(e)
        bound = entries[5]
        store.put(Entry("ns", bound.key, BOUNDARY, bound.parent, bound.start, bound.length, bound.tensors))
        store.flush(10)
        assert store.stats()["tiers"]["ssd"]["entries"] >= 15  # both tiers are asked
        for e in entries[30:33]:
            store.put(e)  # queued or in RAM: held either way
        eids = [e.id for e in entries] + [entry_id(e.key, BOUNDARY) for e in entries]
        assert store.held(eids) == [store.contains(eid) for eid in eids]
        assert sum(store.held(eids)) == 32 + 1  # 33 chunks but the hole, one boundary
        links = match(store, "ns", CT, tokens)
        assert [link.key for link in links] == [e.key for e in entries[:20]]
        assert [link.end for link in links if link.boundary] == [6 * CT]
    finally:
        store.close()


def reference_match(store, ns: str, ct: int, tokens_le: bytes) -> list[tuple]:
    """One `contains` per chunk, in order: what match() must answer (no tails here)."""
    n, out, pos = len(tokens_le) // 4, [], 0
    for key in keys.chain(ns, ct, tokens_le):
        if not store.contains(entry_id(key, CHUNK)):
            break
        end = min(pos + ct, n)
        out.append((pos, end, key, store.contains(entry_id(key, BOUNDARY))))
        pos = end
    return out


def test_match_builds_the_links_one_contains_per_chunk_would(monkeypatch):
    """Random stored prefixes (ending in a tail or not), boundaries and holes,
    through blocks of every size: the same links as the plain walk."""
    from kvd.store.ram import RamStore

    rng = np.random.default_rng(7)
    for blocks in ((4, 16, 64), (3, 8), (1,)):
        monkeypatch.setattr(prefix, "_BLOCKS", blocks)
        for trial in range(40):
            store = RamStore(1 << 30)
            n = int(rng.integers(1, 30 * CT))
            tokens = keys.token_bytes(rng.integers(0, 1000, n))
            parent, pos = keys.root_key("ns", CT), 0
            keep = int(rng.integers(0, -(-n // CT) + 1))  # chunks stored, the tail included if all are
            hole = int(rng.integers(0, keep)) if keep and rng.random() < 0.3 else -1
            for i, key in enumerate(keys.chain("ns", CT, tokens)[:keep]):
                end = min(pos + CT, n)
                if i != hole:
                    store.put(Entry("ns", key, CHUNK, parent, pos, end - pos, (), tail=end - pos < CT))
                if rng.random() < 0.2:
                    store.put(Entry("ns", key, BOUNDARY, parent, pos, end - pos, ()))
                parent, pos = key, end
            want = reference_match(store, "ns", CT, tokens)
            assert [tuple(link) for link in match(store, "ns", CT, tokens)] == want, (blocks, trial, n, keep, hole)
            # With a memo that knows some of the keys (a prefix of the query, the
            # query cut mid-chunk, or one that parts from it), asked first in one block.
            chains = Chains()
            cut = int(rng.integers(0, n + 1))
            other = tokens[: 4 * cut] + keys.token_bytes(rng.integers(0, 1000, int(rng.integers(0, 3 * CT))))
            chains.chain("ns", CT, other)
            for known_block in (256, 2):
                monkeypatch.setattr(prefix, "_KNOWN_BLOCK", known_block)
                got = [tuple(link) for link in match(store, "ns", CT, tokens, chains=chains)]
                assert got == want, (blocks, trial, n, keep, hole, cut, known_block)


def _asking(store) -> list[int]:
    """How many ids each `held` call of `store` asks about, from now on."""
    asked, real = [], store.held
    store.held = lambda eids: (asked.append(len(eids)), real(eids))[1]
    return asked


def test_boundary_state_is_asked_for_only_in_namespaces_that_may_have_some(tmp_path):
    """A LOOKUP asks the index about each chunk and the boundary after it:
    half the descents for state a plain attention model never stores. A
    namespace the store certainly holds none of is asked about its chunks
    alone; certainty comes from a walk of every row on disk (at start, again
    after a rebuild) and from every boundary entry stored since."""
    from kvd.store.ssd import SsdStore

    tokens = keys.token_bytes(np.arange(12 * CT) % 5000)
    plain, hybrid = chain_entries("plain", tokens), chain_entries("hybrid", tokens)
    b = hybrid[3]
    ssd = SsdStore(tmp_path, 64 << 20, min_free_bytes=0)
    for e in plain + hybrid + [Entry("hybrid", b.key, BOUNDARY, b.parent, b.start, b.length, b.tensors)]:
        ssd.put(e)
    assert ssd.flush(10)
    ssd.close()

    ssd = SsdStore(tmp_path, 64 << 20, min_free_bytes=0, background=False)  # its walk is driven below
    try:
        asked = _asking(ssd)
        want_plain = [(i * CT, (i + 1) * CT, e.key, False) for i, e in enumerate(plain)]
        want_hybrid = [(i * CT, (i + 1) * CT, e.key, i == 3) for i, e in enumerate(hybrid)]
        # Not walked yet: any namespace may have boundary state on disk.
        assert not ssd.boundary_free("plain") and not ssd.boundary_free("other")
        assert [tuple(link) for link in match(ssd, "plain", CT, tokens)] == want_plain
        assert sum(asked) == 2 * len(plain)

        def walk() -> None:
            while not ssd.reconciled.is_set():
                ssd.idle(busy=False)

        walk()
        assert ssd.boundary_free("plain") and ssd.boundary_free("other") and not ssd.boundary_free("hybrid")
        asked.clear()
        assert [tuple(link) for link in match(ssd, "plain", CT, tokens)] == want_plain
        assert sum(asked) == len(plain)  # the chunks alone
        asked.clear()
        assert [tuple(link) for link in match(ssd, "hybrid", CT, tokens)] == want_hybrid
        assert sum(asked) == 2 * len(hybrid)

        # A rebuilt index may hold blobs the old one had lost: unknown until walked again.
        ssd._heal_wanted = "a test"  # (want_heal hands it to a writer thread; this store has none)
        ssd.idle(busy=False)
        assert not ssd.reconciled.is_set() and not ssd.boundary_free("plain")  # rebuilt, not walked
        walk()
        assert ssd.boundary_free("plain") and not ssd.boundary_free("hybrid")
        assert [tuple(link) for link in match(ssd, "hybrid", CT, tokens)] == want_hybrid
    finally:
        ssd.close()


def test_a_boundary_entry_stored_while_serving_is_asked_for_at_once(tmp_path):
    """After the walk, a namespace's first boundary entry makes it asked
    about from that PUT on, in RAM, in the spill queue and on disk."""
    tokens = keys.token_bytes(np.arange(6 * CT) % 5000)
    entries = chain_entries("late", tokens)
    store = open_store(4 * 200, tmp_path, ssd_bytes=64 << 20, min_free_bytes=0)
    try:
        assert store.ssd.reconciled.wait(10)
        for e in entries:
            store.put(e)
        assert store.boundary_free("late")
        b = entries[4]
        store.put(Entry("late", b.key, BOUNDARY, b.parent, b.start, b.length, b.tensors))
        assert not store.boundary_free("late") and store.boundary_free("other")
        store.flush(10)
        store.evict(0, tier="ram")  # on disk only now
        assert store.stats()["tiers"]["ram"]["entries"] == 0
        assert not store.boundary_free("late")
        assert [link.end for link in match(store, "late", CT, tokens) if link.boundary] == [5 * CT]
    finally:
        store.close()

    from kvd.store.ram import RamStore

    ram = RamStore(1 << 20)
    ram.put(entries[0])
    assert ram.boundary_free("late")
    ram.put(Entry("late", entries[0].key, BOUNDARY, entries[0].parent, 0, CT, ()))
    assert not ram.boundary_free("late") and ram.boundary_free("other")
