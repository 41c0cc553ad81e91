"""mlx-lm prompt-cache files (`save_prompt_cache` output) in and out of kvd.

Theory of operation
-------------------
A prompt-cache file is one safetensors file: the tensors of every layer's
`state`, flattened with `mlx.utils.tree_flatten` ("0.0", "0.1", ...), and
string metadata, also tree-flattened. Two layouts exist:

    mlx-lm 0.32   metadata = [user metadata, class names, scalars]
                  state is whole pre-allocated buffers plus the scalars
                  (offset, keep, ...) saved as 0-d arrays and listed in
                  "scalars"; "2.0" is always "" (the scalars list's sentinel)
    mlx-lm <=0.31 metadata = [meta_state per layer, user metadata, class names]
                  state is already sliced to the valid rows; scalars travel
                  as strings in meta_state ("2.0" is a class name)

A 0.32 file is read with the installed `load_prompt_cache` (the source of
truth for its own format). A 0.31 file is read here: tensors become fresh
cache objects of the installed classes, their attributes set explicitly the
way 0.31's `from_state(state, meta_state)` did. The 0.31 layout is the one
of upstream mlx-lm's meta_state era (`cache_metadata = [cache_info, metadata,
cache_classes]`); RotatingKVCache meta_state is read as (keep, max_size,
offset, _idx) or, from older releases, (keep, max_size, step, offset, _idx);
QuantizedKVCache's as (offset, group_size, bits) or (step, offset,
group_size, bits). One thing that layout cannot say: how many rows of a
front-trimmed ChunkedKVCache are valid (0.31 saved its whole buffer); the
other layers' token count decides (see `_fix_chunked`).

Token ids: a file written by `kvd export` holds them in the metadata key
`kvd_tokens` (a JSON list; keys avoid dots because mlx-lm's loader splits
metadata keys on dots). `mlx_lm.cache_prompt` files hold none; the caller
supplies them.

Export writes with the installed `save_prompt_cache`, so the installed
`load_prompt_cache` reads the file back bit-exact. Everything here runs on
the calling thread; it imports mlx lazily, like the rest of the adapter.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from kvd.protocol.errors import KvdError

TOKENS_KEY = "kvd_tokens"
NAMESPACE_KEY = "kvd_namespace"
MODEL_KEY = "model"  # what mlx_lm.cache_prompt writes


class CacheFileError(KvdError, ValueError):
    """The file is not an mlx-lm prompt-cache file this module can read."""


@dataclass
class CacheFile:
    """A prompt-cache file, read: cache objects, user metadata, which layout."""

    cache: list[Any]
    metadata: dict[str, str] = field(default_factory=dict)
    layout: str = "0.32"

    @property
    def tokens(self) -> list[int] | None:
        """Token ids from the metadata (`kvd_tokens`), or None."""
        raw = self.metadata.get(TOKENS_KEY)
        return None if raw is None else parse_tokens(raw)

    @property
    def n_tokens(self) -> int | None:
        """How many tokens the cache holds (None for caches without an offset)."""
        return cache_tokens(self.cache)


def parse_tokens(text: str) -> list[int]:
    """Token ids from a JSON list or whitespace/comma separated integers.

    Raises ValueError on anything else (or ids outside [0, 2**32)).
    """
    text = text.strip()
    if text.startswith("["):
        ids = json.loads(text)
    else:
        ids = [int(t) for t in text.replace(",", " ").split()]
    if not all(isinstance(t, int) and 0 <= t < 2**32 for t in ids):
        raise ValueError("token ids must be integers in [0, 2**32)")
    return list(ids)


def read(path: str | os.PathLike) -> CacheFile:
    """Read a `save_prompt_cache` file of mlx-lm 0.32 or 0.31 layout.

    Raises CacheFileError if it is neither.
    """
    import mlx.core as mx

    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except Exception as err:
        raise CacheFileError(f"{path}: not a safetensors file mlx can load ({err})") from None
    if meta.get("2.0") == "":
        return _read_032(path, meta)
    if "2.0" in meta:
        return _read_031(arrays, meta)
    raise CacheFileError(f"{path}: no mlx-lm prompt-cache metadata (class names) in it")


def write(path: str | os.PathLike, cache: Sequence[Any], metadata: dict[str, str] | None = None) -> None:
    """Write `cache` with the installed `save_prompt_cache`, atomically (temp file + rename)."""
    from mlx_lm.models.cache import save_prompt_cache

    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".safetensors", dir=path.parent or ".")
    os.close(fd)
    try:
        save_prompt_cache(tmp, list(cache), dict(metadata or {}))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def export_metadata(tokens: Sequence[int], namespace: str, model: str | None = None) -> dict[str, str]:
    """The metadata `kvd export` writes: token ids, namespace, and the model path if known."""
    meta = {TOKENS_KEY: json.dumps([int(t) for t in tokens]), NAMESPACE_KEY: namespace}
    if model:
        meta[MODEL_KEY] = str(model)
    return meta


def kv_options(cache: Sequence[Any]) -> dict[str, Any]:
    """`namespace_for` keyword options implied by a cache: KV quantization bits / group size."""
    from mlx_lm.models.cache import QuantizedKVCache

    for c in cache:
        if type(c) is QuantizedKVCache:
            return {"kv_bits": int(c.bits), "kv_group_size": int(c.group_size)}
    return {}


def load_model(path: str) -> tuple[Any, Any]:
    """(model, tokenizer) of a local mlx-lm model directory (mlx_lm.utils.load)."""
    from mlx_lm.utils import load

    return load(path)


def namespace_of(
    model: Any,
    cache: Sequence[Any] | None,
    *,
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    quantized_kv_start: int | None = None,
    max_kv_size: int | None = None,
) -> str:
    """The namespace a cache of `model` belongs in: KV options read from the
    cache itself (quantization, a single rotating window size), overridden by
    the arguments given, then `namespace_for`."""
    from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START
    from mlx_lm.models.cache import RotatingKVCache

    from kvd_client.mlx_lm import namespace_for

    opts = kv_options(cache) if cache is not None else {}
    if kv_bits is not None:
        opts["kv_bits"] = kv_bits
    if kv_group_size is not None:
        opts["kv_group_size"] = kv_group_size
    if opts.get("kv_bits") is not None:
        opts["quantized_kv_start"] = DEFAULT_QUANTIZED_KV_START if quantized_kv_start is None else quantized_kv_start
    if max_kv_size is None and cache is not None and not hasattr(model, "make_cache"):
        sizes = {c.max_size for c in cache if type(c) is RotatingKVCache}
        max_kv_size = sizes.pop() if len(sizes) == 1 else None
    return namespace_for(model, max_kv_size=max_kv_size, **opts)


def tokenize_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a prompt, tokenized the way `mlx_lm.cache_prompt` does."""
    if tokenizer.has_chat_template:
        return list(tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=False, continue_final_message=True
        ))
    return list(tokenizer.encode(text))


def cache_tokens(cache: Sequence[Any]) -> int | None:
    """The token count of the first layer that has an offset (None if none has)."""
    for c in cache:
        for layer in (c, *(getattr(c, "caches", None) or ())):
            offset = getattr(layer, "offset", None)
            if isinstance(offset, int) and getattr(layer, "keys", None) is not None:
                return offset
    return None


# -- 0.32 ------------------------------------------------------------------------
def _read_032(path: Any, meta: dict[str, str]) -> CacheFile:
    from mlx_lm.models import cache as C

    if hasattr(C.KVCache, "meta_state"):
        raise CacheFileError(f"{path}: written by mlx-lm >= 0.32; the installed mlx-lm reads only its own older layout")
    try:
        cache = C.load_prompt_cache(str(path))
    except Exception as err:
        raise CacheFileError(f"{path}: mlx-lm could not load it ({err})") from None
    user = {k[2:]: v for k, v in meta.items() if k.startswith("0.")}
    return CacheFile(cache, user, "0.32")


# -- 0.31 ------------------------------------------------------------------------
def _read_031(arrays: dict[str, Any], meta: dict[str, str]) -> CacheFile:
    nested_meta = _nest(meta)
    info = _listify(nested_meta.get("0", {}))
    classes = _listify(nested_meta.get("2", {}))
    user = {k[2:]: v for k, v in meta.items() if k.startswith("1.")}
    states = _listify(_nest(arrays))
    if not isinstance(classes, list) or not classes:
        raise CacheFileError("0.31 layout without class names")
    if not isinstance(states, list) or len(states) != len(classes):
        raise CacheFileError(f"0.31 layout: {len(classes)} classes but {len(states) if isinstance(states, list) else 0} states")
    info = info if isinstance(info, list) else [""] * len(classes)
    try:
        cache = [_layer_031(cls, st, info[i] if i < len(info) else "") for i, (cls, st) in enumerate(zip(classes, states))]
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise CacheFileError(f"0.31 layout: cannot rebuild layers ({err})") from None
    _fix_chunked(cache)
    return CacheFile(cache, user, "0.31")


def _fix_chunked(cache: list[Any]) -> None:
    """Cut 0.31 ChunkedKVCache layers to the token count the other layers agree on.

    0.31 saved `keys[..., :offset, :]`, which after a front trim (start_position
    > 0) is the whole buffer, padding included; the file does not say how many
    rows are valid. Every layer of a model holds the same tokens, so a plain
    layer's offset tells. Without one, start_position + rows is assumed.
    """
    from mlx_lm.models import cache as C

    flat = [s for c in cache for s in (getattr(c, "caches", None) or (c,))]
    known = {int(c.offset) for c in flat if type(c) in (C.KVCache, C.QuantizedKVCache, C.RotatingKVCache)}
    if len(known) != 1:
        return
    (t,) = known
    for c in flat:
        if type(c) is C.ChunkedKVCache and c.offset != t and 0 <= t - c.start_position <= c.keys.shape[2]:
            valid = t - c.start_position
            c.keys, c.values = c.keys[..., :valid, :], c.values[..., :valid, :]
            c.offset = t


def _layer_031(cls: str, state: Any, meta: Any) -> Any:
    from mlx_lm.models import cache as C

    def ints(m: Any) -> list[int]:
        return [int(x) for x in (m if isinstance(m, list) else [])]

    if cls in ("KVCache", "ConcatenateKVCache"):
        c = getattr(C, cls)()
        c.keys, c.values = state[0], state[1]
        c.offset = int(c.keys.shape[2])
        return c
    if cls == "QuantizedKVCache":
        m = ints(meta)
        offset, gs, bits = m[-3:]
        c = C.QuantizedKVCache(group_size=gs, bits=bits)
        c.keys, c.values = tuple(state[0]), tuple(state[1])
        c.offset = offset
        return c
    if cls == "RotatingKVCache":
        m = ints(meta)
        keep, max_size, offset, idx = (m[0], m[1], m[3], m[4]) if len(m) == 5 else m
        c = C.RotatingKVCache(max_size=max_size, keep=keep)
        c.keys, c.values = state[0], state[1]
        c.offset, c._idx = offset, idx
        return c
    if cls == "ChunkedKVCache":
        chunk_size, start = ints(meta)
        c = C.ChunkedKVCache(chunk_size)
        c.keys, c.values = state[0], state[1]
        c.start_position = start
        c.offset = start + int(c.keys.shape[2])
        return c
    if cls in ("ArraysCache", "MambaCache"):
        entries = state if isinstance(state, list) else [state]
        c = C.ArraysCache(len(entries))
        c.cache = list(entries)
        return c
    if cls == "CacheList":
        names = _listify(meta[0]) if isinstance(meta, list) else []
        metas = _listify(meta[1]) if isinstance(meta, list) and len(meta) > 1 else []
        return C.CacheList(*(_layer_031(n, s, metas[j] if j < len(metas) else "") for j, (n, s) in enumerate(zip(names, state))))
    raise CacheFileError(f"0.31 layout: unknown cache class {cls!r}")


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """{"0.1.2": x} -> {"0": {"1": {"2": x}}} (the inverse of tree_flatten, as dicts)."""
    root: dict[str, Any] = {}
    for key, value in flat.items():
        node = root
        parts = key.split(".")
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):  # a leaf and a subtree under one key
                raise CacheFileError(f"conflicting keys at {key!r}")
            node = nxt
        node[parts[-1]] = value
    return root


def _listify(tree: Any) -> Any:
    """Dicts whose keys are 0..n-1 become lists, recursively."""
    if not isinstance(tree, dict):
        return tree
    if tree and all(k.isdigit() for k in tree):
        idx = sorted(int(k) for k in tree)
        if idx == list(range(len(idx))):
            return [_listify(tree[str(i)]) for i in idx]
    return {k: _listify(v) for k, v in tree.items()}
