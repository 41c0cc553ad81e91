"""`Client`: the numpy-level core plus the mlx-lm calls, by composition.

`Core` (in `_core`) speaks kvd/1 with numpy snapshots and knows nothing of
mlx. `Client` adds `store` / `fetch` / `lookup`, which delegate to an
`MlxAdapter` (kvd_client.mlx_lm) created the first time one of them is
called. Importing kvd_client therefore imports neither mlx nor the adapter;
the adapter itself imports mlx only inside `store` / `fetch`.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Sequence

from kvd_client._core import Core

if TYPE_CHECKING:
    from kvd_client.mlx_lm import MlxAdapter


class Client(Core):
    """The kvd client: numpy-level calls (`put`, `get`, `probe`, ...) plus the
    mlx-lm calls (`store`, `fetch`, `lookup`).

    `Client(endpoint=None, namespace="default", timeout=5.0, chunk_tokens=256,
    strict=False)`; usable as a context manager; safe to share between threads.
    Set `store_queue_bytes` to bound the snapshots waiting for the upload thread,
    and `snapshot_pool` to a `kvd_client.mlx_lm._pool.BufferPool` of its own
    (None: fresh memory each time) instead of the process's shared one.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._mlx: MlxAdapter | None = None
        self._mlx_lock = threading.Lock()

    @property
    def mlx(self) -> MlxAdapter:
        """The mlx-lm adapter this client delegates `store`/`fetch`/`lookup` to."""
        if self._mlx is None:
            with self._mlx_lock:
                if self._mlx is None:
                    from kvd_client.mlx_lm import MlxAdapter

                    self._mlx = MlxAdapter(self)
        return self._mlx

    def store(
        self, tokens: Sequence[int], prompt_cache: Sequence[Any], *, wait: bool = False, media: Sequence[Any] = ()
    ) -> bool:
        """Snapshot `prompt_cache` (the mlx-lm cache of `tokens`) on this thread and
        upload it in the background (now, with `wait=True` or a strict client).
        True if queued (or stored); False if refused or dropped. `media`: spans of
        media at token positions (`MediaSpan`), part of the keys. See MlxMethods.store."""
        return self.mlx.store(tokens, prompt_cache, wait=wait, media=media)

    def fetch(self, tokens: Sequence[int], *, media: Sequence[Any] = ()) -> tuple[list[Any] | None, int]:
        """(mlx-lm cache objects covering tokens[:n], n) with 1 <= n <= len(tokens) - 1,
        built on this thread; (None, 0) on a miss. See MlxMethods.fetch.
        Within one `timeout` in all, whichever `get`s it makes."""
        with self._budget():
            return self.mlx.fetch(tokens, media=media)

    def explain(self, tokens: Sequence[int], *, need_boundary: bool | None = None, media: Sequence[Any] = ()):
        """Why the daemon holds only so much of `tokens` (an `Explanation`, or None
        if it did not answer). `need_boundary` defaults to what the model's layout
        says, once `namespace_for` or a store/fetch has seen the model."""
        if need_boundary is None:
            need_boundary = self.mlx.needs_boundary()
        return super().explain(tokens, need_boundary=need_boundary, media=media)

    def lookup(self, tokens: Sequence[int], *, media: Sequence[Any] = ()) -> int:
        """The n that `fetch(tokens, media=media)` would return now, without moving tensors (0 on a miss)."""
        with self._budget():
            return self.mlx.lookup(tokens, media=media)

    def flush_stores(self, timeout: float | None = None) -> bool:
        """Wait until every queued store has been put (or failed). False on timeout."""
        return True if self._mlx is None else self._mlx.flush_stores(timeout)

    def close(self) -> None:
        """Finish queued stores (up to the client timeout), then close the sockets."""
        if self._mlx is not None:
            self._mlx.close()
        super().close()
