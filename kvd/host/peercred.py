"""Who is at the other end of a unix-socket connection: its process id.

What each OS gives:

    Linux   getsockopt SO_PEERCRED: struct ucred {pid, uid, gid}; pid 0 for
            a peer outside our pid namespace.
    macOS   getsockopt SOL_LOCAL (0), LOCAL_PEERPID (2): the pid, a pid_t.
    other   nothing: 0 (unknown).

The peer's uid, which the endpoint checks, is read in kvd/endpoint.py.

macOS: the socket option, quoted verbatim (tabs expanded) from Apple's xnu:
apple-oss-distributions/xnu, tag xnu-11417.101.15, commit
e3723e1f17661b24996789d8afc084c0c3303b26 (tests/host/test_darwin_declarations.py
checks SOL_LOCAL, LOCAL_PEERPID and PID_SIZE against it).
    bsd/sys/un.h, lines 84-89:
        /* Level number of get/setsockopt for local domain sockets */
        #define SOL_LOCAL               0

        /* Socket options. */
        #define LOCAL_PEERCRED          0x001           /* retrieve peer credentials */
        #define LOCAL_PEERPID           0x002           /* retrieve peer pid */
    bsd/kern/uipc_usrreq.c (uipc_ctloutput), lines 831 and 873:
                pid_t peerpid;
                                error = sooptcopyout(sopt, &peerpid, sizeof(peerpid));
END_XNU_QUOTE
"""

from __future__ import annotations

import socket
import struct
import sys

SOL_LOCAL = 0
LOCAL_PEERPID = 2
PID_SIZE = struct.calcsize("i")  # pid_t: a 32-bit int on Darwin


def peer_pid(s: socket.socket) -> int:
    """The pid of a unix socket's peer, 0 if unknown. Raises OSError or
    struct.error if the socket cannot tell."""
    if sys.platform == "linux":  # struct ucred {pid, uid, gid}
        return struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    if sys.platform == "darwin":
        return struct.unpack("i", s.getsockopt(SOL_LOCAL, LOCAL_PEERPID, PID_SIZE))[0]
    return 0
