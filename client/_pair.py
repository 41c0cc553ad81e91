"""A second thread for the other half of a big copy (a fetch's join).

Theory of operation
-------------------
One core's copy does not take all the memory bandwidth there is: two threads
each copying and hashing half of 256 MiB took ~0.8x the time of one (this
2-core machine; numpy lets go of the GIL while it copies, xxh3 holds it for
its ~0.15x of the copy's time and still fits between). mx.load, which
runs a fetch's copy (`mlx_lm._blocks`), calls its reads one at a time even
from several threads, so the copy's other half needs a thread of its own.

`both(mine, theirs)` runs `theirs` on the process's helper thread and `mine`
on the calling thread, and returns once both have. The helper is made on
first use, one per process (made again in a child after fork), and lent to
one caller at a time: a caller that finds it lent, a process with one core
to run on, or one that cannot start a thread now runs both itself, in order
(`theirs` not at all if `mine` raised).

Rules:
- `both` returns only when both calls have returned, whatever either raised
  (a KeyboardInterrupt while it waits included): the memory they write stays
  the caller's to hand out or free.
- What either raised is raised on the calling thread (`mine`'s first).
- The helper runs nothing but what `both` gives it: no mlx array, no socket.
- It keeps nothing of a call once it has returned: the memory a join writes
  is freed when its caller lets it go, not at the next join.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Callable


class _Helper:
    def __init__(self):
        self.pid = os.getpid()
        self.free = threading.Lock()  # held while lent to a caller
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="kvd-copy-half", daemon=True).start()  # RuntimeError: none made

    def _run(self) -> None:
        while True:
            fn, done, box = self.jobs.get()
            try:
                fn()
            except BaseException as err:  # raised on the caller's thread (`both`)
                box.append(err)
            finally:
                # Nothing of a join outlives it here (module rules): waiting for the next
                # job, `fn` would hold the last one's memory (a whole fetch's).
                fn = box = None
                done.release()


_helper: _Helper | None = None
_made = threading.Lock()


def _forked() -> None:
    """In a child after fork: no helper (its thread stayed in the parent), and
    a lock that another thread may have held at the fork made anew."""
    global _helper, _made
    _helper, _made = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def _lend() -> _Helper | None:
    """The helper, lent to the caller (give it back with `free.release()`); None if lent or single-core."""
    global _helper
    helper = _helper
    if helper is None or helper.pid != os.getpid():
        if _cores() < 2:
            return None
        with _made:
            if _helper is None or _helper.pid != os.getpid():  # a child after fork has no thread of its parent
                try:
                    _helper = _Helper()
                except RuntimeError:  # no thread can start (a pids limit): the caller runs both; tried again next time
                    return None
            helper = _helper
    return helper if helper.free.acquire(blocking=False) else None


def both(mine: Callable[[], None], theirs: Callable[[], None]) -> None:
    """Run `theirs` on the helper thread and `mine` here; see the module rules."""
    helper = _lend()
    if helper is None:
        mine()
        theirs()
        return
    try:
        done, box = threading.Lock(), []
        done.acquire()
        helper.jobs.put((theirs, done, box))
        try:
            mine()
        finally:
            _wait(done)  # the helper's half has returned
        if box:
            raise box.pop()  # (box[0] would keep the error's traceback, and with it the join's memory, in a cycle)
    finally:
        helper.free.release()


def _wait(done: threading.Lock) -> None:
    """Until the helper's half has returned, even through a signal's
    exception (KeyboardInterrupt): that is raised after, not instead."""
    pending = None
    while True:
        try:
            done.acquire()
            break
        except BaseException as err:
            pending = pending or err
    if pending is not None:
        raise pending
