"""`store` / `fetch` / `lookup`: the mlx-lm calls of `kvd_client.Client`.

Theory of operation
-------------------
`MlxMethods` holds the logic over any object with the numpy-level `put`,
`get`, `probe`, `namespace`, `strict` and `counters` (a test's in-memory
fake mixes it in). `MlxAdapter` binds it to one numpy-level client by
composition: `kvd_client.Client` creates one the first time `store`,
`fetch` or `lookup` is called and delegates to it, so the numpy core never
imports this package, and importing `kvd_client` imports no part of it.
The adapter refers to its client weakly (the client owns the adapter, not
the reverse), so a dropped client still stops its writer thread. This module imports
no mlx at import time; the mlx work lives in `_snapshot` and `_rebuild` and
always runs on the thread that calls `store` / `fetch` (the generation
thread, inside its `mx.stream` if it has one):

    store:  caller thread   take(): slice, eval, copy to numpy  -> Snapshot
                            (into a slab of the process's BufferPool)
            writer thread   put(tokens, Snapshot)                (numpy only);
                            dropping it gives the slab back to the pool
    fetch:  caller thread   get() -> Hit joined into mlx memory (`_blocks`: the
                            copy may run on mlx's own I/O threads, inside
                            mx.load) -> rebuild(): views of it, eval

Does the model need boundary state? A model with any recurrent or
sliding-window layer (ArraysCache, RotatingKVCache, ChunkedKVCache) can only
resume where such state was stored; an attention-only model can resume at
any stored prefix. The client records the model's layer layout per
namespace (process-wide, in `_format`) from:

1. `namespace_for(model, ...)`, which builds the model's own
   `make_prompt_cache` and records its layout under the id it returns;
2. the first `store` in a namespace with nothing recorded yet;
3. the meta of every hit (each chunk carries the layout); it overrides what
   was recorded, since it describes the data actually stored.

Until one of these has been seen, `fetch` asks for any prefix and, if the
hit's meta says the model needs boundary state the hit lacks, asks once more
for a boundary (one wasted transfer, once per process and namespace); and
`lookup` takes stored boundaries as the sign of a model that needs them
(attention-only snapshots carry none). With `namespace_for` both are exact
from the first call.

A namespace has one layout: a `store` whose layout differs from the one
recorded (e.g. a KVCache snapshot in a namespace made for a quantized KV
cache) is refused and counted `store_layout_mismatch`, because chunks of two
layouts under one prefix would not join.

Failures never raise into the caller unless `strict`: they are counted in
`counters` (`store_dropped`, `store_failed`, `store_unsupported`,
`store_invalid`, `store_layout_mismatch`, `fetch_miss`, `fetch_invalid`) and
the call degrades to "not stored" / a miss.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Sequence

from kvd_client.mlx_lm import _format as F
from kvd_client.mlx_lm import _pool
from kvd_client.mlx_lm._pool import BufferPool
from kvd_client.mlx_lm._writer import DEFAULT_MAX_PENDING_BYTES, Writer

_init_lock = threading.Lock()


class MlxMethods:
    """mlx-lm prompt caches in and out of kvd (see module docstring)."""

    #: Bytes of snapshots that may wait for the writer thread before `store`
    #: starts dropping new ones (at least one is always admitted).
    store_queue_bytes: int = DEFAULT_MAX_PENDING_BYTES
    #: Touched host memory snapshots are copied into (`_pool`): the process's
    #: shared pool; None copies every snapshot into fresh memory.
    snapshot_pool: BufferPool | None = _pool.SHARED

    # -- public --------------------------------------------------------------
    def store(
        self, tokens: Sequence[int], prompt_cache: Sequence[Any], *, wait: bool = False, media: Sequence[Any] = ()
    ) -> bool:
        """Store `prompt_cache`, the cache of `tokens` (fed from position 0).

        The snapshot (mlx slicing, evaluation and the copy to host memory) is
        taken on the calling thread before this returns, so the caller may
        keep decoding into the cache at once. The upload then runs on a
        background writer thread, unless `wait=True` or the client is strict.

        `media`: spans of media at token positions (`kvd_client.MediaSpan`),
        part of the keys (PROTOCOL.md 4.1); the same text with other media
        never shares a cache.

        Returns True if the snapshot was queued (or, when waiting, stored);
        False if there was nothing to store or it was refused or dropped
        (counted). Raises only when the client is strict.
        """
        from kvd_client.mlx_lm._snapshot import host_tokens, take

        toks_in = host_tokens(tokens)
        try:
            taken = take(toks_in, prompt_cache, start=self._mlx_held(toks_in, media), pool=self.snapshot_pool)
        except F.UnsupportedCache:
            self._mlx_count("store_unsupported")
            if self._mlx_strict():
                raise
            return False
        except F.SnapshotMismatch:
            self._mlx_count("store_invalid")
            if self._mlx_strict():
                raise
            return False
        if taken is None:
            return False
        toks, snap = taken
        snap.media = tuple(media)
        layers = snap.meta["layers"]
        known = F.layout_for(self.namespace)
        if known is None:
            F.remember(self.namespace, layers)
        elif known != layers:
            self._mlx_count("store_layout_mismatch")
            if self._mlx_strict():
                raise F.SnapshotMismatch(f"cache layout differs from the one recorded for namespace {self.namespace!r}")
            return False
        if wait or self._mlx_strict():
            try:
                ok = bool(self.put(toks, snap))
            except Exception:
                self._mlx_count("store_failed")
                if self._mlx_strict():
                    raise
                return False
            self._mlx_count("stored" if ok else "store_failed")
            return ok
        return self._mlx_writer().submit(toks, snap)

    def fetch(self, tokens: Sequence[int], *, media: Sequence[Any] = ()) -> tuple[list[Any] | None, int]:
        """The longest reusable stored prefix of `tokens`, as mlx-lm cache objects.

        Returns (prompt_cache, n): a fresh cache list covering `tokens[:n]`
        (built on the calling thread, inside its active stream), with
        1 <= n <= len(tokens) - 1 so at least one token is left to feed;
        or (None, 0) on a miss. For models with recurrent/windowed layers n
        is a position where that state was stored. `media` as in `store`.
        """
        from kvd_client.mlx_lm._blocks import mlx_blocks
        from kvd_client.mlx_lm._rebuild import rebuild
        from kvd_client.mlx_lm._snapshot import host_tokens

        toks = host_tokens(tokens)
        cap = len(toks) - 1
        if cap < 1:
            return None, 0
        need = self._mlx_boundary_need() is True
        extra = {"media": media} if media else {}  # numpy-level clients without media keep working
        # The hit is joined straight into mlx memory (one copy from the wire
        # or shared memory, and no memset before it: `_blocks`), and rebuilt
        # as views of it.
        blocks: dict[int, Any] = {}  # address of a joined tensor's memory -> its mlx array

        def alloc(sizes: list[int], fill):
            xs, aliases = mlx_blocks(sizes, fill)
            blocks.clear()  # a second get replaces the first's
            blocks.update((a.ctypes.data, x) for x, a in zip(xs, aliases))
            return aliases

        hit = self.get(toks, max_tokens=cap, need_boundary=need, alloc=alloc, **extra)
        if hit is not None and not need and hit.boundary is None and self._mlx_learn(hit):
            # Layout unknown (or recorded wrong) and the data says this model
            # resumes only at a boundary: ask again for one.
            hit = self.get(toks, max_tokens=cap, need_boundary=True, alloc=alloc, **extra)
        if hit is None or hit.n < 1:
            self._mlx_count("fetch_miss")
            return None, 0
        self._mlx_learn(hit)
        try:
            if hit.n > cap:
                raise F.SnapshotMismatch(f"served {hit.n} tokens, asked for at most {cap}")
            implied = F.model_layout(self.namespace)
            if implied is not None and (hit.meta or {}).get("layers") != implied:
                # Any process of the user may write this namespace: a hit
                # must match the layout the model itself implies.
                raise F.SnapshotMismatch(f"served layout differs from the model's for namespace {self.namespace!r}")
            cache = rebuild(hit, blocks)
        except F.SnapshotMismatch:
            self._mlx_count("fetch_invalid")
            if self._mlx_strict():
                raise
            return None, 0
        self._mlx_count("fetch_hit")
        self._mlx_count("tokens_reused", hit.n)
        return cache, hit.n

    def lookup(self, tokens: Sequence[int], *, media: Sequence[Any] = ()) -> int:
        """The n that `fetch(tokens, media=media)` would return now, without moving tensors (0 on a miss)."""
        from kvd_client.mlx_lm._snapshot import host_tokens

        toks = host_tokens(tokens)
        cap = len(toks) - 1
        if cap < 1:
            return 0
        probe = self.probe(toks, media=media) if media else self.probe(toks)
        limit = min(cap, probe.n)
        need = self._mlx_boundary_need()
        if need is None:  # unknown layout: only snapshots of boundary models store boundaries
            need = bool(probe.boundaries)
        if not need:
            return max(limit, 0)
        return max((b for b in probe.boundaries if b <= limit), default=0)

    def holds(self, tokens: Sequence[int]) -> bool:
        """Whether the daemon holds all of `tokens`, and the boundary state at
        their end if this namespace's model needs it (one LOOKUP, no tensors)."""
        from kvd_client.mlx_lm._snapshot import host_tokens

        toks = host_tokens(tokens)
        probe = self.probe(toks)
        if probe.n < len(toks):
            return False
        return not self._mlx_boundary_need() or len(toks) in probe.boundaries

    def needs_boundary(self) -> bool:
        """Whether this namespace's model resumes only at boundary state (a
        hybrid or sliding-window model), as far as its layout is known yet."""
        return bool(self._mlx_boundary_need())

    def flush_stores(self, timeout: float | None = None) -> bool:
        """Wait until every queued store has been put (or failed). False on timeout."""
        writer = getattr(self, "_mlx_writer_obj", None)
        return True if writer is None else writer.flush(timeout)

    def close(self) -> None:
        """Finish queued stores (up to the client timeout), then close the client."""
        writer = getattr(self, "_mlx_writer_obj", None)
        if writer is not None:
            writer.close(getattr(self, "timeout", 5.0))
        parent = getattr(super(), "close", None)
        if parent is not None:
            parent()

    # -- plumbing ----------------------------------------------------------------
    def _mlx_writer(self) -> Writer:
        writer = getattr(self, "_mlx_writer_obj", None)
        if writer is None:
            with _init_lock:
                writer = getattr(self, "_mlx_writer_obj", None)
                if writer is None:
                    writer = Writer(*_weak_calls(self), self.store_queue_bytes)
                    # A client dropped without close() must not keep a thread alive.
                    weakref.finalize(self, writer.close, 0)
                    self._mlx_writer_obj = writer
        return writer

    def _mlx_held(self, tokens: Any, media: Sequence[Any] = ()) -> int:
        """Where the snapshot may start: one LOOKUP (no tensors move), so a
        long conversation copies only its new chunks on the caller's thread."""
        return _held_start(self, tokens, media)

    def _mlx_count(self, key: str, n: int = 1) -> None:
        with _init_lock:
            counters = getattr(self, "counters", None)
            if counters is None:
                counters = self.counters = {}
            counters[key] = counters.get(key, 0) + n

    def _mlx_strict(self) -> bool:
        return bool(getattr(self, "strict", False))

    def _mlx_boundary_need(self) -> bool | None:
        layers = F.layout_for(self.namespace)
        return None if layers is None else F.needs_boundary(layers)

    def _mlx_learn(self, hit: Any) -> bool:
        """Record the layout a hit describes; return whether it needs boundary state."""
        meta = hit.meta if isinstance(hit.meta, dict) else {}
        layers = meta.get("layers")
        if meta.get("fmt") != F.FORMAT or not isinstance(layers, list) or not layers:
            return False
        try:
            need = F.needs_boundary(layers)
        except (KeyError, TypeError, ValueError, AttributeError):
            return False  # not layers kvd describes: nothing to learn (rebuild refuses them)
        if F.layout_for(self.namespace) != layers:
            F.remember(self.namespace, layers)
        return need


def _held_start(client: Any, tokens: Any, media: Sequence[Any] = ()) -> int:
    """Tokens before the first chunk the daemon lacks (a chunk boundary): the
    snapshot need not copy them. 0 for clients without chunked storage."""
    chunk = getattr(client, "chunk_tokens", None)
    if not chunk or len(tokens) < chunk:
        return 0
    probe = client.probe(tokens, media=media) if media else client.probe(tokens)
    return (probe.n // chunk) * chunk


def _weak_calls(client: Any):
    """put/count callables for the writer that do not keep `client` alive."""
    ref = weakref.ref(client)

    def put(tokens: Any, snapshot: Any) -> bool:
        me = ref()
        if me is None:
            return False
        if getattr(me, "chunk_tokens", None):  # a real client: upload on its own socket
            return bool(me.put(tokens, snapshot, background=True))
        return bool(me.put(tokens, snapshot))

    def count(key: str, n: int) -> None:
        me = ref()
        if me is not None:
            me._mlx_count(key, n)

    return put, count


class MlxAdapter(MlxMethods):
    """`MlxMethods` bound to one numpy-level client (see module docstring).

    Forwards `put`/`get`/`probe` and reads `namespace`, `strict`, `timeout`,
    `chunk_tokens`, `counters` and (if set) `store_queue_bytes` and
    `snapshot_pool` from it.
    `close()` drains queued stores only; the client closes its own sockets.
    """

    def __init__(self, client: Any):
        self._client = weakref.ref(client)

    def _target(self) -> Any:
        client = self._client()
        if client is None:
            raise ReferenceError("the kvd client of this adapter is gone")
        return client

    namespace = property(lambda self: self._target().namespace)
    strict = property(lambda self: self._target().strict)
    timeout = property(lambda self: self._target().timeout)
    chunk_tokens = property(lambda self: self._target().chunk_tokens)
    counters = property(lambda self: self._target().counters)

    @property
    def store_queue_bytes(self) -> int:  # type: ignore[override]
        return getattr(self._target(), "store_queue_bytes", DEFAULT_MAX_PENDING_BYTES)

    @property
    def snapshot_pool(self) -> BufferPool | None:  # type: ignore[override]
        return getattr(self._target(), "snapshot_pool", _pool.SHARED)

    def put(self, tokens: Any, snapshot: Any, *, background: bool = False) -> bool:
        return self._target().put(tokens, snapshot, background=background)

    def get(self, tokens: Any, **kw: Any) -> Any:
        return self._target().get(tokens, **kw)

    def probe(self, tokens: Any, **kw: Any) -> Any:
        return self._target().probe(tokens, **kw)
