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
    # Packed blobs without rows (pack.py): a crash between the pack's commit
    # and the index's, or a row deleted whose blob delete failed.
    pack = store.pack
    last: bytes | None = None
    while pack is not None:
        keys, more = pack.keys_after(last, 512)
        orphans = [eid for eid in keys if eid not in store.queue and not store.has_row(eid)]
        if orphans:
            size = 0
            for eid in orphans:
                buf = pack.read(eid)
                size += len(buf) if buf is not None else 0
            if not dry_run:
                pack.delete_many(orphans)
                store.count("orphans_removed", len(orphans))
            report["orphans_removed"] += len(orphans)
            report["orphan_bytes"] += size
        if not more or not keys:
            break
        last = keys[-1]
        yield
    # Rows whose blob is gone. Our own write order never makes these
    # (rows die before blobs, blobs are born before rows); they come from
    # outside interference: a blob deleted by hand, a restored backup.
    last = b""
    done = 0
    exists = store.blob_exists
    total = store.entries
    while True:
        missing, seen = [], 0
        with store.index.reading() as txn:
            cur = txn.cursor(db=store.index.rows)
            ok = cur.set_range(last) if last else cur.first()
            while ok and seen < 512:
                eid = bytes(cur.key())
                if eid != last:
                    seen += 1
                    if not exists(eid):
                        missing.append(eid)
                last = eid
                ok = cur.next()
        done += seen
        if missing:
            report["rows_repaired"] += len(missing)
            if not dry_run:
                store.remove_rows(missing, "rows_repaired")
        if progress:
            progress("rows", done, total)
        if not ok or not seen:
            return
        yield
