"""The segment hand-out: a Unix socket in the plane's folder that answers a
request naming segments with their fds (SCM_RIGHTS; the lines are
kvd/protocol/handout.py, PROTOCOL.md section 15).

Theory of operation
-------------------
Where segments are POSIX shm_open objects (macOS; Linux with host =
portable) the daemon unlinks each one's name as soon as it is made and keeps
the fd (kvd.host.segments.new_segment): no name outlives its creation, so
none can be opened, squatted or left behind by a kill -9. A client gets the
segments it needs here instead, at any time, as fds: `fds` in the plane's
0700 folder, named in HELLO's offer (`handout`).

The service runs on a thread of its own (`kvd-shm-fds`), never the serving
thread, with a selector over the listener, a wake-up pipe and its peers.
Rules it keeps, so a hostile peer costs it a connection and nothing else:
1. A connection is served only if its peer runs as the daemon's uid or root
   (kvd.endpoint.peer_uid, the rule every ipc connection of kvd follows);
   any other is closed at once, nothing said (`refused_peers`).
2. At most `max_peers` connections at once: one more is told BUSY and
   closed (`busy`). When no fd is left to accept one, the listener rests
   for REST_S (a listener that stays readable would spin the thread).
3. Each connection has `deadline_s` from its accept to send one request of
   at most MAX_REQUEST bytes; past it, or sending garbage, it is refused or
   cut (`cut`). One request per connection: the reply, then close.
4. A reply is sent without blocking: it is small and the first bytes on the
   connection, so it fits the socket's buffer; if it does not, the peer is
   cut. The fds sent are dups made under the arena's lock (`lookup`), so a
   segment removed meanwhile is never another one by fd number, and closed
   here once sent: the peer holds its own.
5. The socket's name is checked on every wake-up (at least once a second):
   removed or replaced under the daemon (a tmp cleaner), it is bound again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from kvd.endpoint import peer_uid
from kvd.protocol.errors import Busy, ProtocolError
from kvd.protocol.handout import GONE, MAX_REQUEST, OK, encode_refusal, encode_reply, parse_request, request_line
from kvd.server.shm.folders import HANDOUT_SOCKET

log = logging.getLogger("kvd.server")

MAX_PEERS = 16
DEADLINE_S = 2.0
REST_S = 0.1  # the listener rests this long when no fd is left to accept with
TICK_S = 1.0  # the socket's name is checked at least this often (rule 5)


class _Peer:
    __slots__ = ("sock", "deadline", "buf")

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline, self.buf = sock, deadline, bytearray()


class Handout:
    """The hand-out service (module docstring). `lookup(name)` returns a new
    fd of the live segment of that name (the service closes it) or None;
    `ahead(name)`, asked of a name with none, whether it names a segment this
    run has not made yet (a client following the window being prepared:
    counted `ahead`, not `gone`; both are answered "gone")."""

    def __init__(self, folder: Path, lookup: Callable[[str], int | None], *, max_peers: int = MAX_PEERS,
                 deadline_s: float = DEADLINE_S, clock: Callable[[], float] = time.monotonic,
                 ahead: Callable[[str], bool] = lambda name: False):
        self.path = folder / HANDOUT_SOCKET  # short, for macOS's 104-byte socket paths
        self._lookup, self._ahead = lookup, ahead
        self.max_peers, self.deadline_s = max_peers, deadline_s
        self._clock = clock
        self._sel = selectors.DefaultSelector()
        self._peers: dict[int, _Peer] = {}
        self._listener: socket.socket | None = None
        self._bound: tuple[int, int] | None = None  # (st_dev, st_ino) of the name we bound
        self._rest_until = 0.0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.counters = {"fds_handed": 0, "requests": 0, "gone": 0, "ahead": 0, "refused_peers": 0, "busy": 0,
                         "cut": 0, "rebound": 0}
        try:
            self._bind()
        except BaseException:
            self._sel.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise

    # -- the listener ------------------------------------------------------------
    def _bind(self) -> None:
        """Bind the socket's name afresh (raises OSError: a path too long, no
        room), removing whatever now holds it (the folder is ours, 0700)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(str(self.path))  # the folder is 0700: no one else can reach it
            s.listen(self.max_peers)
            s.setblocking(False)
            st = os.lstat(self.path)
        except BaseException:
            s.close()
            raise
        if self._listener is not None:
            with contextlib.suppress(KeyError):  # resting (rule 2): not registered
                self._sel.unregister(self._listener)
            self._listener.close()
        self._listener, self._bound, self._rest_until = s, (st.st_dev, st.st_ino), 0.0
        self._sel.register(s, selectors.EVENT_READ, "listener")

    def _check_name(self) -> None:
        try:
            st = os.lstat(self.path)
            same = (st.st_dev, st.st_ino) == self._bound
        except OSError:
            same = False
        if not same:
            try:
                self._bind()
                self.counters["rebound"] += 1
            except OSError as err:  # the folder gone: the plane's repair makes it again, we retry
                log.debug("shared memory: cannot bind %s again yet: %s", self.path, err)

    # -- the thread --------------------------------------------------------------
    def start(self) -> "Handout":
        self._thread = threading.Thread(target=self._run, name="kvd-shm-fds", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread, close every connection, remove the socket's name."""
        self._stopping = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(5.0)
        for peer in list(self._peers.values()):
            self._close(peer)
        if self._listener is not None:
            self._listener.close()
        with contextlib.suppress(OSError):
            if (os.lstat(self.path).st_dev, os.lstat(self.path).st_ino) == self._bound:
                os.unlink(self.path)
        self._sel.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._turn()
            except Exception:  # a bug here must not end the hand-out for good
                log.exception("shared memory: the fd hand-out failed a turn")

    def _turn(self) -> None:
        now = self._clock()
        wait = TICK_S
        if self._peers:
            wait = min(wait, max(0.0, min(p.deadline for p in self._peers.values()) - now))
        if self._listener is not None and self._rest_until > now:
            wait = min(wait, self._rest_until - now)
        for key, _ in self._sel.select(wait):
            if key.data is None:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 64)
            elif key.data == "listener":
                self._accept()
            else:
                self._read(key.data)
        now = self._clock()
        for peer in [p for p in self._peers.values() if p.deadline <= now]:  # rule 3
            self.counters["cut"] += 1
            self._close(peer)
        if self._rest_until and self._rest_until <= now and self._listener is not None:
            self._rest_until = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ, "listener")
        self._check_name()

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return
        except OSError as err:  # EMFILE, ENFILE, ENOBUFS: rest, or this thread spins (rule 2)
            log.debug("shared memory: the fd hand-out cannot accept now: %s", err)
            self._sel.unregister(self._listener)
            self._rest_until = self._clock() + REST_S
            return
        conn.setblocking(False)
        uid = peer_uid(conn.fileno())
        if uid is None or uid not in (os.getuid(), 0):  # rule 1
            self.counters["refused_peers"] += 1
            conn.close()
            return
        if len(self._peers) >= self.max_peers:  # rule 2
            self.counters["busy"] += 1
            self._answer(conn, encode_refusal(Busy("too many connections to the fd hand-out")), [])
            conn.close()
            return
        peer = _Peer(conn, self._clock() + self.deadline_s)
        self._peers[conn.fileno()] = peer
        self._sel.register(conn, selectors.EVENT_READ, peer)
        self._read(peer)  # a client sends its request as it connects: often here already

    def _read(self, peer: _Peer) -> None:
        try:
            got = peer.sock.recv(MAX_REQUEST + 1 - len(peer.buf))
        except BlockingIOError:
            return
        except OSError:
            got = b""
        if not got:  # the peer hung up before a whole request
            self._close(peer)
            return
        peer.buf += got
        try:
            line = request_line(peer.buf)
            if line is None:
                return
            names = parse_request(line)
        except ProtocolError as err:
            self.counters["cut"] += 1
            self._answer(peer.sock, encode_refusal(err), [])
            self._close(peer)
            return
        self.counters["requests"] += 1
        fds: list[int] = []
        statuses: list[str] = []
        ahead = 0
        try:
            for name in names:
                fd = self._lookup(name)
                statuses.append(GONE if fd is None else OK)
                if fd is not None:
                    fds.append(fd)
                elif self._ahead(name):
                    ahead += 1
        except OSError as err:  # no fd left to dup with (EMFILE): ask again later
            self.counters["busy"] += 1
            self._answer(peer.sock, encode_refusal(Busy(f"no fd to hand out now: {err}")), [])
            statuses = []
        try:
            if statuses:
                self.counters["gone"] += statuses.count(GONE) - ahead
                self.counters["ahead"] += ahead
                if self._answer(peer.sock, encode_reply(statuses), fds):
                    self.counters["fds_handed"] += len(fds)
        finally:
            for fd in fds:  # the peer holds its own now (rule 4)
                os.close(fd)
            self._close(peer)

    def _answer(self, sock: socket.socket, data: bytes, fds: list[int]) -> bool:
        """Send a reply without blocking (rule 4); False if it did not go whole."""
        try:
            sent = socket.send_fds(sock, [data], fds) if fds else sock.send(data)
        except OSError:  # full, or the peer gone
            sent = 0
        if sent != len(data):
            self.counters["cut"] += 1
            return False
        return True

    def _close(self, peer: _Peer) -> None:
        self._peers.pop(peer.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(peer.sock)
        peer.sock.close()

    def stats(self) -> dict[str, int]:
        return {f"handout_{k}": v for k, v in self.counters.items()} | {"handout_peers": len(self._peers)}
