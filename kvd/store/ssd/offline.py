"""Stats and GC on a data dir while no daemon runs (`kvd stats/gc --offline`).

`stats` opens the LMDB index read-only and takes no lock, so it also works
beside a running daemon (LMDB readers never block the writer). `gc` mutates,
so it takes the data-dir lock exactly as the daemon does -- and therefore
refuses (DataDirBusy) while a daemon runs; use the online `kvd gc` then.
Both run the very code the daemon runs (`SsdStore` with no writer thread),
so offline and online GC cannot disagree about what is garbage.

`progress(phase, done, total)` is called as work advances; phases are
"blobs" (shards walked), "rows" (rows checked), "pack" (the pack's keys
looked through, after a crash only), "verify" (blobs read).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from kvd.store.datadir import PACK_DIR, QUARANTINE_DIR, DataDirLock
from kvd.store.ssd.heal import IndexDamaged, open_readonly

Progress = Callable[[str, int, int], None]


def _quarantine_usage(root: Path) -> tuple[int, int]:
    n = nbytes = 0
    qdir = root / QUARANTINE_DIR
    if qdir.is_dir():
        for entry in os.scandir(qdir):  # a symlink is a name there, never followed (admin.purge)
            n += 1
            try:
                nbytes += entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                pass
    return n, nbytes


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stats(data_dir: str | os.PathLike) -> dict[str, Any]:
    """Entries, bytes and per-namespace usage of the data dir, read-only.

    Returns {"entries", "bytes", "namespaces": {ns: {entries, bytes}},
    "quarantine": {files, bytes}, "index": {map_size, used_bytes}, "pack": {file_bytes} (the
    pack of small blobs, pack.py), "locked_by": pid of a live holder (likely the daemon) or None}.
    Raises FileNotFoundError if `data_dir` holds no kvd index, IndexDamaged
    if its index is damaged (see heal.py).
    """
    root = Path(data_dir)
    index = open_readonly(root)  # IndexDamaged rather than a SIGBUS on a truncated file
    try:
        with index.reading() as txn:
            try:
                entries, nbytes = index.totals(txn)
            except (ValueError, TypeError) as exc:  # another process's garbage: what a start heals
                raise IndexDamaged(f"its totals record does not decode ({exc})") from None
            namespaces = index.namespaces(txn)
        info = index.info()
    finally:
        index.close()
    qn, qb = _quarantine_usage(root)
    try:
        pack_bytes = (root / PACK_DIR / "data.mdb").stat().st_size
    except OSError:
        pack_bytes = 0
    # Report the lock holder without touching the lock: even a brief probe
    # could make a daemon starting at that instant fail with DataDirBusy.
    holder = DataDirLock(root).holder()
    if holder is not None and not _alive(holder):
        holder = None
    return {
        "data_dir": str(root),
        "entries": entries,
        "bytes": nbytes,
        "namespaces": dict(sorted(namespaces.items())),
        "quarantine": {"files": qn, "bytes": qb},
        "index": info,
        "pack": {"file_bytes": pack_bytes},
        "locked_by": holder,
    }


def gc(
    data_dir: str | os.PathLike,
    *,
    namespace: str | None = None,
    older_than: float | None = None,
    budget_bytes: int | None = None,
    orphans: bool = True,
    verify: bool = False,
    quarantine: bool = False,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Collect garbage in a stopped daemon's data dir. Each step is optional:

    orphans      remove temp files, blobs without rows, rows without blobs
    verify       read every blob, quarantining those failing their checksum
    namespace / older_than   drop matching entries (as `Store.drop`)
    budget_bytes evict LRU entries down to this many bytes on disk
    quarantine   delete the quarantined blobs

    Returns a report of what was (with dry_run: would be) removed. Raises
    DataDirBusy if a daemon holds the data dir; with dry_run, IndexDamaged
    (or FileNotFoundError) for an index it would have to heal (or make).
    """
    from kvd.store.ssd import SsdStore  # deferred: stats() stays import-light

    report: dict[str, Any] = {"dry_run": dry_run}
    if dry_run:
        # Opening the store heals a damaged index (moved aside, rebuilt): not
        # what a dry run may do. Such an index is IndexDamaged here, as for
        # `kvd stats --offline`; a missing one FileNotFoundError.
        open_readonly(Path(data_dir)).close()
    store = SsdStore(data_dir, 1 << 62, min_free_bytes=0, background=False, reconcile=False)
    try:
        if orphans:
            report["reconcile"] = store.reconcile(dry_run=dry_run, progress=progress)
        if verify:
            report["verify"] = _verify(store, dry_run, progress)
        if namespace is not None or older_than is not None:
            n, b = store.drop(namespace=namespace, older_than=older_than, dry_run=dry_run)
            report["dropped"] = {"entries": n, "bytes": b}
        if budget_bytes is not None:
            n, b = store.evict(budget_bytes, dry_run=dry_run)
            report["evicted"] = {"entries": n, "bytes": b}
        if quarantine:
            n, b = store.purge_quarantine(dry_run=dry_run)
            report["quarantine_purged"] = {"files": n, "bytes": b}
        report["entries"], report["bytes"] = store.entries, store.bytes
    finally:
        store.close()
    return report


def _verify(store, dry_run: bool, progress: Progress | None) -> dict[str, int]:
    """Every blob read back against its checksum (`SsdStore.check`); failures
    are quarantined unless `dry_run`."""
    def step(done: int, total: int) -> None:
        if progress and (done % 256 == 0 or done == total):
            progress("verify", done, total)

    report = store.check(verify=True, progress=step)
    if not dry_run:
        for eid, _ in report.bad:
            store.verify_blob(eid)  # fails again, and is quarantined
    return {"checked": report.rows, "bad": len(report.bad)}


def repair(data_dir: str | os.PathLike) -> dict[str, Any]:
    """Rebuild a stopped daemon's index from its blobs (`kvd verify --repair`):
    the index is moved aside whatever its state, every blob is read and
    checked, bad ones are quarantined. Returns the rebuild's report
    (heal.Heal.stats()). Raises DataDirBusy if a daemon holds the data dir."""
    from kvd.store.ssd import SsdStore  # deferred: stats() stays import-light

    store = SsdStore(data_dir, 1 << 62, min_free_bytes=0, background=False, reconcile=False,
                     rebuild="kvd verify --repair")
    try:
        report = store.heal.stats()
        report["entries"], report["bytes"] = store.entries, store.bytes
    finally:
        store.close()
    return report
