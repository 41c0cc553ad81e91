"""The pack: small blobs in one LMDB file instead of a file each.

Why. Making a file costs far more than writing a few KiB into it: on the
test VM's ext4 ~100-200 us per inode before any fsync, and each file wants
its own fsync. With 256-token chunks of a small model (4-16 KiB) the SSD
writer was bound by file creation (~850 blobs/s inside the daemon, ~2 k/s
alone). A batch of packed blobs is one LMDB transaction and one fsync
(~40 k values of 8 KiB/s on the same disk).

What. For every entry whose blob is at most `pack_max_bytes`, the pack holds
the very bytes its blob file would hold (`blobfile.encode_blob`: safetensors,
`kvd_sum` included), keyed by entry id; its index row says so
(`Row.state == "pack"`). A read copies the value out inside its read
transaction and checks it against the row's size and checksum, as a file
read does.

Rules, as for blob files (index.py): a packed blob is committed (synced)
before its row; a row is deleted (committed) before its packed blob. LMDB's
MVCC keeps a value a reader is copying unchanged while a delete commits.

Damage. The pack is its own environment, apart from the index: a damaged
index is rebuilt from the pack as from the files (heal.py), and a damaged
pack costs only the entries in it. One that LMDB must not map (see
`heal.inspect_data_file`) is moved aside at start (`pack.bad-<UTC time>`)
and a new one made; the rows that named it then name nothing, and reconcile
removes them (counted in `rows_repaired`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from kvd.store.blobfile import fsync_dir
from kvd.store.lmdbenv import DEFAULT_MAP_SIZE, Env

PACKED = "pack"  # Row.state of an entry whose blob is in the pack
CLEAN = "clean"  # in the pack's folder while closed cleanly with no blob lacking a row
BLOCK = 4096


def packed_disk_bytes(size: int) -> int:
    """What a packed blob of `size` bytes is charged: LMDB keeps a value over
    half a page on pages of its own (overflow pages), so whole pages."""
    return -(-(size + 16) // BLOCK) * BLOCK


class Pack(Env):
    """The LMDB environment at `path` holding packed blobs (one table, `blobs`)."""

    def __init__(self, path: str | Path, *, readonly: bool = False, map_size: int = DEFAULT_MAP_SIZE):
        super().__init__(path, readonly=readonly, map_size=map_size, max_dbs=2)
        try:
            self.blobs = self.env.open_db(b"blobs", create=not readonly)
        except BaseException:
            self.env.close()
            raise
        # No blob without a row is in it: the last process to write it said so
        # at a clean close, or reconcile has looked through it since (it sets
        # this). The mark is taken away now, and put back by a clean close.
        self.orphan_free = False
        if not readonly:
            try:
                os.unlink(self.path / CLEAN)
                self.orphan_free = True
                fsync_dir(self.path)
            except FileNotFoundError:
                pass

    def close(self, *, clean: bool = False) -> None:
        """Close; `clean`: every write is committed and none is coming (a
        clean stop). Marked so only if also `orphan_free`."""
        self.env.close()
        if clean and self.orphan_free and not self.readonly:
            try:
                with open(self.path / CLEAN, "wb") as f:
                    os.fsync(f.fileno())
                fsync_dir(self.path)
            except OSError:  # a full disk: the next start looks for orphans, that is all
                pass

    def read(self, eid: bytes, alloc: Callable[[int], Any] | None = None) -> Any:
        """A copy of `eid`'s blob (into `alloc(size)` if given and it gives
        one, else bytes), or None if the pack does not hold it. Raises
        IndexBusy while the map grows, lmdb.Error if the pack is damaged."""
        with self.reading(buffers=True) as txn:
            view = txn.get(eid, db=self.blobs)
            if view is None:
                return None
            buf = alloc(len(view)) if alloc is not None else None
            if buf is None:
                return bytes(view)
            memoryview(buf).cast("B")[:] = view
            return buf

    def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> None:
        """Commit these (entry id, blob bytes) in one synced transaction."""
        items = list(items)

        def put(txn):
            for eid, buf in items:
                txn.put(eid, buf, db=self.blobs)

        self.write(put)

    def delete_many(self, eids: Iterable[bytes]) -> int:
        """Delete these blobs in one transaction. Returns how many were there."""
        eids = list(eids)
        return self.write(lambda txn: sum(bool(txn.delete(eid, db=self.blobs)) for eid in eids))

    def keys_after(self, last: bytes | None, n: int) -> tuple[list[bytes], bool]:
        """Up to `n` entry ids after `last` (from the first if None), in key
        order, and whether more follow: for walks in small steps."""
        out: list[bytes] = []
        with self.reading(buffers=True) as txn:
            cur = txn.cursor(db=self.blobs)
            ok = cur.set_range(last) if last is not None else cur.first()
            if ok and last is not None and bytes(cur.key()) == last:
                ok = cur.next()
            while ok and len(out) < n:
                out.append(bytes(cur.key()))
                ok = cur.next()
        return out, bool(ok)

    def keys_between(self, lo: bytes | None, hi: bytes | None) -> list[bytes]:
        """The entry ids k with lo < k <= hi, in order (None: no bound on that side)."""
        out: list[bytes] = []
        with self.reading(buffers=True) as txn:
            cur = txn.cursor(db=self.blobs)
            ok = cur.set_range(lo) if lo is not None else cur.first()
            while ok:
                key = bytes(cur.key())
                if hi is not None and key > hi:
                    break
                if key != lo:
                    out.append(key)
                ok = cur.next()
        return out

    def iter_keys(self, step: int = 4096) -> Iterator[bytes]:
        """Every entry id, `step` per read transaction."""
        last = None
        while True:
            keys, more = self.keys_after(last, step)
            yield from keys
            if not more or not keys:
                return
            last = keys[-1]

    def __len__(self) -> int:
        with self.reading() as txn:
            return txn.stat(self.blobs)["entries"]

    def file_bytes(self) -> int:
        """Bytes the pack's file takes (it grows, and reuses freed pages; it never shrinks)."""
        try:
            return (self.path / "data.mdb").stat().st_size
        except OSError:
            return 0
