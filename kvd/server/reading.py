"""How the serving loop reads a message (daemon rules 8 and 9).

A request is read part by part (kvd.server.admission.parts), so a message of
many parts is read in turns and one over the frame limit is read only as far
as the decoder needs to answer TOO_MANY_FRAMES. What happens to the rest
depends on where it came:

- on a lane (kvd.server.lanes), the lane is doomed: closed once the answer is
  queued, the rest never read;
- on the main socket, whose rest must be read before any other message there,
  the socket is lent to a thread that drops the rest in C
  (kvd.server.admission.drain.Lent), the replies for its peers held meanwhile
  (Outbox.lend), and the loop takes it back when that thread is done.

Either way the sender is struck (drain.Striking): a process that keeps
sending such messages is banned. `Reading` is the Daemon's side of it (a
mixin); it uses the daemon's `parts`, `lanes`, `limits`, `outbox`, `wakeup`,
`handler`, `_conns` and the counters `peer_stats` reports.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import zmq

from kvd.protocol import codec
from kvd.protocol import errors as E
from kvd.server.admission import drain
from kvd.server.admission.connections import connection_id, origin
from kvd.server.lanes import PREFIX as LANE_PREFIX
from kvd.server.lanes import Lane

log = logging.getLogger("kvd.server")

# Frames below this size are copied out of ZeroMQ's receive buffers so a small
# tensor never pins a larger shared buffer; above it the frame itself is kept.
_KEEP_FRAME_BYTES = 64 * 1024


def kept(frames: list[zmq.Frame]) -> list:
    """A request's frames as the handler takes them (see _KEEP_FRAME_BYTES)."""
    return [f.bytes if len(f) < _KEEP_FRAME_BYTES else f.buffer for f in frames]


class Conn(NamedTuple):
    """A peer connection, as its first request found it."""

    identity: bytes
    origin: bytes | None  # the process at the other end, whose cost a new connection starts from (kvd.server.admission.turns)
    where: tuple[int, int | None]  # (fd, connection_id): what the outbox names when it asks the gate to cut it off


class Reading(drain.Striking):
    """The Daemon's reading of messages (a mixin). See the module docstring."""

    def _conn(self, identity: bytes, fd: int | None) -> Conn | None:
        """The connection a request came on (`fd`: its ZMQ_SRCFD), looked at
        once per connection (a new one on a reused fd has a new identity).
        None if unknown."""
        if fd is None:
            return None
        known = self._conns.get(fd)
        if known is None or known.identity != identity:
            if known is not None:
                self._fresh.discard(known.identity)
            known = self._conns[fd] = Conn(identity, origin(fd), (fd, connection_id(fd)))
            self._fresh.add(identity)  # no request of it charged yet (turns.py: what connecting cost)
        return known

    def _recv(self, sock: zmq.Socket, whole: bool = False) -> list[zmq.Frame]:
        """One message, part by part (ZeroMQ delivers a message whole, so once
        its first part is here the rest is too). Parts past what the decoder
        needs to say TOO_MANY_FRAMES are read and dropped at once: a message of
        millions of empty frames costs no memory (recv_multipart would keep a
        Frame object for each, ~280 bytes apiece). A lane's message comes
        under the lane's identity (_recv_lane)."""
        lane = self.lanes.by_sock.get(sock) if self.lanes is not None else None
        if lane is not None:
            return self._recv_lane(lane, whole)
        cpu = time.thread_time()
        parts, more, before = self.parts.read(sock, self.limits.max_frames, whole, refuse=self._refusable)
        if self.lanes is not None and parts[0].bytes.startswith(LANE_PREFIX):
            # A routing id a peer chose to look like a lane's (kvd.server.lanes
            # rule 5): its requests would be served, and answered, as that
            # lane's client's. Not served; its connection cut, its rest dropped.
            self.spoofed_lanes += 1
            fd = parts[1].get(zmq.SRCFD) if len(parts) > 1 else None
            if fd is not None:
                self._cut_off((fd, connection_id(fd)))
            if more:
                self._lend_main(sock)
            raise zmq.Again()
        if not more:
            return parts
        # A frame bomb: answered here (the reply waits in the outbox until
        # the socket is back), the rest dropped in C by a thread the socket
        # is lent to (rule 8), and a process that keeps sending them is
        # banned (drain.Offenders).
        self._lend_main(sock)
        self._too_many_frames(parts)
        self._strike(parts[0].bytes, parts[1].get(zmq.SRCFD))
        self.main_bomb_cpu += time.thread_time() - cpu + before
        raise zmq.Again()  # nothing to serve: the next socket's message

    def _too_many_frames(self, parts: list) -> None:
        """Answer a message over the frame limit (`parts`: its first ones)."""
        err = E.TooManyFrames(f"more than {self.limits.max_frames} frames; the limit is {self.limits.max_frames}")
        self.handler.errors[err.name] += 1
        self._send(parts[0].bytes, codec.encode_error(err, id=codec.peek_id([parts[1].bytes]) if len(parts) > 1 else 0))

    def _take_back_main(self) -> None:
        """A stop: the thread dropping a bomb's rest stops at its next batch
        (~10 ms) and the main socket is the loop's again, its held replies
        sent. If it never comes back, it is not closed under that thread."""
        lent, self._lent = self._lent, None
        if lent is None:
            return
        lent.halt.set()
        if not lent.back.wait(5.0):
            log.error("the thread dropping a frame bomb did not stop; leaving the main socket open")
            self._sock = None
            return
        self._taken_back(lent)

    def _taken_back(self, lent: drain.Lent) -> None:
        """The main socket is the loop's again: what the drop cost is
        counted, and the replies held for its peers are sent."""
        self._lent = None
        self.dropped_frames += lent.dropped
        self.dropping_seconds += lent.seconds
        self.lent_seconds += lent.seconds
        if self.outbox is not None:
            self.outbox.give_back()

    def _lend_main(self, sock: zmq.Socket) -> None:
        """Rule 8: lend the main socket to a thread that drops the rest of
        the message being read; the loop takes it back when it is done."""
        if self.outbox is not None:
            self.outbox.lend()
        self._lent = drain.Lent(sock, self.wakeup.poke)

    def _recv_lane(self, lane: Lane, whole: bool = False) -> list[zmq.Frame]:
        """One message from `lane`, as `_recv` returns it. A message over the
        frame limit is read only as far as the decoder needs to answer
        TOO_MANY_FRAMES, and its lane is doomed: closed once the answer is
        queued, the rest never read (kvd.server.lanes). The bulk of a long
        message is read in C, so a bomb costs milliseconds."""
        sock = lane.sock
        started, cpu = time.perf_counter(), time.thread_time()
        parts, more, before = self.parts.read(sock, self.limits.max_frames, whole, refuse=self._refusable)
        lane.seen(parts[0].bytes, parts[1].get(zmq.SRCFD) if len(parts) > 1 else None)
        parts[0] = zmq.Frame(lane.identity)
        if not more:
            return parts
        # Over the limit: answered here (the handler would only count the
        # frames), the lane doomed, the rest never read.
        self._too_many_frames(parts)
        self.lanes.doom(lane)  # type: ignore[union-attr]
        self._strike(lane.identity, lane.conn[0] if lane.conn is not None else None)
        self.dropping_seconds += time.perf_counter() - started
        self.lane_bomb_cpu += time.thread_time() - cpu + before
        raise zmq.Again()  # nothing to serve: the next socket's message
