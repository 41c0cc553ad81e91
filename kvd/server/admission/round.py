"""The sockets the serving loop takes its next message from (daemon rule 7).

The loop's poll says which sockets have a message waiting; `Round`, called,
takes one message from each in turn, so a lane's client waits behind no other
socket's backlog. While the loop serves a run of requests (up to 64 before it
polls again), a socket that becomes readable would wait for the run's end:
with four writers whose lanes each have a next request as soon as their reply
goes out, a GET sent meanwhile on another lane waited for all of them
(bench_stress's put-storm). So before each request is served the loop looks
again (`refresh`, a poll that does not wait) and the new sockets join the
round; their reads then go first (kvd.server.admission.ready).

Looking again costs a poll of every socket: ~6 us with a few lanes, ~0.6 ms
with a thousand. It is done at most every REPOLL_S, and never sooner than ten
times the last poll's cost after it: at most a tenth of the loop's time,
however many lanes there are.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import zmq

# How soon the loop looks again for sockets that became readable (an idle
# daemon's loop has just polled).
REPOLL_S = 0.0002


class Round:
    """The sockets with a message waiting, as the loop's poll found them;
    called, the next message from each in turn (a lane's client waits behind
    no other socket's backlog), zmq.Again when none has one. `refresh` joins
    the sockets that became readable since. `daemon`: the Daemon whose
    sockets these are (its `_recv`, lanes and lent main socket)."""

    def __init__(self, daemon: Any, poller: zmq.Poller, clock: Callable[[], float] = time.monotonic):
        self.d, self.poller, self.clock = daemon, poller, clock
        self.waiting: list[zmq.Socket] = []
        self.polled = 0.0  # when the poller last looked
        self.gap = REPOLL_S  # how long after that `refresh` looks again

    def poll(self, timeout_ms: int) -> dict:
        """The loop's poll: its events; the sockets among them wait their turn."""
        events = dict(self.poller.poll(timeout_ms))
        self.polled = self.clock()
        self.waiting[:] = [s for s in events if isinstance(s, zmq.Socket)]  # (not the wakeup's fd)
        return events

    def refresh(self) -> None:
        """Look again, without waiting, for sockets that became readable.
        Not while the main socket is lent (drain.Lent: another thread reads
        it, and a poll touches it too); and lanes closed during this run
        leave the poller first (a closed socket polls as fd 0: stdin)."""
        now = self.clock()
        if now - self.polled < self.gap or self.d._lent is not None:
            return
        self.d._sync_lanes(self.poller)
        events = self.poller.poll(0)
        self.polled = self.clock()
        # A poll costs ~0.6 us a socket: with a thousand lanes, ~0.6 ms. Looking
        # again takes at most a tenth of the loop's time, whatever their number.
        self.gap = max(REPOLL_S, 10 * (self.polled - now))
        present = set(self.waiting)
        for s, _ in events:
            if isinstance(s, zmq.Socket) and s not in present:
                self.waiting.append(s)

    def __call__(self) -> list[zmq.Frame]:
        d, waiting = self.d, self.waiting
        while waiting:
            s = waiting.pop(0)
            if s.closed or (s is d._sock and d._lent is not None):  # a lane closed meanwhile; the main socket lent
                continue
            lane = d.lanes.by_sock.get(s) if d.lanes is not None else None
            if lane is not None and lane.doomed:
                continue  # a bomb's lane, closed soon: the rest of its message is never read (kvd.server.lanes)
            try:
                raw = d._recv(s)
            except zmq.Again:
                continue
            lane = d.lanes.by_sock.get(s) if d.lanes is not None else None
            if lane is None or not lane.doomed:
                waiting.append(s)
            if d._lent is not None and s is not d._sock:
                d.read_while_lent += 1
            return raw
        raise zmq.Again()
