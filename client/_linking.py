"""Which shared-memory link a client's call uses, and when it lets go of one.

A link (kvd_client._shm.Link: the daemon run's segments mapped, its proof) is
shared by every client of a process talking to the same daemon run. A client
takes it at the first call that may use shared memory, after the HELLO that
offered it; and lets go of it when:

- the daemon refuses its proof (a restarted daemon: the run is over for every
  client of the process, its segments unmapped now);
- a segment could not be opened or mapped (only this client lets go, and uses
  frames for SHM_COOL_S: a client that can never open the daemon's segments,
  no /proc or a sandbox, would otherwise take a grant it cannot fill at every
  PUT);
- the process forked (the child forgets its parent's link: its locks may be
  held by a thread the child has not).

`Linking` is `Core`'s side of it (a mixin); it uses the client's `transport`,
`_curve`, `_closed`, `_features`, `counters`, `_hello_now` and
`_forget_daemon`, and the `_shm_*` fields `Core.__init__` sets.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from kvd.protocol.errors import KvdError
from kvd_client import _shm
from kvd_client._transport import fork_lock

log = logging.getLogger("kvd_client")

SHM_COOL_S = 30.0  # frames only, after a segment could not be opened or mapped (Linking._shm_broke)


class Linking:
    """See the module docstring."""

    def _link(self, *, background: bool = False) -> _shm.Link | None:
        """The shared-memory link to use now, or None for frames."""
        if self.transport == "frames" or self._curve is not None or self._closed:
            return None
        self._shm_forked()
        with self._shm_lock:
            stale = self._shm_link
            if stale is not None and stale.closed:
                # Closed by another client of this process, which found the run
                # ended (a restarted daemon's runs are in new folders): forget
                # the offer too, and ask HELLO for the daemon's current one.
                _shm.release(stale, self)
                self._shm_offer = self._shm_link = None
            else:
                stale = None
        if stale is not None:
            self._forget_daemon()
        if self._features is None:  # one HELLO learns the offer
            self._hello_now(background=background)
        if time.monotonic() < self._shm_cool_until:
            return None  # a segment could not be mapped lately: frames for a while (_shm_broke)
        with self._shm_lock:
            if self._closed:  # (closed by another thread meanwhile: it would never let go of a link taken now)
                return None
            if self._shm_link is None and self._shm_offer:
                try:
                    self._shm_link = _shm.shared(self._shm_offer, self)  # one per daemon run in a process
                except (OSError, KvdError) as err:  # another user's daemon, a folder gone
                    self.counters["shm_unavailable"] += 1
                    log.debug("shared memory unavailable: %s", err)
                    self._shm_offer = None
            return self._shm_link

    def _shm_forked(self) -> None:
        """In a child after fork, forget its parent's link: its locks may be
        held by a thread the child has not (its premapper's), and that thread
        is not the child's."""
        if self._shm_pid != os.getpid():
            with fork_lock():  # the child's first callers: one remakes, the others see it made
                if self._shm_pid != os.getpid():
                    self._shm_lock, self._shm_link = threading.Lock(), None
                    self._shm_pid = os.getpid()

    def _shm_broke(self, link: _shm.Link) -> None:
        """After a call the plane could not serve: if a segment could not be
        opened or mapped (not a lease running out), use frames for
        SHM_COOL_S. A client that can never open the daemon's segments (no
        /proc, a sandbox) would otherwise take a grant it cannot fill, lost
        to everyone until its lease ends, at every PUT."""
        if link.broken:
            # (Taken back: the link may be shared, and another client's later
            # failure is no sign that it cannot open segments.)
            link.broken = False
            self._shm_cool_until = time.monotonic() + SHM_COOL_S
            self.counters["shm_cooling"] += 1

    def _shm_reset(self, link: _shm.Link, *, ended: bool = True) -> None:
        """Forget `link` and ask HELLO again on the next call; nothing if
        another thread has replaced it already (the new one stays). `ended`:
        the daemon refused its proof (a restarted daemon), so the run is over
        for every client of this process, and its segments are unmapped now,
        their memory freed; else (a segment this call could not map) only this
        client lets go of the link, which the others keep using."""
        with self._shm_lock:
            if self._shm_link is not link:
                return
            if self._shm_link is not None:
                if ended:
                    self._shm_link.close()
                _shm.release(self._shm_link, self)
            self._shm_offer, self._shm_link = None, None
        self._forget_daemon()
