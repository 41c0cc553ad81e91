"""The writer's batch: writing what the spill queue hands over, durably.

Theory of operation
-------------------
The writer thread (spill.py) takes a batch from the spill queue and calls
`write_batch`, in named steps:

  1. `_prepare`: take the hits recorded since the last batch, to ride in
     its index commit (recency.py); make sure blobs/ is a real folder; read
     in the index pages the batch will touch if the last batch waited on
     the disk for them (`_prefetch`); estimate each entry's disk bytes and
     make room for the whole batch at once (budget.py, and the groups'
     quotas, quota.py): one commit of victims, not one each.
  2. For each entry, `_admit` (degraded, too big, low space, the quota, the
     budget: each a drop, counted, with its reason; a commit of the batch's
     own blobs first if only they stand in the way), then `_write_blob`:
     into the pack if small (pack.py), else a file of its own (blobfile.py).
  3. Group sync (`_synced`: the pack's blobs in one synced transaction, the
     files and their folders fsynced together; a file's fsync begins on a
     helper thread as soon as it is written, so the disk writes it while the
     writer copies the next), then all their rows in one synced LMDB
     transaction (`_commit`).
  4. `_check_files`, then `settled` (called by the writer) tells
     `on_settled` which entries are durable (the daemon answers
     write-through PUTs from that).

Durability. A commit into an index or pack whose file was removed or
replaced under the daemon is durable nowhere: before settling, one stat
each says whether the files at their paths are still the ones mapped
(Env.file_fault); if not, the batch is reported not durable, the tier
degrades, and the pack is replaced at once, the index healed (rebuilt from
the blobs; repair.py). A blob whose fsync fails is removed and dropped,
never indexed; if the index refuses a write mid-batch, blobs written but
not yet indexed are removed and the rest of the batch dropped, counted
(`_index_refused`). `close(timeout)` stops writing at its deadline
(`writes_stopped`): the batch in hand commits what is already written, and
the rest is left (`abandoned`).

Once the index outgrows the page cache, each random insert would wait for
a disk read of its own, one after another: so while batches cause page
faults that wait for the disk, a batch has its index pages read in first
by helper threads, several at a time (`Env.prefetch`). (The pack's inserts
append at its right edge, pack.py: none of its pages wait to be read.)

Everything here runs on the writer thread.
"""

from __future__ import annotations

import logging
import resource
from typing import Callable

import lmdb

from kvd.store.base import BOUNDARY, Entry, as_stored
from kvd.store.courtesy import never
from kvd.store.datadir import BLOB_DIR, eid_of_blob, ensure_folder
from kvd.store.pools import OrInline
from kvd.store.ssd import blobfile
from kvd.store.ssd.blobfile import Altered, Unencodable
from kvd.store.ssd.budget import DISK_ERRNOS
from kvd.store.ssd.index import Row
from kvd.store.ssd.pack import PACKED, pack_key, packed_disk_bytes, slot_of

log = logging.getLogger("kvd.store.ssd")

# Blob writes failing one after another with the same other errno (ENOENT,
# EACCES, ...): past this many it is the folder or the disk, not one path.
PATH_ERRORS_DEGRADE = 3


class _Progress:
    """How far a batch got: the index of the entry in hand (`at`), what it
    wrote and has not committed yet (`written`, their ids `ids`, and the
    disk bytes those take, `planned`), and how many rows its commits stored
    (`committed`). `ids` is kept as `written` grows: made afresh for each
    entry, it cost a batch of 8,000 tiny chunks 2.5 s of the writer's 3.4."""

    __slots__ = ("at", "written", "ids", "planned", "committed")

    def __init__(self) -> None:
        self.at = 0
        self.written: list[tuple[bytes, Row]] = []
        self.ids: set[bytes] = set()
        self.planned = 0
        self.committed = 0

    def add(self, eid: bytes, row: Row) -> None:
        self.written.append((eid, row))
        self.ids.add(eid)

    def clear(self) -> None:
        """What was written so far is committed."""
        self.written, self.ids, self.planned = [], set(), 0


class Batch:
    """`write_batch` and its steps (writer thread); mixed into `SsdStore`."""

    def _init_batch(self, pack_max_bytes: int, durable: bool) -> None:
        self.durable = durable
        self.pack_max_bytes = int(pack_max_bytes)  # blobs up to this size go to the pack (pack.py)
        self._packing: dict[bytes, bytes] = {}  # a batch's packed blobs, until synced
        self._syncing: dict = {}  # a batch's blob files whose fsync has begun: path -> future (_synced)
        # Told after every batch which of its entries are now durable
        # ((eid, True)) or were dropped ((eid, False)), with the degraded
        # reason if any; called on the writer thread (spill.py, ordering rule).
        self.on_settled: Callable[[list[tuple[bytes, bool]], str | None], None] | None = None
        self.writes_stopped = False  # close() ran out of time: write nothing more
        self.abandoned: list[Entry] = []  # entries a stopped writer left unwritten
        self._pool: OrInline | None = None  # the writer's helper threads (_threads)
        self.prefetching = False  # read a batch's pages in ahead (write_batch)
        self.major_faults: Callable[[], int] = _major_faults
        self.courtesy: Callable[[], None] = never  # the writer's pause point between entries (kvd.store.courtesy)
        self._errnos_logged: set[int | None] = set()
        self._path_errors: tuple[int | None, int] = (None, 0)  # one errno, how many writes in a row
        self._unsettled: set[bytes] = set()  # of the batch in hand: committed, yet not durable (_check_files)

    def write_batch(self, batch: list[Entry]) -> None:
        """Write `batch` (the steps are in the module docstring). Drops are
        counted, never raised; an error not the disk's propagates (the writer
        takes the batch again)."""
        done = _Progress()
        faults = self.major_faults()
        degrades = self._degrades
        try:
            ests = self._prepare(batch)
            for done.at, entry in enumerate(batch):
                if self.writes_stopped:
                    # close() is out of time: commit what is written, leave the rest.
                    self.abandoned.extend(batch[done.at:])
                    break
                self._write_one(entry, ests[done.at], batch, done)
                self.courtesy()
            if done.written:
                done.committed += self._commit(self._synced(done.written, batch))
            if done.committed:
                self._check_files(batch)
            # Recovered only once the disk took something: an encoded blob in
            # memory proves nothing (a full disk flapped "recovered"/"degraded").
            if done.committed and self._degrades == degrades:
                self._recover()
        except lmdb.Error as exc:
            self._index_refused(exc, batch, done)
        except BaseException:
            # Not the disk's (the writer takes the batch again): blobs the pack
            # took in may now be in slots no row will name.
            self.pack.orphan_free = False
            raise
        finally:
            self._packing.clear()
            self._syncing.clear()
            if self._riding:  # no commit carried them: recorded again, for the next one (or idle's)
                self._untake_touches(self._riding)
                self._riding = {}
        # Read ahead while the batch's pages come from the disk (several a
        # batch: the index has outgrown the page cache), not while they are
        # cached: then the helper threads only cost CPU (~20% of a batch's).
        self.prefetching = self.major_faults() - faults >= max(1, len(batch) // 8)
        self._note_recency_floor()

    def _prepare(self, batch: list[Entry]) -> list[int]:
        """Step 1: ready the batch; returns each entry's estimated disk bytes."""
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
            # a batch of 64, ~0.4 s. Each entry still checks (`_admit`): an
            # estimate, or a lease in the way, may leave some room to make
            # one by one.
            self._make_room(need, set())
        return ests

    def _write_one(self, entry: Entry, est: int, batch: list[Entry], done: _Progress) -> None:
        """Step 2, for one entry: admit it, write its blob, note its row in `done`."""
        now = self._clock()
        if not self._admit(entry, est, now, batch, done):
            return
        wrote = self._write_blob(entry, est)
        if wrote is None:
            return
        info, state = wrote
        done.planned += info.disk_bytes
        if entry.kind == BOUNDARY:
            self.boundary_ns.add(entry.namespace)  # (queued by spill: there already, unless queued directly)
        done.add(entry.id, _row(entry, info, state, now))

    def _admit(self, entry: Entry, est: int, now: float, batch: list[Entry], done: _Progress) -> bool:
        """Whether `entry` may be written now; if not, it is dropped, counted
        with the reason. May commit what the batch wrote so far, when only
        that stands in the way."""
        if self.degraded and now < self._retry_at:
            self._drop(entry, "degraded")
            return False
        if est > self.budget_bytes:
            self._drop(entry, "too_big")
            return False
        if not self._space_ok(est):
            self._drop(entry, "low_space")
            return False
        if self.quotas is not None and not self.quotas.make_room_ssd(self, entry, est, done.written):
            # As below: this batch's own uncommitted blobs of the group may
            # be what stands in the way (a commit only for those: a synced
            # commit per chunk had slowed the writer for everyone).
            fits = False
            if self.quotas.pending_in_group(entry, done.written):
                self._commit_so_far(batch, done)
                fits = self.quotas.make_room_ssd(self, entry, est, done.written)
            if not fits:
                self._drop(entry, "quota")
                return False
        if not self._make_room(est + done.planned, protect=done.ids):
            # Perhaps only this batch's own uncommitted blobs stand in the
            # way (a batch bigger than the budget): commit them, so they
            # become evictable like any other, and try once more.
            if done.written:
                self._commit_so_far(batch, done)
            if not self._make_room(est, set()):
                self._drop(entry, "budget_leased")
                return False
        return True

    def _commit_so_far(self, batch: list[Entry], done: _Progress) -> None:
        """Sync and commit what the batch wrote so far, mid-batch."""
        done.committed += self._commit(self._synced(done.written, batch))
        done.clear()

    def _write_blob(self, entry: Entry, est: int) -> tuple[blobfile.BlobInfo, str] | None:
        """Encode `entry` for the pack, or write its file (not synced yet:
        `_synced` does it for the whole batch). Its blob info and row state;
        None if it could not be (dropped, counted)."""
        eid = entry.id
        try:
            if est <= self.pack_max_bytes:
                # Bytes in a shared-memory slot are packed from a checked
                # private copy: what a process wrote into the slot after
                # COMMIT never lands. (A file is written from the slot and
                # checked as it is written: write_blob, Altered.)
                whole = as_stored(entry)
                if whole is None:
                    raise Altered("changed in its shared-memory slot after COMMIT")
                # Into the pack (pack.py), with the batch's others, at _synced.
                buf, checksum = blobfile.encode_blob(whole)
                self._packing[eid] = buf
                info = blobfile.BlobInfo(len(buf), packed_disk_bytes(len(buf)), checksum)
                state = PACKED
            else:
                # Synced before any row commits (_synced); its fsync starts
                # now, while the writer goes on with the batch's next blob.
                path = self.path(eid)
                info = blobfile.write_blob(path, entry, durable=False)
                state = "ssd"
                if self.durable:
                    self._syncing[path] = blobfile.start_sync(path, self._threads())
        except Altered:
            log.warning("ssd: %s not written: its shared-memory bytes changed after they were stored", eid.hex())
            self._drop(entry, "altered")
            return None
        except Unencodable as exc:
            log.error("ssd: cannot store %s: %s", eid.hex(), exc)
            self._drop(entry, "unencodable")
            return None
        except OSError as exc:
            self._write_failed(entry, exc)
            return None
        self._path_errors = (None, 0)
        return info, state

    def _index_refused(self, exc: lmdb.Error, batch: list[Entry], done: _Progress) -> None:
        """The index refused a write mid-batch (LMDB on a full disk, most
        often). Blobs written but not yet indexed must not stay on disk, and
        every entry of the batch not yet stored is dropped, counted."""
        self._count("write_errors")
        self._degrade(f"index write failed: {exc}")
        unindexed = {eid for eid, _ in done.written}
        self._discard(done.written)
        for entry in batch[:done.at]:
            if entry.id in unindexed:
                self._drop(entry, "write_error")
        for entry in batch[done.at:]:
            self._drop(entry, "write_error")

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
        if self._file_faults() is not None:
            self._unsettled.update(e.id for e in batch)

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
            started = {f: self._syncing.pop(f) for f in files if f in self._syncing}
            failed = blobfile.sync_group(files, {f.parent for f in files} | {self.root / BLOB_DIR}, self._threads(),
                                         started)
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
            added, pause = [], self.courtesy
            for eid, row in written:
                if self.index.put_row(txn, eid, row):
                    added.append((eid, row))
                pause()
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


def _row(entry: Entry, info: blobfile.BlobInfo, state: str, now: float) -> Row:
    """The index row of `entry`, written as `info` says, into `state` ("ssd" or PACKED)."""
    return Row(
        ns=entry.namespace, kind=entry.kind, parent=entry.parent, start=entry.start,
        length=entry.length, tail=entry.tail, nbytes=entry.nbytes, file_size=info.file_size,
        disk_bytes=info.disk_bytes, checksum=info.checksum, fmt=blobfile.FORMAT_VERSION,
        tensors=[[t.name, t.dtype, list(t.shape)] for t in entry.tensors], atime=now, state=state,
    )


def _major_faults() -> int:
    """Page faults this process has waited on a disk read for (Linux and macOS)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt
