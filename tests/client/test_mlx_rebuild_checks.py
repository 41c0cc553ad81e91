"""A hit whose tensors no mlx-lm cache could hold is a miss, never a cache.

Any process of the user may write a namespace (proto/PROTOCOL.md section 11),
and a hit consistent in itself still has to be what the cache class makes:
quantized triples as mx.quantize lays them out, a ring buffer's rows within
what it has seen, a chunked window's rows those since its start, keys and
values in floating point, scalars that are numbers. Before, such hits became
caches that failed in the model's next step (outside the adapters' guards)
or, for a ring buffer short of rows, attended over rows of zeros.

Each case starts from a real cache of its class, snapshotted as `store` does
(so the unchanged hit must rebuild: the test can fail both ways), then
changes one thing.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from fakes import hit_from
from mlx_lm.models import cache as C

from kvd_client._tensors import HostTensor
from kvd_client.mlx_lm import snapshot
from kvd_client.mlx_lm._format import SnapshotMismatch
from kvd_client.mlx_lm._rebuild import rebuild

T = 40


def _quantized():
    q = C.QuantizedKVCache(group_size=32, bits=4)
    k = mx.random.normal((1, 2, T, 64), key=mx.random.key(3)).astype(mx.float16)
    q.update_and_fetch(k, k - 1)
    return q


def _rotating():
    rot = C.RotatingKVCache(max_size=16, keep=2)
    for t in (T - 2, 1, 1):  # wrapped: 40 tokens in a ring of 16
        r = mx.random.normal((1, 2, t, 8), key=mx.random.key(t)).astype(mx.bfloat16)
        rot.update_and_fetch(r, r)
    return rot


def _chunked():
    c = C.ChunkedKVCache(16)
    k = mx.random.normal((1, 2, T, 8), key=mx.random.key(5))
    c.update_and_fetch(k, k)
    c.maybe_trim_front()
    return c


def _kv():
    c = C.KVCache()
    k = mx.random.normal((1, 2, T, 8), key=mx.random.key(7)).astype(mx.bfloat16)
    c.update_and_fetch(k, k)
    return c


MAKERS = {"qkv": _quantized, "rot": _rotating, "chunked": _chunked, "kv": _kv}


def _hit(kind):
    _, snap = snapshot(list(range(T)), [MAKERS[kind]()])
    return hit_from(snap, T)


def _retype(hit, name, dtype, *, boundary=False):
    where = hit.boundary if boundary else hit.sliced
    where[name] = HostTensor(dtype, np.ones(where[name].shape, {"float16": np.float16, "float32": np.float32,
                                                                 "int8": np.int8}[dtype]))


def _reshape(hit, name, shape, *, boundary=False):
    where = hit.boundary if boundary else hit.sliced
    where[name] = HostTensor(where[name].dtype, np.zeros(shape, where[name].array.dtype))


def _rows(hit, rows):
    for name in ("0.k", "0.v"):
        a = hit.boundary[name].array
        hit.boundary[name] = HostTensor(hit.boundary[name].dtype, np.ascontiguousarray(a[:, :, :rows]))


CASES = {
    "qkv: packed codes of a float dtype": ("qkv", lambda h: _retype(h, "0.k.q", "float16")),
    "qkv: scales of another group count": ("qkv", lambda h: _reshape(h, "0.k.s", (1, 2, T, 3))),
    "qkv: biases of another dtype than the scales": ("qkv", lambda h: _retype(h, "0.v.b", "float32")),
    "rot: fewer rows than it has seen": ("rot", lambda h: _rows(h, 3)),
    "rot: its index past its rows": ("rot", lambda h: h.boundary_meta["0"].__setitem__("idx", 99)),
    "rot: an offset of infinity": ("rot", lambda h: h.boundary_meta["0"].__setitem__("offset", float("inf"))),
    "rot: a ring of no rows": ("rot", lambda h: h.meta["layers"][0].__setitem__("max", 0)),
    "rot: keeping more than it holds": ("rot", lambda h: h.meta["layers"][0].__setitem__("keep", 100)),
    "chunked: chunks of no tokens": ("chunked", lambda h: h.meta["layers"][0].__setitem__("cs", 0)),
    "chunked: rows not those since its start": ("chunked", lambda h: _rows(h, 5)),
    "chunked: a start past its offset": ("chunked", lambda h: h.boundary_meta["0"].__setitem__("start", T + 1)),
    "kv: integer keys": ("kv", lambda h: (_retype(h, "0.k", "int8"), _retype(h, "0.v", "int8"))),
    "kv: 2**31 heads of no bytes": ("kv", lambda h: (_reshape(h, "0.k", (1, 2**31, T, 0)),
                                                     _reshape(h, "0.v", (1, 2**31, T, 0)))),
}


@pytest.mark.parametrize("kind", list(MAKERS))
def test_the_hit_of_a_real_cache_rebuilds(kind):
    (c,) = rebuild(_hit(kind))
    assert type(c) is type(MAKERS[kind]()) and c.offset == T


@pytest.mark.parametrize("case", list(CASES))
def test_a_hit_no_cache_of_its_class_could_hold_is_a_mismatch(case):
    kind, change = CASES[case]
    hit = _hit(kind)
    change(hit)
    with pytest.raises(SnapshotMismatch):
        rebuild(hit)
