"""The real `kvd serve` under a stand-in systemd: readiness and watchdog over NOTIFY_SOCKET.

Like systemd with Type=notify and WatchdogSec=, the test binds a datagram
socket, starts the daemon with NOTIFY_SOCKET and WATCHDOG_USEC set, and checks:
READY=1 comes once the daemon answers, WATCHDOG=1 keeps coming from the main
loop, a stopped (wedged) daemon stops pinging, and STOPPING=1 comes on SIGTERM.
"""

from __future__ import annotations

import inspect
import os
import signal
import socket
import time

import pytest

from kvd_client import Client

# 1.2 s: pings every 0.4 s. The worst gap is a third of the period plus one
# main-loop tick (0.1 s), so the period must exceed 6 ticks to stay under half.
WATCHDOG_USEC = 1_200_000


def _serve_sends_notifications() -> bool:
    import kvd.cli.serve

    return "Notifier" in inspect.getsource(kvd.cli.serve)


pytestmark = [
    pytest.mark.skipif(not hasattr(socket, "AF_UNIX"), reason="needs unix sockets"),
    pytest.mark.skipif(not _serve_sends_notifications(),
                       reason="kvd serve does not use kvd.service.notify.Notifier yet"),
]


class NotifyListener:
    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.path = path

    def next(self, timeout: float) -> str | None:
        """The next datagram, or None if none arrives within `timeout` seconds."""
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(4096).decode()
        except (socket.timeout, BlockingIOError):
            return None

    def collect(self, seconds: float) -> list[str]:
        out, deadline = [], time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            msg = self.next(left)
            if msg is not None:
                out.append(msg)
        return out

    def wait_for(self, field: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            msg = self.next(left)
            if msg is not None and field in msg.split("\n"):
                return msg
        raise AssertionError(f"no {field} within {timeout} s")

    def close(self):
        self.sock.close()


@pytest.fixture
def notified_daemon(daemon_factory):
    d = daemon_factory("--ram-mb", "64", start=False)
    listener = NotifyListener(str(d.workdir / "notify"))
    d.env.update(NOTIFY_SOCKET=listener.path, WATCHDOG_USEC=str(WATCHDOG_USEC))
    d.env.pop("WATCHDOG_PID", None)
    d.start(wait=False)
    yield d, listener
    if d.proc is not None and d.proc.poll() is None:
        d.proc.send_signal(signal.SIGCONT)
    listener.close()


def test_ready_only_when_answering_then_watchdog_then_stopping(notified_daemon):
    d, listener = notified_daemon
    ready = listener.wait_for("READY=1", timeout=20)
    # READY=1 means "clients can use me now": the very next ping must be answered.
    with Client(d.endpoint, namespace="probe", timeout=2.0) as c:
        assert c.ping() is not None, d.log()
    assert any(line.startswith("STATUS=") for line in ready.split("\n")) or ready == "READY=1"

    # Pings from the main loop: about every WATCHDOG_USEC/3, always under WATCHDOG_USEC/2.
    msgs = listener.collect(2.0)
    pings = [m for m in msgs if "WATCHDOG=1" in m.split("\n")]
    assert len(pings) >= 4, msgs

    # A wedged daemon (SIGSTOP) stops pinging, so systemd would kill and restart it.
    os.kill(d.proc.pid, signal.SIGSTOP)
    listener.collect(0.1)  # drop what was already in flight
    assert [m for m in listener.collect(1.5) if "WATCHDOG=1" in m] == []
    os.kill(d.proc.pid, signal.SIGCONT)
    listener.wait_for("WATCHDOG=1", timeout=2)

    d.proc.send_signal(signal.SIGTERM)
    listener.wait_for("STOPPING=1", timeout=10)
    assert d.proc.wait(10) == 0


def test_watchdog_gap_stays_under_half_the_period(notified_daemon):
    d, listener = notified_daemon
    listener.wait_for("READY=1", timeout=20)
    # Keep the daemon busy with pings while timing the watchdog datagrams.
    stamps, deadline = [], time.monotonic() + 3.0
    with Client(d.endpoint, namespace="load", timeout=2.0) as c:
        while time.monotonic() < deadline:
            c.ping()
            msg = listener.next(0)
            while msg is not None:
                if "WATCHDOG=1" in msg.split("\n"):
                    stamps.append(time.monotonic())
                msg = listener.next(0)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert len(stamps) >= 6 and max(gaps) < WATCHDOG_USEC / 1e6 / 2, (gaps, d.log())
