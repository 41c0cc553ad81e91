"""Requests read off the socket and ready to serve: reads before writes.

Theory of operation
-------------------
A ROUTER socket hands the loop one message from each peer that has one, in
turn. With four peers storing prompts back to back (a LOOKUP, a SLOTS and a
COMMIT each, ~0.3 ms of the serving thread apiece), a model server's GET
waits behind a request of every one of them, every time (issue 44: its p99
8x its idle one). Their requests cost what the GET costs, so no measure of
cost tells them apart; what does is who waits. A model server waits for a
GET or a LOOKUP before its prefill; a store is written behind its
generation (kvd_client's writer thread), and nobody's first token waits
for it. The deadline I/O scheduler orders a disk's reads before its writes
for the same reason.

So the loop reads everything waiting on the socket into this queue (up to
its bound) and serves reads first -- every request but PUT, SLOTS, COMMIT
and GC, by the type its header names (codec.peek_type) -- and otherwise in
arrival order. A GET then waits for the request being served, not for one
of every other peer's. Peers whose requests cost more than `Turns.heavy_s`
never come here: they wait for their turns there.

Rules:
1. A peer's requests are served in the order they came: only each peer's
   oldest request is a candidate, and it counts as a write if any of that
   peer's waiting requests is one (a read cannot overtake its own write).
   Among peers of one class, the one served longest ago goes first, as the
   socket's own fair queue would have it: a peer that sent 60 GETs at once
   does not put a client's GET behind all 60.
2. Nothing waits for ever: a peer's oldest request passed over
   `max_passes` times (counted from when it became its peer's oldest) goes
   next, so writes keep flowing under any stream of reads.
3. What waits here is bounded: at most `max_waiting` requests and
   `max_bytes` in all; without room the loop stops reading the socket
   (libzmq's queues, bounded by their high-water marks, hold the rest).
4. No I/O and no clock. The type is a hint read before the request is
   decoded: a peer that names a write a read only moves itself ahead of
   writes, and is checked in full when served.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator

WRITES = frozenset({"PUT", "SLOTS", "COMMIT", "GC"})


class Ready:
    """Requests received, waiting to be served; see the module docstring."""

    def __init__(self, *, max_waiting: int = 64, max_bytes: int = 64 << 20, max_passes: int = 16):
        self.max_waiting = max_waiting
        self.max_bytes = max_bytes
        self.max_passes = max_passes
        self.bytes = 0
        self._n = 0
        self._seq = 0  # arrival order
        self._pops = 0
        # peer -> its waiting requests, oldest first: (seq, request, nbytes, a write?)
        self._peers: dict[bytes, deque[tuple[int, Any, int, bool]]] = {}
        self._head_since: dict[bytes, int] = {}  # peer -> pops when its oldest request became its oldest
        self._writes: dict[bytes, int] = {}  # peer -> how many of its waiting requests are writes
        self._served_at: dict[bytes, int] = {}  # peer -> pops when it was last served, while it has more waiting
        self.counters = {"reordered": 0}
        self.last_write = False  # the request pop() returned last is a write (someone waits on the others)
        self.last_type: str | None = None  # and its type, as its first bytes name it

    def __len__(self) -> int:
        return self._n

    def room(self, nbytes: int = 0) -> bool:
        """May one more request of `nbytes` wait (rule 3)? One always may when none waits."""
        return self._n == 0 or (self._n < self.max_waiting and self.bytes + nbytes <= self.max_bytes)

    def put(self, peer: bytes, request: Any, nbytes: int, mtype: str | None) -> None:
        """Keep `request` (check `room()` first); `mtype` its header's type, if it names one."""
        write = mtype in WRITES
        if peer not in self._peers:
            self._peers[peer] = deque()
            self._head_since[peer] = self._pops
        self._peers[peer].append((self._seq, request, nbytes, write, mtype))
        if write:
            self._writes[peer] = self._writes.get(peer, 0) + 1
        self._seq += 1
        self._n += 1
        self.bytes += nbytes

    def pop(self) -> Any | None:
        """The next request to serve (rules 1 and 2), or None."""
        if not self._n:
            return None
        best = longest = None
        writes, since = self._writes, self._head_since
        for peer, q in self._peers.items():
            seq = q[0][0]
            if longest is None or (since[peer], seq) < longest[0]:
                longest = ((since[peer], seq), peer)
            key = (peer in writes, self._served_at.get(peer, -1), seq)
            if best is None or key < best[0]:
                best = (key, peer)
        assert best is not None and longest is not None
        # Rule 2: the request passed over longest, once passed over max_passes times.
        peer = longest[1] if self._pops - longest[0][0] >= self.max_passes else best[1]
        if peer != longest[1]:
            self.counters["reordered"] += 1
        return self._take(peer)

    def _take(self, peer: bytes) -> Any:
        q = self._peers[peer]
        _, request, nbytes, write, self.last_type = q.popleft()
        self.last_write = write
        if q:
            self._served_at[peer] = self._head_since[peer] = self._pops + 1
        else:
            del self._peers[peer], self._head_since[peer]
            self._served_at.pop(peer, None)
        if write:
            left = self._writes[peer] - 1
            if left:
                self._writes[peer] = left
            else:
                del self._writes[peer]
        self._n -= 1
        self._pops += 1
        self.bytes -= nbytes
        return request

    def drain(self) -> Iterator[Any]:
        """Every waiting request, oldest first, removed (for a stop's refusals)."""
        items = sorted((e for q in self._peers.values() for e in q), key=lambda e: e[0])
        self._peers.clear()
        self._head_since.clear()
        self._writes.clear()
        self._served_at.clear()
        self._n, self.bytes = 0, 0
        for e in items:
            yield e[1]

    def peers_waiting(self, peer: bytes) -> bool:
        return peer in self._peers

    def stats(self) -> dict[str, int]:
        return {"ready": self._n, **self.counters}
