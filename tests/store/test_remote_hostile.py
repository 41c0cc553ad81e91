"""The remote tier against a server that is hostile, full, slow or shared.

Everything here is real: a redis-server (tests/redis_server.py), values
planted straight into it the way another program (or an attacker with write
access) would, a TCP relay thread that trickles the server's replies, and
for the end-to-end case two `kvd serve` daemons. What is asserted:

- a planted value that promises too much (a million parts; parts of 64 MiB
  where its header says 1 byte) is a miss plus `checksum_failures`: no part
  is asked for beyond what the header allows, nothing allocated beyond it;
- a key of another Redis type is that key's miss, never a degraded tier;
- a full server (OOM) keeps reads on, backs off its writes, one log line;
- a link that trickles bytes costs a read at most `timeout` in all;
- a GET streams only its own walk's chain, sized by its own entries, and
  a popular prefix's thousands of tails neither crowd out what a LOOKUP
  promised nor travel whole.
Waits are bounded polls or the tier's own condition, never fixed sleeps.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import msgpack
import numpy as np
import pytest
import xxhash

from kvd.protocol import keys
from kvd.protocol import remote_value as rv
from kvd.protocol.codec import Tensor
from kvd.store import RamStore
from kvd.store.base import CHUNK, Entry, entry_id
from kvd.store.remote.layered import WithRemote
from kvd.store.remote.pending import Pending
from kvd.store.remote.tier import RemoteTier
from redis_server import SKIP_REASON, RedisServer, module_server, redis_binary, session_key  # noqa: F401 (a fixture)
from redis_server import write_entries as write
from support import assert_prefix_hit, prefix_snapshot, wait_until

pytestmark = pytest.mark.skipif(redis_binary() is None, reason=SKIP_REASON)

MiB = 1 << 20




@pytest.fixture
def r(server):
    client = server.client()
    client.flushall()
    client.config_resetstat()
    return client


def calls(r, command: str) -> int:
    return int(r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def chain(n: int, nbytes: int, seed: int, ns: str = "h") -> list[Entry]:
    rng = np.random.default_rng(seed)
    parent, out = rng.bytes(32), []
    for i in range(n):
        key = rng.bytes(32)
        data = rng.integers(0, 256, nbytes, dtype=np.uint8)
        out.append(Entry(ns, key, CHUNK, parent, i * 16, 16, (Tensor("t", "uint8", (nbytes,), data),)))
        parent = key
    return out


def tail_of(parent: Entry, nbytes: int, seed: int, length: int = 5) -> Entry:
    rng = np.random.default_rng(seed)
    return Entry(parent.namespace, rng.bytes(32), CHUNK, parent.key, parent.start + 16, length,
                 (Tensor("t", "uint8", (nbytes,), rng.integers(0, 256, nbytes, dtype=np.uint8)),), tail=True)


def same(a: Entry | None, b: Entry) -> bool:
    return a is not None and a.id == b.id and all(
        bytes(memoryview(x.data).cast("B")) == bytes(memoryview(y.data).cast("B")) for x, y in zip(a.tensors, b.tensors)
    )


def planted(key: bytes, *, size: int, parts: int, part_bytes: int) -> bytes:
    """A main value whose header passes every field check, promising what a hostile writer likes."""
    header = msgpack.packb({
        "v": 1, "ns": "h", "key": key, "kind": 0, "parent": b"\0" * 32, "start": 0, "length": 16, "tail": False,
        "meta": b"", "tensors": [["x", "uint8", [size]]], "size": size, "parts": parts, "part_bytes": part_bytes,
    }, use_bin_type=True)
    return struct.pack("<4sQI", b"KVR1", xxhash.xxh3_64(header).intdigest(), len(header)) + header + b"\0"


# -- values that promise too much ----------------------------------------------------


def test_a_header_promising_a_million_parts_is_refused_without_asking_for_one(server, r):
    good = chain(2, 4096, seed=1)
    write(server.url, good)
    bad = b"\x11" * 32
    r.set(rv.value_key(bad, CHUNK), planted(bad, size=1 << 20, parts=1 << 20, part_bytes=1))
    tier = RemoteTier(server.url, auth=session_key(), timeout=5.0)
    try:
        r.config_resetstat()
        t = time.monotonic()
        got = tier.fetch([entry_id(bad), *(e.id for e in good)])
        took = time.monotonic() - t
        assert set(got) == {e.id for e in good} and all(same(got[e.id], e) for e in good)
        c = tier.counters
        assert c["checksum_failures"] == 1 and c["hits"] == 2 and c["errors"] == 0 and not tier.degraded
        assert calls(r, "get") == 3 and calls(r, "getrange") == 0  # the three main values: no part asked for
        assert took < 1.0  # the old reader built a million key names and pipelined a million GETs
    finally:
        tier.close()


def test_parts_longer_than_their_header_says_are_never_sent_nor_allocated(server, r):
    """Part keys holding 64 MiB each behind a header promising 1-byte parts:
    each part is asked for with its exact length (GETRANGE), so the server
    sends one byte, the checksum refuses the value, nothing big is allocated."""
    key = b"\x22" * 32
    main = rv.value_key(key, CHUNK)
    for i in (1, 2):
        r.setrange(rv.part_key(main, i), 64 * MiB - 1, b"x")
    r.set(main, planted(key, size=3, parts=3, part_bytes=1))
    good = chain(1, 4096, seed=2)
    write(server.url, good)
    tier = RemoteTier(server.url, auth=session_key(), timeout=5.0)
    asked: list[int] = []

    def alloc(n):
        asked.append(n)
        return np.empty(n, np.uint8)

    tier.alloc = alloc
    try:
        got = tier.fetch([entry_id(key), good[0].id])
        assert list(got) == [good[0].id] and same(got[good[0].id], good[0])
        assert max(asked) < 64 * 1024 and tier.counters["bytes_in"] < MiB
        assert tier.counters["checksum_failures"] == 1 and not tier.degraded
    finally:
        tier.close()


def test_a_payload_over_the_largest_entry_is_refused_from_its_header(server, r):
    big = chain(1, 2 * MiB, seed=3)
    write(server.url, big)
    tier = RemoteTier(server.url, auth=session_key(), timeout=5.0, max_entry_bytes=MiB)
    try:
        assert tier.fetch([big[0].id]) == {}
        assert tier.counters["checksum_failures"] == 1 and calls(r, "getrange") == 0 and not tier.degraded
    finally:
        tier.close()


# -- keys of another type ----------------------------------------------------------


def test_a_key_of_another_type_is_that_keys_miss_never_a_degraded_tier(server, r, caplog):
    entries = chain(3, 4096, seed=4)
    tail = tail_of(entries[-1], 512, seed=5)
    write(server.url, [*entries, tail])
    r.delete(rv.value_key(entries[1].key, CHUNK))
    r.hset(rv.value_key(entries[1].key, CHUNK), "x", "y")  # a hash where a value should be
    r.delete(rv.tails_key(entries[-1].key))
    r.set(rv.tails_key(entries[-1].key), b"not a hash")  # a string where the tails hash should be
    tier = RemoteTier(server.url, auth=session_key(), timeout=5.0)
    try:
        got = tier.fetch([e.id for e in entries])
        assert set(got) == {entries[0].id, entries[2].id}
        assert tier.tails(entries[-1].key) == [] and tier.tails_among(entries[-1].key, [(5, tail.key)]) == []
        c = tier.counters
        assert c["checksum_failures"] == 3 and c["errors"] == 0 and not tier.degraded and c["degraded_episodes"] == 0
        # a writer meeting the string where its tails hash goes writes its values all the same
        later = tail_of(entries[-1], 256, seed=6, length=7)
        tier.offer(later)
        assert tier.flush(10) and tier.counters["written"] == 1 and not tier.degraded and not tier.writes_refused
        assert r.exists(rv.value_key(later.key, CHUNK))
    finally:
        tier.close()
    assert "unavailable" not in caplog.text


def test_a_daemon_on_a_unix_socket_serves_past_a_key_of_another_type(daemon_factory):
    """End to end: the documented `unix:///path` form starts a daemon; a chunk
    key replaced by a hash is a miss for that prompt only, and another
    namespace's prompt right after it is served."""
    server = RedisServer()
    sock = str(server.dir / "redis.sock")
    server.extra += ["--unixsocket", sock, "--unixsocketperm", "700"]
    server.start()
    try:
        url = f"unix://{sock}"
        a = daemon_factory("--ram-mb", "64", "--remote-url", url)
        b = daemon_factory("--ram-mb", "64", "--remote-url", url)
        x, y = list(range(1000, 1800)), list(range(5000, 5600))
        with a.client("rt", strict=True) as ca, a.client("other", strict=True) as co:
            assert ca.put(x, prefix_snapshot(x)) and co.put(y, prefix_snapshot(y))
            wait_until(lambda: (lambda s: s["backlog"] == 0 and s["written"] == 7)(ca.stats()["tiers"]["remote"]))
        k1 = keys.chain("rt", 256, keys.token_bytes(x))[1]
        rc = server.client()
        rc.delete(rv.value_key(k1, CHUNK))
        rc.hset(rv.value_key(k1, CHUNK), "x", "y")
        with b.client("rt", strict=True) as cb, b.client("other", strict=True) as cbo:
            hx = cb.get(x)
            assert hx is not None and hx.n == 256  # chunk 0, then the bad chunk 1 is a miss
            hy = cbo.get(y)
            assert hy is not None and hy.n == 600
            assert_prefix_hit(hy, y)
            s = cb.stats()["tiers"]["remote"]
            assert s["checksum_failures"] == 1 and s["errors"] == 0 and not s["degraded"] and s["url"] == url
    finally:
        server.close()


# -- a full server -------------------------------------------------------------------


def test_a_full_server_keeps_reads_on_and_backs_off_its_writes(caplog):
    caplog.set_level(logging.INFO, logger="kvd.store.remote")
    server = RedisServer("--maxmemory", "2mb", "--maxmemory-policy", "noeviction").start()
    try:
        readable = chain(1, 4096, seed=7)
        write(server.url, readable)
        tier = RemoteTier(server.url, auth=session_key(), timeout=2.0, batch_entries=4)
        try:
            for e in chain(24, 256 * 1024, seed=8):  # 6 MiB for a 2 MiB server
                tier.offer(e)
            wait_until(lambda: tier.writes_refused)
            t0, errors0 = time.monotonic(), tier.counters["errors"]
            # reads go on meanwhile, from the loop thread's own connection
            assert tier.exists([readable[0].id]) == [True] and same(tier.fetch([readable[0].id])[readable[0].id], readable[0])
            # three more refusals take 0.25 + 0.5 + 1 s of growing backoff, not 3 x 0.27 s
            wait_until(lambda: tier.counters["errors"] >= errors0 + 3)
            assert time.monotonic() - t0 >= 1.5
            assert tier.counters["degraded_episodes"] == 0 and not tier.degraded
            assert tier.writes_refused.startswith("OOM") and tier.stats()["backlog"] > 0
            from kvd.cli.admin import render_stats  # what `kvd stats` shows an operator

            assert "WRITES REFUSED: OOM" in render_stats({"tiers": {"remote": tier.stats()}})
            server.client().config_set("maxmemory", "0")  # room again: the backlog drains by itself
            wait_until(lambda: tier.stats()["backlog"] == 0, timeout=20)
            assert not tier.writes_refused and tier.counters["degraded_episodes"] == 0
        finally:
            tier.close()
    finally:
        server.close()
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "kvd.store.remote"]
    assert sum("refuses writes" in line for line in lines) == 1
    assert sum("takes writes again" in line for line in lines) == 1
    assert not any("unavailable" in line for line in lines)


# -- a slow link ---------------------------------------------------------------------


class Listener:
    """A loopback TCP server posing as a Redis server (`url`): each connection
    it accepts is given to `_take`, on the accepting thread, until `close`."""

    def __init__(self):
        self.listen = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listen.getsockname()[1]}/0"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.listen.accept()
            except OSError:
                return
            self._take(c)

    def _take(self, c: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.listen.close()


class Relay(Listener):
    """A TCP relay to the server whose replies trickle: `rate` bytes/s in
    steps of `piece` bytes (16 KiB), so every recv returns long before a socket timeout."""

    def __init__(self, port: int, rate: int, piece: int = 16 << 10):
        self.port, self.rate, self.piece = port, rate, piece
        self.socks: list[socket.socket] = []
        super().__init__()

    def _take(self, c: socket.socket) -> None:
        u = socket.create_connection(("127.0.0.1", self.port))
        self.socks += [c, u]
        threading.Thread(target=self._pump, args=(c, u, False), daemon=True).start()
        threading.Thread(target=self._pump, args=(u, c, True), daemon=True).start()

    def _pump(self, src, dst, slow: bool) -> None:
        try:
            while data := src.recv(self.piece if slow else 1 << 16):
                dst.sendall(data)
                if slow and self.rate:
                    time.sleep(len(data) / self.rate)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        super().close()
        for s in self.socks:
            s.close()


def test_a_trickling_link_costs_a_read_at_most_the_timeout_in_all(server, r):
    entries = chain(4, 4 * MiB, seed=9)
    write(server.url, entries)
    relay = Relay(server.port, rate=1 * MiB)  # 4 MiB values: 4 s each
    store = WithRemote(RamStore(64 * MiB), RemoteTier(relay.url, auth=session_key(), timeout=0.4))
    try:
        ids = [e.id for e in entries]
        assert store.held(ids) == [True] * 4
        t = time.monotonic()
        assert store.get(ids[0]) is None  # a miss, not a 4 s wait on the loop thread
        assert time.monotonic() - t < 1.2
        assert store.remote.degraded and store.remote.counters["degraded_episodes"] == 1
        t = time.monotonic()
        assert store.get(ids[1]) is None and time.monotonic() - t < 0.1  # degraded: not asked at all
        # The link comes back to full speed: the late connection was dropped,
        # nothing of its reply is read as another's.
        relay.rate = 0
        wait_until(lambda: not store.remote.degraded)
        assert store.held(ids) == [True] * 4
        for e in entries:
            assert same(store.get(e.id), e)
    finally:
        store.close()
        relay.close()


def test_a_request_parked_on_a_server_that_answers_a_byte_at_a_time_is_answered_locally(server, r):
    """Red-team (session 41): a byte every 0.2 s beats a 0.4 s socket timeout
    at every recv, so the read never ended and the request parked on it was
    never answered (nor the reader thread freed for anyone else's)."""
    entries = chain(1, 1024, seed=11)
    write(server.url, entries)
    ids = [entries[0].id]
    relay = Relay(server.port, rate=5, piece=1)
    store = WithRemote(RamStore(64 * MiB), RemoteTier(relay.url, auth=session_key(), timeout=0.4))
    store.patience = 1.0  # (10 timeouts, at least 5 s, by default)
    store.set_settled_callback(lambda *a: None)
    answered: list = []

    def serve(token: bytes | None = None) -> None:  # what the daemon's handler does with a deferrable request
        try:
            with store.reading("defer", fresh=token is None):
                answered.append(store.held(ids))
        except Pending as pending:
            store.wait(pending, serve, token)

    try:
        serve()
        assert answered == [] and len(store._waits) == 1  # parked on the server
        t0 = time.monotonic()
        wait_until(lambda: store.tick() or answered, timeout=10)
        assert answered == [[False]] and time.monotonic() - t0 < 5  # from the local tiers, which lack it
        assert store.remote.degraded and store.remote.counters["parked_overdue"] == 1 and not store._waits
        relay.rate = 0  # the link at full speed again: the probes find the server back
        wait_until(lambda: not store.remote.degraded, timeout=30)
        assert store.held(ids) == [True]
    finally:
        store.close()
        relay.close()


def test_a_parked_request_whose_answer_comes_as_it_is_given_up_is_served_once(server, r):
    """Red-team (session 41): dropping the readers' connections (`overdue`)
    ends the read the request waits for; when that answer came before the
    tick went on, the request was served as done and again as late, and the
    second pop raised KeyError out of the daemon's tick."""
    entries = chain(1, 1024, seed=14)
    write(server.url, entries)
    ids = [entries[0].id]
    relay = Relay(server.port, rate=5, piece=1)
    store = WithRemote(RamStore(64 * MiB), RemoteTier(relay.url, auth=session_key(), timeout=0.4))
    store.patience = 0.5
    store.set_settled_callback(lambda *a: None)
    answered: list = []

    def serve(token: bytes | None = None) -> None:
        try:
            with store.reading("defer", fresh=token is None):
                answered.append(store.held(ids))
        except Pending as pending:
            store.wait(pending, serve, token)

    real = store.remote.overdue

    def overdue(waited: float) -> None:  # the reader's answer lands before the tick goes on
        real(waited)
        wait_until(lambda: all(fut.done() for fut, _, _ in store._waits.values()), timeout=10)

    store.remote.overdue = overdue
    try:
        serve()
        wait_until(lambda: store.tick() or answered, timeout=10)
        store.tick()
        assert answered == [[False]] and not store._waits
    finally:
        store.close()
        relay.close()


class BrokenHello(Listener):
    """A RESP server that cannot be had for real: `phase` "drop" closes every
    connection at its first command; "bad" answers HELLO with +OK (a proxy
    speaking RESP2 only, or a hostile server), which makes redis-py raise
    AttributeError, not a RedisError; "digits" answers GET with a bulk length
    of 5,000 digits; "huge" answers a GETRANGE of a key in `huge` with a
    bulk length of 1 GiB and then trickles junk (what it sent counted in
    `trickled`), that of any other key with the range of `values` it asks
    for; "good" behaves (HELLO 3, PONG, OK, and CLUSTER SLOTS naming itself
    for slots 0..`last_slot`)."""

    def __init__(self):
        self.phase, self.bad_hellos, self.last_slot = "drop", 0, 16383
        self.huge: set[bytes] = set()
        self.values: dict[bytes, bytes] = {}
        self.trickled = 0
        super().__init__()

    def _take(self, c: socket.socket) -> None:
        threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        f = c.makefile("rb")
        try:
            while line := f.readline():
                args = [f.read(int(f.readline()[1:]) + 2)[:-2] for _ in range(int(line[1:]))]
                name = args[0].upper()
                if self.phase == "drop":
                    return
                if name == b"HELLO":
                    self.bad_hellos += self.phase == "bad"
                    c.sendall(b"+OK\r\n" if self.phase == "bad" else b"%1\r\n$5\r\nproto\r\n:3\r\n")
                elif name == b"GET" and self.phase == "digits":  # a length of 5,000 digits: int() refuses it
                    c.sendall(b"$" + b"9" * 5000 + b"\r\n")
                elif name == b"GETRANGE" and self.phase == "huge" and args[1] in self.huge:
                    c.sendall(b"$%d\r\n" % (1 << 30))  # 1 GiB promised; a reader that takes it waits for all of it
                    for _ in range(256):  # 16 MiB at most, a piece every 10 ms, until the reader hangs up
                        c.sendall(b"x" * (64 << 10))
                        self.trickled += 64 << 10
                        time.sleep(0.01)
                elif name == b"GETRANGE" and self.phase == "huge":
                    v = self.values.get(args[1], b"")[int(args[2]) : int(args[3]) + 1]
                    c.sendall(b"$%d\r\n%s\r\n" % (len(v), v))
                elif name == b"CLUSTER" and args[1].upper() == b"SLOTS":  # a million slots, one node: itself
                    host, port = self.listen.getsockname()
                    node = b"*3\r\n$%d\r\n%s\r\n:%d\r\n$2\r\nid\r\n" % (len(host), host.encode(), port)
                    c.sendall(b"*1\r\n*3\r\n:0\r\n:%d\r\n" % self.last_slot + node)
                elif name == b"COMMAND":  # (RedisCluster's command table: none known)
                    c.sendall(b"*0\r\n")
                else:
                    c.sendall(b"+PONG\r\n" if name == b"PING" else b"+OK\r\n")
        except (OSError, ValueError):
            pass
        finally:
            c.close()


def test_a_reply_that_breaks_the_client_is_a_failed_probe_never_the_writers_end():
    """Red-team (session 41): the writer's probe met a HELLO answered +OK,
    redis-py raised AttributeError, and the writer thread died: the tier
    stayed degraded, its backlog unwritten, for the rest of the daemon's life."""
    fake = BrokenHello()
    tier = RemoteTier(fake.url, auth=session_key(), timeout=0.5)
    try:
        tier.offer(chain(1, 64, seed=12)[0])
        wait_until(lambda: tier.degraded)
        errors = tier.counters["errors"]
        fake.phase = "bad"
        wait_until(lambda: fake.bad_hellos >= 1 and tier.counters["errors"] > errors, timeout=30)
        fake.phase = "good"
        wait_until(lambda: not tier.degraded and tier.stats()["backlog"] == 0, timeout=30)
        assert tier._thread.is_alive() and tier.counters["written"] == 1
    finally:
        tier.close(budget=1.0)
        fake.close()


def test_a_node_naming_a_million_slots_fails_its_discovery_in_bounded_memory():
    """Red-team (session 41): redis-py fills a dict entry per slot a CLUSTER
    SLOTS section names before it checks anything: a node answering [0, 2**40,
    ...] had the daemon's memory grow until it was killed, at every discovery."""
    import tracemalloc

    from kvd.store.remote.cluster import cluster_client

    fake = BrokenHello()
    fake.phase = "good"
    try:
        fake.last_slot = 1_000_000
        tracemalloc.start()
        try:
            with pytest.raises(Exception, match="[Cc]luster"):
                cluster_client(fake.url, 0.5, {}, False, 0)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 8 * MiB, peak
        fake.last_slot = 16383  # the same node with a map a cluster gives: taken
        client = cluster_client(fake.url, 0.5, {}, False, 0)
        assert len(client.get_nodes()) == 1
        client.close()
    finally:
        fake.close()


def test_a_bulk_length_of_five_thousand_digits_is_a_miss_never_an_exception():
    fake = BrokenHello()
    fake.phase = "digits"
    store = WithRemote(RamStore(64 * MiB), RemoteTier(fake.url, auth=session_key(), timeout=0.5))
    try:
        e = chain(1, 64, seed=13)[0]
        assert store.remote.fetch([e.id]) == {}
        assert store.get(e.id) is None  # ("block" mode: the path that raised ValueError to its caller)
    finally:
        store.close()
        fake.close()


def presence(auth, eid: bytes) -> bytes:
    """The first PRESENCE_BYTES of a value the shared secret vouches for (the rest of it is never asked)."""
    return struct.pack("<4sI", rv.MAGIC, 100) + auth.key_tag(rv.value_key(eid[:32], eid[32]))


@pytest.mark.parametrize("cluster", [False, True], ids=["server", "cluster"])
def test_a_presence_reply_of_a_gibibyte_is_refused_from_its_header(cluster):
    """Red-team: LOOKUP's presence check (GETRANGE 0 23 per key) was read by
    redis-py, which takes a bulk reply whole before kvd looks at it: a server
    (or anything at remote_url) answering each with 512 MiB had the daemon's
    memory grow by that per key. Now the key is refused from its header (a
    miss and `checksum_failures`), its connection dropped, the keys after it
    asked again, and nothing of the reply is allocated."""
    import tracemalloc

    fake = BrokenHello()
    fake.phase = "huge"
    auth = session_key()
    huge, good, missing = (e.id for e in chain(3, 64, seed=15))
    fake.huge.add(rv.value_key(huge[:32], huge[32]))
    fake.values[rv.value_key(good[:32], good[32])] = presence(auth, good) + b"the rest, never asked"
    tier = RemoteTier(fake.url, auth=auth, timeout=0.5, cluster=cluster)
    try:
        tracemalloc.start()
        try:
            t = time.monotonic()
            held = tier.exists([huge, good, missing])
            took = time.monotonic() - t
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert held == [False, True, False]
        assert took < 2.0 and peak < 8 * MiB, (took, peak)
        c = tier.counters
        assert c["checksum_failures"] == 1 and c["auth_failures"] == 0 and c["errors"] == 0 and not tier.degraded
        assert fake.trickled < 16 << 20  # the reader hung up long before the trickle ran out
        assert tier.exists([good]) == [True]  # the dropped connection left nothing behind
    finally:
        tier.close(budget=1.0)
        fake.close()


def test_presence_on_a_real_server_is_vouched_counted_or_a_miss(server, r):
    """What exists() answers of a well-behaved server, on the daemon's own
    reader: a written value is held; a key of another type is that key's
    miss (`checksum_failures`, rule 3); a short value not ours is counted
    (`auth_failures`); a missing key is a plain miss."""
    entries = chain(4, 4096, seed=16)
    write(server.url, entries[:3])
    held, typed, planted_short = entries[0].id, entries[1].id, entries[2].id
    r.delete(rv.value_key(typed[:32], typed[32]))
    r.hset(rv.value_key(typed[:32], typed[32]), "x", "y")
    r.set(rv.value_key(planted_short[:32], planted_short[32]), b"short")
    tier = RemoteTier(server.url, auth=session_key(), timeout=5.0)
    try:
        assert tier.exists([held, typed, planted_short, entries[3].id]) == [True, False, False, False]
        c = tier.counters
        assert c["checksum_failures"] == 1 and c["auth_failures"] == 1 and c["errors"] == 0 and not tier.degraded
        assert c["exists_queries"] == 1
    finally:
        tier.close()


# -- what a GET streams -------------------------------------------------------------------


def test_a_get_streams_its_own_chain_only(server, r):
    """Two clients' walks interleave (P's LOOKUP, Q's LOOKUP, P's GET): the GET
    streams P's chunks, not Q's, and not the tails listed under P's last chunk."""
    p, q = chain(4, 8192, seed=10, ns="p"), chain(4, 8192, seed=11, ns="q")
    tails = [tail_of(p[-1], 8192, seed=100 + i) for i in range(10)]
    write(server.url, [*p, *q, *tails])
    store = WithRemote(RamStore(64 * MiB), RemoteTier(server.url, auth=session_key(), timeout=5.0))
    try:
        def walk(c):  # what kvd.server.prefix asks: a block's chunks, then their boundaries
            return store.held([e.id for e in c] + [e.key + b"\x01" for e in c])[: len(c)]

        assert walk(p) == [True] * 4 and len(list(store.tails(p[-1].key))) == 10
        assert walk(q) == [True] * 4
        assert walk(p) == [True] * 4  # the GET's own walk
        for e in p:
            assert same(store.get(e.id), e)
        assert not store._ahead and not store._stream  # nothing more queued
        c = store.remote.counters
        assert c["hits"] == 4 and c["promotions"] == 4
        assert all(store.local.get(e.id) is None for e in [*q, *tails])  # never fetched, never promoted
    finally:
        store.close()


def test_read_ahead_is_sized_by_the_streams_own_entries(server, r):
    small, big = chain(2, 4096, seed=12, ns="small"), chain(8, MiB, seed=13, ns="big")
    write(server.url, [*small, *big])
    store = WithRemote(RamStore(256 * MiB), RemoteTier(server.url, auth=session_key(), timeout=5.0, fetch_bytes=4 * MiB))
    batches: list[int] = []
    read_ahead = store.remote.read_ahead
    store.remote.read_ahead = lambda ids, *stop: (batches.append(len(ids)), read_ahead(ids, *stop))[1]
    try:
        for c in (small, big):
            assert store.held([e.id for e in c]) == [True] * len(c)
            for e in c:
                assert same(store.get(e.id), e)
        # small: one entry, then the other. big: one entry (its size unknown; a
        # 4 KiB entry of another stream says nothing), then fetch_bytes / 4 / 1 MiB = 1 each
        assert batches == [1, 1] + [1] * 8
    finally:
        store.close()


def test_a_popular_prefix_with_many_tails_still_serves_what_lookup_promised(server, r):
    """70,000 tails under one parent: LOOKUP's chunk ids are not pushed out by
    them, the reply listing them is bounded, and a query's own tail is found
    among them by asking for its candidate fields only."""
    system = chain(2, 4096, seed=14)
    mine = tail_of(system[-1], 2048, seed=15, length=3)
    write(server.url, [*system, mine])
    pipe = r.pipeline(transaction=False)
    auth = session_key()
    for i in range(70_000):  # earlier conversations' tails, their entries long evicted
        tail = (i + 1).to_bytes(32, "big")
        pipe.hset(rv.tails_key(system[-1].key), tail.hex(), auth.tail_value(system[-1].key, tail, 1 + i % 255))
    pipe.execute()
    store = WithRemote(RamStore(64 * MiB), RemoteTier(server.url, auth=session_key(), timeout=5.0))
    try:
        ids = [e.id for e in system]
        assert store.held(ids) == [True, True]
        listed = list(store.tails(system[-1].key))
        assert 0 < len(listed) <= 512  # one bounded page, not 70,000 fields
        for e in system:  # what the LOOKUP promised, served
            assert same(store.get(e.id), e)
        # A query that goes on 3 tokens past the parent: candidates of length 1..3, one of them ours.
        assert store.held(ids) == [True, True]
        candidates = [(1, b"\x01" * 32), (2, b"\x02" * 32), (3, mine.key)]
        assert list(store.tails_for(system[-1].key, iter(candidates))) == [(3, mine.key)]
        assert store.contains(mine.id)  # the matcher found it: now GET may fetch it
        assert same(store.get(mine.id), mine)
        assert store.remote.counters["hits"] == 3 and store.remote.counters["errors"] == 0
    finally:
        store.close()


def test_the_matcher_finds_its_own_tail_among_seventy_thousand(server, r):
    """A LOOKUP that goes on past a stored tail (a conversation's next turn)
    finds that tail, hanging off a prefix with 70,000 others, by asking for it
    by name (tail_candidates -> tails_for): it is matched, and the reply
    was never the whole hash. (With one HSCAN page of ~512 of them, it was
    found about once in 140.)"""
    from kvd.server.prefix import match

    ct, toks = 16, list(range(100, 140))  # two chunks, then 8 tokens: the stored 3-token tail and more
    tokens_le = keys.token_bytes(toks)
    k1, k2 = list(keys.iter_chain("t", ct, tokens_le[: 4 * 32]))
    tail = keys.span_key(k2, tokens_le, 32, 35)
    data = (Tensor("t", "uint8", (64,), np.arange(64, dtype=np.uint8)),)
    stored = [Entry("t", k1, CHUNK, keys.root_key("t", ct), 0, 16, data), Entry("t", k2, CHUNK, k1, 16, 16, data),
              Entry("t", tail, CHUNK, k2, 32, 3, data, tail=True)]
    write(server.url, stored)
    pipe = r.pipeline(transaction=False)
    auth = session_key()
    for i in range(70_000):
        other = (i + 1).to_bytes(32, "big")
        pipe.hset(rv.tails_key(k2), other.hex(), auth.tail_value(k2, other, 1 + i % 15))
    pipe.execute()
    store = WithRemote(RamStore(64 * MiB), RemoteTier(server.url, auth=session_key(), timeout=5.0))
    try:
        links = match(store, "t", ct, tokens_le)
        assert [(link.start, link.end, link.key) for link in links] == [(0, 16, k1), (16, 32, k2), (32, 35, tail)]
        assert same(store.get(entry_id(tail, CHUNK)), stored[2])
    finally:
        store.close()


def test_a_planted_tail_of_megabytes_is_never_read_into_the_daemon(server, r):
    """Red-team (session 41): anyone who can write to the server planted a
    tails field of hundreds of MiB, and HMGET/HSCAN read it whole (copies
    and all) before its tag was refused; a hash of 1,024 such fields is
    hundreds of GiB asked for. A tail value is under a hundred bytes."""
    import tracemalloc

    parent, auth = b"\x02" * 32, session_key()
    good, bad = b"\x03" * 32, b"\x04" * 32
    r.hset(rv.tails_key(parent), mapping={bad.hex(): b"5:" + b"x" * (8 * MiB), good.hex(): auth.tail_value(parent, good, 7)})
    tier = RemoteTier(server.url, auth=session_key(), timeout=2.0)
    try:
        tracemalloc.start()
        try:
            among = tier.tails_among(parent, [(5, bad), (7, good)])
            listed = tier.tails(parent)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert among == [(7, good)]  # (asked after the planted one: on a connection of its own)
        assert listed in ([], [(7, good)])  # (one HSCAN page: what follows a refused field in it is not read)
        assert peak < MiB, peak
        assert tier.counters["auth_failures"] == 2 and not tier.degraded
    finally:
        tier.close(budget=1.0)


def test_closing_with_the_server_hung_takes_the_budget_not_the_socket_timeout():
    """The write-behind copy is a cache, never a promise: a stop gives it what
    is left of its own bound (WithRemote.close), not a 2 s flush and then the
    writer's socket timeout on top (4 s here)."""
    import signal

    server = RedisServer().start()
    tier = RemoteTier(server.url, auth=session_key(), timeout=4.0)
    server.proc.send_signal(signal.SIGSTOP)
    try:
        tier.offer(chain(1, 4096, seed=21)[0])  # the writer sends it and waits on the hung server
        wait_until(lambda: tier.stats()["backlog"] == 1)
        t0 = time.monotonic()
        tier.close(0.5)
        took = time.monotonic() - t0
    finally:
        server.proc.send_signal(signal.SIGCONT)
        server.close()
    assert took < 1.5, f"close took {took:.1f}s for a budget of 0.5 s"
