"""The pack: small blobs in one LMDB file instead of a file each.

Why. Making a file costs far more than writing a few KiB into it: on the
test VM's ext4 ~100-200 us per inode before any fsync, and each file wants
its own fsync. With 256-token chunks of a small model (4-16 KiB) the SSD
writer was bound by file creation (~850 blobs/s inside the daemon, ~2 k/s
alone). A batch of packed blobs is one LMDB transaction and one fsync
(~40 k values of 8 KiB/s on the same disk).

What. For every entry whose blob is at most `pack_max_bytes`, the pack holds
the very bytes its blob file would hold (`blobfile.encode_blob`: safetensors,
`kvd_sum` included); its index row says so (`Row.state == "pack"`) and names
its slot (`Row.slot`). A read copies the value out inside its read
transaction and checks it against the row's size and checksum, as a file
read does.

Slots. A blob's key is its slot -- a number one higher than the highest the
pack holds, 8 bytes big-endian -- then its entry id (41 bytes in all): every
batch appends at the right edge of the B-tree (MDB_APPEND), one leaf and
the path down to it dirtied, whatever the pack's size. Keyed by entry id,
as a pack an older kvd wrote is (its `blobs` table, still read, deleted
from and reconciled), each insert dirtied a random leaf and, past a few
hundred thousand blobs, a random branch page above it: the writer took in
half as many blobs a second at 1 M entries as at 10 k. Recency follows
age, so eviction deletes mostly from the left edge too. The entry id in
the key lets a walk of the keys alone say whose blob each is (reconcile,
`kvd verify`, the index's rebuild) without reading a value; a lookup by
entry id alone (a row that no longer decodes) scans the keys (`find`).
A key of 33 bytes is an entry id in the old table; `pack_key` makes
either from a row.

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
import struct
from pathlib import Path
from typing import Iterable, Iterator

import lmdb

from kvd.store.ssd.blobfile import fsync_dir
from kvd.store.ssd.lmdbenv import DEFAULT_MAP_SIZE, Env

PACKED = "pack"  # Row.state of an entry whose blob is in the pack
CLEAN = "clean"  # in the pack's folder while closed cleanly with no blob lacking a row
BLOCK = 4096
EID_BYTES = 33
_SLOT = struct.Struct(">Q")


def pack_key(eid: bytes, slot: int) -> bytes:
    """The key of the packed blob of `eid` at `slot` (0: a blob an older kvd
    packed, keyed by its entry id alone)."""
    return _SLOT.pack(slot) + eid if slot else eid


def slot_of(key: bytes) -> int:
    return _SLOT.unpack_from(key)[0] if len(key) > EID_BYTES else 0


def eid_of(key: bytes) -> bytes:
    return bytes(key[-EID_BYTES:])


def packed_disk_bytes(size: int) -> int:
    """What a packed blob of `size` bytes is charged: LMDB keeps a value over
    half a page on pages of its own (overflow pages), so whole pages."""
    return -(-(size + 16) // BLOCK) * BLOCK


class Pack(Env):
    """The LMDB environment at `path` holding packed blobs: `slots` (slot +
    entry id -> blob), and `blobs` (entry id -> blob) of older kvds."""

    def __init__(self, path: str | Path, *, readonly: bool = False, map_size: int = DEFAULT_MAP_SIZE):
        super().__init__(path, readonly=readonly, map_size=map_size, max_dbs=2)
        try:
            self.blobs = self.env.open_db(b"blobs", create=not readonly)
            try:
                self.slots = self.env.open_db(b"slots", create=not readonly)
            except lmdb.NotFoundError:  # read-only, a pack only an older kvd wrote
                self.slots = None
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

    def _db(self, key: bytes):
        return self.slots if len(key) > EID_BYTES else self.blobs

    def read(self, key: bytes) -> bytes | None:
        """A copy of the blob at `key` (`pack_key`), or None if the pack does
        not hold it. Raises IndexBusy while the map grows, lmdb.Error if the
        pack is damaged."""
        db = self._db(key)
        if db is None:
            return None
        with self.reading(buffers=True) as txn:
            view = txn.get(key, db=db)
            return None if view is None else bytes(view)

    def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> list[bytes]:
        """Commit these (entry id, blob bytes) in one synced transaction, each
        in the next slot. Returns their keys, in order."""
        items = list(items)

        def put(txn):
            cur = txn.cursor(db=self.slots)
            first = slot_of(cur.key()) + 1 if cur.last() else 1
            keys = [pack_key(eid, first + i) for i, (eid, _) in enumerate(items)]
            for key, (_, buf) in zip(keys, items):
                if not txn.put(key, buf, db=self.slots, append=True):  # not past the last key: never
                    raise lmdb.Error(f"the pack's slot {first} is not past its last key")
            return keys

        return self.write(put)

    def delete_many(self, keys: Iterable[bytes]) -> int:
        """Delete the blobs at these keys in one transaction. Returns how many were there."""
        keys = list(keys)
        return self.write(lambda txn: sum(bool(txn.delete(k, db=self._db(k))) for k in keys))

    def holds(self, keys: Iterable[bytes]) -> set[bytes]:
        """Those of `keys` the pack holds (no value is read)."""
        out = set()
        with self.reading(buffers=True) as txn:
            for key in keys:
                db = self._db(key)
                if db is not None and txn.get(key, db=db) is not None:
                    out.add(key)
        return out

    def find(self, eids: Iterable[bytes]) -> dict[bytes, bytes]:
        """{entry id: key} for those of `eids` the pack holds a blob of, for
        when no row names its slot (a row that does not decode): a walk of
        every key (rare; no value is read)."""
        want, out = set(eids), {}
        if not want:
            return out
        for key in self.iter_keys(old=False):  # in slot order: the newest last
            if (eid := eid_of(key)) in want:
                out[eid] = key
        with self.reading(buffers=True) as txn:
            for eid in want - out.keys():
                if txn.get(eid, db=self.blobs) is not None:
                    out[eid] = eid
        return out

    def keys_after(self, last: bytes | None, n: int, *, old: bool = True) -> tuple[list[bytes], bool]:
        """Up to `n` keys after `last` (from the first if None) of the old
        table (`old`: entry ids) or of the slots, in key order, and whether
        more follow: for walks in small steps."""
        out: list[bytes] = []
        db = self.blobs if old else self.slots
        if db is None:
            return out, False
        with self.reading(buffers=True) as txn:
            cur = txn.cursor(db=db)
            ok = cur.set_range(last) if last is not None else cur.first()
            if ok and last is not None and bytes(cur.key()) == last:
                ok = cur.next()
            while ok and len(out) < n:
                out.append(bytes(cur.key()))
                ok = cur.next()
        return out, bool(ok)

    def keys_between(self, lo: bytes | None, hi: bytes | None) -> list[bytes]:
        """The entry ids k with lo < k <= hi of the old table, in order (None:
        no bound on that side)."""
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

    def iter_keys(self, step: int = 4096, *, old: bool | None = None) -> Iterator[bytes]:
        """Every key (of the old table only, `old=True`; of the slots only,
        False), `step` per read transaction."""
        for table in (True, False) if old is None else (old,):
            last = None
            while True:
                keys, more = self.keys_after(last, step, old=table)
                yield from keys
                if not more or not keys:
                    break
                last = keys[-1]

    def __len__(self) -> int:
        with self.reading() as txn:
            return sum(txn.stat(db)["entries"] for db in (self.blobs, self.slots) if db is not None)

    def file_bytes(self) -> int:
        """Bytes the pack's file takes (it grows, and reuses freed pages; it never shrinks)."""
        try:
            return (self.path / "data.mdb").stat().st_size
        except OSError:
            return 0
