"""The daemon's side of the shared-memory data plane (PROTOCOL.md section 14).

Theory of operation
-------------------
The arena is a set of segment files in a private 0700 folder, each created
0600 and mapped with `mmap` (the same on macOS and Linux). The folder must be
memory, not disk, or the kernel writes every slot back to the drive: on Linux
it is `/dev/shm/kvd-<uid>-<hash of the socket path>-<random>` (tmpfs), elsewhere
`<socket>.shm-<random>` beside the socket (`new_plane_dir`): a name drawn at each
start, so no other user can take it first, and found again by its prefix so the
next start sweeps what a killed run left (`sweep_plane_dirs`). Segments are sparse; each
slot's pages are reserved when it is allocated (posix_fallocate where it
exists; a page map per segment skips pages reserved already, a syscall per
slot on every put otherwise), so memory grows with use, slot by slot (a tight memory cgroup sees no
jump), and a full tmpfs is an allocation failure, never a SIGBUS on first touch. A *slot* is one
allocation in a segment, carved from the smallest free range that holds it
(best fit, kvd/server/freespace.py: O(log n) however fragmented), merged with
its free neighbours when freed, every slot starting at a multiple of ALIGN. A segment whose slots are
all free is removed (unlinked and unmapped) as soon as the arena holds more
free space than it keeps warm for the next slots (`keep_free`, half its
capacity: about the RAM tier's budget), so memory the RAM tier gives back
under memory pressure leaves the arena too; replies list the live
segments so clients unmap the others. When the RAM tier yields to memory
pressure (its budget below the configured one), `trim` also hands back the
pages of every free range (MADV_REMOVE); a slot later carved from such a range
is reserved again like any other.

A slot's lifetime is its Python references: the bytes are handed out as a
`SlotArray` (a uint8 ndarray viewing the mapping that carries its `Slot`),
and the slot returns to the free list when the last reference goes -- the
RAM tier's entry, the spill queue's entry, a ZeroMQ frame still being sent,
a lease. So nothing frees a slot early and no code path has to remember to
free one: eviction drops the RAM tier's reference, a lease holds its own.

Rules the plane keeps (the sans-I/O halves are in kvd.protocol.shm):
1. Offered only on an ipc endpoint, and only to a request that echoes the
   nonce the daemon wrote 0600 into the folder at start (a peer of another
   uid cannot read it). A failed proof is not an error: the GET is served
   over frames, a SLOTS request is refused with BAD_FIELD.
2. A GET served over shm moves its entries' bytes into slots if they are not
   there yet (a frame-PUT entry, once), and pins them under a read lease.
3. SLOTS grants write slots under a write lease; nothing of them is in the
   store until COMMIT, so a half-written slot is never served. An expired
   or released lease drops its references: an uncommitted grant is freed.
   A grant keeps its request (tokens, metas, ns_meta) until then, so grants
   awaiting COMMIT are bounded, all peers together: at most
   `PENDING_LEASES`, holding at most min(max_message_bytes, PENDING_BYTES)
   (`_held_bytes`). Past either, SLOTS is BUSY (the client sends frames);
   a grant already made is never taken back for a newer one. A SLOTS that
   places nothing (no chunks, no boundary) is BAD_FIELD: that is a PUT.
   Read leases are bounded too (`READ_LEASES` live at once): past that a
   GET is served as frames, as when the arena has no room. A write lease
   that ends uncommitted loses its slots (`Arena.lose`): their ranges are
   never allocated again, since a writer stopped mid-copy (SIGSTOP, swapped
   out) writes on when it resumes, past any deadline; their pages are handed
   back at once. Their segment then drains: nothing more is allocated in it,
   its free pages are handed back too, it counts against the arena's capacity
   only by its live slots, and it goes with the last of them.
4. At start the folders killed predecessors on this endpoint left are
   swept (`sweep_plane_dirs`: our own user's only) and a fresh one is made;
   at a clean stop this run's segments, nonce and folder are removed.
5. No process can shrink a segment under the daemon (`_new_segment`). On
   Linux a segment is a memfd sealed against shrinking, named in the folder
   by a symlink to `/proc/<pid>/fd/<fd>` (which only processes allowed to
   inspect the daemon, i.e. of its uid, can open): a file cut short under a
   mapping turns the next touch of its pages into SIGBUS, in the daemon's
   spill writer or libzmq's sending thread, and in every client. A segment
   dies with the daemon and its clients' mappings, never left in /dev/shm.
   Elsewhere a segment is a file 0600 in the folder (README, known limits).
   Names removed or replaced under the daemon (a tmp cleaner, systemd's
   RemoveIPC) are put back within a second (`ShmPlane.repair`).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import logging
import math
import mmap
import os
import re
import secrets
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np

from kvd.endpoint import check_run_dir
from kvd.protocol import dtypes
from kvd.protocol.codec import Message, Tensor
from kvd.protocol.errors import BadField, Busy
from kvd.protocol.shm import (
    ALIGN, Descriptor, LeaseTable, align_up, check_proof, parse_segment_name, segment_name, stale_segments,
)
from kvd.server.freespace import FreeSpace
from kvd.server.peers import PENDING_ALLOWANCE
from kvd.server.ratelog import now_and_then
from kvd.store.base import Entry

log = logging.getLogger("kvd.server")

_PAGE = mmap.PAGESIZE
_MAX_SEGMENTS = 999_999  # segment indexes a run may use (kvd.protocol.shm.segment_name)
SEGMENT_BYTES = 64 << 20  # a new segment's size, unless one slot needs more
NONCE_FILE = "nonce"
_RUN_DIR = re.compile(r"-[0-9a-f]{16}")  # a run's folder: the prefix and this

# Grants awaiting COMMIT, all peers together (module docstring, rule 3). A
# model server has one or two in flight, each holding its tokens (4 MiB for
# the most a request may carry, 1 M) and ~1 KiB per chunk and tensor.
PENDING_LEASES = 1024
PENDING_BYTES = PENDING_ALLOWANCE  # and never more than max_message_bytes (the memory ceiling counts it)
# Read leases live at once, all peers together: a client releases its GET's
# lease with its next request; one that never does gets frames past this
# (each lease costs ~0.5 KiB here, and pins its slots in the arena).
READ_LEASES = 4096
# What a pending grant holds besides its tokens, metas and ns_meta (CPython
# 3.11, x86-64, measured with tracemalloc, rounded up): the lease and the PUT
# message with its maps; per chunk its map, its slot and slot array; per
# tensor its Tensor, shape and view of the slot (plus the name's bytes).
_PER_GRANT = 2048
_PER_CHUNK = 1536
_PER_TENSOR = 640
_PER_SPAN = 512  # a media span: its map, two ints and a 32-byte hash


def _specs(msg: Message) -> list:
    """A SLOTS request's tensors, a list per chunk and one for its boundary state."""
    specs = [c["tensors"] for c in msg["chunks"]]
    if msg.get("boundary") is not None:
        specs.append(msg["boundary"]["tensors"])
    return specs


def _sizes(specs: list) -> list[list[int]]:
    return [[math.prod(t.shape) * dtypes.itemsize(t.dtype) for t in ts] for ts in specs]


def _total(sizes: list[list[int]]) -> int:
    return sum(align_up(n) for ns in sizes for n in ns)


def asked_bytes(msg: Message) -> int:
    """The slot bytes a SLOTS request asks for (what its PUT will store)."""
    return _total(_sizes(_specs(msg)))


def _held_bytes(msg: Message, meta_bytes: int) -> int:
    """What a grant's pending PUT keeps in memory until COMMIT or expiry (an estimate
    that errs high): tokens, media, ns_meta (`meta_bytes`: it is kept packed), and
    every chunk's meta and tensors. O(chunks + tensors), whatever the maps hold."""
    parts = list(msg["chunks"]) + ([msg["boundary"]] if msg.get("boundary") is not None else [])
    return (_PER_GRANT + len(msg["tokens"]) + _PER_SPAN * len(msg.get("media") or ()) + meta_bytes
            + sum(_PER_CHUNK + len(p.get("meta") or b"")
                  + sum(_PER_TENSOR + len(t.name) for t in p["tensors"]) for p in parts))


class Slot:
    """One allocation; its bytes return to the arena when this object dies."""

    __slots__ = ("arena", "seg", "off", "size", "sid", "lost")

    def __init__(self, arena: "Arena", seg: int, off: int, size: int, sid: int):
        self.arena, self.seg, self.off, self.size, self.sid = arena, seg, off, size, sid
        self.lost = False  # its range is never allocated again (Arena.lose)

    def __del__(self):
        self.arena._free(self.seg, self.off, self.size, self.lost)


class SlotArray(np.ndarray):
    """A uint8 view of a slot's bytes that keeps the slot alive (views inherit it)."""

    slot: Slot | None = None

    def __array_finalize__(self, obj):
        self.slot = getattr(obj, "slot", None)


class Arena:
    """Segment files and their free lists. Thread-safe: the last reference to
    a slot may go on any thread (the SSD spill writer, ZeroMQ's I/O)."""

    def __init__(self, folder: Path, run_id: str, capacity: int | Callable[[], int], segment_bytes: int = SEGMENT_BYTES):
        self.folder, self.run_id = folder, run_id
        self.sealed = _probe_memfd()  # segments are sealed memfds (rule 5), else files
        # Bytes the arena may use: a number, or a callable read at each
        # allocation (the daemon's follows the RAM tier's budget as memory
        # pressure moves it, so under pressure shm PUTs fall back to frames).
        self._capacity = capacity if callable(capacity) else (lambda: int(capacity))
        self.segment_bytes = int(segment_bytes)
        self._mu = threading.Lock()
        # The thread inside `_mu`, and frees that arrived while it was: a
        # slot's last reference can go inside a locked section of this very
        # thread (the cyclic garbage collector runs wherever objects are
        # made), and `_mu` is not reentrant. Such a free waits here (a deque:
        # appends need no lock) until the section ends.
        self._owner: int | None = None
        self._deferred: collections.deque[tuple[int, int, int, bool]] = collections.deque()
        self._maps: list[mmap.mmap | None] = []  # None: removed (indexes are never reused)
        self._bases: list[int] = []  # address of each mapping (to locate views)
        self._sizes: list[int] = []
        self._fds: list[int] = []  # kept open: every slot reserves its range (_reserve)
        self._reserved: list[bytearray] = []  # per segment, per page: 1 once reserved (and not trimmed)
        self._space = FreeSpace()  # the free ranges of every segment
        self._seg_used: list[int] = []  # bytes of live slots, per segment
        # Bytes of lost ranges, per segment and in all: a write lease there
        # ended uncommitted, and its writer may still be writing (`lose`).
        self._seg_lost: list[int] = []
        self.lost_bytes = 0
        # Segments holding lost ranges: nothing more is allocated in them (their
        # free pages are handed back), and each goes once its live slots do. So
        # a few small entries beside lost ranges never pin whole segments of
        # capacity: a draining segment counts only its live bytes (`_grow`).
        self._draining: set[int] = set()
        self._sids = 0
        self._reserve_failures = 0
        self.used = 0
        self.counters = {"allocs": 0, "alloc_failures": 0, "segments_removed": 0, "trimmed_bytes": 0,
                         "grow_failures": 0, "lost_slots": 0, "names_repaired": 0}
        self.lean = False  # keep no free memory warm (give_back), until the next alloc

    # -- allocation ----------------------------------------------------------
    def alloc(self, nbytes: int) -> SlotArray | None:
        """A fresh slot of `nbytes` as a SlotArray, or None if the arena is full."""
        size = align_up(max(1, nbytes))
        with self._locked():
            self.lean = False
            if self.used + size > self.capacity:
                self.counters["alloc_failures"] += 1
                return None
            found = self._space.take(size)
            if found is None:
                try:
                    found = self._grow(size)
                except OSError as err:  # no memory for a segment, the folder gone: frames instead
                    self.counters["grow_failures"] += 1
                    if now_and_then(self.counters["grow_failures"]):
                        log.warning("cannot add a shared-memory segment (%d times so far): %s",
                                    self.counters["grow_failures"], err)
                    found = None
            if found is None:
                self.counters["alloc_failures"] += 1
                return None
            seg, off = found
            if not self._reserve(seg, off, size):
                self._free_locked(seg, off, size, count=False)
                self.counters["alloc_failures"] += 1
                return None
            self.used += size
            self._seg_used[seg] += size
            self.counters["allocs"] += 1
            self._sids += 1
            slot = Slot(self, seg, off, size, self._sids)
        arr = np.frombuffer(self._maps[seg], np.uint8, count=nbytes, offset=off).view(SlotArray)
        arr.slot = slot
        return arr

    @property
    def capacity(self) -> int:
        return int(self._capacity())

    def keep_free(self) -> int:
        """Free bytes the arena keeps mapped and reserved for the next slots:
        half its capacity (about the RAM tier's budget). A put then writes
        into pages already there, mapped by its client since an earlier put,
        instead of a new segment's (a RAM tier in steady state frees one
        entry as it stores the next: removing the freed segment at once made
        every put fault in fresh pages, 0.75 GiB/s instead of ~4 for 256 MiB).
        Memory pressure shrinks the capacity, and `trim` gives the rest back."""
        if self.lean:
            return self.segment_bytes
        return max(self.segment_bytes, self.capacity // 2)

    def give_back(self) -> int:
        """The operator emptied the RAM tier (`kvd gc --ram-mb`): hand back the
        free memory now (`trim`), and the slots freed later too (leases still
        pin some), until the next allocation."""
        self.lean = True
        return self.trim()

    def _grow(self, size: int) -> tuple[int, int] | None:
        seg_size = max(self.segment_bytes, size)
        # Draining segments count their live slots only: their other pages were
        # handed back (a late writer faulting lost ones in again pays for them
        # itself). Each segment costs a descriptor: at most about twice as many
        # as the capacity holds, draining ones included.
        held = sum(self._seg_used[seg] if seg in self._draining else n for seg, n in enumerate(self._sizes))
        if (held + seg_size > self.capacity or len(self._maps) >= _MAX_SEGMENTS
                or len(self.live()) >= 2 * (self.capacity // self.segment_bytes) + 8):
            return None
        seg = len(self._maps)
        name = segment_name(self.run_id, seg)
        fd = _new_segment(self.folder, name, seg_size, self.sealed)  # sparse: slots reserve their pages (_reserve)
        try:
            mm = mmap.mmap(fd, seg_size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            _unlink(self.folder / name)
            raise
        self._fds.append(fd)
        self._maps.append(mm)
        self._bases.append(np.frombuffer(mm, np.uint8).ctypes.data)
        self._sizes.append(seg_size)
        self._reserved.append(bytearray(-(-seg_size // _PAGE)))  # pages reserved so far (_reserve)
        self._seg_used.append(0)
        self._seg_lost.append(0)
        if seg_size > size:
            self._space.give(seg, size, seg_size - size)
        return seg, 0

    def _reserve(self, seg: int, off: int, size: int) -> bool:
        if not hasattr(os, "posix_fallocate"):
            return True
        lo, hi = off // _PAGE, -(-(off + size) // _PAGE)
        pages = self._reserved[seg]
        if pages.find(0, lo, hi) == -1:
            return True  # reused memory: its pages are there already (a syscall per slot saved)
        try:
            os.posix_fallocate(self._fds[seg], off, size)
        except OSError as err:
            self._reserve_failures += 1
            if now_and_then(self._reserve_failures):
                log.warning("cannot reserve %d bytes of shared memory (%d times so far): %s",
                            size, self._reserve_failures, err)
            return False
        pages[lo:hi] = b"\x01" * (hi - lo)
        return True

    def trim(self) -> int:
        """Give back the pages of every free range and remove all-free segments.
        Returns the bytes handed back."""
        freed = 0
        with self._locked():
            for seg, mm in enumerate(self._maps):
                if mm is None:
                    continue
                free = self._space.ranges(seg)
                if free == [(0, self._sizes[seg])]:
                    freed += self._sizes[seg]
                    self._remove(seg)
                    continue
                for off, n in free:
                    freed += self._punch(seg, off, n)
        self.counters["trimmed_bytes"] += freed
        return freed

    def _punch(self, seg: int, off: int, n: int) -> int:
        """Hand back the whole pages inside [off, off + n) of a segment (under
        the lock); returns how many bytes. A later touch finds zeros."""
        lo = -(-off // _PAGE) * _PAGE
        hi = (off + n) // _PAGE * _PAGE
        if hi <= lo or not hasattr(mmap, "MADV_REMOVE"):
            return 0
        self._maps[seg].madvise(mmap.MADV_REMOVE, lo, hi - lo)
        self._reserved[seg][lo // _PAGE:hi // _PAGE] = bytes((hi - lo) // _PAGE)
        return hi - lo

    def _free(self, seg: int, off: int, size: int, lost: bool = False) -> None:
        if self._owner == threading.get_ident():
            self._deferred.append((seg, off, size, lost))  # inside our own locked section
            return
        with self._locked():
            self._free_locked(seg, off, size, lost=lost)

    @contextlib.contextmanager
    def _locked(self):
        with self._mu:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                while self._deferred:
                    seg, off, size, lost = self._deferred.popleft()
                    self._free_locked(seg, off, size, lost=lost)
                self._owner = None

    def _free_locked(self, seg: int, off: int, size: int, count: bool = True, lost: bool = False) -> None:
        if count:
            self.used -= size
            self._seg_used[seg] -= size
        if self._maps[seg] is None:
            return
        if lost:
            # Never allocated again: its writer may still be writing. The
            # pages go back now (the writer's later touches cost its own).
            self._seg_lost[seg] += size
            self.lost_bytes += size
            self._punch(seg, off, size)
            self.counters["lost_slots"] += 1
            if seg not in self._draining:
                self._draining.add(seg)
                for start, n in self._space.ranges(seg):
                    self._punch(seg, start, n)
                self._space.drop(seg)
        elif seg in self._draining:
            self._punch(seg, off, size)  # never allocated again either: the segment drains
        elif self._space.give(seg, off, size) == (0, self._sizes[seg]) and self._spare() > self.keep_free():
            self._remove(seg)  # all free, and more than enough is kept warm elsewhere
            return
        if seg in self._draining and not self._seg_used[seg]:
            self._remove(seg)  # nothing live left: its late writer writes to memory no one reads

    def _spare(self) -> int:
        """Free bytes in the segments that allocate (not draining ones)."""
        return sum(n - self._seg_used[seg] for seg, n in enumerate(self._sizes) if seg not in self._draining)

    def lose(self, slots) -> None:
        """Allocate these slots' ranges never again: they were granted to a
        writer whose lease ended before it committed, and a writer stopped
        mid-copy (SIGSTOP, swapped out) writes on when it resumes, into
        whatever the range would hold by then. Their pages are handed back
        when the slots are freed, and their segment drains (`_draining`)."""
        for slot in slots:
            slot.lost = True

    def _remove(self, seg: int) -> None:
        """Give an all-free segment back (called under the lock)."""
        mm, self._maps[seg] = self._maps[seg], None
        self.lost_bytes -= self._seg_lost[seg]
        self._seg_lost[seg] = 0
        self._draining.discard(seg)
        self._sizes[seg], self._reserved[seg] = 0, bytearray()
        self._space.drop(seg)
        _unlink(self.folder / segment_name(self.run_id, seg))
        try:
            mm.close()
        except BufferError:  # a view still exports it: the mapping goes with that view
            pass
        os.close(self._fds[seg])
        self._fds[seg] = -1
        self.counters["segments_removed"] += 1

    def live(self) -> list[int]:
        """Indexes of the segments that exist now."""
        return [seg for seg, mm in enumerate(self._maps) if mm is not None]

    # -- lookups ------------------------------------------------------------------
    def locate(self, data: Any) -> tuple[Slot, Descriptor] | None:
        """The slot and descriptor of a buffer inside the arena, else None."""
        obj: Any = data
        for _ in range(4):  # memoryview -> its exporter -> ndarray base chain
            slot = getattr(obj, "slot", None) if isinstance(obj, np.ndarray) else None
            if slot is not None:
                break
            obj = obj.obj if isinstance(obj, memoryview) else getattr(obj, "base", None)
            if obj is None:
                return None
        else:
            return None
        view = memoryview(data)
        if view.nbytes:
            addr = np.frombuffer(view.cast("B") if view.format != "B" else view, np.uint8).ctypes.data
            off = addr - self._bases[slot.seg]
        else:
            off = slot.off
        if not slot.off <= off <= slot.off + slot.size - view.nbytes:
            return None
        return slot, Descriptor(slot.seg, off, view.nbytes)

    def stats(self) -> dict[str, Any]:
        return {"segments": len(self.live()), "mapped_bytes": sum(self._sizes), "used_bytes": self.used,
                "capacity_bytes": self.capacity, "lost_bytes": self.lost_bytes,
                "draining_segments": len(self._draining), **self.counters}

    def unlink(self) -> None:
        """Remove this run's segment names (mappings stay valid until unmapped)."""
        for seg in self.live():
            _unlink(self.folder / segment_name(self.run_id, seg))

    def repair(self) -> int:
        """Put back the names of live segments removed or replaced under us
        (rule 5; a file's name, off Linux, cannot be made again); returns how
        many. Under the lock: a segment removed meanwhile is not named again."""
        fixed = 0
        if not self.sealed:
            return 0
        with self._locked():
            for seg in self.live():
                path = self.folder / segment_name(self.run_id, seg)
                if not _names(path, self._fds[seg]):
                    try:
                        _unlink(path)
                        _name_segment(path, self._fds[seg])
                    except OSError:  # a folder under that name: not ours to empty; the next segment's
                        continue
                    fixed += 1
        self.counters["names_repaired"] += fixed
        return fixed


def _tmpfs(path: str) -> bool:
    try:
        with open("/proc/mounts") as f:
            return any(line.split()[1:3] == [path, "tmpfs"] for line in f if len(line.split()) > 2)
    except OSError:
        return False


_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_SEAL", 0)
_SEALED = hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS") and _SEALS


def _probe_memfd() -> bool:
    """Whether this process may make sealed memfds (a seccomp filter may
    forbid memfd_create: then segments are files, as off Linux)."""
    if not _SEALED:
        return False
    try:
        fd = os.memfd_create("kvd-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as err:
        log.warning("shared memory: memfd_create refused (%s); segments are files in the folder", err)
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        return True
    except OSError as err:
        log.warning("shared memory: memfds cannot be sealed (%s); segments are files in the folder", err)
        return False
    finally:
        os.close(fd)


def _new_segment(folder: Path, name: str, size: int, sealed: bool) -> int:
    """A new segment of `size` bytes (sparse), open read-write, named `name`
    in `folder`: the one OS-specific step of the arena (module docstring,
    rule 5). `sealed` (Linux, `_probe_memfd`): a memfd sealed against
    shrinking, named by a symlink to /proc/<pid>/fd/<fd>. Else: a file 0600."""
    path = folder / name
    if not sealed:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        return fd
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        _name_segment(path, fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _name_segment(path: Path, fd: int) -> None:
    """Make `path` name the segment open on `fd` (a memfd: a symlink to it)."""
    os.symlink(f"/proc/{os.getpid()}/fd/{fd}", path)


def _names(path: Path, fd: int) -> bool:
    """Whether the symlink `path` still names the memfd open on `fd`."""
    try:
        return os.readlink(path) == f"/proc/{os.getpid()}/fd/{fd}"
    except OSError:
        return False


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def plane_prefix(socket_path: Path, uid: int | None = None) -> Path:
    """What the folders of an ipc endpoint's runs are named from (module
    docstring): on Linux `/dev/shm/kvd-<uid>-<12 hex of the socket path's
    hash>`, elsewhere `<socket>.shm` beside the socket."""
    if sys.platform.startswith("linux") and _tmpfs("/dev/shm"):
        digest = hashlib.sha256(os.fsencode(os.path.abspath(socket_path))).hexdigest()[:12]
        return Path("/dev/shm") / f"kvd-{os.getuid() if uid is None else uid}-{digest}"
    return socket_path.with_name(socket_path.name + ".shm")


def plane_dirs(socket_path: Path, uid: int | None = None) -> list[Path]:
    """The folders runs on this endpoint made and left (a daemon killed; the
    live one's too): named from the prefix (or the prefix alone, as daemons
    before 0.2 named theirs), directories, and owned by `uid` (default: ours).
    A name another user made is never ours to touch."""
    prefix = plane_prefix(socket_path, uid)
    uid = os.getuid() if uid is None else uid
    try:
        names = os.listdir(prefix.parent)
    except OSError:
        return []
    found = []
    for name in names:
        if name != prefix.name and not _RUN_DIR.fullmatch(name.removeprefix(prefix.name)):
            continue
        try:
            st = os.lstat(prefix.parent / name)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid:
            found.append(prefix.parent / name)
    return sorted(found)


def sweep_plane_dirs(socket_path: Path) -> int:
    """Remove the folders killed runs on this endpoint left (call it holding
    the endpoint's lock: no other daemon serves it): their segments and
    nonce, then the folder. Anything else in one stays, and so does that
    folder. Returns how many folders went."""
    gone = 0
    for folder in plane_dirs(socket_path):
        try:
            for name in os.listdir(folder):
                if parse_segment_name(name) is not None or name == NONCE_FILE or name.startswith(NONCE_FILE + "."):
                    os.unlink(folder / name)
            folder.rmdir()
            gone += 1
        except OSError as err:
            log.warning("shared memory: cannot remove %s, a stopped run's folder: %s", folder, err)
    return gone


def new_plane_dir(socket_path: Path) -> Path:
    """A folder for this run's segments, made here, 0700: the prefix and 16
    random hex digits. Another user cannot have made it first (a name taken
    is passed over for another)."""
    prefix = plane_prefix(socket_path)
    for _ in range(8):
        folder = prefix.with_name(f"{prefix.name}-{secrets.token_hex(8)}")
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            continue
        return folder
    raise FileExistsError(f"no free folder name beside {prefix}")


class ShmPlane:
    """Proof, leases and the GET/SLOTS/COMMIT halves of the plane (module docstring)."""

    def __init__(self, folder: Path, *, capacity: int, lease_seconds: float,
                 clock: Callable[[], float] = time.monotonic, segment_bytes: int = SEGMENT_BYTES,
                 max_pending: int = PENDING_LEASES, max_pending_bytes: int = PENDING_BYTES,
                 max_read_leases: int = READ_LEASES):
        self.folder = folder
        self.run_id = secrets.token_hex(4)
        folder.mkdir(mode=0o700, exist_ok=True)
        check_run_dir(folder)  # ours, 0700, not a symlink: else UnsafeEndpoint
        for name in stale_segments(os.listdir(folder), self.run_id):
            os.unlink(folder / name)
        self.nonce = secrets.token_bytes(32)
        self._write_nonce()
        self.arena = Arena(folder, self.run_id, capacity, segment_bytes)
        self.leases = LeaseTable(lease_seconds)
        self._clock = clock
        self._held: dict[int, list[Slot]] = {}  # lease id -> the slots it keeps alive
        self._pending: dict[int, Message] = {}  # write lease -> the PUT it will commit
        self._pending_cost: dict[int, int] = {}  # write lease -> what its PUT holds (_held_bytes)
        self.pending_bytes = 0
        self.granted_bytes = 0  # slot bytes of the grants awaiting COMMIT
        self.max_pending, self.max_pending_bytes = max_pending, max_pending_bytes
        self.max_read_leases = max_read_leases
        self.counters = {"gets": 0, "refused": 0, "grants": 0, "commits": 0, "expired": 0, "released": 0,
                         "adopted_bytes": 0, "busy_pending": 0, "frames_over_leases": 0}

    def _write_nonce(self) -> None:
        tmp = self.folder / f"{NONCE_FILE}.{self.run_id}"
        _unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.nonce)
        os.replace(tmp, self.folder / NONCE_FILE)

    def repair(self) -> None:
        """Put back what was removed or replaced under the daemon (rule 5): the
        folder, the nonce, the segments' names. Call it on the loop's thread
        (a second apart is plenty). A folder that is no longer ours stays as
        it is: the plane is then of no use to clients (they refuse it), and
        frames serve them."""
        try:
            st = os.lstat(self.folder)
        except FileNotFoundError:
            os.mkdir(self.folder, 0o700)
            st = os.lstat(self.folder)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return
        try:
            fd = os.open(self.folder / NONCE_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                same = stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, 64) == self.nonce
            finally:
                os.close(fd)
        except OSError:
            same = False
        if not same:
            if os.path.isdir(self.folder / NONCE_FILE) and not os.path.islink(self.folder / NONCE_FILE):
                return  # a folder of that name: not ours to empty
            self._write_nonce()
        self.arena.repair()

    def offer(self) -> dict[str, Any]:
        """What HELLO tells a client about the plane."""
        offer = {"dir": str(self.folder), "run": self.run_id, "lease_s": self.leases.lease_seconds}
        if self.arena.sealed:  # segments are links into /proc/<pid>/fd: clients open nothing else (rule 5)
            offer["pid"] = os.getpid()
            with contextlib.suppress(OSError):  # a client in another pid namespace cannot open them
                offer["pidns"] = os.readlink("/proc/self/ns/pid")
        return offer

    # -- leases ----------------------------------------------------------------
    def expire(self) -> None:
        """End leases past their deadline (run before every request): costs
        what expired, not what is live (LeaseTable.expire_leases)."""
        for lease in self.leases.expire_leases(self._clock()):
            if lease.lease_id in self._pending:  # granted, never committed: its writer may be late, not gone
                self.arena.lose(self._held.get(lease.lease_id, ()))
            self._forget(lease.lease_id)
            self.counters["expired"] += 1

    def _drop(self, lid: int) -> None:
        self.leases.release(lid)
        self._forget(lid)

    def _forget(self, lid: int) -> None:
        """Let go of what a lease the table no longer has kept alive."""
        slots = self._held.pop(lid, None)
        if self._pending.pop(lid, None) is not None:
            self.pending_bytes -= self._pending_cost.pop(lid)
            self.granted_bytes -= sum(slot.size for slot in slots or ())

    def _lease(self, slots: list[Slot], *, write: bool) -> int:
        sids = [s.sid for s in slots]
        lease = self.leases.grant(self._clock(), **({"write": sids} if write else {"read": sids}))
        self._held[lease.lease_id] = slots
        return lease.lease_id

    def admit(self, field: Any) -> bool:
        """Check a request's `shm` map: True if its proof holds. Releases the
        leases it lists (only for this run: ids restart with every run)."""
        if not isinstance(field, dict):
            raise BadField("field 'shm' must be a map")
        if not check_proof(self.nonce, field.get("proof")):
            self.counters["refused"] += 1
            return False
        release = field.get("release") or []
        if not isinstance(release, list) or len(release) > 4096:
            raise BadField("field 'shm.release' must be an array of at most 4096 lease ids")
        for lid in release:
            if isinstance(lid, int) and not isinstance(lid, bool) and lid in self._held and lid not in self._pending:
                self._drop(lid)
                self.counters["released"] += 1
        return True

    # -- GET -----------------------------------------------------------------
    def describe_get(self, reply: dict[str, Any], entries: list[Entry]) -> dict[str, Any]:
        """Turn a GET reply's tensors into descriptors under one read lease.
        Entries not yet in the arena are copied in (and keep living there);
        a tensor the arena has no room for stays a frame, and so does the
        whole reply while READ_LEASES read leases are live."""
        if len(self._held) - len(self._pending) >= self.max_read_leases:
            self.counters["frames_over_leases"] += 1
            reply["shm"] = {"run": self.run_id, "lease_s": self.leases.lease_seconds, "segments": self.arena.live()}
            return reply
        swap: dict[int, Tensor] = {}
        for entry in entries:
            swap.update(self._adopt(entry))
        slots: dict[int, Slot] = {}

        def convert(tensors: list[Tensor]) -> list[Tensor]:
            out = []
            for t in tensors:
                t = swap.get(id(t), t)
                found = self.arena.locate(t.data)
                if found is None:
                    out.append(t)
                    continue
                slots[found[0].sid] = found[0]
                out.append(Tensor(t.name, t.dtype, t.shape, found[1]))
            return out

        for chunk in reply.get("chunks", ()):
            chunk["tensors"] = convert(chunk["tensors"])
        if reply.get("boundary") is not None:
            reply["boundary"]["tensors"] = convert(reply["boundary"]["tensors"])
        self.counters["gets"] += 1
        if slots:
            lid = self._lease(list(slots.values()), write=False)
            reply["shm"] = {"lease": lid, "run": self.run_id, "lease_s": self.leases.lease_seconds}
        else:
            reply["shm"] = {"run": self.run_id, "lease_s": self.leases.lease_seconds}
        reply["shm"]["segments"] = self.arena.live()
        return reply

    def _adopt(self, entry: Entry) -> dict[int, Tensor]:
        """Move an entry's tensors into one slot, unless they are in the arena
        already; returns {id(old tensor): new tensor}."""
        todo = [t for t in entry.tensors if self.arena.locate(t.data) is None]
        if not todo:
            return {}
        total = sum(align_up(t.nbytes) for t in todo)
        arr = self.arena.alloc(total)
        if arr is None:
            return {}
        swap: dict[int, Tensor] = {}
        pos = 0
        for t in todo:
            n = t.nbytes
            dst = arr[pos:pos + n]
            if n:
                dst[:] = np.frombuffer(memoryview(t.data).cast("B"), np.uint8)
            swap[id(t)] = Tensor(t.name, t.dtype, t.shape, dst)
            pos += align_up(n)
        entry.tensors = tuple(swap.get(id(t), t) for t in entry.tensors)
        self.counters["adopted_bytes"] += total
        return swap

    # -- PUT: SLOTS then COMMIT ----------------------------------------------------
    def grant(self, msg: Message, max_bytes: int) -> dict[str, Any]:
        """Write slots for a PUT's tensors, under a write lease. BUSY past the
        bound on grants awaiting COMMIT (module docstring, rule 3)."""
        specs = _specs(msg)
        if not specs:
            raise BadField("SLOTS without chunks or boundary places nothing; send a PUT")
        sizes = _sizes(specs)
        total = _total(sizes)
        if total > max_bytes:
            raise BadField(f"SLOTS asks for {total} bytes; one request may cover {max_bytes}")
        # ns_meta waits packed: decoded, a 64 KiB map of maps is ~70x that.
        meta = msg.get("ns_meta")
        packed_meta = None if meta is None else msgpack.packb(meta, use_bin_type=True)
        cost = _held_bytes(msg, len(packed_meta or b""))
        if (len(self._pending) >= self.max_pending
                or self.pending_bytes + cost > min(max_bytes, self.max_pending_bytes)):
            self.counters["busy_pending"] += 1
            raise Busy(f"{len(self._pending)} shared-memory PUTs ({self.pending_bytes} bytes) await their COMMIT; "
                       "send this PUT over frames")
        # One slot per entry, so an entry's bytes are freed with it, not
        # with the last survivor of the batch it came in.
        slots: list[Slot] = []
        out: list[list[list[int]]] = []
        filled: list[list[Tensor]] = []
        for ts, ns in zip(specs, sizes):
            arr = self.arena.alloc(sum(align_up(n) for n in ns))
            if arr is None:
                raise Busy("the shared-memory arena is full; send this PUT over frames")
            slots.append(arr.slot)
            descs, tensors, pos = [], [], 0
            for t, n in zip(ts, ns):
                descs.append([arr.slot.seg, arr.slot.off + pos, n])
                tensors.append(Tensor(t.name, t.dtype, t.shape, arr[pos:pos + n]))
                pos += align_up(n)
            out.append(descs)
            filled.append(tensors)
        lid = self._lease(slots, write=True)
        fields = dict(msg.fields)
        fields["chunks"] = [{**c, "tensors": filled[i]} for i, c in enumerate(msg["chunks"])]
        if msg.get("boundary") is not None:
            fields["boundary"] = {**msg["boundary"], "tensors": filled[-1]}
        fields.pop("shm", None)
        if packed_meta is not None:
            fields["ns_meta"] = packed_meta
        self._pending[lid] = Message("PUT", fields, msg.id)
        self._pending_cost[lid] = cost
        self.pending_bytes += cost
        self.granted_bytes += sum(slot.size for slot in slots)
        self.counters["grants"] += 1
        reply: dict[str, Any] = {"lease": lid, "run": self.run_id, "lease_s": self.leases.lease_seconds,
                                 "chunks": out[:len(msg["chunks"])], "segments": self.arena.live()}
        if msg.get("boundary") is not None:
            reply["boundary"] = out[-1]
        return reply

    def lease_bytes(self, lease_id: Any) -> int:
        """The bytes of a live write lease's slots (0 if it is not one): what its PUT stores."""
        if not isinstance(lease_id, int) or lease_id not in self._pending:
            return 0
        return sum(slot.size for slot in self._held[lease_id])

    def commit(self, lease_id: int) -> Message:
        """The PUT a live write lease was granted for, its slots now written.
        BadField if the lease is unknown or expired (its slots are gone)."""
        msg = self._pending.get(lease_id)
        if msg is None:
            raise BadField(f"no live shm write lease {lease_id}")
        now = self._clock()
        for slot in self._held[lease_id]:
            self.leases.commit(lease_id, slot.sid, now)  # BadField past the deadline
        self._drop(lease_id)  # the store's entries now keep the slots alive
        self.counters["commits"] += 1
        if msg.get("ns_meta") is not None:
            msg.fields["ns_meta"] = msgpack.unpackb(msg["ns_meta"], raw=False, strict_map_key=False)
        return msg

    def stats(self) -> dict[str, Any]:
        return {"run": self.run_id, "dir": str(self.folder), "lease_s": self.leases.lease_seconds,
                "leases": len(self._held), "pending": len(self._pending), "pending_bytes": self.pending_bytes,
                "granted_bytes": self.granted_bytes,
                **self.arena.stats(), **self.counters}

    def close(self) -> None:
        """A clean stop leaves nothing: segments, nonce, folder."""
        self._held.clear()
        self._pending.clear()
        self._pending_cost.clear()
        self.pending_bytes = self.granted_bytes = 0
        self.arena.unlink()
        try:
            os.unlink(self.folder / NONCE_FILE)
            self.folder.rmdir()
        except OSError:  # not empty: something else is in there; leave it
            pass
