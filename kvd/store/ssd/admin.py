"""Admin: the jobs an operator runs on the SSD tier (gc, evict, drop, verify).

Theory of operation
-------------------
Admin jobs mutate, so they run on the writer thread: the caller (the
daemon thread, for `kvd gc`, `kvd evict`, `kvd drop`) submits one and waits
for it (`_admin`), interleaved with spills like any other writer work. An
index found damaged meanwhile is healed (repair.py) and the caller told to
retry: Busy on the wire, IndexDamaged offline -- never an internal error.
A disk that refuses the job's writes (read-only, full, failing) degrades
the tier (budget.py) and is Busy too. Offline (`background=False`, offline
gc) there is no writer: a job runs in the caller and errors come as they are.

`check` and `recheck` (`kvd verify`) read: they run in the caller, with
the writer idle.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path
from typing import Any, Callable, Iterator

import lmdb

from kvd.protocol.errors import Busy
from kvd.store.base import Entry
from kvd.store.datadir import QUARANTINE_DIR, ensure_blob_dirs, ensure_quarantine
from kvd.store.ssd import heal
from kvd.store.ssd.budget import DISK_ERRNOS
from kvd.store.ssd.index import Index, Row

log = logging.getLogger("kvd.store.ssd")


class Admin:
    """Operator jobs, submitted to the writer and waited for; mixed into `SsdStore`."""

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
        """Does the index agree with the blobs? A `kvd.store.ssd.check.CheckReport`.
        Call it with the writer idle (after `flush()`, or on a closed-down
        store's data dir): a write in flight looks like a temp file."""
        from kvd.store.ssd.check import check

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
        """Delete whatever the quarantine folder holds (`purge`). Returns
        (files, bytes). A quarantine folder that is missing or not a folder
        is made again (heal.py)."""
        qdir = self.root / QUARANTINE_DIR if dry_run else ensure_quarantine(self.root)
        if qdir is None or not qdir.is_dir():
            return 0, 0
        return purge(qdir, dry_run=dry_run)

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


def _take_while_old(index: Index, txn, cutoff: float) -> Iterator[tuple[bytes, Row]]:
    """Rows in LRU order while their last use is older than `cutoff`."""
    for t, eid in index.oldest(txn):
        if t >= cutoff:
            return
        row = index.get(txn, eid)
        if row is not None:
            yield eid, row


def purge(qdir: Path, *, dry_run: bool = False) -> tuple[int, int]:
    """Delete everything in the folder `qdir`: what the tier quarantined
    (blob files), and whatever else came to be there -- folders (whole
    trees), symlinks, FIFOs, sockets. Returns (names removed, bytes of the
    regular files among them).

    Nothing is followed: a symlink is unlinked, never its target (which may
    be anyone's file), and `lstat` decides what each name is, so a FIFO is
    never opened. A name that vanishes meanwhile is skipped; one that cannot
    be removed (no permission) is left, for the operator."""
    n = nbytes = 0
    for entry in os.scandir(qdir):
        try:
            mode = entry.stat(follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode):
                size = _tree_bytes(entry.path)
                if not dry_run:
                    shutil.rmtree(entry.path)  # a symlink inside is unlinked, not followed
            else:
                size = entry.stat(follow_symlinks=False).st_size if stat.S_ISREG(mode) else 0
                if not dry_run:
                    os.unlink(entry.path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("ssd: could not remove %s from the quarantine (%s); left there", entry.path, exc)
            continue
        n += 1
        nbytes += size
    return n, nbytes


def _tree_bytes(top: str) -> int:
    """Bytes of the regular files under the folder `top` (symlinks not followed)."""
    total = 0
    for folder, _, files in os.walk(top):  # followlinks=False: a symlinked folder is a name, not a tree
        for name in files:
            try:
                st = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total
