"""mlx-lm prompt cache -> `Snapshot` of host bytes, on the caller's thread.

Theory of operation
-------------------
`take(tokens, prompt_cache)` runs entirely on the thread that owns the cache
(the generation thread, inside its `mx.stream`, if any). It

1. describes every layer (`_format.spec_of`) and reads its tensors and
   scalars from explicit attributes (`keys`, `values`, `offset`, `_idx`,
   ...), never from `state`: in mlx-lm 0.32 `state` is the whole
   pre-allocated buffer (padding and rows left over after `trim` included),
   in 0.31 it was already sliced; the attributes mean the same in both;
2. decides how many tokens the cache covers (`T`, the layers' common
   `offset`) and slices every token-axis tensor to `T` rows -- a lazy view;
3. reinterprets bfloat16 as uint16 (numpy's buffer protocol cannot carry
   bf16, and casting through float16/float32 is lossy or doubles the bytes);
4. evaluates all of it with one `mx.eval` on the caller's stream, then copies
   each array into memory numpy owns (a real copy: a numpy view of a live
   `KVCache.keys` buffer would see later decode writes, and an array still
   backed by mlx memory would be freed by mlx on whichever thread drops it
   last). The copies land in one slab leased from the process's `BufferPool`
   (memory a finished snapshot left touched: the copy runs at memcpy speed
   instead of page-faulting fresh memory), carved per tensor, each copied
   with one `np.copyto` from a numpy alias of the evaluated mlx array; the
   slab goes back to the pool when the last of its arrays is dropped (the
   upload done). Without a pool, or past its bound, `np.array` copies into
   fresh memory. Into a slab, the copies of 2 MiB or more in all are shared
   with the process's helper thread (`kvd_client._pair`, as a fetch's join
   is: ~0.8x the time of one thread): `take` returns once both halves are
   done, and the helper reads the bytes of arrays this thread evaluated and
   holds, never an mlx object.

The result holds numpy arrays and plain Python values only. Whatever thread
handles it afterwards cannot reach an mlx object through it.

Rules kept: every tensor carries its own dtype name; scalars are Python ints;
nothing is dequantized, cast, or re-laid out.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from kvd.protocol import dtypes
from kvd_client._chunking import copy_all
from kvd_client._tensors import HostTensor, Snapshot
from kvd_client.mlx_lm import _format as F
from kvd_client.mlx_lm._pool import SHARED, BufferPool, aligned


def take(
    tokens: Sequence[int], prompt_cache: Sequence[Any], *, start: int = 0, pool: BufferPool | None = SHARED
) -> tuple[np.ndarray, Snapshot] | None:
    """Snapshot `prompt_cache`, which was built by feeding `tokens` from position 0.

    Returns (the tokens the snapshot covers, the Snapshot), or None when the
    cache holds no tokens. The covered tokens are `tokens[:T]` where T is
    the cache's offset; a cache longer than `tokens` is cut to `len(tokens)`
    if every layer is sliceable. Token-axis tensors are copied from position
    `start` on (a chunk boundary the daemon already holds everything before);
    a `start` past T is ignored (everything is copied). Boundary state is
    always copied whole. The copies land in one slab leased from `pool`
    (memory already touched, see `_pool`; the process's shared pool unless
    told otherwise), or in fresh numpy memory with `pool=None` or past the
    pool's bound.

    Raises UnsupportedCache for cache classes kvd does not know, and
    SnapshotMismatch when layers disagree on their offset or a boundary
    layer holds more tokens than `tokens` names.
    """
    import mlx.core as mx

    toks = host_tokens(tokens)
    layers = [F.spec_of(c) for c in prompt_cache]

    offsets: set[int] = set()
    for spec, c in zip(layers, prompt_cache):
        _collect_offsets(spec, c, offsets)
    if len(offsets) > 1:
        raise F.SnapshotMismatch(f"cache layers disagree on offset: {sorted(offsets)}")
    t_cache = offsets.pop() if offsets else len(toks)  # pure-recurrent models have no offset
    bnd = F.needs_boundary(layers)
    if t_cache > len(toks):
        if bnd:
            raise F.SnapshotMismatch(
                f"cache holds {t_cache} tokens but only {len(toks)} were given; "
                "its recurrent/windowed state cannot be cut back"
            )
        t_cache = len(toks)
    if t_cache == 0:
        return None
    toks = toks[:t_cache]

    plan = _Plan(t_cache, start if start <= t_cache else 0)
    for i, (spec, c) in enumerate(zip(layers, prompt_cache)):
        plan.layer(str(i), spec, c)

    # One eval for everything: slices, bf16 views, and whatever lazy work the
    # model left on the cache buffers, all on the caller's stream.
    mx.eval(*(x for _, x, _, _ in plan.items))
    snap = Snapshot(meta=F.make_meta(layers), boundary_meta=plan.boundary_meta, start=plan.start)
    lease = pool.lease(sum(aligned(x.nbytes) for _, x, _, _ in plan.items)) if pool is not None else None
    copies = []  # (alias of mlx memory, its slab's carve), dropped once copied
    for name, x, wire, axis in plan.items:
        if lease is None:
            host = HostTensor(wire, np.array(x, copy=True, order="C"))
        else:
            src = np.asarray(x)
            dst = lease.carve(src.shape, src.dtype)
            copies.append((src, dst))
            host = HostTensor(wire, dst)
        if axis is None:
            snap.boundary[name] = host
        else:
            snap.sliced[name] = (host, axis)
    # The caller's thread and the helper's share the copy (`_pair`; the
    # mlx arrays stay alive here, in `plan`, until both halves are done).
    copy_all(copies)
    copies.clear()
    return toks, snap


def host_tokens(tokens: Sequence[int]) -> np.ndarray:
    # A numpy copy made here, so an mx.array of tokens never reaches the writer.
    if hasattr(tokens, "tolist") and not isinstance(tokens, np.ndarray):
        tokens = tokens.tolist()  # mx.array: read on the owning thread
    return np.array(tokens, dtype=np.int64).reshape(-1)


def _collect_offsets(spec: dict[str, Any], c: Any, out: set[int]) -> None:
    if spec["k"] == "list":
        for s, sub in zip(spec["sub"], c.caches):
            _collect_offsets(s, sub, out)
    elif spec["k"] != "arrays":
        out.add(int(c.offset) if c.keys is not None else 0)


def wire_dtype(x: Any) -> str:
    """The kvd dtype name of an mlx array's dtype; UnsupportedCache if none."""
    name = str(x.dtype).rsplit(".", 1)[-1]
    if name not in dtypes.DTYPES:
        raise F.UnsupportedCache(f"mlx dtype {x.dtype} has no kvd wire name")
    return name


class _Plan:
    """Lazy mlx views to copy, with their wire names; built on the caller's thread."""

    def __init__(self, n_tokens: int, start: int = 0):
        self.t = n_tokens
        self.start = start
        self.items: list[tuple[str, Any, str, int | None]] = []  # name, mx view, dtype, axis
        self.boundary_meta: dict[str, Any] = {}

    def add(self, name: str, x: Any, axis: int | None) -> None:
        import mlx.core as mx

        wire = wire_dtype(x)
        if wire == "bfloat16":
            x = x.view(mx.uint16)  # same bits, a dtype numpy can hold
        self.items.append((name, x, wire, axis))

    def rows(self, x: Any, n: int) -> Any:
        return x if x.shape[F.TOKEN_AXIS] == n else x[..., :n, :]

    def token_rows(self, x: Any) -> Any:
        """Rows [start, T) of a token-axis tensor (all T rows when start is 0)."""
        return self.rows(x, self.t) if not self.start else x[..., self.start : self.t, :]

    def layer(self, p: str, spec: dict[str, Any], c: Any) -> None:
        kind = spec["k"]
        if kind == "kv":
            self.add(f"{p}.k", self.token_rows(c.keys), F.TOKEN_AXIS)
            self.add(f"{p}.v", self.token_rows(c.values), F.TOKEN_AXIS)
        elif kind == "qkv":
            for side, triple in (("k", c.keys), ("v", c.values)):
                packed, scales, biases = triple
                self.add(f"{p}.{side}.q", self.token_rows(packed), F.TOKEN_AXIS)
                self.add(f"{p}.{side}.s", self.token_rows(scales), F.TOKEN_AXIS)
                self.add(f"{p}.{side}.b", self.token_rows(biases), F.TOKEN_AXIS)
        elif kind == "rot":
            # Rows past min(offset, buffer) are padding from in-place growth;
            # once the ring has wrapped (offset >= buffer) every row is live.
            valid = min(int(c.offset), c.keys.shape[F.TOKEN_AXIS])
            self.add(f"{p}.k", self.rows(c.keys, valid), None)
            self.add(f"{p}.v", self.rows(c.values, valid), None)
            self.boundary_meta[p] = {"offset": int(c.offset), "idx": int(c._idx)}
        elif kind == "chunked":
            start = int(c.start_position)
            valid = int(c.offset) - start
            self.add(f"{p}.k", self.rows(c.keys, valid), None)
            self.add(f"{p}.v", self.rows(c.values, valid), None)
            self.boundary_meta[p] = {"offset": int(c.offset), "start": start}
        elif kind == "arrays":
            nones = []
            for i, a in enumerate(c.cache):
                if a is None:
                    nones.append(i)
                else:
                    self.add(f"{p}.a{i}", a, None)
            extra = {}
            for attr, tag in (("left_padding", "lp"), ("lengths", "len")):
                a = getattr(c, attr, None)
                if a is not None:
                    self.add(f"{p}.{tag}", a, None)
                    extra[tag] = True
            self.boundary_meta[p] = {"none": nones, **extra}
        elif kind == "list":
            for j, (s, sub) in enumerate(zip(spec["sub"], c.caches)):
                self.layer(f"{p}.{j}", s, sub)
        else:  # pragma: no cover - spec_of only makes the kinds above
            raise F.UnsupportedCache(f"unknown layer kind {kind!r}")
