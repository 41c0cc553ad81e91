"""vllm-mlx prefix-cache entries <-> mlx-lm cache objects, without touching a value.

Theory of operation
-------------------
vllm-mlx's `MemoryAwarePrefixCache` stores, per entry, a list with one
object per layer. With `--kv-cache-quantization`, every *plain* `KVCache`
layer of an entry long enough (`kv_min_quantize_tokens`) is replaced by
vllm-mlx's private `_QuantizedCacheWrapper`: the `mx.quantize` triples
`(packed, scales, biases)` of keys and values, the offset, bits, group size
and the class to dequantize back to. Every other layer is an mlx-lm cache
object already (RotatingKVCache stays rotating: vllm-mlx never quantizes it).

kvd snapshots mlx-lm cache classes (`kvd_client.mlx_lm`). The wrapper holds
exactly what mlx-lm's `QuantizedKVCache` holds, so `to_mlx_lm` re-labels it
as one -- the same three arrays, no dequantize, no copy -- and `to_vllm`
turns a rebuilt `QuantizedKVCache` back into a wrapper whose dequantize gives
the same bits vllm-mlx's own RAM hit would. Wrappers of anything but a plain
KVCache (vllm-mlx makes none today) are refused: kvd would not know how to
restore their class.

All of this only relabels objects; it runs on the engine's thread anyway
because the snapshot/rebuild around it do.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvd.protocol.errors import KvdError


class NotConvertible(KvdError):
    """An entry layer kvd cannot hold as an mlx-lm cache object."""


def _is_wrapper(layer: Any, wrapper_cls: type | None) -> bool:
    return wrapper_cls is not None and isinstance(layer, wrapper_cls)


def to_mlx_lm(cache: Sequence[Any], wrapper_cls: type | None) -> tuple[list[Any], bool]:
    """(mlx-lm cache objects sharing the entry's arrays, whether any layer was quantized)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    out: list[Any] = []
    quantized = False
    for layer in cache:
        if _is_wrapper(layer, wrapper_cls):
            if layer.orig_type is not KVCache or "max_size" in layer.orig_attrs:
                raise NotConvertible(f"quantized {layer.orig_type.__name__} layers have no mlx-lm class")
            q = QuantizedKVCache(group_size=int(layer.group_size), bits=int(layer.bits))
            q.keys, q.values, q.offset = tuple(layer.keys), tuple(layer.values), int(layer.offset)
            out.append(q)
            quantized = True
        else:
            out.append(layer)
    return out, quantized


def to_vllm(cache: Sequence[Any], wrapper_cls: type | None) -> list[Any]:
    """The entry layers vllm-mlx stores for `cache` (QuantizedKVCache -> wrapper)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    out: list[Any] = []
    for layer in cache:
        if type(layer) is QuantizedKVCache:
            if wrapper_cls is None:
                raise NotConvertible("vllm-mlx has no quantized-entry class to restore into")
            w = wrapper_cls.__new__(wrapper_cls)
            w.keys, w.values = tuple(layer.keys), tuple(layer.values)
            w.offset, w.bits, w.group_size = int(layer.offset), int(layer.bits), int(layer.group_size)
            w.orig_type = KVCache
            # What the wrapper's constructor records for a plain KVCache.
            probe = KVCache()
            w.orig_attrs = {a: getattr(probe, a) for a in ("max_size", "keep", "step", "_idx") if hasattr(probe, a)}
            out.append(w)
        else:
            out.append(layer)
    return out
