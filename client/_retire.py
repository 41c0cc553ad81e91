"""Closing the kvd clients of an adapter cache that was collected.

Theory of operation
-------------------
The server adapters (vllm-mlx's prefix caches, mlx-lm's prompt cache) live
exactly as long as the server keeps them: no registry of theirs holds one
strongly, so dropping a scheduler or a model frees its cache and, through
it, nothing of the model. What such a cache leaves behind is its `Client`s,
whose writer threads may still have snapshots queued (numpy bytes only: a
writer never sees a cache, a model or an mlx array).

A client that is simply dropped stops its writer and loses that queue (its
writer refers to it weakly), so each adapter cache registers
`weakref.finalize(cache, retire, <what holds its clients>)`: when the cache
is collected, `retire` closes those clients -- queued uploads finish,
bounded by the client timeout -- on a thread of its own, because a
finalizer runs wherever the cache died (vllm-mlx's unload runs its
`gc.collect()` on the event loop) and must not hold that thread up.

Rules kept: the finalizer's arguments never reach the cache or its model
(else the cache could never be collected); a retiring thread holds only
clients; `join_retired(timeout)` waits for them (the launchers' exit does,
after closing the caches still alive). Finalizers do not run at exit
(`atexit=False`): at exit the launchers close every live cache themselves.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

_lock = threading.Lock()
_threads: set[threading.Thread] = set()


def on_collect(obj: Any, close: Callable[[], None]) -> None:
    """Run `close` on a thread of its own once `obj` is collected (not at exit).

    `close` must not refer to `obj`."""
    weakref.finalize(obj, retire, close).atexit = False


def retire(close: Callable[[], None]) -> None:
    """Run `close` on a new daemon thread, tracked until it returns."""
    t = threading.Thread(target=_run, args=(close,), name="kvd-retire", daemon=True)
    with _lock:
        _threads.add(t)
    t.start()


def join_retired(timeout: float | None = None) -> bool:
    """Wait for every retiring close started so far (each up to `timeout`). False if one is still running."""
    with _lock:
        threads = list(_threads)
    for t in threads:
        t.join(timeout)
    return not any(t.is_alive() for t in threads)


def _run(close: Callable[[], None]) -> None:
    try:
        close()
    except Exception:  # closing must not raise on a thread nobody watches
        pass
    finally:
        with _lock:
            _threads.discard(threading.current_thread())
