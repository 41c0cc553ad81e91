"""The sockets under a peer connection, seen from the gate: the empty stand-in
a pause points libzmq's listener at, what a connection is (its local
address, its id, the process at its other end) and cutting one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import termios

from kvd.host.peercred import peer_pid


def stand_in(kind: int, sockname) -> socket.socket:
    """The empty listening socket a pause points libzmq's listener fd at.

    Whatever connects to it while the listener is paused, libzmq accepts as
    a peer: so nobody must be able to. An ipc endpoint's stand-in is bound
    in the endpoint's own directory (0700, kvd.endpoint rule 3) and its name
    unlinked at once -- a socket without a name cannot be connected to (an
    abstract name, as before, could be by any local user, bypassing the
    directory's mode) -- and anything that connected in between is turned
    away. tcp's is on loopback: reaching it is no more than reaching the
    endpoint, and CURVE is the socket's, not the listener's."""
    s = socket.socket(kind, socket.SOCK_STREAM)
    try:
        if kind == socket.AF_UNIX and isinstance(sockname, str) and sockname.startswith("/"):
            path = os.path.join(os.path.dirname(sockname), f".kvd-pause-{os.getpid()}")  # another daemon's dir too
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a dead daemon's of the same pid
            s.bind(path)
            s.listen(1)
            os.unlink(path)
        elif kind == socket.AF_UNIX:
            s.bind("")  # an abstract endpoint is anyone's already: an autobound name is no more
            s.listen(1)
        else:
            s.bind(("::1", 0) if kind == socket.AF_INET6 else ("127.0.0.1", 0))
            s.listen(1)
        s.setblocking(False)
        while True:  # connected before the name was gone
            try:
                s.accept()[0].close()
            except BlockingIOError:
                return s
    except BaseException:
        s.close()
        raise


def sockname(fd: int):
    s = socket.socket(fileno=fd)
    try:
        return s.getsockname()
    finally:
        s.detach()


def origin(fd: int) -> bytes | None:
    """The process at the other end of unix-socket connection `fd`, whose
    cost a new connection of it starts from (kvd.server.admission.turns). None if it
    cannot be told: the fd is gone or not a unix socket (over TCP a host may
    be many clients), or the peer is outside our pid namespace (pid 0)."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        pid = peer_pid(s) if s.family == socket.AF_UNIX else 0
    except (OSError, struct.error):
        pid = 0
    finally:
        s.detach()
    return b"pid %d" % pid if pid > 0 else None


def unread(fd: int) -> int:
    """Bytes the peer on connection `fd` has sent that nobody has read yet
    (FIONREAD, Linux and macOS alike); 0 if it cannot be told."""
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return 0


def connection_id(fd: int) -> int | None:
    """What tells the connection on `fd` from a later one on the same number:
    its socket's inode (Linux: from a counter, never reused while the
    system runs; macOS: unique among open sockets). None if `fd` is closed."""
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


def shut_down(fd: int) -> None:
    s = socket.socket(fileno=fd)
    try:
        s.shutdown(socket.SHUT_RDWR)
    finally:
        s.detach()  # libzmq owns the fd and closes it
