"""The daemon: one ROUTER socket, one thread, one Handler over one Store.

Why one module of ~700 lines: it is one thread's loop -- receive, decode,
admit, serve, reply, tick -- and its rules below bind those steps together;
what could leave it has: admission, the outbox and turns
(kvd.server.admission), how a message is read (kvd.server.reading, rules 8
and 9), parked replies and a stop's answers (kvd.server.settling, rule 4),
the shared-memory plane (kvd.server.shm).

Theory of operation
-------------------
Clients are DEALER sockets. A request arrives as [identity, header, data...];
the daemon decodes it (kvd.protocol.codec), hands it to the Handler, encodes
the reply and sends [identity, reply frames...]. Requests are served one at a
time, in arrival order, like redis: the work per request is a hash chain and
a few dict lookups, and tensor bytes are never copied in the RAM tier -- large
frames are kept as the received ZeroMQ frames and sent back as they are.

Rules the loop keeps:
1. No byte sequence from a client can stop it: decoding errors become ERROR
   replies with the protocol's code; any other exception in a handler becomes
   INTERNAL, is logged with its traceback, and the loop goes on.
2. A reply to a client that went away, or whose queue is full, is dropped
   and counted (ROUTER_MANDATORY + NOBLOCK), never blocks the loop; queued
   reply bytes are budgeted per peer and in total (kvd.server.admission.outbox).
3. The loop wakes at least every `tick` seconds to run housekeeping hooks
   (the systemd watchdog, store maintenance) and to notice SIGTERM/SIGINT.
4. Write-through PUTs are answered only when their entries are on disk: the
   reply is parked (kvd/server/parking.py) and sent when the SSD writer's
   news arrives through a pipe the poller watches; nobody else waits. At a
   stop, parked PUTs get at most half of `stop_timeout` to complete, then
   NOT_PERSISTED -- never an acknowledgement for what is not on disk.
5. Peer connections stay under `max_peers`, far from the fd limit, and
   stalled peers are shed when memory passes the ceiling (kvd.server.admission.gate,
   on a thread of its own).
6. A peer whose requests cost far more than ordinary ones is served when
   nobody else is waiting, and while others are active in at most a share of
   the time (kvd.server.admission.turns): a client is not queued behind peers that keep
   the daemon busy. A peer's own requests keep their order.
7. Of the others, what waits on the socket is read first, and reads go
   before writes (kvd.server.admission.ready): a model server's GET waits
   for the request being served, not for one of every other peer's. What is
   read and unserved at a stop is answered BUSY. "What waits" is looked for
   again before each request is served (at most every 0.2 ms, and in at
   most a tenth of the loop's time however many lanes there are:
   kvd.server.admission.round): a socket that became readable while the
   loop served a run of other peers' requests joins the round then, not
   when the run ends.
8. A message over the frame limit costs its sender, not the serving thread:
   on a lane it is read only as far as the decoder needs and the lane is
   closed (kvd.server.lanes); on the main socket, whose rest must be read
   before any other message there, the socket is lent to a thread of its
   own that drops the rest (drain.Lent) while the loop serves the lanes.
   Replies to the main socket's peers wait meanwhile (Outbox.lend).
9. A message of many parts is read in turns (kvd.server.admission.parts):
   between two, the loop serves what waits on other sockets (a socket in
   the middle of a message stays readable, and a lane's client waits
   behind no other socket's message). On the main socket its other peers
   still wait for the whole message: ZeroMQ hands a socket's messages out
   one at a time.
10. A write refused because the disk is behind, from a process refused a
   moment ago, is answered later (kvd.server.admission.backoff: 50 ms,
   doubling, at most 0.5 s, or once the backlog has room): a peer that
   resends at once no longer spends a core on what will be refused.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import zmq

from kvd.protocol import codec
from kvd.protocol import errors as E
from kvd.protocol.codec import Message
from kvd.protocol.limits import Limits
from kvd.endpoint import EndpointLock, default_keys_dir, ipc_path, is_tcp
from kvd.server.curve import secure_tcp
from kvd.server.handler import Deferred, Handler, ShutdownRequested, Sliced
from kvd.server.parking import Parking, Wakeup
from kvd.server.latency import Latency
from kvd.server.admission.outbox import Outbox, start_collector
from kvd.server.admission import acceptguard, drain
from kvd.server.admission.backoff import Backoff
from kvd.host import select as host_select
from kvd.host.memory import rss_counts_shared
from kvd.server.admission.caps import default_max_peers, io_threads, listen_backlog, memory_ceiling
from kvd.server.admission.gate import PeerGate
from kvd.server.ratelog import RateLimitedLog
from kvd.server.admission.parts import PartReader, Truncated
from kvd.server.admission.ready import WRITES, Ready
from kvd.server.admission.round import Round
from kvd.server.admission.turns import Turns, Unfinished, whose
from kvd.server.lanes import Lanes, folder_of
from kvd.server.reading import Conn, Reading, kept
from kvd.server.settling import Settling
from kvd.store.base import Store, finish
from kvd.store.courtesy import Courtesy

log = logging.getLogger("kvd.server")

# Unread replies a peer may have queued: a client has one request in flight,
# so more than a few means it is not reading (kvd.server.admission.outbox).
_SNDHWM = 16


class Daemon(Reading, Settling):
    """Serve `store` on `endpoint` until stopped. See the module docstring."""

    def __init__(
        self,
        store: Store,
        endpoint: str,
        *,
        limits: Limits | None = None,
        chunk_tokens: int = 256,
        tick: float = 0.1,
        on_ready: Callable[[], None] | None = None,
        on_tick: Callable[[], None] | None = None,
        keys_dir: str | None = None,
        allow_insecure_tcp: bool = False,
        shm: bool = True,
        shm_lease_s: float = 30.0,
        stop_timeout: float = 10.0,
        parked_max_bytes: int = 256 << 20,
        max_peers: int | None = None,
    ):
        self.store = store
        self.endpoint = endpoint
        self.limits = limits or Limits()
        self.handler = Handler(store, self.limits, endpoint=endpoint, chunk_tokens=chunk_tokens)
        self.tick = tick
        self.on_ready = on_ready
        self.on_tick = on_tick
        self.dropped_replies = 0
        self.dropped_frames = 0  # parts of messages over the frame limit, dropped unread (_recv)
        self.dropping_seconds = 0.0  # what dropping them took of the serving thread
        self.lane_bomb_cpu = 0.0  # CPU time of the serving thread spent on lanes' messages over the limit
        self.main_bomb_cpu = 0.0  # ... and on the main socket's, before it is lent (rule 8)
        self._lent: drain.Lent | None = None  # the main socket, while a thread drops a bomb's rest
        self.lent_seconds = 0.0  # how long the main socket was lent, in all
        self.read_while_lent = 0  # requests read from lanes meanwhile
        self.parts = PartReader()  # messages read in turns (rule 9)
        self.banned_requests = 0  # requests of a banned process read before the gate cut it off
        self.spoofed_lanes = 0  # main-socket messages under a routing id like a lane's (reading.py): dropped
        self.offenders = drain.Offenders()
        self.struck_for_memory = 0  # strikes of processes shed for memory inside a bomb (gate rule 9)
        self.latency = Latency()
        self.turns = Turns()
        self.backoff = Backoff()  # refused writes' answers, held for a process refused again and again (rule 10)
        self._backlog_busy = False  # the request being served is refused for the backlog (backoff rule 1)
        self.ready = Ready()
        # The SSD writer steps aside while a read is served (kvd.store.courtesy).
        self.courtesy = Courtesy(urgent=self._writer_awaited)
        self.pressed: Callable[[], bool] = lambda: False  # the RAM tier is under memory pressure (serve.py: its governor)
        ssd = getattr(store, "ssd", None)
        if ssd is not None and hasattr(ssd, "courtesy"):
            ssd.courtesy = self.courtesy.pause
            ssd.writer.rested = self.courtesy.stepped_aside
        self._conns: dict[int, Conn] = {}  # fd -> the connection on it, as of its identity's first request
        self._fresh: set[bytes] = set()  # connections (identities) in _conns with no request charged yet
        self.ratelog = RateLimitedLog(log)  # repeated warnings: one line per episode, with a count
        # Held while a request is served; readers on other threads (the
        # metrics exporter) take it to see the handler and store at rest.
        self.lock = threading.Lock()
        self.summary_every = 60.0  # seconds between activity lines in the log
        self.shutdown_grace = 0.3  # seconds served after a SHUTDOWN request
        self._last_summary = (time.monotonic(), 0)
        self._stop = threading.Event()
        self._lock = EndpointLock(endpoint)
        self.keys_dir = Path(keys_dir) if keys_dir else default_keys_dir()
        self.allow_insecure_tcp = allow_insecure_tcp
        self.security: dict = {"transport": "ipc" if not is_tcp(endpoint) else "tcp"}
        self.handler.stats_sections["security"] = lambda stats: dict(self.security)
        self._auth = None  # the ZAP authenticator thread (tcp with CURVE)
        self.stop_timeout = stop_timeout
        self.stopping_since: float | None = None  # monotonic time a stop was asked for
        self.write_through = bool(getattr(store, "write_through", False))
        # Write-back with an SSD tier: a PUT is refused while the dirty backlog
        # is at its bound (kvd.store.tiered, PUT), never waited for.
        self._refuse_put = getattr(store, "refuse_put", None)
        self.parking = Parking(parked_max_bytes)
        self.wakeup = Wakeup()
        self.handler.post = self.wakeup.post  # a grant's pages reserved off this thread (handler.on_slots)
        self._signal_fd = False  # the wakeup pipe is Python's signal wakeup fd
        hook = getattr(store, "set_settled_callback", None)
        if hook is not None:
            hook(lambda results, degraded: self.wakeup.post((results, degraded)))
        if self.write_through:
            self.handler.stats_sections["write_through"] = lambda stats: self.parking.stats()
        self.max_peers = max_peers
        self.gate: PeerGate | None = None
        self.outbox: Outbox | None = None
        self._ceiling = 0  # bytes of RSS (anonymous) allowed; recomputed every tick
        self.handler.stats_sections["peers"] = lambda stats: self.peer_stats()
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._guarded = False  # this daemon installed the accept guard (kvd.server.admission.acceptguard)
        self.lanes: Lanes | None = None  # a socket per client (kvd.server.lanes); ipc only
        self.shm_enabled, self.shm_lease_s = shm and not is_tcp(endpoint), shm_lease_s

    # -- lifecycle ---------------------------------------------------------
    def bind(self) -> None:
        """Take the endpoint lock and bind. Raises EndpointError (EndpointBusy) or zmq.ZMQError."""
        self._lock.acquire()
        monitor = None
        try:
            ctx = zmq.Context(io_threads=io_threads())
            start_collector()  # pyzmq's zero-copy thread, now rather than at the first big reply (outbox rule 5)
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.LINGER, 0)
            # A single frame over the limit makes libzmq drop that peer's
            # connection: the last line of defence (clients learn the limit in
            # HELLO and split their messages; totals are checked when decoding).
            sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
            # Per-peer queues, in messages. Inbound, a message may be
            # max_message_bytes, so a client pipelining PUTs must not park
            # gigabytes here. Outbound, a client has one request in flight;
            # a peer with _SNDHWM unread replies is not reading (see Outbox).
            sock.setsockopt(zmq.SNDHWM, _SNDHWM)
            sock.setsockopt(zmq.RCVHWM, 4)
            if is_tcp(self.endpoint):
                self._auth = secure_tcp(ctx, sock, self.endpoint, self.keys_dir, self.allow_insecure_tcp, self.security)
            # Connections waiting to be accepted: what a burst can add at once
            # when the gate opens the listener (kvd.server.admission.gate, _admit).
            sock.setsockopt(zmq.BACKLOG, listen_backlog(self.max_peers or default_max_peers()))
            # Before bind: the gate learns the listener's fd from LISTENING,
            # and libzmq's accept() drops a newcomer rather than abort when no
            # fd is free (kvd.server.admission.acceptguard; the gate is told, rule 8).
            monitor = sock.get_monitor_socket(PeerGate.EVENTS)
            if host_select.mechanism("accept_guard") == "patched accept":  # not macOS, not portable
                self._guarded = acceptguard.install(on_refused=self._on_refused)
            sock.bind(self.endpoint)
        except Exception:
            if monitor is not None:
                monitor.close(linger=0)
            if self._guarded:
                acceptguard.uninstall(self._on_refused)
                self._guarded = False
            if self._auth is not None:
                self._auth.stop()
                self._auth = None
            self._lock.release()
            raise
        # No chmod after bind (kvd.endpoint rule 5): the socket is made in a
        # 0700 directory under the umask `kvd serve` set, so it never exists
        # with a mode another user could use, not even for a moment.
        self._ctx, self._sock = ctx, sock
        if self.shm_enabled:
            from kvd.server.shm.startup import open_plane  # ipc only: TCP peers never get shared memory

            open_plane(self)
        m = self.limits.max_message_bytes
        # Queued replies stay under 2 x m + one message in all (kvd.server.admission.caps.memory_ceiling).
        self._update_ceiling()
        self.gate = PeerGate(
            monitor, max_peers=self.max_peers or default_max_peers(), ceiling=lambda: self._ceiling, over_unit=m
        )
        folder = None if is_tcp(self.endpoint) else folder_of(ipc_path(self.endpoint))
        if folder is not None:
            self.lanes = Lanes(ctx, folder, most=self.max_peers or default_max_peers(), configure=self._configure_lane)
            self.handler.hello_fields.append(self._offer_lane)
            self.gate.lanes_folder = str(folder)  # gate rule 10: it sheds lanes' connections too
        self.outbox = Outbox(sock, peer_bytes=m, total_bytes=2 * m, disconnect=self._cut_off,
                             route=self.lanes.route if self.lanes is not None else None)
        self.gate.start()
        self._arm_gate(ctx)

    def _configure_lane(self, sock: zmq.Socket) -> None:
        """A lane's options: the main socket's (see bind), one peer's worth."""
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
        sock.setsockopt(zmq.SNDHWM, _SNDHWM)
        sock.setsockopt(zmq.RCVHWM, 4)
        sock.setsockopt(zmq.BACKLOG, 4)
        if self.outbox is not None:
            sock.setsockopt(zmq.SNDTIMEO, self.outbox.retry_ms)  # outbox rule 1: a blocking retry is bounded

    def _offer_lane(self, hello: Message) -> dict:
        """HELLO's `lane` for a client that asked for one (kvd.server.lanes)."""
        if not hello.get("lanes") or self.lanes is None:
            return {}
        endpoint = self.lanes.open()
        return {"lane": endpoint} if endpoint is not None else {}

    def _cut_off(self, where: tuple[int, int | None]) -> bool:
        """Cut off the connection at `where` (fd, connection id): a lane's is
        closed with its lane, the main socket's peers are shed by the gate."""
        lane = self.lanes.on(*where) if self.lanes is not None else None
        if lane is not None:
            self.lanes.close(lane, "lanes_cut_off", linger=0)  # type: ignore[union-attr]
            return True
        return self.gate is not None and self.gate.shed(*where)

    def _on_refused(self) -> None:
        """The accept guard found no fd for a connection (libzmq's I/O thread)."""
        gate = self.gate
        if gate is not None:
            gate.refused()

    def _arm_gate(self, ctx: zmq.Context) -> None:
        """Connect to ourselves once, so the gate sees an accept and starts
        keeping the listener paused (kvd.server.admission.gate: it must not pause
        before libzmq's I/O thread has registered the listener)."""
        assert self.gate is not None
        probe = ctx.socket(zmq.DEALER)
        try:
            probe.setsockopt(zmq.LINGER, 0)
            probe.connect(self.endpoint)
            if not self.gate.armed.wait(5.0):
                log.warning("the connection gate saw no accept of its probe: it sheds but does not pause the listener")
        finally:
            probe.close(linger=0)

    def _update_ceiling(self) -> None:
        ram = getattr(self.store, "ram", self.store)
        ssd = getattr(self.store, "ssd", None)
        spilled = ssd.queue.outside_bytes if ssd is not None else 0  # waiting for the disk, no longer in RAM
        # The watchdog reads anonymous memory: entries in shared-memory slots
        # are not in it, and counted here they would let stalled peers take
        # that much more (the RAM tier twice over, in all). Where it counts
        # the slot pages the daemon touched (macOS's footprint), they stay
        # counted: else every page read or written there would look like a
        # peer's, and peers would be shed for it.
        shm = self.handler.shm
        shared = shm.arena.used if shm is not None and not rss_counts_shared() else 0
        self._ceiling = memory_ceiling(max(0, getattr(ram, "bytes", 0) - shared) + spilled, self.limits)

    def peer_stats(self) -> dict:
        out = {"dropped_replies": self.dropped_replies, "rss_ceiling_bytes": self._ceiling,
               "oversized_messages": self.offenders.strikes - self.struck_for_memory,
               "struck_for_memory": self.struck_for_memory, "spared_for_memory": self.offenders.spared,
               "dropped_frames": self.dropped_frames,
               "dropping_ms": round(1000 * self.dropping_seconds, 3), "lane_bomb_cpu_ms": round(1000 * self.lane_bomb_cpu, 3),
               "main_bomb_cpu_ms": round(1000 * self.main_bomb_cpu, 3),
               "main_lent": self._lent is not None, "main_lent_ms": round(1000 * self.lent_seconds, 3),
               "read_while_lent": self.read_while_lent, "read_turns": self.parts.turns, "refused_unread": self.parts.refused,
               "banned_requests": self.banned_requests, "bans": self.offenders.bans, "spoofed_lanes": self.spoofed_lanes,
               **self.backoff.stats()}
        if self.gate is not None:
            out.update(self.gate.stats())
        if self.outbox is not None:
            out.update(self.outbox.stats())
        if self.lanes is not None:
            out.update(self.lanes.stats())
        out.update(self.turns.stats())
        out.update(self.ready.stats())
        out.update(self.courtesy.stats())
        return out

    def stop(self) -> None:
        """Ask the loop to finish (thread- and signal-safe)."""
        if self.stopping_since is None:
            self.stopping_since = time.monotonic()
        self._stop.set()
        self.wakeup.poke()  # out of poll() now, not at the next tick

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: self.stop())
        # Whichever thread the kernel hands the signal to, Python's C handler
        # writes to this fd, so poll() returns at once (not at the next tick)
        # and the handler above runs on this thread.
        signal.set_wakeup_fd(self.wakeup.write_fd, warn_on_full_buffer=False)
        self._signal_fd = True

    def close(self) -> None:
        self._take_back_main()
        if self.handler.shm is not None:
            self.handler.shm.close()
            self.handler.shm = None
        if self.gate is not None and self._sock is not None:
            self._sock.disable_monitor()  # the gate sees MONITOR_STOPPED and ends
            self.gate.stop()
            self.gate.join(timeout=2.0)
            self.gate.resume()  # libzmq must find its own listener when it closes it
            self.gate = None
        if self.lanes is not None:
            self.lanes.close_all()
        if self._sock is not None:
            # Let replies already queued (the SHUTDOWN acknowledgement above
            # all) reach their peers; a peer that is gone cannot hold us long.
            self._sock.close(linger=500)
            self._sock = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._guarded:
            acceptguard.uninstall(self._on_refused)  # before term: no callback into a finalizing interpreter
            self._guarded = False
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._signal_fd:
            signal.set_wakeup_fd(-1)  # before the fd closes: it may be reused
            self._signal_fd = False
        self.wakeup.close()
        self._lock.release()

    # -- the loop ------------------------------------------------------------
    def serve_forever(self) -> None:
        """Bind if needed, then serve until stop() or SHUTDOWN. Always closes."""
        if self._sock is None:
            self.bind()
        assert self._sock is not None
        sock = self._sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self.wakeup.fd, zmq.POLLIN)
        recv = Round(self, poller)
        watching = True  # the poller watches the main socket (not while it is lent, rule 8)

        log.info("serving endpoint=%s", self.endpoint)
        if self.on_ready is not None:
            self.on_ready()
        next_tick = time.monotonic() + self.tick
        stop_at: float | None = None
        try:
            while not self._stop.is_set():
                wake = next_tick if stop_at is None else min(next_tick, stop_at)
                due = self.turns.due(time.monotonic())
                if due is not None:
                    wake = min(wake, due)
                if (held := self.backoff.due()) is not None:
                    wake = min(wake, held)
                timeout_ms = 0 if len(self.ready) else max(0, math.ceil((wake - time.monotonic()) * 1000))
                self._sync_lanes(poller)
                watching = self._watch_main(poller, watching)
                events = recv.poll(timeout_ms)
                if self.wakeup.fd in events:
                    self._settle()
                if held is not None and held <= time.monotonic():
                    self._answer_held()
                if (recv.waiting or len(self.ready) or (due is not None and due <= time.monotonic())) and self._serve_waiting(recv) and stop_at is None:
                    # Keep serving briefly: a peer's unread reply is
                    # discarded when our end of the pipe goes away.
                    stop_at = time.monotonic() + self.shutdown_grace
                    if self.stopping_since is None:
                        self.stopping_since = time.monotonic()
                if self.lanes is not None and self.lanes.doomed:
                    started, cpu = time.perf_counter(), time.thread_time()
                    self.lanes.close_doomed()
                    self._sync_lanes(poller)
                    self.dropping_seconds += time.perf_counter() - started
                    self.lane_bomb_cpu += time.thread_time() - cpu
                if stop_at is not None and time.monotonic() >= stop_at:
                    break
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + self.tick
                    if self.on_tick is not None:
                        self.on_tick()
                    if self.outbox is not None:
                        self.outbox.sweep()
                    self._update_ceiling()
                    self._strike_stuck()
                    self.turns.forget(time.monotonic())
                    self._answer_held(tick=True)
                    if self.lanes is not None:
                        self.lanes.reap()
                    with self.lock:
                        self.store.tick()
                    self._maybe_log_summary()
                    self.ratelog.flush()
        finally:
            if self.stopping_since is None:
                self.stopping_since = time.monotonic()
            self._take_back_main()
            self._refuse_ready("the daemon is stopping")
            self._answer_held(stopping=True)
            self._drain_parked(self.stopping_since + self.stop_timeout / 2)
            self.ratelog.flush(force=True)
            log.info("stopping endpoint=%s", self.endpoint)
            self.close()

    def _watch_main(self, poller: zmq.Poller, watching: bool) -> bool:
        """Rule 8: the poller leaves the main socket alone while it is lent;
        once it is back, the replies held for its peers are sent."""
        lent = self._lent
        if lent is not None and lent.back.is_set():
            self._taken_back(lent)
            lent = None
        if lent is not None and watching:
            poller.unregister(self._sock)
            return False
        if lent is None and not watching:
            poller.register(self._sock, zmq.POLLIN)
            return True
        return watching

    def _sync_lanes(self, poller: zmq.Poller) -> None:
        """The poller watches the lanes open now (kvd.server.lanes)."""
        lanes = self.lanes
        if lanes is None:
            return
        for lane in lanes.removed:
            poller.unregister(lane.sock)
            self.parts.forget(lane.sock)
        for lane in lanes.added:
            poller.register(lane.sock, zmq.POLLIN)
        lanes.removed.clear()
        lanes.added.clear()

    def _serve_waiting(self, recv: Callable[[], list[zmq.Frame]], most: int = 64) -> bool:
        """Serve up to `most` requests (rule 6), then return to the loop: it
        must tick under load. Before each, whatever waits on the socket is
        read into `ready` (rule 7); `recv` is the next message from the
        socket, or raises zmq.Again. True if one asked the daemon to shut down."""
        turns, ready, shutdown = self.turns, self.ready, False
        for _ in range(most):
            raw, waited = turns.overdue(), True
            if raw is None:
                shutdown = self._read_ready(recv) or shutdown
                raw, waited = ready.pop(), False
                if raw is None:
                    raw, waited = turns.take(time.monotonic()), True  # nobody else asks: a heavy peer's turn, if due
                    if raw is None:
                        break
                elif not ready.last_write:  # someone waits on it: the writer steps aside
                    self.courtesy.serving()
                    try:
                        shutdown = self._serve_one(raw) or shutdown
                    finally:
                        self.courtesy.served(read=ready.last_type in ("GET", "LOOKUP"))
                    continue
            shutdown = self._serve_one(raw, waited=waited) or shutdown
        return shutdown

    def _read_ready(self, recv: Callable[[], list[zmq.Frame]]) -> bool:
        """Read what waits on the socket into `ready`, or `turns` for a heavy
        peer, while `ready` has room. True if a request served meanwhile (a
        heavy one without room to wait) asked the daemon to shut down."""
        turns, ready, shutdown = self.turns, self.ready, False
        refresh = getattr(recv, "refresh", None)  # (a test's own recv may have none)
        if refresh is not None and ready.room():
            refresh()
        while ready.room():
            try:
                raw = recv()
            except zmq.Again:
                break
            peer = raw[0].bytes
            conn = self._conn(peer, raw[1].get(zmq.SRCFD) if len(raw) > 1 else None)
            if conn is not None and self.gate is not None and self.gate.is_banned(conn.origin):
                # Banned (gate rule 9), and its request came before the gate
                # read its ACCEPTED news: unserved, its connection cut.
                self.banned_requests += 1
                self._cut_off(conn.where)
                continue
            if self.outbox is not None and self.outbox.mute(peer, conn and conn.where):
                # It does not read its replies: this request costs nothing more
                # (and is not charged: a mean pulled down by cheap drops would hide its process's heavy requests).
                self.dropped_replies += 1
                continue
            nbytes = sum(len(f) for f in raw)
            mtype = codec.peek_type(raw[1]) if len(raw) > 1 else None
            # (A type the first bytes do not name may be a write: a busy writer's waits too.)
            if not ready.peers_waiting(peer) and turns.defers(peer, conn and conn.origin, mtype is None or mtype in WRITES):
                if turns.full(peer):  # it sends without waiting for its replies (turns.py rule 3)
                    turns.counters["refused_waiting"] += 1
                    self._send(peer, self._busy(raw[1:], f"{turns.max_per_peer} of this connection's requests "
                                                          "wait for their turn already: wait for their replies"),
                               raw[1:], conn and conn.where)
                    continue
                while len(turns) and not turns.room(nbytes):
                    shutdown = self._serve_one(turns.pop(), waited=True) or shutdown
                if turns.room(nbytes):
                    turns.put(peer, raw, nbytes, conn and conn.origin)
                    continue
                # too big to wait: served next (its peer has nothing waiting)
            if not ready.room(nbytes):
                shutdown = self._serve_one(raw) or shutdown  # no room: served now, as before this queue
                break
            ready.put(peer, raw, nbytes, mtype)
        return shutdown

    def _maybe_log_summary(self) -> None:
        """One info line per `summary_every` seconds with activity, for operators."""
        now = time.monotonic()
        since, seen = self._last_summary
        total = sum(self.handler.requests.values())
        if now - since < self.summary_every or total == seen:
            return
        self._last_summary = (now, total)
        tiers = finish(self.store.stats_steps(namespaces=False)).get("tiers", {})
        parts = [f"requests={total - seen}"]
        for name, t in tiers.items():
            parts.append(f"{name}_entries={t.get('entries', 0)} {name}_bytes={t.get('bytes', 0)} {name}_hits={t.get('hits', 0)} {name}_misses={t.get('misses', 0)} {name}_evictions={t.get('evictions', 0)}")
        if self.dropped_replies:
            parts.append(f"dropped_replies={self.dropped_replies}")
        log.info("activity %s", " ".join(parts))

    def _serve_one(self, raw: list[zmq.Frame], waited: bool = False) -> bool:
        """Serve one request, or the next turn of one served in turns
        (`raw` an Unfinished); True if it asked the daemon to shut down."""
        left = raw if isinstance(raw, Unfinished) else None
        saturated, refused = False, None
        self._backlog_busy = False
        if left is not None:
            identity, frames, conn = left.identity, left.frames, left.conn
        else:
            identity, payload = raw[0].bytes, raw[1:]
            fd = payload[0].get(zmq.SRCFD) if payload else None
            conn = self._conn(identity, fd)
            if self.gate is not None:
                self.gate.touch(fd)
            saturated = self.outbox is not None and self.outbox.saturated(identity)
            if not saturated:
                refused = self._truncated(raw) if isinstance(raw, Truncated) else self._refused_unread(payload)
            # (A refused request's frames are not made bytes: 8,000 of them take ~1.5 ms.)
            frames = kept(payload) if refused is None else payload
        started, cpu = time.perf_counter(), time.thread_time()
        self._left = None
        if left is not None:
            with self.lock:
                reply, shutdown, mtype = self._handle(frames, identity, left)
        elif saturated:
            # Its replies would be dropped or refused anyway: do no work for it.
            reply, shutdown, mtype = self._busy(frames, "replies to this peer are not being read; read them"), False, "BUSY"
        elif refused is not None:
            reply, shutdown, mtype = refused
        else:
            with self.lock:
                reply, shutdown, mtype = self._handle(frames, identity)
        if not self._backlog_busy and mtype in ("PUT", "SLOTS") and left is None:
            self.backoff.taken(whose(identity, conn and conn.origin))  # (rule 10)
        if reply is not None and not (self._backlog_busy and self._hold_refusal(identity, reply, conn)):
            self._send(identity, reply, frames, conn and conn.where)  # (None: parked, or more turns to come)
        nbytes = left.size if left is not None else sum(len(f) for f in frames)
        dropped = raw.dropped if isinstance(raw, Truncated) else 0  # (charged as if read: they arrived)
        nbytes += raw.dropped_bytes if dropped else 0
        while self._left is not None and not self.turns.room(nbytes):
            # No room to wait: served to its end now, as a request too big to wait is.
            rest, self._left = self._left, None
            with self.lock:
                reply, _, mtype = self._handle(frames, identity, rest)
            if reply is not None:
                self._send(identity, reply, frames, conn and conn.where)
        if self._left is not None:  # its next turn comes as a heavy peer's does (turns.py rule 5)
            self.turns.put_first(identity, self._left._replace(conn=conn, size=nbytes), nbytes, conn and conn.origin)
        elapsed = time.perf_counter() - started
        # CPU time, not wall: on a busy machine every request takes longer, the cheap ones too
        cpu = time.thread_time() - cpu
        # (A request's bytes are charged with its first turn: they arrived once.)
        connected = identity in self._fresh  # its connection's first request (what connecting cost is charged with it)
        self._fresh.discard(identity)
        self.turns.charge(identity, cpu, 0 if left is not None else nbytes, time.monotonic(),
                          waited=waited, origin=conn and conn.origin, parts=0 if left is not None else len(frames) + 1 + dropped,
                          more=self._left is not None, write=mtype in WRITES, connected=connected)
        self.latency.observe(mtype, elapsed)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("served type=%s ms=%.3f", mtype, 1000 * elapsed)
        return shutdown

    def _handle(self, frames: list, identity: bytes = b"", left: Unfinished | None = None) -> tuple[list | None, bool, str]:
        """(reply frames or None if parked or unfinished, shutdown?, message
        type for metrics) for one request, or for the next turn of `left`.
        A request with turns to come is left in `self._left`."""
        shutdown = False
        if left is not None:
            msg = left.msg
        else:
            try:
                msg = codec.decode_request(frames, self.limits)
                if (peeked := codec.peek_type(frames[0])) is not None and peeked != msg.type:
                    # The loop ordered and admitted it by the first "type" (Ready, Turns); the
                    # decoder keeps the last. A header that names two is refused, not served as either.
                    raise E.MalformedMessage(f"the header names its type twice ({peeked!r}, then {msg.type!r})")
            except E.ProtocolError as err:
                self.handler.errors[err.name] += 1
                self.ratelog.warning(f"rejected error={err.name}", "rejected error=%s code=%d detail=%r", err.name, err.code, err.message)
                return codec.encode_error(err, id=codec.peek_id(frames) if frames else 0), False, "INVALID"
        try:
            nbytes = 0
            if left is not None:
                rtype, fields, nbytes = msg.type, left.sliced, left.nbytes
            elif msg.type in ("PUT", "SLOTS", "COMMIT") and self.write_through:
                nbytes = self._waiting_bytes(msg, frames)
                # A COMMIT's bytes were admitted with its SLOTS (and are in the arena by now).
                if msg.type != "COMMIT" and (why := self._admit_waiting(identity, nbytes)) is not None:
                    self._backlog_busy = True
                    raise E.Busy(f"write-through: {why}; retry later")
            if left is None and msg.type in ("PUT", "SLOTS") and not self.write_through and self._refuse_put is not None:
                # A shared-memory PUT is refused at SLOTS, before it takes arena
                # slots; its COMMIT, like a PUT admitted a moment ago, is not.
                # The PUT counts with the grants awaiting their COMMIT: those are
                # backlog already (kvd.store.tiered, PUT).
                shm = self.handler.shm
                if (why := self._refuse_put(self._waiting_bytes(msg, frames), len(msg.get("chunks") or ()),
                                            shm.granted_bytes if shm is not None else 0)) is not None:
                    self._backlog_busy = True
                    raise E.Busy(f"write-back: {why}; retry later")
            if left is None:
                rtype, fields = self.handler.handle(msg)
            if isinstance(fields, Sliced):
                got = fields.resume(self.handler.slice_seconds)
                if got is None:
                    self._left = Unfinished(identity, frames, msg, fields, nbytes, None)
                    return None, False, msg.type
                rtype, fields = got
            if isinstance(fields, Deferred):
                # (A SLOTS parks with no bytes: its grant's count against the
                # write-back bound, shm.granted_bytes, already holds them.)
                self.parking.park(identity, msg.id, fields.fields, fields.eids, 0 if rtype == "SLOTS" else nbytes, rtype)
                return None, False, msg.type
            reply = codec.encode(rtype, fields, id=msg.id)
        except ShutdownRequested:
            reply, shutdown = codec.encode("SHUTDOWN", {}, id=msg.id), True
            log.info("shutdown requested by a client")
        except (E.ProtocolError, E.ServerError) as err:  # wire errors; local ones are bugs here
            self.handler.errors[err.name] += 1
            self.ratelog.warning(
                f"failed type={msg.type} error={err.name}", "failed type=%s error=%s detail=%r", msg.type, err.name, err.message
            )
            reply = codec.encode_error(err, id=msg.id)
        except Exception:
            err = E.Internal(f"internal error serving {msg.type}; see the daemon log")
            self.handler.errors[err.name] += 1
            log.exception("internal error type=%s id=%d", msg.type, msg.id)
            reply = codec.encode_error(err, id=msg.id)
        return reply, shutdown, msg.type

    def _writer_awaited(self) -> bool:
        """Someone waits on the SSD writer (kvd.store.courtesy rule 2; its
        thread asks): a write-through PUT parked, or memory pressure."""
        parking = getattr(self, "parking", None)  # (in write-back mode only reads wait there, on the remote tier)
        return bool(self.write_through and parking is not None and len(parking)) or self.pressed()

    def _truncated(self, raw: Truncated) -> tuple[list, bool, str]:
        """The answer to a message refused as it was read (`_refusable`), its
        frames after the header dropped: TOO_MANY_FRAMES if they were more
        than the limit allows (as a message read whole is told), else BUSY,
        whether or not the backlog has had room since (a moment): what it
        carried is gone."""
        payload, mtype = raw[1:], codec.peek_type(raw[1]) or "PUT"
        if 1 + raw.dropped > self.limits.max_frames:
            err = E.TooManyFrames(
                f"{1 + raw.dropped} frames; the limit is {self.limits.max_frames}")
            self.handler.errors[err.name] += 1
            return codec.encode_error(err, id=codec.peek_id(payload)), False, mtype
        refused = self._refused_unread(payload)
        if refused is not None:
            return refused
        # (Not counted in backlog_refusals: the store no longer refuses it.)
        self._backlog_busy = True
        return self._busy(payload, f"write-back: stored chunks were {E.BACKLOG_FULL} when this PUT came, its frames "
                                   "dropped unread: send it again"), False, mtype

    def _backlog_refusal(self, header, *, count: bool = True) -> tuple[str, str] | None:
        """(type, why) if a write-back PUT or SLOTS with this header is refused
        now for the backlog, from its first bytes alone; else None."""
        if self.write_through or self._refuse_put is None:
            return None
        if (mtype := codec.peek_type(header)) not in ("PUT", "SLOTS"):  # (~1.5 us)
            return None
        shm = self.handler.shm
        with self.lock:  # (refuse_put counts what it refuses; the metrics thread reads the store under it)
            why = self._refuse_put(0, 0, shm.granted_bytes if shm is not None else 0, count=count)
        return None if why is None else (mtype, why)

    def _refusable(self, header: zmq.Frame) -> bool:
        """At read time (kvd.server.admission.parts): would a message with this
        header be refused unread (`_refused_unread`, not counted here)? Its
        frames are then dropped in C as they are read, not made Frames (~0.75
        us each: 6 ms of the thread for 8,000 tiny chunks, at every refusal)."""
        return self._backlog_refusal(header, count=False) is not None

    def _refused_unread(self, frames: list) -> tuple[list, bool, str] | None:
        """A write-back PUT or SLOTS refused BUSY before its header is
        decoded (one of 8,000 tiny chunks takes 2-7 ms), as `_handle` answers:
        when the backlog is past its bound with nothing added, what the
        request holds cannot change the answer. None: decoded and served."""
        if not frames or (refusal := self._backlog_refusal(frames[0])) is None:
            return None
        mtype, why = refusal
        self._backlog_busy = True
        err = E.Busy(f"write-back: {why}; retry later")
        self.handler.errors[err.name] += 1
        self.ratelog.warning(f"failed type={mtype} error={err.name}", "failed type=%s error=%s detail=%r", mtype, err.name, err.message)
        return codec.encode_error(err, id=codec.peek_id(frames)), False, mtype

    def _busy(self, request: list, why: str) -> list:
        err = E.Busy(f"{why}, or retry later")
        self.handler.errors[err.name] += 1
        return codec.encode_error(err, id=codec.peek_id(request) if request else 0)

    def _send(self, identity: bytes, frames: list, request: list | None = None, where: tuple | None = None) -> None:
        assert self.outbox is not None
        outcome = self.outbox.send(identity, frames, busy=lambda: self._busy(request, "too many reply bytes are queued for peers"), where=where)
        if outcome == "dropped":
            self.dropped_replies += 1
            self.ratelog.warning("reply dropped", "reply dropped (peer gone or not reading)")
        elif outcome == "busy":
            self.ratelog.warning("reply over budget", "reply refused BUSY: queued reply bytes over budget")
