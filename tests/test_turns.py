"""Whose request is served next (kvd/server/turns.py), alone and in a real daemon's loop."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from kvd.protocol import codec, keys
from kvd.server.daemon import Daemon
from kvd.server.turns import BYTE_SECONDS, Turns
from kvd.store.ram import RamStore


def test_only_a_peer_over_the_heavy_cost_waits_and_its_later_requests_wait_behind_it():
    t = Turns(free_s=0.0005, heavy_s=0.001)
    t.charge(b"light", 0.0004, 1000, now=0.0)  # an ordinary request costs nothing
    assert t.cost(b"light", 0.0) == 0.0 and not t.defers(b"light", 0.0)
    t.charge(b"heavy", 0.0030, 0, now=0.0)
    assert t.cost(b"heavy", 0.0) == pytest.approx(0.0025) and t.defers(b"heavy", 0.0)
    t.put(b"heavy", "h0", 10)
    t.charge(b"heavy", 0.0, 0, now=100.0)  # long decayed...
    assert t.defers(b"heavy", 100.0)  # ...but h0 still waits: h1 must wait behind it (rule 1)
    t.put(b"heavy", "h1", 10)
    assert [t.pop(), t.pop(), t.pop()] == ["h0", "h1", None]
    assert not t.defers(b"heavy", 100.0) and t.bytes == 0 and len(t) == 0


def test_cost_decays_with_the_half_life_and_counts_bytes():
    t = Turns(half_life=0.5, free_s=0.0)
    t.charge(b"p", 0.008, 0, now=10.0)
    assert t.cost(b"p", 10.0) == pytest.approx(0.008)
    assert t.cost(b"p", 10.5) == pytest.approx(0.004)
    assert t.cost(b"p", 11.5) == pytest.approx(0.001)
    t.charge(b"q", 0.0, 4 << 20, now=0.0)  # a 4 MiB message that was answered at once
    assert t.cost(b"q", 0.0) == pytest.approx((4 << 20) * BYTE_SECONDS)


def test_a_request_passed_over_max_passes_times_goes_next():
    t = Turns(max_passes=4)
    t.put(b"heavy", "h", 0)
    for i in range(3):
        assert t.overdue() is None
        t.charge(b"light", 0.0, 0, now=0.0)  # one request served ahead of it
    assert t.overdue() is None
    t.charge(b"light", 0.0, 0, now=0.0)
    assert t.overdue() == "h" and t.counters["overdue"] == 1
    assert t.overdue() is None and len(t) == 0


def test_room_is_bounded_in_count_and_bytes():
    t = Turns(max_waiting=3, max_bytes=100)
    for i in range(3):
        assert t.room(10)
        t.put(b"a", i, 10)
    assert not t.room(0)  # three wait
    assert [t.pop() for _ in range(3)] == [0, 1, 2]
    assert t.room(100) and not t.room(101)  # over max_bytes alone: never waits
    t.put(b"a", "x", 60)
    assert t.room(40) and not t.room(41)
    assert t.pop() == "x" and t.bytes == 0


def test_forget_drops_decayed_costs():
    t = Turns(half_life=0.1, free_s=0.0)
    t.charge(b"gone", 0.01, 0, now=0.0)
    t.forget(now=0.05)
    assert t.stats()["peers_with_cost"] == 1
    t.forget(now=10.0)
    assert t.stats()["peers_with_cost"] == 0


# -- in a real daemon -----------------------------------------------------------
def request(sock: zmq.Socket, frames: list[bytes]) -> dict:
    sock.send_multipart(frames)
    assert sock.poll(10_000), "no reply"
    return msgpack.unpackb(sock.recv_multipart()[0])


def test_a_light_client_is_served_before_peers_that_keep_the_daemon_busy(tmp_path):
    """Eight peers whose 4 MiB LOOKUPs have cost the daemon have two requests
    each waiting ahead of a client's STATS: the STATS is served first, then
    theirs, each peer's in order. (Served as they came, it waited for 16.)"""
    d = Daemon(RamStore(16 << 20), f"ipc://{tmp_path / 'kvd.sock'}", shm=False)
    d.turns = Turns(half_life=600.0)  # their cost must not decay while a slow machine runs the test
    d.bind()
    ctx = zmq.Context.instance()
    heavy = [ctx.socket(zmq.DEALER) for _ in range(8)]
    good = ctx.socket(zmq.DEALER)

    def received(n: int) -> list:
        """The next n messages from the daemon's real socket, in its order."""
        out, deadline = [], time.monotonic() + 10
        while len(out) < n:
            assert time.monotonic() < deadline, f"only {len(out)} of {n} requests arrived"
            if d._sock.poll(100):
                out.append(d._recv(d._sock))
        return out

    def feed(messages: list):
        def recv():
            if not messages:
                raise zmq.Again()
            return messages.pop(0)
        return recv

    try:
        for s in [*heavy, good]:
            s.setsockopt(zmq.LINGER, 0)
            s.connect(d.endpoint)
        lookup = codec.encode("LOOKUP", {"ns": "x", "tokens": keys.token_bytes(range(1 << 20)), "chunk_tokens": 1}, id=0)
        for s in heavy:  # what they cost: one each, served as the loop serves
            s.send_multipart(lookup)
            d._serve_waiting(feed(received(1)))
            assert msgpack.unpackb(s.recv_multipart()[0])["type"] == "LOOKUP"
        assert d.turns.stats()["peers_with_cost"] == 8
        for s in heavy:
            s.send_multipart(codec.encode("PING", {}, id=1))
            s.send_multipart(codec.encode("LOOKUP", {"ns": "x", "tokens": keys.token_bytes(range(4096)), "chunk_tokens": 1}, id=2))
        waiting = received(16)
        good.send_multipart(codec.encode("STATS", {}, id=9))
        waiting += received(1)  # the STATS arrives last
        d._serve_waiting(feed(waiting))
        stats = msgpack.unpackb(good.recv_multipart()[0])
        assert stats["type"] == "STATS"
        served = stats["stats"]["server"]["requests"]
        assert served["LOOKUP"] == 8 and "PING" not in served  # none of the 16 went first
        for s in heavy:  # and then every one of them, each peer's in order
            assert [msgpack.unpackb(s.recv_multipart()[0])["id"] for _ in range(2)] == [1, 2]
        assert d.handler.requests["LOOKUP"] == 16 and d.handler.requests["PING"] == 8 and len(d.turns) == 0
        assert d.peer_stats()["deferred"] == 16
        heavy[0].send_multipart([codec.encode("PING", {}, id=7)[0], bytes(9 << 20)])  # over max_bytes: cannot wait
        d._serve_waiting(feed(received(1)))
        assert msgpack.unpackb(heavy[0].recv_multipart()[0])["id"] == 7  # answered (an error: a PING has no frames)
        assert d.peer_stats()["deferred"] == 16 and len(d.turns) == 0
    finally:
        for s in [*heavy, good]:
            s.close(linger=0)
        d.close()
