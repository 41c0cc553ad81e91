"""Lanes (issue 44): a socket of its own per client, so a frame bomb costs its sender.

A client's HELLO that asks (`lanes: true`) is offered a lane, a ROUTER the
daemon binds for that client alone (kvd/server/lanes.py). A message over the
frame limit on a lane is answered TOO_MANY_FRAMES and its lane closed: the
rest of it is never read by the serving thread, and other clients' requests
are served meanwhile.
"""

from __future__ import annotations

import os
import stat
import statistics
import subprocess
import sys
import threading
import time

import pytest
import zmq

from kvd.protocol import codec

from stress import BOMB, ZMTP, attack
from support import peer_stats, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ZMTP by hand over AF_UNIX; bans by pid")

FRAMES = 8_000_000
PING = codec.encode("PING", {}, id=9)[0].hex()

# A DEALER that asks HELLO for a lane over pyzmq, then, as a ZMTP 3.0 peer
# by hand on the lane's path, sends one message of the given header (hex)
# and F empty frames (16 MB on the wire for 8 M) and prints the reply's
# error name ("EOF": the connection was cut), then "again:" and what a PING
# on the lane after it got (EOF: the lane is gone).
LANE_BOMB = ZMTP + r"""
import sys, zmq
sys.path.insert(0, sys.argv[4])
from kvd.protocol import codec
endpoint, f, header = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])
ctx = zmq.Context()
main = ctx.socket(zmq.DEALER)
main.connect(endpoint)
main.send_multipart(codec.encode("HELLO", {"versions": [1], "lanes": True}, id=1))
assert main.poll(30000)
lane = codec.decode_reply(main.recv_multipart())["lane"]
s, r = zmtp_connect(lane[len("ipc://"):])
print("ready", flush=True)
sys.stdin.readline()
s.sendall(zmtp_bomb(header, f))
out = [zmtp_reply(r)]
try:
    s.sendall(bytes([0, len(header)]) + header)
    out += ["again:", zmtp_reply(r)]
except OSError:
    out += ["again:", "EOF"]
print(" ".join(out), flush=True)
sys.stdin.read()
"""


def wait_for(what, deadline_s: float = 30.0):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.05)
    return what()


class Pinger(threading.Thread):
    """Another client: PINGs in a loop on its lane until told to stop, timing each."""

    def __init__(self, d):
        super().__init__(daemon=True)
        self.client = d.client("pinger", strict=True, timeout=30.0)
        assert self.client.hello() and self.client._transport._lane is not None  # it took its lane
        self.times: list[float] = []
        self.failed: list[BaseException] = []
        self.stop = threading.Event()
        self.during = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                t = time.perf_counter()
                assert self.client.ping()
                self.times.append(time.perf_counter() - t)
        except BaseException as err:  # reported by the test
            self.failed.append(err)

    def p99_ms(self, times: list[float]) -> float:
        return 1000 * statistics.quantiles(times, n=100)[98] if len(times) >= 2 else float("nan")


def lane_bomb(d, pinger: Pinger, seen=lambda: True) -> tuple[str, str, int]:
    """LANE_BOMB's 8 M frames sent once `seen()` and `pinger` has 300 PINGs
    answered; the pinger goes on until 300 more after the bomber's line.
    Returns (that line, the bomber's stderr, PINGs before the bomb)."""
    bomber = subprocess.Popen([sys.executable, "-c", LANE_BOMB, d.endpoint, str(FRAMES), PING, sys.path[0]],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert bomber.stdout.readline().strip() == "ready"
        assert wait_for(seen)
        pinger.start()
        assert wait_for(lambda: len(pinger.times) >= 300)
        n_before = len(pinger.times)
        bomber.stdin.write("go\n")
        bomber.stdin.flush()
        line = bomber.stdout.readline().strip()
        n_bomb = len(pinger.times)
        assert wait_for(lambda: len(pinger.times) >= n_bomb + 300)
    finally:
        pinger.stop.set()
        pinger.join(30)
        bomber.stdin.close()
        bomber.wait(30)
    return line, bomber.stderr.read(), n_before


def test_a_frame_bomb_on_a_lane_is_answered_within_100ms_of_serving_thread_and_others_are_served(daemon_factory):
    """The issue's test: 8 M empty frames on one client's lane while another
    client PINGs on its own: answered TOO_MANY_FRAMES, under 100 ms of the
    serving thread (the daemon's own `dropping_ms`), and every PING answered."""
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")
    pinger = Pinger(d)
    line, _, n_before = lane_bomb(d, pinger)
    # Answered; the lane is closed after it (a PING on it gets no answer).
    assert line == "TOO_MANY_FRAMES again: EOF", line
    assert not pinger.failed, pinger.failed
    p = peer_stats(d)
    assert p["oversized_messages"] == 1 and p["lanes_closed_for_frames"] == 1 and p["bans"] == 0
    # The daemon's own count of serving-thread time spent on the bomb (CPU:
    # on a loaded machine the wall time, `dropping_ms`, adds preemption).
    assert p["lane_bomb_cpu_ms"] < 100, p
    print(f"\nPING p99 before {pinger.p99_ms(pinger.times[:n_before]):.3f} ms, while the bomb arrived and after "
          f"{pinger.p99_ms(pinger.times[n_before:]):.3f} ms; the bomb took {p['lane_bomb_cpu_ms']} ms of the serving "
          f"thread's CPU ({p['dropping_ms']} ms wall)")
    assert d.proc.poll() is None


def test_a_frame_bomb_on_the_main_socket_is_answered_within_100ms_of_serving_thread_and_lane_clients_are_served(daemon_factory):
    """The issue's test on the main socket (before HELLO: where any process
    can send): 8 M empty frames are answered TOO_MANY_FRAMES after under
    100 ms of the serving thread's CPU; the rest is dropped by a thread the
    socket is lent to (daemon rule 8), and a client on its lane is served
    meanwhile: every PING answered, many of them while the socket was lent."""
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")
    pinger = Pinger(d)
    pinger.start()
    try:
        assert wait_for(lambda: len(pinger.times) >= 100)
        with attack(BOMB, d.endpoint[len("ipc://"):], "1", str(FRAMES), PING) as line:
            assert line == "TOO_MANY_FRAMES again: PING", line
        n = len(pinger.times)
        assert wait_for(lambda: len(pinger.times) >= n + 100)
    finally:
        pinger.stop.set()
        pinger.join(30)
    assert not pinger.failed, pinger.failed
    p = peer_stats(d)
    assert p["oversized_messages"] == 1 and p["lanes_closed_for_frames"] == 0
    assert p["dropped_frames"] >= FRAMES - 100_000 and not p["main_lent"], p
    assert p["main_bomb_cpu_ms"] < 100, p
    # The loop went on reading the lanes while the main socket was lent.
    assert p["read_while_lent"] >= 10, p
    print(f"\nthe bomb took {p['main_bomb_cpu_ms']} ms of the serving thread's CPU; the socket was lent "
          f"{p['main_lent_ms']} ms, and {p['read_while_lent']} requests were read from lanes meanwhile")


def test_lanes_do_not_leak_as_clients_come_and_go(daemon_factory):
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")
    watch = d.client("watch", strict=True, timeout=30.0)
    try:
        assert watch.hello() and watch.ping()
        for round_ in range(3):
            clients = [d.client(f"c{i}", strict=True, timeout=30.0) for i in range(6)]
            for c in clients:
                assert c.hello() and c.ping() and c._transport._lane is not None
            assert watch.stats()["peers"]["lanes"] == 7
            for c in clients[:4]:
                c.close()
            assert wait_for(lambda: watch.stats()["peers"]["lanes"] == 3), watch.stats()["peers"]
            for c in clients[4:]:
                assert c.ping()  # still on their lanes
                c.close()
            assert wait_for(lambda: watch.stats()["peers"]["lanes"] == 1), watch.stats()["peers"]
        p = watch.stats()["peers"]
        assert p["lanes_opened"] == 1 + 3 * 6 and p["lanes_closed_gone"] == 3 * 6
    finally:
        watch.close()


def test_lanes_are_bounded_by_max_peers_and_a_client_without_one_is_served(daemon_factory):
    """Five clients, each with a main-socket connection, over max_peers=3:
    the gate sheds two of those connections (gate rule 1: one that has not
    completed its first request yet goes first, so a newcomer's HELLO may be
    cut: a miss, and the client asks again). The first three took the lanes."""
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none", "--max-peers", "3")
    clients = [d.client(f"c{i}", timeout=30.0) for i in range(5)]
    try:
        for c in clients:
            wait_until(lambda: c.hello() and c.ping(), what="HELLO and PING answered")
        laned = [c._transport._lane is not None for c in clients]
        assert laned == [True, True, True, False, False]
        p = clients[0].stats()["peers"]
        assert p["lanes"] == 3 and p["lanes_refused"] >= 2
        toks = list(range(512))
        clients[4].strict = True  # a failure raises now (not a 0 like a miss)
        assert clients[4].lookup(toks) == 0  # served on the main socket
    finally:
        for c in clients:
            c.close()


def test_a_client_that_does_not_ask_for_a_lane_is_served_on_the_main_socket(daemon_factory):
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(d.endpoint)
    try:
        s.send_multipart(codec.encode("HELLO", {"versions": [1], "client": "old"}, id=1))
        assert s.poll(30_000)
        hello = codec.decode_reply(s.recv_multipart())
        assert hello.type == "HELLO" and hello.get("lane") is None
        s.send_multipart(codec.encode("PING", {}, id=2))
        assert s.poll(30_000)
        assert codec.decode_reply(s.recv_multipart()).type == "PING"
        # A HELLO that asks gets one, in the daemon's folder, a socket only its user may use.
        s.send_multipart(codec.encode("HELLO", {"versions": [1], "lanes": True}, id=3))
        assert s.poll(30_000)
        lane = codec.decode_reply(s.recv_multipart())["lane"]
        path = lane[len("ipc://"):]
        assert os.path.dirname(path) == os.path.dirname(d.endpoint[len("ipc://"):])
        assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0
    finally:
        ctx.destroy(linger=0)


def test_a_main_socket_peer_named_like_a_lane_is_neither_served_nor_answered_on_it(daemon_factory):
    """Red-team (session 41): a peer of the main socket that set its routing
    id to a lane's identity (the token is the lane's file name, in the run
    folder) had its requests served as that lane's client's, and their
    replies sent to the lane."""
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")
    ctx = zmq.Context()

    def dealer(endpoint, rid=None):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if rid is not None:
            s.setsockopt(zmq.ROUTING_ID, rid)
        s.connect(endpoint)
        return s

    try:
        main = dealer(d.endpoint)
        main.send_multipart(codec.encode("HELLO", {"versions": [1], "lanes": True}, id=1))
        assert main.poll(30_000)
        lane_ep = codec.decode_reply(main.recv_multipart())["lane"]
        victim = dealer(lane_ep)
        victim.send_multipart(codec.encode("PING", {}, id=2))
        assert victim.poll(30_000) and codec.decode_reply(victim.recv_multipart()).id == 2
        token = os.path.basename(lane_ep)[len("l-"):-len(".sock")]
        spoofer = dealer(d.endpoint, b"\x01lane" + bytes.fromhex(token))
        spoofer.send_multipart(codec.encode("PING", {}, id=999))
        wait_until(lambda: peer_stats(d)["spoofed_lanes"] == 1)
        victim.send_multipart(codec.encode("PING", {}, id=3))  # the victim's next reply is its own, not 999's
        assert victim.poll(30_000) and codec.decode_reply(victim.recv_multipart()).id == 3
        assert not spoofer.poll(100)
    finally:
        ctx.destroy(linger=0)


def test_a_lane_nobody_connects_to_is_closed_after_its_grace_and_lanes_are_bounded(tmp_path):
    """In process, with an injected clock: a lane offered but never used is
    closed by the first reap past `grace`; past `most`, none is offered."""
    from kvd.server.lanes import Lanes

    now = [100.0]
    ctx = zmq.Context()
    lanes = Lanes(ctx, tmp_path, most=2, configure=lambda s: s.setsockopt(zmq.LINGER, 0), grace=10.0,
                  clock=lambda: now[0])
    try:
        first, second = lanes.open(), lanes.open()
        assert first and second and first != second and lanes.open() is None
        assert lanes.stats()["lanes"] == 2 and lanes.counters["lanes_refused"] == 1
        now[0] += 9.0
        lanes.reap()
        assert lanes.stats()["lanes"] == 2
        now[0] += 2.0
        lanes.reap()
        assert lanes.stats()["lanes"] == 0 and lanes.counters["lanes_closed_unused"] == 2
        assert len(lanes.removed) == 2  # for the serving loop's poller
        assert lanes.open() is not None  # room again
    finally:
        lanes.close_all(linger=0)
        ctx.destroy(linger=0)


def test_a_frame_bomb_on_a_lane_is_cut_off_before_it_is_whole_when_memory_is_over_the_ceiling(daemon_factory):
    """Gate rule 10: the gate learns the lanes' connections from the accept
    guard, so over the memory ceiling a lane stalled inside a message of 8 M
    frames (~600 MB inside libzmq) is shed like a main-socket peer: its
    sender sees its connection cut, never an answer; a client PINGing on its
    own lane meanwhile has every PING answered; the daemon lives on."""
    d = daemon_factory("--ram-mb", "16", "--max-message-mb", "16", "--data-dir", "none")
    pinger = Pinger(d)
    line, err, _ = lane_bomb(d, pinger, seen=lambda: peer_stats(d)["lane_connections"] >= 1)  # the bomber's, at accept
    # Cut off while it was still sending (its write fails) or right after.
    assert line == "EOF again: EOF" or (line == "" and ("BrokenPipeError" in err or "ConnectionResetError" in err)), (line, err)
    assert not pinger.failed, pinger.failed
    p = peer_stats(d)
    assert p["shed_for_memory"] >= 1 and p["oversized_messages"] == 0, p
    assert d.proc.poll() is None


@pytest.mark.parametrize("n", [4_000, 20_000])
def test_a_long_message_on_a_lane_is_read_in_turns_and_another_sockets_request_is_read_in_between(n):
    """Daemon rule 9: n parts on a lane are read 512 at a time (past 8,192
    parts, 2,048 at a time in C); between two turns a PING on the main
    socket is read whole; the lane's message, taken up again, comes out
    whole and exact (every part, in order)."""
    import shutil
    import tempfile
    from pathlib import Path

    from kvd.server.daemon import Daemon
    from kvd.store import RamStore

    home = Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp"))  # short: lanes' ipc paths have a limit
    d = Daemon(RamStore(16 << 20), f"ipc://{home / 'kvd.sock'}", shm=False)
    d.bind()
    ctx = zmq.Context.instance()
    long_peer, pinger = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        lane = d.lanes.open()
        assert lane is not None
        lane_sock = next(iter(d.lanes.by_sock))
        for s, ep in ((long_peer, lane), (pinger, d.endpoint)):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
        sent = [codec.encode("PING", {}, id=5)[0]] + [i.to_bytes(4, "big") for i in range(n - 1)]
        long_peer.send_multipart(sent)
        assert lane_sock.poll(10_000), "the long message did not arrive"
        with pytest.raises(zmq.Again):
            d._recv(lane_sock)  # its first turn
        assert len(d.parts.partial[lane_sock][0]) == 513  # the identity and 512 parts
        turns, pinged = 1, 0  # turns cut short so far (the first, above)
        while True:
            if turns in (1, n // 1000):  # early, and (for 20,000) among the turns in C
                pinger.send_multipart(codec.encode("PING", {}, id=6 + pinged))
                assert d._sock.poll(10_000)
                ping = d._recv(d._sock)
                assert codec.peek_id([ping[1].bytes]) == 6 + pinged
                pinged += 1
            try:
                got = d._recv(lane_sock)
                break
            except zmq.Again:
                pass
            turns += 1
        # n + 1 parts with the identity: 513, 1,025, ... through pyzmq up to
        # 8,193, then 2,048 more a turn in C; the call that reads the last part returns.
        got_, cut = 1, 0
        while True:
            if got_ < 8193:
                got_ = min(n + 1, 8193, got_ + 512)
                if got_ < min(n + 1, 8193):
                    cut += 1
                    continue
            if got_ < n + 1:
                got_ = min(n + 1, got_ + 2048)
            if got_ == n + 1:
                break
            cut += 1
        assert turns == cut and d.parts.turns == cut, (turns, cut)
        assert got[0].bytes.startswith(b"\x01lane") and [bytes(f.bytes) for f in got[1:]] == sent
        assert lane_sock not in d.parts.partial
    finally:
        for s in (long_peer, pinger):
            s.close()
        d.close()
        shutil.rmtree(home, ignore_errors=True)
