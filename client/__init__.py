"""kvd_client: talk to a kvd daemon from a model server.

    from kvd_client import Client
    with Client(namespace="my-model") as kv:
        kv.put(tokens, snapshot)        # numpy level
        hit = kv.get(tokens)

The mlx-lm level (`store`, `fetch`, `lookup`, `kvd_client.mlx_lm`) turns live
mlx-lm prompt caches into snapshots and back on the caller's thread; it is
imported the first time one of those is called, never by this package.

In strict mode (`Client(..., strict=True)`) calls raise the errors exported
here, all under `KvdError` (the tree is drawn in kvd/protocol/errors.py).
"""

from kvd.endpoint import EndpointError, UnsafeEndpoint
from kvd.protocol.errors import (
    BadDtype,
    BadField,
    BadFrameIndex,
    BadShape,
    Busy,
    Internal,
    NotPersisted,
    KvdError,
    MalformedMessage,
    MessageTooLarge,
    ProtocolError,
    ServerError,
    TooManyFrames,
    TooManyTokens,
    UnknownMessageType,
    UnsupportedVersion,
)
from kvd_client._client import Client
from kvd_client._core import Probe
from kvd_client._errors import AuthenticationFailed, BadReply, DaemonUnavailable, ShmDamaged
from kvd_client._explain import Explanation
from kvd_client._media import MediaSpan, digest as media_digest
from kvd_client._tensors import Hit, HostTensor, Snapshot

__all__ = [
    "Client",
    "Probe",
    "Explanation",
    "Snapshot",
    "Hit",
    "HostTensor",
    "MediaSpan",
    "media_digest",
    "KvdError",
    "ProtocolError",
    "MalformedMessage",
    "UnsupportedVersion",
    "UnknownMessageType",
    "BadField",
    "BadDtype",
    "BadShape",
    "BadFrameIndex",
    "MessageTooLarge",
    "TooManyFrames",
    "TooManyTokens",
    "ServerError",
    "Busy",
    "Internal",
    "NotPersisted",
    "DaemonUnavailable",
    "BadReply",
    "ShmDamaged",
    "EndpointError",
    "UnsafeEndpoint",
    "AuthenticationFailed",
]
