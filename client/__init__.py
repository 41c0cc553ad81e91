"""kvd_client: talk to a kvd daemon from a model server.

    from kvd_client import Client
    with Client(namespace="my-model") as kv:
        kv.put(tokens, snapshot)        # numpy level
        hit = kv.get(tokens)

The mlx-lm level (`store`, `fetch`, `lookup`, `kvd_client.mlx_lm`) turns live
mlx-lm prompt caches into snapshots and back on the caller's thread.
"""

from kvd.protocol.errors import KvdError, ProtocolError, ServerError
from kvd_client._client import Client, Probe
from kvd_client._errors import BadReply, DaemonUnavailable
from kvd_client._media import MediaSpan, digest as media_digest
from kvd_client._tensors import Hit, HostTensor, Snapshot

__all__ = [
    "Client",
    "Probe",
    "Snapshot",
    "Hit",
    "HostTensor",
    "MediaSpan",
    "media_digest",
    "KvdError",
    "ProtocolError",
    "ServerError",
    "DaemonUnavailable",
    "BadReply",
]
