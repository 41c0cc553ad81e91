"""Prefix matching asks the store in blocks (`Store.held`): it must say what
one `contains` per entry would, across both tiers, the spill queue and a hole."""

from __future__ import annotations

import numpy as np

from kvd.protocol import keys
from kvd.server import prefix
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
