"""Dropping the rest of a message at libzmq's speed: what a frame bomb costs.

ZeroMQ delivers a message whole: once its first part has been read, every
other part must be read before any other peer's message can be (libzmq's
fair queue asserts on it). ZMQ_MAXMSGSIZE bounds one frame, not the number
of frames, so a peer can send one message of 8 M empty frames (16 MB on the
wire). Read a frame at a time through pyzmq, that held the serving thread
~1 us a frame: 8-12 s for such a message, with every other peer waiting.

`rest` reads what is left of the current message with libzmq's own
`zmq_recviov`, which loops in C over up to `BATCH` parts a call and stops at
the end of the message; the parts are copied into buffers it mallocs, which
are freed by a thread of their own (`_Freer`: `map` over libc's free, no
bytecode per part), so the serving thread is back at its socket as soon as
the message is read. The GIL is let go during each call (ctypes.CDLL).
Measured on this 2-core machine (`python bench/bench_stress.py`'s frame
bomb): ~60-250 ns a part, against ~1,000-1,200 through pyzmq.

libzmq is found where pyzmq keeps it (its wheels' bundled copy) or as the
system's, and only a copy this process has already loaded is used
(RTLD_NOLOAD): the socket handle belongs to that copy. Where none is found
(`available()` False) the parts are read through pyzmq, as before.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import glob
import logging
import os
import queue
import threading
import time
from typing import Callable

import zmq

from kvd.server.admission.connections import connection_id

log = logging.getLogger("kvd.server")

BATCH = 1 << 16  # parts per zmq_recviov call: a 1 MiB iovec array
_PENDING_BATCHES = 4  # batches of buffers waiting to be freed, at most


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _candidates() -> list[str]:
    here = os.path.dirname(zmq.__file__)
    found = sorted(glob.glob(os.path.join(here, os.pardir, "pyzmq.libs", "libzmq*")))  # Linux wheels
    found += sorted(glob.glob(os.path.join(here, ".dylibs", "libzmq*")))  # macOS wheels
    found += sorted(glob.glob(os.path.join(here, "backend", "cython", "_zmq.*")))  # libzmq linked in
    if not found:
        # Only then: find_library runs ldconfig and a compiler (~10 ms a
        # start, and 15 s of fork retries under a tight pids limit).
        system = ctypes.util.find_library("zmq")
        if system:
            found.append(system)
    return found


def _load():
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LOCAL", 0)
    if not getattr(os, "RTLD_NOLOAD", 0):
        return None
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path, mode=mode, use_errno=True)
            fn = lib.zmq_recviov
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Iovec), ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
        libc = ctypes.CDLL(None)
        free = libc.free
        free.restype, free.argtypes = None, [ctypes.c_void_p]
        return fn, free
    return None


_fns = _load()


def available() -> bool:
    return _fns is not None


class _Freer(threading.Thread):
    """Frees the buffers zmq_recviov malloc'd, off the serving thread."""

    def __init__(self, free):
        super().__init__(name="kvd-drop", daemon=True)
        self.free = free
        # At most a few batches wait (~2 MiB of small buffers each): past that
        # the reader waits for the frees, so a bomb's parts never pile up.
        self.todo: queue.Queue[list[int]] = queue.Queue(maxsize=_PENDING_BATCHES)
        self.start()

    def run(self) -> None:
        free = self.free
        while True:
            collections.deque(map(free, self.todo.get()), maxlen=0)


_freer: _Freer | None = None
_freer_lock = threading.Lock()


def _free_later(pointers: list[int]) -> None:
    global _freer
    if _freer is None:
        with _freer_lock:
            if _freer is None:
                _freer = _Freer(_fns[1])  # type: ignore[index]
    _freer.todo.put(pointers)


class Dropper:
    """Drops the rest of the current message of one socket; one per socket,
    used by the thread that owns it."""

    def __init__(self, sock: zmq.Socket, halt: threading.Event | None = None):
        self.sock = sock
        self.halt = halt  # set: stop between batches, the rest left unread (the socket is closing)
        self._parts = _Parts(BATCH) if _fns is not None else None

    def rest(self) -> int:
        """Read and drop the parts left of the message being read; how many."""
        return _drop(self.sock, self._parts, None, self.halt, measure=False)[0]


class _Parts:
    """An iovec array for zmq_recviov, its length, and the count it fills."""

    def __init__(self, size: int):
        self.iov, self.size, self.count = (_Iovec * size)(), size, ctypes.c_size_t()
        # Each part's (base, len) as integers: the bases to free, the lengths to count.
        self.words = memoryview(self.iov).cast("B").cast("Q" if ctypes.sizeof(ctypes.c_void_p) == 8 else "I")


_DROP_TURN: _Parts | None = None  # drop_some's, the serving thread's only


def drop_some(sock: zmq.Socket, most: int) -> tuple[int, int, bool]:
    """Read and drop up to `most` more parts of the message being read on
    `sock`, in C where zmq_recviov is found (~0.1 us a part, against ~0.75
    through pyzmq): (how many, their bytes, whether parts are left). The
    serving thread's only: a message refused from its header (kvd.server.admission.parts)."""
    global _DROP_TURN
    want = min(most, BATCH)
    if _fns is not None and (_DROP_TURN is None or _DROP_TURN.size < want):
        _DROP_TURN = _Parts(want)
    return _drop(sock, _DROP_TURN if _fns is not None else None, most)


def _drop(sock: zmq.Socket, parts: _Parts | None, most: int | None,
          halt: threading.Event | None = None, measure: bool = True) -> tuple[int, int, bool]:
    """Read and drop parts of the message being read on `sock`, all that are
    left or up to `most`, through zmq_recviov into `parts` (pyzmq where it is
    None), stopping between calls once `halt` is set: (how many, their
    bytes if `measure` (0 else: a bomb's 8 M parts are not summed), whether
    parts are left)."""
    n, nbytes, more = 0, 0, bool(sock.get(zmq.RCVMORE))
    if parts is None:
        while more and (most is None or n < most) and not (halt is not None and halt.is_set()):
            nbytes += len(sock.recv(copy=True))
            n += 1
            more = bool(sock.get(zmq.RCVMORE))
        return n, nbytes, more
    recviov = _fns[0]  # type: ignore[index]
    handle, words = ctypes.c_void_p(sock.underlying), parts.words
    while more and (most is None or n < most) and not (halt is not None and halt.is_set()):
        parts.count.value = parts.size if most is None else min(parts.size, most - n)
        rc = recviov(handle, parts.iov, ctypes.byref(parts.count), zmq.DONTWAIT)
        got = parts.count.value
        if got:
            _free_later(words[0 : 2 * got : 2].tolist())
            if measure:
                nbytes += sum(words[1 : 2 * got : 2].tolist())
        elif rc < 0:
            # Cannot happen for a message's later parts (they are all here)
            # but for a malloc failing, after the part was taken: the rest,
            # if any is left, through pyzmq rather than spin.
            log.warning("zmq_recviov failed (errno %d); the rest read through pyzmq", ctypes.get_errno())
            m, b, more = _drop(sock, None, None if most is None else most - n, halt, measure)
            return n + m, nbytes + b, more
        n += got
        more = bool(sock.get(zmq.RCVMORE))
    return n, nbytes, more


def read_some(sock: zmq.Socket, most: int) -> tuple[list[bytes], bool]:
    """Read up to `most` more parts of the message being read on `sock`, in
    C where zmq_recviov is found: (their bytes, whether parts are left). One
    turn of a long message's reading (the daemon's rule 9), so `most` is
    small; each part is copied (~0.1-0.3 us for a small one)."""
    got, more = [], bool(sock.get(zmq.RCVMORE))
    if not more or most <= 0:
        return got, more
    if _fns is None:
        while more and len(got) < most:
            got.append(sock.recv(copy=True))
            more = bool(sock.get(zmq.RCVMORE))
        return got, more
    parts = _Parts(most)
    parts.count.value = most
    rc = _fns[0](ctypes.c_void_p(sock.underlying), parts.iov, ctypes.byref(parts.count), zmq.DONTWAIT)
    n = parts.count.value
    if rc < 0 and n == 0:
        # Cannot happen for a message's later parts but for a malloc failing,
        # after the part was taken: one through pyzmq, if any is left.
        if not sock.get(zmq.RCVMORE):
            return [], False
        return [sock.recv(copy=True)], bool(sock.get(zmq.RCVMORE))
    words = parts.words[0 : 2 * n].tolist()
    got = [ctypes.string_at(b, size) if size else b"" for b, size in zip(words[0::2], words[1::2])]
    _free_later(words[0::2])
    return got, bool(sock.get(zmq.RCVMORE))


class Lent(threading.Thread):
    """The main socket lent to a thread of its own while it drops the rest of
    a message over the frame limit (daemon rule 8).

    On the main socket a bomb's rest must be read before any other message
    there, and reading 8 M parts takes ~1.5 s even in C. The serving thread
    reads only as far as the decoder needs, then lends the socket here and
    goes on serving the lanes; it neither reads nor sends on the main socket
    until `back` is set (replies to its peers wait in the outbox,
    `Outbox.lend`). `done` is called from this thread once the socket is
    back (the daemon pokes its loop). A ZeroMQ socket may change threads
    this way: one user at a time, with the Event's lock as the barrier.
    """

    def __init__(self, sock: zmq.Socket, done: Callable[[], None]):
        super().__init__(name="kvd-drop-main", daemon=True)
        self.sock, self.done = sock, done
        self.halt = threading.Event()  # the daemon is closing: stop at the next batch
        self.back = threading.Event()
        self.dropped = 0
        self.seconds = 0.0
        self.start()

    def run(self) -> None:
        started = time.perf_counter()
        try:
            self.dropped = Dropper(self.sock, self.halt).rest()
        except Exception:  # noqa: BLE001 -- a closed context; the daemon is going
            log.exception("dropping a message's rest failed")
        finally:
            self.seconds = time.perf_counter() - started
            self.back.set()
            self.done()


class Offenders:
    """Processes that sent messages over the frame limit (`strike`), or were
    shed for memory while inside their first message (gate rule 3: a frame
    bomb that the memory ceiling cut off before it was whole).

    A kvd client never does the first: it learns the limit from HELLO. The
    first strike of a process is answered like any other (TOO_MANY_FRAMES,
    or the cut); a second within `window` seconds bans the process: its
    connections are shed and its new ones held unread at accept (the gate,
    `PeerGate.ban`, rule 9) for `first_ban` seconds, twice as long at each
    ban after, up to `longest`.
    A process is told by its pid (kvd.server.admission.connections.origin);
    over TCP, where one host may be many clients, nobody is banned.

    A process shed for memory inside a bomb is spared while a request of it
    was read on a connection still open (a client: its idle connection may be
    the one shed while memory fell for another reason), but only `spares`
    times within `window` when the connections shed were still sending, and
    three times as many when they were not (`spare`: a client's remade idle
    connection sends nothing; a bomber may stop sending too, its bomb whole
    but its last frame): a bomber that keeps one connection served is
    struck from then on."""

    def __init__(self, window: float = 60.0, first_ban: float = 10.0, longest: float = 300.0, clock=None,
                 spares: int = 2):
        self.window, self.first_ban, self.longest = window, first_ban, longest
        self.clock = clock or time.monotonic
        self.spares = spares
        self._last: dict[bytes, float] = {}  # origin -> its last strike
        self._bans: dict[bytes, float] = {}  # origin -> its last ban's length
        self._spared: dict[bytes, list[tuple[float, int]]] = {}  # origin -> (when, cost) of its spares within `window`
        self.strikes = self.bans = self.spared = 0

    def spare(self, who: bytes, sending: bool = True) -> bool:
        """May `who`, shed for memory inside a bomb with a request read on a
        connection still open, be spared this time? Within `window`, a spare
        while sending costs 3 and one while not 1, out of 3 x `spares`."""
        now = self.clock()
        spent = [(t, c) for t, c in self._spared.pop(who, ()) if now - t <= self.window]
        cost = 3 if sending else 1
        if sum(c for _, c in spent) + cost > 3 * self.spares:
            self._spared[who] = spent
            return False
        self._spared[who] = spent + [(now, cost)]
        self.spared += 1
        if len(self._spared) > 4096:  # the oldest half forgotten, as `_last`'s
            for k in list(self._spared)[:2048]:
                del self._spared[k]
        return True

    def strike(self, who: bytes | None) -> float | None:
        """One more oversized message from `who`: the ban's length if it is
        banned now, else None."""
        self.strikes += 1
        if who is None:
            return None
        now = self.clock()
        last, self._last[who] = self._last.get(who), now
        if len(self._last) > 4096:  # forget the oldest half: a pid is reused, a flood of them is not kept
            for k in sorted(self._last, key=self._last.__getitem__)[:2048]:
                self._last.pop(k, None)
                self._bans.pop(k, None)
        if last is None or now - last > self.window:
            return None
        ban = min(self.longest, 2 * self._bans[who]) if who in self._bans else self.first_ban
        self._bans[who] = ban
        self.bans += 1
        return ban


class Striking:
    """The Daemon's side of `Offenders` (a mixin): who is struck, and what a
    ban does to the connections the serving loop knows. It uses the daemon's
    `offenders`, `gate`, `lanes`, `_conns`, `_conn` and `ratelog`."""

    def _strike(self, identity: bytes, fd: int | None) -> None:
        """A message over the frame limit from the connection at `fd`: a
        process that keeps sending them is banned (drain.Offenders)."""
        conn = self._conn(identity, fd)
        self._strike_who(conn.origin if conn is not None else None)

    def _strike_stuck(self) -> None:
        """Processes the gate shed for memory inside a bomb (gate rule 9, `PeerGate._judge`): struck
        unless a request of theirs was read on a connection still open (a client's idle one may be shed),
        and then only a few times a minute, more if the connections shed were not sending
        (`Offenders.spare`: a bomber may keep one connection served)."""
        stuck = self.gate.stuck_senders if self.gate is not None else None
        while stuck:
            who, sending = stuck.popleft()
            served = any(c.origin == who and connection_id(c.where[0]) == c.where[1] for c in list(self._conns.values()))
            if not served or not self.offenders.spare(who, sending):
                self.struck_for_memory += 1
                self._strike_who(who)

    def _strike_who(self, who: bytes | None) -> None:
        ban = self.offenders.strike(who)
        if ban is not None and self.gate is not None:
            fds = [fd for fd, c in self._conns.items() if c.origin == who]
            for fd in fds:  # its lanes are closed; the gate cuts off its connections to the main socket
                if self.lanes is not None and (lane := self.lanes.on(fd, self._conns[fd].where[1])) is not None:
                    self.lanes.close(lane, "lanes_cut_off", linger=0)
            self.gate.ban(who, fds, ban)
            self.ratelog.warning(f"banned {who!r}", "banned %s for %.0f s: messages over the frame limit, or shed for memory inside one", who.decode(), ban)
