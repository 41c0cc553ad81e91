"""One request's work is bounded, whatever chunk size a client picks.

Before `max_chunks`, a LOOKUP of 1 M tokens with chunk_tokens=1 hashed a
million keys: ~0.9 s of the daemon's only thread, every other client waiting.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvd.protocol import keys
from kvd.protocol.errors import BadField
from kvd.protocol.limits import Limits
from kvd_client import HostTensor, Snapshot

MAX_CHUNKS = Limits().max_chunks


def test_lookup_and_get_walk_at_most_max_chunks(kvd_daemon):
    c = kvd_daemon.client("tiny", strict=True, chunk_tokens=1)
    stored = list(range(MAX_CHUNKS))
    data = np.arange(MAX_CHUNKS, dtype=np.uint16).reshape(1, MAX_CHUNKS, 1)
    assert c.put(stored, Snapshot(sliced={"k": (HostTensor.from_numpy(data), 1)}))
    longer = stored + list(range(10**6, 10**6 + (1 << 20) - MAX_CHUNKS))  # 1 M tokens, all past the stored ones
    assert c.probe(longer).n == MAX_CHUNKS  # the walk ends at max_chunks, not at a miss a million hashes later
    hit = c.get(longer)
    assert hit is not None and hit.n == MAX_CHUNKS
    np.testing.assert_array_equal(hit.sliced["k"].array, data)
    assert c.stats()["server"]["limits"]["max_chunks"] == MAX_CHUNKS


def test_a_put_over_max_chunks_is_bad_field(kvd_daemon):
    c = kvd_daemon.client("tiny", strict=True, chunk_tokens=1)
    n = MAX_CHUNKS + 1
    snap = Snapshot(sliced={"k": (HostTensor.from_numpy(np.zeros((1, n, 0), np.uint8)), 1)})
    with pytest.raises(BadField, match="max_chunks|limit is"):
        c.put(list(range(n)), snap)
    assert c.stats()["tiers"]["ram"]["entries"] == 0


def test_iter_chain_is_chain_one_key_at_a_time():
    toks = keys.token_bytes(range(1000))
    assert list(keys.iter_chain("n", 7, toks)) == keys.chain("n", 7, toks)
