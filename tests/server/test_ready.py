"""Requests read off the socket are served reads first (kvd.server.admission.ready):
a model server's GET waits for the request being served, not for one of
every writer's."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from kvd.protocol import codec, keys
from kvd.server.admission.ready import Ready
from kvd.server.daemon import Daemon
from kvd.store import RamStore


def test_reads_go_before_writes_and_otherwise_in_arrival_order():
    r = Ready()
    for peer, mtype in ((b"w1", "PUT"), (b"w2", "SLOTS"), (b"r1", "GET"), (b"w3", "COMMIT"), (b"r2", "LOOKUP"),
                        (b"r3", "PING"), (b"w4", "GC"), (b"x", None)):
        r.put(peer, peer, 1, mtype)
    assert [r.pop() for _ in range(len(r))] == [b"r1", b"r2", b"r3", b"x", b"w1", b"w2", b"w3", b"w4"]
    assert r.pop() is None and r.bytes == 0


def test_a_peers_requests_keep_their_order_a_read_behind_its_own_write_included():
    r = Ready()
    r.put(b"a", "a-put", 1, "PUT")
    r.put(b"a", "a-get", 1, "GET")  # must not overtake a's PUT (the GET may be for what the PUT stores)
    r.put(b"b", "b-get", 1, "GET")
    assert [r.pop(), r.pop(), r.pop()] == ["b-get", "a-put", "a-get"]


def test_a_write_passed_over_max_passes_times_goes_next():
    r = Ready(max_passes=3)
    r.put(b"w", "w", 1, "PUT")
    served = []
    for i in range(5):  # a stream of reads, one waiting at a time
        r.put(b"r%d" % i, "r%d" % i, 1, "GET")
        served.append(r.pop())
    assert served == ["r0", "r1", "r2", "w", "r3"]
    assert r.pop() == "r4" and len(r) == 0


def test_what_waits_is_bounded_in_count_and_bytes_and_one_always_may():
    r = Ready(max_waiting=2, max_bytes=100)
    assert r.room(1000)  # none waits: one may, whatever its size
    r.put(b"a", "a", 1000, "PUT")
    assert not r.room(0)
    r.pop()
    r.put(b"a", "a", 60, "GET")
    assert r.room(40) and not r.room(41)
    r.put(b"b", "b", 40, "GET")
    assert not r.room(0)  # two waiting


def test_drain_gives_every_waiting_request_oldest_first_and_empties():
    r = Ready()
    for i, mtype in enumerate(["PUT", "GET", "PUT", "PING"]):
        r.put(b"p%d" % (i % 2), i, 1, mtype)
    assert list(r.drain()) == [0, 1, 2, 3]
    assert len(r) == 0 and r.bytes == 0 and r.pop() is None


def test_the_type_is_read_from_the_headers_first_bytes():
    assert codec.peek_type(codec.encode("GET", {"ns": "n"}, id=2**63)[0]) == "GET"
    put = codec.encode("PUT", {"ns": "n", "tokens": bytes(4 << 20), "chunk_tokens": 1, "chunks": []}, id=7)[0]
    assert codec.peek_type(put) == "PUT"
    for junk in (b"", b"\xc1", b"\x93\x01\x02\x03", b"\x81\xa4type\x05", b"\x83\xa1v\x01\xa4type", bytes(range(256))):
        assert codec.peek_type(junk) is None


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(RamStore(64 << 20), f"ipc://{tmp_path / 'kvd.sock'}", shm=False)
    d.bind()
    yield d
    d.close()


def test_a_get_waiting_with_four_writers_puts_is_served_first(daemon):
    """Four peers' PUTs are waiting on the socket before a client's GET: the
    GET is answered first (by a ROUTER's order it came fifth), then the PUTs
    in their order."""
    d = daemon
    ctx = zmq.Context.instance()
    writers = [ctx.socket(zmq.DEALER) for _ in range(4)]
    reader = ctx.socket(zmq.DEALER)
    toks = keys.token_bytes(range(256))
    try:
        for s in (*writers, reader):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(d.endpoint)
        for i, w in enumerate(writers):
            data = np.full(1 << 20, i, np.uint8)
            w.send_multipart(codec.encode("PUT", {"ns": f"w{i}", "tokens": toks, "chunk_tokens": 256, "chunks": [
                {"index": 0, "tensors": [codec.Tensor("k", "uint8", (1 << 20,), data)], "meta": b""}]}, id=i))
        reader.send_multipart(codec.encode("GET", {"ns": "w0", "tokens": toks, "chunk_tokens": 256}, id=9))
        deadline = time.monotonic() + 10
        waiting: list = []
        while len(waiting) < 5:  # all five are in before the daemon serves one
            assert time.monotonic() < deadline, "the requests did not arrive"
            if d._sock.poll(100):
                waiting.append(d._recv(d._sock))

        def recv():
            if not waiting:
                raise zmq.Again()
            return waiting.pop(0)

        d._serve_waiting(recv, most=1)
        assert reader.poll(5000), "the GET was not answered first"
        assert codec.decode_reply(reader.recv_multipart()).type == "GET"
        assert not any(w.poll(0) for w in writers)
        assert d.ready.stats()["ready"] == 4
        d._serve_waiting(recv, most=4)
        for i, w in enumerate(writers):
            assert w.poll(5000)
            reply = codec.decode_reply(w.recv_multipart())
            assert reply.type == "PUT" and reply.id == i and reply["stored"] == 1
    finally:
        for s in (*writers, reader):
            s.close()


def test_what_was_read_and_not_served_at_a_stop_is_answered_busy(daemon):
    d = daemon
    ctx = zmq.Context.instance()
    client = ctx.socket(zmq.DEALER)
    try:
        client.setsockopt(zmq.LINGER, 0)
        client.connect(d.endpoint)
        client.send_multipart(codec.encode("PING", {}, id=3))
        assert d._sock.poll(5000)
        raw = d._recv(d._sock)
        d.ready.put(raw[0].bytes, raw, 0, "PING")
        d._refuse_ready("the daemon is stopping")
        assert client.poll(5000)
        reply = codec.decode_reply(client.recv_multipart())
        assert reply.type == "ERROR" and reply["name"] == "BUSY" and reply.id == 3
        assert len(d.ready) == 0
    finally:
        client.close()


def test_a_peer_with_many_requests_waiting_does_not_put_anothers_behind_all_of_them():
    r = Ready()
    for i in range(10):  # a peer that sent ten GETs at once
        r.put(b"flood", f"f{i}", 1, "GET")
    r.put(b"client", "c", 1, "GET")
    r.put(b"writer", "w", 1, "PUT")
    assert [r.pop() for _ in range(3)] == ["f0", "c", "f1"]  # the client's GET second, as the socket would have it
    assert [r.pop() for _ in range(len(r))] == [f"f{i}" for i in range(2, 10)] + ["w"]


def test_passes_count_from_when_a_request_became_its_peers_oldest():
    """A peer that sent ten GETs at once has them all waiting long: the rule
    for requests passed over does not make it the only one served."""
    r = Ready(max_passes=3)
    for i in range(10):
        r.put(b"flood", f"f{i}", 1, "GET")
    for _ in range(4):
        r.pop()  # f0..f3: passes that do not count against its later ones
    r.put(b"client", "c", 1, "GET")
    assert r.pop() == "c"


def test_a_socket_that_became_readable_during_a_run_of_others_requests_is_read_before_the_next_is_served(tmp_path):
    """Daemon rule 7 (`admission.round.Round.refresh`): a writer's PUTs wait on its lane as
    the loop polls; a client's GET arrives on another lane after that poll.
    Before the next request is served the loop looks again: the GET is read
    and served first, not after the writer's run. Within REPOLL_S of a poll
    the loop does not look again (an injected clock)."""
    import shutil
    import tempfile
    from pathlib import Path

    from kvd.server.admission import round as D

    home = Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp"))  # short: lanes' ipc paths have a limit
    d = Daemon(RamStore(64 << 20), f"ipc://{home / 'kvd.sock'}", shm=False)
    # Both lanes' peers are this process, one origin: a first PUT that took
    # over heavy_s of the thread (a loaded machine: 5 runs in 20 beside two
    # spinning processes) made the origin heavy, and the GET, on a connection
    # with no cost of its own yet, waited in turns behind the writer's next
    # PUT (turns rule 1). The round is what this test is about, not turns.
    d.turns.heavy_s = float("inf")
    d.bind()
    ctx = zmq.Context.instance()
    writer, reader = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    toks = keys.token_bytes(range(256))
    now = [100.0]
    try:
        poller = zmq.Poller()
        poller.register(d._sock, zmq.POLLIN)
        poller.register(d.wakeup.fd, zmq.POLLIN)
        lanes = [d.lanes.open(), d.lanes.open()]
        d._sync_lanes(poller)
        by_endpoint = {lane.endpoint: s for s, lane in d.lanes.by_sock.items()}
        for s, ep in ((writer, lanes[0]), (reader, lanes[1])):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
        for i in range(3):
            writer.send_multipart(codec.encode("PUT", {"ns": f"w{i}", "tokens": toks, "chunk_tokens": 256, "chunks": [
                {"index": 0, "tensors": [codec.Tensor("k", "uint8", (1024,), np.full(1024, i, np.uint8))], "meta": b""}]},
                id=i))
        assert by_endpoint[lanes[0]].poll(10_000), "the PUTs did not arrive"
        rnd = D.Round(d, poller, clock=lambda: now[0])
        rnd.poll(0)
        assert rnd.waiting == [by_endpoint[lanes[0]]]
        reader.send_multipart(codec.encode("GET", {"ns": "w0", "tokens": toks, "chunk_tokens": 256}, id=9))
        assert by_endpoint[lanes[1]].poll(10_000), "the GET did not arrive"

        now[0] += D.REPOLL_S / 2  # too soon to look again: the writer's first PUT is served
        d._serve_waiting(rnd, most=1)
        assert writer.poll(5000) and codec.decode_reply(writer.recv_multipart()).id == 0
        assert not reader.poll(0)

        now[0] += D.REPOLL_S  # the loop looks again: the GET is read, and goes first
        d._serve_waiting(rnd, most=1)
        assert reader.poll(5000), "the GET was not served next"
        assert codec.decode_reply(reader.recv_multipart()).id == 9
        assert not writer.poll(0)
        d._serve_waiting(rnd, most=2)
        assert [codec.decode_reply(writer.recv_multipart()).id for _ in range(2) if writer.poll(5000)] == [1, 2]
    finally:
        for s in (writer, reader):
            s.close()
        d.close()
        shutil.rmtree(home, ignore_errors=True)


def _counted_poller(d, now: list, polls: list, cost: float = 0.0) -> zmq.Poller:
    """A real poller of the daemon's main socket whose polls are noted in
    `polls` (at the injected clock `now`) and advance that clock by `cost`."""
    poller = zmq.Poller()
    poller.register(d._sock, zmq.POLLIN)
    real = poller.poll

    def counted(timeout=None):
        polls.append(now[0])
        now[0] += cost
        return real(timeout)

    poller.poll = counted
    return poller


def test_looking_again_takes_at_most_a_tenth_of_the_loops_time_however_many_lanes(tmp_path):
    """`Round.refresh` after a poll that took 1 ms (an injected clock; a
    thousand lanes take ~0.6 ms here) does not poll again for 10 ms."""
    from kvd.server.admission import round as D

    d = Daemon(RamStore(16 << 20), f"ipc://{tmp_path / 'kvd.sock'}", shm=False)
    d.bind()
    now, polls = [100.0], []
    try:
        poller = _counted_poller(d, now, polls, cost=0.001)
        rnd = D.Round(d, poller, clock=lambda: now[0])
        rnd.poll(0)
        now[0] += D.REPOLL_S
        rnd.refresh()
        assert len(polls) == 2 and rnd.gap == pytest.approx(0.010)
        now[0] += 0.005
        rnd.refresh()
        assert len(polls) == 2  # within ten times the last poll's cost: not again
        now[0] += 0.0051
        rnd.refresh()
        assert len(polls) == 3
    finally:
        d.close()


def test_looking_again_after_a_lane_was_closed_in_the_run_serves_on(tmp_path):
    """A lane closed while the loop serves a run (a banned peer cut off, the
    outbox's hog) stays in the poller until the loop's next poll: polled
    again before that, a closed socket polled as fd 0, and with stdin on
    /dev/null (a service) `refresh` took that fd for a socket and the loop
    died on it. Now the lanes closed leave the poller first."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from kvd.server.admission import round as D

    home = Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp"))
    d = Daemon(RamStore(64 << 20), f"ipc://{home / 'kvd.sock'}", shm=False)
    d.bind()
    ctx = zmq.Context.instance()
    client = ctx.socket(zmq.DEALER)
    stdin = os.dup(0)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # as under a service manager: fd 0 always readable
    now = [100.0]
    try:
        poller = zmq.Poller()
        poller.register(d._sock, zmq.POLLIN)
        poller.register(d.wakeup.fd, zmq.POLLIN)
        kept, gone = d.lanes.open(), d.lanes.open()
        d._sync_lanes(poller)
        client.setsockopt(zmq.LINGER, 0)
        client.connect(kept)
        for i in range(2):
            client.send_multipart(codec.encode("PING", {}, id=i))
        sock = next(s for s, lane in d.lanes.by_sock.items() if lane.endpoint == kept)
        assert sock.poll(10_000), "the PINGs did not arrive"
        rnd = D.Round(d, poller, clock=lambda: now[0])
        rnd.poll(0)
        d.lanes.close(d.lanes.by_identity[next(i for i, lane in d.lanes.by_identity.items() if lane.endpoint == gone)])
        now[0] += D.REPOLL_S
        d._serve_waiting(rnd, most=2)
        assert all(isinstance(s, zmq.Socket) for s in rnd.waiting)
        assert [codec.decode_reply(client.recv_multipart()).id for _ in range(2) if client.poll(5000)] == [0, 1]
    finally:
        os.dup2(stdin, 0)
        os.close(stdin)
        os.close(null)
        client.close()
        d.close()
        shutil.rmtree(home, ignore_errors=True)


def test_the_main_socket_lent_is_not_polled_again_until_the_loop_lets_it_go(tmp_path):
    """While a thread drops the rest of a frame bomb from the main socket
    (drain.Lent), that thread alone touches it: a poll reads its events
    (libzmq sockets are not thread-safe), so `refresh` does not look again."""
    from kvd.server.admission import round as D

    d = Daemon(RamStore(16 << 20), f"ipc://{tmp_path / 'kvd.sock'}", shm=False)
    d.bind()
    now, polls = [100.0], []
    try:
        poller = _counted_poller(d, now, polls)
        rnd = D.Round(d, poller, clock=lambda: now[0])
        rnd.poll(0)
        d._lent = object()  # (a real Lent needs a bomb to drop: only whether it is lent is read here)
        now[0] += 1.0
        rnd.refresh()
        assert len(polls) == 1
        d._lent = None
        rnd.refresh()
        assert len(polls) == 2
    finally:
        d._lent = None
        d.close()
