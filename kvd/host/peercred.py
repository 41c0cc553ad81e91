"""Who is at the other end of a unix-socket connection: its process id.

What each OS gives:

    Linux   getsockopt SO_PEERCRED: struct ucred {pid, uid, gid}; pid 0 for
            a peer outside our pid namespace.
    macOS   getsockopt SOL_LOCAL (0), LOCAL_PEERPID (2): the pid.
    other   nothing: 0 (unknown).

The peer's uid, which the endpoint checks, is read in kvd/endpoint.py.
"""

from __future__ import annotations

import socket
import struct
import sys


def peer_pid(s: socket.socket) -> int:
    """The pid of a unix socket's peer, 0 if unknown. Raises OSError or
    struct.error if the socket cannot tell."""
    if sys.platform == "linux":  # struct ucred {pid, uid, gid}
        return struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    if sys.platform == "darwin":  # SOL_LOCAL, LOCAL_PEERPID
        return struct.unpack("i", s.getsockopt(0, 2, 4))[0]
    return 0
