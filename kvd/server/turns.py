"""Requests from peers that keep the daemon busy wait while others are served.

Theory of operation
-------------------
A ROUTER socket fair-queues its peers: one message from each peer that has
one waiting, in turn. That is fair in messages, not in work: with eight
peers sending requests that take milliseconds each (LOOKUPs of a million
tokens, GETs read from the SSD tier), a client's 0.3 ms GET waits behind
eight of them, every time.

So each peer has a *cost*: the serving thread's time its requests took
beyond `free_s` each, plus the time their bytes took to arrive
(`BYTE_SECONDS` per byte: a 4 MiB header costs libzmq's I/O thread far more
than it costs the loop), decayed with a half-life of `half_life` seconds.
Ordinary requests (a GET of a RAM hit, a PUT of a few chunks, a PING) cost
nothing; a peer whose cost is over `heavy_s` is *heavy*. The loop serves
what it receives at once, in the socket's order, except a heavy peer's
requests: those wait here, and get their turn when the socket has nothing
else. So a heavy peer is served in full whenever nobody else asks, and
never ahead of a peer that is not heavy.

Rules:
1. A peer's requests are served in the order they came: once one waits
   here, its later ones wait behind it.
2. Nothing waits for ever: a request that `max_passes` others have been
   served ahead of goes next.
3. What waits here is bounded: at most `max_waiting` requests, `max_bytes`
   in all. Without room for one more, the oldest waiting are served first;
   a request over `max_bytes` alone is served at once, when its peer has
   nothing waiting.
4. No I/O and no clock of its own: the loop passes the time (testable with
   any clock).
"""

from __future__ import annotations

from collections import deque
from typing import Any

# Seconds charged per byte a request carries: ~2 GB/s, what receiving it
# through a unix socket and libzmq costs this machine's CPUs.
BYTE_SECONDS = 0.5e-9


class Turns:
    """Heavy peers' requests waiting for a quiet moment, and each peer's cost."""

    def __init__(
        self,
        *,
        max_waiting: int = 16,
        max_bytes: int = 8 << 20,
        max_passes: int = 64,
        half_life: float = 0.25,
        free_s: float = 0.0005,
        heavy_s: float = 0.001,
    ):
        self.max_waiting = max_waiting
        self.max_bytes = max_bytes
        self.max_passes = max_passes
        self.half_life = half_life
        self.free_s = free_s
        self.heavy_s = heavy_s
        self.bytes = 0
        self._served = 0  # requests served so far: a waiting request's passes are this minus its mark
        self._waiting: deque[tuple[int, bytes, int, Any]] = deque()  # (mark, peer, nbytes, request), oldest first
        self._per_peer: dict[bytes, int] = {}
        self._cost: dict[bytes, tuple[float, float]] = {}  # peer -> (cost, when it was that); only peers with a cost
        self.counters = {"deferred": 0, "overdue": 0}

    def __len__(self) -> int:
        return len(self._waiting)

    # -- the loop's questions ------------------------------------------------------
    def defers(self, peer: bytes, now: float) -> bool:
        """Must `peer`'s request wait (it is heavy, or its earlier ones wait: rule 1)?"""
        return peer in self._per_peer or self.cost(peer, now) > self.heavy_s

    def room(self, nbytes: int) -> bool:
        """May a request of `nbytes` wait (rule 3)?"""
        return len(self._waiting) < self.max_waiting and self.bytes + nbytes <= self.max_bytes

    def put(self, peer: bytes, request: Any, nbytes: int) -> None:
        """Keep `request` until its turn (check `room()` first)."""
        self._waiting.append((self._served, peer, nbytes, request))
        self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        self.bytes += nbytes
        self.counters["deferred"] += 1

    def overdue(self) -> Any | None:
        """The oldest waiting request if `max_passes` others went ahead of it (rule 2)."""
        if self._waiting and self._served - self._waiting[0][0] >= self.max_passes:
            self.counters["overdue"] += 1
            return self.pop()
        return None

    def pop(self) -> Any | None:
        """The oldest waiting request (the socket is quiet, or room is needed), or None."""
        if not self._waiting:
            return None
        _, peer, nbytes, request = self._waiting.popleft()
        left = self._per_peer[peer] - 1
        if left:
            self._per_peer[peer] = left
        else:
            del self._per_peer[peer]
        self.bytes -= nbytes
        return request

    # -- costs ---------------------------------------------------------------------
    def cost(self, peer: bytes, now: float) -> float:
        """`peer`'s decayed cost at `now`, in seconds."""
        got = self._cost.get(peer)
        if got is None:
            return 0.0
        value, at = got
        return value * 0.5 ** ((now - at) / self.half_life) if now > at else value

    def charge(self, peer: bytes, seconds: float, nbytes: int, now: float) -> None:
        """`peer`'s request took `seconds` of the serving thread and carried `nbytes`."""
        self._served += 1
        extra = seconds - self.free_s + nbytes * BYTE_SECONDS
        if extra > 0:
            self._cost[peer] = (self.cost(peer, now) + extra, now)

    def forget(self, now: float) -> None:
        """Drop the costs that have decayed to nothing (peers come and go: the map must not grow)."""
        for peer in [p for p in self._cost if self.cost(p, now) < self.heavy_s / 64]:
            del self._cost[peer]

    def stats(self) -> dict[str, int]:
        return {"waiting_turn": len(self._waiting), "peers_with_cost": len(self._cost), **self.counters}
