"""Whose request is served next (kvd/server/admission/turns.py), alone and in a real daemon's loop."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from kvd.protocol import codec, keys
from kvd.server.daemon import Daemon
from kvd.server.admission.connections import origin
from kvd.protocol.errors import MalformedMessage
from kvd.server.admission.turns import BYTE_SECONDS, Turns
from kvd.store.ram import RamStore
from kvd_client import HostTensor, Snapshot


def test_only_a_peer_whose_requests_cost_over_heavy_s_waits_and_its_later_requests_wait_behind_it():
    t = Turns(heavy_s=0.001, connect_s=0.0)  # (a connection's cost: test_a_process_that_keeps_connecting...)
    for i in range(1000):  # many cheap requests, as fast as they come: never heavy
        t.charge(b"light", 0.0009, 1000, now=i * 0.0001)
    assert t.cost(b"light") < 0.001 and not t.defers(b"light")
    t.charge(b"heavy", 0.0001, 4 << 20, now=0.0)  # one 4 MiB request: its bytes cost the most
    assert t.cost(b"heavy") == pytest.approx(0.0001 + (4 << 20) * BYTE_SECONDS) and t.defers(b"heavy")
    t.put(b"heavy", "h0", 10)
    for _ in range(50):
        t.charge(b"heavy", 0.0, 0, now=1.0)  # its later requests are cheap...
    assert t.cost(b"heavy") < 0.001 and t.defers(b"heavy")  # ...but h0 still waits: h1 must wait behind it (rule 1)
    t.put(b"heavy", "h1", 10)
    assert [t.pop(), t.pop(), t.pop()] == ["h0", "h1", None]
    assert not t.defers(b"heavy") and t.bytes == 0 and len(t) == 0


def test_cost_is_a_running_mean_of_cpu_time_and_bytes():
    t = Turns(weight=0.25, connect_s=0.0)
    t.charge(b"p", 0.008, 0, now=10.0)
    assert t.cost(b"p") == pytest.approx(0.008)  # the first request is all it knows
    t.charge(b"p", 0.0, 0, now=10.0)
    assert t.cost(b"p") == pytest.approx(0.006)
    t.charge(b"q", 0.0, 4 << 20, now=0.0)  # a 4 MiB message that cost no CPU
    assert t.cost(b"q") == pytest.approx((4 << 20) * BYTE_SECONDS)


def test_a_request_passed_over_max_passes_times_goes_next_one_at_a_time():
    t = Turns(max_passes=4, share=0.25, connect_s=0.0)
    for name in ("h0", "h1", "h2"):  # three heavy peers' requests, waiting since the same moment
        t.put(name.encode(), name, 0)
    for i in range(3):
        assert t.overdue() is None
        t.charge(b"light", 0.0001, 0, now=0.0)  # one request served ahead of them
    assert t.overdue() is None
    t.charge(b"light", 0.0001, 0, now=0.0)
    assert t.overdue() == "h0" and t.counters["overdue"] == 1
    # h1 was passed over as often, but goes only after max_passes more: the
    # heavy requests are spread among the others, not served in one burst
    assert t.overdue() is None
    t.charge(b"h0", 0.003, 0, now=0.0, waited=True)  # 1 ms past heavy peers' burst: due 4 ms on (share 1/4)
    for i in range(3):
        t.charge(b"light", 0.0001, 0, now=0.0)
        assert t.overdue() is None
    t.charge(b"light", 0.0001, 0, now=0.0)
    assert t.overdue() is None  # passed over enough, but heavy peers had their share
    t.charge(b"light", 0.0001, 0, now=0.004)
    assert t.overdue() == "h1"
    # a turn given any other way (a quiet socket's) restarts the count too
    t.charge(b"h1", 0.003, 0, now=0.004, waited=True)
    for i in range(3):
        t.charge(b"light", 0.0001, 0, now=0.004)
    assert t.take(1.0) == "h2" and t.overdue() is None and len(t) == 0


def test_passes_alone_do_not_give_a_heavy_peer_more_than_its_share_but_max_wait_s_does():
    """Issue 44: a client sending back to back never leaves the socket quiet;
    a 90 ms request must not have a turn every max_passes requests."""
    t = Turns(max_passes=4, max_wait_s=1.0, share=0.25)
    t.charge(b"light", 0.0005, 0, now=0.0)
    t.put(b"heavy", "p0", 0)
    assert t.pop() == "p0"
    t.charge(b"heavy", 0.09, 0, now=0.0, waited=True)  # a turn of 90 ms: due 0.36 s on
    t.put(b"heavy", "p1", 0)
    for i in range(1, 200):  # 1 ms apart: 0.2 s of requests, far past max_passes
        t.charge(b"light", 0.0005, 0, now=i * 0.001)
        assert t.overdue() is None
    t.charge(b"light", 0.0005, 0, now=0.4)
    assert t.overdue() == "p1"  # its share is due again
    t.put(b"heavy", "p2", 0)
    t.charge(b"heavy", 10.0, 0, now=0.4, waited=True)  # a share far in the future...
    for i in range(5):
        t.charge(b"light", 0.0005, 0, now=0.5)
    assert t.overdue() is None
    t.charge(b"light", 0.0005, 0, now=1.41)
    assert t.overdue() == "p2"  # ...but it waited max_wait_s


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


def test_while_others_are_active_heavy_turns_take_at_most_their_share():
    t = Turns(share=0.25, active_s=0.05, burst_s=0.002)
    for name in ("h0", "h1", "h2", "h3"):
        t.put(b"h", name, 0)
    assert t.due(0.0) == 0.0 and t.take(0.0) == "h0"  # nobody else about: served in full
    t.charge(b"h", 0.001, 8 << 20, now=0.0, waited=True)
    assert t.take(0.0) == "h1"  # ...its cost counted against nothing
    t.charge(b"h", 0.001, 8 << 20, now=0.0, waited=True)
    t.charge(b"light", 0.0002, 100, now=1.0)  # a client is served: heavy turns now share
    assert t.take(1.0) == "h2"  # within the burst
    cost = 0.001 + (4 << 20) * BYTE_SECONDS
    t.charge(b"h", 0.001, 4 << 20, now=1.0, waited=True)
    wait = (cost - 0.002) / 0.25  # until the credit it overdrew is earned back at a quarter of the time
    assert t.due(1.0) == pytest.approx(1.0 + wait)
    assert t.take(1.0 + wait * 0.9) is None and t.take(1.0 + wait * 1.01) == "h3"
    t.put(b"h", "h4", 0)
    t.charge(b"h", 0.0, 64 << 20, now=1.01, waited=True)  # a turn that overdrew by far...
    assert t.due(1.01) == pytest.approx(1.05)  # ...waits only while the client is about
    assert t.take(1.049) is None and t.take(1.05) == "h4"
    assert t.due(2.0) is None  # nothing waits


def test_a_peer_alone_is_not_held_back_by_its_own_cheap_requests():
    t = Turns(share=0.25, active_s=0.05)
    t.charge(b"p", 0.0002, 0, now=0.0)  # a cheap request of its own...
    t.charge(b"p", 0.0, 64 << 20, now=0.0)  # ...then it turns heavy
    t.put(b"p", "a", 0)
    t.put(b"p", "b", 0)
    assert t.take(0.001) == "a"
    t.charge(b"p", 0.0, 64 << 20, now=0.001, waited=True)
    assert t.due(0.001) == 0.001 and t.take(0.001) == "b"  # nobody else about: no share to keep
    t.charge(b"q", 0.0002, 0, now=0.002)  # another client is served
    t.put(b"p", "c", 0)
    t.charge(b"p", 0.0, 64 << 20, now=0.002, waited=True)
    assert t.due(0.002) == pytest.approx(0.052) and t.take(0.002) is None


def test_a_process_is_not_held_back_by_its_own_other_connections():
    """A process's light requests on one connection (a client's HELLO on the
    main socket, its upload socket, another model's client) do not make its
    heavy ones on another wait for a share: only another process does. A new
    client's fetch of 1 GiB waited up to active_s after its own HELLO."""
    t = Turns(share=0.05, active_s=0.05)
    t.charge(b"main", 0.0002, 0, now=0.0, origin=b"pid 1")  # the client's HELLO
    t.charge(b"lane", 0.005, 0, now=0.0, origin=b"pid 1")  # its GET's first page: heavy
    t.put(b"lane", "page 2", 0, b"pid 1")
    assert t.due(0.001) == 0.001 and t.take(0.001) == "page 2"  # nobody else about
    t.charge(b"lane", 0.005, 0, now=0.006, waited=True, origin=b"pid 1")
    t.put(b"lane", "page 3", 0, b"pid 1")
    assert t.take(0.006) == "page 3"  # its turn drew on no share: none was kept from anyone
    t.charge(b"lane", 0.005, 0, now=0.011, waited=True, origin=b"pid 1")
    t.charge(b"other", 0.0002, 0, now=0.012, origin=b"pid 2")  # another process's client is served
    t.put(b"lane", "page 4", 0, b"pid 1")
    assert t.take(0.012) == "page 4"  # (within the burst)
    t.charge(b"lane", 0.005, 0, now=0.017, waited=True, origin=b"pid 1")
    t.put(b"lane", "page 5", 0, b"pid 1")
    assert t.take(0.017) is None and t.due(0.017) > 0.017  # now its turns take a share
    assert t.take(0.2) == "page 5"
    t.charge(b"tcp a", 0.0002, 0, now=1.0)  # over TCP no process is known: each connection is its own
    t.charge(b"tcp b", 0.005, 0, now=1.0)
    t.put(b"tcp b", "b1", 0)
    assert t.take(1.0) == "b1"  # (within the burst)
    t.charge(b"tcp b", 0.005, 0, now=1.005, waited=True)
    t.put(b"tcp b", "b2", 0)
    assert t.take(1.005) is None and t.take(1.06) == "b2"


def test_forget_drops_the_costs_of_silent_peers():
    t = Turns(forget_s=10.0)
    t.charge(b"gone", 0.01, 0, now=0.0)
    t.charge(b"waits", 0.01, 0, now=0.0)
    t.put(b"waits", "w", 0)
    t.forget(now=5.0)
    assert t.stats()["peers_with_cost"] == 2
    t.forget(now=10.5)
    assert t.stats()["peers_with_cost"] == 1 and t.defers(b"waits")  # one with a request waiting is kept


def test_forget_goes_by_each_peers_last_request_not_its_first():
    t = Turns(forget_s=10.0)
    t.charge(b"early", 0.01, 0, now=0.0, origin=b"pid 1")
    t.charge(b"middle", 0.01, 0, now=1.0, origin=b"pid 2")
    t.charge(b"early", 0.01, 0, now=5.0, origin=b"pid 1")  # asked again
    t.forget(now=12.0)
    assert t.cost(b"early") > 0 and t.cost(b"middle") == 0
    assert t.cost(b"new", b"pid 1") > 0 and t.cost(b"new", b"pid 2") == 0


# -- in a real daemon -----------------------------------------------------------
def request(sock: zmq.Socket, frames: list[bytes]) -> dict:
    sock.send_multipart(frames)
    assert sock.poll(10_000), "no reply"
    return msgpack.unpackb(sock.recv_multipart()[0])


# A client in a process of its own (costs are charged per process): sends
# one request (hex), prints the reply's type and what the daemon had served.
CLIENT = r"""
import sys, msgpack, zmq
s = zmq.Context().socket(zmq.DEALER)
s.setsockopt(zmq.RCVTIMEO, 10_000)  # unanswered: fails (zmq.Again), never hangs the suite
s.connect(sys.argv[1])
s.send(bytes.fromhex(sys.argv[2]))
reply = msgpack.unpackb(s.recv())
served = reply.get("stats", {}).get("server", {}).get("requests", {})
print(reply["type"], served.get("LOOKUP", 0), served.get("PING", 0), flush=True)
"""


def test_a_light_client_is_served_before_peers_that_keep_the_daemon_busy(tmp_path):
    """Eight peers whose 4 MiB LOOKUPs have cost the daemon have two requests
    each waiting ahead of a client's STATS: the STATS is served first, then
    theirs, each peer's in order. (Served as they came, it waited for 16.)"""
    d = Daemon(RamStore(16 << 20), f"ipc://{tmp_path / 'kvd.sock'}", shm=False)
    d.turns = Turns(active_s=0.0, max_bytes=8 << 20)  # the order alone: no share (a slow machine would use it up)
    d.bind()
    ctx = zmq.Context.instance()
    heavy = [ctx.socket(zmq.DEALER) for _ in range(8)]

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
        for s in heavy:
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
        client = subprocess.Popen([sys.executable, "-c", CLIENT, d.endpoint, codec.encode("STATS", {}, id=9)[0].hex()],
                                  stdout=subprocess.PIPE, text=True)
        waiting += received(1)  # the STATS arrives last
        try:
            d._serve_waiting(feed(waiting))
            assert client.stdout.readline().split() == ["STATS", "8", "0"]  # none of the 16 went first
        finally:
            client.kill()
            client.wait()
        for s in heavy:  # and then every one of them, each peer's in order
            assert [msgpack.unpackb(s.recv_multipart()[0])["id"] for _ in range(2)] == [1, 2]
        assert d.handler.requests["LOOKUP"] == 16 and d.handler.requests["PING"] == 8 and len(d.turns) == 0
        assert d.peer_stats()["deferred"] == 7 + 16  # (and the 2nd to 8th connections' first: their process's cost)
        heavy[0].send_multipart([codec.encode("PING", {}, id=7)[0], bytes(9 << 20)])  # over max_bytes: cannot wait
        d._serve_waiting(feed(received(1)))
        assert msgpack.unpackb(heavy[0].recv_multipart()[0])["id"] == 7  # answered (an error: a PING has no frames)
        assert d.peer_stats()["deferred"] == 7 + 16 and len(d.turns) == 0
    finally:
        for s in heavy:
            s.close(linger=0)
        d.close()


def test_the_loop_wakes_for_a_waiting_request_when_its_turn_comes(tmp_path):
    """A heavy peer's request waits while a client is about, and the loop
    answers it when its turn comes -- not at its next tick (an hour here)."""
    d = Daemon(RamStore(16 << 20), f"ipc://{tmp_path / 'kvd.sock'}", shm=False, tick=3600.0)
    d.bind()
    now = time.monotonic()
    d.turns.charge(b"heavy", 0.0, 64 << 20, now)  # its requests cost the daemon
    d.turns.charge(b"light", 0.0005, 0, now)  # a client was served just now...
    d.turns.charge(b"other", 0.0, 64 << 20, now, waited=True)  # ...and heavy turns overdrew their share
    loop = threading.Thread(target=d.serve_forever)
    loop.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.ROUTING_ID, b"heavy")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(d.endpoint)
        assert request(sock, codec.encode("PING", {}, id=5))["id"] == 5
        assert d.peer_stats()["deferred"] == 1
    finally:
        sock.close(linger=0)
        d.stop()
        loop.join(10)
    assert not loop.is_alive()


def test_the_origin_of_a_connection_is_the_process_at_the_other_end():
    a, b = socket.socketpair(socket.AF_UNIX)
    listener = socket.create_server(("127.0.0.1", 0))
    tcp = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    r, w = os.pipe()
    try:
        assert origin(a.fileno()) == origin(b.fileno()) == b"pid %d" % os.getpid()
        assert origin(accepted.fileno()) is None  # over TCP one host may be many clients: each connection is its own
        assert origin(r) is None  # not a socket
    finally:
        for s in (a, b, tcp, accepted, listener):
            s.close()
        os.close(r)
        os.close(w)


def test_a_new_connection_starts_from_its_process_cost_then_has_its_own():
    t = Turns(heavy_s=0.001)
    t.charge(b"upload", 0.01, 256 << 20, now=0.0, origin=b"pid 1")  # one process's big upload...
    t.charge(b"fetch", 0.0002, 100, now=0.0, origin=b"pid 1")  # ...and its fetches, on another connection
    assert t.defers(b"new", b"pid 1")  # a new connection of that process: heavy until it has a cost of its own
    assert not t.defers(b"fetch", b"pid 1")  # the fetch is not held back by the upload
    assert not t.defers(b"new", b"pid 2") and not t.defers(b"new")  # another process, or none known
    t.forget(now=11.0)
    assert not t.defers(b"new", b"pid 1")  # silent for forget_s: forgotten


def test_a_peer_that_reconnects_for_every_request_is_still_heavy(tmp_path):
    """Its cost belongs to its process, not to each new connection (which
    would start with none: served at once every time)."""
    d = Daemon(RamStore(16 << 20), f"ipc://{tmp_path / 'kvd.sock'}", shm=False)
    d.bind()
    ctx = zmq.Context.instance()
    lookup = codec.encode("LOOKUP", {"ns": "x", "tokens": keys.token_bytes(range(1 << 20)), "chunk_tokens": 1}, id=0)
    try:
        for i in range(3):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(d.endpoint)
            sock.send_multipart(lookup)
            assert d._sock.poll(10_000)
            d._serve_waiting(lambda: d._recv(d._sock))
            assert msgpack.unpackb(sock.recv_multipart()[0])["type"] == "LOOKUP"
            sock.close(linger=0)
            assert d.peer_stats()["deferred"] == i  # the first was served at once; the others waited their turn
    finally:
        d.close()


def test_a_request_served_in_turns_costs_what_all_its_turns_cost_as_one_request():
    """Sixty 0.5 ms turns of one PUT are one 30 ms request (heavy), not sixty
    light ones; its frames are charged once, with its first turn."""
    from kvd.server.admission.turns import PART_SECONDS

    t = Turns(connect_s=0.0)
    t.charge(b"p", 0.0002, 0, now=0.0)  # an ordinary request first: light
    assert not t.defers(b"p")
    for i in range(59):
        t.charge(b"p", 0.0005, 0, now=0.001 * i, waited=True, parts=8001 if i == 0 else 0, more=True)
        assert t.cost(b"p") == pytest.approx(0.0002)  # unchanged until the request is done
    t.charge(b"p", 0.0005, 0, now=0.06, waited=True)
    whole = 60 * 0.0005 + 8001 * PART_SECONDS
    assert t.cost(b"p") == pytest.approx(0.0002 + t.weight * (whole - 0.0002))
    assert t.defers(b"p")


def test_a_process_whose_writes_keep_the_thread_busy_has_its_writes_wait_not_its_reads():
    """Cheap writes back to back are never heavy one by one; a process whose
    writes took more than busy_share of the thread over busy_window_s is a
    busy writer until it sends no write for a window, or its writes' share
    falls under an eighth of busy_share (bench_stress's put-storm)."""
    t = Turns(busy_share=0.05, busy_window_s=1.0)
    for i in range(80):  # a model server storing 256 MiB (a SLOTS and COMMITs: 8 ms) four times a second
        t.charge(b"server", 0.0005, 0, now=(i // 16) * 0.25, origin=b"pid 1", write=True)
        assert not t.defers(b"server", b"pid 1", write=True)
    now, n = 10.0, 0
    while not t.defers(b"storm", b"pid 2", write=True):  # 0.4 ms writes back to back: 40% of the thread
        assert n < 1000, "never a busy writer"
        t.charge(b"storm", 0.0004, 0, now=now, origin=b"pid 2", write=True)
        now, n = now + 0.001, n + 1
    assert 125 < n < 150  # over 50 ms of writes in the decaying second: 5%
    assert t.stats()["busy_writers"] == 1 and t.counters["busy_writers_seen"] == 1
    assert not t.defers(b"storm", b"pid 2")  # its reads are served as anyone's
    assert t.defers(b"upload", b"pid 2", write=True)  # and its process's other connections' writes wait too
    assert not t.defers(b"server", b"pid 1", write=True)
    for _ in range(50):  # paced to a quarter of the share (four busy writers), it stays one
        t.charge(b"storm", 0.0025, 0, now=now, origin=b"pid 2", write=True)
        now += 0.2
        assert t.defers(b"storm", b"pid 2", write=True)
    for _ in range(10):  # at a tenth of it, it is one no longer (a server that burst once, then stores now and then)
        t.charge(b"storm", 0.0005, 0, now=now, origin=b"pid 2", write=True)
        now += 0.2
    assert not t.defers(b"storm", b"pid 2", write=True)
    for _ in range(150):  # busy again...
        t.charge(b"storm", 0.0004, 0, now=now, origin=b"pid 2", write=True)
    assert t.defers(b"storm", b"pid 2", write=True) and t.counters["busy_writers_seen"] == 2
    t.charge(b"storm", 0.0001, 0, now=now + 1.01, origin=b"pid 2")  # ...then a read, a window after its last write
    assert not t.defers(b"storm", b"pid 2", write=True) and t.stats()["busy_writers"] == 0
    t.forget(now + 20.0)
    assert t._writes == {}  # silent writers are forgotten: the map does not grow


def test_a_process_that_keeps_connecting_has_its_new_connections_wait_and_pays_for_them():
    """Each connection's first request is charged what connecting cost the
    daemon (connect_s); a process that opens more than churn_rate
    connections a second is churning: the first request of each new
    connection of it waits (a heavy peer's turn), not its open connections'
    requests, nor anyone else's; it stops once its rate falls under an
    eighth of churn_rate (bench_stress's churn)."""
    t = Turns(churn_rate=64.0, busy_window_s=1.0, connect_s=0.0004, weight=1.0)
    t.charge(b"server", 0.0001, 0, now=0.0, origin=b"pid 1", connected=True)  # a model server's first request
    assert t.cost(b"server") == pytest.approx(0.0005)
    t.charge(b"server", 0.0001, 0, now=0.0, origin=b"pid 1")  # its next: the request alone
    assert t.cost(b"server") == pytest.approx(0.0001)
    for i in range(8):  # eight more connections at once (its models' clients): fine
        t.charge(b"lane%d" % i, 0.0001, 0, now=0.001, origin=b"pid 1", connected=True)
    assert not t.defers(b"new", b"pid 1")
    now, n = 1.0, 0
    while not t.defers(b"c%d" % n, b"pid 2"):  # a connection a millisecond, each one PING
        assert n < 1000, "never churning"
        t.charge(b"c%d" % n, 0.0001, 0, now=now, origin=b"pid 2", connected=True)
        now, n = now + 0.001, n + 1
    assert 64 < n < 100 and t.counters["churners_seen"] == 1 and t.stats()["churning"] == 1
    assert not t.defers(b"c0", b"pid 2")  # a connection it keeps is served as anyone's
    assert not t.defers(b"new", b"pid 1")  # and other processes' new connections too
    assert not t.defers(b"new", None)  # (over TCP each connection is its own)
    for i in range(30):  # paced to ten connections a second: still over an eighth of churn_rate
        t.charge(b"p%d" % i, 0.0001, 0, now=now, origin=b"pid 2", connected=True)
        now += 0.1
        assert t.defers(b"next", b"pid 2")
    now += 3.0  # quiet: no longer churning
    t.due(now)
    assert not t.defers(b"next", b"pid 2")
    t.forget(now + 20.0)
    assert t._connects == {}  # the map does not grow
    for i in range(100):  # connections it keeps, silent past forget_s, asking again: not new ones
        t.charge(b"p%d" % (i % 30), 0.0001, 0, now=now + 20.0 + i * 0.001, origin=b"pid 2")
    assert not t.churning(b"pid 2")


def test_busy_writers_alone_are_served_in_full_and_share_with_a_reader_about():
    """A busy writer's reads (a storm's LOOKUPs) do not make another busy
    writer's turns wait: only a process that is not one does."""
    t = Turns(share=0.05, busy_share=0.05, active_s=0.05, burst_s=0.002)
    for peer, pid in ((b"w1", b"pid 1"), (b"w2", b"pid 2")):
        t.charge(peer, 0.06, 0, now=0.0, origin=pid, write=True)  # busy writers both
        t.charge(peer, 0.0002, 0, now=0.001, origin=pid)  # and each reads, cheaply
    t.put(b"w1", "s1", 0, b"pid 1")
    assert t.take(0.001) == "s1"  # nobody else about
    t.charge(b"w1", 0.005, 0, now=0.006, waited=True, origin=b"pid 1", write=True)
    t.put(b"w2", "s2", 0, b"pid 2")
    assert t.take(0.006) == "s2"  # the 5 ms turn before drew on no share
    t.charge(b"w2", 0.0004, 0, now=0.0065, waited=True, origin=b"pid 2", write=True)
    t.charge(b"reader", 0.0003, 0, now=0.007, origin=b"pid 3")  # a reader is served
    t.put(b"w1", "s3", 0, b"pid 1")
    assert t.take(0.007) == "s3"  # within the burst
    t.charge(b"w1", 0.003, 0, now=0.010, waited=True, origin=b"pid 1", write=True)
    t.put(b"w2", "s4", 0, b"pid 2")
    assert t.take(0.010) is None  # overdrawn by 1 ms: it waits until 5% of the time earns it back
    assert t.due(0.010) == pytest.approx(0.010 + 0.001 / 0.05)
    assert t.take(0.0301) == "s4"


def test_a_busy_writers_reads_hold_back_heavy_peers_and_its_waiting_writes_keep_it_busy():
    """A model server that stores a lot is still someone a heavy peer's turns
    make wait; and a busy writer whose write waits over a window for its
    turn is still one (its silence counts from its writes' arrival)."""
    t = Turns(share=0.05, busy_share=0.05, active_s=0.05, burst_s=0.002)
    for _ in range(100):  # a busy writer (of cheap writes)...
        t.charge(b"m", 0.0006, 0, now=0.0, origin=b"pid 1", write=True)
    t.charge(b"h", 0.02, 0, now=0.0, origin=b"pid 2")  # ...and a heavy peer
    t.charge(b"m", 0.0002, 0, now=0.001, origin=b"pid 1")  # the busy writer fetches
    t.put(b"h", "h1", 0, b"pid 2")
    assert t.take(0.001) == "h1"  # (within the burst)
    t.charge(b"h", 0.02, 0, now=0.021, waited=True, origin=b"pid 2")
    t.put(b"h", "h2", 0, b"pid 2")
    assert t.take(0.021) is None and t.due(0.021) > 0.021  # its fetch holds back the heavy peer's next turn
    t.put(b"m", "w1", 0, b"pid 1")  # its next write waits
    t.due(1.5)  # the loop passes 1.5 s: over a window since its last write was served...
    assert t.defers(b"m2", b"pid 1", write=True)  # ...but one waits: still a busy writer
    assert t.pop() == "h2" and t.pop() == "w1"
    assert t.defers(b"m2", b"pid 1", write=True)  # its silence counts from its write's turn
    t.due(2.6)
    assert not t.defers(b"m2", b"pid 1", write=True)  # a window after it, silent: no longer one


def test_a_header_that_names_its_type_twice_is_malformed(tmp_path):
    """The loop orders and admits a request by the first "type" in its header
    (codec.peek_type); the decoder keeps the last. Such a header is refused."""
    d = Daemon(RamStore(16 << 20), f"ipc://{tmp_path / 'kvd.sock'}", shm=False)
    try:
        header = msgpack.packb({"v": 1, "type": "PING", "id": 4})
        assert header[:1] == b"\x83"
        twice = b"\x84" + header[1:] + msgpack.packb("type") + msgpack.packb("GC")
        assert codec.peek_type(twice) == "PING" and msgpack.unpackb(twice)["type"] == "GC"
        reply, _, mtype = d._handle([twice])
        err = msgpack.unpackb(reply[0])
        assert err["type"] == "ERROR" and err["code"] == MalformedMessage.code and "twice" in err["message"]
        reply, _, _ = d._handle([header])
        assert msgpack.unpackb(reply[0])["type"] == "PING"  # the same header naming it once is served
    finally:
        d.close()


# A process that stores small prompts back to back (bench_stress's put-storm),
# then prints how many were acknowledged.
STORM = r"""
import sys
import numpy as np
from kvd_client import Client, HostTensor, Snapshot
snap = Snapshot(sliced={"k": (HostTensor.from_numpy(np.full((1, 1024, 16), 7, np.uint8)), 1)})
acked = sent = 0
more = None  # how many PUTs after the daemon first paced it
with Client(sys.argv[1], namespace="storm", timeout=30, chunk_tokens=256) as c:
    while sent < int(sys.argv[2]) and more != 0:
        acked += bool(c.put([sent, 7] * 512, snap))
        sent += 1
        if more is not None:
            more -= 1
        elif sent % 10 == 0:
            peers = c.stats()["peers"]
            if peers["busy_writers_seen"] >= 1 and peers["deferred"] > 0:
                more = int(sys.argv[3])
print(acked, sent, flush=True)
"""


def _reading_through(d, script: str, *args: str):
    """A reader stores a 300-token prefix and GETs it, every GET a whole hit,
    while `script` runs in a process of its own to its end: (the reader,
    what the script printed). The prefix is served bit-exact after."""
    reader = d.client("good", strict=True)
    tokens = list(range(300))
    data = np.arange(300 * 160, dtype=np.uint8).reshape(1, 300, 160)
    assert reader.put(tokens, Snapshot(sliced={"k": (HostTensor.from_numpy(data), 1)}))
    proc = subprocess.Popen([sys.executable, "-c", script, d.endpoint, *args], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            hit = reader.get(tokens)
            assert hit is not None and hit.n == 300
        assert proc.wait(30) == 0
        out = proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()
    np.testing.assert_array_equal(reader.get(tokens).sliced["k"].array, data)
    return reader, out


def test_a_writer_storming_the_daemon_is_paced_while_a_reader_reads(kvd_daemon):
    """A real daemon: a process PUTting small prompts back to back becomes a
    busy writer while another process reads; every put is acknowledged and
    every read is a hit. (It stops 60 PUTs after the daemon first paced it:
    the 400 before waited their turns to the end, ~10 s, for no other check.)"""
    reader, out = _reading_through(kvd_daemon, STORM, "400", "60")
    acked, sent = map(int, out.split())
    assert acked == sent, out  # every put acknowledged
    peers = reader.stats()["peers"]
    assert peers["busy_writers_seen"] >= 1 and peers["deferred"] > 0, peers


# A process that connects, PINGs, reads the reply and hangs up, N times in a
# row (bench_stress's churn), then prints how many were answered.
CHURN = r"""
import sys, zmq
from kvd.protocol import codec
ctx, answered = zmq.Context(), 0
for i in range(int(sys.argv[2])):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(sys.argv[1])
    s.send_multipart(codec.encode("PING", {}, id=i))
    if s.poll(30_000):
        answered += codec.decode_reply(s.recv_multipart()).type == "PING"
    s.close()
print(answered, flush=True)
"""


def test_a_process_connecting_again_and_again_is_paced_while_a_reader_reads(kvd_daemon):
    """A real daemon: a process opening a connection for every PING becomes
    churning while another process reads: its new connections' PINGs wait
    their turns, each is answered, and every read is a hit."""
    reader, out = _reading_through(kvd_daemon, CHURN, "300")
    assert out.split() == ["300"]  # every PING answered
    peers = reader.stats()["peers"]
    assert peers["churners_seen"] >= 1 and peers["deferred"] > 0, peers


# A process that sends N LOOKUPs of 1 M tokens (4 MiB each: heavy) without
# waiting for replies, then reads them all and prints how many of each kind.
PIPELINE = r"""
import sys, zmq
from kvd.protocol import codec, keys
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 0)
s.connect(sys.argv[1])
n = int(sys.argv[2])
lookup = codec.encode("LOOKUP", {"ns": "x", "tokens": keys.token_bytes(range(1 << 20)), "chunk_tokens": 1}, id=0)[0]
for i in range(n):
    s.send_multipart([lookup])
kinds = {}
for _ in range(n):
    assert s.poll(60_000), kinds
    r = codec.decode_reply(s.recv_multipart())
    kind = r.type if r.type != "ERROR" else r["name"]
    kinds[kind] = kinds.get(kind, 0) + 1
print(" ".join(f"{k}={v}" for k, v in sorted(kinds.items())), flush=True)
"""


def test_a_heavy_peer_that_does_not_wait_for_its_replies_is_told_busy_past_its_few_waiting(kvd_daemon):
    """A real daemon: a process pipelining 24 heavy LOOKUPs while another
    reads. At most turns.max_per_peer of them wait for their turns; the rest
    are answered BUSY unserved (else, the queue full, they were served at
    once, the pacing undone). Every request has an answer."""
    reader, out = _reading_through(kvd_daemon, PIPELINE, "24")
    kinds = {k: int(v) for k, v in (kv.split("=") for kv in out.split())}
    assert kinds.get("BUSY", 0) > 0 and kinds.get("BUSY", 0) + kinds.get("LOOKUP", 0) == 24, kinds
    peers = reader.stats()["peers"]
    assert peers["refused_waiting"] == kinds["BUSY"] and peers["deferred"] > 0, peers
