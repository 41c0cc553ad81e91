"""Reconcile: make the SSD tier's directory and its index agree again.

After a crash (or a hand-deleted file, a restored backup) three kinds of
debris can exist: temp files of writes that never finished, blobs whose
index row was never committed (orphans: files, or values in the pack of
small blobs), and rows whose blob is gone. The
write order (blob durable before its row; row deleted before its blob)
means none of them can hold a byte that was ever served, so removing them is
always safe. The work is a generator of small steps, so the writer thread
can interleave it with spills and the daemon serves from the first moment.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Callable, Iterator

from kvd.store.datadir import BLOB_DIR, eid_of_blob, is_temp_name, shard_folders
from kvd.store.ssd import heal
from kvd.store.ssd.index import Row, RowDamaged
from kvd.store.ssd.pack import PACKED, eid_of, pack_key

if TYPE_CHECKING:
    from kvd.store.ssd import SsdStore

log = logging.getLogger("kvd.store.ssd")

Progress = Callable[[str, int, int], None]


def reconcile_steps(
    store: "SsdStore", report: dict[str, int], dry_run: bool = False, progress: Progress | None = None
) -> Iterator[None]:
    """Remove temp files, blobs without rows and rows without blobs, a
    little per step. Must run on the writer thread (or with none running):
    then no blob is being written while a step looks at the directory."""
    for key in ("temps_removed", "orphans_removed", "rows_repaired", "temp_bytes", "orphan_bytes"):
        report.setdefault(key, 0)
    # A blob without a row is an orphan only once the index is whole: while
    # a rebuild is unfinished (one that died, say) it is an entry not indexed yet.
    keep_orphans = heal.unfinished(store.index)
    if keep_orphans:
        report["orphans_kept"] = 1
        log.warning("ssd: the index's rebuild is unfinished; reconcile removes no blob for want of a row")
    try:
        shards = shard_folders(store.root)
    except OSError as exc:
        log.warning("ssd: reconcile cannot list %s (%s); no blob removed", store.root / BLOB_DIR, exc)
        shards = []
    for i, shard in enumerate(shards):
        try:
            names = os.listdir(shard)
        except OSError as exc:  # unreadable (its mode changed by hand): its blobs stay as they are
            log.warning("ssd: reconcile cannot list %s (%s); left as it is", shard, exc)
            names = []
        for n, name in enumerate(names, 1):
            if n % 512 == 0:
                # A step of a few ms (a shard holds ~4k blobs at 1 M): the writer
                # holds the GIL while it looks. Between steps a batch may write
                # or evict blobs of this shard: a name listed earlier is then
                # found with its row, or gone (FileNotFoundError below).
                yield
            path = shard / name
            if is_temp_name(name):
                kind = "temp"
            else:
                eid = eid_of_blob(name)
                if eid is None or keep_orphans or eid in store.queue or store.has_row(eid):
                    continue
                kind = "orphan"
            try:
                size = path.stat().st_size
                if not dry_run:
                    os.unlink(path)
            except FileNotFoundError:
                continue
            report[f"{kind}s_removed"] += 1
            report[f"{kind}_bytes"] += size
            if not dry_run:
                store.count(f"{kind}s_removed")
        if progress:
            progress("blobs", i + 1, len(shards))
        yield
    # Rows whose blob is gone, then packed blobs no row names. Our own write
    # order never makes a row without its blob (rows die before blobs, blobs
    # are born before rows): those come from outside -- a blob deleted by
    # hand, a restored backup, a damaged pack moved aside. Packed orphans
    # come from a crash between the pack's commit and the index's: after a
    # clean stop (`Pack.orphan_free`) there are none, and the rows say which
    # blobs are packed, so the pack is not looked at at all (on a cold page
    # cache its pages are random reads: minutes at a million entries).
    # Otherwise each step takes 512 rows and asks the pack for the keys they
    # name (no value is read), and the pack's keys are walked after, 512 a
    # step: its key says whose blob each is (pack.py), and a blob is an
    # orphan unless that entry's row names that very key. An older kvd's
    # table, keyed by entry id, is in id order as the rows are: a step takes
    # its keys of the same id range.
    pack = store.pack
    trust = pack is None or pack.orphan_free
    prev: bytes | None = None  # ids up to this one are done
    done = 0
    total = store.entries
    while True:
        rows: list[tuple[bytes, Row | None]] = []
        with store.index.reading() as txn:
            cur = txn.cursor(db=store.index.rows)
            ok = cur.set_range(prev) if prev is not None else cur.first()
            if ok and prev is not None and bytes(cur.key()) == prev:
                ok = cur.next()
            while ok and len(rows) < 512:
                eid = bytes(cur.key())
                rows.append((eid, _row(store.index, eid, cur.value())))
                ok = cur.next()
        hi = rows[-1][0] if ok else None  # the last step takes the old table's keys to its end
        named = {pack_key(eid, row.slot) for eid, row in rows if row is not None and row.state == PACKED}
        if trust:
            held = named
            old: list[bytes] = []
        else:
            held = pack.holds(named)
            # Damaged rows (None) are the writer's to repair, from this very blob.
            named.update(eid for eid, row in rows if row is None)
            old = [k for k in pack.keys_between(prev, hi) if k not in named]
        missing = [eid for eid, row in rows if row is not None and (
            pack_key(eid, row.slot) not in held if row.state == PACKED else not store.path(eid).exists())]
        done += len(rows)
        if missing:
            report["rows_repaired"] += len(missing)
            if not dry_run:
                store.remove_rows(missing, "rows_repaired")
        if not keep_orphans:
            _remove_orphans(store, old, report, dry_run)
        if progress:
            progress("rows", done, total)
        if hi is None:
            break
        prev = hi
        yield
    if trust:
        return
    # A queued entry gets a new slot when written, so a blob of its here is
    # an orphan all the same; one whose row does not decode is left for the
    # writer's repair (which reads the blob), and the pack stays unchecked.
    last: bytes | None = None
    skipped, done, total = 0, 0, len(pack)
    while True:
        keys, more = pack.keys_after(last, 512, old=False)
        orphans = []
        with store.index.reading() as txn:
            for key in sorted(keys, key=eid_of):  # in the index's order
                named = _names(store, txn, key)
                skipped += named is None
                if named is False:
                    orphans.append(key)
        _remove_orphans(store, orphans, report, dry_run)
        done += len(keys)
        if progress:
            progress("pack", done, total)
        if not more or not keys:
            break
        last = keys[-1]
        yield
    if not dry_run and not skipped:
        pack.orphan_free = True  # looked through, orphans removed


def _remove_orphans(store: "SsdStore", keys: list[bytes], report: dict[str, int], dry_run: bool) -> None:
    if not keys:
        return
    report["orphans_removed"] += len(keys)
    report["orphan_bytes"] += sum(len(b) for b in map(store.pack.read, keys) if b is not None)
    if not dry_run:
        store.pack.delete_many(keys)
        store.count("orphans_removed", len(keys))


def _names(store: "SsdStore", txn, key: bytes) -> bool | None:
    """Does the row of the entry whose blob is at `key` name it? None: that
    row does not decode (the writer repairs it, from a blob of the pack's)."""
    eid = eid_of(key)
    try:
        row = store.index.get(txn, eid)
    except RowDamaged:
        return None
    return row is not None and row.state == PACKED and pack_key(eid, row.slot) == key


def _row(index, eid: bytes, raw: bytes) -> Row | None:
    """The row, or None if it is damaged (remembered for the writer to repair)."""
    try:
        return Row.unpack(raw, index.bounds)
    except RowDamaged:
        index.damaged.add(eid)
        return None
