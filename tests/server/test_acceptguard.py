"""The accept guard (kvd/server/admission/acceptguard.py) on a real libzmq, in a process
of its own: a ROUTER whose fd table is full drops newcomers instead of
aborting and serves again once fds are free; uninstall puts libzmq's own
entries back."""

from __future__ import annotations

import select
import socket
import subprocess
import sys

import pytest
import zmq

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard is Linux's (ELF)")

CHILD = r"""
import ctypes, os, resource, sys, zmq
from kvd.server.admission import acceptguard

guard = sys.argv[2] == "guard"
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
ctx = zmq.Context()
router = ctx.socket(zmq.ROUTER)
router.bind("ipc://" + sys.argv[1])
if guard:
    assert acceptguard.install()
    slots = list(acceptguard._State.patched)
    assert slots and all(ctypes.c_void_p.from_address(s).value != v for s, v in slots)
held = []
try:
    while True:  # the table full to its last fd
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
print("ready", flush=True)
sys.stdin.readline()  # the parent has connected
for fd in held:
    os.close(fd)
print("refused", acceptguard.refused(), flush=True)
if not router.poll(10_000):
    sys.exit("nothing received")
assert router.recv_multipart()[1] == b"hi"
if guard:
    acceptguard.uninstall()
    assert all(ctypes.c_void_p.from_address(s).value == v for s, v in slots)
print("served", flush=True)
"""


def _connect_while_full(tmp_path, mode):
    """Start the child, connect 20 plain sockets while its table is full;
    returns (child, how many of them were closed on us)."""
    path = str(tmp_path / "s.sock")
    child = subprocess.Popen([sys.executable, "-c", CHILD, path, mode], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    dropped = 0
    socks = []
    try:
        assert _line(child) == "ready", child.stderr.read()
        for _ in range(20):
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(10)
            try:
                s.connect(path)
                dropped += s.recv(1) == b""
            except (ConnectionError, FileNotFoundError):
                pass  # the child is gone
            socks.append(s)
    except BaseException:
        child.kill()
        child.wait()
        raise
    finally:
        for s in socks:
            s.close()
    return child, dropped, path


def _line(child: subprocess.Popen, timeout: float = 30.0) -> str:
    """The child's next line, or fail (never a hang) after `timeout`."""
    if not select.select([child.stdout], [], [], timeout)[0]:
        raise AssertionError("the child said nothing")
    return child.stdout.readline().strip()


def test_a_full_fd_table_drops_the_newcomer_instead_of_aborting(tmp_path):
    child, dropped, path = _connect_while_full(tmp_path, "guard")
    ctx = zmq.Context()
    try:
        assert dropped == 20
        child.stdin.write("go\n")
        child.stdin.flush()
        assert _line(child).split() == ["refused", "20"]
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect("ipc://" + path)
        dealer.send(b"hi")
        out, err = child.communicate(timeout=30)
    finally:
        ctx.destroy(linger=0)
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0 and out.split() == ["served"], err


def test_without_the_guard_libzmq_aborts(tmp_path):
    """What the guard is for (libzmq 4.3.5, src/ipc_listener.cpp): if this
    ever fails, libzmq tolerates EMFILE and the guard can go."""
    child, _, _ = _connect_while_full(tmp_path, "none")
    _, err = child.communicate(timeout=30)
    assert child.returncode == -6 and "ipc_listener.cpp" in err, (child.returncode, err)


HOLD_CHILD = r"""
import os, sys, zmq
from kvd.server.admission import acceptguard

ctx = zmq.Context()
router = ctx.socket(zmq.ROUTER)
router.setsockopt(zmq.LINGER, 0)
router.bind("ipc://" + sys.argv[1])
assert acceptguard.install()
refusing = {"on": True}
acceptguard.set_refuse(lambda fd: refusing["on"])
print("ready", flush=True)
sys.stdin.readline()  # the parent's first socket has connected and sent
import time
deadline = time.monotonic() + 30
while acceptguard.held()[0] == 0 and time.monotonic() < deadline:  # libzmq's I/O thread accepts on its own schedule
    time.sleep(0.01)
print("held", *acceptguard.held(), "got", router.poll(100), flush=True)
sys.stdin.readline()
acceptguard.release(lambda fd: False)  # its ban is over
acceptguard.set_refuse(None)
print("released", *acceptguard.held(), flush=True)
sys.stdin.readline()  # the parent has connected again and sent
if not router.poll(10_000):
    sys.exit("nothing received")
print("served", router.recv_multipart()[1].decode(), flush=True)
acceptguard.uninstall()
"""


def test_a_banned_processs_connection_is_held_unread_until_its_ban_ends(tmp_path):
    """Gate rule 9 at accept: a connection the gate's `refuse` names is
    accepted by the guard and kept, never handed to libzmq (nothing it sends
    is read); released, it is closed, and the next connection is served."""
    path = str(tmp_path / "s.sock")
    child = subprocess.Popen([sys.executable, "-c", HOLD_CHILD, path], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    try:
        assert _line(child) == "ready", child.stderr.read()
        s.connect(path)
        s.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00NULL" + bytes(16) + b"\x00" + bytes(31))  # a ZMTP greeting
        child.stdin.write("go\n")
        child.stdin.flush()
        assert _line(child).split() == ["held", "1", "1", "got", "0"]
        child.stdin.write("go\n")
        child.stdin.flush()
        assert _line(child).split() == ["released", "0", "1"]
        try:
            assert s.recv(64) == b""  # closed, never greeted
        except ConnectionResetError:
            pass  # closed with our greeting unread
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect("ipc://" + path)
        dealer.send(b"hi")
        child.stdin.write("go\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=30)
    finally:
        s.close()
        ctx.destroy(linger=0)
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0 and out.split() == ["served", "hi"], err
