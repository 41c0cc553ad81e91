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

import errno
import json
import os
import stat
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
        try:
            ids = json.loads(text)
        except RecursionError:  # "[[[[...": json recurses once per bracket
            raise ValueError("not a flat JSON list of token ids (nested too deeply)") from None
    else:
        ids = [int(t) for t in text.replace(",", " ").split()]
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < 2**32 for t in ids):
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
        cf = _read_032(path, meta)
    elif "2.0" in meta:
        cf = _read_031(arrays, meta)
    else:
        raise CacheFileError(f"{path}: no mlx-lm prompt-cache metadata (class names) in it")
    for i, layer in enumerate(cf.cache):
        try:
            _check_layer(layer, mx)
        except CacheFileError as err:
            raise CacheFileError(f"{path}: layer {i} ({type(layer).__name__}): {err}") from None
    return cf


def write(path: str | os.PathLike, cache: Sequence[Any], metadata: dict[str, str] | None = None) -> None:
    """Write `cache` with the installed `save_prompt_cache`, atomically (temp file + rename).

    Raises CacheFileError if `path` exists and is not a regular file (a FIFO,
    a device, a directory) or is a symlink: the rename would replace that
    node, not write through it. OSError if the folder cannot be written.
    """
    from mlx_lm.models.cache import save_prompt_cache

    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise CacheFileError(f"{path} is a symlink; kvd export replaces only a regular file (give the target's path)")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise CacheFileError(f"{path} exists and is not a regular file; kvd export writes only new or regular files")
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
    """(model, tokenizer) of a local mlx-lm model directory (mlx_lm.utils.load).

    Raises NotADirectoryError unless `path` is an existing directory: given
    anything else, mlx_lm.utils.load would download it from the Hugging Face
    Hub, and a file's metadata must never make kvd fetch and run a model.
    """
    local = Path(os.path.expanduser(str(path)))
    if not local.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a local model directory (kvd never downloads one)", str(path))
    from mlx_lm.utils import load

    return load(str(local.resolve()))  # an existing path: mlx-lm reads it, never the Hub


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


# -- what a layer must hold ---------------------------------------------------------
# Both loaders set attributes from whatever the file says: `load_prompt_cache`
# passes its scalars through as saved (a string, None, a float), and a crafted
# file can put a number where keys go. Everything downstream (the snapshot,
# the daemon's arithmetic) assumes the shapes and types mlx-lm itself makes,
# so a layer is checked here, once, and a file that breaks them is refused.
_MAX_DIM = 1 << 31  # no shape or scalar in a real cache comes near it


def _int(value: Any, what: str, lo: int = 0, hi: int = _MAX_DIM) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        shown = repr(value) if len(repr(value)) <= 40 else type(value).__name__
        raise CacheFileError(f"{what} must be an integer in [{lo}, {hi}], got {shown}")
    return value


def _array(value: Any, what: str, mx: Any, ndim: int | None = 4) -> Any:
    if not isinstance(value, mx.array):
        raise CacheFileError(f"{what} must be an array, got {type(value).__name__}")
    if ndim is not None and value.ndim != ndim:
        raise CacheFileError(f"{what} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    return value


def _kv_pair(keys: Any, values: Any, mx: Any, quantized: bool = False) -> int | None:
    """Rows (T) of a keys/values pair after checking them; None for an empty layer."""
    if keys is None and values is None:
        return None
    if quantized:
        sides = []
        for name, side in (("keys", keys), ("values", values)):
            if not isinstance(side, (tuple, list)) or len(side) != 3:
                n = len(side) if isinstance(side, (tuple, list)) else type(side).__name__
                raise CacheFileError(f"quantized {name} must be 3 arrays (data, scales, biases), got {n}")
            arrs = [_array(a, f"quantized {name}[{j}]", mx) for j, a in enumerate(side)]
            if len({tuple(a.shape[:3]) for a in arrs}) != 1:
                raise CacheFileError(f"quantized {name}: its arrays disagree on (batch, heads, rows)")
            sides.append(arrs[0])
        k, v = sides
    else:
        k, v = _array(keys, "keys", mx), _array(values, "values", mx)
    if tuple(k.shape[:3]) != tuple(v.shape[:3]):
        raise CacheFileError(f"keys {tuple(k.shape)} and values {tuple(v.shape)} disagree on (batch, heads, rows)")
    return int(k.shape[2])


def _check_layer(c: Any, mx: Any) -> None:
    """Raise CacheFileError (saying what is wrong, not where) unless `c` holds what a cache of its class made by mlx-lm holds."""
    from mlx_lm.models import cache as C

    kind = type(c)
    if kind in (C.KVCache, getattr(C, "ConcatenateKVCache", None)):
        rows = _kv_pair(c.keys, c.values, mx)
        _int(c.offset, "offset", 0, rows or 0)
    elif kind is C.QuantizedKVCache:
        _int(c.group_size, "group_size", 1, 1 << 16)
        _int(c.bits, "bits", 1, 32)
        rows = _kv_pair(c.keys, c.values, mx, quantized=True)
        _int(c.offset, "offset", 0, rows or 0)
    elif kind is C.RotatingKVCache:
        rows = _kv_pair(c.keys, c.values, mx)
        max_size = _int(c.max_size, "max_size", 1)
        _int(c.keep, "keep", 0, max_size)
        _int(c.offset, "offset", 0)
        _int(c._idx, "_idx", 0, rows or 0)
    elif kind is getattr(C, "ChunkedKVCache", None):
        rows = _kv_pair(c.keys, c.values, mx)
        _int(c.chunk_size, "chunk_size", 1)
        start = _int(c.start_position, "start_position", 0)
        _int(c.offset, "offset", start, start + (rows or 0))
    elif isinstance(c, C.ArraysCache):
        if not isinstance(c.cache, list):
            raise CacheFileError(f"its entries must be a list, got {type(c.cache).__name__}")
        for j, entry in enumerate(c.cache):
            if entry is not None:
                _array(entry, f"entry {j}", mx, ndim=None)
        for name in ("left_padding", "lengths"):
            if getattr(c, name, None) is not None:
                _array(getattr(c, name), name, mx, ndim=None)
    elif kind is getattr(C, "CacheList", None):
        if not isinstance(c.caches, (list, tuple)):
            raise CacheFileError(f"its caches must be a list, got {type(c.caches).__name__}")
        for j, sub in enumerate(c.caches):
            try:
                _check_layer(sub, mx)
            except CacheFileError as err:
                raise CacheFileError(f"cache {j} ({type(sub).__name__}): {err}") from None
    # Other classes: the client's adapter says whether it can store them (UnsupportedCache).


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
