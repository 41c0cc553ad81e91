"""Replies on their way out: a peer that never reads loses its own replies.

Theory of operation
-------------------
The ROUTER socket keeps one outbound pipe per peer. A reply sits there, then
in the kernel's socket buffer, until the peer reads it; a peer that never
reads would otherwise hold the daemon two ways: its replies pile up in memory
(a GET reply read from the SSD tier is fresh bytes, a RAM reply pins an entry
the tier may have evicted), and every send to its full pipe would block the
one thread that serves everyone.

Rules the outbox keeps:
1. Never block for a full peer more than once per episode. A send is
   non-blocking; if the pipe looks full, one blocking retry of at most
   `retry_ms` follows (libzmq learns that a reader caught up only when the
   writer processes its commands, which a non-blocking send does at most
   once a millisecond, so a fast reader can look full for a moment). If that
   fails too the peer is marked full, and until a non-blocking send to it
   succeeds its replies are dropped (counted) without waiting.
2. Bytes are budgeted. Every reply of at least `TRACK_BYTES` is sent with a
   libzmq tracker; until libzmq lets go of it its bytes count against the
   peer and against everyone. A big reply is refused -- replaced by BUSY,
   which is small -- when the peer already has `peer_bytes` queued, or when
   it would take everyone's queued bytes past `total_bytes`. The per-peer
   check is on what is already queued, not on what would be, because a
   tracker learns that its message is gone on pyzmq's garbage thread, a
   moment late, and a client paging through a GET must never be refused for
   its previous page. With `total_bytes` = 2 x `peer_bytes` = 2 x the largest
   message, that page and the next always fit. The garbage thread needs the
   GIL, which the serving loop holds, so it can lag by several pages: before
   refusing a peer, or cutting anyone off, the outbox sleeps up to `_SETTLE`
   (10 ms; measured lags 7-10 ms, a GIL switch interval or two) for it to
   catch up. These waits come out of one budget that refills at 5% of the
   time (`_SETTLE_SHARE`, at most 50 ms banked), so no peer, however it
   reads or does not, can make the loop sleep more than that.
   When the total is reached, the peer holding the most is cut off
   (`disconnect(where)`, the connection its last request came on: the daemon
   names it by fd and connection id, kvd.server.admission.gate rule 2): libzmq drops what
   was queued for it, and the others' replies flow again. Without that, a
   few peers that never read would get everyone else's big replies refused.
3. `saturated(identity)` tells the serving loop, before any work is done,
   that a peer's replies would be dropped or refused anyway, so a never-
   reading peer's GETs cost no disk reads. `mute(identity)` goes further for
   a peer marked full: its requests are dropped as soon as they are received
   (no decoding, no reply to build and fail to send -- ~40 us each before,
   which 16 peers pumping PINGs turned into every other client's wait),
   except one every `_PROBE` seconds, whose reply tests whether it reads again.
   A muted peer that goes on sending -- `_CUT_MUTED` requests dropped while
   it was full -- is cut off like a hog (`disconnect(where)`): dropping costs a
   few microseconds, but a peer that pumps requests and never reads sends
   tens of thousands a second, and the loop dropping them is then a busy
   thread the scheduler preempts, with everyone's requests behind it
   (measured: a client's p99 4-6x its idle one under `bench_stress.py --only
   mute-big-gets`). It may reconnect: a new peer, muted again once it fills.
4. Bookkeeping is bounded: finished trackers are pruned on every send to their
   peer and by `sweep()` (the loop calls it every tick); the set of full peers
   is cleared if it ever grows past `_MAX_FULL` (the cost: one more short
   blocking retry each).
5. A big reply never ends the loop. pyzmq hands zero-copy frames back on a
   thread of its own, started with a socket of its own on first use: the
   daemon starts it when it binds (`start_collector`), so a thread or fd
   limit reached later cannot stop the first big reply. If sending fails all
   the same (RuntimeError, a ZMQError but the peer's), the peer gets BUSY.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Callable

import zmq

from kvd.server.lanes import PREFIX as LANE_PREFIX
from kvd.server.ratelog import now_and_then

log = logging.getLogger("kvd.server.outbox")


def start_collector() -> None:
    """Start pyzmq's thread for zero-copy frames, and its socket, now rather
    than at the first big reply (rule 5): a zero-copy frame, dropped unsent,
    makes both. Raises RuntimeError or zmq.ZMQError if it cannot."""
    zmq.Frame(b"\0", copy=False)

TRACK_BYTES = 64 * 1024  # smaller replies are copied by pyzmq and bounded by SNDHWM
_MAX_FULL = 65536
_SETTLE = 0.010  # most time given to pyzmq's garbage thread before a refusal
_SETTLE_SHARE = 0.05  # of the loop's time, at most, spent in such waits
_SETTLE_BANK = 0.05  # seconds of waiting that may be banked
_PROBE = 0.1  # seconds between requests served to a peer marked full (rule 3)
_CUT_MUTED = 1000  # requests dropped from a full peer before it is cut off (rule 3)


def _nbytes(frame) -> int:
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)


class Outbox:
    """Sends replies on `sock` under the rules of the module docstring."""

    def __init__(
        self,
        sock: zmq.Socket,
        *,
        peer_bytes: int,
        total_bytes: int,
        retry_ms: int = 2,
        disconnect: Callable[[object], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        route: Callable[[bytes], tuple[zmq.Socket, bytes] | None] | None = None,
    ):
        self.sock = sock
        # A peer on a lane of its own (kvd.server.lanes): its identity names
        # the lane; `route` gives the lane's socket and the peer's id there.
        self.route = route
        self.disconnect = disconnect
        self.conns: dict[bytes, object] = {}  # identity -> the connection of its last request, while it has bytes queued
        self.cut: set[bytes] = set()  # peers cut off whose queued bytes libzmq has not freed yet
        self._bank = _SETTLE_BANK  # seconds of settle waits available (rule 2)
        self._bank_at = time.monotonic()
        self.peer_bytes = peer_bytes
        self.total_bytes = total_bytes
        self.retry_ms = retry_ms
        sock.setsockopt(zmq.SNDTIMEO, retry_ms)
        self.queued: defaultdict[bytes, list[tuple[zmq.MessageTracker, int]]] = defaultdict(list)
        self.queued_bytes = 0
        self.clock = clock
        self.full: dict[bytes, float] = {}  # peers whose pipe is full -> when one was last let through (rule 3)
        self.mutes: dict[bytes, int] = {}  # full peers -> requests dropped since (rule 3)
        self.cut_muted: set[bytes] = set()  # full peers cut off for it (rule 3)
        self.lent = False  # the main socket is lent to another thread (`lend`)
        self.held: list[list] = []  # replies to its peers meanwhile, sent when it is back
        self.held_bytes = 0
        self.counters = dict.fromkeys(("dropped_full", "dropped_gone", "refused_over_budget", "cut_off", "muted", "cut_muted",
                                       "send_failures", "held_while_lent", "dropped_while_lent"), 0)

    # -- budgets -------------------------------------------------------------
    def _prune(self, identity: bytes) -> int:
        """Forget `identity`'s finished replies; returns its bytes still queued."""
        pending = self.queued.get(identity)
        if not pending:
            self.queued.pop(identity, None)
            return 0
        live = [(t, n) for t, n in pending if not t.done]
        self.queued_bytes -= sum(n for _, n in pending) - sum(n for _, n in live)
        if live:
            self.queued[identity] = live
        else:
            del self.queued[identity]
            self.conns.pop(identity, None)
            self.cut.discard(identity)
        return sum(n for _, n in live)

    def sweep(self) -> None:
        for identity in list(self.queued):
            self._prune(identity)

    def _settle(self, done: Callable[[], bool]) -> None:
        """Let pyzmq's garbage thread report finished replies (rule 2): sleep
        in short steps, up to _SETTLE and what the budget allows, until done()."""
        now = time.monotonic()
        self._bank = min(_SETTLE_BANK, self._bank + (now - self._bank_at) * _SETTLE_SHARE)
        self._bank_at = now
        deadline = now + min(_SETTLE, self._bank)
        while time.monotonic() < deadline:
            time.sleep(0.0002)
            if done():
                break
        self._bank -= time.monotonic() - now

    def _mine(self, identity: bytes) -> int:
        mine = self._prune(identity)
        if mine >= self.peer_bytes:
            self._settle(lambda: self._prune(identity) < self.peer_bytes)
            mine = self._prune(identity)
        return mine

    def mute(self, identity: bytes, where=None) -> bool:
        """True if a request from this peer is to be dropped unread (rule 3):
        its pipe is full and another of its requests went through less than
        `_PROBE` seconds ago. Counted; every `_CUT_MUTED`th tries to cut the
        peer off (`where`: the connection the request came on, as
        `disconnect` takes it)."""
        probed = self.full.get(identity)
        if probed is None:
            return False
        now = self.clock()
        if now - probed < _PROBE:
            self.counters["muted"] += 1
            n = self.mutes[identity] = self.mutes.get(identity, 0) + 1
            if n % _CUT_MUTED == 0 and where is not None and self.disconnect is not None and identity not in self.cut_muted:
                # Again every _CUT_MUTED until it works (the gate may not know the
                # fd yet), never after: what it still sent is dropped (it stays
                # full), and trying again and again is not free.
                if self.disconnect(where):
                    self.cut_muted.add(identity)
                    self.counters["cut_muted"] += 1
            return True
        self.full[identity] = now  # this one is served: its reply's send probes the pipe
        return False

    def saturated(self, identity: bytes) -> bool:
        """True if a reply to this peer would be dropped or refused right now."""
        return identity in self.full or self._mine(identity) >= self.peer_bytes

    # -- sending ---------------------------------------------------------------
    def _held(self, identity: bytes) -> int:
        return sum(n for _, n in self.queued.get(identity, ()))

    def _room(self, asking: bytes, size: int) -> bool:
        """Can `size` more bytes be queued within the total? Cuts off the
        peers holding the most until they can (rule 2): bytes of a peer cut
        off count as gone, since libzmq is about to free them."""
        over = self.queued_bytes + size - self.total_bytes
        if over > 0:
            def under() -> bool:
                self.sweep()
                return self.queued_bytes + size <= self.total_bytes

            self._settle(under)
            over = self.queued_bytes + size - self.total_bytes
        if over <= 0:
            return True
        leaving = sum(self._held(i) for i in self.cut)
        while leaving < over and self.disconnect is not None:
            hogs = [i for i in self.queued if i not in self.cut and i != asking and i in self.conns]
            if not hogs:
                break
            hog = max(hogs, key=self._held)
            self.cut.add(hog)  # tried once, whatever the outcome
            if self.disconnect(self.conns[hog]):
                self.counters["cut_off"] += 1
                leaving += self._held(hog)
        return leaving >= over

    def send(self, identity: bytes, frames: list, busy: Callable[[], list], where=None) -> str:
        """Send one reply; returns "sent", "busy" (replaced by `busy()`), or "dropped".
        `where` is the connection the request came on, as `disconnect` takes it, if known."""
        size = sum(_nbytes(f) for f in frames)
        outcome = "sent"
        tracked = size >= TRACK_BYTES
        if tracked:
            mine = self._mine(identity)
            if self.queued_bytes + size > self.total_bytes:
                self.sweep()
            if mine >= self.peer_bytes or not self._room(identity, size):
                self.counters["refused_over_budget"] += 1
                frames, tracked, outcome = busy(), False, "busy"
        parts: list = [identity]
        trackers = []
        try:
            for f in frames:
                if tracked and _nbytes(f) >= TRACK_BYTES:
                    f = zmq.Frame(f, track=True)
                    trackers.append(f)
                parts.append(f)
            sent = self._send(identity, parts)
        except (RuntimeError, zmq.ZMQError) as err:  # rule 5: no thread or fd for zero-copy frames
            self.counters["send_failures"] += 1
            if now_and_then(self.counters["send_failures"]):
                log.warning("cannot send a reply (%s; %d times so far): answering BUSY", err, self.counters["send_failures"])
            try:
                return "busy" if self._send(identity, [identity, *busy()]) else "dropped"
            except (RuntimeError, zmq.ZMQError):
                return "dropped"
        if not sent:
            return "dropped"
        if trackers:
            self.queued[identity].append((zmq.MessageTracker(*trackers), size))
            self.queued_bytes += size
            if where is not None:
                self.conns[identity] = where
        return outcome

    def lend(self) -> None:
        """The main socket is another thread's until `give_back`: replies to
        its peers are held (at most `total_bytes` of them), never sent."""
        self.lent = True

    def give_back(self) -> None:
        """The main socket is back: send what was held, in order."""
        self.lent = False
        held, self.held, self.held_bytes = self.held, [], 0
        for parts in held:
            self._send(parts[0], parts)

    def _send(self, identity: bytes, parts: list) -> bool:
        sock = self.sock
        if self.route is not None and identity.startswith(LANE_PREFIX):
            routed = self.route(identity)
            if routed is None:  # its lane is closed: the client asks HELLO again
                self.counters["dropped_gone"] += 1
                return False
            sock, parts[0] = routed
        elif self.lent:
            size = sum(_nbytes(f) for f in parts[1:])
            if self.held_bytes + size > self.total_bytes:
                self.counters["dropped_while_lent"] += 1
                return False
            self.held.append(parts)
            self.held_bytes += size
            self.counters["held_while_lent"] += 1
            return True
        try:
            try:
                sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=False)
                if self.full.pop(identity, None) is not None:
                    self.mutes.pop(identity, None)
                    self.cut_muted.discard(identity)
                return True
            except zmq.Again:
                if identity in self.full:
                    raise
                sock.send_multipart(parts, copy=False)  # rule 1: one retry, SNDTIMEO bounds it
                return True
        except zmq.Again:
            if len(self.full) >= _MAX_FULL:
                self.full.clear()
                self.mutes.clear()
                self.cut_muted.clear()
            self.full.setdefault(identity, self.clock())
            self.counters["dropped_full"] += 1
        except zmq.ZMQError:  # EHOSTUNREACH: the peer is gone
            self.full.pop(identity, None)
            self.mutes.pop(identity, None)
            self.cut_muted.discard(identity)
            self.counters["dropped_gone"] += 1
        return False

    def stats(self) -> dict:
        return {"queued_bytes": self.queued_bytes, "queued_peers": len(self.queued), "full_peers": len(self.full),
                "held_bytes": self.held_bytes, **self.counters}
