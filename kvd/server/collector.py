"""The cyclic garbage collector, run on the daemon's tick instead of at random.

CPython's collector runs whenever allocations outnumber frees by 700, on
whichever thread allocates, and every so often scans *every* tracked object.
The RAM tier holds ~5 tracked objects per entry (the entry, its tensors and
their buffers): 100 k small entries make a full scan ~130 ms, and while PUTs
fill the tier scans of the young objects alone took 1-5 ms, several a
second (`bench/bench_stress.py --only put-storm`); every client waited through
them. None of those objects is ever part of a cycle: they are freed
by reference counting the moment the tier lets them go.

So `kvd serve` turns automatic collection off and, on each tick (0.1 s),
collects what is young -- objects made since the last tick -- then freezes the
survivors (`gc.freeze`: moved where no collection looks). The scan per tick
is as long as the tick's new objects, never the tier's. A frozen object that
later becomes part of a garbage cycle is found only by a full collection; those
run every `full_every_s` (10 minutes), and the interval doubles each time one
finds nothing (up to a day), back to 10 minutes when one does. `kvd stats`
shows the counts and the last full scan's duration; its count of frozen
objects is the last full scan's (counting them walks them all).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any, Callable

log = logging.getLogger("kvd.server")


class Collector:
    def __init__(self, full_every_s: float = 600.0, longest_s: float = 86400.0,
                 clock: Callable[[], float] = time.monotonic):
        self.full_every_s, self.longest_s, self.clock = full_every_s, longest_s, clock
        self.interval = full_every_s
        self.next_full = 0.0
        self.running = False
        self.young = self.fulls = 0  # collections run
        self.young_found = self.full_found = 0  # objects they freed
        self.last_full_ms = 0.0
        # Frozen objects, counted where everything is scanned anyway (start,
        # full): gc.get_freeze_count() walks them all, ~7 ms a million, too
        # long for every STATS and scrape.
        self.frozen = 0

    def start(self) -> None:
        """Collection on our ticks from now on; what start-up made is frozen."""
        gc.disable()
        gc.collect()
        gc.freeze()
        self.frozen = gc.get_freeze_count()
        self.running = True
        self.next_full = self.clock() + self.interval

    def tick(self) -> None:
        if not self.running:
            return
        found = gc.collect(1)  # only generations 0 and 1: what was made since the last tick
        gc.freeze()
        self.young += 1
        self.young_found += found
        if self.clock() >= self.next_full:
            self.full()

    def full(self) -> int:
        """Scan everything, frozen objects too; returns the objects freed."""
        started = time.perf_counter()
        gc.unfreeze()
        found = gc.collect()
        gc.freeze()
        self.frozen = gc.get_freeze_count()
        self.last_full_ms = 1000 * (time.perf_counter() - started)
        self.fulls += 1
        self.full_found += found
        if found:
            self.interval = self.full_every_s
            log.info("gc: a full collection freed %d objects in cycles (%.0f ms); the next in %.0f s",
                     found, self.last_full_ms, self.interval)
        else:
            self.interval = min(2 * self.interval, self.longest_s)
        self.next_full = self.clock() + self.interval
        return found

    def stats(self) -> dict[str, Any]:
        return {
            "running": self.running,
            "frozen": self.frozen,  # at start-up or the last full collection
            "young_collections": self.young,
            "young_freed": self.young_found,
            "full_collections": self.fulls,
            "full_freed": self.full_found,
            "last_full_ms": round(self.last_full_ms, 3),
            "next_full_s": round(max(0.0, self.next_full - self.clock()), 1) if self.running else None,
        }
