"""The SSD tier's index: an LMDB environment describing every committed blob.

Theory of operation
-------------------
LMDB gives one writer and any number of lock-free MVCC readers, in this
process and others. kvd uses exactly one writer: the SSD tier's writer
thread (inside the daemon, or `kvd gc --offline` under the data-dir lock).
The daemon thread only ever opens read transactions, so a read never waits
for a write. A `readonly` Index in another process (`kvd stats`) reads while
the daemon writes.

Named databases (all keys and values are bytes):

    rows    entry id (33 B)           -> msgpack Row: where (its file, or the pack)/what the blob is
    lru     atime_us (8 B BE) + eid   -> b""    recency order, oldest first
    tails   parent (32 B) + length (4 B BE) + key (32 B) -> b""
                                                  the tail index, by prefix scan
    ns      namespace (utf-8)         -> msgpack [entries, disk bytes, tokens, last used]
                                         (tokens: summed chunk lengths; older
                                         records of two fields read as 0, 0)
    meta    b"format" -> b"1";  b"totals" -> msgpack [entries, disk bytes]

Rules kept by every write (`put_row`, `delete_row`, `touch_many`):
1. rows, lru, tails, ns and totals change in the same transaction, so the
   totals read at start-up are exact without scanning anything.
2. A row is committed only after its blob is durable (see blobfile), and a
   row is deleted (committed) before its blob is unlinked. So a row always
   names a blob that existed; the converse (blob without row) is an orphan
   that reconcile removes.
3. Transactions are re-runnable: `write(fn)` may run `fn` again after growing
   the map on MapFullError, so `fn` must not touch state outside the txn.

Damage. A row whose bytes do not decode, or that decodes to a field out of
its bounds (`Row.check`: a size no blob here can have, a dtype kvd does not
know, a shape whose bytes do not add up, ...), raises RowDamaged from `get`
-- before anything sizes a buffer or packs a key from it; the
eid is remembered in `damaged`, and `iter_rows`/`oldest` step over it, so
no scan (eviction, a drop, a check) stumbles on garbage. The SSD tier's
writer then removes it with `drop_damaged` (every trace, sums recounted).
A file LMDB cannot use at all is heal.py's business.

Growing the map needs no open transaction in this process: `_grow` closes a
gate that new readers see (they miss rather than wait), waits for readers in
flight, resizes, and reopens it.
"""

from __future__ import annotations

import itertools
import math
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import msgpack

from kvd.protocol.dtypes import DTYPES
from kvd.protocol.errors import KvdError
from kvd.protocol.limits import DEFAULT_LIMITS, Limits
from kvd.store.base import BOUNDARY, CHUNK
from kvd.store.ssd.blobfile import FORMAT_VERSION
from kvd.store.ssd.lmdbenv import DEFAULT_MAP_SIZE, Env, IndexBusy
from kvd.store.ssd.pack import PACKED

__all__ = ["DEFAULT_MAP_SIZE", "INDEX_FORMAT", "Bounds", "IncompatibleIndex", "Index", "IndexBusy", "Row", "RowDamaged"]

INDEX_FORMAT = 1


class IncompatibleIndex(KvdError, RuntimeError):
    """The data dir was written by a kvd whose index format this one cannot read."""


class RowDamaged(KvdError):
    """An index row does not decode, or holds a field out of bounds (garbage in
    the LMDB file): its entry is served as a miss, and the writer repairs it."""


# The largest message any daemon may be set to take (kvd.config: max_message_mb
# is at most 2**40 MiB): what bounds a blob when the setting is not known
# (offline commands, a readonly index).
ANY_ENTRY_BYTES = 1 << 60


@dataclass(frozen=True, slots=True)
class Bounds:
    """What a sane row of this tier may hold (`Row.check`).

    `max_entry_bytes`: no entry is larger (its tensors and meta, `nbytes`) --
    the tier's budget, and the largest message the daemon takes (an entry
    arrived in one). `max_blob_bytes`: no blob file is larger -- that, and a
    header."""

    max_entry_bytes: int = ANY_ENTRY_BYTES
    max_blob_bytes: int = ANY_ENTRY_BYTES + DEFAULT_LIMITS.max_header_bytes
    limits: Limits = DEFAULT_LIMITS

    @classmethod
    def of(cls, budget_bytes: int, max_entry_bytes: int | None, limits: Limits = DEFAULT_LIMITS) -> "Bounds":
        """The bounds of a tier with that budget taking entries of up to
        `max_entry_bytes` (None: whatever a daemon may be set to take)."""
        budget = max(0, int(budget_bytes))
        entry = ANY_ENTRY_BYTES if max_entry_bytes is None else max_entry_bytes
        return cls(min(budget, entry), min(budget, entry + limits.max_header_bytes), limits)


DEFAULT_BOUNDS = Bounds()
_MAX_DIM = (1 << 64) - 1  # a tensor dimension on the wire (msgpack's largest uint)
# Where a blob's tail key packs the length (4 bytes), and past any sequence.
_MAX_TOKENS = 1 << 32
# Seconds since the epoch: a recency key holds microseconds in 8 bytes, and
# no clock reads past this (year 2514).
_MAX_ATIME = float(1 << 34)
_STATES = ("ssd", PACKED)  # its own file, or the pack


@dataclass(slots=True)
class Row:
    """What the index knows about one blob (and enough to rebuild the tail index)."""

    ns: str
    kind: int
    parent: bytes
    start: int
    length: int
    tail: bool
    nbytes: int  # Entry.nbytes (tensor bytes + meta)
    file_size: int
    disk_bytes: int  # allocated on disk; what the budget counts
    checksum: int  # xxh3_64 of the whole file
    fmt: int  # blob FORMAT_VERSION
    tensors: list = field(default_factory=list)  # [[name, dtype, shape], ...] summary
    atime: float = 0.0
    state: str = "ssd"  # where the blob is: "ssd" its own file, "pack" in the pack (pack.py)
    slot: int = 0  # a packed blob's slot in the pack (pack.py; 0: keyed by entry id, as older kvds packed)

    def pack(self) -> bytes:
        # Not dataclasses.asdict: it deep-copies every field, a third of the
        # writer's time per small blob. Same map, same order, same bytes.
        return msgpack.packb({k: getattr(self, k) for k in self.__slots__}, use_bin_type=True)

    @classmethod
    def unpack(cls, raw: bytes, bounds: Bounds = DEFAULT_BOUNDS) -> "Row":
        """Decode a row and `check` it. Raises RowDamaged for bytes that are not a sane one."""
        try:
            d = msgpack.unpackb(raw, raw=False)
            # Tolerate fields a newer kvd added: keep only the ones we know.
            row = cls(**{k: d[k] for k in cls.__slots__ if k in d})
        except Exception as exc:  # msgpack raises many kinds; every one means the same here
            raise RowDamaged(f"undecodable index row: {exc!r}") from None
        return row.check(bounds)

    def check(self, bounds: Bounds = DEFAULT_BOUNDS) -> "Row":
        """This row, if every field is of its type and within `bounds`.
        Raises RowDamaged naming the first field that is not.

        Every use of a row trusts these: the read path sizes a buffer by
        `file_size`, the budget sums `disk_bytes`, a recency key packs
        `atime`, a tail key `length`. So a row is checked whole, when it is
        read from the index, and a row failing here is garbage however it
        came to be (a torn page, a flipped bit, a bug): a miss, and the
        writer's to repair (repair.py)."""
        why = _insane(self, bounds)
        if why is not None:
            raise RowDamaged(f"bad index row: {why}")
        return self


def _int(v: Any, lo: int, hi: int) -> bool:
    """`v` is an int (not a bool) in [lo, hi]."""
    return type(v) is int and lo <= v <= hi


def _ns_counts(raw: bytes | None) -> tuple[int, int, int, float]:
    """A namespace's record in the `ns` table: (entries, bytes, tokens, last
    used). Zeros for none, and for one that does not decode to such numbers
    (garbage written by another process): these are counts for `kvd stats`,
    never what a read relies on, and the next write to the namespace puts a
    sane record back (its counts start again from there)."""
    if not raw:
        return 0, 0, 0, 0.0
    try:
        e, b, t, u = (list(msgpack.unpackb(raw)) + [0, 0])[:4]
    except (ValueError, TypeError):  # (msgpack's FormatError, StackError and ExtraData are ValueErrors)
        return 0, 0, 0, 0.0
    if not all(type(x) is int and 0 <= x < 1 << 63 for x in (e, b, t)) or type(u) not in (int, float) \
            or not math.isfinite(u):
        return 0, 0, 0, 0.0
    return e, b, t, float(u)


def _insane(row: Row, bounds: Bounds) -> str | None:
    """What is wrong with `row` (see Row.check), or None."""
    lim = bounds.limits
    if not isinstance(row.ns, str) or len(row.ns.encode("utf-8", "surrogatepass")) > lim.max_namespace_bytes:
        return "ns"
    if row.kind not in (CHUNK, BOUNDARY) or type(row.kind) is not int:
        return f"kind {row.kind!r}"
    if not isinstance(row.parent, bytes) or len(row.parent) != 32:
        return "parent"
    if type(row.tail) is not bool:
        return "tail"
    if not (_int(row.start, 0, _MAX_TOKENS) and _int(row.length, 0, _MAX_TOKENS - row.start)):
        return f"tokens {row.start!r}+{row.length!r}"
    if not _int(row.file_size, 8, bounds.max_blob_bytes):  # 8: a blob's header length alone
        return f"file_size {row.file_size!r}"
    if not _int(row.nbytes, 0, min(row.file_size, bounds.max_entry_bytes)):  # the tensors and meta are in the file
        return f"nbytes {row.nbytes!r}"
    # Blocks allocated: fewer (compression, holes), or the file rounded up to
    # the filesystem's records -- never a budget's worth more.
    if not _int(row.disk_bytes, 0, max(2 * row.file_size, row.file_size + (16 << 20))):
        return f"disk_bytes {row.disk_bytes!r}"
    if not _int(row.checksum, 0, (1 << 64) - 1):  # xxh3_64
        return "checksum"
    if not _int(row.fmt, 1, FORMAT_VERSION):
        return f"fmt {row.fmt!r}"
    if type(row.atime) not in (int, float) or not 0 <= row.atime <= _MAX_ATIME:  # NaN fails too
        return f"atime {row.atime!r}"
    if row.state not in _STATES or type(row.state) is not str:
        return f"state {row.state!r}"
    if not _int(row.slot, 0, (1 << 64) - 1):
        return f"slot {row.slot!r}"
    return _insane_tensors(row.tensors, row.nbytes, lim)


def _insane_tensors(tensors: Any, nbytes: int, lim: Limits) -> str | None:
    """What is wrong with a row's tensor summary [[name, dtype, shape], ...], or None."""
    if not isinstance(tensors, list) or len(tensors) > lim.max_frames:
        return "tensors"
    total = 0
    for t in tensors:
        if not isinstance(t, (list, tuple)) or len(t) != 3:
            return "a tensor"
        name, dtype, shape = t
        if not isinstance(name, str) or len(name) > lim.max_meta_bytes:
            return "a tensor's name"
        if not isinstance(dtype, str) or dtype not in DTYPES:
            return f"dtype {dtype!r}"
        if not isinstance(shape, (list, tuple)) or len(shape) > lim.max_rank:
            return "a tensor's rank"
        size = DTYPES[dtype][0]
        for dim in shape:
            if not _int(dim, 0, _MAX_DIM):  # what the wire takes (a msgpack uint64)
                return f"a tensor's dim {dim!r}"
        # A tensor of no elements may have any other dims (the wire takes
        # [0, 2**64 - 1]: a PUT acknowledged must read back); in any other no
        # dim is larger than the entry's bytes.
        if 0 in shape:
            size = 0
        for dim in shape if size else ():
            size *= dim
            if size > nbytes:  # stop at once: a product of garbage dims grows without bound
                return "a tensor's shape (more bytes than the entry)"
        total += size
        if total > nbytes:
            return "the tensors' shapes (more bytes than the entry)"
    return None


_INDEXES = itertools.count(1)


def _lru_key(atime: float, eid: bytes) -> bytes:
    return struct.pack(">Q", max(0, int(atime * 1e6))) + eid


def _tail_key(parent: bytes, length: int, key: bytes) -> bytes:
    return parent + struct.pack(">I", length) + key


class Index(Env):
    """The LMDB environment at `path` (a directory). See the module docstring."""

    def __init__(self, path: str | Path, *, readonly: bool = False, map_size: int = DEFAULT_MAP_SIZE,
                 on_create: Callable[[], dict[bytes, bytes]] | None = None):
        """`on_create()`: meta records to write in the transaction that makes
        it a kvd index (its `format`), if this open is the one that does; then
        `fresh` is True (an index made now, or an LMDB no kvd had written)."""
        super().__init__(path, readonly=readonly, map_size=map_size, max_dbs=8)
        self.fresh = False
        try:
            create = not readonly
            self.rows = self.env.open_db(b"rows", create=create)
            self.lru = self.env.open_db(b"lru", create=create)
            self.tails_db = self.env.open_db(b"tails", create=create)
            self.ns_db = self.env.open_db(b"ns", create=create)
            self.meta = self.env.open_db(b"meta", create=create)
            self._check_format(on_create)
        except BaseException:
            self.env.close()
            raise
        # Rows found undecodable by any reader; the SSD tier's writer repairs
        # them (`drop_damaged`). A set: adding is atomic under the GIL.
        self.damaged: set[bytes] = set()
        # What a sane row holds here (Row.check): set by the SSD tier from its
        # budget and the largest message it takes.
        self.bounds = DEFAULT_BOUNDS
        # A walk of the recency order may resume where it stopped (quota.py)
        # only if no key has been put below that place since: `lru_guard` is
        # the highest place a walk will resume at, `lru_moves` counts the keys
        # put below it (a touch recorded before a clock step back, a repaired
        # row's old atime); a walk that sees it change starts from the oldest.
        self.lru_guard: bytes | None = None
        # Counted across Index objects (a healed index is a new one, its rows'
        # atimes taken from their blobs): a walk's place in an old one is void.
        self.lru_moves = next(_INDEXES) << 32

    def _check_format(self, on_create: Callable[[], dict[bytes, bytes]] | None = None) -> None:
        with self.env.begin(db=self.meta, write=not self.readonly) as txn:
            raw = txn.get(b"format")
            if raw is None:
                if self.readonly:
                    return  # a fresh dir nobody has written yet: it is simply empty
                self.fresh = True
                txn.put(b"format", str(INDEX_FORMAT).encode())
                txn.put(b"created", str(time.time()).encode())
                for k, v in (on_create() if on_create is not None else {}).items():
                    txn.put(k, v)  # in the same transaction: a stop between the two cannot part them
            elif int(raw) != INDEX_FORMAT:
                raise IncompatibleIndex(
                    f"{self.path} has index format {int(raw)}; this kvd reads {INDEX_FORMAT}. "
                    "Use a matching kvd, or delete the data dir to start empty."
                )

    # -- reads (any thread, inside `reading()` or a write txn) -------------
    def get(self, txn, eid: bytes) -> Row | None:
        """The row of `eid`, or None. Raises RowDamaged (and remembers `eid`
        in `damaged`, for the writer to repair) if it does not decode."""
        raw = txn.get(eid, db=self.rows)
        if raw is None:
            return None
        try:
            return Row.unpack(raw, self.bounds)
        except RowDamaged:
            self.damaged.add(bytes(eid))
            raise

    def has(self, txn, eid: bytes) -> bool:
        return txn.get(eid, db=self.rows) is not None

    def oldest(self, txn) -> Iterator[tuple[float, bytes]]:
        """(atime, eid) from least to most recently used. An eid whose row is
        damaged is skipped (and remembered in `damaged`): callers go on to
        `get` its row, and eviction must not stumble on garbage."""
        for k, eid, _ in self.oldest_rows(txn):
            yield struct.unpack_from(">Q", k)[0] / 1e6, eid

    def oldest_atime(self, txn) -> float | None:
        """The least recent use in the recency order (None: no rows)."""
        cur = txn.cursor(db=self.lru)
        return struct.unpack_from(">Q", cur.key())[0] / 1e6 if cur.first() else None

    def oldest_rows(self, txn, start: bytes | None = None) -> Iterator[tuple[bytes, bytes, Row]]:
        """(recency key, eid, row) from least to most recently used, from the
        first recency key >= `start` if given (see `lru_guard`); damaged rows
        skipped as in `oldest`."""
        cur = txn.cursor(db=self.lru)
        if start is not None and not cur.set_range(start):
            return
        for k in cur.iternext(keys=True, values=False):
            eid = bytes(k[8:])
            raw = txn.get(eid, db=self.rows)
            if raw is None:
                continue  # a stray recency key (a repaired row's): nothing to evict
            try:
                row = Row.unpack(raw, self.bounds)
            except RowDamaged:
                self.damaged.add(eid)
                continue
            yield bytes(k), eid, row

    def tails(self, txn, parent: bytes) -> list[tuple[int, bytes]]:
        out = []
        cur = txn.cursor(db=self.tails_db)
        if cur.set_range(parent):
            for k in cur.iternext(keys=True, values=False):
                if k[:32] != parent:
                    break
                out.append((struct.unpack_from(">I", k, 32)[0], bytes(k[36:])))
        return out

    def totals(self, txn) -> tuple[int, int]:
        raw = txn.get(b"totals", db=self.meta)
        return tuple(msgpack.unpackb(raw)) if raw else (0, 0)

    def namespaces(self, txn) -> dict[str, dict[str, float]]:
        """{namespace: {entries, bytes (on disk), tokens, last_used}}."""
        out = {}
        for k, v in txn.cursor(db=self.ns_db).iternext(keys=True, values=True):
            e, b, t, used = _ns_counts(v)
            out[bytes(k).decode(errors="replace")] = {"entries": e, "bytes": b, "tokens": t, "last_used": used}
        return out

    def iter_rows(self, txn) -> Iterator[tuple[bytes, Row]]:
        """Every (eid, row) that decodes; damaged ones are skipped and
        remembered in `damaged`."""
        for k, v in txn.cursor(db=self.rows).iternext(keys=True, values=True):
            try:
                yield bytes(k), Row.unpack(v, self.bounds)
            except RowDamaged:
                self.damaged.add(bytes(k))

    def info(self) -> dict[str, Any]:
        info = self.env.info()
        stat = self.env.stat()
        return {"map_size": info["map_size"], "used_bytes": (info["last_pgno"] + 1) * stat["psize"]}

    # -- writes (the writer thread only, inside `write()`) -----------------
    def _bump(self, txn, ns: str, entries: int, nbytes: int, tokens: int = 0, used: float = 0.0) -> None:
        if entries or nbytes:
            e, b = self.totals(txn)
            txn.put(b"totals", msgpack.packb([e + entries, b + nbytes]), db=self.meta)
        key = ns.encode()
        e, b, t, u = _ns_counts(txn.get(key, db=self.ns_db))
        e, b, t, u = e + entries, b + nbytes, t + tokens, max(u, used)
        if e <= 0:
            txn.delete(key, db=self.ns_db)
        else:
            txn.put(key, msgpack.packb([e, b, t, u]), db=self.ns_db)

    def put_row(self, txn, eid: bytes, row: Row) -> bool:
        """Insert `row`; False (nothing changed) if `eid` already has one."""
        if not txn.put(eid, row.pack(), db=self.rows, overwrite=False):
            return False
        self._put_lru(txn, _lru_key(row.atime, eid))
        if row.tail and row.kind == 0:
            txn.put(_tail_key(row.parent, row.length, eid[:32]), b"", db=self.tails_db)
        self._bump(txn, row.ns, 1, row.disk_bytes, row.length if row.kind == 0 else 0, row.atime)
        return True

    def _put_lru(self, txn, key: bytes) -> None:
        txn.put(key, b"", db=self.lru)
        if self.lru_guard is not None and key < self.lru_guard:
            self.lru_moves += 1

    def delete_row(self, txn, eid: bytes) -> Row | None:
        """Remove the row of `eid` (and its lru/tail/ns/totals traces). Returns it, or None."""
        try:
            row = self.get(txn, eid)
        except RowDamaged:
            self.drop_damaged(txn, [eid])
            return None
        if row is None:
            return None
        txn.delete(eid, db=self.rows)
        txn.delete(_lru_key(row.atime, eid), db=self.lru)
        if row.tail and row.kind == 0:
            txn.delete(_tail_key(row.parent, row.length, eid[:32]), db=self.tails_db)
        self._bump(txn, row.ns, -1, -row.disk_bytes, -row.length if row.kind == 0 else 0)
        return row

    def drop_damaged(self, txn, eids: Iterable[bytes]) -> set[bytes]:
        """Remove those rows of `eids` that do not decode, and every trace of
        them, then recount the totals and namespaces from the rows. Nothing in
        the damaged bytes can be trusted, so their lru and tail keys are found
        by scanning for them and the sums are recomputed: one scan and one
        recount however many rows (O(rows), for a rare repair; a row at a
        time would be O(rows) each). Returns the eids removed."""
        gone = set()
        for eid in eids:
            raw = txn.get(eid, db=self.rows)
            if raw is None:
                continue
            try:
                Row.unpack(raw, self.bounds)
                continue  # it decodes (mended since): not this method's business
            except RowDamaged:
                txn.delete(eid, db=self.rows)
                gone.add(bytes(eid))
        if not gone:
            return gone
        keys = {eid[:32] for eid in gone}
        for db, match in ((self.lru, lambda k: k[8:] in gone), (self.tails_db, lambda k: k[36:] in keys)):
            stale = [bytes(k) for k in txn.cursor(db=db).iternext(keys=True, values=False) if match(k)]
            for k in stale:
                txn.delete(k, db=db)
        self.recount(txn)
        return gone

    def recount(self, txn) -> None:
        """Recompute the totals row and the per-namespace records from the rows."""
        per_ns: dict[str, list] = {}
        for _, row in self.iter_rows(txn):
            rec = per_ns.setdefault(row.ns, [0, 0, 0, 0.0])
            rec[0] += 1
            rec[1] += row.disk_bytes
            rec[2] += row.length if row.kind == 0 else 0
            rec[3] = max(rec[3], row.atime)
        txn.drop(self.ns_db, delete=False)
        for ns, rec in per_ns.items():
            txn.put(ns.encode(), msgpack.packb(rec), db=self.ns_db)
        total = [sum(r[0] for r in per_ns.values()), sum(r[1] for r in per_ns.values())]
        txn.put(b"totals", msgpack.packb(total), db=self.meta)

    def touch_many(self, txn, touched: dict[bytes, float]) -> int:
        """Move each eid of `touched` to its atime in the recency order (never
        backwards). A namespace's last use is written once, and the totals
        not at all (a touch changes no sum). Returns how many moved."""
        used: dict[str, float] = {}
        moved = 0
        for eid, atime in touched.items():
            try:
                row = self.get(txn, eid)
            except RowDamaged:
                continue  # repaired by the writer (drop_damaged), not moved
            if row is None or atime <= row.atime:
                continue
            txn.delete(_lru_key(row.atime, eid), db=self.lru)
            row.atime = atime
            txn.put(eid, row.pack(), db=self.rows)
            self._put_lru(txn, _lru_key(atime, eid))
            used[row.ns] = max(used.get(row.ns, 0.0), atime)
            moved += 1
        for ns, atime in used.items():
            self._bump(txn, ns, 0, 0, 0, atime)
        return moved
