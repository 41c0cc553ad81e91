"""A fetch's mlx memory, written once (client/mlx_lm/_blocks.py), on both roads.

The loaded road (mx.load allocates, the stream's readinto is the join's copy)
and the zeroed road (mx.zeros, then the copy) must give the same caches, bit
for bit, for every wire dtype and every cache class; a shared-memory piece
whose bytes changed after COMMIT is ShmDamaged on the caller's thread (a miss
for `fetch`) whichever road, and whichever thread mlx ran the copy on. The
`road` fixture also pins that this mlx takes the loaded road: were it to
read the stream otherwise, the fetch would still work, but slower, and this
test says so.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest
import xxhash
from mlx_lm.models import cache as C

from kvd.protocol import dtypes
from kvd.protocol.codec import Tensor
from kvd_client import ShmDamaged
from kvd_client import _chunking, _pair
from kvd_client._chunking import chunk_meta, cut, join
from kvd_client._shm import Viewed
from kvd_client._tensors import Hit, HostTensor, Snapshot
from kvd_client.mlx_lm import _blocks, rebuild, snapshot

CHUNK = 64


@pytest.fixture(params=["loaded", "zeroed"])
def road(request, monkeypatch):
    """Which road `mlx_blocks` must take; the threads `fill` ran on are recorded."""
    zeroed, taken = _blocks._zeroed, []
    if request.param == "zeroed":
        monkeypatch.setattr(_blocks, "_loaded", lambda sizes, fill: None)
    monkeypatch.setattr(_blocks, "_zeroed", lambda sizes, fill: taken.append("zeroed") or zeroed(sizes, fill))
    yield request.param
    assert taken == ([] if request.param == "loaded" else ["zeroed"] * len(taken)), "mx.load did not take the stream"


@pytest.fixture(params=[0, 65536, None], ids=["blob-per-tensor", "few-per-blob", "default"])
def grouping(request, monkeypatch):
    """How many tensors one mx.load read fills (`_blocks.GROUP_BYTES`)."""
    if request.param is not None:
        monkeypatch.setattr(_blocks, "GROUP_BYTES", request.param)
    return request.param


@pytest.fixture(params=[0, None], ids=["split", "default-split"])
def split(request, monkeypatch):
    """Over how many bytes a join's copies are shared with the helper thread
    (`_chunking.SPLIT_BYTES`; 0: always, so small tests take that road too)."""
    if request.param is not None:
        monkeypatch.setattr(_chunking, "SPLIT_BYTES", request.param)
    return request.param


def joined(chunks, n):
    """join() into mlx memory as `MlxMethods.fetch` does: (tensors, blocks, fill threads)."""
    blocks, threads = [], set()

    def alloc(sizes, fill):
        def tracked(i, raw, *half):
            threads.add(threading.get_ident())
            fill(i, raw, *half)

        xs, aliases = _blocks.mlx_blocks(sizes, tracked)
        blocks[:] = zip(xs, aliases)
        return aliases

    tensors, axes, meta = join(chunks, n, CHUNK, alloc)
    return tensors, axes, meta, blocks, threads


def chunks_of(snap: Snapshot, n_tokens: int, digests: bool = False) -> list[dict]:
    """The chunks a GET serves for `snap`; with `digests`, each tensor's bytes
    sit in a buffer carrying the xxh3 COMMIT fixed, as shared memory does."""
    out = []
    for s in range(0, n_tokens, CHUNK):
        e = min(s + CHUNK, n_tokens)
        tensors = cut(snap, s, e)
        if digests:
            tensors = [Tensor(t.name, t.dtype, t.shape, _slotted(t.data)) for t in tensors]
        out.append({"start": s, "length": e - s, "meta": chunk_meta(snap), "tensors": tensors})
    return out


def _slotted(data: np.ndarray) -> Viewed:
    buf = np.frombuffer(bytearray(data.tobytes()), np.uint8).view(Viewed)
    buf.digest = xxhash.xxh3_64_intdigest(buf)
    return buf


def wire_tensor(dtype: str, shape, seed: int) -> HostTensor:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtypes.itemsize(dtype), dtype=np.uint8)
    if dtype == "bool":
        raw &= 1
    return HostTensor(dtype, raw.view(dtypes.container(dtype)).reshape(shape))


@pytest.mark.parametrize("n", [200, 130, 1])
def test_every_wire_dtype_lands_bit_exact_and_aligned(road, grouping, split, n):
    names = sorted(dtypes.DTYPES)
    snap = Snapshot(sliced={name: (wire_tensor(name, (1, 3, 200, 5), i), 2) for i, name in enumerate(names)})
    tensors, axes, _, blocks, threads = joined(chunks_of(snap, 200, digests=True), n)
    if split == 0 and _pair._cores() > 1:  # the other half of the copy ran on the helper thread
        assert threads & {t.ident for t in threading.enumerate() if t.name == "kvd-copy-half"}
    assert len(blocks) == len(names)
    addresses = {np.asarray(x).ctypes.data for x, _ in blocks}
    assert addresses == {a.ctypes.data for _, a in blocks}  # the aliases are the mlx memory
    assert len(addresses) == len(names)  # a block of its own each (views of a few blobs)
    for name in names:
        got, want = tensors[name], snap.sliced[name][0].array[:, :, :n]
        assert got.dtype == name and got.shape == want.shape
        assert got.array.tobytes() == want.tobytes(), name
        assert got.array.ctypes.data in addresses and got.array.ctypes.data % 64 == 0  # the mlx memory itself


def caches_of_every_class():
    def kv(cls, dtype, t=150):
        c = cls()
        k = mx.random.normal((1, 2, t, 64), key=mx.random.key(t)).astype(dtype)
        c.update_and_fetch(k, k + 1)
        return c

    q = C.QuantizedKVCache(group_size=32, bits=4)
    k = mx.random.normal((1, 2, 150, 64), key=mx.random.key(3)).astype(mx.float16)
    q.update_and_fetch(k, k - 1)
    rot = C.RotatingKVCache(max_size=32, keep=4)
    for t in (148, 1, 1):  # a ring after its prefill: 150 tokens, as every layer
        r = mx.random.normal((1, 2, t, 64), key=mx.random.key(t + 9)).astype(mx.bfloat16)
        rot.update_and_fetch(r, r)
    arrays = C.ArraysCache(3)
    arrays[0] = mx.random.normal((1, 3, 24), key=mx.random.key(1)).astype(mx.bfloat16)
    arrays[2] = mx.random.normal((1, 2, 8, 8), key=mx.random.key(2))
    return [kv(C.KVCache, mx.bfloat16), kv(C.KVCache, mx.float16), kv(C.KVCache, mx.float32),
            kv(C.ConcatenateKVCache, mx.bfloat16), q, C.CacheList(rot, kv(C.KVCache, mx.float32)), arrays]


def test_every_cache_class_rebuilds_bit_exact_from_mlx_memory(road, grouping, split):
    caches = caches_of_every_class()
    toks, snap = snapshot(list(range(150)), caches)
    tensors, axes, meta, blocks, _ = joined(chunks_of(snap, 150, digests=True), 150)
    hit = Hit(n=150, sliced=tensors, axes=axes, boundary=dict(snap.boundary), meta=meta,
              boundary_meta=snap.boundary_meta)
    rebuilt = rebuild(hit, {a.ctypes.data: x for x, a in blocks})
    assert [type(c) for c in rebuilt] == [type(c) for c in caches]
    _, again = snapshot(toks, rebuilt)  # what the rebuilt caches hold, in the terms stored
    assert set(again.sliced) == set(snap.sliced) and set(again.boundary) == set(snap.boundary)
    for name, (t, axis) in snap.sliced.items():
        assert again.sliced[name][0].equal(t) and again.sliced[name][1] == axis, name
    for name, t in snap.boundary.items():
        assert again.boundary[name].equal(t), name
    # the KV buffers are views of the blocks: no second copy
    spans = [(np.asarray(x).ctypes.data, np.asarray(x).ctypes.data + x.size) for x, _ in blocks]
    keys = np.asarray(rebuilt[0].keys.view(mx.uint16))
    assert any(lo <= keys.ctypes.data < hi for lo, hi in spans)


def test_damaged_piece_is_raised_on_the_callers_thread(road, grouping, split):
    snap = Snapshot(sliced={"a": (wire_tensor("bfloat16", (1, 2, 200, 8), 1), 2),
                            "b": (wire_tensor("float32", (1, 2, 200, 8), 2), 2)})
    chunks = chunks_of(snap, 200, digests=True)
    chunks[2]["tensors"][1].data[5] ^= 0x10  # written into after COMMIT
    with pytest.raises(ShmDamaged, match="'b' of the chunk at 128"):
        joined(chunks, 200)
    # the same bytes served for a prefix that ends before them: no piece of theirs is read
    tensors, *_ = joined(chunks, 100)
    assert tensors["b"].array.tobytes() == snap.sliced["b"][0].array[:, :, :100].tobytes()


def test_whatever_fill_raises_reaches_the_caller_after_every_read(road):
    done = []

    def fill(i, raw):
        raw[:] = i
        done.append(i)
        if i == 1:
            raise RuntimeError("fill failed")

    with pytest.raises(RuntimeError, match="fill failed"):
        _blocks.mlx_blocks([100, 200, 300], fill)
    assert 1 in done


def test_a_blob_read_in_parts_is_not_filled():
    src = _blocks._Source([1000], lambda i, raw: pytest.fail("filled from a partial read"))
    head = len(src.head)
    src.seek(head)
    buf = bytearray(500)
    assert src.readinto(buf) == 500
    assert src.odd is not None and src.pads == {}
    assert src.tell() == head + 500


def test_shared_memory_damage_is_a_fetch_miss(road, daemon_factory):
    """Through a real daemon: a scribble into a committed slot is a miss on either road."""
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")
    c = C.KVCache()
    k = mx.random.normal((1, 2, 512, 64), key=mx.random.key(5)).astype(mx.bfloat16)
    c.update_and_fetch(k, k)
    toks = list(range(512))
    with d.client("blocks", strict=False, transport="shm") as kv:
        assert kv.store(toks, [c], wait=True)
        cache, n = kv.fetch(toks + [1])
        assert n == 512 and kv.counters["shm_gets"] >= 1
        assert np.asarray(cache[0].keys.view(mx.uint16)).tobytes() == np.asarray(k.view(mx.uint16)).tobytes()
        link = kv._link()
        reply = kv._transport.request("GET", {**kv._seq(toks), "shm": link.field()}, 5)
        desc = reply["chunks"][1]["tensors"][0].data
        link.done(reply["shm"]["lease"])
        slot = link.view(desc, writable=True)
        slot[:4] = bytes(x ^ 0xFF for x in bytes(slot[:4]))
        cache, n = kv.fetch(toks + [1])
        assert kv.counters["shm_damaged"] == 1
        assert n < 512 and (cache is None or n <= 256)
