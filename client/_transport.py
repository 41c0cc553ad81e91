"""One DEALER socket to the daemon: requests, replies, timeouts, reconnection.

Theory of operation
-------------------
Requests are serialized by a lock (one in flight per Transport), tagged with
an increasing id, and their reply is the next message carrying that id;
stale replies (to a request that already timed out) are discarded.

The socket is created with ZMQ_IMMEDIATE, so a message is only queued once a
connection to the daemon exists. That gives a cheap "is the daemon there?"
test -- POLLOUT -- and a down daemon costs a caller at most `connect_wait`,
then nothing at all until `retry_interval` has passed (ZeroMQ keeps
reconnecting in the background; the first call after the daemon is back
finds POLLOUT ready). A request that timed out after being sent leaves the
socket in an unknown state, so the socket is closed and a fresh one made:
that also makes a restarted daemon reachable again without the caller
doing anything. A reply cannot come once the connection the request went
over is gone (the daemon stopped, restarted, was killed): the socket's
monitor reports that, and the call fails then (DaemonUnavailable) instead of
at its timeout -- a model server's request in flight across `systemctl
restart kvd` would otherwise wait its whole timeout.

Nothing a daemon sends is trusted to be small (PROTOCOL.md section 11):
a reply is bounded by what the daemon advertised in HELLO (`reply_limits`;
before HELLO, the defaults). ZMQ_MAXMSGSIZE drops a connection whose peer
sends a frame larger than that, before libzmq buffers it; ZMQ_RCVHWM keeps
at most a few unread messages (one request is in flight per socket, so
anything more is unsolicited); and a reply is received part by part, so
one of too many frames (or past the deadline) is abandoned -- the socket
closed -- instead of being turned into a million Python objects. A message
whose id is not the request's is dropped even if it cannot be decoded: a
daemon's stale or unsolicited garbage never fails the next request.

ZeroMQ contexts and sockets do not survive os.fork(): a child using its
parent's socket can block for ever. A Transport remembers the pid that made
its socket; in another process it abandons the inherited context, socket and
lock (never closing them: that could block, or disturb the parent's own
connection) and makes its own.

Lanes (PROTOCOL.md, HELLO): on an ipc endpoint a HELLO asks for a lane, a
socket the daemon binds for this client alone, so another client's frame
bomb never holds this one's requests. When the reply names one (in the main
socket's folder; anything else is ignored), later requests go there through
a Transport of its own; the main socket stays connected (idle), for HELLO
and to fall back on. A lane with no connection (the daemon restarted, or
closed it) is dropped before a request is sent on it, and the request goes
to the main socket, after a HELLO there that asks for a lane again; a lane
that fails a request (no reply, a bad one) is dropped after it: that call
is a miss like any other. A daemon that offers no lane (older, or at its
bound) leaves the client on the main socket: lanes are never needed. The
lane's Transport shares this one's lock: still one request in flight, and
no socket touched by two threads (a POLLOUT check on the lane racing a
request on it lost messages).

ZeroMQ starts threads of its own on first need: the context's I/O threads
with its first socket, pyzmq's garbage collector (a thread, and a context
of its own) with the first zero-copy send -- the first PUT of tensor bytes.
A model server at its thread limit (a container's pids limit, systemd's
TasksMax) may reach it only after start-up, so these are started when a
Transport is made, and again in a forked child (_warm_up). What still
fails in this process -- a thread or file it cannot have, a send cut short
-- is DaemonUnavailable like an outage, never a ZeroMQ or RuntimeError out
of `request` (the client's promise: a failed call is a miss, not a crash),
and the socket is remade: a message cut short would prefix the next one.
"""

from __future__ import annotations

import itertools
import os
import struct
import threading
import time
from typing import Any

import zmq

from kvd.endpoint import (
    CurveKeys, UnsafeEndpoint, check_run_dir, check_socket, endpoint_locked, ipc_path, is_default_run_dir, is_tcp,
    peer_uid,
)
from kvd.protocol import codec
from kvd.protocol.codec import Message
from kvd.protocol.errors import KvdError, ProtocolError, from_code
from kvd.protocol.limits import DEFAULT_LIMITS, Limits
from kvd_client._errors import AuthenticationFailed, BadReply, DaemonUnavailable

_LANE_WAIT_S = 0.05  # what taking a lane may wait for its connection
_LANE_CONNECT_S = 2.0  # a lane still unconnected this long after HELLO offered it is dropped
_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
# A reply is bounded by the limits the daemon advertised (module docstring),
# with room for its header beside a full page of tensor bytes: a GET page
# holds up to max_message_bytes of tensors (PROTOCOL.md section 5 GET).
_HEADER_FLOOR, _HEADER_CEILING = 1 << 20, 64 << 20  # a header bound we accept from HELLO
_MESSAGE_FLOOR, _MESSAGE_CEILING = 1 << 20, 1 << 40
_REPLY_FRAMES = 1 << 20  # a page of many tiny tensors may have more than max_frames (a request bound)
_TENSOR_ENTRY = 32  # header bytes of the smallest tensor that refers to a frame: so many frames at most
_FRAME_SLACK = 1 << 20  # MAXMSGSIZE over the largest frame a reply may hold
_RCVHWM = 2  # unread messages kept: the reply, and one stale reply to a request that timed out
_SMALL_FRAME = 1 << 16  # smaller parts are copied out, not kept as zmq.Frame objects
_CHECK_EVERY = 1024  # parts received between two looks at the clock


def reply_limits(advertised: Limits) -> Limits:
    """The bounds a reply from a daemon advertising `advertised` is decoded
    under: its message and header limits (clamped to sane ranges), the
    header allowed beside a full page of tensor bytes."""
    header = min(max(advertised.max_header_bytes, _HEADER_FLOOR), _HEADER_CEILING)
    message = min(max(advertised.max_message_bytes, _MESSAGE_FLOOR), _MESSAGE_CEILING)
    frames = min(_REPLY_FRAMES, 1 + header // _TENSOR_ENTRY)
    return Limits(max_message_bytes=message + header, max_header_bytes=header, max_frames=frames)


def _max_frame(limits: Limits) -> int:
    """ZMQ_MAXMSGSIZE (a bound per frame, not per message) for these reply limits."""
    return limits.max_message_bytes - limits.max_header_bytes + _FRAME_SLACK


_DEFAULT_REPLY_LIMITS = reply_limits(DEFAULT_LIMITS)

# Sockets and monitors inherited across a fork: kept referenced, never closed
# in the child (pyzmq's close is a no-op there anyway; dropping them would
# only warn).
_ABANDONED: list[Any] = []
_fork_lock = threading.Lock()


def fork_lock() -> threading.Lock:
    """The lock under which a forked child's first caller remakes what the
    parent's threads owned (here a Transport's socket; the mlx adapter's
    writer too). A new one in each child: the parent's may have been held by
    a thread the child does not have."""
    return _fork_lock


def _renew_fork_lock() -> None:
    global _fork_lock
    _fork_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_fork_lock)

# Where ZeroMQ fails in this process rather than at the daemon: a thread it
# cannot start (RuntimeError, from pyzmq's garbage collector), a file it
# cannot open (ZMQError EMFILE), any other error of a ZeroMQ call.
_LOCAL_FAILURES = (RuntimeError, zmq.ZMQError)
_warm_pid: int | None = None  # the process whose ZeroMQ threads _warm_up started


def _warm_up(ctx: zmq.Context) -> None:
    """Start, once per process, the threads ZeroMQ would start on first need
    (module docstring): the context's I/O threads -- libzmq *aborts* the
    process when it cannot start them -- and pyzmq's garbage collector, which
    a zero-copy send starts and which raises RuntimeError mid-message when
    it cannot. A warm-up that fails is not an error: the request that needs
    them fails instead, as DaemonUnavailable."""
    global _warm_pid
    if _warm_pid == os.getpid():
        return
    try:
        ctx.socket(zmq.DEALER).close(linger=0)  # the first socket starts the context's threads
        zmq.Frame(b"\0", copy=False)  # a zero-copy frame starts the collector; dropped unsent
    except _LOCAL_FAILURES:
        return
    _warm_pid = os.getpid()


class Transport:
    """A thread-safe request/reply channel to one endpoint."""

    def __init__(
        self, endpoint: str, *, connect_wait: float = 0.25, retry_interval: float = 1.0, curve: CurveKeys | None = None
    ):
        self.endpoint = endpoint
        self.curve = curve
        self._monitor: zmq.Socket | None = None
        self._auth_error: str | None = None
        self._peer_fd: int | None = None  # of the last connection made, until checked
        self._dropped = False  # a connection dropped since the request in flight was sent
        self.connect_wait = connect_wait
        self.retry_interval = retry_interval
        self._pid = os.getpid()
        self._ctx = zmq.Context.instance()
        self._lock = threading.RLock()  # shared with our lane's Transport (one request in flight)
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self._reply_limits = _DEFAULT_REPLY_LIMITS
        self._sock_max_frame = 0  # the MAXMSGSIZE last set on the socket
        self._fresh = True  # socket never connected yet: allow connect_wait
        self._down_until = 0.0
        self._ipc = ipc_path(endpoint)
        # The run dir is checked only if it is a default one (kvd.endpoint rule 5).
        self._run_dir = self._ipc.parent if self._ipc is not None and is_default_run_dir(self._ipc.parent) else None
        self._lane: Transport | None = None  # our lane, while we have one (module docstring)
        self._hello: dict[str, Any] | None = None  # the last HELLO's fields: asked again to take a new lane
        self._rehello = False  # a lane was lost without a failed call: ask HELLO before the next request
        self._lane_since = 0.0  # when the lane was taken
        _warm_up(self._ctx)

    def _absent(self) -> str:
        """Why no connection: an ipc daemon that holds its endpoint's lock is
        there but does not answer (stopped, or too busy to take one)."""
        try:
            running = endpoint_locked(self.endpoint)
        except (KvdError, OSError):
            running = None
        if running:
            return f"the daemon at {self.endpoint} does not answer (stopped, or too busy to take a connection)"
        return f"no daemon at {self.endpoint}"

    def _check_safe(self) -> None:
        """Refuse (UnsafeEndpoint) a run dir or socket file another user may
        own, before every request: ZeroMQ reconnects on its own, so a check
        made once at connect time would not cover a socket swapped later."""
        if self._ipc is None:
            return
        try:
            if self._run_dir is not None:
                check_run_dir(self._run_dir)
            check_socket(self._ipc)
        except UnsafeEndpoint:
            self._reset()  # never keep a connection to what we now refuse
            raise

    def _after_fork(self) -> None:
        """In a forked child: abandon what the parent made, start afresh (module docstring)."""
        with fork_lock():
            if self._pid == os.getpid():
                return  # another thread of this child did it
            _ABANDONED.extend(x for x in (self._monitor, self._sock) if x is not None)
            self._monitor = self._sock = None
            self._auth_error = self._peer_fd = None
            self._ctx = zmq.Context.instance()  # pyzmq makes a new one in a new process
            self._lock = threading.RLock()  # the parent's may be held by a thread that did not fork
            self._fresh, self._down_until = True, 0.0
            self._lane, self._rehello = None, False  # the parent's (it abandons itself): this child asks for its own
            self._pid = os.getpid()
            _warm_up(self._ctx)  # the parent's threads did not fork: this child's own, now

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            try:
                self._configure(sock)
            except _LOCAL_FAILURES:
                # Half made (a monitor it could not open, at a file limit):
                # its monitor stopped before either is closed (see _configure).
                sock.disable_monitor()
                if self._monitor is not None:
                    self._monitor.close(linger=0)
                    self._monitor = None
                sock.close(linger=0)
                raise
            self._sock, self._fresh = sock, True
        return self._sock

    def _configure(self, sock: zmq.Socket) -> None:
        """Set up and connect a new socket (its options, its monitor)."""
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, 50)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        self._sock_max_frame = _max_frame(self._reply_limits)
        sock.setsockopt(zmq.MAXMSGSIZE, self._sock_max_frame)
        sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        if self.curve is not None:
            sock.curve_publickey, sock.curve_secretkey = self.curve.public, self.curve.secret
            sock.curve_serverkey = self.curve.server
        if self._ipc is not None:
            # Who serves the socket is checked per connection, not only
            # by the path: ZeroMQ reconnects in the background, and a
            # connection made while another user squatted the path
            # outlives their moving it away (_check_peer).
            self._monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        elif is_tcp(self.endpoint):
            # A refused CURVE handshake is silent at the socket (it just
            # never becomes writable); the monitor tells it from a daemon
            # that is down, so the caller gets AuthenticationFailed.
            # libzmq's I/O thread -- shared by every socket of this
            # process's context -- *blocks* sending an event the monitor
            # cannot take (its reader closed, or 1,000 unread): so events
            # are read at every request, a refused socket is closed rather
            # than left to retry, and the monitor is never closed before
            # the socket it watches (_reset, __del__).
            self._monitor = sock.get_monitor_socket(_HANDSHAKE_EVENTS | zmq.EVENT_DISCONNECTED)
        sock.connect(self.endpoint)

    def _handshake_refused(self) -> str | None:
        """The last handshake failure the monitor saw since the last success, if any."""
        if self._monitor is None:
            return self._auth_error
        while self._monitor.poll(0):
            try:
                frames = self._monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 2 or len(frames[0]) != 6:
                continue
            # libzmq's event: u16 id, i32 value (an fd here), no padding; read
            # without zmq.utils.monitor, which imports asyncio (~25 ms at import)
            event, value = struct.unpack("=Hi", frames[0])
            if event == zmq.EVENT_CONNECTED:
                self._peer_fd = value  # the latest: a DEALER of one endpoint has one connection
            elif event == zmq.EVENT_DISCONNECTED:
                self._dropped = True
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._auth_error = None
            else:
                self._auth_error = zmq.Event(event).name
        return self._auth_error

    def _check_peer(self) -> None:
        """Refuse (UnsafeEndpoint) the connection the socket made last if the
        process at its other end runs as another user (root excepted)."""
        self._handshake_refused()  # reads the connection events too
        fd, self._peer_fd = self._peer_fd, None
        uid = None if fd is None else peer_uid(fd)
        if uid is not None and uid not in (os.getuid(), 0):
            self._reset()
            raise UnsafeEndpoint(
                f"refusing the kvd socket {self._ipc}: the process serving it runs as uid {uid}, "
                f"not as you (uid {os.getuid()})"
            )

    def _refusal(self, why: str) -> AuthenticationFailed:
        return AuthenticationFailed(
            f"the daemon at {self.endpoint} refused the CURVE handshake ({why}): "
            + ("this client has no keys" if self.curve is None else "its key is not authorized there, or the server key is wrong")
        )

    def _reset(self) -> None:
        if self._pid != os.getpid():
            return  # the parent's socket: never touched here (see _after_fork)
        if self._monitor is not None:
            assert self._sock is not None
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _starved(self, what: str, err: Exception) -> DaemonUnavailable:
        """ZeroMQ failed in this process (`_LOCAL_FAILURES`), not at the
        daemon: the socket is dropped -- it may hold part of a message, which
        would prefix the next -- and the call fails as one the daemon did not
        answer (module docstring)."""
        self._reset()
        failed = DaemonUnavailable(
            f"could not {what} {self.endpoint} in this process ({type(err).__name__}: {err}; "
            "at its thread or open-file limit?)"
        )
        failed.local = True  # never `out_of_time`: no budget ran out (kvd_client._core)
        return failed

    def set_limits(self, advertised: Limits) -> None:
        """Bound replies by what the daemon advertised in HELLO, from the next
        request on (MAXMSGSIZE applies to connections made after it is set: a
        socket that must accept larger frames is remade)."""
        self._reply_limits = reply_limits(advertised)
        lane = self._lane
        if lane is not None:
            lane.set_limits(advertised)

    def retry_now(self) -> None:
        """The daemon is known to be back (someone else reached it): drop the
        socket, so the next request connects afresh (allowing `connect_wait`)
        instead of failing fast or waiting out ZeroMQ's reconnect back-off."""
        if self._pid != os.getpid():
            self._after_fork()
        self._drop_lane()
        with self._lock:
            self._reset()
            self._down_until = 0.0

    def close(self) -> None:
        if self._pid != os.getpid():
            self._after_fork()
        self._drop_lane()
        with self._lock:
            self._reset()

    def __del__(self) -> None:
        # Dropped without close(): without this the monitor's reader could be
        # freed before the socket it watches (see _socket).
        try:
            self._reset()
        except Exception:
            pass

    def _receive(self, sock: zmq.Socket, deadline: float, limits: Limits) -> list[Any] | None:
        """The buffers of the next message, received part by part; None if
        there is none after all. A message of more frames or bytes than
        `limits` allow is BadReply, one still arriving at `deadline`
        DaemonUnavailable; either way the socket is closed, which drops the
        rest of it without reading it."""
        parts: list[Any] = []
        total = 0
        while True:
            try:
                # Never a blocking recv: with ZMQ_IMMEDIATE, a connection
                # that drops (the daemon killed) takes its pipe's unread
                # messages with it at once, so a message poll() saw may be
                # gone by now, and a blocking recv would wait for ever.
                frame = sock.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if not parts:
                    return None
                self._reset()
                raise DaemonUnavailable(f"the connection to {self.endpoint} dropped mid-reply") from None
            size = len(frame)
            total += size
            # Small parts as bytes while receiving (an empty one is a shared
            # object): a hostile reply of many frames costs a pointer each
            # until refused; views are made only for a message within bounds.
            parts.append(frame.bytes if size < _SMALL_FRAME else frame.buffer)
            if not frame.more:
                return [memoryview(p) if isinstance(p, bytes) else p for p in parts]
            if len(parts) >= limits.max_frames or total > limits.max_message_bytes:
                self._reset()
                raise BadReply(f"reply from {self.endpoint} over {limits.max_frames} frames or "
                               f"{limits.max_message_bytes} bytes")
            if len(parts) % _CHECK_EVERY == 0 and time.monotonic() > deadline:
                self._reset()
                raise DaemonUnavailable(f"reply from {self.endpoint} still arriving at the deadline")

    def _await_reply(self, sock: zmq.Socket, deadline: float) -> bool:
        """Wait until a message is readable (True) or `deadline` (False).
        Raises DaemonUnavailable once the connection the request went over
        drops: its reply cannot come (the daemon stopped or died with it),
        and a restarted daemon never saw it (module docstring)."""
        monitor = self._monitor
        if monitor is None:
            remaining = deadline - time.monotonic()
            return remaining > 0 and bool(sock.poll(int(remaining * 1000) + 1, zmq.POLLIN))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            ready = dict(poller.poll(int(remaining * 1000) + 1))
            if sock in ready:
                return True
            if monitor in ready:
                self._handshake_refused()  # reads the events
                if self._dropped:
                    self._reset()
                    raise DaemonUnavailable(
                        f"the daemon at {self.endpoint} closed the connection before replying (stopped or restarted)"
                    )

    # -- lanes (module docstring) ---------------------------------------------
    def _drop_lane(self) -> None:
        lane, self._lane = self._lane, None
        if lane is not None:
            lane.close()

    def _take_lane(self, endpoint: Any, advertised: Any = None) -> None:
        """Send later requests to the lane a HELLO reply named, if it is an
        ipc socket in the main socket's folder."""
        path = ipc_path(endpoint) if isinstance(endpoint, str) and endpoint.startswith("ipc://") else None
        if path is None or self._ipc is None or path.parent != self._ipc.parent or path == self._ipc:
            return
        lane = Transport(endpoint, connect_wait=self.connect_wait, retry_interval=self.retry_interval)
        lane._reply_limits = self._reply_limits
        try:
            # The bounds its replies will have (set_limits follows): a socket
            # made under the defaults would be remade, and its connection with it.
            lane.set_limits(Limits.from_wire(advertised))
        except Exception:
            pass  # not a map of limits: the caller's checks say so; the defaults meanwhile
        try:
            with lane._lock:
                lane._check_safe()
                # Connecting now, while the daemon that offered it is there; a
                # moment's wait (an ipc handshake takes ~0.1 ms) so the next
                # request finds it ready rather than going to the main socket.
                lane._socket().poll(int(1000 * min(self.connect_wait, _LANE_WAIT_S)), zmq.POLLOUT)
        except (KvdError, zmq.ZMQError):
            lane.close()
            return
        self._lane_since = time.monotonic()
        lane._lock = self._lock  # one request in flight per client, on either socket
        self._drop_lane()
        self._lane = lane

    def request(self, mtype: str, fields: dict[str, Any] | None, timeout: float) -> Message:
        """Send a request and return its decoded reply: on our lane if we
        have one, else on the main socket. Raises as `_request`."""
        if self._pid != os.getpid():
            self._after_fork()
        # Under the lock our lane shares: a ZeroMQ socket is for one thread at a time.
        started = time.monotonic()
        if not self._lock.acquire(timeout=max(0.0, timeout)):
            raise DaemonUnavailable(f"client busy for {timeout:.1f}s (another call in flight)")
        try:
            return self._route(mtype, fields, timeout - (time.monotonic() - started))
        finally:
            self._lock.release()

    def _route(self, mtype: str, fields: dict[str, Any] | None, timeout: float) -> Message:
        lane = self._lane
        if lane is not None and mtype != "HELLO":
            sock = lane._sock
            ready = sock is not None and bool(sock.poll(0, zmq.POLLOUT))
            if not ready and lane._fresh and time.monotonic() - self._lane_since < _LANE_CONNECT_S:
                pass  # still connecting: this request goes to the main socket
            elif not ready:
                self._drop_lane()  # no connection: the daemon restarted or closed it
                self._rehello = self._hello is not None
            else:
                try:
                    return lane.request(mtype, fields, timeout)
                except (DaemonUnavailable, BadReply, AuthenticationFailed, UnsafeEndpoint):
                    self._drop_lane()
                    self._rehello = self._hello is not None
                    raise
        if mtype == "HELLO":
            self._hello, self._rehello = dict(fields or {}), False
        elif self._rehello and self._ipc is not None:
            self._rehello = False
            started = time.monotonic()
            try:
                self._request("HELLO", self._hello, timeout)
            except KvdError:
                pass  # no lane: this request goes to the main socket all the same
            timeout -= time.monotonic() - started
        return self._request(mtype, fields, timeout)

    def _request(self, mtype: str, fields: dict[str, Any] | None, timeout: float) -> Message:
        """Send a request on the main socket and return its decoded reply.

        Raises UnsafeEndpoint (the run dir or socket may be another user's:
        no connection is made), AuthenticationFailed (the tcp endpoint refused
        our CURVE handshake), DaemonUnavailable (no connection or no reply
        within `timeout`, or ZeroMQ failed in this process: a thread or file
        it cannot have), the KvdError subclass of an ERROR reply, or BadReply.
        """
        if self._pid != os.getpid():
            self._after_fork()
        timeout = max(0.0, timeout)
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout=timeout):
            raise DaemonUnavailable(f"client busy for {timeout:.1f}s (another call in flight)")
        try:
            self._check_safe()
            limits = self._reply_limits
            if self._sock is not None and self._sock_max_frame != _max_frame(limits):
                if _max_frame(limits) > self._sock_max_frame:
                    self._reset()  # its connection would drop the larger replies the daemon may now send
                else:
                    # Tighter: for the connections ZeroMQ makes from now on. Not
                    # remade now: a daemon that is slow to accept would turn
                    # into an outage, and replies are decoded under `limits` anyway.
                    self._sock.setsockopt(zmq.MAXMSGSIZE, _max_frame(limits))
                    self._sock_max_frame = _max_frame(limits)
            if self._sock is None and self._auth_error is not None and time.monotonic() < self._down_until:
                raise self._refusal(self._auth_error)  # refused a moment ago: not retried before retry_interval
            sock = self._socket()
            self._check_peer()  # reads the monitor's events: none may pile up
            now = time.monotonic()
            if not self._fresh and now < self._down_until:
                wait = 0.0
            else:
                wait = min(self.connect_wait if self._fresh else 0.0, max(0.0, deadline - now))
            if not sock.poll(int(wait * 1000), zmq.POLLOUT):
                self._down_until = time.monotonic() + self.retry_interval
                self._fresh = False
                refused = self._handshake_refused()
                if refused is not None:
                    self._reset()  # not left retrying a handshake that is refused
                    raise self._refusal(refused)
                raise DaemonUnavailable(self._absent())
            self._check_peer()  # a connection made while we waited
            self._dropped = False  # (one that dropped before the send took nothing of this request)
            self._fresh = False
            rid = next(self._ids)
            asked_lane = mtype == "HELLO" and self._ipc is not None and self._lane is None
            if asked_lane:
                fields = {**(fields or {}), "lanes": True}
            frames = codec.encode(mtype, fields, id=rid)
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                raise DaemonUnavailable(f"daemon at {self.endpoint} is not accepting messages") from None
            except _LOCAL_FAILURES as err:  # e.g. the collector of a zero-copy frame could not start
                raise self._starved("send to", err) from None
            while True:
                if time.monotonic() >= deadline or not self._await_reply(sock, deadline):
                    self._reset()
                    raise DaemonUnavailable(f"no reply from {self.endpoint} within {timeout:.1f}s")
                raw = self._receive(sock, deadline, limits)
                if raw is None:
                    continue
                try:
                    reply = codec.decode_reply(raw, limits)
                except ProtocolError as err:
                    if codec.peek_id(raw[:1], limits) not in (rid, None):
                        continue  # stale or unsolicited garbage: not this request's answer
                    self._reset()
                    raise BadReply(f"undecodable reply: {err}") from None
                if reply.id != rid:
                    continue  # a late reply to a request that timed out
                break
            if asked_lane and reply.type == "HELLO" and reply.get("lane") is not None:
                # Under the lock: a HELLO of another thread waiting for it asks for no other.
                self._take_lane(reply["lane"], reply.get("limits"))
        except zmq.ZMQError as err:  # anywhere else: making the socket, polling, receiving
            raise self._starved("talk to", err) from None
        finally:
            self._lock.release()
        if reply.type == "ERROR":
            raise from_code(reply["code"], reply["message"])
        if reply.type != mtype:
            raise BadReply(f"asked {mtype}, got a {reply.type} reply")
        return reply


__all__ = ["Transport", "KvdError"]
