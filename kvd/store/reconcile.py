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

import os
from typing import TYPE_CHECKING, Callable, Iterator

from kvd.store.datadir import BLOB_DIR, eid_of_blob, is_temp_name
from kvd.store.index import Row, RowDamaged
from kvd.store.pack import PACKED

if TYPE_CHECKING:
    from kvd.store.ssd import SsdStore

Progress = Callable[[str, int, int], None]


def reconcile_steps(
    store: "SsdStore", report: dict[str, int], dry_run: bool = False, progress: Progress | None = None
) -> Iterator[None]:
    """Remove temp files, blobs without rows and rows without blobs, a
    little per step. Must run on the writer thread (or with none running):
    then no blob is being written while a step looks at the directory."""
    for key in ("temps_removed", "orphans_removed", "rows_repaired", "temp_bytes", "orphan_bytes"):
        report.setdefault(key, 0)
    blob_root = store.root / BLOB_DIR
    shards = sorted(p for p in blob_root.iterdir() if p.is_dir()) if blob_root.is_dir() else []
    for i, shard in enumerate(shards):
        for n, name in enumerate(os.listdir(shard), 1):
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
                if eid is None or eid in store.queue or store.has_row(eid):
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
    # Rows whose blob is gone, and packed blobs without rows, in one merge:
    # the index's rows and the pack's keys (pack.py) are both in id order, so
    # each step takes 512 rows and the pack's keys of the same id range. Our
    # own write order never makes a row without its blob (rows die before
    # blobs, blobs are born before rows): those come from outside -- a blob
    # deleted by hand, a restored backup, a damaged pack moved aside. Packed
    # orphans come from a crash between the pack's commit and the index's:
    # after a clean stop (`Pack.orphan_free`) there are none, and the rows say
    # which blobs are packed, so the pack's pages are not read at all (on a
    # cold page cache they are random reads: minutes at a million entries).
    pack = store.pack
    trust = pack is not None and pack.orphan_free
    prev: bytes | None = None  # ids up to this one are done
    done = 0
    total = store.entries
    while True:
        rows: list[bytes] = []
        packed: set[bytes] = set()
        with store.index.reading() as txn:
            cur = txn.cursor(db=store.index.rows)
            ok = cur.set_range(prev) if prev is not None else cur.first()
            if ok and prev is not None and bytes(cur.key()) == prev:
                ok = cur.next()
            while ok and len(rows) < 512:
                eid = bytes(cur.key())
                rows.append(eid)
                if trust and _packed_row(cur.value()):
                    packed.add(eid)
                ok = cur.next()
        hi = rows[-1] if ok else None  # the last step takes the pack's keys to its end
        if pack is not None and not trust:
            packed = set(pack.keys_between(prev, hi))
        missing = [eid for eid in rows if eid not in packed and not store.path(eid).exists()]
        orphans = sorted(packed.difference(rows))
        done += len(rows)
        if missing:
            report["rows_repaired"] += len(missing)
            if not dry_run:
                store.remove_rows(missing, "rows_repaired")
        if orphans:
            report["orphans_removed"] += len(orphans)
            report["orphan_bytes"] += sum(len(b) for b in map(pack.read, orphans) if b is not None)
            if not dry_run:
                pack.delete_many(orphans)
                store.count("orphans_removed", len(orphans))
        if progress:
            progress("rows", done, total)
        if hi is None:
            if pack is not None and not dry_run:
                pack.orphan_free = True  # looked through, orphans removed
            return
        prev = hi
        yield


def _packed_row(raw: bytes) -> bool:
    try:
        return Row.unpack(raw).state == PACKED
    except RowDamaged:
        return True  # not this walk's business: the writer repairs damaged rows
