"""The background writer: puts snapshots to the daemon off the generation thread.

Theory of operation
-------------------
`store` takes the snapshot on the caller's thread (mlx work, host copies)
and hands it here; one daemon thread then runs the blocking `put` for each
queued snapshot, in order. This module never imports mlx and only ever sees
numpy arrays and plain values, so the writer cannot touch an mlx object
even by accident.

Rules kept:
* A full queue drops the *new* snapshot (counted `store_dropped`) rather
  than blocking the generation thread: a cache that stalls its model is worse
  than a miss. The queue is bounded in bytes, and always admits one
  snapshot so a single huge one is not dropped forever.
* `put` failures are counted (`store_failed`), logged once by the client,
  and never raised: nobody is waiting to catch them.
* `flush(timeout)` waits until everything submitted before it has been
  put (or failed); tests and demos use it to order a store before a fetch
  in another process. The thread is a daemon: whatever is still queued when
  the interpreter exits is lost (it is a cache), so flush or close first if
  it matters.
* The writer drops each snapshot as soon as its put returns: its arrays
  live in a slab of the snapshot pool (`_pool`), which goes back for the
  next store only when nothing holds them any more.
* In a child made by os.fork() the writer thread does not exist, and the
  queue's lock may be held for ever (if the thread held it at the fork): the
  first call there starts a writer of its own, with an empty queue (what was
  queued is the parent's to put).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from typing import Any, Callable

from kvd_client._transport import fork_lock

log = logging.getLogger("kvd_client")

DEFAULT_MAX_PENDING_BYTES = 1 << 30


class Writer:
    def __init__(
        self,
        put: Callable[[Any, Any], bool],
        count: Callable[[str, int], None],
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
    ):
        self._put = put
        self._count = count
        self._max = max_pending_bytes
        self._start()

    def _start(self) -> None:
        self._pid = os.getpid()
        self._cv = threading.Condition()
        self._queue: deque[tuple[Any, Any, int]] = deque()
        self._pending_bytes = 0
        self._busy = False  # a put is running (its snapshot already left the queue)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvd-writer", daemon=True)
        self._thread.start()

    def _here(self) -> None:
        """In a forked child, a writer of its own (module docstring)."""
        if self._pid != os.getpid():
            with fork_lock():
                if self._pid != os.getpid():
                    self._start()

    def submit(self, tokens: Any, snapshot: Any) -> bool:
        """Queue a snapshot; False (and counted) if the queue is full or closed."""
        self._here()
        nbytes = snapshot.nbytes
        with self._cv:
            if self._closed:
                self._count("store_dropped", 1)
                return False
            if self._queue and self._pending_bytes + nbytes > self._max:
                self._count("store_dropped", 1)
                return False
            self._queue.append((tokens, snapshot, nbytes))
            self._pending_bytes += nbytes
            self._cv.notify_all()
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the queue is drained and no put is running. False on timeout."""
        self._here()
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float | None = 5.0) -> None:
        """Finish queued puts (up to `timeout`), then stop the thread."""
        self.flush(timeout)  # (in a forked child: first a writer of its own)
        with self._cv:
            self._closed = True
            dropped = len(self._queue)
            self._pending_bytes -= sum(nbytes for _, _, nbytes in self._queue)  # a put running keeps its own
            self._queue.clear()
            self._cv.notify_all()
        if dropped:
            self._count("store_dropped", dropped)
        if threading.current_thread() is not self._thread:  # close() may run on it, from a finalizer
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if self._closed and not self._queue:
                    return
                tokens, snapshot, nbytes = self._queue.popleft()
                self._busy = True
            try:
                ok = self._put(tokens, snapshot)
            except Exception:  # a bug below us must not kill the writer
                log.exception("kvd store failed")
                ok = False
            # Dropping the host copy gives its slab back to the snapshot pool
            # (`_pool`): the next store copies into it, touched already.
            del snapshot
            # Count before clearing `_busy`, so a flush() that returns sees the tally.
            self._count("stored" if ok else "store_failed", 1)
            with self._cv:
                self._pending_bytes -= nbytes
                self._busy = False
                self._cv.notify_all()
