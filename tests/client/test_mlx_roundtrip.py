"""Cache objects -> Snapshot -> Hit -> cache objects, bit for bit, for every mlx-lm cache class.

No daemon and no model: caches are filled with random rows through their own
`update_and_fetch`, snapshotted, turned into the Hit a client would get for
the whole sequence or a shorter prefix, rebuilt, and then *driven on*: the
rebuilt cache and the original (trimmed with mlx-lm's own `trim` where a
prefix is served) get the same further updates, and every returned view must
be bitwise equal. That is what the attention layer sees, so it is the
behaviour that matters, not the buffer layout.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C
from fakes import hit_from
from models import same

from kvd_client.mlx_lm import SnapshotMismatch, UnsupportedCache, rebuild, snapshot

DTYPES = [mx.bfloat16, mx.float16, mx.float32]
WIRE = {mx.bfloat16: "bfloat16", mx.float16: "float16", mx.float32: "float32"}


_key = [0]


def rows(t, dtype, h=2, d=64):
    _key[0] += 1
    k = mx.random.normal((1, h, t, d), key=mx.random.key(_key[0])).astype(dtype)
    v = mx.random.normal((1, h, t, d), key=mx.random.key(_key[0] + 10_000)).astype(dtype)
    return k, v


def feed(cache, dtype, steps):
    """Feed updates of the given token counts; return each update's output."""
    out = []
    for t in steps:
        out.append(cache.update_and_fetch(*rows(t, dtype)))
        mx.eval(out[-1])
    return out


def drive_both(a, b, dtype, steps=(1, 1, 7, 1, 40, 1)):
    """Same updates into both caches; every output and offset must match."""
    for t in steps:
        k, v = rows(t, dtype)
        ra, rb = a.update_and_fetch(k, v), b.update_and_fetch(k, v)
        assert same(ra, rb), f"outputs diverge after a {t}-token update"
        assert a.offset == b.offset
        if isinstance(a, C.RotatingKVCache):  # the ring's mask depends on _idx and offset
            for n in (1, 5):
                ma = a.make_mask(n, window_size=a.max_size, return_array=True)
                mb = b.make_mask(n, window_size=b.max_size, return_array=True)
                assert (ma is None and mb is None) or same(ma, mb)


def roundtrip(caches, tokens, n=None, boundary=True):
    toks, snap = snapshot(tokens, caches)
    n = len(toks) if n is None else n
    return toks, snap, rebuild(hit_from(snap, n, boundary=boundary))


# -- KVCache ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_kvcache_roundtrip_bit_exact_and_sliced_to_offset(dtype):
    c = C.KVCache()
    feed(c, dtype, [200, 100])  # 300 tokens in a padded buffer
    assert c.keys.shape[2] > 300  # padding that must not be stored
    toks, snap, (r,) = roundtrip([c], list(range(300)))
    k, axis = snap.sliced["0.k"]
    assert (k.dtype, k.shape, axis) == (WIRE[dtype], (1, 2, 300, 64), 2)
    assert k.array.flags.c_contiguous
    assert not any(np.shares_memory(k.array, np.asarray(x)) for x in (c.keys.view(mx.uint16), c.values.view(mx.uint16)))
    assert type(r) is C.KVCache and type(r.offset) is int and r.offset == 300
    assert same(r.keys, c.keys[..., :300, :]) and same(r.values, c.values[..., :300, :])
    drive_both(c, r, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 100, 256, 299])
def test_kvcache_prefix_is_trimmed(dtype, n):
    c = C.KVCache()
    feed(c, dtype, [300])
    _, _, (r,) = roundtrip([c], list(range(300)), n=n)
    ref = copy.deepcopy(c)
    ref.trim(300 - n)
    assert r.offset == n and same(r.keys, c.keys[..., :n, :])
    drive_both(ref, r, dtype)


def test_snapshot_copies_so_later_decodes_do_not_leak_in():
    c = C.KVCache()
    feed(c, mx.float32, [10])
    _, snap = snapshot(list(range(10)), [c])
    before = snap.sliced["0.k"][0].array.tobytes()
    c.trim(5)
    feed(c, mx.float32, [5])  # overwrites rows 5..9 of the same buffer in place
    assert snap.sliced["0.k"][0].array.tobytes() == before


def test_trimmed_cache_snapshots_only_live_rows_and_tokens():
    c = C.KVCache()
    feed(c, mx.bfloat16, [120])
    c.trim(20)  # rows 100..119 stay in the buffer as garbage
    toks, snap = snapshot(list(range(130)), [c])
    assert list(toks) == list(range(100))
    assert snap.sliced["0.v"][0].shape == (1, 2, 100, 64)


def test_kv_only_cache_longer_than_tokens_is_cut_to_tokens():
    c = C.KVCache()
    feed(c, mx.float16, [50])
    toks, snap = snapshot(list(range(40)), [c])
    assert len(toks) == 40 and snap.sliced["0.k"][0].shape[2] == 40


def test_concatenate_kvcache_roundtrip():
    c = C.ConcatenateKVCache()
    feed(c, mx.bfloat16, [30, 3])
    _, _, (r,) = roundtrip([c], list(range(33)), n=20)
    assert type(r) is C.ConcatenateKVCache and r.offset == 20
    assert same(r.keys, c.keys[..., :20, :])


# -- QuantizedKVCache -------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_quantized_triples_roundtrip_and_trim(bits, group_size, dtype):
    c = C.QuantizedKVCache(group_size=group_size, bits=bits)
    feed(c, dtype, [150, 1, 1])
    toks, snap = snapshot(list(range(152)), [c])
    names = {n: (t.dtype, t.shape[2], ax) for n, (t, ax) in snap.sliced.items()}
    wire = WIRE[dtype]
    assert names == {
        "0.k.q": ("uint32", 152, 2), "0.k.s": (wire, 152, 2), "0.k.b": (wire, 152, 2),
        "0.v.q": ("uint32", 152, 2), "0.v.s": (wire, 152, 2), "0.v.b": (wire, 152, 2),
    }
    assert snap.sliced["0.k.q"][0].shape[3] == 64 * bits // 32
    assert snap.meta["layers"] == [{"k": "qkv", "gs": group_size, "bits": bits}]
    for n in (152, 77):
        (r,) = rebuild(hit_from(snap, n))
        assert type(r) is C.QuantizedKVCache and (r.group_size, r.bits, r.offset) == (group_size, bits, n)
        assert same(r.keys, tuple(x[..., :n, :] for x in c.keys))
        assert same(r.values, tuple(x[..., :n, :] for x in c.values))
        ref = copy.deepcopy(c)
        ref.trim(152 - n)
        drive_both(ref, r, dtype)


def test_to_quantized_cache_roundtrip():
    c = C.KVCache()
    feed(c, mx.bfloat16, [64])
    q = c.to_quantized(group_size=32, bits=4)
    _, _, (r,) = roundtrip([q], list(range(64)), n=40)
    assert r.offset == 40 and same(r.keys, tuple(x[..., :40, :] for x in q.keys))


# -- RotatingKVCache --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "steps",
    [
        [50],  # over-long right after prefill: holds the whole prompt
        [50, 1, 1, 1],  # shrunk to the window, then a ring
        [10, 1, 1],  # still growing in place: buffer padded past the live rows
        [20] + [1] * 40,  # wrapped many times
        [20] + [1] * 40 + [9],  # concat after wrapping
    ],
)
def test_rotating_roundtrip_before_and_after_wrap(dtype, steps):
    c = C.RotatingKVCache(max_size=32, keep=4)
    feed(c, dtype, steps)
    total = sum(steps)
    toks, snap, (r,) = roundtrip([c], list(range(total)))
    assert snap.sliced == {} and set(snap.boundary) == {"0.k", "0.v"}
    assert snap.meta["bnd"] is True
    assert snap.boundary_meta["0"] == {"offset": total, "idx": c._idx}
    live = min(c.offset, c.keys.shape[2])
    assert snap.boundary["0.k"].shape[2] == live
    assert type(r) is C.RotatingKVCache and (r.max_size, r.keep, r.offset, r._idx) == (32, 4, total, c._idx)
    assert type(r.offset) is int and type(r._idx) is int
    drive_both(c, r, dtype)


def test_rotating_without_boundary_state_is_refused():
    c = C.RotatingKVCache(max_size=16)
    feed(c, mx.float32, [20])
    _, snap = snapshot(list(range(20)), [c])
    with pytest.raises(SnapshotMismatch):
        rebuild(hit_from(snap, 20, boundary=False))


def test_boundary_cache_longer_than_tokens_is_refused():
    c = C.RotatingKVCache(max_size=16)
    feed(c, mx.float32, [20])
    with pytest.raises(SnapshotMismatch):
        snapshot(list(range(19)), [c])


# -- ArraysCache, ChunkedKVCache, CacheList ----------------------------------------------


def arrays_cache():
    a = C.ArraysCache(3)
    a[0] = mx.random.normal((1, 3, 24), key=mx.random.key(1)).astype(mx.bfloat16)
    a[2] = mx.random.normal((1, 2, 8, 8), key=mx.random.key(2))  # fp32 recurrent state
    return a


def test_arrays_cache_mixed_dtypes_and_none():
    a = arrays_cache()
    toks, snap, (r,) = roundtrip([a], list(range(17)))
    assert {n: t.dtype for n, t in snap.boundary.items()} == {"0.a0": "bfloat16", "0.a2": "float32"}
    assert snap.boundary_meta["0"] == {"none": [1]}
    assert type(r) is C.ArraysCache and r.cache[1] is None
    assert same(r.cache[0], a.cache[0]) and same(r.cache[2], a.cache[2])
    assert r.left_padding is None and r.lengths is None


def test_arrays_cache_left_padding_survives():
    a = C.ArraysCache(1, left_padding=[3])
    a[0] = mx.ones((1, 4), dtype=mx.float16)
    _, _, (r,) = roundtrip([a], list(range(5)))
    assert same(r.left_padding, a.left_padding)


def test_arrays_only_model_needs_exact_boundary():
    toks, snap = snapshot(list(range(9)), [arrays_cache()])
    assert len(toks) == 9 and snap.sliced == {} and snap.meta["bnd"]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_chunked_kvcache_roundtrip(dtype):
    c = C.ChunkedKVCache(32)
    for t in (40, 30, 1):
        c.maybe_trim_front()
        feed(c, dtype, [t])
    assert c.start_position > 0
    _, snap, (r,) = roundtrip([c], list(range(71)))
    assert snap.boundary_meta["0"] == {"offset": 71, "start": c.start_position}
    assert (r.offset, r.start_position, r.chunk_size) == (71, c.start_position, 32)
    assert same(r.keys_and_values(), c.keys_and_values())
    drive_both(c, r, dtype, steps=(1, 5))


def test_cache_list_nested():
    kv = C.KVCache()
    feed(kv, mx.bfloat16, [12])
    rot = C.RotatingKVCache(max_size=8)
    feed(rot, mx.bfloat16, [12])
    lst = C.CacheList(arrays_cache(), kv)
    toks, snap, (r0, r1) = roundtrip([lst, C.CacheList(rot)], list(range(12)))
    assert set(snap.sliced) == {"0.1.k", "0.1.v"}
    assert set(snap.boundary) == {"0.0.a0", "0.0.a2", "1.0.k", "1.0.v"}
    assert snap.meta["layers"][0] == {"k": "list", "sub": [{"k": "arrays", "n": 3}, {"k": "kv"}]}
    assert type(r0) is C.CacheList and type(r0.caches[1]) is C.KVCache
    assert r0.caches[1].offset == 12 and r1.caches[0].offset == 12
    assert same(r0.caches[1].keys, kv.keys[..., :12, :])
    assert same(r1.caches[0].keys, rot.keys)


# -- rules --------------------------------------------------------------------------------


def test_explicit_attributes_not_state(monkeypatch):
    """kvd reads keys/values/offset, never `state` (its layout differs across mlx-lm versions)."""
    caches = [C.KVCache(), C.QuantizedKVCache(32, 4), C.RotatingKVCache(16), arrays_cache()]
    for c in caches[:3]:
        feed(c, mx.float16, [20])
    for cls in (C.KVCache, C.QuantizedKVCache, C.RotatingKVCache, C.ArraysCache):
        monkeypatch.setattr(cls, "state", property(lambda self: pytest.fail("state was read")))
    toks, snap = snapshot(list(range(20)), caches)
    rebuilt = rebuild(hit_from(snap, 20))
    assert [type(c) for c in rebuilt] == [type(c) for c in caches]


def test_unsupported_caches_are_refused():
    b = C.BatchKVCache([0])
    with pytest.raises(UnsupportedCache):
        snapshot([1, 2], [b])

    class MyCache(C.KVCache):
        pass

    with pytest.raises(UnsupportedCache):
        snapshot([1, 2], [MyCache()])


def test_layers_disagreeing_on_offset_are_refused():
    a, b = C.KVCache(), C.KVCache()
    feed(a, mx.float32, [10])
    feed(b, mx.float32, [11])
    with pytest.raises(SnapshotMismatch):
        snapshot(list(range(11)), [a, b])


def test_empty_cache_is_nothing_to_store():
    assert snapshot([1, 2, 3], [C.KVCache()]) is None


def test_rebuild_rejects_foreign_or_inconsistent_hits():
    c = C.KVCache()
    feed(c, mx.float32, [10])
    _, snap = snapshot(list(range(10)), [c])
    bad = hit_from(snap, 10)
    bad.meta = {"fmt": 999, "layers": snap.meta["layers"]}
    with pytest.raises(SnapshotMismatch):
        rebuild(bad)
    short = hit_from(snap, 10)
    short.n = 9  # tensors still hold 10 rows
    with pytest.raises(SnapshotMismatch):
        rebuild(short)
    missing = hit_from(snap, 10)
    del missing.sliced["0.v"]
    with pytest.raises(SnapshotMismatch):
        rebuild(missing)
    rot = C.RotatingKVCache(8)
    feed(rot, mx.float32, [10])
    _, rsnap = snapshot(list(range(10)), [rot])
    wrong_n = hit_from(rsnap, 10)
    wrong_n.n = 9  # boundary state is for 10 tokens
    with pytest.raises(SnapshotMismatch):
        rebuild(wrong_n)
