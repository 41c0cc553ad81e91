"""Errors the client raises (only in strict mode; otherwise calls degrade).

    KvdError                      (kvd.protocol.errors)
     +-- ProtocolError ...        the daemon said our message broke kvd/1
     +-- ServerError ...          the daemon could not serve it (BUSY, INTERNAL)
     +-- DaemonUnavailable        no answer in time: down, slow or restarting
     +-- BadReply                 the daemon's reply broke kvd/1

Wire error codes map to the same classes on both sides (`errors.from_code`).
"""

from __future__ import annotations

from kvd.protocol.errors import KvdError


class DaemonUnavailable(KvdError):
    """The daemon did not answer within the timeout (down, slow or restarting)."""

    code, name = 0, "UNAVAILABLE"


class BadReply(KvdError):
    """The daemon's reply could not be decoded or did not match the request."""

    code, name = 0, "BAD_REPLY"
