"""Background threads step aside while the serving thread answers someone waiting.

Theory of operation
-------------------
The daemon's threads share one GIL. The SSD writer's Python work per entry
(a blob header, an index row) is small, but a flood of tiny entries keeps it
at it, and every time the serving thread lets the GIL go -- each recv, send
and poll -- the writer takes it and the serving thread waits up to the
switch interval to have it back. Measured under a flood of PUTs of 8,000
tiny chunks (issue 44): the writer held the GIL a fifth of the wall time,
and a model server's GET of a RAM hit, 0.3 ms alone, took 2-5 ms; its p99
was 27-31 ms with the SSD tier on against 3.7-7.3 ms without.

So the serving thread says when it serves a request someone waits on
(`serving()` ... `served()`: the daemon does for reads, kvd.server.admission.ready),
and a background thread calls `pause()` between two pieces of its work (the
writer: between entries, between index rows). While a request is served,
`pause()` waits until it is done.

Rules:
1. A writer is slowed, never stopped: one `pause()` waits at most
   `max_wait_s`, and after a wait that ran out, `pause()` does not wait again
   for `grace_s` -- under a stream of reads the writer still gets about
   grace / (grace + max_wait) of its time.
2. `serving()` and `served()` are the serving thread's; `pause()` any other
   thread's. None of them does I/O; the clock is injected.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class Courtesy:
    """See the module docstring."""

    def __init__(self, *, max_wait_s: float = 0.002, grace_s: float = 0.001,
                 clock: Callable[[], float] = time.monotonic):
        self.max_wait_s = max_wait_s
        self.grace_s = grace_s
        self._clock = clock
        self._idle = threading.Event()
        self._idle.set()
        self._free_until = float("-inf")  # pause() does not wait before this (rule 1)
        self.pauses = 0  # pause() calls that waited
        self.paused_s = 0.0  # what they waited, in all

    def serving(self) -> None:
        self._idle.clear()

    def served(self) -> None:
        self._idle.set()

    def pause(self) -> None:
        if self._idle.is_set():
            return
        began = self._clock()
        if began < self._free_until:
            return
        done = self._idle.wait(self.max_wait_s)
        ended = self._clock()
        self.pauses += 1
        self.paused_s += ended - began
        if not done:
            self._free_until = ended + self.grace_s

    def stats(self) -> dict[str, float]:
        return {"writer_pauses": self.pauses, "writer_paused_ms": round(1000 * self.paused_s, 3)}


def never() -> None:
    """A pause() for threads with nobody to step aside for (tools, offline gc)."""
