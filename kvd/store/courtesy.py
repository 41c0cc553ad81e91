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

That covers the serving thread, not the rest of a read's round trip: the
client's own threads, and both ends' ZeroMQ I/O threads, want a core at the
same moments. On two cores a writer running flat out on one of them (0.8 s
of CPU for a PUT of 8,000 tiny chunks) made a model server's GET of a RAM
hit wait its turn for a core: p99 4-6x idle, and as much with the writer's
daemon another one (`bench_stress.py --floor`). So while reads come (a GET
or LOOKUP was served within `readers_s`: what a model server waits on, not
a PING or a STATS, whose pollers would keep the writer slow for nothing),
the writer also keeps to a duty cycle: each
`work_s` of its CPU time is followed by a rest of work_s x (1 - duty) / duty.
A writer of big entries spends its time waiting for the disk, not on a CPU,
and is hardly slowed; a flood of tiny ones is. The grain is fine (0.25 ms,
a rest of 0.75): a thread that works a few milliseconds and sleeps between
(1 ms then 3 did) is run first when it wakes, ahead of the reader's threads
waking meanwhile -- another process busy a quarter of the time cost a
reader's p99 2.3x idle in periods of 4 ms, 3.5x in 10 ms, 1.3x in 1 ms
(bench/RESULTS.md, session 45).

Rules:
1. A writer is slowed, never stopped: one `pause()` waits at most
   `max_wait_s`, and after a wait that ran out, `pause()` does not wait again
   for `grace_s` -- under a stream of reads the writer still gets about
   grace / (grace + max_wait) of its time.
2. While reads come, the writer rests work_s x (1 - duty) / duty after
   each `work_s` of its CPU time (rests happen in `pause()`, between two
   pieces of work; a piece that ran longer -- one big entry -- earns no
   longer rest, so a writer of big entries is hardly slowed). With no read for
   `readers_s`, it runs flat out; and whenever `urgent()` says someone
   waits on the writer itself (the daemon's: a write-through PUT parked
   until its entries are on disk, the RAM tier under memory pressure, which
   only spilling relieves: a daemon in a 128 MiB cgroup storing while it
   read was killed before its writer could catch up).
3. `serving()` and `served()` are the serving thread's; `pause()` any other
   thread's. None of them does I/O; the clocks and the sleep are injected.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class Courtesy:
    """See the module docstring."""

    def __init__(self, *, max_wait_s: float = 0.002, grace_s: float = 0.001, duty: float = 0.25,
                 work_s: float = 0.00025, readers_s: float = 0.05, clock: Callable[[], float] = time.monotonic,
                 cpu: Callable[[], float] = time.thread_time, sleep: Callable[[float], None] = time.sleep,
                 urgent: Callable[[], bool] = lambda: False):
        self.max_wait_s = max_wait_s
        self.grace_s = grace_s
        self.duty, self.work_s, self.readers_s = duty, work_s, readers_s
        self._clock, self._cpu, self._sleep = clock, cpu, sleep
        self.urgent = urgent
        self._idle = threading.Event()
        self._idle.set()
        self._free_until = float("-inf")  # pause() does not wait before this (rule 1)
        self._read_at = float("-inf")  # when a read was last served (rule 2)
        self._rested: float | None = None  # the writer's CPU clock at its last rest, while reads come
        self.pauses = 0  # pause() calls that waited
        self.paused_s = 0.0  # what they waited, in all
        self.rests = 0  # rests of rule 2
        self.rested_s = 0.0

    def serving(self) -> None:
        self._idle.clear()

    def served(self, read: bool = True) -> None:
        """The request is answered; `read`: one a model server waits on (rule 2)."""
        if read:
            self._read_at = self._clock()
        self._idle.set()

    def pause(self) -> None:
        if not self._idle.is_set():
            began = self._clock()
            if began >= self._free_until:
                done = self._idle.wait(self.max_wait_s)
                ended = self._clock()
                self.pauses += 1
                self.paused_s += ended - began
                if not done:
                    self._free_until = ended + self.grace_s
        self._keep_duty()

    def _keep_duty(self) -> None:
        """Rule 2."""
        if self._clock() - self._read_at > self.readers_s or self.urgent():
            self._rested = None
            return
        cpu = self._cpu()
        if self._rested is None:
            self._rested = cpu
            return
        worked = cpu - self._rested
        if worked >= self.work_s:
            # At most one piece's rest: a piece that ran long (one big entry's
            # copy into the page cache) is not paid for after the fact -- a
            # 40 ms piece made a 120 ms sleep that a write-through PUT parked
            # meanwhile waited out, and 64 MiB entries were written 2.25x slower.
            rest = min(worked, self.work_s) * (1.0 - self.duty) / self.duty
            self._sleep(rest)
            self.rests += 1
            self.rested_s += rest
            self._rested = self._cpu()

    def stepped_aside(self) -> float:
        """Seconds the writer has waited and rested so far (rules 1 and 2):
        what its pace leaves out, since a stop serves nobody (Writer.rested)."""
        return self.paused_s + self.rested_s

    def stats(self) -> dict[str, float]:
        return {"writer_pauses": self.pauses, "writer_paused_ms": round(1000 * self.paused_s, 3),
                "writer_rests": self.rests, "writer_rested_ms": round(1000 * self.rested_s, 3)}


def never() -> None:
    """A pause() for threads with nobody to step aside for (tools, offline gc)."""
