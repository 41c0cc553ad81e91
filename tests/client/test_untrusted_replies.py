"""A client trusts no reply blindly: a peer that writes chunks of another shape
under a namespace turns the owner's `get` and `fetch` into a miss, counted in
`get_inconsistent`, never into a cache of the wrong shape.

Any process of the user may write any namespace (proto/PROTOCOL.md §11), so
the peer here is an ordinary numpy `Client` on the same real daemon.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from models import llama_model, prefill, prompt  # noqa: F401  (the fixture `llama`)

from kvd.protocol.codec import Tensor
from kvd_client import Snapshot, _chunking
from kvd_client._tensors import HostTensor
from kvd_client.mlx_lm import namespace_for

CHUNK = 64


def _arr(shape, dtype=np.float32, seed=0):
    return HostTensor.from_numpy(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


def _forge(peer, tokens, index, tensors, meta):
    """A raw PUT of one chunk, past the client's own checks (a hostile peer's)."""
    seq = peer._seq(tokens)
    assert peer._send_put(seq, [{"index": index, "tensors": tensors, "meta": meta}], None, False)


WRONG = {
    # name: the peer's tensor for tokens [2*CHUNK, 3*CHUNK) of "k" (the owner's is (1, 2, T, 8) float32)
    "fewer heads (broadcastable)": lambda t: Tensor("k", "float32", (1, 1, CHUNK, 8), _arr((1, 1, CHUNK, 8)).array),
    "other head dim": lambda t: Tensor("k", "float32", (1, 2, CHUNK, 4), _arr((1, 2, CHUNK, 4)).array),
    "other dtype": lambda t: Tensor("k", "float16", (1, 2, CHUNK, 8), _arr((1, 2, CHUNK, 8), np.float16).array),
    "other rank": lambda t: Tensor("k", "float32", (2, CHUNK, 8), _arr((2, CHUNK, 8)).array),
    "one row for the chunk (broadcastable)": lambda t: Tensor("k", "float32", (1, 2, 1, 8), _arr((1, 2, 1, 8)).array),
    "other name": lambda t: Tensor("q", "float32", (1, 2, CHUNK, 8), _arr((1, 2, CHUNK, 8)).array),
}


@pytest.mark.parametrize("wrong", list(WRONG))
def test_wrong_shaped_chunk_from_a_peer_is_a_miss_for_get(kvd_daemon, wrong):
    owner = kvd_daemon.client("victim", chunk_tokens=CHUNK)
    peer = kvd_daemon.client("victim", chunk_tokens=CHUNK)
    s = np.arange(2 * CHUNK)
    longer = np.arange(3 * CHUNK)
    mine = Snapshot({"k": (_arr((1, 2, 2 * CHUNK, 8)), 2)})
    assert owner.put(s, mine)
    # The peer extends the owner's sequence by one chunk of another layout.
    meta = _chunking.chunk_meta(Snapshot({"k": (_arr((1, 2, CHUNK, 8)), 2)}))
    _forge(peer, longer, 2, [WRONG[wrong](None)], meta)
    assert peer.probe(longer).n == 3 * CHUNK  # the daemon holds it: only the client can tell

    before = owner.counters["get_inconsistent"]
    assert owner.get(longer) is None
    assert owner.counters["get_inconsistent"] == before + 1
    # The owner's own prefix is still served, bit for bit.
    hit = owner.get(s)
    assert hit.n == 2 * CHUNK and np.array_equal(hit.sliced["k"].array, mine.sliced["k"][0].array)


def test_a_peer_changing_the_layout_meta_between_chunks_is_a_miss(kvd_daemon):
    owner = kvd_daemon.client("victim", chunk_tokens=CHUNK)
    peer = kvd_daemon.client("victim", chunk_tokens=CHUNK)
    s, longer = np.arange(CHUNK), np.arange(2 * CHUNK)
    assert owner.put(s, Snapshot({"k": (_arr((1, 2, CHUNK, 8)), 2)}))
    assert peer.put(longer, Snapshot({"k": (_arr((1, 2, CHUNK, 8)), 2)}, meta={"other": 1}, start=CHUNK))
    assert owner.get(longer) is None and owner.counters["get_inconsistent"] == 1
    with pytest.raises(ValueError, match="another layout"):
        kvd_daemon.client("victim", chunk_tokens=CHUNK, strict=True).get(longer)


def test_wrong_shaped_chunks_from_a_peer_are_a_miss_for_fetch(kvd_daemon, llama):
    ns = namespace_for(llama)
    owner = kvd_daemon.client(ns, chunk_tokens=CHUNK)
    peer = kvd_daemon.client(ns, chunk_tokens=CHUNK)
    toks = prompt(2 * CHUNK)
    with mx.stream(mx.new_thread_local_stream(mx.cpu)):
        cache = make_prompt_cache(llama)
        prefill(llama, toks, cache)
        assert owner.store(toks, cache, wait=True)
        cache, n = owner.fetch(toks + [1])
        assert n == 2 * CHUNK and cache[0].keys.shape[2] == 2 * CHUNK

        # 1. The peer extends the owner's prompt with a chunk of half the heads.
        hit = owner.get(toks)
        longer = toks + prompt(CHUNK, seed=9)
        wrong = []
        for name, t in hit.sliced.items():
            shape = list(t.shape)
            shape[1], shape[2] = max(1, shape[1] // 2), CHUNK
            wrong.append(Tensor(name, t.dtype, tuple(shape), np.zeros(shape, t.array.dtype)))
        meta = _chunking.chunk_meta(Snapshot({n: (t, 2) for n, t in hit.sliced.items()}, meta=hit.meta))
        _forge(peer, longer, 2, wrong, meta)
        before = owner.counters["get_inconsistent"]
        assert owner.fetch(longer + [1]) == (None, 0)
        assert owner.counters["get_inconsistent"] == before + 1
        assert owner.counters["fetch_miss"] >= 1

        # 2. A whole sequence stored by the peer in a layout that is not the
        # model's (consistent in itself, so only the namespace's layout tells).
        other = prompt(CHUNK, seed=11)
        layers = hit.meta["layers"][:1]
        fake = Snapshot({"0.k": (_arr((1, 2, CHUNK, 8)), 2), "0.v": (_arr((1, 2, CHUNK, 8)), 2)},
                        meta={**hit.meta, "layers": layers})
        assert peer.put(other, fake)
        before = owner.counters["fetch_invalid"]
        assert owner.fetch(other + [1]) == (None, 0)
        assert owner.counters["fetch_invalid"] == before + 1
        # The model's layout is still the one the namespace records.
        cache, n = owner.fetch(toks + [1])
        assert n == 2 * CHUNK and cache[0].keys.shape == hit.sliced["0.k"].shape


@pytest.mark.parametrize("meta", [
    {"fmt": 1, "layers": [{"k": "qkv"}], "bnd": False},  # a quantized layer without its group size
    {"fmt": 1, "layers": ["kv"], "bnd": False},  # a layer that is not a spec
    {"fmt": 1, "layers": [{"k": "list", "sub": None}], "bnd": False},  # a list layer without its parts
])
def test_meta_no_snapshot_of_kvd_has_is_a_miss_for_fetch(kvd_daemon, meta):
    """Any process of the user may PUT an entry whose meta describes no cache
    kvd makes: a model server's fetch counts it invalid and misses (it had
    raised KeyError/TypeError out of the rebuild)."""
    toks = list(range(100, 108))
    snap = Snapshot(meta=meta, start=0)
    parts = ["0.k.q", "0.k.s", "0.k.b", "0.v.q", "0.v.s", "0.v.b"] if meta["layers"][0] == {"k": "qkv"} else ["0.k", "0.v"]
    for name in parts:
        snap.sliced[name] = (HostTensor("float16", np.zeros((1, 2, 8, 4), np.float16)), 2)
    with kvd_daemon.client("garbage", strict=True) as c:
        assert c.put(np.array(toks), snap)
    with kvd_daemon.client("garbage") as c:
        assert c.fetch(toks + [1]) == (None, 0)
        assert c.counters["fetch_invalid"] == 1
