"""The snapshot's host memory pool (client/mlx_lm/_pool.py), alone and under `store`.

What must hold: the pool never holds more than its bound; a slab goes back
only when the last array carved from it is gone (so only after its upload,
whoever holds the bytes); two live snapshots never share memory; idle slabs
are released; and a snapshot is bit-exact what the cache held when `store`
returned, however the cache is changed right after.
"""

from __future__ import annotations

import os
import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C
from mlx_lm.models.cache import make_prompt_cache
from models import build, prefill, prompt
from support import FakeClock, numpy_owner, wait_until

from kvd_client import Client, _pair
from kvd_client.mlx_lm import _pool, snapshot
from kvd_client.mlx_lm._pool import BufferPool

MiB = 1 << 20



def arrays(snap):
    return [t.array for t, _ in snap.sliced.values()] + [t.array for t in snap.boundary.values()]


def kv_cache(tokens=300, layers=4, dtype=mx.bfloat16, seed=0):
    caches = []
    for i in range(layers):
        c = C.KVCache()
        k = mx.random.normal((1, 2, tokens, 64), key=mx.random.key(seed * 100 + i)).astype(dtype)
        c.update_and_fetch(k, -k)
        caches.append(c)
    mx.eval([c.state for c in caches])
    return caches


# -- the pool alone ---------------------------------------------------------------


def test_a_slab_returns_only_when_the_last_array_carved_from_it_is_gone():
    pool = BufferPool(64 * MiB)
    lease = pool.lease(2 * MiB)
    a = lease.carve((1024, 256), np.uint16)
    b = lease.carve((3, 5), np.float32)
    assert not np.shares_memory(a, b) and b.ctypes.data % _pool.ALIGN == 0
    held = pool.held_bytes
    assert held >= 2 * MiB and pool.free_bytes == 0
    del lease
    bv = b.reshape(-1)[2:]  # a view of a view still holds it
    del b, a
    assert pool.free_bytes == 0
    del bv
    assert pool.free_bytes == held
    with pytest.raises(ValueError):
        pool.lease(MiB).carve((2 * MiB,), np.uint8)  # no carving past the slab


def test_the_pool_never_holds_more_than_its_bound():
    pool = BufferPool(10 * MiB)
    first = pool.lease(4 * MiB).carve((4 * MiB,), np.uint8)
    second = pool.lease(4 * MiB).carve((4 * MiB,), np.uint8)
    assert not np.shares_memory(first, second)
    assert pool.held_bytes <= 10 * MiB
    assert pool.lease(4 * MiB) is None  # both leased: no room, the caller copies into fresh memory
    assert pool.lease(11 * MiB) is None  # never, however empty
    first_at = first.ctypes.data
    del first
    again = pool.lease(3 * MiB).carve((3 * MiB,), np.uint8)  # a free slab it fits: reused
    assert again.ctypes.data == first_at and pool.held_bytes <= 10 * MiB
    del again
    # 6 MiB fits no free slab; dropping the free one still leaves no room beside the leased one.
    assert pool.lease(6 * MiB) is None and pool.held_bytes <= 10 * MiB
    del second
    big = pool.lease(9 * MiB)  # the free slabs make room, least recently used first
    assert big is not None and pool.held_bytes <= 10 * MiB
    assert pool.free_bytes == 0


def test_a_small_request_does_not_take_a_big_free_slab():
    pool = BufferPool(64 * MiB)
    big = pool.lease(16 * MiB).carve((16 * MiB,), np.uint8)
    big_at = big.ctypes.data
    del big
    small = pool.lease(MiB).carve((MiB,), np.uint8)
    assert not (big_at <= small.ctypes.data < big_at + 16 * MiB)
    assert pool.lease(10 * MiB).carve((1,), np.uint8).ctypes.data == big_at


def test_idle_slabs_are_released():
    clock = FakeClock(100.0)
    pool = BufferPool(64 * MiB, idle_s=30.0, clock=clock)
    kept = pool.lease(2 * MiB).carve((2 * MiB,), np.uint8)
    dropped = pool.lease(4 * MiB).carve((4 * MiB,), np.uint8)
    del dropped
    clock.advance(29.0)
    assert pool.trim() == 0 and pool.free_bytes >= 4 * MiB
    clock.advance(1.0)
    # Dropped by this trim, or by the pool's reaper thread if it has run since
    # the slab came back: it reads the same clock (was a flake: trim() == 0).
    pool.trim()
    assert pool.free_bytes == 0 and 2 * MiB <= pool.held_bytes < 4 * MiB  # a leased slab is never released
    del kept
    clock.advance(30.0)
    pool.trim()
    assert pool.held_bytes == 0


def test_the_reaper_releases_idle_slabs_on_its_own():
    pool = BufferPool(64 * MiB, idle_s=0.05)
    x = pool.lease(MiB).carve((MiB,), np.uint8)
    del x
    wait_until(lambda: pool.held_bytes == 0, what="the idle slab to be released")


def test_a_forked_child_starts_a_pool_of_its_own():
    pool = BufferPool(64 * MiB)
    parents = pool.lease(2 * MiB).carve((2 * MiB,), np.uint8)
    pid = os.fork()
    if pid == 0:  # the child: numpy only, then out without running anything of pytest's
        ok = False
        try:
            mine = pool.lease(MiB).carve((MiB,), np.uint8)
            ok = pool.held_bytes < 2 * MiB and not np.shares_memory(mine, parents)
            del parents  # the parent's lease: never given back into the child's pool
            ok = ok and pool.free_bytes == 0
            del mine
            ok = ok and 0 < pool.free_bytes == pool.held_bytes < 2 * MiB
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pool.held_bytes >= 2 * MiB and pool.free_bytes == 0  # the parent's pool as it was
    del parents
    assert pool.free_bytes >= 2 * MiB


# -- snapshots ----------------------------------------------------------------------


def test_snapshots_copy_into_the_pool_and_two_live_ones_never_share_memory():
    pool = BufferPool(256 * MiB)
    cache = kv_cache()
    toks = list(range(300))
    want = snapshot(toks, cache, pool=None)[1]  # fresh memory, the reference
    _, one = snapshot(toks, cache, pool=pool)
    _, two = snapshot(toks, cache, pool=pool)
    for snap in (one, two):
        assert all(numpy_owner(a) is not numpy_owner(arrays(want)[0]) and numpy_owner(a).flags.owndata for a in arrays(snap))
        for name, (t, _) in want.sliced.items():
            assert snap.sliced[name][0].equal(t)
    assert not any(np.shares_memory(a, b) for a in arrays(one) for b in arrays(two))
    at = arrays(one)[0].ctypes.data
    del one
    _, three = snapshot(toks, cache, pool=pool)  # the slab `one` left behind, touched already
    assert arrays(three)[0].ctypes.data == at
    assert not any(np.shares_memory(a, b) for a in arrays(three) for b in arrays(two))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_pooled_snapshots_are_bit_exact_for_every_layout(dtype):
    pool = BufferPool(256 * MiB)
    caches = [C.KVCache(), C.RotatingKVCache(max_size=64, keep=4), C.ArraysCache(2),
              C.CacheList(C.KVCache(), C.ArraysCache(1)), C.KVCache()]
    for i, c in enumerate(caches):
        k = mx.random.normal((1, 2, 100, 16), key=mx.random.key(i)).astype(dtype)
        if isinstance(c, C.ArraysCache):
            c[0] = k[..., :3, :]
        elif isinstance(c, C.CacheList):
            c.caches[0].update_and_fetch(k, k * 2)
            c.caches[1][0] = k[:, :1]
        else:
            c.update_and_fetch(k, k + 1)
    quant = C.KVCache()
    quant.update_and_fetch(*(mx.random.normal((1, 2, 100, 64), key=mx.random.key(9)).astype(dtype),) * 2)
    caches.append(quant.to_quantized(group_size=32, bits=4))
    mx.eval([c.state for c in caches])
    toks = list(range(100))
    _, want = snapshot(toks, caches, pool=None)
    _, got = snapshot(toks, caches, pool=pool)
    assert pool.held_bytes > 0 and pool.free_bytes == 0
    assert want.sliced.keys() == got.sliced.keys() and want.boundary.keys() == got.boundary.keys()
    for name, (t, axis) in want.sliced.items():
        assert got.sliced[name][0].equal(t) and got.sliced[name][1] == axis
    for name, t in want.boundary.items():
        assert got.boundary[name].equal(t)
    assert got.boundary_meta == want.boundary_meta and got.meta == want.meta


@pytest.mark.skipif(_pair._cores() < 2, reason="one core: no helper thread")
def test_a_big_snapshot_is_copied_on_two_threads_and_is_bit_exact(monkeypatch):
    """2 MiB or more into a slab: the copy is shared with the process's helper
    thread (kvd_client._pair), each tensor copied once, by one of the two,
    half the bytes each; the caller's thread does its half."""
    from kvd_client import _chunking

    copies: dict[int, list[int]] = {}
    real = np.copyto

    class Spy:  # numpy as _chunking sees it, its copies noted by thread
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def copyto(dst, src, **kw):
            copies.setdefault(threading.get_ident(), []).append(dst.nbytes)
            real(dst, src, **kw)

    cache = kv_cache(tokens=2048, layers=4)  # 8 tensors of 512 KiB
    toks = list(range(2048))
    _, want = snapshot(toks, cache, pool=None)  # fresh memory (np.array), the reference
    monkeypatch.setattr(_chunking, "np", Spy())
    _, got = snapshot(toks, cache, pool=BufferPool(256 * MiB))
    for name, (t, axis) in want.sliced.items():
        assert got.sliced[name][0].equal(t) and got.sliced[name][1] == axis
    assert len(copies) == 2 and threading.get_ident() in copies
    assert sorted(sum(v) for v in copies.values()) == [4 * 512 << 10] * 2


# -- under store, through a real daemon --------------------------------------------------


class HeldUpload:
    """Wraps a client's put: each upload waits until the test lets it go."""

    def __init__(self, kv):
        self.put = kv.put
        self.started = threading.Event()
        self.go = threading.Event()
        kv.put = self

    def __call__(self, *args, **kw):
        self.started.set()
        assert self.go.wait(30), "the test never let the upload go"
        return self.put(*args, **kw)


@pytest.mark.parametrize("transport", ["shm", "frames"])
def test_a_slab_goes_back_only_after_its_upload(kvd_daemon, transport):
    pool = BufferPool(256 * MiB)
    cache = kv_cache(tokens=512)
    toks = prompt(512)
    with Client(kvd_daemon.endpoint, namespace=f"pool-{transport}", transport=transport, chunk_tokens=256) as kv:
        kv.snapshot_pool = pool
        held = HeldUpload(kv)
        assert kv.store(toks, cache)
        assert held.started.wait(30)
        one = pool.held_bytes
        assert one > 0 and pool.free_bytes == 0  # the upload has not run: the slab is still out
        assert kv.store(prompt(512, seed=7), cache)  # the next snapshot, taken meanwhile, gets a slab of its own
        assert pool.held_bytes >= 2 * one and pool.free_bytes == 0
        held.go.set()
        assert kv.flush_stores(30) and kv.counters["stored"] == 2
        # On the frames plane ZeroMQ may still hold a sent frame for a moment: it holds the lease too.
        wait_until(lambda: pool.free_bytes == pool.held_bytes, what="the slabs to come back after their uploads")


@pytest.mark.parametrize("transport", ["shm", "frames"])
def test_the_snapshot_is_the_cache_as_store_returned_it(kvd_daemon, transport):
    model = build("llama")
    toks = prompt(200)
    cache = make_prompt_cache(model)
    prefill(model, toks, cache)
    _, want = snapshot(toks, cache, pool=None)  # a copy taken before store
    with Client(kvd_daemon.endpoint, namespace=f"mutate-{transport}", transport=transport, chunk_tokens=64) as kv:
        held = HeldUpload(kv)
        assert kv.store(toks, cache)
        # Right after store returns, the cache is rewritten in place: the last
        # 40 rows are trimmed and others decoded over them.
        for c in cache:
            c.trim(40)
        prefill(model, prompt(40, seed=9), cache)
        _, now = snapshot(toks, cache, pool=None)
        assert any(not now.sliced[n][0].equal(t) for n, (t, _) in want.sliced.items())  # it did change
        held.go.set()
        assert kv.flush_stores(30) and kv.counters["stored"] == 1
        hit = kv.get(toks + [1], max_tokens=len(toks))
    assert hit is not None and hit.n == len(toks)
    for name, (t, _) in want.sliced.items():
        assert hit.sliced[name].equal(t), name
