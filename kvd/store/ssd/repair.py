"""Quarantine and repair: what the SSD tier does with damage it meets.

Theory of operation
-------------------
A blob that fails its checksum, a file that is not a blob (a FIFO, a
folder, a symlink), a blob gone while its row stays, a row whose bytes do
not decode or hold a field out of bounds (index.Row.check): whoever meets it (a read on the daemon thread, an eviction, a
check) hides the entry at once (`_mark_bad`: `_bad`, which every lookup
consults) and submits its quarantine to the writer, which drops its row
and moves its blob into the quarantine folder (`_quarantine_now`,
`_quarantine_blob`). Rows that do not decode are mended together
(`_repair_rows`): dropped with every trace (`Index.drop_damaged`, one scan
of the index for all of them), then each blob is read: one that passes its
own checksum (kvd_sum) gets its row back from what it carries (counted in
`rows_repaired`, served again at once), any other is quarantined.

Damage LMDB itself reports is a heal (heal.py): `want_heal` has the writer
move the index aside and rebuild it from the blobs (`_heal_now`), serving
misses meanwhile; what was hidden for a bad row then is forgotten, since
the rebuild checks every blob anyway. An index or pack whose file was
removed or replaced under the daemon (`_file_faults`, looked at after every
batch and on the writer's tick) is healed, or replaced at once (the pack).
"""

from __future__ import annotations

import logging

import lmdb

from kvd.store.ssd import heal
from kvd.store.ssd.blobfile import BlobCorrupt
from kvd.store.ssd.index import IndexBusy, Row, RowDamaged
from kvd.store.ssd.pack import PACKED, pack_key

log = logging.getLogger("kvd.store.ssd")


class Repair:
    """Hiding, quarantining and mending damaged entries; healing the index; mixed into `SsdStore`."""

    def _init_repair(self) -> None:
        self._bad: dict[bytes, str] = {}  # eid -> reason, awaiting quarantine
        self._bad_rows_told = False  # a bad row was logged since the last sweep (_repair_rows sums up the rest)
        self._heal_wanted: str | None = None  # damage found while running: heal on the writer

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

    def want_heal(self, reason: str) -> bool:
        """The index is damaged (found while running): have the writer move it
        aside and rebuild it from the blobs, serving misses meanwhile. True if
        this asked for a heal; False if one is asked for or under way already."""
        # During a rebuild the damage is that of the index just replaced (a
        # reader that met it as it went): nothing more to do.
        if self._heal_wanted is None and self._rebuild is None and self.writer.alive:
            self._heal_wanted = reason
            with self.queue.cond:  # wake the writer
                self.queue.cond.notify_all()
            return True
        return False

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
        new.bounds = self.row_bounds
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

    def _file_faults(self) -> str | None:
        """Replace the pack or heal the index if its file is not the one it
        maps any more; what was wrong, or None. Writer thread. Whoever finds
        it (a batch's check or the writer's tick), what was committed there is
        lost: the tier degrades, counted in `files_replaced`, so the next
        writes wait for the retry like after any other fault of the disk."""
        why = None
        fault = self.pack.file_fault()
        if fault is not None:
            why = f"the pack's data.mdb {fault}"
            self._replace_pack(why)
        fault = self.index.file_fault()
        if fault is not None:  # until the heal has swapped it, every batch goes into that file
            why = f"the index's data.mdb {fault}"
            if self.want_heal(why):  # (found again until the heal swaps it in: counted once)
                self._count("files_replaced")
        if why is not None:
            self._degrade(why)
        return why

    def _replace_pack(self, why: str) -> None:
        old = self.pack
        try:
            self.pack = heal.replace_pack(self.root, why, map_size=old.map_size)
        except (OSError, lmdb.Error) as exc:
            self._degrade(f"cannot replace the pack: {exc}")
            return
        old.retire()
        self._count("files_replaced")
        # Rows that named the old pack's blobs name nothing now: reconcile drops them.
        if self._reconcile is None:
            self._reconcile = self._reconcile_steps({})
            self.reconciled.clear()

    def _repair_damaged(self) -> None:
        """Rows some reader found undecodable (eviction, a drop, a check):
        hidden and quarantined like a bad read."""
        for eid in list(self.index.damaged):
            if eid not in self._bad:
                self._mark_bad(eid, "bad row: undecodable index row")
            self.index.damaged.discard(eid)

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
        its file), if the blob passes its own checksum and that row is sane
        here (Row.check: a blob larger than this tier takes is not served);
        None if not (or it predates kvd_sum, or is gone)."""
        try:
            if key is not None:
                row, verified = heal.recover_packed(self.pack, key, atime=self._clock())
            else:
                row, verified = heal.recover_row(self.path(eid), eid, self.index.bounds.max_blob_bytes)
            row.check(self.index.bounds)
        except (BlobCorrupt, RowDamaged, OSError, lmdb.Error):
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
