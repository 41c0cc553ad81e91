"""Pages of the arena made ready before a PUT needs them (issue 42).

A freshly started daemon has no segments: each SLOTS made one and reserved
its slots' pages on the serving thread (posix_fallocate: the kernel clears
every page, ~2 GiB/s here), while the client waited, so a put into a fresh
daemon ran at a fraction of a warm one's rate. The thread `kvd-shm-prep`
keeps prepared free space ahead of demand instead: whole segments made,
mapped and reserved (posix_fallocate of all of it) away from the serving
thread, offered to `Arena.alloc` only once ready; a slot carved from them
costs no syscall.

How far ahead: twice the bytes allocated in the busiest recent interval
(each wake measures the bytes allocated since the last, and the figure
decays by a tenth per wake), at least two segments, from the first PUT on
(not before: a daemon started in a tight memory cgroup must not jump at
start, tests/server/test_pressure.py) -- and never past the
ceiling: the segments that allocate hold at most half the arena's capacity
plus one segment (the RAM tier's budget, about: what a warm daemon keeps
mapped anyway, `Arena.keep_free`). Nothing is prepared while the RAM tier
yields to memory pressure (`allowed`), nor after `kvd gc --ram-mb` emptied
it (`Arena.lean`), so memory handed back stays handed back.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

from kvd.server.shm.arena import Arena

log = logging.getLogger("kvd.server")

WAKE_S = 0.05  # the thread looks at demand at least this often


class Preparer:
    def __init__(self, arena: Arena, allowed: Callable[[], bool] = lambda: True):
        self.arena, self.allowed = arena, allowed
        self._wake = threading.Event()
        self._stop = False
        self._seen = 0
        self._burst = 0.0
        self.prepared_bytes = 0
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name="kvd-shm-prep", daemon=True)

    def start(self) -> "Preparer":
        self.arena.on_alloc = self._wake.set
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        self.arena.on_alloc = None
        self._wake.set()
        self._thread.join(5.0)

    def ahead(self) -> int:
        """Free prepared bytes wanted now (module docstring)."""
        allocated = self.arena.allocated
        self._burst = max(self._burst * 0.9, float(allocated - self._seen))
        self._seen = allocated
        if not allocated:
            return 0  # nothing before the first PUT: a daemon in a tight memory cgroup sees no jump at start
        return max(2 * self.arena.segment_bytes, int(2 * self._burst))

    def step(self) -> bool:
        """Prepare one segment if wanted and allowed; whether one was."""
        arena = self.arena
        want = self.ahead()
        if arena.lean or not self.allowed() or arena.spare_prepared() >= want:
            return False
        begun = arena.begin_segment(room=arena.capacity // 2 + arena.segment_bytes)
        if begun is None:
            return False
        seg, fd = begun
        reserved = hasattr(os, "posix_fallocate")
        if reserved:
            try:
                os.posix_fallocate(fd, 0, arena.segment_bytes)
            except OSError as err:  # a full /dev/shm or memory cgroup: slots reserve their own pages
                reserved = False
                self.failures += 1
                log.debug("shared memory: cannot prepare a segment: %s", err)
        arena.end_segment(seg, reserved)
        self.prepared_bytes += arena.segment_bytes if reserved else 0
        return reserved

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(WAKE_S)
            self._wake.clear()
            try:
                while not self._stop and self.step():
                    pass
            except OSError as err:  # the folder gone, no memory: the serving thread grows as before
                self.failures += 1
                log.debug("shared memory: preparing a segment failed: %s", err)

    def stats(self) -> dict[str, int]:
        return {"prepared_bytes": self.prepared_bytes, "prepare_failures": self.failures}
