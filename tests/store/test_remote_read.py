"""The remote tier's read path against a real redis-server, in process.

`get_many` (kvd/store/remote/get.py) reads pipelined GET replies straight
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
from kvd.store.remote.layered import WithRemote
from kvd.store.remote.tier import RemoteTier
from kvd.store.remote.get import Refused, get_many
from redis_server import SKIP_REASON, RedisServer, module_server, redis_binary, session_key, write_entries  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(redis_binary() is None, reason=SKIP_REASON)

MiB = 1 << 20




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


def test_get_many_an_error_reply_is_that_keys_refusal_and_the_rest_is_read(server):
    r = redis.Redis.from_url(server.url, max_connections=1)
    r.set(b"gm:ok", b"x" * 100_000)
    r.hset(b"gm:hash", b"f", b"v")  # GET of a hash: WRONGTYPE
    got = get_many(r, [b"gm:hash", b"gm:ok", b"gm:hash"])
    assert isinstance(got[0], Refused) and "WRONGTYPE" in got[0].reason and not got[0].unread
    assert bytes(got[1]) == b"x" * 100_000 and isinstance(got[2], Refused)
    assert r.get(b"gm:ok") == b"x" * 100_000  # the one pooled connection is in step


def test_get_many_refuses_a_value_of_another_length_before_allocating_it(server):
    """Each part's length is known from its header: it is asked for with
    GETRANGE, so the server sends at most that many bytes whatever the key
    holds, and a shorter reply is refused from its "$n" line, nothing
    allocated for it; after a long one (left unread) the keys after it are
    asked again on a fresh connection, less the refused key's group (the
    other parts of a value already refused)."""
    r = redis.Redis.from_url(server.url, max_connections=1)
    small, short = b"s" * 1000, b"S" * (3 * MiB)
    r.mset({b"gm:a": small, b"gm:short": short, b"gm:mate": b"m" * (4 * MiB), b"gm:c": small, b"gm:tiny": b"t"})
    r.setrange(b"gm:huge", 300 * MiB - 1, b"x")  # 300 MiB on the server: never sent
    asked = []

    def alloc(n):
        asked.append(n)
        return np.empty(n, np.uint8)

    names = [b"gm:a", b"gm:short", b"gm:mate", b"gm:c", b"gm:none", b"gm:tiny", b"gm:huge", b"gm:a"]
    sizes = [1000, 4 * MiB, 4 * MiB, 1000, 1000, 1000, 1000, 1000]
    got = get_many(r, names, alloc, sizes=sizes, groups=[0, 1, 1, 2, 3, 4, 5, 6])
    assert asked == [1000, 1000, 1000, 1000]  # never 3 MiB, never 300 MiB
    assert bytes(got[0]) == small and bytes(got[3]) == small and bytes(got[7]) == small
    assert got[4] is None  # a missing key reads as empty, which no part is
    assert isinstance(got[1], Refused) and got[1].unread and "3145728-byte" in got[1].reason
    assert isinstance(got[2], Refused) and not got[2].unread  # its group-mate, not asked again
    assert isinstance(got[5], Refused) and not got[5].unread  # a short one is read past: the connection goes on
    assert bytes(got[6]) == b"\0" * 1000  # bytes past a part's length are never sent (the checksum judges these)
    assert r.get(b"gm:c") == small  # the pool's connection is in step
    # without sizes, `most` bounds every value: GET, and nothing allocated past it
    got = get_many(r, [b"gm:short", b"gm:a"], alloc, most=MiB)
    assert isinstance(got[0], Refused) and got[0].unread and bytes(got[1]) == small and asked[-1] == 1000
    with pytest.raises(ValueError):
        get_many(r, [b"gm:a"], sizes=[0])  # GETRANGE 0 -1 would be the whole value


def test_get_many_first_reads_at_most_that_many_bytes_of_any_value(server):
    """`first` (the presence check): GETRANGE 0 first-1 of values of any
    length, a shorter one read as it is, a missing key empty, a key of
    another type that key's refusal; the connection stays in step."""
    r = redis.Redis.from_url(server.url, max_connections=1)
    r.set(b"gm:long", b"L" * MiB)
    r.set(b"gm:short", b"abc")
    r.delete(b"gm:none", b"gm:hash")
    r.hset(b"gm:hash", "x", "y")
    got = get_many(r, [b"gm:long", b"gm:short", b"gm:none", b"gm:hash"], bytearray, first=24)
    assert got[:3] == [b"L" * 24, b"abc", b""] and isinstance(got[3], Refused) and "WRONGTYPE" in got[3].reason
    assert r.get(b"gm:short") == b"abc"  # the pool's connection is in step
    with pytest.raises(ValueError):
        get_many(r, [b"gm:a"], first=0)
    with pytest.raises(ValueError):
        get_many(r, [b"gm:a"], sizes=[3], first=3)


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
    write_entries(server.url, entries)
    return RemoteTier(server.url, auth=session_key(), timeout=5.0, **kw)


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
        ahead = sum(len(b.ids) for b in store._ahead)
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
    """A server (or something posing as one) announcing a huge bulk reply:
    that key is refused unread, nothing allocated for it (get_many then drops
    the connection). An error reply about a key is that key's refusal; one
    about the whole server (LOADING, ...) raises."""
    import socket

    from kvd.store.remote import get as remote_get

    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"$%d\r\n" % (remote_get.MAX_VALUE + 1))
        asked = []
        got = remote_get._Replies(ours).value(lambda n: asked.append(n))
        assert isinstance(got, Refused) and got.unread and "over" in got.reason and asked == []
        theirs.sendall(b"$5\r\nhello\r\n$-1\r\n-ERR no\r\n-LOADING Redis is loading the dataset in memory\r\n")
        replies = remote_get._Replies(ours)  # and what is a value still reads
        assert bytes(replies.value(remote_get.np_alloc)) == b"hello" and replies.value(remote_get.np_alloc) is None
        assert replies.value(remote_get.np_alloc) == Refused("error reply: ERR no")
        with pytest.raises(redis.ResponseError, match="LOADING"):
            replies.value(remote_get.np_alloc)
