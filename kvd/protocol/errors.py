"""kvd's errors: one tree, and the wire codes of the ones that travel.

Every error kvd raises on purpose is a KvdError. Those under ProtocolError
and ServerError cross the wire, each bound to one stable code (proto/
PROTOCOL.md section 6); the others stay in the process that raised them and
have no code (`code is None`). Local errors are defined beside the code that
raises them, in the module named on their line; tests/test_layering.py checks
this drawing against the classes themselves.

    KvdError
     +-- ProtocolError              a message broke the protocol (codes 1xx)
     |    +-- MalformedMessage      100  not msgpack, header not a map, truncated
     |    +-- UnsupportedVersion    101  "v" is a version this peer does not speak
     |    +-- UnknownMessageType    102  "type" names no message of kvd/1
     |    +-- BadField              103  a field missing, of the wrong type or range
     |    +-- BadDtype              104  a tensor's dtype is not in the dtype table
     |    +-- BadShape              105  rank too high, or bytes != prod(shape) * itemsize
     |    +-- BadFrameIndex         106  a frame index out of range or used twice
     |    +-- MessageTooLarge       107  total bytes over the advertised limit
     |    +-- TooManyFrames         108  frame count over the advertised limit
     |    +-- TooManyTokens         109  token count over the advertised limit
     +-- ServerError                the daemon could not serve a valid request (2xx, 5xx)
     |    +-- Busy                  200  the daemon is shedding load; retry later
     |    +-- Internal              500  a bug in the daemon; the request is lost, not the daemon
     |    +-- NotPersisted          503  write-through: the disk did not take the write; not acknowledged
     +-- DaemonUnavailable          kvd_client: no answer in time (down, slow or restarting)
     +-- BadReply                   kvd_client: the daemon's reply broke kvd/1
     +-- AuthenticationFailed       kvd_client: the tcp endpoint refused our CURVE handshake
     +-- ShmUnavailable             kvd_client: shared memory unusable now (daemon restarted, lease ran out)
     +-- ShmDamaged                 kvd_client: bytes read from shared memory changed after their COMMIT
     +-- UnsupportedCache           kvd_client.mlx_lm: a cache object the adapter cannot snapshot
     +-- SnapshotMismatch           kvd_client.mlx_lm: a hit that does not rebuild into a cache
     +-- CacheFileError             kvd_client.mlx_lm_files: not a prompt-cache file it can read
     +-- NotConvertible             kvd_client.vllm_mlx: a vllm-mlx entry no mlx-lm cache class holds
     +-- ConfigError                kvd.config: a setting's value, or the config file, is bad
     +-- EndpointError              kvd.endpoint: not an endpoint kvd can use
     |    +-- EndpointBusy          kvd.endpoint: another daemon serves it
     |    +-- UnsafeEndpoint        kvd.endpoint: its run dir or socket may be another user's
     +-- DataDirBusy                kvd.store.datadir: another process holds the data dir's lock
     +-- IncompatibleIndex          kvd.store.ssd.index: written by a kvd this one cannot read
     +-- IndexBusy                  kvd.store.ssd.index: the map is being resized (served as a miss)
     +-- RowDamaged                 kvd.store.ssd.index: an index row does not decode (served as a miss)
     +-- IndexDamaged               kvd.store.ssd.heal: the index file is truncated, zeroed or not LMDB
     +-- BlobCorrupt                kvd.store.ssd.blobfile: a blob is not the one the index describes
     +-- BadRemoteValue             kvd.protocol.remote_value: a remote-tier value is not the entry its key names
     |    +-- ForgedRemoteValue    kvd.protocol.remote_value: its tag or MAC is not the tier key's
     +-- Unencodable                kvd.store.ssd.blobfile: an entry cannot be written as safetensors
     +-- Altered                    kvd.store.ssd.blobfile: a slot's bytes changed after COMMIT (not written)
     +-- ServiceError               kvd.service.install: installing or removing the service failed
          +-- UnsupportedPlatform   kvd.service.install: no init system kvd knows
          +-- CommandFailed         kvd.service.install: launchctl/systemctl exited non-zero

A decoder raises the ProtocolError subclass for the first rule a message
breaks; the daemon replies with an ERROR message carrying `code` and `name`,
and the client maps the code straight back to the same class (`from_code`).
Only wire errors are ever put in an ERROR reply: a local error reaching the
daemon's loop is a bug there and is answered INTERNAL. The command line maps
each branch to one exit code (kvd/cli/exits.py). Not an error, and so not
drawn: kvd.server.handler.ShutdownRequested, which unwinds a SHUTDOWN request.
"""

from __future__ import annotations


class KvdError(Exception):
    """Base of every error kvd raises on purpose."""

    code: int | None = None  # the wire code; None for errors that never leave their process
    name: str = "KVD_ERROR"  # the wire name, or a short tag (client counters: error_<name>)

    def __init__(self, message: str = ""):
        super().__init__(message or self.__class__.__doc__ or self.name)

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class ProtocolError(KvdError):
    """A message broke the kvd/1 protocol."""


class MalformedMessage(ProtocolError):
    """The message could not be parsed: not msgpack, not a map, or truncated."""

    code, name = 100, "MALFORMED"


class UnsupportedVersion(ProtocolError):
    """The message's protocol version is not one this peer speaks."""

    code, name = 101, "UNSUPPORTED_VERSION"


class UnknownMessageType(ProtocolError):
    """The message type is not part of kvd/1."""

    code, name = 102, "UNKNOWN_TYPE"


class BadField(ProtocolError):
    """A field is missing, of the wrong type, or out of range."""

    code, name = 103, "BAD_FIELD"


class BadDtype(ProtocolError):
    """A tensor names a dtype that is not in the kvd/1 dtype table."""

    code, name = 104, "BAD_DTYPE"


class BadShape(ProtocolError):
    """A tensor's shape is invalid or disagrees with its byte length."""

    code, name = 105, "BAD_SHAPE"


class BadFrameIndex(ProtocolError):
    """A tensor refers to a frame that does not exist or is already used."""

    code, name = 106, "BAD_FRAME_INDEX"


class MessageTooLarge(ProtocolError):
    """The message is larger than the peer's advertised max_message_bytes."""

    code, name = 107, "TOO_LARGE"


class TooManyFrames(ProtocolError):
    """The message has more frames than the peer's advertised max_frames."""

    code, name = 108, "TOO_MANY_FRAMES"


class TooManyTokens(ProtocolError):
    """The token sequence is longer than the peer's advertised max_tokens."""

    code, name = 109, "TOO_MANY_TOKENS"


class ServerError(KvdError):
    """The daemon could not serve a well-formed request."""


class Busy(ServerError):
    """The daemon is overloaded; the request was not served. Retry later."""

    code, name = 200, "BUSY"


# In the message of a BUSY answered to PUT or SLOTS while a write-back daemon's
# write-behind backlog is full (PROTOCOL.md §PUT): a client need not resend
# that PUT over frames, which would be refused alike.
BACKLOG_FULL = "not on disk yet"


class Internal(ServerError):
    """The daemon failed while serving the request (a bug: see its log)."""

    code, name = 500, "INTERNAL"


class NotPersisted(ServerError):
    """Write-through: the daemon could not make the entries durable (its SSD tier
    is degraded -- disk full, read-only or failing -- or it is stopping). The PUT
    was not acknowledged; the entries may still be served from RAM."""

    code, name = 503, "NOT_PERSISTED"


ERRORS: dict[int, type[KvdError]] = {
    cls.code: cls
    for cls in (
        MalformedMessage, UnsupportedVersion, UnknownMessageType, BadField, BadDtype,
        BadShape, BadFrameIndex, MessageTooLarge, TooManyFrames, TooManyTokens, Busy, Internal,
        NotPersisted,
    )
}


def from_code(code: int, message: str = "") -> KvdError:
    """The exception for a wire error code (an unknown code gives a plain ServerError)."""
    cls = ERRORS.get(code)
    if cls is None:
        err = ServerError(message or f"daemon error code {code}")
        err.code, err.name = code, "UNKNOWN"
        return err
    return cls(message)
