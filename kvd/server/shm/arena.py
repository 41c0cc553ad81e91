"""The shared-memory plane's arena: segments, and the slots carved from them.

Theory of operation
-------------------
The arena is a set of segment files in a private 0700 folder, each created
0600 and mapped with `mmap` (the same on macOS and Linux). The folder must be
memory, not disk, or the kernel writes every slot back to the drive: on Linux
it is `/dev/shm/kvd-<uid>-<hash of the socket path>-<random>` (tmpfs), elsewhere
`<socket>.shm-<random>` beside the socket (folders.py, `new_plane_dir`): a name drawn at each
start, so no other user can take it first, and found again by its prefix so the
next start sweeps what a killed run left (`sweep_plane_dirs`). Segments are sparse; each
slot's pages are reserved when it is allocated (posix_fallocate where it
exists; a page map per segment skips pages reserved already, a syscall per
slot on every put otherwise), so memory grows with use, slot by slot (a tight memory cgroup sees no
jump), and a full tmpfs is an allocation failure, never a SIGBUS on first touch. A *slot* is one
allocation in a segment, carved from the smallest free range that holds it
(best fit, freespace.py: O(log n) however fragmented), merged with
its free neighbours when freed, every slot starting at a multiple of ALIGN. A segment whose slots are
all free is removed (unlinked and unmapped) as soon as the arena holds more
free space than it keeps warm for the next slots (`keep_free`, half its
capacity: about the RAM tier's budget), so memory the RAM tier gives back
under memory pressure leaves the arena too; and, oldest first, when a slot
too big for any of them would otherwise not fit the capacity (`_drop_idle`);
replies list the live
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

Segments are made by kvd/host/segments.py (sealed memfds on Linux, files
elsewhere: kvd/server/shm/plane.py, rule 5); what the plane does with slots
(leases, GET, SLOTS/COMMIT) is in plane.py, reads.py and writes.py.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import os
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvd.host.segments import advise_huge, clear, fixed_size, name_segment, names_segment, new_segment, unlink_segment
from kvd.host.select import mechanism
from kvd.protocol.shm import Descriptor, align_up, segment_name
from kvd.server.shm.freespace import FreeSpace
from kvd.server.ratelog import now_and_then

log = logging.getLogger("kvd.server")

_PAGE = mmap.PAGESIZE
_MAX_SEGMENTS = 999_999  # segment indexes a run may use (kvd.protocol.shm.segment_name)
SEGMENT_BYTES = 64 << 20  # a new segment's size, unless one slot needs more
RECENT_SLOTS = 64  # the latest slots whose sizes size the segments prepared ahead (`prepare_bytes`)


class Slot:
    """One allocation; its bytes return to the arena when this object dies."""

    __slots__ = ("arena", "seg", "off", "size", "sid", "lost")

    def __init__(self, arena: "Arena", seg: int, off: int, size: int, sid: int):
        self.arena, self.seg, self.off, self.size, self.sid = arena, seg, off, size, sid
        self.lost = False  # its range is never allocated again (Arena.lose)

    def __del__(self):
        self.arena._free(self.seg, self.off, self.size, self.lost)


class SlotArray(np.ndarray):
    """A uint8 view of a slot's bytes that keeps the slot alive (views inherit
    it). A tensor's view also carries `digest`, the xxh3-64 its bytes had when
    committed (kvd.store.base.as_stored checks it); other views do not."""

    slot: Slot | None = None
    unreserved = False  # alloc(reserve=False): its pages not reserved yet (the slot's own array only)
    digest: int | None = None
    located: "tuple[Slot, Descriptor] | None" = None  # Arena.locate's answer, kept: a slot never moves

    def __array_finalize__(self, obj):
        self.slot = getattr(obj, "slot", None)
        self.digest = None
        self.located = None


class Arena:
    """Segment files and their free lists. Thread-safe: the last reference to
    a slot may go on any thread (the SSD spill writer, ZeroMQ's I/O)."""

    def __init__(self, folder: Path, run_id: str, capacity: int | Callable[[], int], segment_bytes: int = SEGMENT_BYTES,
                 *, huge: bool | None = None):
        self.folder, self.run_id = folder, run_id
        self.mechanism = mechanism("shared_memory")  # memfd | shm_open | files (kvd.host.select)
        self.sealed = self.mechanism == "memfd"  # sealed memfds (plane.py rule 5)
        # No process can cut a segment short (a sealed memfd; an shm_open
        # object on macOS): its pages are read and written through the mapping.
        self.fixed = fixed_size(self.mechanism)
        # 2 MiB pages asked for on each segment's mapping, where Linux's shmem
        # THP policy allows (kvd.host.segments, "Huge pages"); the preparer then
        # clears a segment through that mapping. `huge` overrides (tests).
        if huge is None:
            huge = mechanism("shared_memory_pages").startswith("2 MiB")
        self.huge = bool(huge) and self.sealed
        # Bytes the arena may use: a number, or a callable read at each
        # allocation (the daemon's follows the RAM tier's budget as memory
        # pressure moves it, so under pressure shm PUTs fall back to frames).
        self._capacity = capacity if callable(capacity) else (lambda: int(capacity))
        self.segment_bytes = int(segment_bytes)
        # The size of the segments prepared before any slot's size is known
        # (`prepare_bytes`): the daemon's is bigger than `segment_bytes`
        # (kvd/server/shm/startup.py, `window_segment_bytes`).
        self.window_segment_bytes = self.segment_bytes
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
        self._begun: set[int] = set()  # made by the preparer, not yet offered (begin_segment .. end_segment)
        self._sids = 0
        self._reserve_failures = 0
        self.used = 0
        self.counters = {"allocs": 0, "alloc_failures": 0, "segments_removed": 0, "trimmed_bytes": 0,
                         "grow_failures": 0, "lost_slots": 0, "names_repaired": 0, "shrunk_segments": 0}
        self.lean = False  # keep no free memory warm (give_back), until the next alloc
        self.allocated = 0  # bytes allocated so far, in all (kvd/server/shm/prepare.py reads it)
        self._recent: collections.deque[int] = collections.deque(maxlen=RECENT_SLOTS)  # their sizes (`prepare_bytes`)
        # Told after a slot is handed out once `allocated` reaches `wake_at`
        # (the preparer, which sets it: kvd/server/shm/prepare.py, "How far ahead").
        self.on_alloc: Callable[[], None] | None = None
        self.wake_at = 0

    # -- allocation ----------------------------------------------------------
    def alloc(self, nbytes: int, *, reserve: bool = True) -> SlotArray | None:
        """A fresh slot of `nbytes` as a SlotArray, or None if the arena is full.
        `reserve=False`: its pages are not reserved here when they need to be
        (the array's `unreserved` says so); its holder reserves them
        (`reserve`) before anyone writes to it, off the serving thread."""
        size = align_up(max(1, nbytes))
        with self._locked():
            self.lean = False
            if self.used + size > self.capacity:
                self.counters["alloc_failures"] += 1
                return None
            found = self._space.take(size)
            while found is not None and not self.fixed and self._cut_short(found[0]):
                self._space.give(found[0], found[1], size)
                self._drain_shrunk(found[0])  # never allocated in again
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
            if reserve and not self._reserve(seg, off, size):
                self._free_locked(seg, off, size, count=False)
                self.counters["alloc_failures"] += 1
                return None
            self.used += size
            self._seg_used[seg] += size
            self.allocated += size  # the preparer's measure of demand (prepare.py)
            self._recent.append(size)
            self.counters["allocs"] += 1
            self._sids += 1
            slot = Slot(self, seg, off, size, self._sids)
            unreserved = not reserve and self._unreserved(slot)
        arr = np.frombuffer(self._maps[seg], np.uint8, count=nbytes, offset=off).view(SlotArray)
        arr.slot = slot
        if unreserved:
            arr.unreserved = True
        if self.on_alloc is not None and self.allocated >= self.wake_at:
            self.on_alloc()
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
        if held + seg_size > self.capacity:
            held -= self._drop_idle(held + seg_size - self.capacity, below=size)
        if (held + seg_size > self.capacity or len(self._maps) >= _MAX_SEGMENTS
                or len(self.live()) >= 2 * (self.capacity // self.segment_bytes) + 8):
            return None
        seg = self._add_segment(seg_size)
        if seg_size > size:
            self._space.give(seg, size, seg_size - size)
        return seg, 0

    def _drop_idle(self, need: int, below: int) -> int:
        """Remove all-free segments smaller than `below`, oldest first, until
        `need` bytes are given back, for a slot (or a segment prepared for
        slots, `begin_segment`) of `below` bytes, which none of them can
        hold (under the lock). Kept warm for the next slots (`keep_free`), they
        count against the capacity all the same: a daemon whose window was
        prepared in segments smaller than the chunks that came (a 768 MiB RAM
        tier: 16 MiB segments, 32 MiB chunks) had its capacity taken by them
        and sent its PUTs over frames once its RAM tier was full. None is
        removed unless enough can be: the bytes given back (0 or >= need)."""
        idle = [seg for seg, mm in enumerate(self._maps)
                if mm is not None and seg not in self._draining and self._sizes[seg] < below
                and self._space.ranges(seg) == [(0, self._sizes[seg])]]
        if sum(self._sizes[seg] for seg in idle) < need:
            return 0
        freed = 0
        for seg in idle:
            if freed >= need:
                break
            freed += self._sizes[seg]
            self._remove(seg)
        return freed

    def _add_segment(self, seg_size: int) -> int:
        """Make, map and record segment number len(self._maps), sparse (slots
        reserve their pages, _reserve); its number. Under the lock."""
        seg = len(self._maps)
        name = segment_name(self.run_id, seg)
        fd = new_segment(self.folder, name, seg_size, self.mechanism)
        try:
            mm = mmap.mmap(fd, seg_size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            unlink_segment(self.folder, name)
            raise
        self._fds.append(fd)
        self._maps.append(mm)
        self._bases.append(np.frombuffer(mm, np.uint8).ctypes.data)
        if self.huge:
            advise_huge(self._bases[-1], seg_size)  # before any page of it is faulted in
        self._sizes.append(seg_size)
        self._reserved.append(bytearray(-(-seg_size // _PAGE)))  # pages reserved so far (_reserve)
        self._seg_used.append(0)
        self._seg_lost.append(0)
        return seg

    # -- segments prepared ahead of demand (kvd/server/shm/prepare.py) ------------
    def prepare_bytes(self) -> int:
        """The size of the next segment prepared ahead (kvd/server/shm/prepare.py):
        `segment_bytes`, or the biggest of the latest slots (RECENT_SLOTS)
        where that is bigger, as `_grow` makes one for a slot; before any
        slot, `window_segment_bytes` (that size unknown). Segments are
        sized from the RAM budget, chunks from the model: a 70B-class model's
        256-token chunk is 80 MiB against segments of at most 64, an 8B
        model's 32 MiB against a 768 MiB tier's 16. Prepared at
        `segment_bytes`, none held such a slot: each went to a segment of its
        own made for it, pages not ready, and the preparer's memory served
        nothing."""
        with self._locked():
            biggest = max(self._recent, default=0) or self.window_segment_bytes
        return max(self.segment_bytes, biggest)

    def expect_slots(self, size: int) -> None:
        """Count a slot of `size` bytes among the latest (`prepare_bytes`)
        before any is handed out: the size the last run on the endpoint was
        given (kvd/server/shm/folders.py, "the slots a run was given"), so the
        window is prepared in segments that hold such slots. Forgotten, as any
        slot's size, after RECENT_SLOTS more."""
        with self._locked():
            self._recent.append(int(size))

    def spare_prepared(self, fit: int | None = None) -> int:
        """Free bytes in the segments that allocate (not draining, not being
        prepared) that slots of `fit` bytes can use (default `prepare_bytes`:
        every free byte while that is `segment_bytes`, else each free range's
        whole slots of it): the preparer's measure of what is ready. Mostly
        reserved pages; not all: a segment offered unreserved (its preparation
        failed) and the rest of one the serving thread made for a grant count
        too -- the grants carved from them reserve their own pages (`reserve`),
        and preparing more beside them would hold memory twice for one demand."""
        fit = self.prepare_bytes() if fit is None else fit
        with self._locked():
            segs = [seg for seg, mm in enumerate(self._maps)
                    if mm is not None and seg not in self._draining and seg not in self._begun]
            if fit <= self.segment_bytes:
                return sum(self._sizes[seg] - self._seg_used[seg] for seg in segs)
            return sum(n // fit * fit for seg in segs for _, n in self._space.ranges(seg))

    def begin_segment(self, room: int, size: int | None = None) -> tuple[int, int] | None:
        """A new segment of `size` bytes (default `segment_bytes`) for the
        preparer, made and mapped but not yet offered to `alloc` (its free
        space is given in `end_segment`), if the arena may hold one more within
        `room` mapped bytes -- idle segments too small for slots of `size`
        removed to make room if that is enough (`_drop_idle`); else None."""
        size = self.segment_bytes if size is None else size
        with self._locked():
            mapped = sum(n for seg, n in enumerate(self._sizes) if seg not in self._draining)
            if mapped + size > room:
                mapped -= self._drop_idle(mapped + size - room, below=size)
            if (mapped + size > room or len(self._maps) >= _MAX_SEGMENTS
                    or len(self.live()) >= 2 * (self.capacity // self.segment_bytes) + 8):
                return None
            seg = self._add_segment(size)
            self._begun.add(seg)  # not free until offered: stats read on another thread meanwhile
            return seg, self._fds[seg]

    def address(self, seg: int) -> int:
        """Where segment `seg` is mapped in this process (the preparer's populate)."""
        return self._bases[seg]

    def end_segment(self, seg: int, reserved: bool) -> None:
        """Offer a prepared segment to `alloc`: its pages reserved (`reserved`:
        posix_fallocate of the whole of it, done outside the lock, held)."""
        with self._locked():
            self._begun.discard(seg)
            if self._maps[seg] is None:
                return
            if reserved:
                self._reserved[seg][:] = b"\x01" * len(self._reserved[seg])
            self._space.give(seg, 0, self._sizes[seg])

    def unreserved(self, slot: Slot) -> bool:
        """Whether a slot handed out by alloc(reserve=False) has pages not yet reserved."""
        with self._locked():
            return self._unreserved(slot)

    def _unreserved(self, slot: Slot) -> bool:
        if not hasattr(os, "posix_fallocate"):
            return False
        return self._reserved[slot.seg].find(0, slot.off // _PAGE, -(-(slot.off + slot.size) // _PAGE)) != -1

    def reserve(self, slot: Slot) -> bool:
        """Reserve the pages of a slot alloc(reserve=False) handed out, on any
        thread (kvd/server/shm/prepare.py): the lock is not held through the
        clearing and the fallocate, so the serving thread's allocations never
        wait for them. The
        caller holds `slot`: its segment (and so its fd) stays till then."""
        lo, hi = slot.off // _PAGE, -(-(slot.off + slot.size) // _PAGE)
        with self._locked():
            if not self._unreserved(slot):
                return True
            fd = os.dup(self._fds[slot.seg])  # (a copy: nothing of the arena's is used unlocked)
            pages = bytes(self._reserved[slot.seg][lo:hi])
        try:
            cleared = self._clear_holes(fd, slot, lo, pages)
            if not self._fallocate(fd, slot.off, slot.size):  # what is left: the slot's edge pages
                # The runs cleared are allocated all the same: counted reserved,
                # so a later slot there costs no syscall and `trim` hands them back.
                with self._locked():
                    for p, q in cleared:
                        self._reserved[slot.seg][lo + p:lo + q] = b"\x01" * (q - p)
                return False
        finally:
            os.close(fd)
        with self._locked():
            self._reserved[slot.seg][lo:hi] = b"\x01" * (hi - lo)
        return True

    @staticmethod
    def _clear_holes(fd: int, slot: Slot, lo: int, pages: bytes) -> list[tuple[int, int]]:
        """Clear (kvd.host.segments.clear) each run of never-reserved pages
        wholly inside `slot` (`pages`: the bitmap from page `lo`): cleared
        now, a client maps them sixteen a fault, where a posix_fallocate'd
        page is cleared at its first touch, in the client, one fault a page
        (a 256 MiB slot: ~75 ms more of the client's copy here). Only pages no other
        slot shares, and holes: nothing there is overwritten. Best effort:
        posix_fallocate reserves whatever this did not. The runs cleared, as
        (first, end) pages from `lo`."""
        first, end = -(-slot.off // _PAGE) - lo, (slot.off + slot.size) // _PAGE - lo
        cleared = []
        p = pages.find(0, first, end)
        while p != -1:
            q = pages.find(1, p, end)
            q = end if q == -1 else q
            if not clear(fd, (q - p) * _PAGE, (lo + p) * _PAGE):
                break
            cleared.append((p, q))
            p = pages.find(0, q, end)
        return cleared

    def _reserve(self, seg: int, off: int, size: int) -> bool:
        if not hasattr(os, "posix_fallocate"):
            return True
        lo, hi = off // _PAGE, -(-(off + size) // _PAGE)
        pages = self._reserved[seg]
        if pages.find(0, lo, hi) == -1:
            return True  # reused memory: its pages are there already (a syscall per slot saved)
        if not self._fallocate(self._fds[seg], off, size):
            return False
        pages[lo:hi] = b"\x01" * (hi - lo)
        return True

    def _fallocate(self, fd: int, off: int, size: int) -> bool:
        try:
            os.posix_fallocate(fd, off, size)
        except OSError as err:
            self._reserve_failures += 1
            if now_and_then(self._reserve_failures):
                log.warning("cannot reserve %d bytes of shared memory (%d times so far): %s",
                            size, self._reserve_failures, err)
            return False
        return True

    # -- segments a process may cut short (not `fixed`) ------------------------
    # On Linux a process of the daemon's uid can ftruncate a POSIX shm object
    # (/dev/shm/kvd-...) or a file; a touch of a mapped page past the new end
    # is SIGBUS. So the daemon never touches such a segment's pages in user
    # space: it copies out with pread (a short read: the entry is damaged, a
    # miss) and in with pwrite (past the end, the object grows back), and
    # stops allocating in a segment found cut short. Memfds are sealed
    # against shrinking, and macOS sizes a POSIX shm object once (and has no
    # pread/pwrite for one): their pages are copied directly
    # (kvd.host.segments.fixed_size).
    def copy_out(self, data: Any) -> bytes | None:
        """A private copy of a slot's bytes (`data`, a view of one), or None
        if its segment was cut short under them (any thread)."""
        found = self.locate(data) if not self.fixed else None
        if found is None:
            return bytes(memoryview(data).cast("B"))
        slot, desc = found
        parts, off, left = [], desc.offset, desc.length
        try:
            while left:
                got = os.pread(self._fds[slot.seg], left, off)
                if not got:
                    break
                parts.append(got)
                off, left = off + len(got), left - len(got)
        except OSError:
            pass
        if left:
            with self._locked():
                self._drain_shrunk(slot.seg)
            return None
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def copy_in(self, dst: "SlotArray", src: Any) -> None:
        """Write `src`'s bytes into the slot view `dst` (the daemon's own
        writes: an entry moved into the arena)."""
        found = self.locate(dst) if not self.fixed else None
        if found is None:
            dst[:] = np.frombuffer(memoryview(src).cast("B"), np.uint8)
            return
        view, off = memoryview(src).cast("B"), found[1].offset
        while view.nbytes:  # past the end of a cut segment the object grows back: no fault
            n = os.pwrite(self._fds[found[0].seg], view, off)
            view, off = view[n:], off + n

    def _cut_short(self, seg: int) -> bool:
        try:
            return os.fstat(self._fds[seg]).st_size < self._sizes[seg]
        except OSError:
            return True

    def _drain_shrunk(self, seg: int) -> None:
        """A segment was cut short (under the lock): nothing more is allocated
        in it, its free pages go back, and it goes with its last live slot."""
        if self._maps[seg] is None or seg in self._draining:
            return
        self.counters["shrunk_segments"] += 1
        log.warning("shared-memory segment %d was cut short by another process: its entries are misses", seg)
        self._draining.add(seg)
        for start, n in self._space.ranges(seg):
            self._punch(seg, start, n)
        self._space.drop(seg)
        if not self._seg_used[seg]:
            self._remove(seg)

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
        with contextlib.suppress(OSError):  # past the end of a segment cut short
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
        unlink_segment(self.folder, segment_name(self.run_id, seg))
        try:
            mm.close()
        except BufferError:  # a view still exports it: the mapping goes with that view
            pass
        os.close(self._fds[seg])
        self._fds[seg] = -1
        self.counters["segments_removed"] += 1

    def ready(self) -> list[int]:
        """The segments that exist, but those still being prepared (their
        pages not all there yet): what a new client maps ahead. Not only the
        free ones: a full RAM tier frees an entry's slots wherever they are
        as it stores the next."""
        with self._locked():
            return [seg for seg, mm in enumerate(self._maps) if mm is not None and seg not in self._begun]

    def next_segment(self) -> int:
        """The index the next segment made will have (indexes are never reused)."""
        with self._locked():
            return len(self._maps)

    def live(self) -> list[int]:
        """Indexes of the segments that exist now."""
        return [seg for seg, mm in enumerate(self._maps) if mm is not None]

    # -- lookups ------------------------------------------------------------------
    def locate(self, data: Any) -> tuple[Slot, Descriptor] | None:
        """The slot and descriptor of a buffer inside the arena, else None.
        Kept on a SlotArray once found: a GET of a 1 GiB cache asks for 2,048
        tensors, twice each (reads.describe_get), ~5 us a time to work out."""
        if type(data) is SlotArray and data.located is not None:
            return data.located
        found = self._locate(data)
        if found is not None and type(data) is SlotArray:
            data.located = found
        return found

    def _locate(self, data: Any) -> tuple[Slot, Descriptor] | None:
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
            unlink_segment(self.folder, segment_name(self.run_id, seg))

    def repair(self) -> int:
        """Put back the names of live segments removed or replaced under us
        (plane.py rule 5; a file's name, off Linux, cannot be made again); returns how
        many. Under the lock: a segment removed meanwhile is not named again."""
        fixed = 0
        if not self.sealed:
            return 0
        with self._locked():
            for seg in self.live():
                path = self.folder / segment_name(self.run_id, seg)
                if not names_segment(path, self._fds[seg]):
                    try:
                        unlink_name(path)
                        name_segment(path, self._fds[seg])
                    except OSError:  # a folder under that name: not ours to empty; the next segment's
                        continue
                    fixed += 1
        self.counters["names_repaired"] += fixed
        return fixed


def unlink_name(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
