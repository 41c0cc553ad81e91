"""Frame bombs (issue 44): one message of millions of empty frames.

ZeroMQ hands the daemon a message whole, so such a message must be read to
its end before any other peer's can be; the daemon reads what is past the
frame limit in C (kvd/server/admission/drain.py), answers TOO_MANY_FRAMES,
and bans a process that sends a second within a minute (gate rule 9).
"""

from __future__ import annotations

import collections
import ctypes
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import zmq

from kvd.protocol import codec
from kvd.protocol.limits import Limits
from kvd.server.admission import drain
from kvd.server.admission.connections import connection_id

from stress import BOMB, ZMTP, attack
from support import FakeClock, peer_stats, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="bans by SO_PEERCRED pid (Linux)")

FRAMES = 8_000_000
PING = codec.encode("PING", {}, id=9)[0].hex()


def _router_and_two_peers(tmp_path):
    """A ROUTER on an ipc path and two DEALERs connected to it (context first)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"ipc://{tmp_path}/s")
    peers = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for s in peers:
        s.connect(f"ipc://{tmp_path}/s")
    return ctx, router, *peers


def test_the_rest_of_a_message_is_dropped_to_its_end_and_no_further(tmp_path):
    ctx, router, bomber, other = _router_and_two_peers(tmp_path)
    try:
        bomber.send_multipart([b"head"] + [b""] * 200_000 + [b"x" * 1000])
        assert router.poll(30_000)
        router.recv()  # the identity
        head = router.recv()
        assert head == b"head"
        other.send_multipart([b"next", b"one"])
        assert drain.Dropper(router).rest() == 200_001
        assert not router.get(zmq.RCVMORE)
        assert router.poll(30_000)
        assert router.recv_multipart()[1:] == [b"next", b"one"]
    finally:
        ctx.destroy(linger=0)


@pytest.mark.skipif(not drain.available(), reason="zmq_recviov not found: parts are read through pyzmq")
@pytest.mark.parametrize("fails_at", ["middle", "last"])
def test_a_failing_recviov_never_reads_past_the_message(tmp_path, monkeypatch, fails_at):
    """zmq_recviov can take a part and fail after (libzmq's malloc of its
    copy, ENOMEM: not something a test can make happen, so faked here): the
    rest goes through pyzmq, and if that part was the message's last, no
    read follows (a blocking recv there would take the next peer's message,
    or wait for ever). Dropping the rest, a turn of it, and a turn of
    reading all end at the message's end."""
    ctx, router, sender, other = _router_and_two_peers(tmp_path)
    router.rcvtimeo = 2000  # a read past the end would raise zmq.Again here, not hang
    real, free = drain._fns
    failed = []

    def recviov(handle, iov, count, flags):
        """The first call takes one part ("middle") or every part to the
        message's end ("last"), keeps none, and fails; the others are real."""
        if failed:
            return real(handle, iov, count, flags)
        one = ctypes.c_size_t(1)
        while True:
            one.value = 1
            real(handle, iov, ctypes.byref(one), flags)
            free(iov[0].base)
            if fails_at == "middle" or not router.get(zmq.RCVMORE):
                break
        failed.append(1)
        count._obj.value = 0
        return -1

    monkeypatch.setattr(drain, "_fns", (recviov, free))
    try:
        for how in ("rest", "drop_some", "read_some"):
            failed.clear()
            sender.send_multipart([b"head"] + [b"ab"] * 5)
            assert router.poll(30_000)
            router.recv(), router.recv()  # the identity, the head
            if how == "rest":
                drain.Dropper(router).rest()
            elif how == "drop_some":
                while drain.drop_some(router, 100)[2]:
                    pass
            else:
                while drain.read_some(router, 100)[1]:
                    pass
            assert failed and not router.get(zmq.RCVMORE)
            other.send_multipart([b"next", b"one"])
            assert router.poll(30_000)
            assert router.recv_multipart()[1:] == [b"next", b"one"]  # the next message, whole
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("after", [9, 10, 11])
def test_a_message_refused_from_its_header_is_dropped_in_turns_up_to_the_limit(tmp_path, after):
    """`PartReader.read(refuse=)` (a write-back PUT while the backlog is
    full): the parts after a refused header are dropped unread, in turns,
    and counted (parts and bytes, for its peer's charge); with `max_frames`
    10 (header included), 9 parts after it are a message within the limit,
    10 one frame over it (answered TOO_MANY_FRAMES by the daemon, read
    whole), 11 a frame bomb (more=True: the caller's bomb path). The next
    message is the other peer's, whole."""
    from kvd.server.admission import parts as P

    ctx, router, sender, other = _router_and_two_peers(tmp_path)
    reader, old_turn = P.PartReader(), P.TURN_C_PARTS
    P.TURN_C_PARTS = 4  # turns of 4 parts: 9-11 parts take three
    try:
        sender.send_multipart([b"head"] + [b"ab"] * after)
        assert router.poll(30_000)
        other.send_multipart([b"next", b"one"])
        turns = 0
        while True:
            try:
                got, more, _ = reader.read(router, 10, refuse=lambda header: header.bytes == b"head")
                break
            except zmq.Again:
                turns += 1
        assert turns == 2 and [f.bytes for f in got[1:2]] == [b"head"]
        if after == 11:
            assert more and not isinstance(got, P.Truncated) and reader.refused == 0
            drain.Dropper(router).rest()  # what the daemon's bomb path does with the rest
        else:
            assert not more and isinstance(got, P.Truncated) and len(got) == 2
            assert (got.dropped, got.dropped_bytes, reader.refused) == (after, 2 * after, 1)
            assert (1 + got.dropped > 10) == (after == 10)  # over max_frames: TOO_MANY_FRAMES
        assert router.poll(30_000)
        assert [f.bytes for f in reader.read(router, 10, refuse=lambda header: False)[0][1:]] == [b"next", b"one"]
    finally:
        P.TURN_C_PARTS = old_turn
        ctx.destroy(linger=0)


def test_a_process_is_spared_a_strike_for_memory_twice_a_minute_and_no_more():
    """drain.Offenders.spare: a process shed for memory inside a bomb while a
    request of it was read on a connection still open is spared twice
    within the window, then struck; spares older than the window lapse."""
    clock = FakeClock(100.0)
    offenders = drain.Offenders(clock=clock)
    assert offenders.spare(b"pid 7") and offenders.spare(b"pid 7")
    assert not offenders.spare(b"pid 7") and not offenders.spare(b"pid 7")
    assert offenders.spare(b"pid 8")  # another process has spares of its own
    clock.advance(61.0)
    assert offenders.spare(b"pid 7")  # a minute on: the first two have lapsed
    assert offenders.spared == 4


class _Striker(drain.Striking):
    """What `drain.Striking` needs of the daemon: a served connection of
    process 7 (a real socket, so its connection id holds), and the gate's
    stuck senders."""

    def __init__(self, fd: int):
        self.offenders = drain.Offenders(clock=FakeClock(100.0))
        self.gate = self
        self.stuck_senders = collections.deque()
        self.banned = []
        self.lanes = None
        self._conns = {fd: SimpleNamespace(origin=b"pid 7", where=(fd, connection_id(fd)))}
        self.struck_for_memory = 0
        self.ratelog = SimpleNamespace(warning=lambda *a: None)

    def ban(self, who, fds, seconds):
        self.banned.append(who)


@pytest.mark.parametrize("sending", [True, False])
def test_a_served_process_shed_inside_a_bomb_is_spared_a_few_times_a_minute(sending):
    """A process with a request read on a connection still open, shed for
    memory inside its first message, is spared (a client's remade idle
    connection may be shed while memory fell for another reason): twice a
    minute if that connection was still sending, six times if it was not (a
    bomber may stop short of its last frame); struck after that."""
    a, b = socket.socketpair()
    try:
        d = _Striker(a.fileno())
        for _ in range(8):
            d.stuck_senders.append((b"pid 7", sending))
            d._strike_stuck()
        spared = 2 if sending else 6
        assert d.offenders.spared == spared and d.struck_for_memory == 8 - spared
        assert d.banned and set(d.banned) == {b"pid 7"}  # banned at its second strike
    finally:
        a.close()
        b.close()


def test_a_frame_bomb_is_answered_and_its_parts_dropped(daemon_factory):
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")
    path = d.endpoint[len("ipc://"):]
    with attack(BOMB, path, "1", str(FRAMES), PING) as line:
        assert line == "TOO_MANY_FRAMES again: PING", line
    p = peer_stats(d)
    kept = Limits().max_frames + 2  # the identity, then one frame over the limit
    assert p["oversized_messages"] == 1 and p["bans"] == 0
    assert p["dropped_frames"] == FRAMES + 2 - kept  # identity + header + FRAMES parts, less those read
    assert d.proc.poll() is None


def test_a_process_that_keeps_bombing_is_banned_and_others_are_served(daemon_factory):
    """The first bomb is answered; the second bans the process: its
    connection is cut (its reply with it), and the one it makes next is
    held unread by the accept guard (gate rule 9): never greeted, while
    another process is served as before."""
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")
    path = d.endpoint[len("ipc://"):]
    good = d.client("good", strict=True, timeout=30.0)
    assert good.ping()
    bomber = subprocess.Popen([sys.executable, "-c", BOMB, path, "2", "100000", PING, "split"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert bomber.stdout.readline().strip() == "TOO_MANY_FRAMES EOF"
        wait_until(lambda: peer_stats(d)["held_banned"] >= 1, what="the next connection held")
        assert good.ping()
        p = peer_stats(d)
        assert p["oversized_messages"] == 2 and p["bans"] == 1 and p["shed_banned"] >= 1, p
        assert bomber.poll() is None  # still waiting for a greeting that does not come
    finally:
        bomber.kill()
        bomber.wait(30)
    assert d.proc.poll() is None


def test_a_process_shed_twice_for_memory_inside_a_bomb_is_banned_and_then_held(daemon_factory):
    """Over the memory ceiling, a bomb is shed before it is whole (gate rule
    3), so it is never read to an answer: a process shed so twice within a
    minute is banned like one that bombed twice, and its next connections are
    held unread (no more ~600 MB of libzmq's for each). The other client is
    answered throughout; the daemon lives on."""
    d = daemon_factory("--ram-mb", "16", "--max-message-mb", "16", "--data-dir", "none")
    path = d.endpoint[len("ipc://"):]
    good = d.client("good", timeout=30.0)
    assert good.ping()
    watcher = d.client("watch", timeout=30.0)
    bomber = subprocess.Popen([sys.executable, "-c", REBOMB, path, str(FRAMES), PING],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert bomber.stdout.readline().strip() == "ready"
        wait_until(lambda: _held(watcher) >= 1, timeout=120, what="the bomber's connection held")
        p = peer_stats(d)
        assert p["struck_for_memory"] >= 2 and p["bans"] >= 1 and p["oversized_messages"] == 0, p
        _served_on(good)
        assert peer_stats(d)["held_banned"] == 1  # held, the bomber waits: it makes no new connection
    finally:
        bomber.kill()
        bomber.wait(30)
    assert d.proc.poll() is None


def test_a_banned_process_connecting_at_a_full_table_costs_no_peer_its_connection(daemon_factory):
    """At a full table a waiting connection makes the gate shed its oldest
    idle peers; a banned process that connects again and again would have
    had one shed for each try. The gate screens what waits first (rule 9,
    `_screen`): the banned process's connections are held, nobody is shed,
    and a newcomer of another process is still let in (one peer shed for it)."""
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none", "--max-peers", "6")
    path = d.endpoint[len("ipc://"):]
    bomber = subprocess.Popen([sys.executable, "-c", BANNED_FLOOD, path, "100000", PING],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert bomber.stdout.readline().strip() == "TOO_MANY_FRAMES EOF"  # banned at the second (10 s)
        banned_at = time.monotonic()
        # The bomb's connections, cut, leave the table as the gate reads
        # their DISCONNECTED: the table is filled once they have (a stale one
        # counted made the sixth client wait past its connect_wait once in CI;
        # one shed but not closed yet, still holding its place, made the sixth
        # screened in and c0 shed for it, so c0's PING found no connection).
        clients = [d.client("c0", strict=True, timeout=30.0)]
        def alone() -> bool:  # c0 the only peer, and none shed still holding its place
            p = clients[0].stats()["peers"]
            return p["connected"] == 1 and p["closing"] == 0

        wait_until(alone, what="the bomb's connections gone")
        clients += [d.client(f"c{i}", strict=True, timeout=30.0) for i in range(1, 6)]
        assert all(c.ping() for c in clients)  # the table is full: six peers, max_peers 6
        # A peer can be served before the gate has read its ACCEPTED (gate
        # rule 4): the table counts it once that event is read (seen at 4 of 6
        # on a loaded machine).
        wait_until(lambda: clients[0].stats()["peers"]["connected"] == 6, what="the six peers' ACCEPTED read")
        before = clients[0].stats()["peers"]
        assert before["connected"] == 6 and before["bans"] == 1, before
        bomber.stdin.write("40\n")
        bomber.stdin.flush()
        made = int(bomber.stdout.readline())
        assert made >= 4  # those the listen backlog had room for
        wait_until(lambda: clients[0].stats()["peers"]["held_banned"] >= before["held_banned"] + made,
                   what="the banned process's connections held")
        after = clients[0].stats()["peers"]
        assert after["shed_over_cap"] == before["shed_over_cap"] and after["connected"] == 6, (before, after)
        assert all(c.ping() for c in clients)  # strict: no connection of theirs was cut
        # A newcomer of another process is let in while the ban lasts (10 s),
        # an idle peer shed for it -- not the newcomer itself, which has sent
        # nothing yet and would sort first (below 16 peers, again and again) --
        # and the cap kept. (Not "one shed": a peer's DISCONNECTED read late
        # may have left room by then, seen once in CI.)
        late = d.client("late", timeout=30.0)
        wait_until(late.ping, timeout=5.0, what="a newcomer of another process let in")
        assert time.monotonic() - banned_at < 9.0  # the ban (10 s) still in force: it was screened in
        assert late.stats()["peers"]["connected"] <= 6
    finally:
        bomber.kill()
        bomber.wait(30)
    assert d.proc.poll() is None


def _served_on(good) -> None:
    """The other client is answered twenty times in a row. Over the memory
    ceiling the gate may shed its idle connection (gate rule 3: a reconnect,
    and a call in flight then is a miss), and memory may stay over for a
    while after the ban, as libzmq frees what the bombs held (longer on a
    busy machine: seen in a run beside other tests), so the streak is asked
    for until it comes."""
    wait_until(lambda: all(good.ping() for _ in range(20)), what="the other client answered twenty times in a row")


def _held(watcher) -> int:
    """Connections held for banned processes so far (0 while the daemon does not answer)."""
    stats = watcher.stats()
    return 0 if stats is None else stats["peers"]["held_banned"]


# One bomb of F empty frames after another, each on a new connection, on T
# threads (default 1), until killed; with "served", first one request
# answered on a connection kept open throughout.
REBOMB = ZMTP + r"""
import sys, threading
path, f, header = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])
threads = int(sys.argv[4]) if len(sys.argv) > 4 else 1
bomb = zmtp_bomb(header, f)
if sys.argv[5:] == ["served"]:
    kept, kept_r = zmtp_connect(path)
    kept.sendall(bytes([0, len(header)]) + header)
    assert zmtp_reply(kept_r) in ("PING", "PONG"), "not served"

def loop():
    while True:
        try:
            s, r = zmtp_connect(path)
            s.sendall(bomb)
            zmtp_reply(r)
            s.close()
        except OSError:
            pass

for _ in range(threads):
    threading.Thread(target=loop, daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""


def test_a_bomber_that_keeps_a_connection_served_is_banned_all_the_same(daemon_factory):
    """A process with a request read on a connection still open is spared a
    strike for memory (a client's idle connection may be the one shed), but
    a few times a minute at most: one that keeps a connection served while
    it bombs on others is struck after that, banned, and held."""
    d = daemon_factory("--ram-mb", "16", "--max-message-mb", "16", "--data-dir", "none")
    path = d.endpoint[len("ipc://"):]
    good = d.client("good", timeout=30.0)
    assert good.ping()
    watcher = d.client("watch", timeout=5.0)
    bomber = subprocess.Popen([sys.executable, "-c", REBOMB, path, str(FRAMES), PING, "1", "served"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert bomber.stdout.readline().strip() == "ready"
        # (within the minute that spares count in: one bomb takes ~0.3 s here)
        wait_until(lambda: _held(watcher) >= 1, timeout=50, what="the bomber's connection held")
        p = peer_stats(d)
        # Spared twice (six times for bombs no longer sending when shed), then struck twice: banned.
        assert p["spared_for_memory"] <= 6 and p["struck_for_memory"] >= 2 and p["bans"] >= 1, p
        _served_on(good)
    finally:
        bomber.kill()
        bomber.wait(30)
    assert d.proc.poll() is None


def test_a_swarm_of_bombs_from_one_process_is_banned_and_its_threads_held(daemon_factory):
    """32 threads of one process, each bombing on connections of its own:
    what the watchdog frees of one, the others refill, so memory never falls
    after a shed. Several of its connections shed in one step, each inside
    its first message, strike it at once (gate rule 9); banned, its silent
    connections are shed and its threads each wait on a held connection
    (the hold is a sixteenth of the fd limit). Another client is answered."""
    d = daemon_factory("--ram-mb", "16", "--max-message-mb", "16", "--data-dir", "none")
    path = d.endpoint[len("ipc://"):]
    good = d.client("good", timeout=30.0)
    assert good.ping()
    watcher = d.client("watch", timeout=30.0)  # not strict: before the ban a new connection may wait past connect_wait
    bomber = subprocess.Popen([sys.executable, "-c", REBOMB, path, str(FRAMES), PING, "32"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert bomber.stdout.readline().strip() == "ready"
        wait_until(lambda: _held(watcher) >= 32, timeout=120, what="every thread's connection held")
        p = peer_stats(d)
        assert p["bans"] >= 1 and p["struck_for_memory"] >= 2, p
        _served_on(good)
        assert peer_stats(d)["held_banned"] == p["held_banned"]  # each thread waits on its held connection
    finally:
        bomber.kill()
        bomber.wait(30)
    assert d.proc.poll() is None


# Two frame bombs on one connection (banned at the second: it prints the two
# answers), then, for each number N read from stdin, N more connections to
# the socket, kept open and never greeted (non-blocking: those the listen
# backlog has no room for fail); prints how many it holds.
BANNED_FLOOD = ZMTP + r"""
import socket, sys
path, f, header = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])
bomb = zmtp_bomb(header, f)
s, r = zmtp_connect(path)
print(" ".join(zmtp_bombs(s, r, bomb, 2)), flush=True)
held = []
for line in sys.stdin:
    for _ in range(int(line)):
        c = socket.socket(socket.AF_UNIX)
        c.setblocking(False)
        try:
            c.connect(path)
        except OSError:
            c.close()
            continue
        held.append(c)
    print(len(held), flush=True)
"""
