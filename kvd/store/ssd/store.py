"""The SSD tier's facade: `SsdStore`, assembled from the rooms of this package.

Theory of operation
-------------------
Entries live as safetensors blobs under a data dir (blobfile.py; the small
ones together in one LMDB pack, pack.py), indexed by LMDB rows (index.py,
over lmdbenv.py). `SsdStore` is the policy that ties them, one mixin per
concern, each holding the state it owns (set in its `_init_*`):

  leases.py    a LOOKUP's leases, and the entries being evicted
  reads.py     the read path: lookups, blob reads (daemon thread)
  intake.py    put and spill: enqueue only (daemon thread)
  recency.py   hits, moved in the LRU order by the writer
  batch.py     the writer's batch: blobs, group sync, one commit
  budget.py    budget, eviction, degraded mode
  repair.py    quarantine, bad rows mended, the index healed
  upkeep.py    the writer's idle tick; rebuild -> walk -> reconcile
  admin.py     operator jobs (gc, evict, drop, verify), on the writer

This module holds what they share: the data dir and its lock, the index
and the pack, the totals, the counters, `_mu` and `_unlink_lock`, the
spill queue and its writer thread (spill.py); and `stats` and `close`.

Threads. The daemon thread calls get/contains/put/spill/tails/stats; it
only reads LMDB and files, and enqueues. The writer thread does every
mutation: writing blobs, committing and deleting rows, unlinking,
quarantining, flushing recency updates, reconciling. Admin calls (evict,
drop, reconcile) are submitted to the writer and waited for.

Why `contains` does not lie. An entry leaves this tier only by (a) LRU
eviction, (b) an explicit admin evict/drop, or (c) failing its checksum.
  * The queue serves entries until their row is committed (see spill).
  * Rows are deleted and committed *before* their blob is unlinked, and a
    reader looks the row up and opens the file under `_unlink_lock`, which
    the writer holds around each unlink. A reader that saw the row holds an
    open descriptor before the file can be unlinked, and POSIX keeps
    unlinked-but-open files readable: a race ends as a hit, never as a
    "row said yes, file said no". A packed blob (pack.py) is read without
    the lock; one found gone is a fault only if its row is still there, so
    the race ends as a miss of an entry that was just evicted -- never one
    a LOOKUP reported (the lease below keeps it).
  * LOOKUP and the GET that follows are separate requests. `lease(eid)`
    (taken by the tiered store *before* `contains` looks) protects the
    entry for `lease_s` seconds: LRU eviction skips leased entries (if only
    leased ones remain, the incoming spill is dropped instead, counted), and
    a leased entry evicted from RAM enters the queue even when it is full.
    The writer picks victims, then -- under `_mu`, the lock `lease` takes --
    drops any leased since and marks the rest `_evicting` until their rows
    are gone; `lease` refuses an entry being evicted. So a lease and an
    eviction are ordered: either the lease came first and the entry stays,
    or the eviction did and `contains` answers no. Only a yes keeps its
    lease: a no leased would keep the row its PUT writes next from
    eviction. A LOOKUP's batch looks first and leases what it found
    (`lease_found`), which is safe as long as no eviction began or ended in
    between (`eviction_events`); if one did, it leases first and looks
    again (and keeps those leases: a no cannot tell a lease it took from
    one another LOOKUP's yes holds).
  * What remains is (b), which is explicit, and (c), which no design can
    hide: both are counted.

Start-up. Open LMDB (clearing stale reader slots), read the totals row, and
serve. An index that is truncated, zeroed or not LMDB is moved aside and
rebuilt from the blobs on the writer thread, before reconcile (heal.py,
upkeep.py). Folders the tier writes in are made again if removed under it,
and a symlink in their place is moved aside, never written through
(datadir.ensure_folder).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import lmdb

from kvd.store.base import Entry, Store
from kvd.store.datadir import DataDirLock, blob_path, ensure_dirs
from kvd.store.ssd import blobfile, heal
from kvd.store.ssd.admin import Admin
from kvd.store.ssd.batch import Batch
from kvd.store.ssd.budget import DEFAULT_MIN_FREE, Budget
from kvd.store.ssd.index import DEFAULT_MAP_SIZE, Bounds, IndexBusy
from kvd.store.ssd.intake import Intake
from kvd.store.ssd.leases import Leases
from kvd.store.ssd.reads import Reads
from kvd.store.ssd.recency import Recency
from kvd.store.ssd.repair import Repair
from kvd.store.ssd.spill import SpillQueue, Writer
from kvd.store.ssd.upkeep import Upkeep

log = logging.getLogger("kvd.store.ssd")

_COUNTERS = (
    "hits", "touches_skipped", "misses", "queue_hits", "spills", "spill_bytes", "spills_clean", "duplicates",
    "evictions", "evicted_bytes", "dropped", "drops", "checksum_failures", "read_errors",
    "write_errors", "quarantined", "busy_misses", "orphans_removed", "temps_removed", "rows_repaired",
    "bad_rows", "index_errors", "read_transient", "files_replaced", "read_to_slots",
)


class SsdStore(Leases, Reads, Intake, Recency, Batch, Budget, Repair, Upkeep, Admin, Store):
    """A `Store` on a data dir. See the module docstring.

    `background=False` runs no writer thread: mutations then run inline in
    the caller (used by offline gc; `put` is not available that way), and an
    index rebuild (heal.py) is finished before the constructor returns.
    `rebuild="why"` moves the index aside and rebuilds it whatever its state
    (`kvd verify --repair`). `max_entry_bytes`: the largest message the
    daemon takes (None: no bound but the budget); with the budget, it bounds
    what a sane index row may say (index.Row.check).
    """

    name = "ssd"

    def __init__(
        self,
        root: str | os.PathLike,
        budget_bytes: int,
        *,
        min_free_bytes: int = DEFAULT_MIN_FREE,
        queue_bytes: int = 256 << 20,
        queue_entries: int | None = None,
        lease_s: float = 30.0,
        retry_s: float = 5.0,
        touch_flush_s: float = 1.0,
        map_size: int = DEFAULT_MAP_SIZE,
        pack_max_bytes: int = 64 << 10,
        durable: bool = True,
        full_fsync: bool | None = None,
        background: bool = True,
        reconcile: bool = True,
        rebuild: str | None = None,
        max_entry_bytes: int | None = None,
        clock: Callable[[], float] = time.time,
    ):
        if full_fsync is not None:  # the daemon's setting; offline commands leave the policy as it is
            blobfile.set_full_fsync(full_fsync)
        self.root = ensure_dirs(root)
        self._init_budget(budget_bytes, min_free_bytes, retry_s)
        self._init_leases(lease_s)
        self._init_recency(touch_flush_s)
        self._init_batch(pack_max_bytes, durable)
        self._init_reads()
        self._init_repair()
        self._clock = clock
        self.row_bounds = Bounds.of(budget_bytes, max_entry_bytes)
        self._lock_file = DataDirLock(self.root).acquire()
        try:
            self.index, self.heal = heal.open_index(self.root, map_size=map_size, rebuild=rebuild)
        except BaseException:
            self._lock_file.release()
            raise
        self.index.bounds = self.row_bounds
        try:
            self.pack = heal.open_pack(self.root, map_size=map_size)
        except BaseException:
            self.index.close()
            self._lock_file.release()
            raise
        with self.index.reading() as txn:
            self.entries, self.bytes = self.index.totals(txn)
        self.counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self.drop_reasons: dict[str, int] = {}
        # Told of every entry leaving the tier: (eid, namespace or None, what, why);
        # see kvd/server/evictions.py. Called on the writer or daemon thread.
        self.observer: Callable[[bytes, str | None, str, str], None] | None = None
        # Per-namespace SSD quotas (kvd/store/quota.py), checked before a write.
        self.quotas: Any = None
        self.unpersisted = 0  # entries close() had to leave unwritten
        self._mu = threading.Lock()  # counters, _touched, _bad, _leases
        self._unlink_lock = threading.Lock()  # see "Why contains does not lie"
        self.queue = SpillQueue(queue_bytes, queue_entries)
        self._init_upkeep(reconcile)
        self.writer = Writer(self.queue, self)
        if background:
            self.writer.start()
        else:
            self._finish_rebuild()  # offline: nothing may look at the index before

    def count(self, name: str, n: int = 1) -> None:
        """Add `n` to one of this tier's counters (`stats()["counters"]`)."""
        self._count(name, n)

    def _count(self, name: str, n: int = 1) -> None:
        with self._mu:
            self.counters[name] += n

    def _drop(self, entry: Entry, reason: str) -> None:
        with self._mu:
            self.counters["drops"] += 1
            self.drop_reasons[reason] = self.drop_reasons.get(reason, 0) + 1
        if self.observer is not None:
            self.observer(entry.id, entry.namespace, "dropped", reason)

    def path(self, eid: bytes) -> Path:
        return blob_path(self.root, eid)

    # -- reporting -------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._mu:
            counters = dict(self.counters)
            reasons = dict(self.drop_reasons)
        try:
            with self.index.reading() as txn:
                namespaces = self.index.namespaces(txn)
        except IndexBusy:
            namespaces = {}
        except (lmdb.Error, ValueError, TypeError) as exc:  # garbage in the ns records
            self._index_error(exc)
            namespaces = {}
        return {
            "tiers": {
                self.name: {
                    "entries": self.entries,
                    "bytes": self.bytes,
                    "budget_bytes": self.budget_bytes,
                    **counters,
                    "drop_reasons": reasons,
                    "degraded": self.degraded is not None,
                    "degraded_reason": self.degraded,
                    "degraded_since": self.degraded_since,
                    "queue_entries": len(self.queue),
                    "queue_bytes": self.queue.bytes,
                    "queue_max_bytes": self.queue.max_bytes,
                    "queue_max_entries": self.queue.max_entries,
                    "writer_abandoned": self.writer.abandoned,
                    "reconciled": self.reconciled.is_set(),
                    "index_rebuild": self.heal.stats() if self.heal else None,
                    "index_map_size": self.index.map_size,
                    "pack_max_bytes": self.pack_max_bytes,
                    "pack_file_bytes": self.pack.file_bytes(),
                    "data_dir": str(self.root),
                }
            },
            "namespaces": dict(sorted(namespaces.items())),
        }

    def close(self, timeout: float | None = None) -> None:
        """Write out the queue, stop the writer, close the index, release the lock.

        With `timeout`, writing stops after that many seconds: the batch in
        hand commits what it has written, the rest is logged as not
        persisted (counted in `unpersisted`) and lost."""
        self.unpersisted = 0
        if self.writer.alive:
            # The whole of it within `timeout`: writing gets most, and the
            # batch in hand what is left to finish (commit what it wrote).
            deadline = None if timeout is None else time.monotonic() + timeout
            if not self.writer.flush(None if timeout is None else timeout - min(1.0, 0.2 * timeout)):
                self.writes_stopped = True
            self.writer.stop(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            if self.writer.alive:
                # Still inside one write (a slow disk): leave the index to the
                # process exit rather than close it under the writer; LMDB and
                # the blob protocol are crash-safe, the lock dies with us.
                log.error("ssd: the writer did not stop in time; exiting without closing the index")
                return
            left = self.abandoned + self.queue.pending_where(lambda e: True)
            if left:
                self.unpersisted = len(left)
                log.warning(
                    "stop: %d entries (%d bytes) not persisted: stop_timeout reached before they were written",
                    len(left), sum(e.nbytes for e in left),
                )
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        try:
            self._flush_touches()
        except lmdb.Error as exc:  # a full disk: recency updates are lost, nothing else; still a clean stop
            log.warning("ssd: could not record recent hits at stop (%s)", exc)
        finally:
            self.index.close()
            self.pack.close(clean=True)  # the writer has stopped: nothing more is coming
            heal.clear_start(self.root)  # a clean stop is not a start that died
            self._lock_file.release()

    def __enter__(self) -> "SsdStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
