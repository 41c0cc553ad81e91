"""Lanes: a socket of its own per client, so a frame bomb costs its sender.

Theory of operation
-------------------
ZeroMQ makes a multipart message visible only once it is whole, and a socket
hands its messages out one at a time: on one ROUTER socket, a message of
millions of empty frames must be read to its end before any other peer's
(kvd/server/admission/drain.py). A lane is a ROUTER the daemon binds for one
client alone, offered in the HELLO reply (`lane`, to a HELLO that asked with
`lanes: true`); the client sends its later requests there. Each lane is its
own socket, so the serving loop reads a message on one lane without touching
the others, and a message over the frame limit is answered TOO_MANY_FRAMES
and its lane closed (`doom`, then `close_doomed` once the answer is queued):
libzmq frees the unread rest on its own reaper thread, never the serving one.

Rules the lanes keep:
1. A lane is an ipc socket in the main socket's own folder (0700, made by
   `kvd serve`): whoever may reach the main socket may reach a lane, nobody
   else. Its name carries 96 random bits, so another client of the same user
   cannot guess it. No lanes over tcp: a lane there would need a port per
   client and its own CURVE handshake; tcp clients stay on the main socket.
2. At most `most` lanes (the daemon's max_peers): a HELLO past that is
   offered none, and its client stays on the main socket.
3. Lanes do not leak: one whose client never sent on it within `grace`
   seconds, or whose connection is gone (its fd closed or reused: the
   connection id changed) and nothing came on it for `gone_grace` seconds
   since, is closed at a `reap`. The wait lets a client that remade its
   socket (a new connection, maybe on another fd) be seen on it again.
4. What is done to a connection is done to a lane's: a peer the outbox cuts
   off (a hog, a muted peer) or a banned process (drain.Offenders) has its
   lane closed (`on` finds it by fd and connection id). The gate's accept
   limits and peer count concern the main socket, where every client comes
   first; lanes are bounded by rule 2. The gate learns the lanes'
   connections from the accept guard and sheds them over the memory
   ceiling like the main socket's (gate rule 10).
5. Replies find their lane by identity: requests from a lane reach the
   serving loop under the lane's own identity (`PREFIX` + its token), which
   `route` turns back into the lane's socket and its peer's routing id. The
   main socket's own peers have libzmq's identities, which start with a zero
   byte, so the two never meet -- unless a peer sets its own routing id
   (ZMQ_ROUTING_ID) to look like a lane's: such a message on the main socket
   is dropped unserved and its connection cut (kvd/server/reading.py), so no
   peer is answered as another's lane, nor sends replies to it.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from pathlib import Path
from typing import Callable

import zmq

from kvd.server.admission.connections import connection_id

log = logging.getLogger("kvd.server")

PREFIX = b"\x01lane"
_PATH_MAX = 100  # ipc paths: 107 bytes on Linux, 104 on macOS, less a margin


class Lane:
    """One client's socket and what the daemon knows of its connection."""

    __slots__ = ("identity", "sock", "endpoint", "peer", "conn", "born", "doomed", "gone")

    def __init__(self, identity: bytes, sock: zmq.Socket, endpoint: str, born: float):
        self.identity, self.sock, self.endpoint, self.born = identity, sock, endpoint, born
        self.peer: bytes | None = None  # the client's routing id on this socket
        self.conn: tuple[int, int | None] | None = None  # (fd, connection id) of its connection
        self.doomed = False
        self.gone: float | None = None  # when its connection was first found gone

    def seen(self, peer: bytes, fd: int | None) -> None:
        """A message came from `peer` on the connection at `fd`."""
        self.peer, self.gone = peer, None
        if fd is not None and (self.conn is None or self.conn[0] != fd):
            self.conn = (fd, connection_id(fd))


class Lanes:
    """The daemon's lanes, owned by the serving thread (see the module docstring)."""

    def __init__(self, ctx: zmq.Context, folder: Path, *, most: int, configure: Callable[[zmq.Socket], None],
                 grace: float = 10.0, gone_grace: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.ctx, self.folder, self.most, self.configure = ctx, folder, most, configure
        self.grace, self.gone_grace, self.clock = grace, gone_grace, clock
        self.by_identity: dict[bytes, Lane] = {}
        self.by_sock: dict[zmq.Socket, Lane] = {}
        self.added: list[Lane] = []  # opened since the loop last looked (it registers them with its poller)
        self.removed: list[Lane] = []  # closed since (it unregisters them)
        self.doomed: list[Lane] = []  # to close once their last answer is queued
        self.counters = dict.fromkeys(("lanes_opened", "lanes_refused", "lanes_closed_gone", "lanes_closed_unused",
                                       "lanes_closed_for_frames", "lanes_cut_off"), 0)

    @staticmethod
    def possible(folder: Path) -> bool:
        return len(str(folder)) + 32 <= _PATH_MAX

    def open(self) -> str | None:
        """Bind a new lane; its endpoint, or None (rule 2, or it could not be bound)."""
        if len(self.by_identity) >= self.most:
            self.counters["lanes_refused"] += 1
            return None
        token = secrets.token_hex(12)
        endpoint = f"ipc://{self.folder / f'l-{token}.sock'}"
        sock = None
        try:
            sock = self.ctx.socket(zmq.ROUTER)
            self.configure(sock)
            sock.bind(endpoint)
        except zmq.ZMQError as err:  # out of fds or sockets: the client stays on the main socket
            if sock is not None:
                sock.close(linger=0)
            self.counters["lanes_refused"] += 1
            log.warning("could not open a lane (%s): the client stays on the main socket", err)
            return None
        lane = Lane(PREFIX + bytes.fromhex(token), sock, endpoint, self.clock())
        self.by_identity[lane.identity] = self.by_sock[sock] = lane
        self.added.append(lane)
        self.counters["lanes_opened"] += 1
        return endpoint

    def route(self, identity: bytes) -> tuple[zmq.Socket, bytes] | None:
        """Where a reply to `identity` goes: its lane's socket and peer; None if
        the lane is gone (the reply is dropped: its client asks HELLO again)."""
        lane = self.by_identity.get(identity)
        if lane is None or lane.peer is None:
            return None
        return lane.sock, lane.peer

    def on(self, fd: int, conn_id: int | None) -> Lane | None:
        """The lane whose connection is (fd, conn_id), if any."""
        for lane in self.by_identity.values():
            if lane.conn is not None and lane.conn[0] == fd and (conn_id is None or lane.conn[1] == conn_id):
                return lane
        return None

    def doom(self, lane: Lane) -> None:
        """A message over the frame limit came on `lane`: it is closed once its answer is queued."""
        lane.doomed = True
        self.doomed.append(lane)

    def close_doomed(self) -> None:
        for lane in self.doomed:
            self.close(lane, "lanes_closed_for_frames")
        self.doomed.clear()

    def close(self, lane: Lane, why: str | None = None, linger: int = 500) -> None:
        """Close `lane`. A short linger lets its last answer out; what it has
        not read (the rest of a frame bomb) libzmq frees on its reaper thread."""
        if self.by_identity.pop(lane.identity, None) is None:
            return
        self.by_sock.pop(lane.sock, None)
        self.removed.append(lane)
        if lane in self.added:
            self.added.remove(lane)
        lane.sock.close(linger=linger)
        if why is not None:
            self.counters[why] += 1

    def reap(self) -> None:
        """Close lanes nobody uses (rule 3)."""
        now = self.clock()
        for lane in list(self.by_identity.values()):
            if lane.conn is None:
                if now - lane.born > self.grace:
                    self.close(lane, "lanes_closed_unused", linger=0)
            elif lane.conn[1] is None or connection_id(lane.conn[0]) != lane.conn[1]:
                if lane.gone is None:
                    lane.gone = now
                elif now - lane.gone > self.gone_grace:
                    self.close(lane, "lanes_closed_gone", linger=0)

    def close_all(self, linger: int = 500) -> None:
        for lane in list(self.by_identity.values()):
            self.close(lane, linger=linger)
        self.added.clear()
        self.removed.clear()
        self.doomed.clear()

    def stats(self) -> dict:
        return {"lanes": len(self.by_identity), **self.counters}


def folder_of(ipc: Path | None) -> Path | None:
    """The folder lanes are bound in (the main socket's), or None: no lanes."""
    if ipc is None or not Lanes.possible(ipc.parent) or not os.path.isdir(ipc.parent):
        return None
    return ipc.parent
