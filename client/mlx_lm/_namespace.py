"""`namespace_for(model)`: one namespace id per model *and* KV cache layout.

Two processes may share cached KV only if it would be bit-for-bit what each
would compute itself. The id is a SHA-256 over everything that decides that:

* the kvd mlx snapshot format version (`_format.FORMAT`);
* the model class (module and name) and its config (`model.args`);
* the weights: an XXH3-128 digest of every parameter's name, dtype, shape
  and bytes,
  or the caller's `weights_id` (cheaper for big models, e.g. the checkpoint's
  revision or file digests -- the caller then vouches for it);
* the parameter dtypes (the KV dtype follows them), also when `weights_id`
  is given;
* the cache layout per layer from the model's own `make_prompt_cache`
  (class, window, chunk size), with KV quantization (bits, group size, and
  the position it starts at) applied the way mlx-lm's generate does.

Only hashlib and xxhash are used, never `hash()` (salted per process).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any

from kvd_client._explain import remember as remember_components
from kvd_client.mlx_lm import _format as F


def namespace_for(
    model: Any,
    *,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    max_kv_size: int | None = None,
    weights_id: str | None = None,
) -> str:
    """The kvd namespace id for `model` with the given KV cache options.

    `kv_bits`, `kv_group_size`, `quantized_kv_start` and `max_kv_size` mean
    what they mean to `mlx_lm.generate`. Returns a string like
    "mlx.llama.<32 hex digits>". Also records the model's cache layout for
    this id, so `fetch`/`lookup` know whether the model needs boundary state.

    Call it on the thread that owns the model (it evaluates and reads the
    weights unless `weights_id` is given). Raises UnsupportedCache if the
    model's cache has a class kvd cannot snapshot.
    """
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache

    layers = [F.spec_of(c) for c in make_prompt_cache(model, max_kv_size=max_kv_size)]
    if kv_bits is not None:
        # With quantized_kv_start > 0, mlx-lm keeps plain KVCache below the
        # threshold: such snapshots do not match this layout and are refused
        # by `store` (see _methods), so one namespace never mixes the two.
        layers = [_quantized(s, kv_group_size, kv_bits) for s in layers]
    params = tree_flatten(model.parameters())
    ident = {
        "fmt": F.FORMAT,
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": _config(model),
        "param_dtypes": sorted({str(v.dtype) for _, v in params}),
        "weights": weights_id if weights_id is not None else weights_digest(params),
        "weights_from": "caller" if weights_id is not None else "digest",
        "layers": layers,
        "kv": {"bits": kv_bits, "group_size": kv_group_size if kv_bits else None, "start": quantized_kv_start if kv_bits else None},
        "max_kv_size": max_kv_size,
    }
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    model_type = re.sub(r"[^a-z0-9_]+", "_", str(ident["config"].get("model_type", type(model).__name__)).lower())[:40]
    namespace = f"mlx.{model_type}.{digest[:32]}"
    F.remember(namespace, layers, from_model=True)
    remember_components(namespace, ident)  # sent with PUTs: lets `kvd explain` name a differing field
    return namespace


def weights_digest(params: list[tuple[str, Any]]) -> str:
    """XXH3-128 over (name, dtype, shape, bytes) of every parameter, in name order.

    An identity check, not a security boundary (a namespace separates models;
    it does not guard them: proto/PROTOCOL.md section 11), so the fast hash:
    ~12 GiB/s here against ~1 GiB/s for SHA-256, i.e. well under a second
    instead of seconds on a multi-GB model's first request.
    """
    import mlx.core as mx
    import numpy as np
    import xxhash

    h = xxhash.xxh3_128()
    params = sorted(params, key=lambda kv: kv[0])
    mx.eval([v for _, v in params])
    for name, v in params:
        h.update(f"{name}\0{v.dtype}\0{tuple(v.shape)}\0".encode())
        raw = v.view(mx.uint16) if v.dtype == mx.bfloat16 else v
        # Parameters are evaluated and (almost always) contiguous; the alias
        # costs nothing and is dropped before we return.
        h.update(np.ascontiguousarray(np.asarray(raw)).data)
    return h.hexdigest()


def _config(model: Any) -> dict[str, Any]:
    args = getattr(model, "args", None) or getattr(model, "config", None)
    if dataclasses.is_dataclass(args):
        cfg = dataclasses.asdict(args)
    elif isinstance(args, dict):
        cfg = dict(args)
    elif args is not None:
        cfg = dict(vars(args))
    else:
        cfg = {}
    # Round-trip through JSON with repr for odd values, so the id is stable.
    return json.loads(json.dumps(cfg, sort_keys=True, default=repr))


def _quantized(spec: dict[str, Any], group_size: int, bits: int) -> dict[str, Any]:
    # mlx-lm quantizes only top-level caches that have `to_quantized` (KVCache).
    if spec["k"] == "kv" and "c" not in spec:
        return {"k": "qkv", "gs": int(group_size), "bits": int(bits)}
    return spec
