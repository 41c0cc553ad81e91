"""The client against real daemons that restart, stall or change limits, and
across os.fork(): every public call still misses or answers exactly, within
its `timeout` (plus a margin), and never raises.

Faults are real: daemons killed and started again, stopped with SIGSTOP and
continued with SIGCONT by a timer thread. Hooks on the client only time them
(after the first GET page; as each request is sent).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

import numpy as np
import pytest
import zmq

from kvd_client import HostTensor, Snapshot
from kvd_client._breaker import Breaker

LOG = logging.getLogger("kvd_client.test_client_faults")
TO = 1.0  # the client timeout of the timing tests
STALL = 0.8 * TO  # how long the daemon is stopped as each request is sent


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, size=n).tolist()


def _snap(n: int, width: int, seed: int) -> Snapshot:
    """About 4 * width bytes per token: k float16 and v bfloat16, (1, 2, n, width)."""
    rng = np.random.default_rng(seed)
    k = rng.integers(0, 65535, size=(1, 2, n, width), dtype=np.uint16).view(np.float16)
    v = rng.integers(0, 65535, size=(1, 2, n, width), dtype=np.uint16)
    return Snapshot(sliced={"k": (HostTensor.from_numpy(k), 2), "v": (HostTensor.bfloat16(v), 2)}, meta={"x": 1})


def _exact(hit, snap: Snapshot, n: int) -> bool:
    if hit is None or hit.n != n:
        return False
    for name, (want, _) in snap.sliced.items():
        got = hit.sliced[name]
        if got.dtype != want.dtype:
            return False
        if got.array.view(np.uint8).tobytes() != np.ascontiguousarray(want.array[:, :, :n]).view(np.uint8).tobytes():
            return False
    return True


# -- 1. a restart between two pages of a shared-memory GET ---------------------


def test_daemon_restarted_between_two_shm_get_pages_is_exact_not_a_crash(daemon_factory):
    d = daemon_factory("--ram-mb", "64", "--max-message-mb", "1", "--write-through")
    toks, snap = _tokens(4096, 1), _snap(4096, 128, 1)  # 4 MiB: six pages under 1 MiB
    c = d.client("restart-pages", timeout=20.0)  # the restart itself is timed inside the call
    assert c.put(toks, snap) and c.counters["shm_puts"] >= 1  # maps the segments page 1 is served from
    real_call, pages = c._call, []

    def call(mtype, fields=None, timeout=None, **kw):
        reply = real_call(mtype, fields, timeout, **kw)
        if mtype == "GET":
            pages.append(None if reply is None else reply.get("shm"))
            if len(pages) == 1:
                d.kill()  # -9: the new daemon refuses page 1's proof; its data dir serves the rest
                d.start()
                # ZeroMQ reconnects by itself (back-off up to 0.5 s); until then a request fails fast.
                assert c._transport._sock.poll(5000, zmq.POLLOUT)
        return reply

    c._call = call
    hit = c.get(toks)
    assert len(pages) > 2 and pages[0] is not None and pages[0].get("lease") is not None  # page 1: a shm lease
    assert all(p is None for p in pages[1:])  # the others: frames, from the new daemon
    assert _exact(hit, snap, 4096)
    c._call = real_call
    assert _exact(c.get(toks), snap, 4096)
    assert c.counters["shm_gets"] == 2  # a new link to the new daemon
    c.close()


# -- 2. one budget per public call ---------------------------------------------


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


class Stall:
    """Stops the daemon as each request is sent, and continues it STALL s later
    (a timer thread): a daemon that answers every request, slowly."""

    def __init__(self, proc):
        self.pid = proc.pid
        self.requests = 0
        self.timers: list[threading.Timer] = []

    def hook(self, request):
        def slow(mtype, fields, timeout):
            self.requests += 1
            os.kill(self.pid, signal.SIGSTOP)
            if os.path.exists(f"/proc/{self.pid}/stat"):
                deadline = time.monotonic() + 5
                while _state(self.pid) not in ("T", "t") and time.monotonic() < deadline:
                    time.sleep(0.001)
            timer = threading.Timer(STALL, os.kill, (self.pid, signal.SIGCONT))
            self.timers.append(timer)
            timer.start()
            return request(mtype, fields, timeout)

        return slow

    def end(self) -> None:
        for t in self.timers:
            t.join()
        os.kill(self.pid, signal.SIGCONT)


@pytest.fixture
def slow_daemon(daemon_factory):
    return daemon_factory("--ram-mb", "64", "--max-message-mb", "1")


@pytest.mark.parametrize("transport", ["frames", "shm"])
def test_a_many_page_get_from_a_slow_daemon_ends_within_its_timeout(slow_daemon, transport):
    toks, snap = _tokens(4096, 3), _snap(4096, 128, 3)  # six pages
    with slow_daemon.client("slow-get", timeout=TO, transport=transport) as c:
        assert c.put(toks, snap) and _exact(c.get(toks), snap, 4096)
        clock = [1000.0]
        breaker = Breaker(slow_daemon.endpoint, TO, namespace="slow-get", clients=lambda: [c], fallback="nothing",
                          log=LOG, clock=lambda: clock[0])
        stall = Stall(slow_daemon.proc)
        c._transport.request = stall.hook(c._transport.request)
        t0 = time.monotonic()
        try:
            hit = c.get(toks)
            took = time.monotonic() - t0
        finally:
            stall.end()
        assert hit is None and took < 2 * TO, f"get took {took:.2f}s over {stall.requests} requests"
        # It answered every request it had time for: a miss, not an outage.
        assert c.counters["error_out_of_time"] == 1 and c.counters["error_unavailable"] == 0
        breaker.check()
        assert not breaker.down
        del c._transport.request
        assert _exact(c.get(toks), snap, 4096)  # continued: served again


@pytest.mark.parametrize("transport", ["frames", "shm"])
def test_a_many_batch_put_to_a_slow_daemon_ends_within_its_budget(slow_daemon, transport):
    toks, snap = _tokens(4096, 31), _snap(4096, 128, 31)  # 4 MiB: five PUT batches under 1 MiB over frames
    budget = TO + snap.nbytes / 2**28
    with slow_daemon.client("slow-put", timeout=TO, transport=transport) as c:
        assert c.hello() is not None
        stall = Stall(slow_daemon.proc)
        c._transport.request = stall.hook(c._transport.request)
        t0 = time.monotonic()
        try:
            ok = c.put(toks, snap)
            took = time.monotonic() - t0
        finally:
            stall.end()
        assert ok is False and took < budget + TO, f"put took {took:.2f}s over {stall.requests} requests"
        assert c.counters["put_not_stored"] == 1 and c.counters["error_unavailable"] == 0
        del c._transport.request
        assert c.put(toks, snap) and _exact(c.get(toks), snap, 4096)


# -- 2b. the daemon gone with a request in flight ------------------------------


@pytest.mark.parametrize("how", ["kill", "term"])
def test_a_request_in_flight_when_the_daemon_goes_misses_at_once_not_at_its_timeout(daemon_factory, how):
    """The daemon is stopped (SIGSTOP) as the request is sent, then killed
    (-9), or told to stop (SIGTERM) and continued, before it answers: the
    call misses as soon as the connection drops, not at its 30 s timeout
    (a model server's request in flight across a restart of kvd)."""
    d = daemon_factory("--ram-mb", "64", "--write-through")  # the PUT outlives -9
    toks, snap = _tokens(512, 60), _snap(512, 64, 60)
    with d.client("gone", timeout=30.0) as c:
        assert c.put(toks, snap) and _exact(c.get(toks), snap, 512)
        # The request goes on the client's lane when it has one (kvd.server.lanes).
        used = c._transport._lane or c._transport
        pid, real_request, real_await = d.proc.pid, c._transport.request, used._await_reply

        def request(mtype, fields, timeout):
            os.kill(pid, signal.SIGSTOP)
            while _state(pid) not in ("T", "t"):
                time.sleep(0.001)
            return real_request(mtype, fields, timeout)

        def await_reply(sock, deadline):  # the request is sent; the daemon has not read it
            if how == "kill":
                os.kill(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGTERM)
                os.kill(pid, signal.SIGCONT)
            return real_await(sock, deadline)

        c._transport.request, used._await_reply = request, await_reply
        t0 = time.monotonic()
        hit = c.get(toks)
        took = time.monotonic() - t0
        del c._transport.request, used._await_reply
        d.proc.wait(10)
        # SIGTERM may let it answer first (then the hit is exact); -9 never does.
        assert took < 10.0, f"the call waited {took:.1f}s for a daemon that was gone"
        if how == "kill" or hit is None:
            assert hit is None and c.counters["error_unavailable"] == 1, c.counters
        else:
            assert _exact(hit, snap, 512)
        d.start()
        # A socket kept (SIGTERM let the reply through) reconnects by itself, with
        # ZeroMQ's back-off (up to 0.5 s); a reset one connects at the next call.
        assert c._transport._sock is None or c._transport._sock.poll(5000, zmq.POLLOUT)
        assert _exact(c.get(toks), snap, 512)  # the restarted daemon: served again, from its data dir


# -- 3. a restart with a smaller message limit ---------------------------------


def test_a_daemon_restarted_with_a_smaller_message_limit_is_stored_to_again(daemon_factory):
    d = daemon_factory("--ram-mb", "64", "--max-message-mb", "8")
    with d.client("limits", timeout=5.0, transport="frames") as c:
        assert c.put(_tokens(2048, 40), _snap(2048, 1024, 40))  # 8 MiB-limit batches; limits cached
        assert c.limits().max_message_bytes == 8 << 20
        d.stop()
        d.args = ["--ram-mb", "64", "--max-message-mb", "1"]
        d.start()
        assert c._transport._sock.poll(5000, zmq.POLLOUT)  # reconnected (ZeroMQ's back-off: up to 0.5 s)
        stored = []
        for i in range(3):
            toks, snap = _tokens(2048, 41 + i), _snap(2048, 256, 41 + i)  # 4 MiB, 256 KiB a chunk
            stored.append(c.put(toks, snap))
            if stored[-1]:
                assert _exact(c.get(toks), snap, 2048)
        # The first may be refused (TOO_LARGE: the client cannot know before it); never the next.
        assert stored[1:] == [True, True], stored
        assert c.limits().max_message_bytes == 1 << 20


# -- 4. a client used across os.fork() -----------------------------------------


def test_a_client_used_in_a_forked_child_answers_within_its_timeout(kvd_daemon):
    toks, snap = _tokens(512, 16), _snap(512, 64, 16)
    c = kvd_daemon.client("fork", timeout=TO)
    assert c.put(toks, snap) and _exact(c.get(toks), snap, 512)  # sockets made and used before the fork
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave, never return into pytest
        code = 1
        try:
            os.close(r)
            t0 = time.monotonic()
            result = {"exact": _exact(c.get(toks), snap, 512), "ping": c.ping() is not None,
                      "took": time.monotonic() - t0}
            os.write(w, json.dumps(result).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + 10 * TO
    while os.waitpid(pid, os.WNOHANG)[0] == 0:
        if time.monotonic() > deadline:  # hung: the old client blocked in poll() for ever
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.02)
    with os.fdopen(r, "rb") as f:
        report = f.read()
    assert report, "the child hung or died without answering"
    result = json.loads(report)
    assert result["exact"] and result["ping"] and result["took"] < 2 * TO, result
    assert _exact(c.get(toks), snap, 512)  # the parent's client is untouched
    c.close()


def test_a_segment_unmapped_by_another_thread_is_a_miss_not_a_crash(tmp_path):
    """Red-team suspicion: one thread's retain() (an older reply's segment list)
    can close a mapping another thread has just looked up, before it takes its
    view. The view then met a closed mmap: ValueError, out of the non-strict get."""
    import mmap
    import os

    from kvd.protocol.shm import Descriptor, segment_name
    from kvd_client import _shm

    folder = tmp_path / "plane"
    folder.mkdir(mode=0o700)
    (folder / "nonce").write_bytes(os.urandom(32))
    (folder / segment_name("0123abcd", 0)).write_bytes(bytes(8192))
    link = _shm.Link({"dir": str(folder), "run": "0123abcd", "lease_s": 30})
    assert bytes(link.view(Descriptor(0, 4096, 16))) == bytes(16)
    mm = link._segment(0, False)
    mm.close()  # what retain() on another thread does between _segment() and the view
    link._maps[0, False] = mm
    with pytest.raises(_shm.ShmUnavailable):
        link.view(Descriptor(0, 4096, 16))


def test_the_background_writer_works_in_a_forked_child_whatever_the_parent_held():
    """The writer thread is not copied by fork(), and its queue's lock is copied
    as it was: held, if the parent's writer held it at that moment. A store in
    the child then blocked the generation thread for ever."""
    from kvd_client.mlx_lm._writer import Writer

    class Snap:
        nbytes = 16

    r, w = os.pipe()
    writer = Writer(lambda tokens, snap: os.write(w, b"p") == 1, lambda name, n: None)
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:  # another thread inside the writer's lock at the fork, as the writer thread may be
        with writer._cv:
            inside.set()
            leave.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(5)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            ok = writer.submit([1, 2], Snap()) and writer.flush(2.0)
            os.write(w, b"ok" if ok else b"no")
            code = 0
        finally:
            os._exit(code)
    leave.set()
    holder.join()
    os.close(w)
    deadline = time.monotonic() + 10
    while os.waitpid(pid, os.WNOHANG)[0] == 0:
        if time.monotonic() > deadline:  # hung on the lock it inherited
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.02)
    with os.fdopen(r, "rb") as f:
        assert f.read() == b"pok"  # the child's put ran, then its flush returned
    assert writer.submit([3], Snap()) and writer.flush(2.0)  # the parent's writer is untouched
    writer.close()


def test_a_hand_out_that_trickles_its_reply_holds_no_call_past_its_bound(tmp_path):
    """Red-team (session 41): a hand-out socket (PROTOCOL.md section 15) that
    sent its reply a byte at a time, each within the per-read timeout, held
    the open for minutes; and the open ran under the link's lock, which every
    request's `field()` takes, so a GET that needed no segment waited too."""
    import socket

    from kvd_client import _shm

    folder = tmp_path / "plane"
    folder.mkdir(mode=0o700)
    (folder / "nonce").write_bytes(os.urandom(32))
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(folder / "fds"))
    server.listen(1)
    stop, asked = threading.Event(), threading.Event()

    def trickle() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(1024)
            asked.set()
            for b in b"kvd-fds/1 gone gone gone gone gone":  # no newline, ever
                if stop.wait(0.2):
                    return
                try:
                    conn.send(bytes([b]))
                except OSError:  # the client gave up
                    return

    t = threading.Thread(target=trickle)
    t.start()
    link = _shm.Link({"handout": str(folder / "fds"), "run": "0123abcd", "lease_s": 30})
    fielded, took = [], []

    def map_it() -> None:
        t0 = time.monotonic()
        try:
            with pytest.raises(_shm.ShmUnavailable, match="did not answer within|timed out"):
                link._segment(0, False)
        finally:
            took.append(time.monotonic() - t0)

    m = threading.Thread(target=map_it)
    m.start()
    assert asked.wait(5)  # the open is under way, its reply trickling
    t0 = time.monotonic()
    fielded.append(link.field())  # what every request takes: never behind an open
    assert time.monotonic() - t0 < 0.5 and fielded[0]["run"] == "0123abcd"
    m.join(10)
    stop.set()
    t.join(5)
    server.close()
    assert took and took[0] < _shm._HANDOUT_TIMEOUT_S + 0.5, took
