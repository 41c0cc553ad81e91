"""The peer gate: the connection cap, shedding, and the input allowance.

Over 600 lines: one thread's state machine, whose rules below are kept
together with the code that keeps them (the sizes it works with are in
caps.py, the sockets it handles in connections.py, the memory watchdog's
code, rules 3 and 9, in watchdog.py, the OS facts in kvd.host).

Theory of operation
-------------------
libzmq accepts connections on its own I/O thread, and on an ipc endpoint it
*aborts the process* when accept() fails with EMFILE (ipc_listener.cpp,
libzmq 4.3.5: an errno_assert that lists ENFILE but not EMFILE). So the
daemon must never let its fd table fill: it raises the soft RLIMIT_NOFILE to
the hard limit at start (`kvd.host.fds.raise_fd_limit`), and keeps the number of peer
connections at or below `max_peers`, well under that limit. On Linux the
accept guard (acceptguard.py, rule 8) is the backstop for what the gate
cannot prevent: a connection that finds no fd free is dropped, not an abort.

The gate is a thread of its own (`PeerGate`), so it reacts within
microseconds, not after the request the serving loop is busy with. It reads
the ROUTER socket's monitor (LISTENING, ACCEPTED, DISCONNECTED, CLOSED, each
with an fd) and keeps a table fd -> (accepted at, last request at).

The listener is *paused* except while the gate admits connections (or,
under a big cap, while the table is under half full: rule 5). To
pause, the gate keeps a duplicate of libzmq's listening fd and dup2()s a
private, empty listening socket over that fd number. libzmq's epoll still
watches the real listener (the registration belongs to the open file, which
the duplicate keeps alive), so when a connection is waiting libzmq calls
accept() on the fd -- which is now the empty socket: EAGAIN, which libzmq
takes in its stride (its I/O thread spins meanwhile: level-triggered epoll).
Waiting connections stay in the kernel's backlog (`listen_backlog`: small
under a small fd limit), a connect past it waits or is refused by the kernel.

The first pause waits for the first accept (the daemon connects to itself
once at start): libzmq registers the listener with epoll on its I/O thread
some time after reporting LISTENING, and a pause before that registration
would leave epoll watching the empty socket for good -- nothing accepted
again (seen on a busy machine as a daemon that never answers).

The gate polls the duplicate; when a connection waits and the table has
room (`max_peers` less the peers, less those shed but not yet closed), it
opens the listener for a few microseconds at a time, reading the ACCEPTED
events in between (`_admit`). A burst therefore cannot fill the fd table
while the gate is looking elsewhere -- it could when the listener stayed
open and the gate, woken by events, reacted after libzmq had accepted
hundreds. When the table is full and connections wait, the gate sheds the
oldest idle peers, an eighth of the cap at a time (`_make_room`), and admits
the waiting ones once libzmq has closed them. The listener is always
restored before the socket is closed (libzmq asserts when it cannot remove
an fd from epoll). What remains: libzmq accepts what it can in a window, so
a gate preempted inside one (a few microseconds, on a CPU-starved machine)
lets a few dozen more in; `default_max_peers` keeps half the table for that.

To shed, the gate shuts the connection down (shutdown(2), SHUT_RDWR, on the
fd number itself -- no dup, which would need a free fd): libzmq then sees
the end of the stream, closes the fd itself and reports DISCONNECTED. The fd
is never closed behind libzmq's back.

Rules the gate keeps:
1. Who goes first: peers that never completed a request (half-open or silent
   connections, stalled partial frames), oldest first; then peers idle the
   longest. A client between requests may be shed; its DEALER reconnects by
   itself, so that costs it a reconnect, not an error.
2. Before shutting an fd down it checks that the fd is still a socket bound to
   the daemon's own endpoint (getsockname): the monitor's news lags, an fd
   number is reused as soon as libzmq closes it, and it must never cut a
   connection that is not a peer's (the metrics server's, a remote tier's).
   A cut asked for by the outbox names the connection too (`connection_id`,
   taken at its first request): a peer gone since, whose fd number another
   peer has now, is not the newcomer.
3. Input allowance: bytes a peer has sent of a message not yet complete live
   inside libzmq, where nothing can count them (ZMQ_MAXMSGSIZE bounds one
   frame, not a message of many frames). The gate samples the daemon's
   anonymous RSS every `tick` seconds (20 ms; ~2 us a sample) while it is
   near the ceiling, less often when it is not (rule 7); while it
   exceeds `ceiling()` (the RAM tier's bytes plus the allowance of
   `memory_ceiling`, see README "Memory"), it sheds stalled peers --
   connected, and no request completed for `stall_seconds` (0.25 s) -- one per
   sample, or one per `over_unit` bytes over (the largest message) of those
   that never completed a request (a peer stalled inside its first message),
   oldest idle first; when every stalled peer has completed one, one a
   sample (a client idle between requests holds nothing, and one frame
   bomb holds far more than `over_unit`). Shedding frees what libzmq held
   for them. A
   peer is not stalled in its first quarter second, so an attack can
   overshoot by what it sends in that time before it is shed. Under the
   ceiling nobody is shed for being slow: a client sending a big message
   over a slow link is cut off only while memory is over it. Memory the
   allocator keeps after peers are gone is not theirs: over the ceiling the
   gate first asks glibc to give freed memory back (malloc_trim, at most
   once a second; `kvd.host.memory.tune_malloc` at start makes frames of 4 MiB or more
   mmapped), and
   after shedding (once libzmq has closed those peers) it sheds again at
   once only if RSS moved: down (it helped) or up (someone is pushing); if
   it did not move, one peer a second, of those that never completed a
   request (the one shed may have held nothing: an idle connection sorts
   before a peer stalled inside a big message).
4. The serving loop only calls `touch(fd)`; the table is a dict written under
   the GIL, so no lock is needed between the two threads. A request can be
   served before the gate has read its connection's ACCEPTED event (the gate
   waits for the GIL on a busy machine): such a touch is kept until the
   event comes, so a client that has been served never ranks as silent.
5. With thousands of fds to spare (`max_peers` of 4,096 or more: service
   managers' limits) the listener stays open while fewer than half the cap
   are connected, and libzmq accepts at its own pace; the gate pauses it at
   the first ACCEPTED event past that mark, and from there on admits in
   windows as above. A burst the gate is late for then has at least half the
   cap in fds before EMFILE (with the default cap 1.5 x max_peers, over
   6,000), against ~170 accepts measured before its first wake-up. Windows
   cost CPU when connections keep coming: the gate spins opening them, and
   libzmq's I/O thread spins on the paused listener (measured: a peer
   reconnecting ~900 times a second kept the daemon at a full core). Under
   smaller caps (`prlimit --nofile=256`) it never stays open.
6. The fd limit can change under a running daemon (`prlimit --pid`, a
   service manager's tightening): the cap and the alarm computed at start
   would then let libzmq accept into a table that is full. Every tick the
   gate reads RLIMIT_NOFILE again (one system call); when it changed, the cap
   becomes the lesser of the one it was given and `default_max_peers` of the
   new limit, rule 5's mark and the alarm follow, and peers over the new cap
   are shed (oldest idle first). While the limit is below the one at start,
   the gate also counts the fds the daemon holds besides its peers
   (/proc/self/fd, on the change and once a second) and lets peers and those
   closing use at most half of what that leaves (`_fd_room`): a limit
   lowered to a few more than the fds already open still admits a few,
   oldest idle shed to make room, and never a connection libzmq has no fd
   for. What remains: a connection accepted between the change and the
   gate's next tick (at most `quiet_tick`, rule 7) with the listener open under rule 5; and a limit
   that leaves fewer than `_TIGHT_FDS` beyond the daemon's own. Linux's
   accept() takes a free fd before it looks for a connection, and libzmq
   calls it in a loop while one waits on the paused listener: with the table
   full any client that connects would abort the daemon, whatever the gate
   does (without the accept guard, rule 8: with it, that client is dropped).
   So there it admits none and sheds none for fds (a shed peer reconnects),
   and logs an error asking for a higher limit.
7. The gate wakes for its own samples only as often as it must: each wake
   takes the GIL from the serving thread mid-request (which gives it up
   within the switch interval, 0.2 ms, then waits for the gate), and at a
   wake every 20 ms that was what the slowest percent of LOOKUPs waited for
   (their gaps were multiples of 20 ms). So samples come every `tick` (20
   ms) while RSS could reach the ceiling before `quiet_tick` (0.1 s) is
   over at `_FILL_RATE` (4 GiB/s, four times what one libzmq I/O thread
   takes in here), or shed peers are closing, or memory was shed for; every
   `quiet_tick` otherwise. Monitor events and waiting connections still wake
   it at once; only the samples (memory, the fd limit, expiries) are spaced.
8. Where the accept guard is installed (acceptguard.py: Linux), libzmq's
   accept() that finds no fd free drops the newcomer instead of aborting,
   and tells the gate (`refused`, on libzmq's I/O thread). At the next
   sample the gate logs it (a line a second at most) and, if the table is
   still full, sheds the oldest idle (`_make_room`) so that the newcomer's
   reconnect finds room. The windows, the cap and rule 6 stay: the guard is
   the backstop for what they cannot prevent (a gate preempted with the
   listener open, a limit lowered to the fds the daemon holds), not the way
   connections are admitted. One thing changes: libzmq's accept() is then a
   callback that needs the GIL, so a window (`_admit`) lets the GIL go
   while the listener is open, for up to a millisecond, instead of keeping
   it; the guard then accepts at most the room the gate gives it
   (`acceptguard.set_budget`), so a window admits no more than the cap
   allows however long it stays open.
9. A process that keeps sending messages over the frame limit (frame
   bombs: drain.py), or that rule 3 sheds for memory while inside its first
   message with proof it held a bomb (`_judge`: memory over the ceiling
   fell by more than its messages could hold; such a process goes to
   `stuck_senders`, which the serving loop strikes unless a request of it
   was read on a connection still open: then from the third time in a
   minute, the seventh if the connections shed were not sending,
   drain.Offenders.spare), is banned by the serving loop
   (`ban`): its connections are shed. A process several of whose
   connections the watchdog sheds in one step, each inside its first
   message and with bytes it sent still unread in the kernel (`unread`: an
   idle client's remade connections have none), is struck at once (a swarm
   of bombs: what one shed frees, the others refill, so `_judge` would see
   no fall). Where the accept guard runs, a connection a banned process
   makes is accepted by the guard and held unread, never handed to libzmq
   (`acceptguard.set_refuse`: one SO_PEERCRED read per accept while someone
   is banned, and one per held connection at each sample): its sender waits
   on a full socket buffer instead of connecting again at once, and nothing
   it sends is parsed. Held connections are closed at the first sample
   after the ban ends (at most a sixteenth of the fd limit, 16 to 1,024,
   are held, and under a lowered fd limit a quarter of the fds the
   daemon's own leave; past that the oldest is closed). At a full table,
   what waits is screened before anyone is shed for it (`_screen`): the
   guard holds a banned process's connections and lets the first other one
   in, for which one idle peer there before is shed (never the newcomer),
   so a banned process connecting again and again sheds no other peer.
   Elsewhere such a connection
   is shed as soon as its ACCEPTED event is read. The ban ends by itself. The serving loop checks too (`is_banned`):
   a request it reads from a banned process before this thread has read
   the connection's ACCEPTED is not served, and the connection is cut.
10. The lanes' connections (kvd.server.lanes: a socket per client, each
   with its own listener, so not in the main socket's monitor) are learnt
   from the accept guard (`accepted_elsewhere`: accepts on any listener
   but the main one, which alone the windows' budget bounds) and kept apart
   from `peers`: they count in neither max_peers nor the listener's room.
   Over the memory ceiling they are victims like the main socket's peers
   (stalled: no request completed on them for `stall_seconds`), so a frame
   bomb arriving on a lane is cut off before it is whole. No DISCONNECTED
   comes for them: an entry is checked against its connection id before it
   is shed, and those gone are forgotten once a second. Without the accept
   guard (macOS) the gate does not see them.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import socket
import struct
import threading
import time
from typing import Callable

import zmq

from kvd.host.fds import fd_limit, open_fds, swap_fd, wait_readable
from kvd.server.admission import acceptguard
from kvd.server.admission.caps import RESERVE_FDS, default_max_peers
from kvd.server.admission.connections import connection_id, origin, shut_down, sockname, stand_in
from kvd.server.admission.watchdog import MemoryWatch

log = logging.getLogger("kvd.server")

_WINDOW = 0.005  # seconds one PeerGate._admit may spin before polling again
_QUICK_TRIES = 16  # windows of microseconds before one of up to a millisecond
_TIGHT_FDS = 8  # fds beyond the daemon's own under which no peer is shed for fds (rule 6)
# Rule 7: how fast peers' input can grow the daemon's memory, at most (bytes a
# second; one libzmq I/O thread took in ~1 GiB/s over ipc here), and the
# gate's sampling period while that could not reach the ceiling anyway.
_FILL_RATE = 4 << 30
_QUIET_TICK = 0.1
_OPEN_MIN_PEERS = 4096  # caps from which the listener may stay open while under half full (rule 5)
_SCREEN_TRIES = 4  # windows in a row that took nothing before a screen gives way to shedding (rule 9)


def _readable(fd: int) -> bool:
    """Does the listening socket `fd` have a connection waiting?"""
    return bool(select.select([fd], [], [], 0)[0])

_EVENTS = (
    zmq.EVENT_LISTENING | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_MONITOR_STOPPED
)


def _open_below(max_peers: int) -> int:
    """Rule 5's mark: peers under which the listener may stay open (0: never)."""
    return max_peers // 2 if max_peers >= _OPEN_MIN_PEERS else 0


class PeerGate(MemoryWatch, threading.Thread):
    """The fd table and its shedding; see the module docstring."""

    EVENTS = _EVENTS

    def __init__(
        self,
        monitor: zmq.Socket,
        *,
        max_peers: int,
        ceiling: Callable[[], int] | None = None,
        stall_seconds: float = 0.25,
        over_unit: int = 64 << 20,
        tick: float = 0.02,
        quiet_tick: float = _QUIET_TICK,
        clock: Callable[[], float] = time.monotonic,
        lanes_folder: str | None = None,
    ):
        super().__init__(name="kvd-peers", daemon=True)
        self.monitor = monitor
        self._monitor_fd = monitor.getsockopt(zmq.FD) if monitor is not None else -1
        self.wanted_peers = max_peers  # the cap asked for; max_peers is it under the current fd limit (rule 6)
        self.max_peers = max_peers
        # Rule 5: under this many peers (and closing), the listener stays open.
        self.open_below = _open_below(max_peers)
        self.ceiling = ceiling
        self.stall_seconds = stall_seconds
        self.over_unit = max(1, over_unit)
        self.tick = tick
        self.quiet_tick = max(tick, quiet_tick)
        self.headroom: int | None = None  # the ceiling less RSS at the last sample (None: not sampled)
        self.clock = clock
        self.peers: dict[int, list] = {}  # fd -> [accepted at, last request at or None]
        # Rule 10: the lanes' connections (kvd.server.lanes), from the accept
        # guard: fd -> [accepted at, last request at or None, connection id].
        self.lanes_folder = lanes_folder
        self.lane_peers: dict[int, list] = {}
        self._lanes_pruned_at = float("-inf")
        self.closing: dict[int, float] = {}  # fd -> shed at: shut down, libzmq has not closed it yet
        # fd -> last request at, for requests served before this thread read the
        # connection's ACCEPTED event (rule 4): without it a busy machine made a
        # client that had completed requests look silent -- the first to shed.
        self._early: dict[int, float] = {}
        self.listener: int | None = None  # libzmq's listening fd (from LISTENING)
        self._real: int | None = None  # our duplicate of it, which keeps the real listener alive
        self._empty: socket.socket | None = None  # what the listener fd points at while paused
        self.paused = False
        self.fd_limit = self.start_fd_limit = fd_limit()
        self.fd_alarm = self.fd_limit - RESERVE_FDS
        self.own_fds: int | None = None  # fds held besides peers', counted while the limit is lowered (rule 6)
        self._own_counted_at = float("-inf")
        self.sockname = None  # the listener's address: what a peer's fd reports as its own
        self.counters = dict.fromkeys(
            ("accepted", "disconnected", "shed_over_cap", "shed_for_memory", "shed_banned", "high_water", "pauses",
             "fd_limit_changes"), 0
        )
        self.banned: dict[bytes, float] = {}  # origin -> banned until (rule 9)
        # Processes shed for memory inside their first message (rule 3) with
        # proof of a bomb (`_judge`), for the serving loop to strike (rule 9):
        # appended here, taken there.
        self.stuck_senders: collections.deque[tuple[bytes, bool]] = collections.deque(maxlen=1024)  # (origin, sending?)
        # (origin, peers shed, RSS over the ceiling, when, were they sending?): `_judge`
        self._suspect: tuple[bytes, int, int, float, bool] | None = None
        self._refusals = self._refusals_seen = 0  # accepts the guard found no fd for (rule 8)
        # (fd, connection id, until): let in by a screen, not shed for itself (`_is_newcomer`)
        self._newcomer: tuple[int, int | None, float] = (-1, None, float("-inf"))
        self._screen_misses = 0  # screens in a row in which the guard took nothing (`_screen`)
        self._refusals_logged_at = float("-inf")
        self._halt = threading.Event()
        self.armed = threading.Event()  # the listener is paused outside _admit (see _event)
        self._trimmed_at = float("-inf")
        self._shed_at: tuple[float, int] | None = None  # (when, RSS) the watchdog last shed, while over the ceiling
        self._shed_unlogged = 0  # shed since the last log line (one line per second at most)
        self._logged_at = 0.0

    # -- the serving loop's side ------------------------------------------
    def touch(self, fd: int | None) -> None:
        """A request completed on `fd` (ZMQ_SRCFD of its frames)."""
        if fd is None:
            return
        peer = self.peers.get(fd)
        if peer is None:
            peer = self.lane_peers.get(fd)
        if peer is not None:
            peer[1] = self.clock()
        else:
            if len(self._early) >= 4096:  # touches of fds shed meanwhile pile up here; forget them
                self._early.clear()
            self._early[fd] = self.clock()

    def stop(self) -> None:
        self._halt.set()

    def stats(self) -> dict:
        return {
            "connected": len(self.peers), "closing": len(self.closing), "max_peers": self.max_peers, "paused": self.paused,
            "lane_connections": len(self.lane_peers),
            "accept_guard": acceptguard.installed(), "refused_no_fd": acceptguard.refused(),
            "held_banned": acceptguard.held()[1], **self.counters,
        }

    def ban(self, who: bytes, fds: list[int], seconds: float) -> None:
        """Shed process `who`'s connections (`fds`, as the serving loop knows
        them) and cut off its new ones for `seconds` (rule 9; drain.Offenders
        says who)."""
        self.banned[who] = self.clock() + seconds
        # And its connections that never completed a request (a swarm's
        # bombs), which the serving loop has not seen: one SO_PEERCRED read
        # a peer, once a ban.
        silent = [fd for fd, p in list(self.peers.items()) + list(self.lane_peers.items()) if p[1] is None]
        for fd in set(fds) | {fd for fd in silent if origin(fd) == who}:
            if self._shed(fd):
                self.counters["shed_banned"] += 1

    def is_banned(self, who: bytes | None) -> bool:
        """Is process `who` banned now (the serving loop's side of rule 9)?"""
        until = self.banned.get(who) if who is not None and self.banned else None
        return until is not None and until > self.clock()

    def _banned(self, fd: int) -> bool:
        """Is the process at the other end of `fd` banned now? Also called by
        the accept guard on libzmq's I/O thread at every accept (rule 9),
        hence `pop`; with nobody banned it returns at once."""
        if not self.banned:
            return False
        now = self.clock()
        for who, until in list(self.banned.items()):
            if until <= now:
                self.banned.pop(who, None)
        return bool(self.banned) and origin(fd) in self.banned

    def _follow_bans(self) -> None:
        """Rule 9 at each sample: the connections the accept guard holds for
        bans that are over are closed (one SO_PEERCRED read each). It holds
        at most a sixteenth of the fd limit (16 to 1,024): a swarm's threads
        each wait on one, rather than cycling through a few; under a lowered
        limit (rule 6), at most a quarter of the fds the daemon's own leave."""
        most = min(1024, max(16, self.fd_limit // 16))
        if self.own_fds is not None:  # a lowered limit (rule 6): a quarter of the fds the daemon's own leave
            most = min(most, max(1, (self.fd_limit - self.own_fds) // 4))
        acceptguard.set_hold_most(most)
        if acceptguard.held()[0]:
            acceptguard.release(self._banned)

    def refused(self) -> None:
        """libzmq's accept() found no fd free (rule 8; on libzmq's I/O
        thread): logged, and room made, at the next sample."""
        self._refusals += 1

    # -- the thread --------------------------------------------------------
    def run(self) -> None:
        acceptguard.set_refuse(self._banned)  # a banned process's new connections are held unread (rule 9)
        poller = zmq.Poller()
        poller.register(self.monitor, zmq.POLLIN)
        watching = False
        next_sample = self.clock() + self.tick
        try:
            while not self._halt.is_set():
                # Watch for waiting connections only while there is room for
                # them (else a waiting connection would wake us in a loop).
                self._steer()
                want = self._real is not None and self.armed.is_set() and self.paused and self._room() > 0
                if want != watching:
                    if want:
                        poller.register(self._real, zmq.POLLIN)
                    else:
                        poller.unregister(self._real)
                    watching = want
                wait = max(0.0, next_sample - self.clock())
                events = dict(poller.poll(int(wait * 1000) + 1))
                if self.monitor in events:
                    self._drain()
                    self._balance()
                self._adopt_lanes()
                if watching and self._real in events:
                    self._admit()
                if self._room() <= 0 and not self.closing and self._real is not None and _readable(self._real):
                    self._make_room()
                if self.clock() >= next_sample:
                    self._expire_closing()
                    self._drain()
                    self._after_refusals()
                    acceptguard.ensure_spare(self.fd_limit)
                    self._follow_fd_limit()
                    self._balance()
                    self._watch_memory()
                    self._follow_bans()
                    self._log_shedding()
                    next_sample = self.clock() + self._period()
        finally:
            acceptguard.set_refuse(None)
            self.resume()
            self._log_shedding(force=True)
            self.monitor.close(linger=0)
            if self._empty is not None:
                self._empty.close()
            if self.listener is not None:
                acceptguard.set_main(None)
            if self._real is not None:
                acceptguard.set_listener(None)
                os.close(self._real)
                self._real = None

    def _period(self) -> float:
        """Seconds to the next sample (rule 7): `tick` while memory could reach
        the ceiling before a quiet tick is over, or shed peers are closing;
        `quiet_tick` otherwise."""
        near = self.headroom is not None and self.headroom < _FILL_RATE * self.quiet_tick
        busy = self.closing or self._shed_at is not None or self._suspect is not None
        return self.tick if near or busy else self.quiet_tick

    def _open_ok(self) -> bool:
        """May the listener stay open (rule 5)?"""
        return len(self.peers) + len(self.closing) < self.open_below

    def _steer(self) -> None:
        """Outside `_admit`: the listener open under rule 5's mark, else paused."""
        if self.armed.is_set():
            self.resume() if self._open_ok() else self.pause()

    def _room(self) -> int:
        """Connections libzmq may still accept: the cap less the peers, and less
        those shed but not closed yet (they still hold their fds); under a
        lowered fd limit, no more than the fds left allow (rule 6)."""
        room = self.max_peers - len(self.peers) - len(self.closing)
        return room if self.own_fds is None else min(room, self._fd_room())

    def _fd_room(self) -> int:
        """Under a lowered fd limit: half the fds the daemon's own leave, less
        the peers and those closing. The other half is for what libzmq takes
        in a window beyond the room and for the daemon's own new files."""
        assert self.own_fds is not None
        return (self.fd_limit - self.own_fds) // 2 - len(self.peers) - len(self.closing)

    def _fds_shed_ok(self) -> bool:
        """Under a lowered fd limit, may peers be shed for fds (rule 6)? Not
        when the limit leaves the daemon fewer than `_TIGHT_FDS` beyond its
        own: a shed peer reconnects, and libzmq's accept() needs a free fd
        even to find nothing waiting (Linux takes the fd first), so freeing
        one or two would only turn an idle peer into an abort."""
        return self.own_fds is not None and self.fd_limit - self.own_fds >= _TIGHT_FDS

    def _follow_fd_limit(self) -> None:
        """Rule 6: recompute the cap, rule 5's mark and the alarm when the fd
        limit changed; while it is below the one at start, recount the fds
        the daemon holds besides its peers' (on a change, then once a second)."""
        limit = fd_limit()
        changed = limit != self.fd_limit
        if changed:
            self.fd_limit = limit
            self.fd_alarm = limit - RESERVE_FDS
            self.max_peers = min(self.wanted_peers, default_max_peers(limit))
            self.open_below = _open_below(self.max_peers)
            self.counters["fd_limit_changes"] += 1
        if limit >= self.start_fd_limit:
            self.own_fds = None
        elif changed or self.clock() - self._own_counted_at >= 1.0:
            self._own_counted_at = self.clock()
            held = open_fds(limit)
            self.own_fds = None if held is None else max(0, held - len(self.peers) - len(self.closing))
            if self.own_fds is None:
                self.fd_alarm = min(self.fd_alarm, limit // 2)  # no count to go by: pause at every accept past half
        if changed:
            self._steer()
            if self.own_fds is not None and not self._fds_shed_ok():
                log.error(
                    "fd limit %d leaves %d fds beyond the %d the daemon holds: no peer can be admitted safely "
                    "(accept() needs a free fd even to find nothing waiting); raise it", limit, limit - self.own_fds, self.own_fds,
                )
            log.warning(
                "fd limit changed to %d: max_peers=%d (asked %d)%s", limit, self.max_peers, self.wanted_peers,
                "" if self.own_fds is None else f", {self.own_fds} fds held besides peers: room for {max(0, self._fd_room())} more",
            )
            self._balance()

    def _make_room(self, screen: bool = True) -> None:
        """Connections wait and the table is full: shed the oldest idle (rule 1),
        an eighth of the cap at a time; those waiting are admitted once libzmq
        has closed them. While a process is banned, what waits is screened
        first (rule 9, `_screen`); not after the guard dropped a newcomer for
        want of an fd (rule 8: nothing waits then, and the table is full)."""
        if self.own_fds is not None and not self._fds_shed_ok():
            return  # rule 6: the newcomer could not be accepted safely either
        if screen and self.banned and self.own_fds is None and acceptguard.installed() and self._real is not None \
                and self._screen():
            return  # (not under a lowered fd limit: the fd room would shed more for the newcomer, rule 6)
        shed = sum(self._shed(fd) for fd in self.victims()[: max(1, self.max_peers // 8)])
        self.counters["shed_over_cap"] += shed
        self._shed_unlogged += shed
        self._log_shedding()

    def _screen(self) -> bool:
        """Rule 9 at a full table: the listener open for one window in which
        the accept guard takes what waits, holds a banned process's
        connections and hands the first other one to libzmq, one over the
        cap; for it the oldest idle peer of those there before is shed (never
        the newcomer itself, which has completed no request yet and would
        sort first: it is spared by `_shed_over_cap` for `stall_seconds`).
        False only after `_SCREEN_TRIES` windows in a row in which the guard
        took nothing while connections waited (libzmq's thread did not run):
        then room is made as without a ban. A banned process connecting
        again and again at a full table would otherwise have an eighth of
        the cap shed for each try."""
        assert self._real is not None
        held = acceptguard.held()[1]
        acceptguard.set_budget(0)
        acceptguard.set_screen(True)
        deadline = self.clock() + _WINDOW
        try:
            self.resume()
            while acceptguard.screening() and _readable(self._real) and self.clock() < deadline:
                select.select([self._monitor_fd], [], [], 0.001)  # the GIL let go: the guard runs on libzmq's thread
        finally:
            self.pause()
            acceptguard.set_screen(False)
            acceptguard.set_budget(None)
            acceptguard.settle(0.01)  # an accept under way may be inside `_refused` (Python): its newcomer too
            newcomer = acceptguard.take_screened()
        if newcomer is not None:
            # The peers there before, in shedding order (the newcomer's ACCEPTED
            # is not drained yet; a sort of the table only when one is let in,
            # not at every screen of a banned process's connections).
            before = [fd for fd in self.victims() if fd != newcomer and not self._is_newcomer(fd)]
            self._newcomer = (newcomer, connection_id(newcomer), self.clock() + self.stall_seconds)
            shed = next((1 for fd in before if self._shed(fd)), 0)
            self.counters["shed_over_cap"] += shed
            self._shed_unlogged += shed
            self._log_shedding()
        self._drain()
        self._balance()
        if newcomer is not None or acceptguard.held()[1] > held or not _readable(self._real):
            self._screen_misses = 0
            return True
        self._screen_misses += 1
        if self._screen_misses < _SCREEN_TRIES:
            return True
        self._screen_misses = 0
        return False

    def _is_newcomer(self, fd: int) -> bool:
        """Is `fd` the connection a screen let in lately, silent since (`_screen`)?"""
        newcomer, conn_id, until = self._newcomer
        return (fd == newcomer and self.clock() < until and self.peers.get(fd, (0, 0))[1] is None
                and connection_id(fd) == conn_id)

    def _after_refusals(self) -> None:
        """Rule 8: the accept guard dropped newcomers since the last sample:
        the table was full of fds, whatever our count says. If it still is,
        shed the oldest idle, so that their reconnects find room."""
        seen, self._refusals_seen = self._refusals_seen, self._refusals
        if self._refusals == seen:
            return
        now = self.clock()
        if now - self._refusals_logged_at >= 1.0:  # one line a second at most
            self._refusals_logged_at = now
            log.warning(
                "no fd free for a connection (fd limit %d, %d peers): the newcomer was dropped instead of "
                "libzmq aborting (%d dropped since start)", self.fd_limit, len(self.peers), acceptguard.refused(),
            )
        if self.closing or not self.peers:
            return
        held = open_fds(self.fd_limit)
        if held is None or held >= self.fd_limit - _TIGHT_FDS:  # still full: not a moment past
            self._make_room(screen=False)

    def _admit(self) -> None:
        """Connections are waiting: let libzmq accept them, a few at a time.

        The listener stays paused except in windows of a few microseconds
        (two dup3() calls back to back that keep the GIL, `_swap_fd`), opened and closed by this thread
        while it is awake: libzmq's I/O thread, spinning on the waiting
        connection, takes none, one or a few; the gate counts them and goes
        again while there is room. Longer windows lose the race: libzmq
        accepts ~4x faster than Python reads ACCEPTED events, a thread woken
        by events can be scheduled too late (measured: 170 accepts before the
        gate's first wake-up on 2 busy cores), and a window of 20 us let 150
        through when CPU hogs preempted the gate (libzmq aborts on EMFILE). Connections beyond the room wait in
        the kernel's backlog until the oldest idle peers are shed
        (`_make_room`).
        """
        assert self._real is not None
        deadline = self.clock() + _WINDOW
        missed = 0
        guarded = acceptguard.installed()
        while self._room() > 0 and _readable(self._real) and self.clock() < deadline:
            if guarded:
                # libzmq's accept() is the guard's callback, which needs the
                # GIL: a window that kept it would take no one. So the window
                # lets the GIL go, and the guard itself accepts no more than
                # the room (its budget) however long libzmq has.
                acceptguard.set_budget(self._room())
            self.resume()
            if guarded:
                select.select([self._monitor_fd], [], [], 0.001)
            elif missed >= _QUICK_TRIES:
                # libzmq's I/O thread has not been running alongside us (busy
                # CPUs): hold the listener open until it takes one (the
                # monitor's fd signals its ACCEPTED), at most a millisecond,
                # and let it have this CPU meanwhile -- keeping the GIL, so
                # that the window ends when the millisecond does.
                wait_readable(self._monitor_fd, 1)
            self.pause()  # libzmq takes what it can in between: none, one or a few
            acceptguard.set_budget(None)
            if self._drain():
                missed = 0
            else:
                missed += 1
                time.sleep(0)  # let the serving thread have the GIL
        self._balance()  # libzmq may have taken a few more than the room

    def _event(self) -> bool:
        """Handle one queued monitor event; False when none is left."""
        try:
            frames = self.monitor.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError:
            self._halt.set()
            return False
        if len(frames) == 2 and len(frames[0]) == 6:  # libzmq's event: u16 id, i32 value (the fd), no padding
            self._on_event(*struct.unpack("=Hi", frames[0]))
        return True

    def _on_event(self, kind: int, fd: int) -> None:
        if kind == zmq.EVENT_ACCEPTED:
            if not self.armed.is_set() and self._empty is not None:
                # libzmq registers its listener with epoll on its I/O thread
                # some time after LISTENING; a pause before that would leave
                # epoll watching the empty socket for good. An accept proves
                # the registration is on the real listener (Daemon.bind
                # makes one): from now on it stays paused outside _admit.
                self.pause()
                self.armed.set()
            # Served already if the serving loop got its request before this news.
            self.peers[fd] = [self.clock(), self._early.pop(fd, None)]
            self.closing.pop(fd, None)  # the number was reused: the old one is closed
            self.lane_peers.pop(fd, None)
            self.counters["accepted"] += 1
            self.counters["high_water"] = max(self.counters["high_water"], len(self.peers) + len(self.closing))
            if self.banned and self._banned(fd):
                if self._shed(fd):
                    self.counters["shed_banned"] += 1
                return
            if fd >= self.fd_alarm or not self._open_ok():
                self.pause()  # past rule 5's mark, or the table is nearly full whatever our count says
        elif kind in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
            if self.peers.pop(fd, None) is not None or self.closing.pop(fd, None) is not None:
                self.counters["disconnected"] += 1
        elif kind == zmq.EVENT_LISTENING and self.listener is None:
            self._listening(fd)
        elif kind == zmq.EVENT_MONITOR_STOPPED:
            self._halt.set()

    def victims(self, stalled_only: bool = False, lanes: bool = False) -> list[int]:
        """Peers in shedding order (rule 1); with `stalled_only`, only those
        without a completed request for `stall_seconds`; with `lanes`, the
        lanes' connections among them (rule 10)."""
        now = self.clock()
        order = []
        table = [(fd, p[0], p[1]) for fd, p in list(self.peers.items())]
        if lanes:
            table += [(fd, p[0], p[1]) for fd, p in list(self.lane_peers.items())]
        for fd, accepted, last in table:
            seen = last if last is not None else accepted
            if stalled_only and now - seen < self.stall_seconds:
                continue
            order.append((last is not None, seen, fd))
        order.sort()
        return [fd for _, _, fd in order]

    # -- pausing the listener ------------------------------------------------
    def _listening(self, fd: int) -> None:
        """Remember libzmq's listener and prepare the empty socket a pause swaps in."""
        try:
            self.sockname = sockname(fd)
            family = socket.socket(fileno=fd)
            kind = family.family
            family.detach()
            self._empty = stand_in(kind, self.sockname)
            self._real = os.dup(fd)
            self.listener = fd
            acceptguard.set_listener(self._real)
            acceptguard.set_main(fd)
        except OSError as err:
            log.warning("cannot prepare listener pauses (%s): shedding only", err)
            if self._empty is not None:
                self._empty.close()
                self._empty = None

    def pause(self) -> None:
        if self.paused or self.listener is None or self._empty is None:
            return
        swap_fd(self._empty.fileno(), self.listener)
        self.paused = True
        self.counters["pauses"] += 1

    def resume(self) -> None:
        if not self.paused or self._real is None or self.listener is None:
            return
        swap_fd(self._real, self.listener)
        self.paused = False

    def _balance(self) -> None:
        """Shed down to the cap, and under a lowered fd limit down to what the
        fds allow (the listener is paused outside `_admit`)."""
        if len(self.peers) > self.max_peers or (self._fds_shed_ok() and self._fd_room() < 0):
            self._shed_over_cap()

    def _drain(self) -> int:
        """Read every queued monitor event; how many there were."""
        n = 0
        while self._event():
            n += 1
        return n

    def _expire_closing(self) -> None:
        """Forget shed fds whose DISCONNECTED never came (5 s): never pause for good."""
        cutoff = self.clock() - 5.0
        for fd, at in list(self.closing.items()):
            if at < cutoff:
                del self.closing[fd]

    # -- shedding ---------------------------------------------------------------
    def shed(self, fd: int, conn_id: int | None = None) -> bool:
        """Cut one peer off now (the outbox's hogs); True if it was one of ours.
        `conn_id`: the connection_id its request came with. The outbox's news
        can be old: the peer may be gone and its fd number another peer's
        since (rule 2 checks only that it is one of ours)."""
        if conn_id is not None and connection_id(fd) != conn_id:
            return False
        return self._shed(fd)

    def _shed(self, fd: int) -> bool:
        if fd in self.lane_peers:
            return self._shed_lane(fd)
        if fd not in self.peers:
            return False  # not (or no longer) a peer we know: never shed blindly
        self.peers.pop(fd, None)  # DISCONNECTED will follow; never shed twice
        try:
            if self.sockname is not None and sockname(fd) != self.sockname:
                return False  # rule 2: no longer (or never) one of our peers
            shut_down(fd)
        except OSError:
            return False  # closed meanwhile, or not a socket
        self.closing[fd] = self.clock()
        return True

    # -- the lanes' connections (rule 10) ----------------------------------------
    def _adopt_lanes(self) -> None:
        """Connections the accept guard saw accepted on the lanes' listeners."""
        for fd in acceptguard.accepted_elsewhere():
            if self._lane_conn(fd):
                self.lane_peers[fd] = [self.clock(), self._early.pop(fd, None), connection_id(fd)]

    def _lane_conn(self, fd: int) -> bool:
        """Is `fd` a connection to one of this daemon's lanes?"""
        if self.lanes_folder is None:
            return False
        try:
            name = sockname(fd)
        except OSError:
            return False
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        return isinstance(name, str) and name.startswith(self.lanes_folder + os.sep + "l-")

    def _prune_lanes(self) -> None:
        """Forget lanes' connections that are gone (no DISCONNECTED comes for
        them): at most once a second."""
        now = self.clock()
        if now - self._lanes_pruned_at < 1.0:
            return
        self._lanes_pruned_at = now
        for fd, peer in list(self.lane_peers.items()):
            if connection_id(fd) != peer[2]:
                del self.lane_peers[fd]

    def _shed_lane(self, fd: int) -> bool:
        peer = self.lane_peers.pop(fd)
        try:
            if connection_id(fd) != peer[2] or not self._lane_conn(fd):
                return False  # gone, or its number is someone else's now
            shut_down(fd)
        except OSError:
            return False
        return True

    def _shed_over_cap(self) -> None:
        excess = len(self.peers) - self.max_peers
        if self._fds_shed_ok():
            excess = max(excess, -self._fd_room())
        if excess <= 0:
            return
        # A sixteenth more than the excess: a burst over the cap then costs one
        # sort of the table per batch, not one per connection. Not the
        # newcomer a screen let in, for which room was made (`_screen`).
        victims = [fd for fd in self.victims() if not self._is_newcomer(fd)]
        shed = sum(self._shed(fd) for fd in victims[: excess + self.max_peers // 16])
        self.counters["shed_over_cap"] += shed
        self._shed_unlogged += shed
        self._log_shedding()

    def _log_shedding(self, force: bool = False) -> None:
        now = self.clock()
        if self._shed_unlogged and (force or now - self._logged_at >= 1.0):
            log.warning(
                "peers over max_peers=%d: shed %d connections (oldest idle first; %d connected)",
                self.max_peers, self._shed_unlogged, len(self.peers),
            )
            self._shed_unlogged, self._logged_at = 0, now
