"""Budget, eviction and degraded mode: what the SSD tier may write, and when.

Theory of operation
-------------------
Budget. `budget_bytes` counts blocks actually allocated to blobs
(st_blocks), estimated before a write and corrected after it; LRU rows are
evicted before a write would exceed it (`_make_room`). `min_free_bytes`
keeps space free on the filesystem for everyone else: below it the tier
writes nothing (`_space_ok`).

Eviction. Victims are the oldest rows not leased (leases.py); under `_mu`
any leased meanwhile stop the eviction, the rest are marked being evicted
until their rows are gone, so a LOOKUP's lease and an eviction are ordered
(store.py, "Why `contains` does not lie"). Rows are deleted and committed
*before* their blobs are unlinked, each unlink under `_unlink_lock`
(`_remove`).

Degraded mode. A disk error (`DISK_ERRNOS`: ENOSPC, EDQUOT, EIO, EROFS,
EFBIG) while writing, or free space below `min_free_bytes`, puts the tier
in degraded mode (`_degrade`: logged once, flagged in stats): queued spills
are dropped, counted, while reads from disk and the RAM tier go on. Every
`retry_s` one write is attempted; success clears it. A failed write removes
its temp file, so nothing on disk is harmed. Any other OSError (a shard
directory replaced by a file, a permission changed by hand) concerns one
path: that entry is dropped and counted, logged once per errno, and the
tier goes on -- unless the same errno comes from PATH_ERRORS_DEGRADE writes
in a row, which is no longer one path (batch.py). The tier recovers
(`_recover`) only after a batch committed something without a new error
(an entry encoded in memory proves nothing about the disk). The same disk
errors met elsewhere degrade too: reading a blob (a miss; the blob is
kept, it may be intact), recording hits, an admin job's writes (answered
Busy).

Threads: all of it runs on the writer, but `_degrade` (a read may call it).
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import lmdb

from kvd.store.ssd.pack import PACKED, pack_key

log = logging.getLogger("kvd.store.ssd")

DEFAULT_MIN_FREE = 2 << 30
# Errors that mean "the disk cannot take writes now", as opposed to a bug.
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG}


class Budget:
    """Room on disk: the budget, evictions, degraded mode; mixed into `SsdStore`."""

    def _init_budget(self, budget_bytes: int, min_free_bytes: int, retry_s: float) -> None:
        self.budget_bytes = int(budget_bytes)
        self.min_free_bytes = int(min_free_bytes)
        self.retry_s = retry_s
        self.degraded: str | None = None
        self.degraded_since: float | None = None
        self._retry_at = 0.0
        self._degrades = 0  # _degrade calls: a batch that made one does not also recover

    def _space_ok(self, need: int) -> bool:
        if self.min_free_bytes <= 0:
            return True
        try:
            st = os.statvfs(self.root)
        except OSError:
            return True
        free = st.f_bavail * st.f_frsize
        if free - need >= self.min_free_bytes:
            return True
        self._degrade(f"low space: {free >> 20} MiB free, keeping {self.min_free_bytes >> 20} MiB")
        return False

    def _degrade(self, reason: str) -> None:
        self._degrades += 1
        self._retry_at = self._clock() + self.retry_s
        if self.degraded is None:
            self.degraded_since = self._clock()
            log.warning("ssd tier degraded (%s); RAM keeps serving, retrying every %.1fs", reason, self.retry_s)
        self.degraded = reason

    def _recover(self) -> None:
        if self.degraded is not None:
            log.warning("ssd tier recovered after %.1fs (%s)", self._clock() - (self.degraded_since or 0), self.degraded)
            self.degraded = self.degraded_since = None

    def _make_room(self, need: int, protect: set[bytes]) -> bool:
        """Evict LRU rows until `need` more bytes fit the budget. False (and
        nothing evicted) if only leased/protected entries stand in the way."""
        over = self.bytes + need - self.budget_bytes
        if over <= 0:
            return True
        victims, freed = self._victims(over, protect)
        if self.record_hits_on(victims):
            victims, freed = self._victims(over, protect)
        if freed < over:
            return False
        with self._mu:  # ordered against lease(): see the module docstring
            if any(self.leased(eid) for eid in victims):
                return False  # a LOOKUP just reported one: leave them all this time
            self._mark_evicting(victims)
        try:
            self._remove(victims, "evictions", "budget")
        finally:
            self._unmark_evicting(victims)
        return True

    def _victims(self, over: int, protect: set[bytes]) -> tuple[list[bytes], int]:
        """The oldest rows, not leased nor in `protect`, whose bytes reach `over`."""
        victims, freed = [], 0
        with self.index.reading() as txn:
            for _, eid in self.index.oldest(txn):
                if eid in protect or self.leased(eid):
                    continue
                row = self.index.get(txn, eid)
                victims.append(eid)
                freed += row.disk_bytes
                if freed >= over:
                    break
        return victims, freed

    def evict_rows(self, victims: list[bytes], why: str) -> tuple[int, int]:
        """Writer thread: evict these rows, except any leased meanwhile
        (ordered against `lease` as in `_make_room`). Returns (entries, bytes)."""
        with self._mu:
            victims = [eid for eid in victims if not self.leased(eid)]
            self._mark_evicting(victims)
        try:
            return self._remove(victims, "evictions", why)
        finally:
            self._unmark_evicting(victims)

    def _remove(self, eids: list[bytes], counter: str, why: str = "gc") -> tuple[int, int]:
        """Delete rows (committed first), then unlink their blobs."""
        def delete(txn):
            rows = [(eid, self.index.delete_row(txn, eid)) for eid in eids]
            return [(e, r) for e, r in rows if r is not None], self.index.totals(txn)

        rows, totals = self.index.write(delete)
        self.entries, self.bytes = totals
        if self.quotas is not None:
            self.quotas.reset_failures()  # room made: a group that had none may have some
        packed = []
        for eid, row in rows:
            if row.state == PACKED:
                packed.append(pack_key(eid, row.slot))
                continue
            with self._unlink_lock:
                self._unlink(self.path(eid))
        if packed:
            try:  # no _unlink_lock: readers of packed blobs need none (_read_packed)
                self.pack.delete_many(packed)
            except lmdb.Error as exc:  # their rows are gone: orphans, which reconcile removes
                self.pack.orphan_free = False
                log.warning("ssd: could not delete %d packed blobs (%s)", len(packed), exc)
        nbytes = sum(r.disk_bytes for _, r in rows)
        with self._mu:
            self.counters[counter] += len(rows)
            if counter == "evictions":
                self.counters["evicted_bytes"] += nbytes
        if self.observer is not None:
            for eid, row in rows:
                self.observer(eid, row.ns, "evicted" if counter == "evictions" else "dropped", why)
        return len(rows), nbytes

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
