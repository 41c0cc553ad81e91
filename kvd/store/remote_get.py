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
given back. A connection an error leaves mid-reply is disconnected, never
returned half read. Replies handled: a bulk string (RESP2 `$n`), a null
(`$-1`, RESP3 `_`), an error (`-...`: redis.ResponseError, like the
library's pipeline raises). Anything else -- a RESP3 push frame between
replies included -- is a protocol error (redis.ConnectionError): the
connection is dropped and the tier's failure rule applies (degraded, retried).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

Alloc = Callable[[int], Any]  # nbytes -> a writable uint8 buffer of exactly nbytes

_MAX_LINE = 1 << 16  # a reply's header line ($<len>, -ERR ...) is short
MAX_VALUE = 512 << 20  # the server's own default proto-max-bulk-len: a longer "$n" is not a value it keeps


def np_alloc(nbytes: int) -> np.ndarray:
    """A fresh buffer without the zero-fill a bytearray would pay for."""
    return np.empty(nbytes, np.uint8)


def get_many(client: Any, keys: Sequence[bytes], alloc: Alloc = np_alloc) -> list[Any]:
    """GET every key of `keys` in one pipeline on a connection of `client`'s
    pool: per key its value (a buffer from `alloc`) or None. Raises what the
    connection raises (redis.RedisError, OSError, timeouts)."""
    import redis

    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_packed_command(conn.pack_commands([("GET", k) for k in keys]), check_health=False)
        sock = conn._sock  # set by connect(); redis-py's own parser holds nothing unread between replies
        if sock is None:
            raise redis.ConnectionError("connection closed while sending")
        replies = _Replies(sock)
        out = [replies.bulk(alloc) for _ in keys]
        if replies.pending():
            raise redis.ConnectionError("bytes after the last reply")
        return out
    except BaseException:
        conn.disconnect()  # mid-reply or out of step: never back into the pool as is
        raise
    finally:
        pool.release(conn)


class _Replies:
    """Reads RESP replies from a socket: header lines through a small buffer,
    bulk bodies with recv_into straight into their destination."""

    def __init__(self, sock: Any):
        self.sock = sock
        self.buf = bytearray()
        self.pos = 0

    def pending(self) -> int:
        return len(self.buf) - self.pos

    def _fill(self) -> None:
        if self.pos:
            del self.buf[: self.pos]
            self.pos = 0
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

    def bulk(self, alloc: Alloc) -> Any:
        import redis

        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            raise redis.ResponseError(rest.decode("utf-8", "replace"))
        if kind == b"_" or (kind == b"$" and rest == b"-1"):
            return None
        if kind != b"$" or not rest.isdigit():
            raise redis.ConnectionError(f"unexpected reply to GET: {line[:40]!r}")
        n = int(rest)
        if n > MAX_VALUE:
            raise redis.ConnectionError(f"a {n}-byte value is over {MAX_VALUE} bytes")
        dest = alloc(n)
        view = memoryview(dest).cast("B")
        have = min(self.pending(), n)
        view[:have] = self.buf[self.pos : self.pos + have]
        self.pos += have
        got = have
        while got < n:
            k = self.sock.recv_into(view[got:])
            if not k:
                raise redis.ConnectionError("server closed the connection mid-value")
            got += k
        while self.pending() < 2:
            self._fill()
        if self.buf[self.pos : self.pos + 2] != b"\r\n":
            raise redis.ConnectionError("bulk reply not terminated by CRLF")
        self.pos += 2
        return dest
