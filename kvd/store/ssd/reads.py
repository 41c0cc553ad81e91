"""The read path: what the daemon thread asks the SSD tier, and the reads.

Theory of operation
-------------------
Everything here runs on the daemon thread and only reads: LMDB in read
transactions, blob files, the pack. Nothing waits for the writer: a busy
index (a map resize, IndexBusy) or a contended unlink lock is a miss,
counted `busy_misses` (a short timeout: we miss rather than stall a GET).

A blob file is opened under `_unlink_lock`, which the writer holds around
each unlink, right after its row is looked up; a packed blob is read
without it, and found gone is a fault only if its row is still there
(store.py, "Why `contains` does not lie").

What a read finds wrong is told on, never raised: a blob that fails its
checksum, a row that does not decode, a file that is not a blob is hidden
at once and handed to the writer to quarantine (`_mark_bad`, repair.py);
the disk's own errors degrade the tier (budget.py); a damaged index page
asks for a heal (`_index_error`, repair.py). A GET never answers INTERNAL
for the disk's sake.
"""

from __future__ import annotations

import errno
import logging
import operator
import os
from typing import Iterable, Sequence

import lmdb

from kvd.store.base import Entry
from kvd.store.ssd import blobfile
from kvd.store.ssd.blobfile import BlobCorrupt
from kvd.store.ssd.budget import DISK_ERRNOS
from kvd.store.ssd.index import IndexBusy, Row, RowDamaged
from kvd.store.ssd.pack import PACKED, pack_key

log = logging.getLogger("kvd.store.ssd")

# The process's or the host's, for a moment (no fd free, no memory): a read
# failing so says nothing of the blob, which stays where it is.
TRANSIENT_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR, errno.ENOBUFS}


class Reads:
    """Lookups and blob reads (daemon thread); mixed into `SsdStore`."""

    def _init_reads(self) -> None:
        # Namespaces with a boundary entry here (queued or indexed): complete
        # once a walk of the whole index has listed those on disk
        # (`boundaries_known`, see boundary_free); never shrinks.
        self.boundary_ns: set[str] = set()
        self.boundaries_known = False
        # Where a blob file's bytes may be read to straight (blobfile.read_to_slots):
        # a callable that gives, for the read at hand, an allocator of shared
        # memory (nbytes -> a slot, or None), or None for the heap. The
        # shared-memory plane sets it (kvd/server/shm/startup.py).
        self.read_slots = None

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
        if all(out):
            return out  # (a RAM hit: no read transaction, ~50 us of a GET's ~250)
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

    def has_rows(self, eids: Sequence[bytes]) -> list[bool]:
        """`has_row` for each of `eids`, from one read transaction (a PUT's
        step of new chunks asked one transaction each: ~30 us apiece)."""
        try:
            with self.index.reading() as txn:
                exact = txn.cursor(db=self.index.rows).set_key
                return [exact(eid) for eid in eids]
        except IndexBusy:
            return [False] * len(eids)
        except lmdb.Error as exc:
            self._index_error(exc)
            return [False] * len(eids)

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
            entry = None
            slots = self.read_slots() if self.read_slots is not None else None
            if slots is not None:
                entry = blobfile.read_to_slots(fd, row.file_size, row.checksum, slots)
                if entry is not None:
                    self._count("read_to_slots")
            if entry is None:
                entry = blobfile.read_blob(fd, row.file_size, row.checksum)
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
            buf = self.pack.read(pack_key(eid, row.slot))
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
