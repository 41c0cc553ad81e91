"""kvd for mlx-lm: snapshot prompt caches to kvd and rebuild them on a hit.

    from kvd_client import Client
    from kvd_client.mlx_lm import namespace_for

    kv = Client(namespace=namespace_for(model))
    cache, n = kv.fetch(tokens)          # on the generation thread
    if cache is None:
        cache = make_prompt_cache(model)
    ... feed tokens[n:] through the model with `cache` ...
    kv.store(tokens, cache)              # snapshot now, upload in the background

`Client.store` / `fetch` / `lookup` delegate to an `MlxAdapter` (the logic is
`MlxMethods`) that the client creates on first use; this package also
exposes the pieces for callers that move snapshots themselves.
Every mlx-lm 0.31/0.32 cache class is supported: KVCache, QuantizedKVCache,
ConcatenateKVCache (sliced by token), RotatingKVCache, ChunkedKVCache,
ArraysCache (boundary state), and CacheList of those.
"""

from kvd_client.mlx_lm._format import FORMAT, SnapshotMismatch, UnsupportedCache
from kvd_client.mlx_lm._methods import MlxAdapter, MlxMethods
from kvd_client.mlx_lm._namespace import namespace_for, weights_digest
from kvd_client.mlx_lm._rebuild import rebuild
from kvd_client.mlx_lm._snapshot import take as snapshot

__all__ = [
    "FORMAT",
    "MlxAdapter",
    "MlxMethods",
    "SnapshotMismatch",
    "UnsupportedCache",
    "namespace_for",
    "rebuild",
    "snapshot",
    "weights_digest",
]
