"""Reading a message part by part, in turns (the daemon's rules 8 and 9).

ZeroMQ hands a socket's messages out one at a time, whole: once a message's
first part is read, its other parts are there, and no other message of that
socket can be read before them. Other sockets can: a socket in the middle of
a message stays readable, so the serving loop may read some of its parts,
serve what waits on other sockets (the lanes, kvd.server.lanes), and come
back. `PartReader.read` does one such turn: `TURN_PARTS` parts through pyzmq
(zero-copy frames), or past `PYZMQ_PARTS` parts, `TURN_C_PARTS` in C
(drain.read_some: ~0.1 us a part, each part's bytes copied), so a frame bomb's
first `max_frames` parts cost the loop ~20-35 ms in turns of ~0.5-1 ms, and a
PUT of up to 8,192 parts keeps its frames uncopied. A message is read only as
far as the decoder needs to say TOO_MANY_FRAMES (`max_frames` + 1 parts, the
identity first); what is left past that is the caller's to drop.
"""

from __future__ import annotations

import time
from typing import Callable

import zmq

from kvd.server.admission import drain

TURN_PARTS = 512  # a turn through pyzmq: ~0.5 ms
TURN_C_PARTS = 2048  # a turn in C, past PYZMQ_PARTS
PYZMQ_PARTS = 8192


class Truncated(list):
    """A message refused from its header (`PartReader.read`'s `refuse`): its
    first two parts, the identity and the header; the rest was dropped unread
    (`dropped` parts of `dropped_bytes`, charged to its peer as if read)."""

    dropped = 0
    dropped_bytes = 0


class PartReader:
    """Messages being read in turns, per socket; owned by the serving thread."""

    def __init__(self):
        # parts read so far, CPU they took, and (a message refused from its
        # header) the parts and bytes after it dropped so far, else None
        self.partial: dict[zmq.Socket, tuple[list, float, tuple[int, int] | None]] = {}
        self.turns = 0  # turns cut short, in all
        self.refused = 0  # messages refused from their header, their rest dropped unread

    def forget(self, sock: zmq.Socket) -> None:
        """`sock` is closed: what was read of its message goes with it."""
        self.partial.pop(sock, None)

    def read(self, sock: zmq.Socket, max_frames: int, whole: bool = False,
             refuse: Callable[[zmq.Frame], bool] | None = None) -> tuple[list, bool, float]:
        """The next message on `sock` (or the rest of the one begun), read as
        far as the decoder needs: (parts, True, cpu) if parts are left past
        `max_frames` + 1; `cpu` is what its earlier turns took of this
        thread. Unless `whole`, one turn: when it ends before the message
        does, its parts wait here and zmq.Again is raised (the loop serves
        what else waits and comes back). `refuse(header)`: True if a message
        with more parts after that header is answered from the header alone
        (a write-back PUT while the backlog is full): its rest is dropped in
        C, in turns of TURN_C_PARTS, and it comes back `Truncated`; past
        `max_frames` it is what any message that long is, (parts, True, cpu):
        a frame bomb, its sender's to pay for as every bomb's."""
        keep = max_frames + 2  # the identity, then one frame over the limit
        held = self.partial.pop(sock, None)
        if held is None:
            frame = sock.recv(flags=zmq.NOBLOCK, copy=False)
            parts, more, before, dropped = [frame], frame.more, 0.0, None
            if more and refuse is not None:
                header = sock.recv(copy=False)
                parts.append(header)
                more = header.more
                dropped = (0, 0) if more and refuse(header) else None
        else:
            parts, before, dropped = held
            more = True
        if dropped is not None:
            cpu = time.thread_time()
            most = keep - len(parts) - dropped[0]  # parts up to one over the limit
            n, nbytes, more = drain.drop_some(sock, most if whole else min(most, TURN_C_PARTS))
            dropped = (dropped[0] + n, dropped[1] + nbytes)
            if more and dropped[0] < keep - len(parts):
                self._later(sock, parts, before + time.thread_time() - cpu, dropped)
            if more:  # over the limit: a frame bomb (the caller drops the rest)
                return parts, True, before
            self.refused += 1
            out = Truncated(parts)
            out.dropped, out.dropped_bytes = dropped
            return out, False, before
        limit = min(keep, PYZMQ_PARTS)
        # (A turn is TURN_PARTS after the identity, the header read for `refuse` among them.)
        stop = limit if whole else min(limit, (1 if held is None else len(parts)) + TURN_PARTS)
        cpu = time.thread_time()
        while more and len(parts) < stop:
            frame = sock.recv(copy=False)
            more = frame.more
            parts.append(frame)
        if more and len(parts) < limit:
            self._later(sock, parts, before + time.thread_time() - cpu)
        while more and len(parts) < keep:
            got, more = drain.read_some(sock, keep - len(parts) if whole else min(keep - len(parts), TURN_C_PARTS))
            parts += got
            if not whole:
                break
        if more and len(parts) < keep:
            self._later(sock, parts, before + time.thread_time() - cpu)
        if limit < len(parts) and not more:  # a long message within the limit (rare): its parts as frames
            parts[limit:] = [zmq.Frame(p) for p in parts[limit:]]
        return parts, more, before

    def _later(self, sock: zmq.Socket, parts: list, cpu: float, dropped: tuple[int, int] | None = None) -> None:
        self.partial[sock] = (parts, cpu, dropped)
        self.turns += 1
        raise zmq.Again()
