"""A writer the disk keeps refusing hears so later: its BUSY is held a while.

Theory of operation
-------------------
While the write-behind backlog is at its bound (kvd.store.tiered, PUT), the
daemon refuses PUT and SLOTS with BUSY ("not on disk yet"), and cheaply:
from the header's first bytes, the other frames dropped in C as they are
read (kvd.server.admission.parts). Cheap for the daemon, not for the
machine: a peer that sends again the moment it is answered spends a core
building and sending what will be refused, and the daemon's I/O thread
receives it. Measured (bench_stress tiny-flood, 2 cores): a peer resending
PUTs of 8,000 tiny chunks took a third of a core, refused 6-8 times a
second, and a model server's GET p99 was 2.1-3.2x idle; the same peer
waiting 0.5 s after each BUSY took none, and the GET p99 was 1.3-1.4x.

So a process refused for the backlog again soon after its last refusal was
answered hears the next one later: the first refusal of a *streak* is
answered at once, the n-th is held `first_s` x 2^(n-2), at most `max_s`
(0.5 s: well inside a client's timeout, the adapters' 1 s; a BUSY held past
it would reach the client as a daemon that did not answer). A
refusal within `window_s` of the streak's last answer continues it; a write
of that process taken (not refused for the backlog) ends it. A held
answer goes out when its time comes, or as soon as the backlog has room
again (the loop asks at its tick), when the resend it prompts may be taken.
A client that sends one request at a time (the reference client) is so
paced to the disk, and spends nothing meanwhile; the reference client's
uploads run on a thread of their own (a model server's generation thread
does not wait for them unless it stores with wait=True).

"A process" is the one at the other end of a unix socket, where the daemon
knows it (its origin: kvd.server.admission.turns `whose`): new connections do
not start a new streak. Over TCP each connection is its own.

Rules:
1. Only refusals for the backlog are held (write-back's "not on disk yet",
   write-through's parking bound): no other answer waits here.
2. Only the answer is kept: the request's frames are let go (or were
   dropped unread) before it waits. At most `max_per_who` answers of one
   process and `max_held` in all wait; past either, the answer goes at
   once (a peer that pipelines gains nothing by it but its own answers).
3. Nothing held outlives the daemon: at a stop every held answer is sent.
4. No I/O and no clock of its own: the loop passes the time (testable with
   any clock), as in turns.py.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from typing import Any, Hashable


class Backoff:
    """Held answers to refused writes, and each process's streak of refusals."""

    def __init__(self, *, first_s: float = 0.05, max_s: float = 0.5, window_s: float = 1.0,
                 max_per_who: int = 4, max_held: int = 1024):
        self.first_s, self.max_s, self.window_s = first_s, max_s, window_s
        self.max_per_who, self.max_held = max_per_who, max_held
        self._streak: dict[Hashable, tuple[int, float]] = {}  # who -> (refusals in a row, when the last is answered)
        self._held: list[tuple[float, int, Hashable, Any, float]] = []  # a heap of (answer at, order, who, answer, since)
        self._per_who: Counter = Counter()
        self._order = itertools.count()
        self.counters = {"refusals_held": 0, "refusals_held_ms": 0.0}

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, who: Hashable, answer: Any, now: float) -> bool:
        """A refusal for the backlog of `who`'s write, answered by `answer`:
        True if it is held (`take` hands it back when due), False if it is
        to be sent now."""
        n, last = self._streak.get(who, (0, float("-inf")))
        n = n + 1 if now - last <= self.window_s else 1
        delay = 0.0 if n == 1 else min(self.max_s, self.first_s * 2 ** (n - 2))
        if delay and (self._per_who[who] >= self.max_per_who or len(self._held) >= self.max_held):
            delay = 0.0  # rule 2
        self._streak[who] = (n, now + delay)
        if not delay:
            return False
        heapq.heappush(self._held, (now + delay, next(self._order), who, answer, now))
        self._per_who[who] += 1
        self.counters["refusals_held"] += 1
        return True

    def taken(self, who: Hashable) -> None:
        """A write of `who` was taken: its streak of refusals ends."""
        self._streak.pop(who, None)

    def due(self) -> float | None:
        """When the next held answer is due (None: nothing held)."""
        return self._held[0][0] if self._held else None

    def take(self, now: float, every: bool = False) -> list[Any]:
        """The held answers due by `now`, oldest first; with `every`, all of
        them now (the backlog has room, or a stop: rule 3), their streaks
        going on from now."""
        out = []
        while self._held and (every or self._held[0][0] <= now):
            out.append(self._pop(now))
        return out

    def _pop(self, now: float) -> Any:
        at, _, who, answer, since = heapq.heappop(self._held)
        self._per_who[who] -= 1
        if not self._per_who[who]:
            del self._per_who[who]
        self.counters["refusals_held_ms"] += 1000 * max(0.0, now - since)
        if who in self._streak:  # (not if a write taken since ended it)
            n, last = self._streak[who]
            if at > now and last >= at:  # answered early: its streak's window runs from now
                self._streak[who] = (n, now)
        return answer

    def forget(self, now: float) -> None:
        """Drop streaks whose window has passed (the loop's tick: bounded memory)."""
        old = [w for w, (_, last) in self._streak.items() if now - last > self.window_s and w not in self._per_who]
        for w in old:
            del self._streak[w]

    def stats(self) -> dict[str, Any]:
        return {"refusals_held": self.counters["refusals_held"],
                "refusals_held_ms": round(self.counters["refusals_held_ms"], 3),
                "refusals_holding": len(self._held)}
