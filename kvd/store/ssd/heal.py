"""The index heals itself: a damaged LMDB index is moved aside and rebuilt from the blobs.

Why one module of ~700 lines: the index's damage checks (LMDB's meta pages
read by hand), moving a bad index aside and the rebuild that follows form one
procedure whose steps must agree on the same file layout; split, each half
would restate the other's assumptions about data.mdb.

Theory of operation
-------------------
The blobs are the truth; the index is a cache of what they say. Every blob
carries what its row needs (namespace, key, kind, parent, start, length,
tail, tensors, meta; see blobfile's Format) and proves its own bytes with
`kvd_sum`. So an index that is truncated, zeroed, garbage or not LMDB at all
costs a rebuild, never the data, and never a crash loop.

Opening (`open_index`), before LMDB ever maps the file:
1. `inspect_data_file` reads the two meta pages of data.mdb with plain
   reads and checks what LMDB would trust blindly: page flags, magic
   0xBEEFC0DE, version 1, page size, and that the file reaches the last page
   the newer meta records. LMDB maps the file and would touch pages past its
   end: SIGBUS, at every restart. A short file is refused here instead.
2. LMDB then opens it; the errors that mean damage (MDB_INVALID,
   MDB_CORRUPTED, MDB_PAGE_NOTFOUND, version mismatch, an undecodable
   totals or format record) count as damage. Errors that mean the
   environment (permission denied, a full or read-only disk) do not: they
   propagate and the daemon serves RAM only (kvd/cli/serve.py).
3. A damaged index directory is renamed `index.bad-<UTC time>` (the newest
   KEEP_BAD are kept for a post-mortem), a fresh one is created, and a
   `rebuilding` record is committed in it first. An index this start makes
   (there was none, or an LMDB no kvd had written) while blobs exist gets
   the same record, in the transaction that makes it a kvd index (without
   it, reconcile would take every blob for an orphan). An index of kvd's
   that is merely empty is not rebuilt: its rows were removed on purpose
   (a drop, an eviction) and the blobs left by a stop between the two are
   orphans.

Rebuilding (`rebuild_steps`) walks the shard directories with scandir, reads
each blob whole, checks it (it parses, its name matches its content, its
`kvd_sum` matches) and commits rows in batches of REBUILD_BATCH; a blob that
fails is quarantined, a temp file removed. Its recency is the file's mtime
(when it was written): the order of last use is not on disk. The steps run
on the SSD tier's writer thread, between spills, so the daemon serves from
its first moment (entries appear as they are indexed); rows already present
(written meanwhile, or by a rebuild that was stopped) are kept and their
blobs not read again. No one file ends it: whatever checking a blob raises
(not only BlobCorrupt) quarantines that blob and the walk goes on (a shard
folder it cannot list is left as it is, and the record kept: the next start
resumes); a rebuild
that died would leave the blobs after it unindexed, and while the record
says a rebuild is unfinished, reconcile removes no blob for want of a row
(`unfinished`). Once rebuilt, the oldest entries beyond the budget
are evicted. The `rebuilding` record is deleted last: a stop halfway
resumes at the next start. One log line at the end says what happened and
how much was recovered. The pack of small blobs (pack.py) is a separate
LMDB file: after the shards the rebuild reads every blob in it the same way
(its recency is the rebuild's time). A damaged pack is moved aside at start
(`open_pack`, `pack.bad-<UTC time>`) and its entries are lost, the index's
rows for them then dropped by reconcile.

Damage found while running. After any start (and rebuild) the writer walks
every key of every table once (`walk_steps`, in steps). LMDB errors that
mean damage -- there, on a GET, a LOOKUP or an admin request -- are misses
(admin requests get Busy), and the tier heals itself without a restart:
`replace_index` renames the directory under the open environment, opens a
new one, readers switch to it at once, the old one is closed when its
readers are out, and the rebuild runs as above.

Damage LMDB does not report. Some garbage in a page makes LMDB abort the
process (an assertion) instead of returning an error, and a service
manager then restarts it into the same abort. Each start counts itself in
`index.starting`; the walk's end and a clean stop remove it. A start that
finds MAX_UNFINISHED_STARTS earlier starts which never got through their
walk heals the index before opening it.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import shutil
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import lmdb
import msgpack
import xxhash

from kvd.protocol.errors import KvdError
from kvd.store.ssd import blobfile
from kvd.store.base import BOUNDARY
from kvd.store.ssd.blobfile import BlobCorrupt
from kvd.store.datadir import (
    BLOB_DIR, DIR_MODE, FILE_MODE, INDEX_DIR, PACK_DIR, eid_of_blob, ensure_folder, ensure_quarantine, is_temp_name,
    shard_folders,
)
from kvd.store.ssd.index import DEFAULT_BOUNDS, Index, IndexBusy, Row, RowDamaged
from kvd.store.ssd.lmdbenv import DEFAULT_MAP_SIZE
from kvd.store.ssd.pack import PACKED, Pack, eid_of, packed_disk_bytes, slot_of

if TYPE_CHECKING:
    from kvd.store.ssd import SsdStore

log = logging.getLogger("kvd.store.ssd")

DATA_FILE = "data.mdb"
BAD_PREFIX = "index.bad-"
KEEP_BAD = 3  # moved-aside indexes kept for a post-mortem
REBUILD_BATCH = 2048  # rows per LMDB commit while rebuilding
STEP_FILES = 512  # blobs read per writer step (spills interleave between steps)
MAX_FAILURES = 100
REBUILDING = b"rebuilding"  # meta record present while a rebuild is unfinished
STARTING = "index.starting"  # in the data dir: starts whose index walk has not finished
MAX_UNFINISHED_STARTS = 2
WALK_KEYS = 1024  # keys per walk step (~2 ms: the writer holds the GIL that long)

# LMDB 0.9 on a 64-bit little-endian machine (lmdb.h / mdb.c): a page header
# (pgno u64, pad u16, flags u16, lower u16, upper u16), then MDB_meta: magic
# u32, version u32, address u64, mapsize u64, two MDB_db of 48 bytes (the
# first's md_pad holds the page size; md_root is its last u64), last_pg u64,
# txnid u64. Checked against files this lmdb package writes
# (tests/store/test_heal.py::test_meta_layout_matches_the_lmdb_package).
_PAGE_HDR = struct.Struct("<QHHHH")
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, key size: a branch node's child is lo | hi << 16 | flags << 32
_U16, _U64 = struct.Struct("<H"), struct.Struct("<Q")
P_BRANCH, P_LEAF = 0x01, 0x02
F_BIGDATA = 0x01  # a leaf node whose data is on overflow pages
_META = struct.Struct("<IIQQ" + "IHHQQQQQ" * 2 + "QQ")
_META_END = _PAGE_HDR.size + _META.size  # 152
P_META = 0x08
MDB_MAGIC = 0xBEEFC0DE
MDB_DATA_VERSION = 1
P_INVALID = (1 << 64) - 1

# What says the environment, not the file, is at fault (EACCES, ENOSPC, EROFS
# and other errnos come as these or as plain lmdb.Error): not ours to "heal",
# the daemon then serves RAM only. Every other LMDB error while opening and
# first reading (MDB_INVALID, MDB_CORRUPTED, MDB_PAGE_NOTFOUND, version
# mismatch, a transaction spoiled by one of them) means a damaged file.
ENVIRONMENT = (
    lmdb.ReadonlyError, lmdb.DiskError, lmdb.MapFullError, lmdb.ReadersFullError, lmdb.LockError,
    lmdb.TlsFullError, lmdb.MemoryError, lmdb.InvalidParameterError, lmdb.DbsFullError,
)
DAMAGE = (lmdb.Error, RowDamaged, ValueError, TypeError, msgpack.exceptions.UnpackException)


def is_damage(exc: BaseException) -> bool:
    """Whether `exc`, raised opening or first reading an index, means the file is damaged."""
    if isinstance(exc, lmdb.Error):
        return type(exc) is not lmdb.Error and not isinstance(exc, ENVIRONMENT)
    return isinstance(exc, DAMAGE)


class IndexDamaged(KvdError):
    """The index file is truncated, zeroed or not LMDB; `kvd verify --repair` rebuilds it from the blobs."""


def inspect_data_file(path: Path) -> str | None:
    """Why LMDB must not open `path` (a data.mdb), or None if it may.

    Reads the meta pages and, if the file ends before its last page, the
    free list, with pread: a damaged file is never mapped. A missing file
    is fine (LMDB creates it); an empty one is reported.
    """
    try:
        # Neither blocks (a FIFO under the name would hang open()) nor follows a symlink.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "data.mdb is a symlink, not a regular file"
        raise
    try:
        return _inspect(fd)
    finally:
        os.close(fd)


def _inspect(fd: int) -> str | None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return f"data.mdb is not a regular file (mode {stat.filemode(st.st_mode)})"
    size = st.st_size
    if size == 0:
        return "data.mdb is empty (0 bytes)"
    metas = [_meta(os.pread(fd, _META_END, 0), 0)]
    if isinstance(metas[0], str):
        return metas[0]
    psize = metas[0]["psize"]
    metas.append(_meta(os.pread(fd, _META_END, psize), 1))
    if isinstance(metas[1], str):
        return metas[1]
    if metas[1]["psize"] not in (0, psize):
        return "the two meta pages disagree about the page size"
    for m in metas:
        for root in m["roots"]:
            if root != P_INVALID and root > m["last_pg"]:
                return "a meta page points past the last page"
    if size % psize:
        return f"data.mdb is truncated: {size} bytes, not whole pages of {psize}"
    # LMDB may end the file before its last page: pages a transaction took
    # and gave back unwritten are listed free, never written, never read.
    # Any other page past the end is one a read would fault on (SIGBUS).
    newest = max(metas, key=lambda m: m["txnid"])
    missing = range(size // psize, newest["last_pg"] + 1)
    if missing:
        free = free_pages(fd, newest["roots"][0], psize, size // psize)
        if free is None or not free.issuperset(missing):
            return f"data.mdb is truncated: {size} bytes, its meta pages need {(newest['last_pg'] + 1) * psize}"
    return None


def free_pages(fd: int, root: int, psize: int, npages: int) -> set[int] | None:
    """The pages LMDB's free list (the free DB rooted at page `root`) lists
    as free, read with pread from the first `npages` pages of the file; None
    if it cannot be read whole within them (a page past them, a cycle, a
    node that does not fit its page)."""
    free: set[int] = set()
    seen: set[int] = set()
    todo = [root]
    while todo:
        pg = todo.pop()
        if pg == P_INVALID:
            continue
        if pg >= npages or pg in seen:
            return None
        seen.add(pg)
        page = os.pread(fd, psize, pg * psize)
        _, _, flags, lower, _ = _PAGE_HDR.unpack_from(page, 0)
        if not _PAGE_HDR.size <= lower <= psize or not flags & (P_BRANCH | P_LEAF):
            return None
        for i in range((lower - _PAGE_HDR.size) >> 1):
            (off,) = _U16.unpack_from(page, _PAGE_HDR.size + 2 * i)
            if off + _NODE.size > psize:
                return None
            lo, hi, nflags, ksize = _NODE.unpack_from(page, off)
            if flags & P_BRANCH:
                todo.append(lo | hi << 16 | nflags << 32)  # a branch node's child page number
                continue
            size, at = lo | hi << 16, off + _NODE.size + ksize
            if nflags & F_BIGDATA:  # the list is on overflow pages of its own
                if at + 8 > psize:
                    return None
                (first,) = _U64.unpack_from(page, at)
                if first + -(-(size + _PAGE_HDR.size) // psize) > npages:
                    return None
                data = os.pread(fd, size, first * psize + _PAGE_HDR.size)
            else:
                data = page[at : at + size]
            # An ID list: its count, then that many page numbers.
            if len(data) != size or size < 8 or 8 * (_U64.unpack_from(data)[0] + 1) > size:
                return None
            count = _U64.unpack_from(data)[0]
            free.update(struct.unpack_from(f"<{count}Q", data, 8))
    return free


def _meta(buf: bytes, i: int) -> dict | str:
    if len(buf) < _META_END:
        return f"data.mdb is truncated inside meta page {i}"
    _, _, flags, _, _ = _PAGE_HDR.unpack_from(buf, 0)
    f = _META.unpack_from(buf, _PAGE_HDR.size)
    magic, version, psize = f[0], f[1], f[4]
    if not flags & P_META or magic != MDB_MAGIC:
        return f"data.mdb is not an LMDB file (meta page {i} has no LMDB magic)"
    if version != MDB_DATA_VERSION:
        return f"data.mdb has LMDB data version {version}, not {MDB_DATA_VERSION}"
    if i == 0 and (psize < 512 or psize > 65536 or psize & (psize - 1)):
        return f"data.mdb records an impossible page size ({psize})"
    return {"psize": psize, "roots": (f[11], f[19]), "last_pg": f[20], "txnid": f[21]}


@dataclass
class Heal:
    """A rebuild of the index from the blobs: why, where the old index went, progress."""

    reason: str
    moved_to: str | None = None
    since: float = field(default_factory=time.time)
    recovered: int = 0
    recovered_bytes: int = 0
    kept: int = 0  # rows already present (written meanwhile, or by a stopped rebuild)
    quarantined: int = 0
    temps_removed: int = 0
    evicted: int = 0  # over the budget once rebuilt: the oldest evicted
    unverified: int = 0  # blobs older than kvd_sum: parsed and name-checked only
    done: bool = False
    seconds: float = 0.0
    failures: list = field(default_factory=list)  # [entry hex, why], the first MAX_FAILURES

    def record(self) -> bytes:
        return msgpack.packb({"reason": self.reason, "moved_to": self.moved_to, "since": self.since})

    @classmethod
    def from_record(cls, raw: bytes) -> "Heal":
        try:
            d = msgpack.unpackb(raw)
            return cls(reason=str(d["reason"]) + " (resumed)", moved_to=d.get("moved_to"), since=float(d["since"]))
        except Exception:  # noqa: BLE001 - a garbage record still means: rebuild
            return cls(reason="an unfinished rebuild (resumed)")

    def stats(self) -> dict:
        return asdict(self)


def unfinished(index: Index) -> bool:
    """Does `index` say a rebuild of it is unfinished (its `rebuilding`
    record)? Then a blob without a row is an entry not indexed yet, not an
    orphan. True where that cannot be read (reconcile then keeps every blob)."""
    try:
        with index.reading() as txn:
            return txn.get(REBUILDING, db=index.meta) is not None
    except (IndexBusy, lmdb.Error):
        return True


def open_index(root: Path, *, map_size: int, rebuild: str | None = None) -> tuple[Index, Heal | None]:
    """Open the index of the data dir `root`, moving a damaged one aside
    (see the module docstring) -- or any one, giving `rebuild` as the reason.
    Returns it and the rebuild it needs, if any. Raises lmdb.Error or
    OSError for an environment LMDB cannot use."""
    path = root / INDEX_DIR
    data = path / DATA_FILE
    died = note_start(root)
    reason = rebuild or inspect_data_file(data)
    if reason is None and died >= MAX_UNFINISHED_STARTS:
        # Some damage makes LMDB abort the process (an assertion in a cursor
        # walk) rather than return an error: the walk at start then never
        # finishes, start after start. Break that loop here.
        reason = f"the last {died} starts died before walking the index through (an LMDB abort on a damaged page?)"
    index = None
    missing = Heal("the index was missing")
    if reason is None:
        try:
            # An index this open makes (none there, or an LMDB no kvd wrote)
            # beside blobs is marked in the transaction that makes it: a
            # stop right after would otherwise leave an index that looks
            # whole, and reconcile would take every blob for an orphan.
            index = Index(path, map_size=map_size,
                          on_create=lambda: {REBUILDING: missing.record()} if any_blob(root) else {})
            with index.reading() as txn:
                entries, nbytes = index.totals(txn)
                int(entries) + int(nbytes)
                marker = txn.get(REBUILDING, db=index.meta)
        except DAMAGE as exc:
            if index is not None:
                index.close()
            if not is_damage(exc):
                raise
            reason = f"LMDB refuses it: {exc}"
    if reason is not None:
        return replace_index(root, reason, map_size=map_size, quiet=bool(rebuild))
    if marker is None:
        return index, None
    return index, missing if index.fresh else Heal.from_record(bytes(marker))


def replace_index(root: Path, reason: str, *, map_size: int, quiet: bool = False) -> tuple[Index, Heal]:
    """Move root/index aside, open a new one marked `rebuilding`. Also used
    while running (the old environment may still be open: renaming its
    directory does not disturb it). Returns the new index and its Heal."""
    path = root / INDEX_DIR
    moved = move_aside(root)
    heal = Heal(reason, moved_to=str(moved) if moved else None)
    index = Index(path, map_size=map_size, on_create=lambda: {REBUILDING: heal.record()})  # (marked as it is made)
    if not index.fresh:  # (another process made one there meanwhile)
        index.write(lambda txn: txn.put(REBUILDING, heal.record(), db=index.meta))
    log.log(logging.INFO if quiet else logging.WARNING,
            "ssd: index %s is damaged (%s); %s, rebuilding it from the blobs", path, reason,
            f"moved to {moved}" if moved else "its folder was gone")
    return index, heal


def note_start(root: Path) -> int:
    """Count this start in root/index.starting; returns how many earlier
    starts ended before their index walk did (0 normally). Best effort."""
    path = root / STARTING
    try:
        died = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        died = 0
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
        try:
            os.write(fd, f"{died + 1}\n".encode())
        finally:
            os.close(fd)
    except OSError:
        pass
    return died


def clear_start(root: Path) -> None:
    """This start walked its index through (or stopped cleanly)."""
    try:
        os.unlink(root / STARTING)
    except OSError:
        pass


def walk_steps(store: "SsdStore") -> Iterator[None]:
    """Read every key of every table (and decode every row) once, a step at
    a time, on the writer thread: damage that LMDB reports becomes a heal
    now (`store.want_heal`), a row that does not decode a quarantine, and
    damage that makes LMDB abort shows as starts that never finish (see
    `open_index`). Clears the start count when done."""
    index = store.index
    boundary_ns: set[str] = set()  # namespaces with a boundary row (SsdStore.boundary_free)
    for db in (index.rows, index.lru, index.tails_db, index.ns_db, index.meta):
        last: bytes | None = None
        more = True
        while more:
            try:
                with index.reading() as txn:
                    cur = txn.cursor(db=db)
                    ok = cur.set_range(last) if last is not None else cur.first()
                    if ok and last is not None and cur.key() == last:
                        ok = cur.next()
                    n = 0
                    while ok and n < WALK_KEYS:
                        last = bytes(cur.key())
                        if db is index.rows:
                            try:
                                row = Row.unpack(cur.value(), index.bounds)
                                if row.kind == BOUNDARY:
                                    boundary_ns.add(row.ns)
                            except RowDamaged:
                                index.damaged.add(last)
                        n += 1
                        ok = cur.next()
                    more = ok
            except IndexBusy:
                pass
            except lmdb.Error as exc:
                if is_damage(exc):
                    store.want_heal(f"found while walking it: {exc}")
                    return
                raise
            yield
    store.walked(boundary_ns)
    clear_start(store.root)


def open_readonly(root: Path) -> Index:
    """The index of `root` opened read-only for a look (stats, verify), never
    mapping a damaged file. Raises IndexDamaged, FileNotFoundError if there is none."""
    data = root / INDEX_DIR / DATA_FILE
    if not data.exists():
        raise FileNotFoundError(f"{root} holds no kvd index")
    reason = inspect_data_file(data)
    if reason is None:
        try:
            return Index(root / INDEX_DIR, readonly=True, map_size=0)
        except DAMAGE as exc:
            if not is_damage(exc):
                raise
            reason = f"LMDB refuses it: {exc}"
    raise IndexDamaged(
        f"the index of {root} is damaged ({reason}); `kvd serve` rebuilds it from the blobs at start, "
        "or run `kvd verify --repair` with the daemon stopped"
    )


def any_blob(root: Path) -> bool:
    blob_root = root / BLOB_DIR
    if blob_root.is_dir():
        for shard in os.scandir(blob_root):
            if shard.is_dir(follow_symlinks=False):
                with os.scandir(shard.path) as it:
                    if any(eid_of_blob(e.name) for e in it):
                        return True
    try:  # the pack's file is made with its first write: a few pages mean none yet
        return (root / PACK_DIR / DATA_FILE).stat().st_size > 8 * 4096
    except OSError:
        return False


def move_aside(root: Path, name: str = INDEX_DIR) -> Path | None:
    """Rename root/<name> to root/<name>.bad-<UTC time>, keep the newest
    KEEP_BAD, make a new, empty root/<name>. Returns where it went: None if
    there was none (removed by hand under a running daemon)."""
    prefix = f"{name}.bad-"
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dst = root / f"{prefix}{stamp}"
    n = 1
    while dst.exists():
        dst = root / f"{prefix}{stamp}-{n}"
        n += 1
    try:
        os.rename(root / name, dst)
    except FileNotFoundError:
        dst = None
    (root / name).mkdir(mode=DIR_MODE)
    blobfile.fsync_dir(root)
    old = sorted(p for p in root.iterdir() if p.name.startswith(prefix))  # by the UTC time in the name
    for p in old[:-KEEP_BAD]:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return dst


def open_pack(root: Path, *, map_size: int = DEFAULT_MAP_SIZE, readonly: bool = False) -> Pack | None:
    """The pack of small blobs (pack.py) of the data dir `root`. One LMDB
    must not map, or that it refuses, is moved aside and a new one made: the
    entries in it are lost (reconcile drops their rows). Read-only: None if
    there is none or it is damaged. Raises lmdb.Error or OSError for an
    environment LMDB cannot use."""
    path = root / PACK_DIR
    if readonly and (path.is_symlink() or not (path / DATA_FILE).exists()):
        return None
    reason = inspect_data_file(path / DATA_FILE)
    if reason is None:
        try:
            if not readonly:
                ensure_folder(root, PACK_DIR)  # a symlink there: moved aside, never written through
            pack = Pack(path, map_size=map_size, readonly=readonly)
            len(pack)  # a first read: a damaged root page shows here
            return pack
        except DAMAGE as exc:
            if not is_damage(exc):
                raise
            reason = f"LMDB refuses it: {exc}"
    if readonly:
        return None
    moved = move_aside(root, PACK_DIR)
    log.warning("ssd: the pack of small blobs %s is damaged (%s); moved to %s and started empty: "
                "the entries it held are lost, their rows are dropped", path, reason, moved)
    return Pack(path, map_size=map_size)


def replace_pack(root: Path, reason: str, *, map_size: int) -> Pack:
    """While running: the pack's file is no longer the one the open pack
    maps (removed, replaced, cut short; see Env.file_fault). Move what is at
    root/pack aside (the old environment's lock file with it, so the new one
    never shares it) and open a new, empty pack. The entries of the old one
    are lost: their rows then name nothing, and reconcile drops them."""
    moved = move_aside(root, PACK_DIR)
    log.warning("ssd: the pack of small blobs %s cannot be used any more (%s); %s, started a new one: "
                "the entries it held are lost", root / PACK_DIR, reason,
                f"moved what was left to {moved}" if moved else "its folder was gone")
    return Pack(root / PACK_DIR, map_size=map_size)


def recover_row(path: str | Path, eid: bytes, max_bytes: int = DEFAULT_BOUNDS.max_blob_bytes) -> tuple[Row, bool]:
    """The index row for the blob at `path`, after checking it: it parses,
    holds entry `eid`, and matches its own kvd_sum. Returns (row, verified):
    verified is False for a blob written before kvd_sum existed.
    Raises BlobCorrupt (also for anything not a regular file, or a file over
    `max_bytes`, the largest blob the tier takes: it is never read into
    memory), or OSError (FileNotFoundError if it vanished)."""
    fd = blobfile.open_blob(path)  # a FIFO or a symlink under the name: BlobCorrupt, never a hang
    try:
        st = os.fstat(fd)
        if st.st_size > max_bytes:
            raise BlobCorrupt(f"{st.st_size} bytes, more than any blob this tier takes ({max_bytes})")
        buf = blobfile.read_all(fd, st.st_size)
    finally:
        os.close(fd)
    disk = st.st_blocks * 512 if st.st_blocks else st.st_size
    return row_of_blob(buf, eid, disk_bytes=max(disk, st.st_size), atime=st.st_mtime)


def row_of_blob(buf, eid: bytes, *, disk_bytes: int, atime: float, state: str = "ssd", slot: int = 0) -> tuple[Row, bool]:
    """The index row for the whole blob `buf` of entry `eid` (see recover_row)."""
    entry = blobfile.parse_blob(buf)
    if entry.id != eid:
        raise BlobCorrupt("blob holds another entry than its name says")
    ok = blobfile.embedded_sum_ok(buf)
    if ok is False:
        raise BlobCorrupt("kvd_sum does not match the blob's bytes")
    row = Row(
        ns=entry.namespace, kind=entry.kind, parent=entry.parent, start=entry.start, length=entry.length,
        tail=entry.tail, nbytes=entry.nbytes, file_size=len(buf), disk_bytes=disk_bytes,
        checksum=xxhash.xxh3_64_intdigest(buf), fmt=blobfile.FORMAT_VERSION,
        tensors=[[t.name, t.dtype, list(t.shape)] for t in entry.tensors], atime=atime, state=state, slot=slot,
    )
    return row, ok is True


def recover_packed(pack: Pack, key: bytes, atime: float) -> tuple[Row, bool]:
    """As recover_row, for the blob in the pack at `key` (pack.pack_key).
    FileNotFoundError if it holds none."""
    buf = pack.read(key)
    if buf is None:
        raise FileNotFoundError(key.hex())
    return row_of_blob(buf, eid_of(key), disk_bytes=packed_disk_bytes(len(buf)), atime=atime, state=PACKED,
                       slot=slot_of(key))


def quarantine_file(root: Path, path: str | Path, eid_hex: str) -> bool:
    """Move a bad blob into the quarantine folder (re-made if it is missing or
    not a folder); False if even that failed (the blob is then removed)."""
    qdir = ensure_quarantine(root)
    try:
        if qdir is None:
            raise OSError("no quarantine folder")
        os.replace(path, qdir / f"{eid_hex}.{int(time.time() * 1000)}.safetensors")
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.error("ssd: could not quarantine %s (%s); removing it", path, exc)
        try:
            os.unlink(path)
        except OSError:
            pass
        return False


def quarantine_packed(root: Path, pack: Pack, key: bytes) -> bool:
    """Move a bad packed blob (at `key`, pack.pack_key) out of the pack into
    the quarantine folder (as a file); False if the pack no longer held it.
    If the folder cannot be made the blob is only deleted."""
    buf = pack.read(key)
    if buf is None:
        return False
    eid = eid_of(key)
    qdir = ensure_quarantine(root)
    if qdir is not None:
        try:
            with open(qdir / f"{eid.hex()}.{int(time.time() * 1000)}.safetensors", "xb") as f:
                f.write(buf)
        except OSError as exc:
            log.warning("ssd: cannot keep packed blob %s in the quarantine folder (%s); deleted", eid.hex(), exc)
    pack.delete_many([key])
    return True


def rebuild_steps(store: "SsdStore", heal: Heal) -> Iterator[None]:
    """Rebuild `store`'s index from its blobs (see module docstring), a step
    at a time. Runs on the writer thread, or with none running."""
    t0 = time.monotonic()
    index = store.index
    if store.pack is not None:
        # An entry stored again while this runs (a miss meanwhile) takes a new
        # slot, and its blob found here is then kept as "indexed": the
        # reconcile after the rebuild looks through the pack for such.
        store.pack.orphan_free = False
    pending: list[tuple[bytes, Row]] = []
    skipped = False  # a folder could not be listed: the rebuild stays unfinished (its record kept)
    try:
        shards = shard_folders(store.root)
    except OSError as exc:
        log.error("ssd: cannot list %s while rebuilding the index (%s); resumed at the next start",
                  store.root / BLOB_DIR, exc)
        shards, skipped = [], True

    def commit() -> None:
        if not pending:
            return
        rows = list(pending)
        pending.clear()

        def put(txn):
            added = [(eid, row) for eid, row in rows if index.put_row(txn, eid, row)]
            return added, index.totals(txn)

        added, totals = index.write(put)
        store.entries, store.bytes = totals
        heal.recovered += len(added)
        heal.recovered_bytes += sum(r.disk_bytes for _, r in added)
        heal.kept += len(rows) - len(added)

    read = 0

    def take(eid: bytes, recover, quarantine, what: str) -> bool:
        """Index one blob (`recover()` -> its row), or quarantine it. True
        when a step's worth has been read: the caller yields."""
        nonlocal read
        try:
            row, verified = recover()
            row.check(index.bounds)  # a row no read would take (a blob larger than this tier takes): not indexed
        except FileNotFoundError:
            return False  # evicted or quarantined meanwhile
        except Exception as exc:  # noqa: BLE001 - no one file may end the rebuild (module docstring)
            if len(heal.failures) < MAX_FAILURES:
                heal.failures.append([eid.hex(), f"corrupt: {exc}"])
            expected = isinstance(exc, (BlobCorrupt, RowDamaged, OSError))
            log.log(logging.WARNING if expected else logging.ERROR, "ssd: %s %s is bad (%s); quarantined while "
                    "rebuilding the index", what, eid.hex(), exc if expected else repr(exc))
            try:
                moved = quarantine()
            except (OSError, lmdb.Error) as err:
                log.error("ssd: could not quarantine %s %s (%s); left where it is", what, eid.hex(), err)
                moved = False
            if moved:
                heal.quarantined += 1
                store.count("quarantined")
            return False
        heal.unverified += not verified
        pending.append((eid, row))
        read += 1
        if len(pending) >= REBUILD_BATCH:
            commit()
        if read % STEP_FILES == 0:
            commit()
            return True
        return False

    for shard in shards:
        try:
            with os.scandir(shard) as it:
                names = [e.name for e in it]
        except OSError as exc:  # unreadable (its mode changed by hand): its blobs wait, kept; the rest is indexed
            if len(heal.failures) < MAX_FAILURES:
                heal.failures.append([os.path.basename(shard), f"unreadable: {exc}"])
            log.error("ssd: cannot list %s while rebuilding the index (%s); its blobs are left unindexed, "
                      "and the rebuild is resumed at the next start", shard, exc)
            skipped = True
            continue
        try:  # one read transaction per shard, not one per blob
            with index.reading() as txn:
                indexed = {n for n in names if (e := eid_of_blob(n)) is not None and index.has(txn, e)}
        except IndexBusy:  # the map is growing: ask per blob instead
            indexed = None
        for name in names:
            path = os.path.join(shard, name)
            if is_temp_name(name):
                # Left by a crash: this is the writer thread (or none runs),
                # and only the lock holder writes here, so none is in flight.
                try:
                    os.unlink(path)
                    heal.temps_removed += 1
                except OSError:
                    pass
                continue
            eid = eid_of_blob(name)
            if eid is None or eid in store.queue:
                continue
            if (name in indexed) if indexed is not None else store.has_row(eid):
                heal.kept += 1
                continue
            if take(eid, lambda: recover_row(path, eid, index.bounds.max_blob_bytes),
                    lambda: quarantine_file(store.root, path, eid.hex()), "blob"):
                yield
        commit()
        yield
    # Then the pack of small blobs (pack.py), the same way.
    pack = store.pack
    for key in pack.iter_keys() if pack is not None else ():
        eid = eid_of(key)
        if eid in store.queue or store.has_row(eid):
            heal.kept += 1
            continue
        if take(eid, lambda: recover_packed(pack, key, atime=time.time()),
                lambda: quarantine_packed(store.root, pack, key), "packed blob"):
            yield
    commit()
    # Blobs can hold more than the budget (a smaller ssd_gb now, or blobs a
    # crash left unindexed): evict the oldest down to it, as a write would.
    before = store.entries
    store._make_room(0, set())
    heal.evicted = before - store.entries
    if not skipped:
        index.write(lambda txn: txn.delete(REBUILDING, db=index.meta))
    heal.done = True
    heal.seconds = time.monotonic() - t0
    log.warning(
        "ssd: index rebuilt from the blobs in %.1fs (%s%s): %d entries recovered (%d MiB), %d quarantined, "
        "%d already indexed, %d temp files removed, %d evicted to fit the budget%s",
        heal.seconds, heal.reason, f"; the old index is in {heal.moved_to}" if heal.moved_to else "",
        heal.recovered, heal.recovered_bytes >> 20, heal.quarantined, heal.kept, heal.temps_removed, heal.evicted,
        f"; {heal.unverified} blobs predate kvd_sum and were parsed, not checksummed" if heal.unverified else "",
    )
