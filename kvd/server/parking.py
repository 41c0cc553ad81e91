"""Write-through PUTs waiting for the disk: their replies, parked.

Theory of operation
-------------------
In write-through mode a PUT is acknowledged only once every entry it carries
has its blob fsynced and its index row committed. The daemon's loop must not
wait for that (other peers would wait with it), so the handler stores the
entries, queues their writes, and the loop *parks* the reply here, keyed by
the entry ids still being written. The SSD writer thread, after each batch
(fsync of every blob, one LMDB commit for all: a group commit), reports
which entries became durable and which were dropped; `Wakeup` carries that
news across threads and wakes the loop's poller, and `settle` hands back the
replies now complete: the acknowledgement if every entry is durable, else a
NOT_PERSISTED error. A PUT is never acknowledged for an entry that is not on
disk.

Bounds. Parked PUTs hold their entries' bytes until the disk takes them, so
they are bounded: at most `max_bytes` in all (an oversized PUT is admitted
only alone) and `max_per_peer` PUTs per peer. `admit` answers before the PUT
is stored; past a bound the peer gets BUSY and nothing is kept.

Rules:
1. News about an entry that is queued again by the time it arrives is not
   about the copy a PUT waits for (spill.py, ordering rule): it is ignored,
   and the PUT waits for the next write.
2. A reply leaves this module exactly once: settled, failed, or expired at
   stop (`fail_all`).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from kvd.protocol.errors import BACKLOG_FULL


@dataclass(eq=False)
class Parked:
    """One PUT waiting: who asked, what to answer, what it waits for."""

    peer: bytes
    msg_id: int
    fields: dict[str, Any]
    waiting: set[bytes]
    nbytes: int
    failed: list[bytes] = field(default_factory=list)
    rtype: str = "PUT"  # the reply's type: PUT, COMMIT for a PUT made over shared memory, SLOTS (its pages reserved)


class Parking:
    """Parked write-through PUT replies (and, parked alike, requests waiting for
    the remote tier and SLOTS waiting for their pages: kvd/server/handler.py,
    `Deferred`; the counters are the PUTs'). Daemon thread only."""

    def __init__(self, max_bytes: int, max_per_peer: int = 64):
        self.max_bytes = int(max_bytes)
        self.max_per_peer = max_per_peer
        self.bytes = 0
        self._by_eid: dict[bytes, list[Parked]] = {}
        self._per_peer: dict[bytes, int] = {}
        self._count = 0
        self.counters = {"parked": 0, "acknowledged": 0, "not_persisted": 0, "refused": 0}

    def __len__(self) -> int:
        return self._count

    def admit(self, peer: bytes, nbytes: int, *, reserved: int = 0) -> str | None:
        """None if a PUT of `nbytes` from `peer` may park, besides `reserved`
        bytes of PUTs on their way (shared-memory grants); else why not. The
        reason says BACKLOG_FULL: a client need not send that PUT over frames."""
        if self._per_peer.get(peer, 0) >= self.max_per_peer:
            self.counters["refused"] += 1
            return f"this client already has {self.max_per_peer} PUTs {BACKLOG_FULL}"
        if (self._count or reserved) and self.bytes + reserved + nbytes > self.max_bytes:
            self.counters["refused"] += 1
            return f"{(self.bytes + reserved) >> 20} MiB of PUTs are {BACKLOG_FULL} (dirty_max_mb is {self.max_bytes >> 20})"
        return None

    def park(
        self, peer: bytes, msg_id: int, fields: dict[str, Any], eids: list[bytes], nbytes: int, rtype: str = "PUT"
    ) -> None:
        p = Parked(peer, msg_id, fields, set(eids), nbytes, rtype=rtype)
        for eid in p.waiting:
            self._by_eid.setdefault(eid, []).append(p)
        self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        self._count += 1
        self.bytes += nbytes
        if rtype != "SLOTS":
            self.counters["parked"] += 1

    def settle(
        self, results: list[tuple[bytes, bool]], still_queued: Callable[[bytes], bool]
    ) -> list[Parked]:
        """Apply the writer's news; return the PUTs now complete (rule 1)."""
        done: list[Parked] = []
        for eid, ok in results:
            waiters = self._by_eid.get(eid)
            if not waiters or still_queued(eid):
                continue
            del self._by_eid[eid]
            for p in waiters:
                p.waiting.discard(eid)
                if not ok:
                    p.failed.append(eid)
                if not p.waiting:
                    done.append(p)
        for p in done:
            self._release(p)
        return done

    def fail_all(self) -> list[Parked]:
        """Every PUT still parked (at stop), each marked failed."""
        out: dict[int, Parked] = {}
        for waiters in self._by_eid.values():
            for p in waiters:
                out[id(p)] = p
        self._by_eid.clear()
        for p in out.values():
            p.failed.extend(p.waiting)
            p.waiting.clear()
            self._release(p)
        return list(out.values())

    def _release(self, p: Parked) -> None:
        self._count -= 1
        self.bytes -= p.nbytes
        left = self._per_peer[p.peer] - 1
        if left:
            self._per_peer[p.peer] = left
        else:
            del self._per_peer[p.peer]
        if p.rtype != "SLOTS":  # (a SLOTS waits for its pages, not for the disk)
            self.counters["not_persisted" if p.failed else "acknowledged"] += 1

    def stats(self) -> dict[str, Any]:
        return {"waiting": self._count, "waiting_bytes": self.bytes, "max_bytes": self.max_bytes, **self.counters}


class Wakeup:
    """Writer-thread news for the loop, and a pipe whose read end the loop polls."""

    def __init__(self):
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._lock = threading.Lock()
        self._news: deque = deque()

    @property
    def fd(self) -> int:
        return self._r

    @property
    def write_fd(self) -> int:
        return self._w

    def post(self, item: Any) -> None:
        """Any thread: queue `item` and wake the loop (nothing, once closed)."""
        with self._lock:
            if self._w < 0:
                return
            self._news.append(item)
            try:
                os.write(self._w, b"\0")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already: the loop will look

    def poke(self) -> None:
        """Wake the loop, nothing more: safe in a signal handler (no lock)."""
        try:
            os.write(self._w, b"\0")
        except OSError:
            pass  # full (the loop wakes anyway) or closed (no loop to wake)

    def take(self) -> list[Any]:
        """Loop thread: everything posted so far."""
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            items = list(self._news)
            self._news.clear()
        return items

    def close(self) -> None:
        """Idempotent; posts after it are ignored (the writer may outlive the loop)."""
        with self._lock:
            fds, self._r, self._w = (self._r, self._w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)
