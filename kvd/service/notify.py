"""systemd readiness and watchdog notifications, in plain Python.

Theory of operation
-------------------
A service started with `Type=notify` gets `$NOTIFY_SOCKET`, the address of a
datagram socket the service manager reads. Each notification is one datagram
of newline-separated `KEY=value` lines (sd_notify(3)). A leading `@` in the
address means the Linux abstract namespace (a NUL byte on the wire). With
`WatchdogSec=` the manager also sets `$WATCHDOG_USEC` (and `$WATCHDOG_PID`),
and kills the service if no `WATCHDOG=1` arrives within that many microseconds.

Rules this module keeps:
1. No NOTIFY_SOCKET, no work: `Notifier.from_env` returns a notifier whose
   methods do nothing, so the daemon calls them unconditionally.
2. A watchdog whose WATCHDOG_PID names another process is not ours: ignored.
3. `tick()` pings when a third of the watchdog period has passed since the last
   ping, so the longest gap is a third of the period plus one main-loop tick:
   with ticks every <=100 ms and WatchdogSec= of a second or more, that is
   under half the period, as systemd advises. Otherwise `tick()` is one clock
   read and one comparison.
4. Pings come from the main loop on purpose: a wedged loop stops pinging and
   systemd restarts the daemon. Never ping from a helper thread.
5. Socket errors never reach the daemon: the first is logged as a warning,
   later ones at debug level; the send is non-blocking so a full manager
   queue cannot stall the loop.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Callable, Mapping

log = logging.getLogger(__name__)


def _address(raw: str) -> str | bytes | None:
    """Return a connectable AF_UNIX address for $NOTIFY_SOCKET, or None."""
    if raw.startswith("@"):
        return b"\0" + raw[1:].encode()
    if raw.startswith("/"):
        return raw
    return None  # e.g. vsock: addresses of VM managers; not supported here


class Notifier:
    """Sends sd_notify messages; every method is a no-op when disabled."""

    def __init__(
        self,
        address: str | bytes | None = None,
        watchdog_usec: int | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._address = address
        self._clock = clock
        self._sock: socket.socket | None = None
        self._warned = False
        # Ping every third of the period; None means no watchdog.
        self._every = watchdog_usec / 3e6 if watchdog_usec else None
        self._last_ping = float("-inf")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Notifier":
        """Return a Notifier for $NOTIFY_SOCKET / $WATCHDOG_USEC / $WATCHDOG_PID.

        Returns a disabled (no-op) notifier when NOTIFY_SOCKET is unset or not
        a unix socket address. Never raises.
        """
        raw = environ.get("NOTIFY_SOCKET", "")
        address = _address(raw) if raw else None
        if raw and address is None:
            log.warning("NOTIFY_SOCKET=%r is not a unix socket address; not notifying", raw)
        usec = None
        try:
            usec = int(environ.get("WATCHDOG_USEC", "") or 0) or None
            pid = environ.get("WATCHDOG_PID")
            if pid and int(pid) != os.getpid():
                usec = None
        except ValueError:
            log.warning("ignoring malformed WATCHDOG_USEC/WATCHDOG_PID")
            usec = None
        return cls(address, usec if address is not None else None)

    def notify(self, **fields: object) -> bool:
        """Send one datagram of KEY=value lines; return True if it was sent.

        Keys are upper-cased field names (`notify(status="x")` sends STATUS=x).
        Returns False when disabled or on a socket error (never raises).
        """
        if self._address is None:
            return False
        payload = "\n".join(f"{k.upper()}={v}" for k, v in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # (Python's sockets are close-on-exec already)
            self._sock.sendto(payload, socket.MSG_DONTWAIT, self._address)
            return True
        except OSError as exc:
            level = logging.DEBUG if self._warned else logging.WARNING
            log.log(level, "sd_notify to %r failed: %s", self._address, exc)
            self._warned = True
            return False

    def ready(self, status: str = "") -> None:
        """Tell the manager the daemon is ready (READY=1), with an optional STATUS."""
        if status:
            self.notify(ready=1, status=status)
        else:
            self.notify(ready=1)

    def status(self, text: str) -> None:
        """Set the one-line status shown by `systemctl status` (STATUS=)."""
        self.notify(status=text.replace("\n", " "))

    def stopping(self, status: str = "") -> None:
        """Tell the manager the daemon is shutting down (STOPPING=1)."""
        if status:
            self.notify(stopping=1, status=status)
        else:
            self.notify(stopping=1)

    def tick(self) -> None:
        """Send WATCHDOG=1 if a third of the watchdog period passed since the last one.

        Cheap when there is nothing to send; call it often from the main loop.
        """
        if self._every is None:
            return
        now = self._clock()
        if now - self._last_ping >= self._every:
            self._last_ping = now
            self.notify(watchdog=1)

    def close(self) -> None:
        """Close the socket (a later notification reopens it)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
