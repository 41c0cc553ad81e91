"""Intake: what the daemon thread hands the SSD tier to write.

`put` (a PUT written through, or one too big for RAM) and `spill` (an entry
evicted from RAM) only look and enqueue, on the daemon thread: an entry
already on disk costs a recency update (recency.py), anything else goes
into the spill queue (spill.py) for the writer (batch.py), or is dropped,
counted, when the queue is full -- unless a lease or `force` says it must
be kept, then it is queued past the queue's bounds.
"""

from __future__ import annotations

from kvd.store.base import BOUNDARY, Entry, PutOutcome
from kvd.store.ssd import blobfile


class Intake:
    """`put` and `spill`: enqueue only (daemon thread); mixed into `SsdStore`."""

    def put(self, entry: Entry, *, force: bool = False) -> PutOutcome:
        """Queue `entry` for writing. DUPLICATE if held (recency refreshed);
        TOO_BIG if over the whole budget; DROPPED (counted) if the queue is
        full (`force`: it takes it regardless)."""
        eid = entry.id
        held, row = (False, None) if eid in self.queue or eid in self._bad else self._committed_row(eid)
        if held or eid in self.queue:  # (asked again: the writer may have taken it meanwhile)
            self._count("duplicates")
            self._hit(eid, row)
            return PutOutcome.DUPLICATE
        if blobfile.estimate_disk_bytes(entry) > self.budget_bytes:
            self._drop(entry, "too_big")
            return PutOutcome.TOO_BIG
        if not self.spill(entry, force=force):
            return PutOutcome.DROPPED
        return PutOutcome.STORED

    def spill(self, entry: Entry, *, force: bool = False) -> bool:
        """Hand an entry evicted from RAM (or too big for it) to this tier.
        True if it is (or will be) held; False if dropped (counted). `force`
        queues it past the queue's bounds instead of waiting for room."""
        eid = entry.id
        if entry.kind == BOUNDARY:
            self.boundary_ns.add(entry.namespace)
        held, row = (False, None) if eid in self._bad else self._committed_row(eid)
        if held:
            # Already on disk (promoted earlier, or written through): a clean
            # eviction costs one recency update, no write.
            self._count("spills_clean")
            self._hit(eid, row)
            return True
        force = force or self.leased(eid)
        if self.queue.offer(entry, force=force, outside=True):
            return True
        self._drop(entry, "queue_full")
        return False
