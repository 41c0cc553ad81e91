"""Requests from peers that keep the daemon busy wait while others are served.

Theory of operation
-------------------
A ROUTER socket fair-queues its peers: one message from each peer that has
one waiting, in turn. That is fair in messages, not in work: with eight
peers sending requests that take milliseconds each (LOOKUPs of a million
tokens, GETs read from the SSD tier), a client's 0.3 ms GET waits behind
eight of them, every time.

So each peer has a *cost*: what one of its requests costs, on average (the
newest weighs `weight`): the serving thread's CPU time -- not wall time: on
a busy machine every request takes longer, the cheap ones too -- plus the
time its bytes took to arrive (`BYTE_SECONDS` per byte: a 4 MiB header costs
libzmq's I/O thread far more than it costs the loop). Ordinary requests (a
GET of a RAM hit, a PUT of a few chunks, a PING) cost well under `heavy_s`,
however many a peer sends; a peer whose cost is over it is *heavy*. The loop
serves what it receives at once, in the socket's order, except a heavy
peer's requests: those wait here, and get their turn when the socket has
nothing else. While other peers are active (one was served in the last
`active_s`), heavy peers' turns take at most `share` of the time: after one
that cost c, the next waits until c / share has passed. A peer waiting for
its reply sends nothing more, so this also slows what heavy peers send,
which is most of what they cost. With nobody else about, heavy peers are
served in full. "Else" is another process, where the daemon knows it (a
unix socket's peer; over TCP each connection is its own): a process's own
connections (a client's HELLO on the main socket and its lane, its upload
socket, the clients of a server's other models) do not hold back its heavy requests --
the pages of a new client's 1 GiB GET, sent on its lane at once after a
PING on its main socket, waited 26-55 ms for their turns (5-18 ms now).

A cost belongs to a connection, and also to its *origin*, the process at
the other end of a unix socket (the daemon finds it once per connection,
kvd.server.admission.connections.origin): a connection with no requests served yet is
charged its origin's cost. Otherwise every new connection would start light,
and a peer that reconnects for every request -- a new identity each time --
would never be heavy (measured: 1,100 LOOKUPs of 4 MiB on fresh connections,
5 of them deferred). Once it has its own, a connection's cost is its own: a
client's fetch is not held back by the 256 MiB upload its process runs on
another connection (kvd_client does both).

A process can also keep the thread busy with requests that are each cheap:
four clients PUTting 16 KiB prompts back to back (SLOTS and COMMIT, ~0.4 ms
each) kept it busy with their writes, never heavy, and a client's 0.3 ms GET
waited for the request in hand and for a CPU, every time (bench_stress's
put-storm: p99 5x idle). So a process whose *writes* (PUT, SLOTS, COMMIT, GC)
took more than `busy_share` of the thread over about `busy_window_s` (a
decaying sum of their cost) is a *busy writer* until it has sent no write for
`busy_window_s` or its writes' share falls under an eighth of `busy_share`:
its writes wait here like a heavy peer's requests, sharing heavy peers'
`share` while others are active. Its reads are served as anyone's, and
hold back heavy peers as anyone's do, but not other busy writers' writes:
busy writers alone are served in full. Only writes: what a model server
waits on is its reads (a fetch), while its store uploads in the
background. A store of 256 MiB
costs the thread 5-10 ms in all (a SLOTS and its COMMITs), so `busy_share`
(5%: 50 ms of writes in the decaying second) is about five such stores a
second from one process; a busy writer whose writes fit in the share keeps
up, later.

A process can also keep the machine busy with connections: four threads
that connect, PING, read the reply and hang up, as fast as they can (~2,600
connections a second here), cost the daemon ~0.4 ms a connection in all
(libzmq's accept and handshake, the gate's events, the first request:
`connect_s`, charged to each connection's first request) -- a core --
and themselves another: a client's GET p99 3x its idle one on two
cores (bench_stress's churn), though no request is heavy and none a write.
So a process that opened more than `churn_rate` connections a second (a
decaying count over `busy_window_s`) is *churning*: the first request on
each of its new connections waits here like a heavy peer's, sharing heavy
peers' `share` while others are active, and its threads, each waiting for
its reply before it connects again, are slowed with it. A model server
opens a few connections at start (a main socket, a lane, an upload
socket per model) and keeps them; churning lasts until its rate falls
under an eighth of `churn_rate`. Only where the daemon knows the process
(a unix socket's peer).

Rules:
1. A peer's requests are served in the order they came: once one waits
   here, its later ones wait behind it.
2. Nothing waits for ever: once `max_passes` others have been served since
   the oldest waiting request came, and since the last waiting request's
   turn, it goes next -- when heavy peers' share allows it, or once it has
   waited `max_wait_s` whatever the share. One at a time: with eight heavy
   peers waiting, their requests pass the mark together, and serving them
   all at once would make a client's request wait behind eight (measured:
   bursts of 3-5 ms, a client's p99 5x its idle one). The share counts here
   too: a client sending back to back never leaves the socket quiet, and
   with passes alone a flood of 90 ms PUTs of 8,000 tiny chunks each had a
   turn every 64 of its requests -- 40% of the thread, and its p99 the
   length of a PUT (issue 44).
3. What waits here is bounded: at most `max_waiting` requests, `max_bytes`
   in all. Without room for one more, the oldest waiting are served first;
   a request over `max_bytes` alone is served at once, when its peer has
   nothing waiting. One peer may have at most `max_per_peer` waiting: the
   loop answers its next BUSY, unserved (`full`). Else a peer that sends
   without waiting for its replies would fill the queue and have its
   requests served at once, its pacing undone (a client sends one request
   at a time).
4. No I/O and no clock of its own: the loop passes the time (testable with
   any clock); `overdue` goes by the latest time it was given.
5. A request served in turns (kvd/server/handler.py `Sliced`) waits here
   between them as an `Unfinished`, ahead of its peer's later requests
   (rule 1: its reply goes first) and like them otherwise: its next turn
   comes as a heavy peer's does, so a client's PING waits for one turn of
   it (`slice_seconds`), not for all of it. Rule 3 holds: without room, it
   is served to its end at once.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, NamedTuple

# Seconds charged per byte a request carries: what moving it through a unix
# socket and libzmq costs this machine's CPUs, at both ends (0.7 ns a byte in
# a steady stream of 4 MiB messages here, the sender's and the receiver's CPU
# time; more in bursts, which a peer sending 8 x 4 MiB at once makes). At 0.5 ns (the receiving end's alone)
# bench_stress's heavy-peers had 22 LOOKUPs of 4 MiB a second served, a good
# client's p99 1.3-1.9x idle, in bursts as the 32 MiB came in; at 1 ns, 12 a
# second and 1.2x (session 46).
BYTE_SECONDS = 1.0e-9
# Seconds charged per frame: the loop reads a message part by part, ~0.75 us
# each here (8,001 frames of a PUT of 8,000 tiny chunks: ~6 ms before its first turn).
PART_SECONDS = 1e-6
# Seconds charged to a new connection's first request besides its own:
# what connecting costs the daemon's threads (libzmq's accept and handshake,
# the gate's connect and disconnect events, the connection's first look),
# ~0.4 ms a connection here (2,600 a second took 1.1 cores).
CONNECT_SECONDS = 0.0004


def whose(peer: bytes, origin: bytes | None) -> tuple:
    """Whose request it is, for who else is about: its process where the
    daemon knows it (a unix socket's peer), else the connection alone (TCP:
    one host may be many clients)."""
    return ("origin", origin) if origin is not None else ("peer", peer)


class Unfinished(NamedTuple):
    """A request part-served (rule 5): its peer, its frames (its tensors and
    tokens are views of them), the decoded message, what is left of it (a
    handler.Sliced), the bytes it holds while it waits for the disk, its
    connection as the daemon knows it, and its frames' bytes (summed once:
    8,000 frames take ~0.5 ms to sum, a turn's whole budget)."""

    identity: bytes
    frames: list
    msg: Any
    sliced: Any
    nbytes: int
    conn: Any
    size: int = 0


class Turns:
    """Heavy peers' requests waiting for their turn, and each peer's cost."""

    def __init__(
        self,
        *,
        max_waiting: int = 16,
        max_per_peer: int = 4,
        max_bytes: int = 32 << 20,
        max_passes: int = 64,
        max_wait_s: float = 1.0,
        weight: float = 0.25,
        heavy_s: float = 0.001,
        share: float = 0.05,  # a quarter let a flood of 8,000-chunk PUTs read 8 a second: 12% of the time in recv alone
        active_s: float = 0.05,
        burst_s: float = 0.002,
        forget_s: float = 10.0,
        busy_share: float = 0.05,
        busy_window_s: float = 1.0,
        churn_rate: float = 64.0,
        connect_s: float = CONNECT_SECONDS,
    ):
        self.max_waiting = max_waiting
        self.max_per_peer = max_per_peer
        self.max_bytes = max_bytes
        self.max_passes = max_passes
        self.max_wait_s = max_wait_s
        self._now = float("-inf")  # the latest time the loop passed (rule 4)
        self._popped_at = float("inf")  # _now when the last waiting request left
        self.weight = weight
        self.heavy_s = heavy_s
        self.share = share
        self.active_s = active_s
        self.burst_s = burst_s
        self.forget_s = forget_s
        self.busy_share = busy_share
        self.busy_window_s = busy_window_s
        self.churn_rate = churn_rate
        self.connect_s = connect_s
        # origin -> (its new connections, decaying over busy_window_s; when it last opened one; churning?)
        self._connects: dict[bytes, tuple[float, float, bool]] = {}
        # who (`whose`) -> (its writes' cost, decaying over busy_window_s; when it last wrote; a busy writer?),
        # in order of last write
        self._writes: dict[tuple, tuple[float, float, bool]] = {}
        self.bytes = 0
        self._served = 0  # requests served so far: a waiting request's passes are this minus its mark
        self._turn = 0  # _served after the last waiting request's turn (rule 2)
        # (mark, peer, nbytes, request, since, who: `whose`), oldest first
        self._waiting: deque[tuple[int, bytes, int, Any, float, tuple]] = deque()
        self._per_peer: dict[bytes, int] = {}
        self._cost: dict[bytes, tuple[float, float]] = {}  # peer -> (mean cost of a request, when it last sent one)
        self._origin_cost: dict[bytes, tuple[float, float]] = {}  # origin -> the same, over all its connections
        self._partial: dict[bytes, float] = {}  # peer -> what its request served in turns has cost so far
        # The last two processes (`whose`) with a request served that is not heavy, and when: (who, time), newest first.
        self._light: list[tuple[tuple, float]] = [((), float("-inf"))] * 2
        # The same for busy writers' light requests (their reads): they hold back heavy peers'
        # turns as anyone's do, but not other busy writers' writes (busy writers alone are served in full).
        self._light_busy: list[tuple[tuple, float]] = [((), float("-inf"))] * 2
        self._credit = (burst_s, 0.0)  # (seconds heavy peers' turns may still take, when it was that)
        self.counters = {"deferred": 0, "overdue": 0, "sliced": 0, "busy_writers_seen": 0, "churners_seen": 0,
                         "refused_waiting": 0}

    def __len__(self) -> int:
        return len(self._waiting)

    # -- the loop's questions ------------------------------------------------------
    def defers(self, peer: bytes, origin: bytes | None = None, write: bool = False) -> bool:
        """Must `peer`'s request wait (it is heavy -- by its origin's cost if it
        has none of its own yet --, it is a `write` of a busy writer, or its
        earlier ones wait: rule 1)?"""
        return (peer in self._per_peer or self.cost(peer, origin) > self.heavy_s
                or (write and self.busy_writer(whose(peer, origin)))
                or (peer not in self._cost and origin is not None and self.churning(origin)))

    def churning(self, origin: bytes) -> bool:
        """Is the process `origin` churning (module docstring), as of the latest time the loop passed?"""
        got = self._connects.get(origin)
        return got is not None and got[2] and self._decayed(*got[:2], self._now) >= self.churn_rate * self.busy_window_s / 8

    def busy_writer(self, who: tuple) -> bool:
        """Is `who` (`whose`) a busy writer (module docstring), as of the latest time the loop passed?"""
        got = self._writes.get(who)
        return got is not None and got[2] and self._still_busy(*got[:2], self._now, who)

    def _still_busy(self, load: float, at: float, now: float, who: tuple) -> bool:
        """A busy writer `who` whose last write was served at `at`, its sum `load`
        then, is one still at `now` unless silent for a window or its writes'
        share fell under an eighth of `busy_share` (paced, four busy writers get
        a quarter each). One with a request waiting here is not silent."""
        if any(w[5] == who for w in self._waiting):  # (at most max_waiting)
            return True
        if now - at > self.busy_window_s:
            return False
        return self._decayed(load, at, now) >= self.busy_share * self.busy_window_s / 8

    def _decayed(self, load: float, at: float, now: float) -> float:
        """A writes' sum `load` taken at `at`, as it stands at `now`."""
        return load * math.exp(-max(0.0, now - at) / self.busy_window_s)

    def full(self, peer: bytes) -> bool:
        """Has `peer` as many requests waiting as one may (rule 3)? Its next is answered BUSY."""
        return self._per_peer.get(peer, 0) >= self.max_per_peer

    def room(self, nbytes: int) -> bool:
        """May a request of `nbytes` wait (rule 3)?"""
        return len(self._waiting) < self.max_waiting and self.bytes + nbytes <= self.max_bytes

    def put(self, peer: bytes, request: Any, nbytes: int, origin: bytes | None = None) -> None:
        """Keep `request` until its turn (check `room()` first)."""
        self._waiting.append((self._served, peer, nbytes, request, self._now, whose(peer, origin)))
        self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        self.bytes += nbytes
        self.counters["deferred"] += 1

    def put_first(self, peer: bytes, request: Any, nbytes: int, origin: bytes | None = None) -> None:
        """Keep `request` ahead of `peer`'s other waiting requests (rule 5;
        check `room()` first: without room, the loop serves it to its end)."""
        at = next((i for i, w in enumerate(self._waiting) if w[1] == peer), len(self._waiting))
        self._waiting.insert(at, (self._served, peer, nbytes, request, self._now, whose(peer, origin)))
        self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        self.bytes += nbytes
        self.counters["sliced"] += 1

    def overdue(self) -> Any | None:
        """The oldest waiting request if `max_passes` others went ahead of it
        and heavy peers' share allows it, or it waited `max_wait_s` (rule 2)."""
        if not self._waiting or self._served - max(self._waiting[0][0], self._turn) < self.max_passes:
            return None
        now, head = self._now, self._waiting[0]
        if head[4] == float("-inf"):  # put before the loop passed any time: it waits from now
            self._waiting[0] = head = (*head[:4], now, head[5])
        if self._credit_at(now) < 0 and now - head[4] < self.max_wait_s:
            return None
        self.counters["overdue"] += 1
        return self.pop()

    def due(self, now: float) -> float | None:
        """When the oldest waiting request may have a quiet socket's turn: `now`
        or later (others are active and heavy peers used their share); None if
        nothing waits."""
        self._now = max(self._now, now)
        if not self._waiting:
            return None
        until = self._others_until(self._waiting[0][5], self.busy_writer(self._waiting[0][5]))
        if now >= until:
            return now
        credit = self._credit_at(now)
        if credit > 0:
            return now
        return min(now - credit / self.share, until)

    def take(self, now: float) -> Any | None:
        """The socket is quiet: the oldest waiting request, if it is due."""
        due = self.due(now)
        return self.pop() if due is not None and due <= now else None

    def pop(self) -> Any | None:
        """The oldest waiting request, or None."""
        if not self._waiting:
            return None
        _, peer, nbytes, request, _, who = self._waiting.popleft()
        got = self._writes.get(who)
        if got is not None and got[2]:  # it waited, it was not silent: its silence counts from now
            load, at, busy = self._writes.pop(who)
            self._writes[who] = (self._decayed(load, at, self._now), max(at, self._now), busy)
        self._turn = self._served + 1  # passes count from after this turn (its own charge is none)
        self._popped_at = self._now
        left = self._per_peer[peer] - 1
        if left:
            self._per_peer[peer] = left
        else:
            del self._per_peer[peer]
        self.bytes -= nbytes
        return request

    # -- costs ---------------------------------------------------------------------
    def cost(self, peer: bytes, origin: bytes | None = None) -> float:
        """What one of `peer`'s requests costs, on average, in seconds; its
        origin's cost while it has none of its own."""
        got = self._cost.get(peer)
        if got is None and origin is not None:
            got = self._origin_cost.get(origin)
        return 0.0 if got is None else got[0]

    def charge(self, peer: bytes, seconds: float, nbytes: int, now: float, *, waited: bool = False,
               origin: bytes | None = None, parts: int = 0, more: bool = False, write: bool = False,
               connected: bool = False) -> None:
        """`peer`'s request took `seconds` of the serving thread's CPU and
        carried `nbytes` in `parts` frames; `waited`: it had waited here.
        Charged to `origin` too. `more`: a turn of a request served in turns
        that was not its last: its cost counts with its last turn's, as one
        request's (a PUT of 8,000 tiny chunks in 0.5 ms turns is one heavy
        request, not sixty light ones). `write`: a PUT, SLOTS, COMMIT or GC
        (it counts toward its process being a busy writer). `connected`: the
        first request on its connection (the daemon knows: an identity new on
        its fd; a cost forgotten after forget_s does not make one new), which
        is charged what connecting cost (`connect_s`) and counts toward its
        process churning."""
        self._served += 1
        self._now = max(self._now, now)
        cost = seconds + nbytes * BYTE_SECONDS + parts * PART_SECONDS
        if connected:
            cost += self.connect_s
            if origin is not None:
                self._connected(origin, now)
        if more:
            self._partial[peer] = self._partial.get(peer, 0.0) + cost
            mean = self.cost(peer, origin)
        else:
            whole = cost + self._partial.pop(peer, 0.0)
            mean = self._average(self._cost, peer, whole, now)
            if origin is not None:
                self._average(self._origin_cost, origin, whole, now)
            if write:
                self._wrote(whose(peer, origin), whole, now)
        if waited:
            # Others about when the turn began (a turn longer than active_s held
            # them off: at its end they look gone, and the share went unspent --
            # a 125 ms PUT of 8,000 tiny chunks then had every other turn, issue 44).
            began = min(now - seconds, self._popped_at)
            who = whose(peer, origin)
            if began < self._others_until(who, self.busy_writer(who)):  # others are about: this turn uses heavy peers' share
                # What the others waited is the turn's wall time, when it is longer than its
                # CPU time (a busy machine, a message of 8,000 frames read part by part).
                held = max(cost, now - self._popped_at) if self._popped_at <= now else cost
                self._credit = (self._credit_at(now) - held, now)
        elif seconds > 0 and mean <= self.heavy_s and not more:
            who = whose(peer, origin)
            light = self._light_busy if self.busy_writer(who) else self._light
            light[:] = [(who, now), light[1 if light[0][0] == who else 0]]

    def _average(self, costs: dict[bytes, tuple[float, float]], key: bytes, cost: float, now: float) -> float:
        got = costs.pop(key, None)  # and in again at the end: the dict stays in order of last request
        mean = cost if got is None else got[0] + self.weight * (cost - got[0])
        costs[key] = (mean, now)
        return mean

    def _wrote(self, who: tuple, cost: float, now: float) -> None:
        """`who` had a write served that cost `cost`: its decaying sum, and
        whether that makes it a busy writer (it stays one while it writes)."""
        load, at, busy = self._writes.pop(who, (0.0, now, False))
        busy = busy and self._still_busy(load, at, now, who)
        load = self._decayed(load, at, now) + cost
        if not busy and load > self.busy_share * self.busy_window_s:
            busy = True
            self.counters["busy_writers_seen"] += 1
        self._writes[who] = (load, now, busy)  # (in again at the end: the dict stays in order of last write)

    def _connected(self, origin: bytes, now: float) -> None:
        """`origin` opened a connection: its decaying count, and whether that makes it churning."""
        count, at, churning = self._connects.pop(origin, (0.0, now, False))
        count = self._decayed(count, at, now) + 1.0
        churning = churning and count >= self.churn_rate * self.busy_window_s / 8
        if not churning and count > self.churn_rate * self.busy_window_s:
            churning = True
            self.counters["churners_seen"] += 1
        self._connects[origin] = (count, now, churning)  # (in again at the end: in order of last connection)

    def _others_until(self, who: tuple, busy: bool = False) -> float:
        """Until when processes other than `who` (`whose`) count as active (one was
        served lately); for a `busy` writer's turn, busy writers do not count."""
        light = self._light if busy else self._light + self._light_busy
        return max((at for other, at in light if other != who), default=float("-inf")) + self.active_s

    def _credit_at(self, now: float) -> float:
        credit, at = self._credit
        return min(self.burst_s, credit + max(0.0, now - at) * self.share)

    def forget(self, now: float) -> None:
        """Drop the costs of peers and origins silent for `forget_s` (peers come and go: the maps must not grow).
        The maps are in order of last request, so this looks at the silent ones only: a peer that
        reconnects for every request leaves thousands of costs a second behind it."""
        for costs, keep in ((self._cost, self._per_peer), (self._origin_cost, ())):
            gone = []
            for key, (_, at) in costs.items():
                if now - at <= self.forget_s:
                    break
                if key not in keep:
                    gone.append(key)
            for key in gone:
                del costs[key]
        silent = max(self.forget_s, self.busy_window_s)
        for book in (self._writes, self._connects):
            while book:
                key, (_, at, _) = next(iter(book.items()))
                if now - at <= silent:
                    break
                del book[key]

    def stats(self) -> dict[str, int]:
        busy = sum(1 for who in self._writes if self.busy_writer(who))
        churning = sum(1 for origin in self._connects if self.churning(origin))
        return {"waiting_turn": len(self._waiting), "peers_with_cost": len(self._cost), "busy_writers": busy,
                "churning": churning, **self.counters}
