"""The SSD tier: entries as safetensors blobs under a data dir, indexed by LMDB.

Theory of operation
-------------------
Three parts, each in its own module: `blobfile` (one entry <-> one file,
crash-safe write, checked read), `index` (LMDB rows: what is on disk, in
what recency order), `spill` (the bounded queue and the single writer
thread). This module is the policy that ties them: budgets, eviction,
degradation, quarantine, reconcile, and the read path.

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

Budget. `budget_bytes` counts blocks actually allocated to blobs
(st_blocks), estimated before a write and corrected after it; LRU rows are
evicted before a write would exceed it. `min_free_bytes` keeps space free
on the filesystem for everyone else: below it the tier writes nothing.

Degraded mode. A disk error (`DISK_ERRNOS`: ENOSPC, EDQUOT, EIO, EROFS,
EFBIG) while writing, or free space below
`min_free_bytes`, puts the tier in degraded mode (logged once, flagged in
stats): queued spills are dropped, counted, while reads from disk and the
RAM tier go on. Every `retry_s` one write is attempted; success clears it.
A failed write removes its temp file, so nothing on disk is harmed. Any
other OSError (a shard directory replaced by a file, a permission changed by
hand) concerns one path: that entry is dropped and counted, logged once per
errno, and the tier goes on -- unless the same errno comes from
PATH_ERRORS_DEGRADE writes in a row, which is no longer one path. The tier
recovers only after a batch committed something without a new error (an
entry encoded in memory proves nothing about the disk). The same disk
errors met elsewhere degrade too: reading a blob (a miss; the blob is kept,
it may be intact), recording hits, an admin job's writes (answered Busy).
A blob read that fails for any other reason (the name is a FIFO, a folder,
a symlink; a shard folder became a file) hides and quarantines the entry.
Folders the tier writes in are made again if removed under it, and a
symlink in their place is moved aside, never written through
(datadir.ensure_folder).

Durability. The writer writes a batch's blobs, fsyncs them and their folders
together (group sync, blobfile.sync_group), then commits all their rows in
one synced LMDB transaction; only then does it tell `on_settled` which
entries are durable (the daemon answers write-through PUTs from that). A
commit into an index or pack whose file was removed or replaced under the
daemon is durable nowhere: before settling, one stat each says whether the
files at their paths are still the ones mapped (Env.file_fault); if not,
the batch is reported not durable, the tier degrades, and the pack is
replaced at once, the index healed (rebuilt from the blobs). The writer's
tick looks too, so a file cut short is replaced before most readers meet
the missing pages (a SIGBUS; a read in the meantime still meets it). A
blob whose fsync fails is removed and dropped, never indexed. `close(timeout)`
stops writing at its deadline: the batch in hand commits what is already
written, and the rest is counted (`unpersisted`) and logged in one line.
Once the index outgrows the page cache, each random insert would wait for
a disk read of its own, one after another: so while batches cause page
faults that wait for the disk, a batch has its index pages read in first
by helper threads, several at a time (`Env.prefetch`). (The pack's inserts
append at its right edge, pack.py: none of its pages wait to be read.)

Recency. A disk hit records (eid, time) in memory, so the daemon thread
never waits for an LMDB write; the writer moves them in the LRU order in
the next batch's index commit (one synced commit for both), on their own
every `touch_flush_s` when no batch carried them, and before choosing
victims if one of them was read. A use of a row among the tier's youngest
(its last use within the newest quarter of the span from the oldest row's
to now) is not recorded at all (`_hit`): each move rewrites two random
index pages, and rows that far from eviction need none.

Start-up. Open LMDB (clearing stale reader slots), read the totals row, and
serve. An index that is truncated, zeroed or not LMDB is moved aside and
rebuilt from the blobs on the writer thread, before reconcile (heal.py).
A row whose bytes do not decode is a miss; the writer drops it and every
trace of it (`Index.drop_damaged`, with every other row found bad so far:
one scan of the index for all of them), then reads the blob: one that
passes its own checksum (kvd_sum) gets its row back from what it carries
(counted in `rows_repaired`, served again at once), any other is
quarantined. Damage
LMDB itself reports is a heal (heal.py): what was hidden for a bad row then
is forgotten, since the rebuild checks every blob anyway. Reconcile --
removing leftover temp files, blobs without rows (a crash between rename
and commit) and rows without blobs -- runs on the writer thread in small
steps, interleaved with spills.
"""

from __future__ import annotations

import errno
import itertools
import logging
import operator
import os
import resource
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import lmdb

from kvd.protocol.errors import Busy
from kvd.store import blobfile, heal
from kvd.store.base import BOUNDARY, Entry, PutOutcome, Store
from kvd.store.blobfile import BlobCorrupt, Unencodable
from kvd.store.datadir import (
    BLOB_DIR,
    INDEX_DIR,
    QUARANTINE_DIR,
    DataDirLock,
    blob_path,
    eid_of_blob,
    ensure_dirs,
    ensure_blob_dirs,
    ensure_folder,
    ensure_quarantine,
)
from kvd.store.index import DEFAULT_MAP_SIZE, Index, IndexBusy, Row, RowDamaged
from kvd.store.pack import PACKED, pack_key, packed_disk_bytes, slot_of
from kvd.store.pools import OrInline
from kvd.store.reconcile import reconcile_steps
from kvd.store.spill import SpillQueue, Writer

log = logging.getLogger("kvd.store.ssd")

DEFAULT_MIN_FREE = 2 << 30
# Errors that mean "the disk cannot take writes now", as opposed to a bug.
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG}
# The process's or the host's, for a moment (no fd free, no memory): a read
# failing so says nothing of the blob, which stays where it is.
TRANSIENT_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR, errno.ENOBUFS}
# Blob writes failing one after another with the same other errno (ENOENT,
# EACCES, ...): past this many it is the folder or the disk, not one path.
PATH_ERRORS_DEGRADE = 3
YOUNG_SHARE = 0.25  # a use of a row this young (a share of the tier's age) does not move it (`_hit`)
FILE_CHECK_S = 0.1  # how often the writer looks at the index's and the pack's files (Env.file_fault)

_COUNTERS = (
    "hits", "touches_skipped", "misses", "queue_hits", "spills", "spill_bytes", "spills_clean", "duplicates",
    "evictions", "evicted_bytes", "dropped", "drops", "checksum_failures", "read_errors",
    "write_errors", "quarantined", "busy_misses", "orphans_removed", "temps_removed", "rows_repaired",
    "bad_rows", "index_errors", "read_transient",
)


class SsdStore(Store):
    """A `Store` on a data dir. See the module docstring.

    `background=False` runs no writer thread: mutations then run inline in
    the caller (used by offline gc; `put` is not available that way), and an
    index rebuild (heal.py) is finished before the constructor returns.
    `rebuild="why"` moves the index aside and rebuilds it whatever its state
    (`kvd verify --repair`).
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
        background: bool = True,
        reconcile: bool = True,
        rebuild: str | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.root = ensure_dirs(root)
        self.budget_bytes = int(budget_bytes)
        self.min_free_bytes = int(min_free_bytes)
        self.lease_s = lease_s
        self.retry_s = retry_s
        self.touch_flush_s = touch_flush_s
        self.durable = durable
        self.pack_max_bytes = int(pack_max_bytes)  # blobs up to this size go to the pack (pack.py)
        self._packing: dict[bytes, bytes] = {}  # writer thread: a batch's packed blobs, until synced
        # Where reads land: a callable (size -> writable buffer, or None for a
        # bytearray). The shared-memory plane sets it (kvd/server/shm_setup.py).
        self.read_buffers: Any = None
        self._clock = clock
        self._lock_file = DataDirLock(self.root).acquire()
        try:
            self.index, self.heal = heal.open_index(self.root, map_size=map_size, rebuild=rebuild)
        except BaseException:
            self._lock_file.release()
            raise
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
        # Told after every batch which of its entries are now durable
        # ((eid, True)) or were dropped ((eid, False)), with the degraded
        # reason if any; called on the writer thread (spill.py, ordering rule).
        self.on_settled: Callable[[list[tuple[bytes, bool]], str | None], None] | None = None
        self.writes_stopped = False  # close() ran out of time: write nothing more
        self.abandoned: list[Entry] = []  # entries a stopped writer left unwritten
        self.unpersisted = 0  # entries close() had to leave unwritten
        self._pool: OrInline | None = None  # the writer's helper threads (_threads)
        self.prefetching = False  # read a batch's pages in ahead (write_batch)
        self.major_faults: Callable[[], int] = _major_faults
        self._mu = threading.Lock()  # counters, _touched, _bad, _leases
        self._unlink_lock = threading.Lock()  # see "Why contains does not lie"
        self._touched: dict[bytes, float] = {}
        self._riding: dict[bytes, float] = {}  # writer: hits taken to ride in the batch's index commit
        self._errnos_logged: set[int | None] = set()
        self._bad: dict[bytes, str] = {}  # eid -> reason, awaiting quarantine
        self._bad_rows_told = False  # a bad row was logged since the last sweep (_repair_rows sums up the rest)
        self._leases: dict[bytes, float] = {}
        self._evicting: set[bytes] = set()  # victims whose rows are being deleted
        # Evictions begun or ended so far (each counts twice): unchanged across a
        # LOOKUP's look, no row can have gone in between (TieredStore.held).
        self.eviction_events = 0
        self._lease_sweep_at = 4096
        self._next_touch_flush = 0.0
        self.recency_floor: float | None = None  # the oldest row's last use, as the writer last saw it (`_hit`)
        self._next_file_check = 0.0
        self.degraded: str | None = None
        self.degraded_since: float | None = None
        self._retry_at = 0.0
        self._degrades = 0  # _degrade calls: a batch that made one does not also recover
        self._path_errors: tuple[int | None, int] = (None, 0)  # one errno, how many writes in a row
        self._unsettled: set[bytes] = set()  # of the batch in hand: committed, yet not durable (_check_files)
        self.queue = SpillQueue(queue_bytes, queue_entries)
        # Namespaces with a boundary entry here (queued or indexed): complete
        # once a walk of the whole index has listed those on disk
        # (`boundaries_known`, see boundary_free); never shrinks.
        self.boundary_ns: set[str] = set()
        self.boundaries_known = False
        self.reconciled = threading.Event()
        # A rebuild runs before reconcile: until it is done, blobs without
        # rows are entries not yet indexed, not orphans.
        self._rebuild: Iterator[None] | None = heal.rebuild_steps(self, self.heal) if self.heal else None
        # Then one walk over every page of the index (heal.walk_steps), then reconcile.
        self._walk: Iterator[None] | None = heal.walk_steps(self) if reconcile else None
        self._reconcile: Iterator[None] | None = self._reconcile_steps({}) if reconcile else None
        self._heal_wanted: str | None = None  # damage found while running: heal on the writer
        if not reconcile and self._rebuild is None:
            self.reconciled.set()
        self.writer = Writer(self.queue, self)
        if background:
            self.writer.start()
        else:
            self._finish_rebuild()  # offline: nothing may look at the index before

    # -- small helpers -----------------------------------------------------
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

    def lease(self, eid: bytes) -> bool:
        """Protect `eid` from LRU eviction for `lease_s` seconds (a LOOKUP is
        about to report it). False if it is being evicted right now: then it
        must be reported absent."""
        now = self._clock()
        with self._mu:
            if eid in self._evicting:
                return False
            self._leases[eid] = now + self.lease_s
            self._sweep_leases(now)
        return True

    def _sweep_leases(self, now: float) -> None:
        """Under `_mu`: drop expired leases once there are twice as many as
        after the last sweep (amortized O(1) per lease taken)."""
        if len(self._leases) > self._lease_sweep_at:
            self._leases = {k: t for k, t in self._leases.items() if t > now}
            self._lease_sweep_at = max(4096, 2 * len(self._leases))

    def leased(self, eid: bytes) -> bool:
        t = self._leases.get(eid)
        return t is not None and t > self._clock()

    # -- lookups (daemon thread) -----------------------------------------
    def contains(self, eid: bytes) -> bool:
        if eid in self.queue:
            return True
        return eid not in self._bad and self.has_row(eid)

    def held(self, eids: Sequence[bytes], also: Sequence[bool] | None = None) -> list[bool]:
        """`contains` for each of `eids`, from one read transaction; where
        `also` (known elsewhere, e.g. in RAM) is true, without asking.

        One exact descent per id, in a comprehension: for the 256 ids of a
        32k-token LOOKUP ~35 us at 10 k rows, ~50 us at 1 M. (Answering a
        chunk and its boundary with one descent and a step, as this once did,
        saves B-tree walks but costs more Python than it saves at any size.)"""
        out, bad = self.queue.held(eids), self._bad
        if also is not None:
            out = list(map(operator.or_, out, also))
        try:
            with self.index.reading() as txn:
                exact = txn.cursor(db=self.index.rows).set_key
                if bad:
                    return [have or (eid not in bad and exact(eid)) for have, eid in zip(out, eids)]
                return [have or exact(eid) for have, eid in zip(out, eids)]
        except IndexBusy:
            return out
        except lmdb.Error as exc:  # a damaged page: as in `contains`, a miss (and a heal)
            self._index_error(exc)
            return out

    def lease_many(self, eids: Sequence[bytes]) -> list[bool]:
        """`lease` for each of `eids`, under one lock."""
        now = self._clock()
        until = now + self.lease_s
        with self._mu:
            evicting = self._evicting
            if evicting:
                out = [eid not in evicting for eid in eids]
                self._leases.update((eid, until) for eid, ok in zip(eids, out) if ok)
            else:  # the usual case, at C speed: a LOOKUP of 32k tokens leases 256 ids
                out = [True] * len(eids)
                self._leases.update(dict.fromkeys(eids, until))
            self._sweep_leases(now)
        return out

    def lease_found(self, eids: Sequence[bytes], found: list[bool], since: int) -> bool:
        """Lease those of `eids` that `found` says are held, if no eviction
        began or ended since `since` (`eviction_events` read before they were
        looked up): then none of them can have gone in between, and the
        victims of one still in progress are answered no (`found` is changed
        in place). False, with nothing leased, otherwise: look again, lease
        first (TieredStore.held)."""
        until = self._clock() + self.lease_s
        with self._mu:
            if self.eviction_events != since:
                return False
            if self._evicting:
                evicting = self._evicting
                found[:] = [ok and eid not in evicting for eid, ok in zip(eids, found)]
            self._leases.update(dict.fromkeys(itertools.compress(eids, found), until))
            self._sweep_leases(until - self.lease_s)
        return True

    def has_row(self, eid: bytes) -> bool:
        """Whether a committed blob exists for `eid` (ignores the queue)."""
        try:
            with self.index.reading() as txn:
                return self.index.has(txn, eid)
        except IndexBusy:
            return False
        except lmdb.Error as exc:
            self._index_error(exc)
            return False

    def with_rows(self, eids: Iterable[bytes]) -> set[bytes]:
        """Those of `eids` with a committed blob, in one read transaction."""
        try:
            with self.index.reading() as txn:
                return {eid for eid in eids if self.index.has(txn, eid)}
        except IndexBusy:
            return set()
        except lmdb.Error as exc:
            self._index_error(exc)
            return set()

    def get(self, eid: bytes) -> Entry | None:
        entry = self.queue.get(eid)
        if entry is not None:
            self._count("hits")
            self._count("queue_hits")
            return entry
        found = self._read(eid)
        if found is None:
            self._count("misses")
            return None
        entry, row = found
        self._count("hits")
        self._hit(eid, row)
        return entry

    def _committed_row(self, eid: bytes) -> tuple[bool, Row | None]:
        """Whether `eid` has a committed row, and the row (None if it does not decode)."""
        try:
            with self.index.reading() as txn:
                row = self.index.get(txn, eid)
            return row is not None, row
        except IndexBusy:
            return False, None
        except RowDamaged:
            return True, None
        except lmdb.Error as exc:
            self._index_error(exc)
            return False, None

    def _hit(self, eid: bytes, row: Row | None) -> None:
        """A use of `eid` (a disk hit, a clean spill, a duplicate PUT; `row`
        its row, None if it has none yet): remembered for the writer to move
        in the recency order -- unless the row is among the tier's youngest
        already, its last use within the newest `YOUNG_SHARE` of the span
        from the oldest row's to now (counted `touches_skipped`). Recency is
        then exact to that share of the tier's age, and the writer is spared
        rewriting rows that are nowhere near eviction: under 8 clients'
        mixed load at 1 M rows, moving every hit's row took 52 s of the
        writer's 68 (two random index pages each), and its pace is what
        PUTs are admitted at. Rows of a group with an SSD quota are always
        moved: the group evicts its own oldest, and the tier's age says
        nothing of the group's."""
        now = self._clock()
        floor = self.recency_floor
        if (row is not None and floor is not None and row.atime >= now - (now - floor) * YOUNG_SHARE
                and not self._quota_on(row.ns)):
            self._count("touches_skipped")
            return
        with self._mu:
            self._touched[eid] = now

    def _quota_on(self, ns: str) -> bool:
        """Whether namespace `ns` is in a group with an SSD quota."""
        if self.quotas is None:
            return False
        rule = self.quotas.rule_for(ns)
        return rule is not None and rule.ssd_bytes is not None

    def _note_recency_floor(self) -> None:
        """Writer thread: the oldest row's last use, for `_hit`."""
        try:
            with self.index.reading() as txn:
                self.recency_floor = self.index.oldest_atime(txn)
        except (IndexBusy, lmdb.Error):
            self.recency_floor = None  # every hit recorded meanwhile

    def _read(self, eid: bytes) -> tuple[Entry, Row] | None:
        if eid in self._bad:
            return None
        # A short timeout: under contention we miss rather than stall a GET.
        if not self._unlink_lock.acquire(timeout=0.05):
            self._count("busy_misses")
            return None
        fault: BaseException | None = None
        try:
            with self.index.reading() as txn:
                row = self.index.get(txn, eid)
            if row is None:
                return None
            if row.state == PACKED:
                fd = -2  # read below, without the lock (see _read_packed)
            else:
                try:
                    fd = blobfile.open_blob(self.path(eid))
                except (BlobCorrupt, OSError) as exc:
                    fd, fault = -1, exc
        except IndexBusy:
            self._count("busy_misses")
            return None
        except RowDamaged as exc:
            self._mark_bad(eid, f"bad row: {exc}")
            return None
        except lmdb.Error as exc:  # a damaged page under the row: a miss, counted, never INTERNAL
            self._index_error(exc)
            return None
        finally:
            self._unlink_lock.release()
        if fd == -2:
            entry = self._read_packed(eid, row)
            return None if entry is None else (entry, row)
        if fd < 0:
            self._open_failed(eid, fault)
            return None
        try:
            entry = blobfile.read_blob(fd, row.file_size, row.checksum, self.read_buffers)
            if entry.id != eid or entry.namespace != row.ns:
                raise BlobCorrupt("blob holds another entry than its name says")
        except BlobCorrupt as exc:
            self._mark_bad(eid, f"corrupt: {exc}")
            return None
        except OSError as exc:
            self._read_failed(eid, exc)
            return None
        finally:
            os.close(fd)
        entry.nbytes = row.nbytes
        return entry, row

    def _open_failed(self, eid: bytes, exc: BaseException | None) -> None:
        """A blob file that would not open: a miss, and what it says about it."""
        if isinstance(exc, FileNotFoundError):
            self._mark_bad(eid, "missing")
        elif isinstance(exc, BlobCorrupt):  # a FIFO, a folder, a symlink: not a blob
            self._mark_bad(eid, f"corrupt: {exc}")
        else:
            self._read_failed(eid, exc)

    def _read_failed(self, eid: bytes, exc: OSError) -> None:
        """An I/O error reading a blob file. The disk's own (EIO, ...): a miss,
        and the tier degraded -- the blob may well be intact, so it stays
        (quarantining on a transient error would lose it). The process's
        (no fd or memory free: EMFILE, ENOMEM, ...): a miss, nothing more.
        Anything else concerns this one path (a symlink loop, a shard folder
        replaced by a file): the entry is hidden and its blob quarantined, so
        the same GET does not fail again and again."""
        self._count("read_errors")
        if exc.errno in DISK_ERRNOS:
            self._degrade(f"read failed: {exc}")
        elif exc.errno in TRANSIENT_ERRNOS:
            self._count("read_transient")
            if (n := self.counters["read_transient"]) & (n - 1) == 0:  # the 1st, 2nd, 4th, ... time
                log.warning("ssd: cannot read blobs for now (%s, %d times so far); serving misses",
                            exc.strerror or exc, n)
        else:
            self._mark_bad(eid, f"read error: {exc}")

    def _read_packed(self, eid: bytes, row: Row) -> Entry | None:
        """The entry of a packed blob whose row `_read` found, checked as a
        file's is. Not under `_unlink_lock`: an eviction may delete the row
        and then the blob meanwhile, so a blob found missing is only a fault
        if its row is still there."""
        try:
            buf = self.pack.read(pack_key(eid, row.slot), self.read_buffers)
        except IndexBusy:
            self._count("busy_misses")
            return None
        except lmdb.Error as exc:  # a damaged pack: a miss, counted, never INTERNAL
            with self._mu:
                self.counters["read_errors"] += 1
                first = self.counters["read_errors"] == 1
            if first:
                log.error("ssd: the pack of small blobs failed a read (%s); serving misses for what it cannot read", exc)
            return None
        if buf is None:
            # Missing only if the row still names that blob: evicted and
            # stored again meanwhile, the entry is in another slot now.
            held, now = self._committed_row(eid)
            if held and now is not None and now.state == PACKED and now.slot == row.slot:
                self._mark_bad(eid, "missing")
            return None
        try:
            entry = blobfile.checked_blob(buf, row.file_size, row.checksum)
            if entry.id != eid or entry.namespace != row.ns:
                raise BlobCorrupt("blob holds another entry than its name says")
        except BlobCorrupt as exc:
            self._mark_bad(eid, f"corrupt: {exc}")
            return None
        entry.nbytes = row.nbytes
        return entry

    def _mark_bad(self, eid: bytes, reason: str) -> None:
        """Hide `eid` at once and have the writer quarantine its blob."""
        with self._mu:
            if eid in self._bad:
                return
            self._bad[eid] = reason
            first_row = False
            if reason.startswith("bad row"):
                self.counters["bad_rows"] += 1
                first_row, self._bad_rows_told = not self._bad_rows_told, True
            elif reason != "missing":
                self.counters["checksum_failures"] += 1
        if self.observer is not None:
            self.observer(eid, None, "quarantined", reason.split(":")[0])
        if reason.startswith("bad row"):
            # A damaged page holds many rows: one line here, the sweep's line sums them all up.
            (log.warning if first_row else log.debug)(
                "ssd: the index row of %s is bad; serving a miss, checking its blob (and any more found before it is mended)",
                eid.hex())
        else:
            log.warning("ssd: blob %s is bad (%s); quarantining, serving a miss", eid.hex(), reason)
        self.writer.submit(lambda: self._quarantine(eid))

    def _index_error(self, exc: Exception) -> None:
        with self._mu:
            self.counters["index_errors"] += 1
            first = self.counters["index_errors"] == 1
        if heal.is_damage(exc):
            self.want_heal(f"a read failed: {exc}")
        elif first:  # once: the counter keeps the tally
            log.error("ssd: the index failed a read (%s); serving misses for what it cannot read", exc)

    def want_heal(self, reason: str) -> None:
        """The index is damaged (found while running): have the writer move it
        aside and rebuild it from the blobs, serving misses meanwhile."""
        # During a rebuild the damage is that of the index just replaced (a
        # reader that met it as it went): nothing more to do.
        if self._heal_wanted is None and self._rebuild is None and self.writer.alive:
            self._heal_wanted = reason
            with self.queue.cond:  # wake the writer
                self.queue.cond.notify_all()

    def _heal_now(self) -> None:
        """Writer thread: swap in a new index and rebuild it (heal.py). Readers
        switch at once (they look `self.index` up per call); the old one is
        closed once the readers still inside it are out."""
        reason, old = self._heal_wanted, self.index
        try:
            new, h = heal.replace_index(self.root, reason, map_size=old.map_size)
        except (OSError, lmdb.Error) as exc:
            self._degrade(f"cannot replace the damaged index: {exc}")
            return
        self.index, self.heal = new, h
        self.entries, self.bytes = 0, 0
        self.boundaries_known = False  # the rebuild may index blobs the old index had lost: walked again
        self._rebuild = heal.rebuild_steps(self, h)
        self._walk = heal.walk_steps(self)
        self._reconcile = self._reconcile_steps({})
        self.reconciled.clear()
        self._heal_wanted = None
        with self._mu:  # what was hidden for the old index: the rebuild checks every blob
            self._bad.clear()
        old.retire()

    def boundary_free(self, namespace: str) -> bool:
        return self.boundaries_known and namespace not in self.boundary_ns

    def walked(self, boundary_ns: set[str]) -> None:
        """Writer thread: a walk of every row (heal.walk_steps) found boundary
        entries of `boundary_ns`; with those written meanwhile, the list is whole."""
        self.boundary_ns |= boundary_ns
        self.boundaries_known = True

    def tails(self, parent: bytes) -> list[tuple[int, bytes]]:
        found = dict(self.queue.tails(parent))
        try:
            with self.index.reading() as txn:
                found.update(self.index.tails(txn, parent))
        except IndexBusy:
            pass
        except lmdb.Error as exc:
            self._index_error(exc)
        return sorted(found.items(), reverse=True)

    # -- writes (daemon thread: enqueue only) ------------------------------
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

    # -- the writer thread -----------------------------------------------
    def write_batch(self, batch: list[Entry]) -> None:
        written: list[tuple[bytes, Row]] = []
        i = 0
        faults = self.major_faults()
        degrades, committed = self._degrades, 0
        try:
            # The hits recorded since the last batch ride in its index
            # commit: one synced commit, not two (each touch dirties two
            # random index pages; under disk hits they were half the
            # writer's time, and its pace bounds what PUTs are admitted).
            # If one is on a victim, it is recorded first (`record_hits_on`,
            # asked by _make_room and by the quotas' own eviction).
            self._riding = self._take_touches()
            self._blob_root_ok()
            if self.prefetching:
                self._prefetch(batch)
            ests = [blobfile.estimate_disk_bytes(e) for e in batch]
            if self.quotas is not None:
                self.quotas.reset_failures()
                self.quotas.make_room_ssd_for(self, list(zip(batch, ests)))
            need = sum(est for est in ests if est <= self.budget_bytes)
            if self.bytes + need > self.budget_bytes and not (self.degraded and self._clock() < self._retry_at):
                # Room for the whole batch at once (after its groups' quotas
                # made theirs): one commit of victims (index, then pack), not
                # one each. A full tier evicted per entry: ~130 synced commits
                # a batch of 64, ~0.4 s. Each entry still checks (below): an
                # estimate, or a lease in the way, may leave some room to make
                # one by one.
                self._make_room(need, set())
            planned = 0
            for i, entry in enumerate(batch):
                if self.writes_stopped:
                    # close() is out of time: commit what is written, leave the rest.
                    self.abandoned.extend(batch[i:])
                    break
                eid = entry.id
                now = self._clock()
                if self.degraded and now < self._retry_at:
                    self._drop(entry, "degraded")
                    continue
                est = ests[i]
                if est > self.budget_bytes:
                    self._drop(entry, "too_big")
                    continue
                if not self._space_ok(est):
                    self._drop(entry, "low_space")
                    continue
                if self.quotas is not None and not self.quotas.make_room_ssd(self, entry, est, written):
                    # As below: this batch's own uncommitted blobs of the group may
                    # be what stands in the way (a commit only for those: a synced
                    # commit per chunk had slowed the writer for everyone).
                    fits = False
                    if self.quotas.pending_in_group(entry, written):
                        committed += self._commit(self._synced(written, batch))
                        written, planned = [], 0
                        fits = self.quotas.make_room_ssd(self, entry, est, written)
                    if not fits:
                        self._drop(entry, "quota")
                        continue
                if not self._make_room(est + planned, protect={e for e, _ in written}):
                    # Perhaps only this batch's own uncommitted blobs stand in the
                    # way (a batch bigger than the budget): commit them, so they
                    # become evictable like any other, and try once more.
                    if written:
                        committed += self._commit(self._synced(written, batch))
                        written, planned = [], 0
                    if not self._make_room(est, set()):
                        self._drop(entry, "budget_leased")
                        continue
                try:
                    if est <= self.pack_max_bytes:
                        # Into the pack (pack.py), with the batch's others, at _synced.
                        buf, checksum = blobfile.encode_blob(entry)
                        self._packing[eid] = buf
                        info = blobfile.BlobInfo(len(buf), packed_disk_bytes(len(buf)), checksum)
                        state = PACKED
                    else:
                        # Synced with the rest of the batch before any row commits (_synced).
                        info = blobfile.write_blob(self.path(eid), entry, durable=False)
                        state = "ssd"
                except Unencodable as exc:
                    log.error("ssd: cannot store %s: %s", eid.hex(), exc)
                    self._drop(entry, "unencodable")
                    continue
                except OSError as exc:
                    self._write_failed(entry, exc)
                    continue
                self._path_errors = (None, 0)
                planned += info.disk_bytes
                if entry.kind == BOUNDARY:
                    self.boundary_ns.add(entry.namespace)  # (queued by spill: there already, unless queued directly)
                written.append((eid, Row(
                    ns=entry.namespace, kind=entry.kind, parent=entry.parent, start=entry.start,
                    length=entry.length, tail=entry.tail, nbytes=entry.nbytes, file_size=info.file_size,
                    disk_bytes=info.disk_bytes, checksum=info.checksum, fmt=blobfile.FORMAT_VERSION,
                    tensors=[[t.name, t.dtype, list(t.shape)] for t in entry.tensors], atime=now, state=state,
                )))
            if written:
                committed += self._commit(self._synced(written, batch))
            if committed:
                self._check_files(batch)
            # Recovered only once the disk took something: an encoded blob in
            # memory proves nothing (a full disk flapped "recovered"/"degraded").
            if committed and self._degrades == degrades:
                self._recover()
        except lmdb.Error as exc:
            # The index refused a write mid-batch (LMDB on a full disk, most
            # often). Blobs written but not yet indexed must not stay on disk,
            # and every entry of the batch not yet stored is dropped, counted.
            self._count("write_errors")
            self._degrade(f"index write failed: {exc}")
            unindexed = {eid for eid, _ in written}
            self._discard(written)
            for entry in batch[:i]:
                if entry.id in unindexed:
                    self._drop(entry, "write_error")
            for entry in batch[i:]:
                self._drop(entry, "write_error")
        except BaseException:
            # Not the disk's (the writer takes the batch again): blobs the pack
            # took in may now be in slots no row will name.
            self.pack.orphan_free = False
            raise
        finally:
            self._packing.clear()
            if self._riding:  # no commit carried them: recorded again, for the next one (or idle's)
                self._untake_touches(self._riding)
                self._riding = {}
        # Read ahead while the batch's pages come from the disk (several a
        # batch: the index has outgrown the page cache), not while they are
        # cached: then the helper threads only cost CPU (~20% of a batch's).
        self.prefetching = self.major_faults() - faults >= max(1, len(batch) // 8)
        self._note_recency_floor()

    def _write_failed(self, entry: Entry, exc: OSError) -> None:
        """A blob file that could not be written: dropped, counted. The disk's
        own errors degrade the tier. Any other concerns one path (a shard
        folder replaced by a file, a permission changed by hand) and the tier
        goes on writing everything else -- unless the same errno keeps coming
        from path after path: then it is not about one path."""
        self._count("write_errors")
        self._drop(entry, "write_error")
        if exc.errno in DISK_ERRNOS:
            self._degrade(f"write failed: {exc}")
            return
        last, n = self._path_errors
        n = n + 1 if exc.errno == last else 1
        self._path_errors = (exc.errno, n)
        if n >= PATH_ERRORS_DEGRADE:
            self._degrade(f"{n} writes in a row failed: {exc}")
        elif exc.errno not in self._errnos_logged:  # once per kind; counters keep the tally
            self._errnos_logged.add(exc.errno)
            log.warning("ssd: cannot write %s (%s); dropped, the tier goes on", entry.id.hex(), exc)

    def _blob_root_ok(self) -> None:
        """blobs/ is a real folder (one lstat a batch): made again if it was
        removed under us, moved aside if it became a symlink (see
        datadir.ensure_folder). A failure is the disk's: write_blob meets it."""
        try:
            ensure_folder(self.root, BLOB_DIR, sync=blobfile.fsync_dir)
        except OSError:
            pass

    def _check_files(self, batch: list[Entry]) -> None:
        """Before a batch is settled: are the index and the pack still the
        files at their paths (Env.file_fault, one stat each)? A commit into
        a removed file is lost at the next start, so then nothing of the
        batch counts as durable (write-through PUTs are not acknowledged),
        the tier degrades, and the file is replaced: the pack at once, the
        index by a heal (which rebuilds it from the blobs)."""
        why = self._file_faults()
        if why is not None:
            self._unsettled.update(e.id for e in batch)
            self._degrade(why)

    def _file_faults(self) -> str | None:
        """Replace the pack or heal the index if its file is not the one it
        maps any more; what was wrong, or None. Writer thread."""
        why = None
        fault = self.pack.file_fault()
        if fault is not None:
            why = f"the pack's data.mdb {fault}"
            self._replace_pack(why)
        fault = self.index.file_fault()
        if fault is not None:  # until the heal has swapped it, every batch goes into that file
            why = f"the index's data.mdb {fault}"
            self.want_heal(why)
        return why

    def _replace_pack(self, why: str) -> None:
        old = self.pack
        try:
            self.pack = heal.replace_pack(self.root, why, map_size=old.map_size)
        except (OSError, lmdb.Error) as exc:
            self._degrade(f"cannot replace the pack: {exc}")
            return
        old.retire()
        # Rows that named the old pack's blobs name nothing now: reconcile drops them.
        if self._reconcile is None:
            self._reconcile = self._reconcile_steps({})
            self.reconciled.clear()

    def _prefetch(self, batch: list[Entry]) -> None:
        """Read in, in parallel, the index pages this batch's inserts will
        touch (Env.prefetch): once the index outgrows the page cache, each
        random insert would otherwise wait for a disk read of its own. (The
        pack's inserts append at its right edge: nothing to read ahead.)"""
        if len(batch) < 2:
            return
        for fut in self.index.prefetch(self.index.rows, [e.id for e in batch], self._threads()):
            fut.result()

    def _threads(self) -> OrInline:
        """The writer's helper threads: group sync's fsyncs, prefetching reads.
        Started as tasks come; where none can be (a pids limit), a task runs
        on the writer's own thread instead."""
        if self._pool is None:
            self._pool = OrInline(8, "kvd-io")
        return self._pool

    def _discard(self, written: list[tuple[bytes, Row]]) -> None:
        """Blobs written but never indexed: unlink the files, delete the packed
        ones (those given a slot: committed to the pack)."""
        packed = [pack_key(eid, row.slot) for eid, row in written if row.state == PACKED and row.slot]
        for eid, row in written:
            if row.state != PACKED:
                self._unlink(self.path(eid))
        if packed:
            try:
                self.pack.delete_many(packed)
            except lmdb.Error as exc:  # left behind as orphans: reconcile removes them
                self.pack.orphan_free = False
                log.warning("ssd: could not remove %d unindexed packed blobs (%s)", len(packed), exc)

    def _synced(self, written: list[tuple[bytes, Row]], batch: list[Entry]) -> list[tuple[bytes, Row]]:
        """Group sync: commit the packed blobs of `written` to the pack in one
        synced transaction, and fsync the others' files and folders together,
        in parallel (blobfile.sync_group). Returns those now durable; the
        others are removed and dropped, counted (a disk error degrades)."""
        if not written:
            return written
        by_id = {e.id: e for e in batch}
        rows = [row for _, row in written if row.state == PACKED]
        packed = [(eid, self._packing.pop(eid)) for eid, row in written if row.state == PACKED]
        lost: set[bytes] = set()
        if packed:
            try:
                for row, key in zip(rows, self.pack.put_many(packed)):  # one synced commit for them all
                    row.slot = slot_of(key)
            except lmdb.Error as exc:
                lost.update(eid for eid, _ in packed)
                for eid, _ in packed:
                    self._count("write_errors")
                    self._drop(by_id[eid], "write_error")
                self._degrade(f"writing to the pack failed: {exc}")
        files = [self.path(eid) for eid, row in written if row.state != PACKED]
        if self.durable and files:
            failed = blobfile.sync_group(files, {f.parent for f in files} | {self.root / BLOB_DIR}, self._threads())
            for path, exc in failed.items():
                eid = eid_of_blob(path.name)
                lost.add(eid)
                self._count("write_errors")
                self._unlink(path)
                self._drop(by_id[eid], "write_error")
                if exc.errno in DISK_ERRNOS:
                    self._degrade(f"fsync failed: {exc}")
        return [(eid, row) for eid, row in written if eid not in lost] if lost else written

    def settled(self, batch: list[Entry]) -> None:
        """Writer thread, after a batch: tell `on_settled` what became durable."""
        unsettled, self._unsettled = self._unsettled, set()
        if self.on_settled is None:
            return
        durable = self.with_rows(e.id for e in batch) - unsettled
        self.on_settled([(e.id, e.id in durable) for e in batch], self.degraded)

    def _commit(self, written: list[tuple[bytes, Row]]) -> int:
        """Commit rows for durable blobs; on failure remove the blobs (counted).
        Returns how many rows were committed."""
        riding = self._riding

        def commit(txn):
            if riding:
                self.index.touch_many(txn, riding)
            added = [(eid, row) for eid, row in written if self.index.put_row(txn, eid, row)]
            return added, self.index.totals(txn)

        try:
            added, totals = self.index.write(commit)
            self._riding = {}
            if len(added) < len(written):
                self._drop_unindexed(written, added)
        except lmdb.Error as exc:
            # The blobs are durable but unindexed: remove them now rather
            # than leave orphans for reconcile.
            self._count("write_errors")
            self._degrade(f"index commit failed: {exc}")
            self._discard(written)
            for eid, row in written:
                with self._mu:
                    self.counters["drops"] += 1
                    self.drop_reasons["write_error"] = self.drop_reasons.get("write_error", 0) + 1
            return 0
        self.entries, self.bytes = totals
        if self.quotas is not None:
            self.quotas.reset_failures()  # committed rows may be evictable now
        with self._mu:
            self.counters["spills"] += len(added)
            self.counters["spill_bytes"] += sum(r.disk_bytes for _, r in added)
        return len(added)

    def _drop_unindexed(self, written: list[tuple[bytes, Row]], added: list[tuple[bytes, Row]]) -> None:
        """Blobs written for entries that had a row already (put_row kept the
        old one): a packed one is in a slot of its own that no row names."""
        kept = {eid for eid, _ in added}
        extra = [pack_key(eid, row.slot) for eid, row in written if eid not in kept and row.state == PACKED and row.slot]
        if extra:
            self._delete_packed(extra, "written twice")

    def _delete_packed(self, keys: list[bytes], what: str) -> None:
        """Delete packed blobs no row names; left for reconcile if the pack refuses."""
        try:
            self.pack.delete_many(keys)
        except lmdb.Error as exc:
            self.pack.orphan_free = False
            log.warning("ssd: could not delete %d packed blobs %s (%s)", len(keys), what, exc)

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

    def record_hits_on(self, victims: list[bytes]) -> bool:
        """Writer thread: True if one of `victims` was read since its row last
        moved -- then every pending hit is recorded now (a commit of its own)
        and the victims must be chosen again: the hit moves that row (and
        others read) out of the way. Only then: hits move rows forward, never
        back, so victims none was read on stay victims, and the hits ride in
        the batch's commit instead (`write_batch`)."""
        riding, touched = self._riding, self._touched
        if (riding or touched) and any(eid in riding or eid in touched for eid in victims):
            self._flush_touches()
            return True
        return False

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

    def _mark_evicting(self, victims: list[bytes]) -> None:
        """Under `_mu`: `lease` refuses `victims` until `_unmark_evicting`;
        both count in `eviction_events` (see `lease_found`)."""
        self._evicting.update(victims)
        self.eviction_events += 1

    def _unmark_evicting(self, victims: list[bytes]) -> None:
        with self._mu:
            self._evicting.difference_update(victims)
            self.eviction_events += 1

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

    def _take_touches(self) -> dict[bytes, float]:
        with self._mu:
            touched, self._touched = self._touched, {}
        return touched

    def _untake_touches(self, touched: dict[bytes, float]) -> None:
        """Hits taken for a commit that did not happen: recorded again."""
        with self._mu:
            _keep_latest(self._touched, touched)

    def _flush_touches(self) -> None:
        """Record the hits taken (riding) and recorded since, in a commit of their own."""
        touched, riding, self._riding = self._take_touches(), self._riding, {}
        _keep_latest(touched, riding)
        if touched:
            self.index.write(lambda txn: self.index.touch_many(txn, touched))

    def _quarantine(self, eid: bytes) -> None:
        reason = self._bad.get(eid)
        if reason is None:  # forgotten by a heal since, or mended with others (_repair_rows)
            return
        try:
            if reason.startswith("bad row"):
                self._repair_rows()
            else:
                self._quarantine_now(eid, reason)
        except lmdb.Error as exc:
            if not heal.is_damage(exc):
                raise
            # Left hidden: the heal forgets it, and the rebuild reads its blob.
            self.want_heal(f"dropping the row of {eid.hex()} failed: {exc}")

    def _repair_rows(self) -> None:
        """Every row found undecodable so far, at once: drop them with every
        trace (one scan and one recount of the index for all of them, not
        one each: a damaged stretch of a big index holds many rows), then
        give each its row back from its blob if the blob passes its own
        checksum, in one commit; quarantine the others' blobs."""
        with self._mu:
            bad = [eid for eid, why in self._bad.items() if why.startswith("bad row")]
            self._bad_rows_told = False  # rows found bad from now on are news again
        if not bad:
            return

        def drop(txn):
            gone = self.index.drop_damaged(txn, bad)
            # A row that decodes after all is left as it is (nothing to mend).
            sound = {eid for eid in bad if eid not in gone and self.index.has(txn, eid)}
            return sound, self.index.totals(txn)

        sound, (self.entries, self.bytes) = self.index.write(drop)
        for eid in bad:
            self.index.damaged.discard(eid)
        rows, lost = [], []
        unsound = [eid for eid in bad if eid not in sound]
        # No row names their slots: one walk of the pack's keys, for those with no file.
        packed = self._packed_keys([eid for eid in unsound if not self.path(eid).exists()])
        for eid in unsound:
            row = self._recovered_row(eid, packed.get(eid))
            (rows if row is not None else lost).append((eid, row))
        if rows:
            def put(txn):
                added = sum(self.index.put_row(txn, eid, row) for eid, row in rows)
                return added, self.index.totals(txn)

            added, (self.entries, self.bytes) = self.index.write(put)
            self._count("rows_repaired", added)
        for eid, _ in lost:
            self._quarantine_blob(eid, packed.get(eid))
        with self._mu:
            for eid in bad:
                self._bad.pop(eid, None)
        log.warning("ssd: %d index rows did not decode: %d rebuilt from their blobs (checksum verified), "
                    "%d blobs quarantined", len(bad) - len(sound), len(rows), len(lost))

    def _packed_keys(self, eids: list[bytes]) -> dict[bytes, bytes]:
        """{entry id: pack key} of those of `eids` with a blob in the pack."""
        if not eids:
            return {}
        try:
            return self.pack.find(eids)
        except (IndexBusy, lmdb.Error):
            return {}

    def _recovered_row(self, eid: bytes, key: bytes | None) -> Row | None:
        """The row the blob of `eid` carries (in the pack at `key`, or else
        its file), if the blob passes its own checksum; None if it does not
        (or predates kvd_sum, or is gone)."""
        try:
            if key is not None:
                row, verified = heal.recover_packed(self.pack, key, atime=self._clock())
            else:
                row, verified = heal.recover_row(self.path(eid), eid)
        except (BlobCorrupt, OSError, lmdb.Error):
            return None
        return row if verified else None

    def _quarantine_now(self, eid: bytes, reason: str) -> None:
        def delete(txn):
            # delete_row drops an undecodable row with every trace of it.
            return self.index.delete_row(txn, eid), self.index.totals(txn)

        row, totals = self.index.write(delete)
        self.index.damaged.discard(eid)
        self.entries, self.bytes = totals
        if row is not None:
            key = pack_key(eid, row.slot) if row.state == PACKED else None
        elif reason != "missing":  # it did not decode: nothing names its slot
            key = None if self.path(eid).exists() else self._packed_keys([eid]).get(eid)
        else:
            key = None
        if reason != "missing":
            self._quarantine_blob(eid, key)
        else:
            self._count("rows_repaired")
            if key is not None:
                # Its row is gone now: whatever the pack may hold there is nobody's.
                self._delete_packed([key], "of rows found missing")
        with self._mu:
            self._bad.pop(eid, None)

    def _quarantine_blob(self, eid: bytes, key: bytes | None) -> None:
        """Move the blob of `eid` (its row is gone) into the quarantine folder:
        the one in the pack at `key`, or else its file."""
        with self._unlink_lock:
            packed = False
            if key is not None:
                try:
                    moved = packed = heal.quarantine_packed(self.root, self.pack, key)
                except lmdb.Error as exc:  # the pack is unreadable: no file to look for either
                    log.warning("ssd: could not move packed blob %s out of the pack (%s)", eid.hex(), exc)
                    moved, packed = False, True
            if not packed:
                moved = heal.quarantine_file(self.root, self.path(eid), eid.hex())
        if moved:
            self._count("quarantined")

    def _repair_damaged(self) -> None:
        """Rows some reader found undecodable (eviction, a drop, a check):
        hidden and quarantined like a bad read."""
        for eid in list(self.index.damaged):
            if eid not in self._bad:
                self._mark_bad(eid, "bad row: undecodable index row")
            self.index.damaged.discard(eid)

    def idle(self, busy: bool) -> bool:
        """Writer-thread periodic work. True if more is waiting right now."""
        if self._heal_wanted is not None and self._rebuild is None:
            self._heal_now()
        if time.monotonic() >= self._next_file_check:
            # Cut short, a file LMDB maps is a SIGBUS at the next read of a
            # page past its end: replace it before a reader gets there (a
            # mitigation only: a read may come first).
            self._next_file_check = time.monotonic() + FILE_CHECK_S
            if self._file_faults() is not None:
                return True
        now = self._clock()
        self._note_recency_floor()
        try:
            if now >= self._next_touch_flush:
                self._next_touch_flush = now + self.touch_flush_s
                self._flush_touches()
        except lmdb.Error as exc:
            if not heal.is_damage(exc):
                # The disk refuses writes (read-only, full): those hits' recency
                # is lost, nothing else. Degraded, said once; the tier keeps serving.
                self._degrade(f"recording hits failed: {exc}")
                return False
            self.want_heal(f"recording hits failed: {exc}")
            return True
        if self.index.damaged:
            self._repair_damaged()
        if self._rebuild is not None:
            try:
                next(self._rebuild)
            except StopIteration:
                self._rebuild = None
                if self._reconcile is None and self._walk is None:
                    self.reconciled.set()
            return not busy
        if self._walk is not None:
            try:
                next(self._walk)
            except StopIteration:
                self._walk = None
                if self._reconcile is None:
                    self.reconciled.set()
            return not busy
        if self._reconcile is not None:
            try:
                next(self._reconcile)
            except StopIteration:
                self._reconcile = None
                self.reconciled.set()
            return self._reconcile is not None and not busy
        return False

    # -- reconcile (kvd/store/reconcile.py) ----------------------------------
    def _reconcile_steps(
        self, report: dict[str, int], dry_run: bool = False, progress: Callable[[str, int, int], None] | None = None
    ) -> Iterator[None]:
        return reconcile_steps(self, report, dry_run, progress)

    def _admin(self, fn: Callable[[], Any]) -> Any:
        """Run an admin job on the writer. An index found damaged meanwhile
        is healed (see want_heal) and the caller told to retry: Busy on the
        wire, IndexDamaged offline -- never an internal error. A disk that
        refuses the job's writes (read-only, full, failing) degrades the tier
        and is Busy too (offline: the error as it is)."""
        def guarded():
            try:
                return fn()
            except OSError as exc:
                if exc.errno not in DISK_ERRNOS or not self.writer.alive:
                    raise
                raise self._refused(exc) from None
            except lmdb.Error as exc:
                if not heal.is_damage(exc):
                    if not self.writer.alive:
                        raise
                    raise self._refused(exc) from None
                if not self.writer.alive:
                    raise heal.IndexDamaged(f"the index of {self.root} is damaged ({exc}); "
                                            "run `kvd verify --repair` to rebuild it from the blobs") from None
                self.want_heal(f"an admin request failed: {exc}")
                raise Busy("the SSD tier's index is damaged and being rebuilt from the blobs; retry later") from None

        return self.writer.submit(guarded).result()

    def _refused(self, exc: Exception) -> Busy:
        """The error to answer an admin job whose writes the disk refused; degrades the tier."""
        self._degrade(f"an admin request failed: {exc}")
        return Busy(f"the disk refuses writes ({exc}); retry later")

    def _finish_rebuild(self) -> None:
        """Run what is left of an index rebuild now (writer thread, or none running)."""
        if self._rebuild is not None:
            for _ in self._rebuild:
                pass
            self._rebuild = None
            if self._reconcile is None:
                self.reconciled.set()

    def reconcile(
        self, *, dry_run: bool = False, progress: Callable[[str, int, int], None] | None = None
    ) -> dict[str, int]:
        """Run a full reconcile now (on the writer). Returns counts removed (or that would be)."""
        def run():
            report: dict[str, int] = {}
            # The walk deletes what it takes for orphans: never in a folder
            # a symlink leads to (datadir.ensure_folder).
            ensure_blob_dirs(self.root)
            if self._rebuild is not None:
                # Blobs not yet indexed are not orphans, and finishing the
                # rebuild here would hold the caller (the daemon's thread, for
                # `kvd gc`) for minutes: the rebuild removes temp files itself
                # and reconcile runs after it.
                return report
            for _ in self._reconcile_steps(report, dry_run, progress):
                pass
            return report

        return self._admin(run)

    def verify_blob(self, eid: bytes) -> bool:
        """Read `eid`'s blob back against its checksum. False if it has no row
        or fails; a failure is quarantined, as on any read."""
        return self._read(eid) is not None

    def remove_rows(self, eids: list[bytes], counter: str) -> tuple[int, int]:
        """Writer thread (or no writer running): delete these rows, committed
        first, then unlink their blobs; counted under `counter`. Returns
        (entries, bytes)."""
        return self._remove(eids, counter)

    def check(self, *, verify: bool = True, progress=None):
        """Does the index agree with the blobs? A `kvd.store.check.CheckReport`.
        Call it with the writer idle (after `flush()`, or on a closed-down
        store's data dir): a write in flight looks like a temp file."""
        from kvd.store.check import check

        return check(self.root, self.index, pack=self.pack, verify=verify, pending=self.queue.__contains__,
                     progress=progress)

    def recheck(self, eids: list[bytes]) -> tuple[int, int]:
        """Read these blobs again (checksum verified; a failure is quarantined
        as on any read). Returns (checked, failed); ids without a row are skipped."""
        checked = failed = 0
        for eid in eids:
            if not self.has_row(eid):
                continue
            checked += 1
            if not self.verify_blob(eid):
                failed += 1
        if failed:
            # Quarantines run on the writer thread in submission order: wait for
            # ours, so whoever asked (kvd verify) finds the blobs moved.
            self.writer.submit(lambda: None).result()
        return checked, failed

    def purge_quarantine(self, *, dry_run: bool = False) -> tuple[int, int]:
        """Delete quarantined blobs. Returns (files, bytes). A quarantine
        folder that is missing or not a folder is made again (heal.py)."""
        n = nbytes = 0
        qdir = self.root / QUARANTINE_DIR if dry_run else ensure_quarantine(self.root)
        if qdir is None or not qdir.is_dir():
            return 0, 0
        for path in qdir.iterdir():
            try:
                nbytes += path.stat().st_size
                if not dry_run:
                    path.unlink()
                n += 1
            except FileNotFoundError:
                pass
        return n, nbytes

    # -- admin (submitted to the writer) -----------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued entry is written (or dropped)."""
        return self.writer.flush(timeout)

    def evict(self, budget_bytes: int, *, dry_run: bool = False, tier: str = "ssd") -> tuple[int, int]:
        if tier != "ssd":
            return 0, 0

        def run():
            self._flush_touches()
            victims, freed = [], 0
            with self.index.reading() as txn:
                over = self.bytes - max(0, int(budget_bytes))
                for _, eid in self.index.oldest(txn):
                    if freed >= over:
                        break
                    victims.append(eid)
                    freed += self.index.get(txn, eid).disk_bytes
            if dry_run:
                return len(victims), freed
            return self._remove(victims, "evictions")

        return self._admin(run)

    def drop(
        self, *, namespace: str | None = None, older_than: float | None = None, dry_run: bool = False,
        ids: list[bytes] | None = None,
    ) -> tuple[int, int]:
        """As `Store.drop`; the ids removed (or that would be) are appended to `ids` if given."""
        cutoff = None if older_than is None else self._clock() - older_than

        def run():
            self._flush_touches()
            victims, nbytes = [], 0
            with self.index.reading() as txn:
                if namespace is None and cutoff is not None:
                    source = _take_while_old(self.index, txn, cutoff)  # stops at the first young row
                else:
                    source = self.index.iter_rows(txn)
                for eid, row in source:
                    if (namespace is None or row.ns == namespace) and (cutoff is None or row.atime < cutoff):
                        victims.append(eid)
                        nbytes += row.disk_bytes
            queued: list[Entry] = []
            if cutoff is None:
                # Queued entries were in RAM moments ago, so an age-based
                # drop never takes them; a namespace drop does.
                def pick(e: Entry) -> bool:
                    return namespace is None or e.namespace == namespace

                if dry_run:
                    queued = self.queue.pending_where(pick)
                else:
                    queued = self.queue.remove_where(pick)
                    if queued and self.on_settled is not None:
                        # Never to be written: a write-through PUT waiting for
                        # them is answered NOT_PERSISTED, not left parked.
                        self.on_settled([(e.id, False) for e in queued], "dropped by gc before it was written")
            qbytes = sum(e.nbytes for e in queued)
            if ids is not None:
                ids.extend(victims)
                ids.extend(e.id for e in queued)
            if dry_run:
                return len(victims) + len(queued), nbytes + qbytes
            n, b = self._remove(victims, "dropped")
            return n + len(queued), b + qbytes

        return self._admin(run)

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


def _major_faults() -> int:
    """Page faults this process has waited on a disk read for (Linux and macOS)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def _keep_latest(into: dict[bytes, float], hits: dict[bytes, float]) -> None:
    """Add `hits` (eid -> time) to `into`, keeping each eid's latest time."""
    for eid, t in hits.items():
        if t > into.get(eid, 0.0):
            into[eid] = t


def _take_while_old(index: Index, txn, cutoff: float) -> Iterator[tuple[bytes, Row]]:
    for t, eid in index.oldest(txn):
        if t >= cutoff:
            return
        row = index.get(txn, eid)
        if row is not None:
            yield eid, row
