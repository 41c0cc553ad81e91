"""Host memory for snapshots, already touched, reused from one store to the next.

Theory of operation
-------------------
A snapshot is one copy of the cache's bytes; what makes it slow is where the
copy lands. Memory the process has not touched costs a page fault and a page
the kernel must clear for every 4 KiB (~2 GiB/s here), memory already touched
takes a plain memcpy (~11 GiB/s). glibc hands big freed blocks back to the
kernel, so `np.array` into fresh memory pays the faults on every store. The
pool keeps the memory of snapshots whose upload is done and gives it to the
next snapshot.

* A *slab* is one numpy uint8 buffer. A snapshot leases one slab large enough
  for all its tensors and carves them out of it (`Lease.carve`, 64-byte
  aligned), so it costs one lock and one finalizer, not one per tensor.
* A lease ends when the last array carved from it is gone. The carved arrays
  are views of a token array whose base is a memoryview, and numpy does not
  collapse a base chain through a non-array, so every view keeps the token
  alive; a finalizer on the token gives the slab back. Whoever can still read
  the bytes -- the writer's queue, a put in flight, a zero-copy ZeroMQ frame
  not sent yet, a caller that kept a tensor -- holds the lease: a slab is never
  written while anything can see it, and two live snapshots never share one.
* Bounded: the slabs held, leased or free, total at most `limit` bytes. A
  lease that does not fit first drops free slabs (the least recently used
  first); if it still does not fit, `lease` returns None and the caller copies
  into fresh memory as before.
* Fit: a free slab serves a request of at least half its size, so a small
  snapshot (one new chunk of a conversation) does not tie up a whole cache's
  slab. A new slab is an eighth larger than asked (within the bound), so a
  conversation that grows by a chunk still fits the slab of its last store.
* Released when idle: a free slab not leased for `idle_s` seconds is dropped,
  by a reaper thread that exists only while the pool holds free slabs.
* In a child made by os.fork() the reaper does not exist and the lock may be
  held for ever: the first call there starts the pool over, empty (what the
  parent leased is the parent's).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Callable

import numpy as np

from kvd_client._transport import fork_lock

ALIGN = 64
IDLE_S = 10.0
#: The process-wide pool's bound: a backstop, not a budget. What the pool
#: holds follows what is in flight -- a snapshot taken, the writer queue's
#: (1 GiB by default, always one), the upload running -- and drains when
#: idle; 4 GiB lets one 4 GiB cache (a 70B-class model at 8-16k tokens) or
#: three 1 GiB ones land in touched memory.
DEFAULT_LIMIT = 4 << 30


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to the carve alignment (what a tensor takes in a slab)."""
    return -(-nbytes // ALIGN) * ALIGN


class Lease:
    """One slab, leased to one snapshot; carve its tensors with `carve`."""

    __slots__ = ("_token", "_used")

    def __init__(self, token: np.ndarray):
        self._token = token
        self._used = 0

    def carve(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A C-contiguous array of `shape` and `dtype` in the slab (uninitialized)."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        start = self._used
        if start + n > self._token.nbytes:
            raise ValueError(f"lease of {self._token.nbytes} bytes has no room for {n} more at {start}")
        self._used = start + aligned(n)
        return self._token[start : start + n].view(dtype).reshape(shape)


class _Slab:
    __slots__ = ("buf", "free_since")

    def __init__(self, nbytes: int):
        raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
        at = -raw.ctypes.data % ALIGN
        self.buf = raw[at : at + nbytes]
        self.free_since: float | None = None  # None while leased

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes


class BufferPool:
    """Touched host buffers for snapshots, bounded and released when idle (module docstring)."""

    def __init__(self, limit: int, idle_s: float = IDLE_S, clock: Callable[[], float] = time.monotonic):
        self.limit = int(limit)
        self.idle_s = float(idle_s)
        self._clock = clock
        self._start()

    def _start(self) -> None:
        self._pid = os.getpid()
        self._cv = threading.Condition()
        self._slabs: list[_Slab] = []
        self._reaper: threading.Thread | None = None

    def _here(self) -> None:
        if self._pid != os.getpid():
            with fork_lock():
                if self._pid != os.getpid():
                    self._start()

    # -- what the snapshot calls ----------------------------------------------------
    def lease(self, nbytes: int) -> Lease | None:
        """A slab of at least `nbytes`, leased until every array carved from it is gone; None if over the bound."""
        self._here()
        nbytes = max(ALIGN, int(nbytes))
        with self._cv:
            slab = self._best_free(nbytes)
            if slab is None:
                slab = self._new(nbytes)
                if slab is None:
                    return None
            slab.free_since = None
        token = np.frombuffer(memoryview(slab.buf), dtype=np.uint8)
        # Not at exit: giving a slab back then would start a reaper thread.
        weakref.finalize(token, self._give_back, slab, self._pid).atexit = False
        return Lease(token)

    # -- introspection (counters, tests) ----------------------------------------
    @property
    def held_bytes(self) -> int:
        """Bytes of all slabs the pool holds, leased or free."""
        with self._cv:
            return sum(s.nbytes for s in self._slabs)

    @property
    def free_bytes(self) -> int:
        with self._cv:
            return sum(s.nbytes for s in self._slabs if s.free_since is not None)

    def trim(self) -> int:
        """Drop free slabs idle for `idle_s` or longer (by the pool's clock); returns the bytes dropped."""
        with self._cv:
            return self._drop_idle(self._clock())

    def clear(self) -> None:
        """Drop every free slab now (leased ones leave the pool when given back)."""
        with self._cv:
            self._slabs = [s for s in self._slabs if s.free_since is None]
            self._cv.notify_all()

    # -- inside ----------------------------------------------------------------
    def _best_free(self, nbytes: int) -> _Slab | None:
        fits = [s for s in self._slabs if s.free_since is not None and nbytes <= s.nbytes <= 2 * nbytes]
        return min(fits, key=lambda s: s.nbytes) if fits else None

    def _new(self, nbytes: int) -> _Slab | None:
        if nbytes > self.limit:
            return None
        # Make room: the least recently used free slabs go first.
        free = sorted((s for s in self._slabs if s.free_since is not None), key=lambda s: s.free_since)
        held = sum(s.nbytes for s in self._slabs)
        while held + nbytes > self.limit and free:
            victim = free.pop(0)
            self._slabs.remove(victim)
            held -= victim.nbytes
        if held + nbytes > self.limit:
            return None
        size = min(aligned(nbytes + nbytes // 8), self.limit - held)
        slab = _Slab(max(size, nbytes))
        self._slabs.append(slab)
        return slab

    def _give_back(self, slab: _Slab, pid: int) -> None:
        if pid != os.getpid():
            return  # a lease of the parent's, dropped in a forked child
        with self._cv:
            if slab not in self._slabs:  # the pool was cleared or started over meanwhile
                return
            slab.free_since = self._clock()
            if self._reaper is None:
                reaper = threading.Thread(target=self._reap, name="kvd-snapshot-pool", daemon=True)
                try:
                    reaper.start()
                except RuntimeError:  # interpreter shutting down: nothing left to reap for
                    return
                self._reaper = reaper
            self._cv.notify_all()

    def _drop_idle(self, now: float) -> int:
        idle = [s for s in self._slabs if s.free_since is not None and now - s.free_since >= self.idle_s]
        for s in idle:
            self._slabs.remove(s)
        return sum(s.nbytes for s in idle)

    def _reap(self) -> None:
        with self._cv:
            while True:
                self._drop_idle(self._clock())
                free = [s.free_since for s in self._slabs if s.free_since is not None]
                if not free:
                    self._reaper = None
                    return
                self._cv.wait(max(0.0, min(free) + self.idle_s - self._clock()))


#: The pool `take` copies into unless told otherwise: one per process, shared
#: by every client in it (a model server runs one generation thread).
SHARED = BufferPool(DEFAULT_LIMIT)
