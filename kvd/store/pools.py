"""Thread pools that never refuse a task.

The SSD writer fsyncs and reads ahead on helper threads, the remote tier
reads ahead on two of its own; a pool starts its threads as tasks come. On a
host at its thread limit (a container's pids limit, systemd's TasksMax)
starting one raises RuntimeError, and a task refused so would turn into a
write that fails or a GET answered INTERNAL. `OrInline` runs such a task on
the caller's thread instead: slower, never a failure of its own.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class OrInline:
    """A ThreadPoolExecutor whose tasks run on the caller's thread when no
    thread of its own can be started (or it was shut down)."""

    def __init__(self, workers: int, name: str):
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self.inline = 0  # tasks run on the caller's thread

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        try:
            return self.pool.submit(fn, *args)
        except RuntimeError:  # "can't start new thread"
            self.inline += 1
            fut: Future = Future()
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, as the pool would
                fut.set_exception(exc)
            return fut

    def shutdown(self, wait: bool = True, **kw: Any) -> None:
        self.pool.shutdown(wait=wait, **kw)
