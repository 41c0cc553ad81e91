"""The client's own errors (raised only in strict mode; otherwise calls degrade).

They hang off the one tree drawn in kvd/protocol/errors.py, beside the wire
errors the daemon can answer with (ProtocolError, ServerError and their
subclasses, mapped from their codes by `errors.from_code`). These two never
cross the wire, so they have no code.
"""

from __future__ import annotations

from kvd.protocol.errors import KvdError


class DaemonUnavailable(KvdError):
    """The daemon did not answer within the timeout (down, slow or restarting)."""

    name = "UNAVAILABLE"


class BadReply(KvdError):
    """The daemon's reply could not be decoded or did not match the request."""

    name = "BAD_REPLY"


class ShmDamaged(KvdError):
    """Bytes read from shared memory are not those their writer committed (a
    process wrote into the slot afterwards): the read is a miss."""

    name = "SHM_DAMAGED"


class AuthenticationFailed(KvdError):
    """The daemon's tcp endpoint refused this client's CURVE handshake (no key, a
    key it does not admit, or the wrong server key)."""

    name = "AUTH_FAILED"
