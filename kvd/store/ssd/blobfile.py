"""One entry as one safetensors file: encoding, crash-safe writing, checked reading.

This module is the SSD tier's serializer, and only that: it knows the file
format and the write protocol, nothing about budgets, the index or threads.

Format
------
A blob is a plain safetensors file, written directly (8-byte little-endian
header length, a JSON header padded with spaces to a multiple of 8, then the
tensor bytes back to back). Tensors keep their true dtype ("bfloat16" is
stored as BF16, never widened), so `mx.load` or any safetensors reader opens
a blob as it is. The `__metadata__` map (strings only, as the format demands)
carries what kvd needs to rebuild the `Entry` without its index row:

    kvd_format   FORMAT_VERSION; a reader refuses any other value
    kvd_namespace, kvd_key (hex), kvd_kind, kvd_parent (hex), kvd_start,
    kvd_length, kvd_tail ("0"/"1"), kvd_meta (base64 of the client's msgpack),
    kvd_order    JSON list of tensor names in entry order (JSON maps need not
                 keep order in other readers)
    kvd_sum      16 hex digits: xxh3-64 of the whole file as written with
                 these 16 digits set to "0". A blob so proves its own bytes,
                 header included, without its index row: what rebuilding a
                 lost index checks (kvd/store/ssd/heal.py). Blobs written before
                 it existed have none; readers ignore metadata they do not use,
                 so older and newer kvd read each other's blobs.

The encoding is deterministic: the same entry always gives the same bytes,
so a blob rewritten after an eviction has the checksum it had before.

Write protocol (`write_blob`)
-----------------------------
temp name in the target's directory -> write -> fsync (F_FULLFSYNC on macOS
with `full_fsync`: there fsync does not flush the drive cache) -> rename over the final name ->
fsync the directory. Only then may the caller commit an index row. A crash at
any step leaves either nothing, a temp file, or a complete blob without a
row -- never a row pointing at a partial file. On error the temp file is
removed and the OSError propagates (the caller decides about ENOSPC/EIO).

Group sync (`write_blob(durable=False)` then `sync_group`): the SSD writer
writes a whole batch first and then fsyncs all its files and folders at
once, in parallel (filesystems merge concurrent fsyncs into fewer journal
commits), before it commits any of their rows. A blob renamed but not yet
synced has no row, so a power cut then leaves at worst a blob without a row,
which reconcile removes, never a row pointing at a partial file.

Reading opens with `open_blob`, which refuses (BlobCorrupt) anything under
a blob's name that is not a regular file, without blocking on a FIFO or
following a symlink. `read_blob` then checks the size and the xxh3-64 of the whole file
against what the index recorded, then parses; any disagreement raises
`BlobCorrupt`, which the tier turns into a quarantine and a miss.
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import json
import os
import stat
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import xxhash

from kvd.host import files as host_files
from kvd.protocol import dtypes
from kvd.protocol.errors import KvdError
from kvd.protocol.shm import align_up
from kvd.store.base import Entry, Tensor
from kvd.store.datadir import FILE_MODE, TMP_SUFFIX, ensure_folder

FORMAT_VERSION = 1

# wire dtype name -> safetensors dtype code. Bijective, so a blob's dtypes
# come back under the very names they were stored with.
ST_DTYPE = {
    "bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64",
    "uint8": "U8", "int8": "I8", "uint16": "U16", "int16": "I16",
    "uint32": "U32", "int32": "I32", "uint64": "U64", "int64": "I64", "bool": "BOOL",
}
WIRE_DTYPE = {code: name for name, code in ST_DTYPE.items()}

_SUM_ZERO = "0" * 16
_SUM_FIELD = b'"kvd_sum":"'

# A header bigger than this is garbage, not a blob (a real one is a few KiB).
MAX_HEADER = 64 << 20


class BlobCorrupt(KvdError):
    """The blob on disk is not the one the index describes (checksum, size or parse failure)."""


class Unencodable(KvdError, ValueError):
    """The entry cannot be written as a safetensors file (duplicate or reserved tensor names)."""


class Altered(KvdError):
    """A tensor in a shared-memory slot no longer holds the bytes fixed at its
    COMMIT (kvd.store.base.as_stored): nothing was written under its name."""


@dataclass(frozen=True, slots=True)
class BlobInfo:
    file_size: int  # bytes in the file
    disk_bytes: int  # bytes the filesystem allocated for it (what the budget counts)
    checksum: int  # xxh3_64 of the whole file


def _buffer(data) -> memoryview:
    mv = memoryview(data)
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


def encode_header(entry: Entry) -> bytes:
    """The 8-byte length prefix plus padded JSON header for `entry`."""
    names = [t.name for t in entry.tensors]
    if len(set(names)) != len(names) or "__metadata__" in names:
        raise Unencodable(f"tensor names must be unique and not '__metadata__': {names}")
    header: dict = {
        "__metadata__": {
            "kvd_format": str(FORMAT_VERSION),
            "kvd_namespace": entry.namespace,
            "kvd_key": entry.key.hex(),
            "kvd_kind": str(entry.kind),
            "kvd_parent": entry.parent.hex(),
            "kvd_start": str(entry.start),
            "kvd_length": str(entry.length),
            "kvd_tail": "1" if entry.tail else "0",
            "kvd_meta": base64.b64encode(entry.meta).decode("ascii"),
            "kvd_order": json.dumps(names),
            "kvd_sum": _SUM_ZERO,
        }
    }
    offset = 0
    for t in entry.tensors:
        n = _buffer(t.data).nbytes
        want = dtypes.itemsize(t.dtype)
        for dim in t.shape:
            want *= dim
        if n != want:
            raise Unencodable(f"tensor {t.name!r}: {n} bytes for {t.dtype}{list(t.shape)}")
        header[t.name] = {"dtype": ST_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    # Pad so the data section starts 8-byte aligned (the safetensors
    # convention, and what lets a reader map tensors without copying).
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    # The sum covers the header with its own digits zeroed, then the data.
    hasher = xxhash.xxh3_64(head)
    for t in entry.tensors:
        hasher.update(_buffer(t.data))
    at = head.index(_SUM_FIELD) + len(_SUM_FIELD)
    return head[:at] + hasher.hexdigest().encode("ascii") + head[at + 16 :]


def embedded_sum_ok(buf: bytes | bytearray) -> bool | None:
    """Whether the whole blob in `buf` matches its own `kvd_sum`: True, False,
    or None for a blob written before kvd_sum existed (nothing to check).
    Call it on a blob that parsed (`parse_blob`)."""
    (hlen,) = struct.unpack_from("<Q", buf, 0)
    head = bytes(buf[8 : 8 + hlen])
    # Inside a JSON string a quote is escaped, so this byte run can only be
    # the metadata key itself; the writer puts it there once.
    at = head.find(_SUM_FIELD)
    if at < 0:
        return None
    at += len(_SUM_FIELD)
    want = head[at : at + 16]
    hasher = xxhash.xxh3_64(bytes(buf[:8]) + head[:at] + _SUM_ZERO.encode() + head[at + 16 :])
    hasher.update(memoryview(buf)[8 + hlen :])
    return hasher.hexdigest().encode("ascii") == want


# fsync semantics per OS (F_FULLFSYNC where the `full_fsync` setting asks)
# live in kvd/host/files.py; these names are the store's.
set_full_fsync, full_fsync, fsync_dir = host_files.set_full_fsync, host_files.full_fsync, host_files.fsync_dir


def _sync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        full_fsync(fd)
    finally:
        os.close(fd)


def start_sync(path: Path, pool):
    """Begin the fsync of `path` (written with durable=False) on `pool`: the
    writer starts each big blob's as soon as it is written, so the disk
    writes one while the writer encodes and copies the next; `sync_group`
    waits for it with the others."""
    return pool.submit(_sync_file, path)


def sync_group(files: list[Path], dirs: set[Path], pool, started: dict | None = None) -> dict[Path, OSError]:
    """Make `files` (written with durable=False) and the folders naming them
    durable, using `pool` (a concurrent.futures executor) to fsync in
    parallel; `started`: {file: future} of fsyncs already begun (start_sync).
    Returns {file: error} for each file that is not durable (its own fsync
    failed, or its folder's); empty when all are."""
    started = started or {}
    file_futs = {f: started.get(f) or pool.submit(_sync_file, f) for f in files}
    dir_futs = {d: pool.submit(fsync_dir, d) for d in dirs}
    failed: dict[Path, OSError] = {}
    dir_errors = {}
    for d, fut in dir_futs.items():
        exc = fut.exception()
        if exc is not None:
            dir_errors[d] = exc
    parents = {f.parent for f in files}
    # A folder above the files (a new shard's parent) failing fails them all.
    above = next((e for d, e in dir_errors.items() if d not in parents), None)
    for f, fut in file_futs.items():
        exc = fut.exception() or dir_errors.get(f.parent) or above
        if exc is not None:
            failed[f] = exc if isinstance(exc, OSError) else OSError(str(exc))
    return failed


_BOUNCE_BYTES = 1 << 20


def _write_all(fd: int, mv: memoryview, hasher, bounce: memoryview, also=None) -> None:
    """Write `mv` to `fd`, hashing exactly what is written: each piece is
    copied into `bounce` (ours alone) first, then hashed and written from
    there. A tensor in shared memory can change under us -- a client writing
    into its slot after COMMIT -- and a checksum of other bytes than the
    file's would make a good blob look corrupt (quarantined, a lost entry).
    `also`: a second hasher fed the same pieces (a slot's own digest)."""
    for pos in range(0, len(mv), len(bounce)):
        piece = bounce[: min(len(bounce), len(mv) - pos)]
        piece[:] = mv[pos : pos + len(piece)]
        hasher.update(piece)
        if also is not None:
            also.update(piece)
        while piece:
            n = os.write(fd, piece)
            piece = piece[n:]


def _touchable(t: Tensor) -> Any:
    """`t`'s bytes, where this process may read them: a slot of a segment
    another process may cut short (kvd.server.shm.arena, not `fixed`) is read
    with pread into a private copy (a touch of its mapping past a new end is
    SIGBUS); Altered if it was cut short under them."""
    slot = getattr(t.data, "slot", None)
    if slot is None or getattr(slot.arena, "fixed", True):
        return t.data
    data = slot.arena.copy_out(t.data)
    if data is None:
        raise Altered(f"tensor {t.name!r}: its shared-memory segment was cut short")
    return data


def _missing_or_symlink(path: Path) -> bool:
    """One lstat, as the is_dir it replaces."""
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except FileNotFoundError:
        return True


def temp_path(path: Path) -> Path:
    return path.parent / f".{path.stem}.{os.getpid()}{TMP_SUFFIX}"


def write_blob(path: Path, entry: Entry, *, durable: bool = True) -> BlobInfo:
    """Write `entry` to `path` crash-safely (see module docstring).

    Tensors in shared-memory slots (a `digest` on their data, see
    kvd.store.base.as_stored) are written from the slot through the bounce
    buffer, and what was written is checked against the digest fixed at
    COMMIT: no private copy of the whole entry first. The file is
    preallocated where the OS can (posix_fallocate): its extents are taken
    at once, not grown write by write.

    Returns the file's size, allocated bytes and checksum. Raises Unencodable
    for an entry safetensors cannot express, Altered for a slot changed since
    its COMMIT, OSError for I/O errors (the temp file is removed first;
    nothing at `path` is touched unless the rename ran).
    """
    digests = [getattr(t.data, "digest", None) for t in entry.tensors]
    datas = [_touchable(t) for t in entry.tensors]
    if any(d is not t.data for d, t in zip(datas, entry.tensors)):
        entry = dataclasses.replace(entry, tensors=tuple(dataclasses.replace(t, data=d) for t, d in zip(entry.tensors, datas)))
    head = encode_header(entry)
    parent = path.parent
    if _missing_or_symlink(parent):
        # A shard's first blob, or blobs/ removed under us: made again; a
        # symlink to elsewhere is moved aside (datadir.ensure_folder). Shard
        # folders live at root/blobs/<2 hex>. (A file there fails this one
        # write, ENOTDIR: the caller's per-path error.)
        root = parent.parent.parent
        ensure_folder(root, f"{parent.parent.name}/{parent.name}", sync=fsync_dir if durable else None)
    tmp = temp_path(path)
    hasher = xxhash.xxh3_64()
    # O_NOFOLLOW | O_NONBLOCK: whatever a stranger left under the temp name
    # (a symlink, a FIFO that would block the open) fails this one write.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, FILE_MODE)
    try:
        try:
            size = len(head) + sum(_buffer(t.data).nbytes for t in entry.tensors)
            _preallocate(fd, size)
            bounce = memoryview(bytearray(min(_BOUNCE_BYTES, max(len(head), entry.nbytes))))
            _write_all(fd, memoryview(head), hasher, bounce)
            for t, digest in zip(entry.tensors, digests):
                check = xxhash.xxh3_64() if digest is not None else None
                _write_all(fd, _buffer(t.data), hasher, bounce, check)
                if check is not None and check.intdigest() != digest:
                    raise Altered(f"tensor {t.name!r} changed in its shared-memory slot after COMMIT")
            if durable:
                full_fsync(fd)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        fsync_dir(parent)
    # st_blocks is in 512-byte units whatever the filesystem's block size.
    disk = st.st_blocks * 512 if st.st_blocks else st.st_size
    return BlobInfo(file_size=st.st_size, disk_bytes=max(disk, st.st_size), checksum=hasher.intdigest())


def _preallocate(fd: int, size: int) -> None:
    """Reserve a big blob's extents at once (kvd/host/files.py: Linux's
    posix_fallocate; macOS grows files well by itself): a full disk fails
    here, before any byte is copied."""
    if size >= _BOUNCE_BYTES:
        host_files.preallocate(fd, size)


def encode_blob(entry: Entry) -> tuple[bytes, int]:
    """The bytes `write_blob` would write for `entry`, in memory, and their
    xxh3-64: what the pack of small blobs stores (kvd/store/ssd/pack.py)."""
    head = encode_header(entry)
    buf = b"".join([head, *(_buffer(t.data) for t in entry.tensors)])
    return buf, xxhash.xxh3_64_intdigest(buf)


def checked_blob(buf: Any, size: int, checksum: int) -> Entry:
    """The entry held in `buf` (a whole blob read from anywhere), after
    checking its size and checksum against the index's. Raises BlobCorrupt."""
    n = memoryview(buf).nbytes
    if n != size:
        raise BlobCorrupt(f"{n} bytes where {size} were recorded")
    got = xxhash.xxh3_64_intdigest(buf)
    if got != checksum:
        raise BlobCorrupt(f"checksum {got:016x} != recorded {checksum:016x}")
    return parse_blob(buf)


def estimate_disk_bytes(entry: Entry, block: int = 4096) -> int:
    """Bytes a blob of `entry` will take on disk, for budgeting before it is written."""
    size = 8 + 1024 + len(entry.meta) * 2 + 128 * len(entry.tensors) + entry.nbytes
    return -(-size // block) * block


def read_all(fd: int, size: int) -> bytearray:
    """Read exactly `size` bytes from `fd` (from offset 0) into a fresh
    bytearray. Short file -> BlobCorrupt."""
    buf = bytearray(size)
    mv = memoryview(buf).cast("B")
    pos = 0
    while pos < size:
        n = os.preadv(fd, [mv[pos:]], pos) if hasattr(os, "preadv") else _pread_into(fd, mv, pos)
        if n == 0:
            raise BlobCorrupt(f"file shorter than recorded ({pos} < {size} bytes)")
        pos += n
    if os.pread(fd, 1, size):
        raise BlobCorrupt(f"file longer than recorded ({size} bytes)")
    return buf


def _pread_into(fd: int, mv: memoryview, at: int, pos: int | None = None) -> int:
    """pread into `mv[at:]` from the file's offset `pos` (default `at`), where
    os.preadv is missing (macOS before 11, as Python was built)."""
    pos = at if pos is None else pos
    chunk = os.pread(fd, min(len(mv) - at, 64 << 20), pos)
    mv[at : at + len(chunk)] = chunk
    return len(chunk)


def open_blob(path: str | os.PathLike) -> int:
    """An fd to read the blob file at `path`, known to be a regular file.

    Anything else under a blob's name is not a blob, and some would hurt: a
    FIFO blocks open() (and then every read) until a writer comes, a symlink
    leads anywhere. So the open neither blocks nor follows a symlink, and
    fstat decides. Raises BlobCorrupt for those, OSError otherwise
    (FileNotFoundError when there is none)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink (or a loop of them)
            raise BlobCorrupt("a symlink, not a blob file") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise BlobCorrupt(f"not a regular file (mode {stat.filemode(mode)})")
    return fd


def read_blob(fd: int, size: int, checksum: int) -> Entry:
    """The entry stored in the open blob `fd`, after checking its size and checksum
    (read into a bytearray of its own: private memory, so the bytes checked are
    the bytes served; `read_to_slots` reads into shared memory with the same promise).

    Raises BlobCorrupt on any disagreement; OSError for I/O errors.
    """
    # Before a buffer is sized by `size`: the index's word for it is checked
    # (index.Row.check), but a file of another size is corrupt whatever it says.
    have = os.fstat(fd).st_size
    if have != size:
        raise BlobCorrupt(f"file of {have} bytes where {size} were recorded")
    return checked_blob(read_all(fd, size), size, checksum)


def read_to_slots(fd: int, size: int, checksum: int, slots: Callable[[int], Any]) -> Entry | None:
    """Read the blob `fd` of `size` bytes into one slot of `slots(nbytes)` (a
    writable uint8 array whose slices take a `digest`: the arena's SlotArray,
    kvd.server.shm), each tensor at an aligned place, as `_write_all` writes:
    each piece is read into a bounce buffer of our own first, hashed there
    (the file's checksum, and the tensor's xxh3-64 that goes with it into the
    slot, kvd.store.base.as_stored), then copied into the slot. Any process of
    the daemon's user can write into a slot, so nothing is checked there:
    what the checksum passed is what the digests describe, and a write into
    the slot at any time after is found wherever the bytes go.

    A fresh bytearray is memory new to the process, which costs more than
    the read itself on some machines (docs/limits.md, new memory); the slot's
    pages are the arena's, ready. None if the blob is smaller than the bounce
    buffer, if `slots` has no room, or if the header lays the tensors out as
    no kvd writes them: read it to the heap instead (`read_blob`).
    Raises BlobCorrupt, OSError as `read_blob`.
    """
    if size < _BOUNCE_BYTES:
        return None  # a blob this small costs no more on the heap
    have = os.fstat(fd).st_size
    if have != size:
        raise BlobCorrupt(f"file of {have} bytes where {size} were recorded")
    (hlen,) = struct.unpack("<Q", _pread_exact(fd, 8, 0, size))
    if hlen > min(MAX_HEADER, size - 8):
        raise BlobCorrupt(f"header length {hlen} out of range")
    if hlen > _SLOTTED_HEADER:
        return None  # parsed before its checksum can pass: only what a kvd writes is, here
    head = _pread_exact(fd, hlen, 8, size)
    start = 8 + hlen
    try:
        md, specs = _parse_header(head, size - start)
    except BlobCorrupt:
        raise
    except _UNPARSABLE as exc:
        raise BlobCorrupt(f"unparsable blob: {exc!r}") from None
    by_place = sorted(range(len(specs)), key=lambda i: specs[i][3:])
    ends = [0] + [specs[i][4] for i in by_place]
    if not specs or any(specs[i][3] != ends[k] for k, i in enumerate(by_place)):
        return None  # tensors that do not tile the data section: the heap road says what is wrong
    places, total = [], 0
    for *_, lo, hi in specs:
        places.append(total)
        total += align_up(hi - lo)
    arr = slots(total)
    if arr is None:
        return None
    hasher = xxhash.xxh3_64()
    hasher.update(struct.pack("<Q", hlen))
    hasher.update(head)
    digests = [xxhash.xxh3_64() for _ in specs]
    bounce = getattr(_reading, "bounce", None)
    if bounce is None:  # one per thread that reads, kept: cache-resident, never memory new to the process
        bounce = _reading.bounce = np.empty(_BOUNCE_BYTES, np.uint8)
    mv = memoryview(bounce)
    k, pos = 0, start
    while pos < size:
        piece = mv[: min(len(mv), size - pos)]
        n = os.preadv(fd, [piece], pos) if hasattr(os, "preadv") else _pread_into(fd, piece, 0, pos)
        if n == 0:
            raise BlobCorrupt(f"file shorter than recorded ({pos} < {size} bytes)")
        hasher.update(mv[:n])
        a, b = pos - start, pos - start + n  # the data section's bytes in the bounce buffer
        while k < len(by_place):
            i = by_place[k]
            lo, hi = specs[i][3], specs[i][4]
            x, y = max(a, lo), min(b, hi)
            if x < y:
                digests[i].update(mv[x - a : y - a])
                np.copyto(arr[places[i] + x - lo : places[i] + y - lo], bounce[x - a : y - a])
            if hi > b:
                break
            k += 1
        pos += n
    if os.pread(fd, 1, size):
        raise BlobCorrupt(f"file longer than recorded ({size} bytes)")
    got = hasher.intdigest()
    if got != checksum:
        raise BlobCorrupt(f"checksum {got:016x} != recorded {checksum:016x}")
    tensors = []
    for i, (name, dtype, shape, lo, hi) in enumerate(specs):
        dst = arr[places[i] : places[i] + hi - lo]
        dst.digest = digests[i].intdigest()
        tensors.append(Tensor(name, dtype, shape, dst))
    try:
        return _entry(md, tensors)
    except _UNPARSABLE as exc:
        raise BlobCorrupt(f"unparsable blob: {exc!r}") from None


_reading = threading.local()  # read_to_slots' bounce buffer, per thread
# A header parsed before the file's checksum is known (read_to_slots) is at
# most this big (a kvd writes a few KiB, and the client's meta); a bigger one
# goes the heap road, whose checksum comes first. Whatever it holds, its
# parse fails as BlobCorrupt: a miss, the blob quarantined, never INTERNAL.
_SLOTTED_HEADER = 1 << 20
_UNPARSABLE = (ValueError, KeyError, TypeError, AttributeError, ArithmeticError, RecursionError, UnicodeDecodeError,
               struct.error)


def _pread_exact(fd: int, n: int, pos: int, size: int) -> bytes:
    out = os.pread(fd, n, pos)
    while len(out) < n:
        more = os.pread(fd, n - len(out), pos + len(out))
        if not more:
            raise BlobCorrupt(f"file shorter than recorded ({pos + len(out)} < {size} bytes)")
        out += more
    return out


def parse_blob(buf: bytearray | bytes) -> Entry:
    """Decode a whole blob held in memory. Tensors are read-only views into `buf`.

    Raises BlobCorrupt if it is not a kvd blob of FORMAT_VERSION.
    """
    try:
        return _parse(memoryview(buf).toreadonly())
    except BlobCorrupt:
        raise
    except _UNPARSABLE as exc:  # (a header of any shape: `__metadata__` a string, say)
        raise BlobCorrupt(f"unparsable blob: {exc!r}") from None


def _parse(mv: memoryview) -> Entry:
    (hlen,) = struct.unpack_from("<Q", mv, 0)
    if hlen > min(MAX_HEADER, len(mv) - 8):
        raise BlobCorrupt(f"header length {hlen} out of range")
    md, specs = _parse_header(bytes(mv[8 : 8 + hlen]), len(mv) - 8 - hlen)
    data = mv[8 + hlen :]
    return _entry(md, [Tensor(name, dtype, shape, data[lo:hi]) for name, dtype, shape, lo, hi in specs])


def _parse_header(raw: bytes, data_len: int) -> tuple[dict, list[tuple[str, str, tuple[int, ...], int, int]]]:
    """A blob's JSON header: its metadata, and each tensor's (name, dtype,
    shape, start, end) in the data section of `data_len` bytes, in order."""
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise BlobCorrupt("header is not a JSON object")
    md = header.pop("__metadata__")
    if md.get("kvd_format") != str(FORMAT_VERSION):
        raise BlobCorrupt(f"blob format {md.get('kvd_format')!r}, this kvd reads {FORMAT_VERSION}")
    order = json.loads(md["kvd_order"])
    if sorted(order) != sorted(header):
        raise BlobCorrupt("tensor list disagrees with kvd_order")
    specs = []
    end = 0
    for name in order:
        spec = header[name]
        dtype = WIRE_DTYPE[spec["dtype"]]
        shape = tuple(int(d) for d in spec["shape"])
        lo, hi = (int(x) for x in spec["data_offsets"])
        want = dtypes.itemsize(dtype)
        for dim in shape:
            if dim < 0:
                raise BlobCorrupt(f"negative dimension in {name!r}")
            want *= dim
        if not 0 <= lo <= hi <= data_len or hi - lo != want:
            raise BlobCorrupt(f"tensor {name!r} offsets {lo}..{hi} do not fit {dtype}{list(shape)}")
        end = max(end, hi)
        specs.append((name, dtype, shape, lo, hi))
    if end != data_len:
        raise BlobCorrupt(f"{data_len - end} stray bytes after the tensors")
    return md, specs


def _entry(md: dict, tensors: list[Tensor]) -> Entry:
    key, parent = bytes.fromhex(md["kvd_key"]), bytes.fromhex(md["kvd_parent"])
    if len(key) != 32:
        raise BlobCorrupt("bad key")
    return Entry(
        namespace=md["kvd_namespace"],
        key=key,
        kind=int(md["kvd_kind"]),
        parent=parent,
        start=int(md["kvd_start"]),
        length=int(md["kvd_length"]),
        tensors=tuple(tensors),
        meta=base64.b64decode(md["kvd_meta"], validate=True),
        tail=md["kvd_tail"] == "1",
    )
