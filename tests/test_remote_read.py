"""The remote tier's read path against a real redis-server, in process.

`get_many` (kvd/store/remote_get.py) reads pipelined GET replies straight
into caller buffers on a connection borrowed from redis-py's pool: values of
every size come back bit for bit, a missing key is None, an error reply
raises like redis-py's pipeline and leaves no half-read connection in the
pool. `WithRemote` streams a chain's chunks on the reader threads, batches
queued ahead of the GETs that consume them; a hole in the chain is a miss
(counted), and boundary state read mid-stream leaves the stream running.
"""

from __future__ import annotations

import numpy as np
import pytest
import redis

from kvd.protocol import remote_value as rv
from kvd.protocol.codec import Tensor
from kvd.store import RamStore
from kvd.store.base import BOUNDARY, CHUNK, Entry
from kvd.store.remote import RemoteTier, WithRemote
from kvd.store.remote_get import get_many
from redis_server import SKIP_REASON, RedisServer, redis_binary

pytestmark = pytest.mark.skipif(redis_binary() is None, reason=SKIP_REASON)

MiB = 1 << 20


@pytest.fixture(scope="module")
def server():
    s = RedisServer().start()
    yield s
    s.close()


def test_get_many_reads_values_of_every_size_bit_exact(server):
    r = redis.Redis.from_url(server.url, max_connections=1)  # one connection: what get_many leaves, the next command meets
    rng = np.random.default_rng(1)
    sizes = [0, 1, 2, 65_535, 65_536, 65_537, 3 * MiB + 7]
    values = {b"gm:%d" % n: rng.bytes(n) for n in sizes}
    for k, v in values.items():
        r.set(k, v)
    asked = []

    def alloc(n):
        asked.append(n)
        return np.empty(n, np.uint8)

    names = [*values, b"gm:absent", *values]
    got = get_many(r, names, alloc)
    assert asked == [len(v) for v in values.values()] * 2
    assert got[len(values)] is None
    for name, buf in zip(names, got):
        if name in values:
            assert bytes(buf) == values[name]
    assert r.get(b"gm:65537") == values[b"gm:65537"]  # the pooled connection is in step
    assert get_many(r, []) == []


def test_get_many_error_reply_raises_and_the_client_recovers(server):
    r = redis.Redis.from_url(server.url, max_connections=1)
    r.set(b"gm:ok", b"x" * 100_000)
    r.hset(b"gm:hash", b"f", b"v")  # GET of a hash: WRONGTYPE
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        get_many(r, [b"gm:hash", b"gm:ok"])
    assert r.get(b"gm:ok") == b"x" * 100_000  # a fresh connection, not the half-read one
    assert [bytes(v) for v in get_many(r, [b"gm:ok"])] == [b"x" * 100_000]


def test_get_many_reads_resp3_nulls(server):
    r = redis.Redis.from_url(server.url, protocol=3, max_connections=1)
    r.set(b"gm:3", b"three")
    got = get_many(r, [b"gm:none", b"gm:3", b"gm:none"])
    assert got[0] is None and bytes(got[1]) == b"three" and got[2] is None
    assert r.get(b"gm:3") == b"three"


def _chain(n: int, nbytes: int, seed: int) -> list[Entry]:
    rng = np.random.default_rng(seed)
    parent, out = rng.bytes(32), []
    for i in range(n):
        key = rng.bytes(32)
        data = rng.integers(0, 256, nbytes, dtype=np.uint8)
        out.append(Entry("rd", key, CHUNK, parent, i * 16, 16, (Tensor("t", "uint8", (nbytes,), data),)))
        parent = key
    return out


def _tier_with(server, entries, **kw) -> RemoteTier:
    writer = RemoteTier(server.url, timeout=5.0)
    try:
        for e in entries:
            writer.offer(e)
        assert writer.flush(30)
    finally:
        writer.close()
    return RemoteTier(server.url, timeout=5.0, **kw)


def _same(a: Entry, b: Entry) -> bool:
    return (a.id, a.parent, a.start, a.length) == (b.id, b.parent, b.start, b.length) and all(
        bytes(memoryview(x.data).cast("B")) == bytes(memoryview(y.data).cast("B")) for x, y in zip(a.tensors, b.tensors)
    )


def test_a_chain_is_streamed_ahead_and_served_bit_exact(server):
    chain = _chain(12, 256 * 1024, seed=2)
    bound = Entry("rd", chain[-1].key, BOUNDARY, chain[-1].parent, chain[-1].start, 16,
                  (Tensor("s", "uint8", (64,), bytes(range(64))),))
    # fetch_bytes 1 MiB: batches of one entry, at most 2 MiB read ahead
    store = WithRemote(RamStore(64 * MiB), _tier_with(server, [*chain, bound], fetch_bytes=MiB))
    try:
        ids = [e.id for e in chain] + [bound.id]
        assert store.held(ids) == [True] * len(ids)
        first = store.get(chain[0].id)
        assert first is not None and _same(first, chain[0])
        assert store._ahead, "the next batches are queued on the reader threads"
        ahead = sum(len(asked) for asked, _ in store._ahead)
        assert ahead * 256 * 1024 <= 2 * MiB + 256 * 1024
        got_b = store.get(bound.id)  # read alone: the stream keeps going
        assert got_b is not None and _same(got_b, bound) and store._ahead
        for e in chain[1:]:
            got = store.get(e.id)
            assert got is not None and _same(got, e)
        assert not store._ahead and not store._stream
        rs = store.remote.counters
        assert rs["hits"] == 13 and rs["promotions"] == 13 and rs["misses"] == 0
        assert all(store.local.get(e.id) is not None for e in chain)  # promoted
    finally:
        store.close()


def test_a_hole_in_a_streamed_chain_is_a_miss_never_an_error(server):
    chain = _chain(6, 64 * 1024, seed=3)
    store = WithRemote(RamStore(64 * MiB), _tier_with(server, chain, fetch_bytes=4 * 64 * 1024))
    try:
        assert store.held([e.id for e in chain]) == [True] * 6
        server.client().delete(rv.value_key(chain[3].key, CHUNK))  # evicted between LOOKUP and GET
        served = [store.get(e.id) for e in chain[:4]]
        assert all(_same(g, e) for g, e in zip(served[:3], chain[:3])) and served[3] is None
        rs = store.remote.counters
        assert rs["misses"] == 1 and rs["errors"] == 0 and not store.remote.degraded
        assert not store._stream  # nothing after the hole is queued
    finally:
        store.close()


def test_a_reply_longer_than_any_value_is_refused_before_allocating():
    """A server (or something posing as one) announcing a huge bulk reply is a
    protocol error: nothing is allocated for it (get_many then drops the connection)."""
    import socket

    from kvd.store import remote_get

    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"$%d\r\n" % (remote_get.MAX_VALUE + 1))
        asked = []
        with pytest.raises(redis.ConnectionError, match="over"):
            remote_get._Replies(ours).bulk(lambda n: asked.append(n))
        assert asked == []
        theirs.sendall(b"$5\r\nhello\r\n$-1\r\n-ERR no\r\n")  # and what is a value still reads
        replies = remote_get._Replies(ours)
        assert bytes(replies.bulk(remote_get.np_alloc)) == b"hello" and replies.bulk(remote_get.np_alloc) is None
        with pytest.raises(redis.ResponseError, match="no"):
            replies.bulk(remote_get.np_alloc)
