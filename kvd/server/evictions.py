"""A bounded record of recent evictions, so a miss can say what happened.

Theory of operation
-------------------
Every time an entry leaves a tier -- RAM evicts it (spilling it to SSD, or
dropping it when there is no SSD tier), the SSD tier evicts it, a spill
never reaches disk (queue full, degraded disk), an admin GC drops it, or a
checksum failure quarantines it -- the tier calls its `observer`, and this
record notes *what* happened to *which entry*, *when*, in *which tier* and
*why*. `kvd explain` looks up the first chunk of a sequence the daemon no
longer holds here; `kvd top` and STATS show the newest events and counts.

The record is bounded: it keeps the latest event of at most `capacity`
entries (16,384 by default, about 3 MiB), oldest forgotten first, and a
counter per (tier, what, why) that is never forgotten. An entry's later
event replaces its earlier one (RAM spills a chunk, then the SSD tier evicts
it: the record says "evicted from ssd").

`what` is one of:
    spilled      RAM let go of it; the SSD tier took it (not a loss)
    evicted      gone from the tier (RAM-only daemon, or the SSD tier)
    dropped      a spill the SSD tier did not write, or an admin GC drop
    quarantined  its blob failed its checksum (or vanished) on read

`why` is the tier's reason: lru (RAM over budget), pressure (RAM yielding
to memory pressure), quota (its namespace over quota), budget (SSD over
budget), gc (an admin request), shutdown, queue_full, degraded, low_space,
too_big, write_error, corrupt, missing, ... (free-form, short).

Threads: RAM calls in on the daemon thread, the SSD tier on its writer
thread; a lock orders them. A note costs one dict insertion.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Callable

from kvd.store.base import Entry

DEFAULT_CAPACITY = 16384


@dataclass(frozen=True, slots=True)
class Eviction:
    """What last happened to one entry."""

    namespace: str  # "" when the tier could not tell (a blob that vanished)
    tier: str  # "ram" | "ssd"
    what: str  # spilled | evicted | dropped | quarantined
    why: str
    when: float  # wall-clock seconds

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class EvictionRecord:
    """The newest event per entry id, for at most `capacity` entries."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, clock: Callable[[], float] = time.time):
        self.capacity = capacity
        self._clock = clock
        self._mu = threading.Lock()
        self._events: OrderedDict[bytes, Eviction] = OrderedDict()
        self.counts: Counter[tuple[str, str, str]] = Counter()

    def note(self, eid: bytes, namespace: str | None, tier: str, what: str, why: str) -> None:
        ev = Eviction(namespace or "", tier, what, why, self._clock())
        with self._mu:
            self._events.pop(eid, None)
            self._events[eid] = ev
            if len(self._events) > self.capacity:
                self._events.popitem(last=False)
            self.counts[(tier, what, why)] += 1

    def get(self, eid: bytes) -> Eviction | None:
        with self._mu:
            return self._events.get(eid)

    def recent(self, n: int = 10) -> list[dict[str, Any]]:
        """The `n` newest events, newest first."""
        with self._mu:
            items = list(self._events.values())[-n:]
        return [ev.as_dict() for ev in reversed(items)]

    def stats(self, recent: int = 10) -> dict[str, Any]:
        with self._mu:
            counts = {" ".join(k): v for k, v in sorted(self.counts.items())}
            held = len(self._events)
        return {"recorded": held, "capacity": self.capacity, "counts": counts, "recent": self.recent(recent)}

    # -- wiring ---------------------------------------------------------------
    def attach(self, store: Any) -> None:
        """Become the eviction observer of `store`'s tiers (a RamStore, an
        SsdStore, or a TieredStore of both). Unknown stores are left alone."""
        ram = getattr(store, "ram", None)
        ssd = getattr(store, "ssd", None)
        if ram is None and hasattr(store, "observer") and getattr(store, "name", "") == "ram":
            ram = store
        if ram is not None:
            lost = "spilled" if ssd is not None else "evicted"

            def on_ram(entry: Entry, why: str) -> None:
                if why == "drop":  # RamStore.drop: an admin GC of a namespace or of old entries
                    self.note(entry.id, entry.namespace, "ram", "dropped", "gc")
                else:
                    self.note(entry.id, entry.namespace, "ram", lost, why)

            ram.observer = on_ram
        if ssd is not None:
            ssd.observer = lambda eid, ns, what, why: self.note(eid, ns, "ssd", what, why)
