"""Pipelined GETs whose values land in buffers of our choosing, one copy.

Why not the client library's reply parser: redis-py with hiredis receives a
bulk reply 64 KiB at a time, copies each piece into hiredis's own buffer and,
once the value is whole, copies it again into a new `bytes`. For the remote
tier's values (tens of MiB each) those two copies, made under the GIL on the
thread that reads ahead, cost more than the transfer itself and starve the
loop thread that serves the page. Here each value's bytes go from the socket
straight into a buffer from `alloc` (`recv_into`), which the caller keeps:
the tensors of the entry are views into it.

Only the replies are read here; the connection (TLS, AUTH/ACL, SELECT,
timeouts) is redis-py's, borrowed from the client's pool for one pipeline and
given back. A connection left mid-reply is disconnected, never returned half
read. Replies handled, per key:

    $n <bytes>   a value: read into a buffer from `alloc` -- unless `n` is not
                 the length the caller expects (or over its bound): then
                 Refused before anything is allocated for it. A short one is
                 read past; a long one is left unread, its connection
                 dropped, and the keys after it asked again on a fresh
                 connection (less the refused key's group: the other parts of
                 a refused entry are not worth reading)
    $-1, _       absent: None
    -ERR ...     an error about that key (WRONGTYPE: another program's key of
                 another type): Refused; the connection stays in step. Only
                 the errors that say the whole server cannot answer
                 (SERVER_ERRORS: loading, busy scripting, ...) raise
                 redis.ResponseError, like the library's pipeline
    anything else (a RESP3 push frame between replies included): a protocol
                 error (redis.ConnectionError), the connection dropped

A key whose exact length the caller knows (a part: its header says) is asked
with GETRANGE 0 <length-1>, not GET: whatever the key holds, the server sends
(and copies into its own reply buffers) at most that many bytes. A missing
key then reads as empty, which no part is: None. Bytes a part has past its
length are never seen; the value's checksum judges the bytes that are.

A presence check (`first`: a LOOKUP asks whether a value is there, from its
first few bytes) is GETRANGE 0 <first-1> too, but of a value of any length:
a reply of at most `first` bytes is read (a missing key's is empty), a longer
one -- which no server sends for that range, only one broken or posing as a
server -- is Refused like any value over its bound: nothing is allocated for
it, and past 64 KiB it is left unread with its connection.

A `Deadline` bounds the whole pipeline, not each recv: a link that trickles
bytes in just often enough never trips a socket timeout, so the time left is
checked before every recv (and the socket's timeout lowered to it). Another
thread may abandon the read through the deadline's stop flag.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Hashable, Iterator, NamedTuple, Sequence

import numpy as np

Alloc = Callable[[int], Any]  # nbytes -> a writable uint8 buffer of exactly nbytes

_MAX_LINE = 1 << 16  # a reply's header line ($<len>, -ERR ...) is short
_SKIP_MAX = 1 << 16  # a refused value this short is read past; a longer one costs its connection
MAX_VALUE = 512 << 20  # the server's own default proto-max-bulk-len: a longer "$n" is not a value it keeps
# Error replies that are about the server, not the key: it answers no key now.
SERVER_ERRORS = ("LOADING", "BUSY", "MASTERDOWN", "NOAUTH")


class Refused(NamedTuple):
    """A reply that is not a value the caller takes (a miss to count, never served)."""

    reason: str
    unread: bool = False  # its bytes are still in the socket: the connection cannot go on


class Deadline:
    """The time a pipeline may take in all, and a flag to abandon it sooner."""

    def __init__(self, seconds: float, stop: threading.Event | None = None):
        self.seconds = seconds
        self.at = time.monotonic() + seconds
        self.stop = stop

    def left(self) -> float:
        """Seconds left; raises redis.TimeoutError when none are (or the read was abandoned)."""
        import redis

        if self.stop is not None and self.stop.is_set():
            raise redis.TimeoutError("read abandoned")
        left = self.at - time.monotonic()
        if left <= 0:
            raise redis.TimeoutError(f"the replies took more than {self.seconds:g}s in all")
        return left


def np_alloc(nbytes: int) -> np.ndarray:
    """A fresh buffer without the zero-fill a bytearray would pay for."""
    return np.empty(nbytes, np.uint8)


def get_many(
    client: Any, keys: Sequence[bytes], alloc: Alloc = np_alloc, *, sizes: Sequence[int] | None = None,
    most: int = MAX_VALUE, deadline: Deadline | None = None, groups: Sequence[Hashable] | None = None,
    first: int | None = None,
) -> list[Any]:
    """GET every key of `keys` pipelined on connections of `client`'s pool:
    per key its value (a buffer from `alloc`), None (absent) or a Refused.
    `sizes[i]` (>= 1): the exact length key i's value must have, asked for
    with GETRANGE (else GET, at most `most` bytes); `groups[i]`: keys of one
    group are refused together. `first` (>= 1, no `sizes`): only the first
    `first` bytes of each value are asked for (GETRANGE), a reply of at most
    that many read (empty for a missing key), a longer one Refused.
    Raises what the connection raises (redis.RedisError, OSError), and
    redis.TimeoutError past `deadline`."""
    if sizes is not None and min(sizes, default=1) < 1:
        raise ValueError("sizes must be >= 1 (GETRANGE 0 -1 is the whole value)")
    if first is not None:
        if first < 1 or sizes is not None:
            raise ValueError("first must be >= 1, and not with sizes")
        # A longer reply is more than was asked: refused like a value over its bound.
        sizes, most = [first] * len(keys), min(most, first)
    out: list[Any] = [None] * len(keys)
    todo = list(range(len(keys)))
    while todo:
        stopped = _pipeline(client, keys, todo, out, alloc, sizes, most, deadline, exact=first is None)
        if stopped is None:
            break
        bad, todo = todo[stopped], todo[stopped + 1 :]
        if groups is not None:
            for i in [i for i in todo if groups[i] == groups[bad]]:
                out[i] = Refused("another part of the value was refused")
            todo = [i for i in todo if groups[i] != groups[bad]]
    return out


def small_values(client: Any, command: Sequence[Any], most: int, longest: int, deadline: Deadline | None = None,
                 nested: bool = False) -> list[Any]:
    """One command whose reply is an array of short bulk strings (HMGET; with
    `nested`, HSCAN's [cursor, [field, value, ...]]): per element, of the
    first `most`, its bytes, None (absent), or a Refused for one over
    `longest` bytes -- read past if short, else left unread with the
    connection, the elements after it then None. Elements past `most` are
    left unread with the connection. Nothing is allocated for a refused
    element, so a value another program planted (512 MiB is the server's
    bound) costs a connection, not the daemon's memory. Raises as `get_many`;
    a reply of another shape is redis.ConnectionError (ResponseError for an
    error reply)."""
    import redis

    with _exchange(client, [tuple(command)], deadline) as replies:
        n = replies.array_length()
        if nested:
            if n != 2:
                raise redis.ConnectionError(f"a reply of {n} elements where [cursor, page] was expected")
            replies.value(bytearray, most=64)  # the cursor: one page is all that is asked
            n = replies.array_length()
        # More elements than asked for (HSCAN's COUNT is a hint; a small
        # hash comes whole): the first `most` are read, the rest left unread.
        out: list[Any] = [None] * min(n, most)
        for i in range(len(out)):
            out[i] = reply = replies.value(bytearray, most=longest)
            if isinstance(reply, Refused) and reply.unread:
                return out
        if n <= most:
            replies.done()
        return out


def _pipeline(client: Any, keys: Sequence[bytes], todo: list[int], out: list[Any], alloc: Alloc,
              sizes: Sequence[int] | None, most: int, deadline: Deadline | None, exact: bool = True) -> int | None:
    """One pipeline of GETs for the keys `todo` names, replies into `out`.
    Returns None when every reply was read, or the position in `todo` of a
    value refused unread (its connection is then dropped). Not `exact`: the
    GETRANGEs of `sizes` ask for at most that many bytes (`most` bounds them)."""
    commands = [("GET", keys[i]) if sizes is None else ("GETRANGE", keys[i], 0, sizes[i] - 1) for i in todo]
    with _exchange(client, commands, deadline) as replies:
        for pos, i in enumerate(todo):
            out[i] = reply = replies.value(alloc, None if sizes is None or not exact else sizes[i], most)
            if isinstance(reply, Refused) and reply.unread:
                return pos
        replies.done()
        return None


@contextmanager
def _exchange(client: Any, commands: list[tuple], deadline: Deadline | None) -> Iterator["_Replies"]:
    """`commands` sent on a connection borrowed from `client`'s pool, and the
    replies to read. It goes back to the pool as it is only if the block said
    every reply was read (`_Replies.done`); mid-reply or out of step, it is
    disconnected first, never returned half read."""
    import redis

    pool = client.connection_pool
    conn = pool.get_connection()
    replies = None
    try:
        conn.send_packed_command(conn.pack_commands(commands), check_health=False)
        sock = conn._sock  # set by connect(); redis-py's own parser holds nothing unread between replies
        if sock is None:
            raise redis.ConnectionError("connection closed while sending")
        replies = _Replies(sock, deadline)
        try:
            yield replies
        finally:
            replies.restore()
    finally:
        if replies is None or not replies.in_step:
            conn.disconnect()
        pool.release(conn)


class _Replies:
    """Reads RESP replies from a socket: header lines through a small buffer,
    bulk bodies with recv_into straight into their destination."""

    def __init__(self, sock: Any, deadline: Deadline | None = None):
        self.sock = sock
        self.deadline = deadline
        self.timeout = sock.gettimeout()  # the connection's own: restored for the pool
        self.lowered = False
        self.in_step = False  # every reply read, nothing more in the socket (`done`)
        self.buf = bytearray()
        self.pos = 0

    def pending(self) -> int:
        return len(self.buf) - self.pos

    def done(self) -> None:
        """Every reply asked for is read: the connection is in step, unless
        bytes came after the last one (a protocol error)."""
        import redis

        if self.pending():
            raise redis.ConnectionError("bytes after the last reply")
        self.in_step = True

    def _arm(self) -> None:
        """Before every recv: fail past the deadline, and let no recv outlast it."""
        if self.deadline is None:
            return
        left = self.deadline.left()
        if self.timeout is None or left < self.timeout:
            self.sock.settimeout(left)
            self.lowered = True

    def restore(self) -> None:
        if self.lowered:
            try:
                self.sock.settimeout(self.timeout)
            except OSError:  # closed meanwhile
                pass

    def _fill(self) -> None:
        if self.pos:
            del self.buf[: self.pos]
            self.pos = 0
        self._arm()
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            import redis

            raise redis.ConnectionError("server closed the connection mid-reply")
        self.buf += chunk

    def _line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n", self.pos)
            if end >= 0:
                line = bytes(self.buf[self.pos : end])
                self.pos = end + 2
                return line
            if self.pending() > _MAX_LINE:
                import redis

                raise redis.ConnectionError("reply header line too long")
            self._fill()

    def value(self, alloc: Alloc, size: int | None = None, most: int = MAX_VALUE) -> Any:
        """The next reply: a buffer from `alloc`, None, or Refused (see the module docstring)."""
        import redis

        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            message = rest.decode("utf-8", "replace")
            if message.split(" ", 1)[0] in SERVER_ERRORS:
                raise redis.ResponseError(message)
            return Refused(f"error reply: {message}")
        if kind == b"_" or (kind == b"$" and rest == b"-1"):
            return None
        if kind != b"$" or not rest.isdigit() or len(rest) > 19:  # (more digits than any length: int() of 5,000 raises)
            raise redis.ConnectionError(f"unexpected reply to GET: {line[:40]!r}")
        n = int(rest)
        if size is not None and n == 0:
            self._skip(0)
            return None  # GETRANGE of a missing key
        if size is not None and n != size:
            return self._refuse(f"a {n}-byte value where {size} bytes are expected", n)
        if n > most:
            return self._refuse(f"a {n}-byte value is over {most} bytes", n)
        dest = alloc(n)
        view = memoryview(dest).cast("B")
        have = min(self.pending(), n)
        view[:have] = self.buf[self.pos : self.pos + have]
        self.pos += have
        got = have
        while got < n:
            self._arm()
            k = self.sock.recv_into(view[got:])
            if not k:
                raise redis.ConnectionError("server closed the connection mid-value")
            got += k
        self._skip(0)
        return dest

    def array_length(self) -> int:
        """The next reply's element count: an array (`*`; a RESP3 map's `%`
        counted in keys and values); an error reply raises ResponseError,
        anything else ConnectionError."""
        import redis

        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            raise redis.ResponseError(rest.decode("utf-8", "replace"))
        if kind not in (b"*", b"%") or not rest.isdigit() or len(rest) > 19:
            raise redis.ConnectionError(f"unexpected reply: {line[:40]!r}")
        return int(rest) * (2 if kind == b"%" else 1)

    def _refuse(self, reason: str, n: int) -> Refused:
        """Refuse an n-byte value without allocating for it: read past a short one, leave a long one unread."""
        if n > _SKIP_MAX:
            return Refused(reason, unread=True)
        self._skip(n)
        return Refused(reason)

    def _skip(self, n: int) -> None:
        """Read past `n` bytes of a bulk reply and its CRLF."""
        import redis

        while self.pending() < n + 2:
            self._fill()
        if self.buf[self.pos + n : self.pos + n + 2] != b"\r\n":
            raise redis.ConnectionError("bulk reply not terminated by CRLF")
        self.pos += n + 2
