"""The SSD tier's consistency check: do the index and the blobs agree?

One check, used by `SsdStore.check()`, `kvd verify`, and the crash and
disk-full tests (python-diskcache's `Cache.check` plays the same part). It
only reads: an LMDB read transaction, a directory walk, and -- with
`verify` -- every blob read back against its checksum.

What a consistent data dir looks like:
  1. every row's blob exists (its file, or in the pack) and (with
     `verify`) matches its checksum;
  2. every blob, file or packed, has a row (no orphans), and no temp file
     is left behind;
  3. the LRU order lists exactly the rows, once each;
  4. the totals row equals the rows' count and summed disk bytes;
  5. every row is in the current blob format.

`live=True` is for a data dir a running daemon is writing: temp files,
orphans and totals are then moments of a write in flight, not faults, so
only (1) is reported, and a blob whose row vanished meanwhile (evicted) is
not a failure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvd.store.ssd import blobfile
from kvd.store.datadir import blob_path, eid_of_blob, is_temp_name, shard_folders
from kvd.store.ssd.index import Index, RowDamaged
from kvd.store.ssd.pack import PACKED, Pack, eid_of, pack_key

Progress = Callable[[int, int], None]


@dataclass
class CheckReport:
    """What `check` found. `ok` is True when nothing is wrong."""

    rows: int = 0
    checked: int = 0  # blobs read back against their checksum
    bad: list[tuple[bytes, str]] = field(default_factory=list)  # (entry id, "missing" | "corrupt: ...")
    orphans: list[bytes] = field(default_factory=list)  # blobs without a row
    temps: list[str] = field(default_factory=list)  # temp files of unfinished writes
    problems: list[str] = field(default_factory=list)  # index-level disagreements, in words

    @property
    def ok(self) -> bool:
        return not (self.bad or self.orphans or self.temps or self.problems)

    def summary(self) -> dict[str, object]:
        return {
            "rows": self.rows, "checked": self.checked, "bad": len(self.bad), "orphans": len(self.orphans),
            "temps": len(self.temps), "problems": list(self.problems),
        }


def check(
    root: Path, index: Index, *, pack: Pack | None = None, verify: bool = True, live: bool = False,
    pending: Callable[[bytes], bool] = lambda eid: False, progress: Progress | None = None,
) -> CheckReport:
    """Check the data dir at `root` against `index` and `pack` (the pack of
    small blobs, pack.py; None if there is none) -- see module docstring.

    `pending(eid)` says an entry is queued for writing (its blob may exist
    before its row). `progress(done, total)` is called as rows are checked.
    """
    from kvd.store.ssd.blobfile import FORMAT_VERSION

    report = CheckReport()
    with index.reading() as txn:
        rows = dict(index.iter_rows(txn))
        lru = [eid for _, eid in index.oldest(txn)]
        totals = index.totals(txn)
    report.rows = len(rows)
    for i, (eid, row) in enumerate(rows.items()):
        if row.state == PACKED:
            reason = _check_packed(pack, eid, row, verify)
        else:
            reason = _check_blob(blob_path(root, eid), row, verify)
        if verify and reason != "missing":
            report.checked += 1
        if reason is not None:
            if live:
                with index.reading() as txn:
                    if _moved(index, txn, eid, row):
                        reason = None  # evicted (and perhaps stored again) while we looked: not a failure
            if reason is not None:
                report.bad.append((eid, reason))
        if progress is not None:
            progress(i + 1, len(rows))
    if live:
        return report
    for shard in shard_folders(root):
        for name in os.listdir(shard):
            if is_temp_name(name):
                report.temps.append(str(shard / name))
                continue
            eid = eid_of_blob(name)
            if eid is not None and eid not in rows and not pending(eid):
                report.orphans.append(eid)
    packed = [key for key in (pack.iter_keys() if pack is not None else ())
              if not _names(rows.get(eid_of(key)), key) and not pending(eid_of(key))]
    if report.orphans or packed:
        # A blob written and indexed after the rows were read is not an orphan.
        with index.reading() as txn:
            report.orphans = [eid for eid in report.orphans if not index.has(txn, eid)]
            report.orphans += [eid_of(key) for key in packed if _unnamed(index, txn, key)]
    if len(lru) != len(rows) or set(lru) != set(rows):
        report.problems.append(f"the LRU order lists {len(lru)} entries ({len(set(lru))} distinct) for {len(rows)} rows")
    want = (len(rows), sum(r.disk_bytes for r in rows.values()))
    if tuple(totals) != want:
        report.problems.append(f"the totals row says {tuple(totals)} (entries, bytes); the rows add up to {want}")
    old = sum(1 for r in rows.values() if r.fmt != FORMAT_VERSION)
    if old:
        report.problems.append(f"{old} rows are in a blob format other than {FORMAT_VERSION}")
    return report


def _names(row, key: bytes) -> bool:
    """Does `row` name the packed blob at `key`?"""
    return row is not None and row.state == PACKED and pack_key(eid_of(key), row.slot) == key


def _moved(index: Index, txn, eid: bytes, row) -> bool:
    """The entry `row` described has no row now, or one naming another blob."""
    try:
        now = index.get(txn, eid)
    except RowDamaged:
        return False
    return now is None or (now.state, now.slot) != (row.state, row.slot)


def _unnamed(index: Index, txn, key: bytes) -> bool:
    """No row names the packed blob at `key` (a row that does not decode may: not an orphan)."""
    try:
        return not _names(index.get(txn, eid_of(key)), key)
    except RowDamaged:
        return False


def _check_packed(pack: Pack | None, eid: bytes, row, verify: bool) -> str | None:
    buf = pack.read(pack_key(eid, row.slot)) if pack is not None else None
    if buf is None:
        return "missing"
    if verify:
        try:
            blobfile.checked_blob(buf, row.file_size, row.checksum)
        except blobfile.BlobCorrupt as exc:
            return f"corrupt: {exc}"
    return None


def _check_blob(path: Path, row, verify: bool) -> str | None:
    try:
        fd = blobfile.open_blob(path)  # a FIFO under the name: corrupt, never a hang
    except FileNotFoundError:
        return "missing"
    except (blobfile.BlobCorrupt, OSError) as exc:
        return f"corrupt: {exc}"
    try:
        if verify:
            blobfile.read_blob(fd, row.file_size, row.checksum)
    except (blobfile.BlobCorrupt, OSError) as exc:
        return f"corrupt: {exc}"
    finally:
        os.close(fd)
    return None
