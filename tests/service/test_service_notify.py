"""kvd.service.notify against a real AF_UNIX datagram socket, as systemd listens."""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile

import pytest

from kvd.service.notify import Notifier

pytestmark = pytest.mark.skipif(not hasattr(socket, "AF_UNIX"), reason="needs unix sockets")


@pytest.fixture
def listener():
    """A bound datagram socket standing in for systemd's notify socket."""
    d = tempfile.mkdtemp(prefix="kvdn-", dir="/tmp")  # short: sun_path is ~107 bytes
    path = os.path.join(d, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2)
    yield sock, path
    sock.close()
    os.unlink(path)
    os.rmdir(d)


def recv_all(sock: socket.socket) -> list[str]:
    out = []
    sock.setblocking(False)
    try:
        while True:
            out.append(sock.recv(4096).decode())
    except BlockingIOError:
        pass
    finally:
        sock.settimeout(2)
    return out


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_disabled_without_notify_socket():
    n = Notifier.from_env({})
    n.ready("x"), n.status("y"), n.tick(), n.stopping()  # all no-ops
    assert n.notify(ready=1) is False
    # A watchdog without a socket to ping is no watchdog.
    assert Notifier.from_env({"WATCHDOG_USEC": "1000000"}).notify(watchdog=1) is False


def test_ready_status_stopping_datagrams(listener):
    sock, path = listener
    n = Notifier.from_env({"NOTIFY_SOCKET": path})
    n.ready()
    assert sock.recv(4096) == b"READY=1"
    n.ready("serving ipc:///x")
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving ipc:///x"
    n.status("two\nlines")
    assert sock.recv(4096) == b"STATUS=two lines"
    n.stopping()
    assert sock.recv(4096) == b"STOPPING=1"
    n.tick()  # no watchdog: sends nothing
    assert recv_all(sock) == []
    n.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract namespace is Linux-only")
def test_abstract_namespace_address():
    name = f"kvd-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2)
    try:
        Notifier.from_env({"NOTIFY_SOCKET": "@" + name}).ready()
        assert sock.recv(4096) == b"READY=1"
    finally:
        sock.close()


def test_watchdog_pings_every_third_of_the_period(listener):
    sock, path = listener
    clock = FakeClock()
    n = Notifier(path, 3_000_000, clock=clock)  # WatchdogSec=3
    n.tick()
    assert recv_all(sock) == ["WATCHDOG=1"]  # the first tick pings at once
    sent = 0
    for _ in range(100):  # 10 s of ticks every 100 ms
        clock.now += 0.1
        n.tick()
        sent += len(recv_all(sock))
    assert sent == 10  # one ping per second, i.e. per third of 3 s
    clock.now += 0.5
    n.tick()
    assert recv_all(sock) == []


def test_watchdog_env_and_pid(listener):
    sock, path = listener
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000"}

    def pings(environ) -> list[str]:
        Notifier.from_env(environ).tick()  # a first tick pings at once, if there is a watchdog
        return recv_all(sock)

    assert pings(env) == ["WATCHDOG=1"]
    assert pings({**env, "WATCHDOG_PID": str(os.getpid())}) == ["WATCHDOG=1"]
    # The watchdog belongs to another process (e.g. a wrapper that exec'd us was not us).
    assert pings({**env, "WATCHDOG_PID": str(os.getpid() + 1)}) == []
    assert pings({**env, "WATCHDOG_USEC": "soon"}) == []
    assert pings({**env, "WATCHDOG_USEC": "0"}) == []


def test_socket_errors_are_logged_once_and_never_raised(tmp_path, caplog):
    n = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens"), "WATCHDOG_USEC": "1"})
    with caplog.at_level(logging.DEBUG, logger="kvd.service.notify"):
        n.ready()
        n.tick()
        n.status("x")
        n.stopping()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "sd_notify" in warnings[0].getMessage()


def test_unsupported_address_disables(caplog):
    with caplog.at_level(logging.WARNING, logger="kvd.service.notify"):
        n = Notifier.from_env({"NOTIFY_SOCKET": "vsock:2:1234"})
    assert n.notify(ready=1) is False
    assert "not a unix socket address" in caplog.text


def test_tick_is_cheap():
    import time

    n = Notifier("/nonexistent", 3_600_000_000)  # one hour: only the first tick sends
    n.tick()
    t0 = time.perf_counter()
    for _ in range(100_000):
        n.tick()
    assert (time.perf_counter() - t0) / 100_000 < 20e-6
