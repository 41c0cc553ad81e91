"""The kvd mlx snapshot format: how mlx-lm cache layers are named on the wire.

kvd never uses mlx-lm's `state` / `save_prompt_cache` layout (it changed
between 0.31 and 0.32 and may change again). Every layer is described by a
small *layer spec* (a msgpack-able dict) and its tensors get explicit names:

    kind      class                   tensors (path p = "3", or "3.1" inside a CacheList)
    --------  ----------------------  ----------------------------------------------------
    kv        KVCache,                p.k  p.v                          sliced, axis 2
              ConcatenateKVCache
    qkv       QuantizedKVCache        p.k.q p.k.s p.k.b p.v.q p.v.s p.v.b  sliced, axis 2
                                      (packed uint32, scales, biases)
    rot       RotatingKVCache         p.k  p.v   (valid rows, ring order)  boundary
    chunked   ChunkedKVCache          p.k  p.v   (rows from start_position) boundary
    arrays    ArraysCache             p.a<i> for every non-None entry,   boundary
                                      p.lp / p.len if set
    list      CacheList               its sub-layers at p.0, p.1, ...

*Sliced* kinds hold one row per token along axis 2 of (B, H, T, D): any
prefix of them is itself a valid cache, so kvd can serve any stored prefix.
*Boundary* kinds are a state after exactly `offset` tokens (a recurrent
state, a rotated window): they are only valid at the end of the sequence
they were taken from, so a model with any boundary layer can only reuse a
prefix that ends where such a state was stored.

Snapshot meta (travels with every chunk): {"fmt": FORMAT, "layers": [spec, ...],
"bnd": bool}. Per-layer scalars valid only at the end of the sequence
(offset, the ring pointer, None entries) go in boundary_meta, keyed by path.
Specs hold only what is the same at every prefix (group size, bits, window).

The registry at the bottom remembers, per namespace, the layout a process
knows a model to have (from `namespace_for`, a store, or a hit's meta), so
that `fetch`/`lookup` know whether they need boundary state. It is process
local and only ever written with layouts that came from real caches or from
the model's own `make_prompt_cache`.
"""

from __future__ import annotations

import threading
from typing import Any

from kvd.protocol.errors import KvdError

FORMAT = 1

BOUNDARY_KINDS = frozenset({"rot", "chunked", "arrays"})
TOKEN_AXIS = 2  # (B, H, T, D) for every sliced tensor


class UnsupportedCache(KvdError):
    """This cache object cannot be snapshotted by the kvd mlx adapter."""


class SnapshotMismatch(KvdError):
    """A hit does not describe a cache the adapter can rebuild (wrong format or shapes)."""


def spec_of(cache: Any) -> dict[str, Any]:
    """The layer spec of one mlx-lm cache object, from its class and config only.

    Touches no arrays, so it works on a fresh `make_prompt_cache` result.
    Raises UnsupportedCache for classes kvd does not know (batch caches,
    model-specific caches).
    """
    from mlx_lm.models import cache as C

    # Exact type checks: a subclass may add state kvd would silently drop.
    t = type(cache)
    if t is C.KVCache:
        return {"k": "kv"}
    if t is getattr(C, "ConcatenateKVCache", None):
        return {"k": "kv", "c": "concat"}
    if t is C.QuantizedKVCache:
        return {"k": "qkv", "gs": int(cache.group_size), "bits": int(cache.bits)}
    if t is C.RotatingKVCache:
        return {"k": "rot", "max": int(cache.max_size), "keep": int(cache.keep)}
    if t is getattr(C, "ChunkedKVCache", None):
        return {"k": "chunked", "cs": int(cache.chunk_size)}
    if t is C.ArraysCache:
        return {"k": "arrays", "n": len(cache.cache)}
    if t is getattr(C, "CacheList", None):
        return {"k": "list", "sub": [spec_of(c) for c in cache.caches]}
    raise UnsupportedCache(f"kvd cannot snapshot {t.__module__}.{t.__qualname__}")


def needs_boundary(layers: list[dict[str, Any]]) -> bool:
    """True if any layer (nested ones included) is boundary state."""
    for spec in layers:
        if spec["k"] == "list":
            if needs_boundary(spec["sub"]):
                return True
        elif spec["k"] in BOUNDARY_KINDS:
            return True
    return False


def make_meta(layers: list[dict[str, Any]]) -> dict[str, Any]:
    return {"fmt": FORMAT, "layers": layers, "bnd": needs_boundary(layers)}


# -- per-namespace layout registry ------------------------------------------

_lock = threading.Lock()
_layouts: dict[str, list[dict[str, Any]]] = {}
_from_model: set[str] = set()  # layouts `namespace_for` read off the model itself


def remember(namespace: str, layers: list[dict[str, Any]], *, from_model: bool = False) -> None:
    """Record the cache layout a namespace's model has (last writer wins),
    except that a layout read off the model (`from_model`, by namespace_for)
    is never replaced by one learned from served data: a peer may write
    anything under a namespace, the model cannot lie about itself."""
    with _lock:
        if namespace in _from_model and not from_model:
            return
        _layouts[namespace] = layers
        if from_model:
            _from_model.add(namespace)


def model_layout(namespace: str) -> list[dict[str, Any]] | None:
    """The layout `namespace_for` read off the model for `namespace`, or None."""
    with _lock:
        return _layouts.get(namespace) if namespace in _from_model else None


def layout_for(namespace: str) -> list[dict[str, Any]] | None:
    """The layout recorded for `namespace`, or None if this process never saw it."""
    with _lock:
        return _layouts.get(namespace)
