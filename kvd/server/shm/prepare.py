"""Pages of the arena made ready before a PUT needs them (issue 42).

A freshly started daemon has no segments: each SLOTS made one and reserved
its slots' pages on the serving thread (posix_fallocate, ~55 ms per 256 MiB
here), and the client then faulted every page of its new mapping in one at a
time (~115 ms more: the kernel clears a shmem page reserved by fallocate at
its first fault, and fault-around skips pages not yet cleared), so a put
into a fresh daemon ran at a fifth of a warm one's rate. The thread
`kvd-shm-prep` keeps prepared free space ahead of demand instead: whole
segments made, mapped, their pages reserved and cleared away from the
serving thread, offered to `Arena.alloc` only once ready. Where Linux
gives huge pages to shmem (`Arena.huge`, kvd.host.segments "Huge pages"),
the daemon's own mapping of the segment, which asked for them, is populated
(`populate`): 2 MiB pages, ~20 GiB/s here out of memory freed moments
before, ~0.4 out of memory the VM gave back to its host. Else on Linux zeros
are written through the segment's fd (kvd.host.segments.clear: pages
allocated, cleared and resident, in no page table; 2.6 GiB/s here);
elsewhere, or if that fails, posix_fallocate then MADV_POPULATE_WRITE of
the daemon's mapping (`populate`: the same, plus the daemon's page tables
filled; 1.7 GiB/s here). A slot carved from them costs no syscall, and a
client maps their pages sixteen a fault (client/_pages.py), not one. Both
go a few MiB per call (`_populate`): with one call per 64 MiB segment, a client
connecting while a 4 GiB window was being prepared missed its 250 ms
`connect_wait` now and then on this loaded 2-core VM (2 of ~25 connects;
with 4 MiB calls none of 36 -- the likely cause, the daemon's mmap lock held
through each call, is a guess).

A grant that comes before the window is ready (or after memory was handed
back) is carved from pages never reserved. The serving thread does not
reserve them (a posix_fallocate of 1 GiB held it ~370 ms here): this thread
does, before anything else it does (`reserve`), and the SLOTS reply is
parked until then (kvd/server/handler.py, `on_slots`).

How far ahead:
- From the start, before any PUT: the *window*, `shm_warm_mb` (kvd/config.py)
  but at most the RAM tier's budget and a segment -- what a warm daemon
  keeps mapped anyway (`Arena.keep_free`), so a new daemon's fill meets
  pages as ready as a warm one's (kvd/server/shm/startup.py, `warm_window`).
- Once puts come: twice the bytes allocated in the busiest recent interval
  (each wake measures the bytes allocated since the last, and the figure
  decays by a tenth per wake), at least two segments.
- Each segment as big as the biggest of the latest slots, where that is
  bigger than the arena's `segment_bytes` (`Arena.prepare_bytes`), and only
  free ranges that hold such a slot count as ready: segments are sized from
  the RAM budget (kvd/server/shm/startup.py), chunks from the model, and a
  70B-class model's 256-token chunks (80 MiB) fit no 64 MiB segment. Idle
  segments smaller than that give way to the new ones when the ceiling
  below is reached (`Arena.begin_segment`). That size is noted for the
  next run on the endpoint, whose window is then prepared in it
  (kvd/server/shm/folders.py, "the slots a run was given"). The thread wakes every
  WAKE_S, and when allocations have taken a segment's worth since its last
  wake (`Arena.wake_at`): not at every slot, which under a storm of small
  puts took the GIL from the serving thread ~2,000 times a second.
Bounds, always: the segments that allocate hold at most half the arena's
capacity plus one segment (the RAM tier's budget, about); a segment is made
only while the free prepared bytes with it stay within a quarter of the
memory available to the daemon (`available`: MemAvailable, or the tightest
memory cgroup's limit less its working set, kvd.host.pressure), so a daemon
in a tight memory cgroup sees no jump at start (tests/server/test_pressure.py);
nothing is prepared while the RAM tier yields to memory pressure (`allowed`;
the arena's `trim` then hands the free window back, kvd/server/shm/startup.py),
nor after `kvd gc --ram-mb` emptied it (`Arena.lean`), so memory handed back
stays handed back; nor while the daemon's fds fill half its fd table
(`fds_ok`: a segment holds one, and the other half is the peers' bursts,
kvd.server.admission.caps), so an fd limit lowered under a running daemon
leaves room for its clients.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Callable

from kvd.host.segments import clear, give_back, populate
from kvd.server.shm.arena import Arena

log = logging.getLogger("kvd.server")

WAKE_S = 0.05  # the thread looks at demand at least this often
POPULATE_STEP = 4 << 20  # bytes populated per call (`_populate`)
AVAILABLE_SHARE = 4  # free prepared bytes stay within 1/AVAILABLE_SHARE of the memory available


class Preparer:
    def __init__(self, arena: Arena, allowed: Callable[[], bool] = lambda: True, *, window: int = 0,
                 available: Callable[[], int | None] = lambda: None, fds_ok: Callable[[], bool] = lambda: True,
                 on_size: Callable[[int], object] | None = None):
        self.arena, self.allowed, self.available, self.fds_ok = arena, allowed, available, fds_ok
        # Told, on this thread, when the size of the segments it prepares
        # changes (`Arena.prepare_bytes`): the daemon notes it for its next
        # run (kvd/server/shm/folders.py, "the slots a run was given").
        self.on_size = on_size
        self._size = arena.prepare_bytes()
        self.window = max(0, int(window))  # bytes prepared from the start, before any PUT
        self._wake = threading.Event()
        self._stop = False
        self._seen = 0
        self._burst = 0.0
        self.prepared_bytes = 0
        self.populated_bytes = 0
        self.failures = 0
        self.held_back = 0  # segments not made for want of available memory
        self._grants: collections.deque = collections.deque()  # (slots, done): reserve these first (`reserve`)
        self.reserved_grants = 0
        self._thread = threading.Thread(target=self._run, name="kvd-shm-prep", daemon=True)

    def start(self) -> "Preparer":
        self.arena.on_alloc = self._wake.set
        self._wake.set()  # the window at once, not after the first wait
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        self.arena.on_alloc = None
        self._wake.set()
        self._thread.join(5.0)
        self._fail_grants()
        self._note_size()  # slots handed out since the thread last looked are noted too

    def _note_size(self) -> int:
        """The size of the next segment prepared (`Arena.prepare_bytes`), told
        to `on_size` if it changed."""
        size = self.arena.prepare_bytes()
        if size != self._size:
            self._size = size
            if self.on_size is not None:
                self.on_size(size)
        return size

    def _fail_grants(self) -> None:
        """Grants never reserved: their PUTs go over frames (nothing waits for ever)."""
        while self._grants:
            try:
                _, done = self._grants.popleft()
            except IndexError:
                break
            done(False)

    @property
    def running(self) -> bool:
        """Whether `reserve` may be asked (the thread started and not stopped)."""
        return not self._stop and self._thread.is_alive()

    def reserve(self, slots: list, done: Callable[[bool], None]) -> None:
        """Reserve the pages of a grant's slots (alloc(reserve=False)) on this
        thread, before anything else it does, then call `done(ok)` here: the
        serving thread never waits for a fallocate (a fresh daemon's first
        SLOTS of 1 GiB held it ~370 ms). RuntimeError once stopped."""
        if not self.running:
            raise RuntimeError("the preparer has stopped")
        self._grants.append((slots, done))
        self._wake.set()

    def _reserve_grants(self) -> None:
        while self._grants and not self._stop:
            try:
                slots, done = self._grants.popleft()
            except IndexError:
                return
            ok = False
            try:
                ok = all(self.arena.reserve(slot) for slot in slots)
            except OSError as err:  # a dup refused (no fd): the PUT goes over frames
                log.debug("shared memory: cannot reserve a grant's pages: %s", err)
            finally:
                self.reserved_grants += ok
                done(ok)

    def window_left(self) -> int:
        """Bytes of the window not ready yet, before any PUT (else 0): HELLO's
        `shm_window`, so a client that connects meanwhile (a model server
        loading its model) maps the rest as it is made ready (client/_pages.py,
        `Premapper.follow`): in the whole segments `step` still makes, or a
        client would look for a last segment that never comes."""
        if self.arena.allocated or self._stop:
            return 0
        size = self.arena.prepare_bytes()
        spare = self.arena.spare_prepared(size)
        return max(0, self.window - spare) // size * size  # the whole segments `step` makes yet

    def ahead(self, size: int) -> int:
        """Free prepared bytes wanted now, in segments of `size` (module docstring)."""
        allocated = self.arena.allocated
        self._burst = max(self._burst * 0.9, float(allocated - self._seen))
        self._seen = allocated
        if not allocated:
            return self.window
        return max(2 * size, int(2 * self._burst))

    def room(self, spare: int, size: int) -> bool:
        """Whether one more segment of `size` fits the memory available (module docstring)."""
        avail = self.available()
        if avail is None:
            return True
        return spare + size <= (avail + spare) // AVAILABLE_SHARE

    def step(self) -> bool:
        """Prepare one segment if wanted and allowed; whether one was."""
        arena = self.arena
        size = self._note_size()  # read once: every figure below is of this one segment
        want = self.ahead(size)
        if arena.lean or not self.allowed():
            return False
        spare = arena.spare_prepared(size)
        if spare + (0 if arena.allocated else size) > want:
            return False  # before any PUT the window is a ceiling; after, a floor to keep
        if spare >= want:
            return False
        if not self.room(spare, size) or not self.fds_ok():
            self.held_back += 1
            return False
        begun = arena.begin_segment(room=arena.capacity // 2 + size, size=size)
        if begun is None:
            return False
        seg, fd = begun
        huge = arena.huge and self._populate(arena.address(seg), size)
        if arena.huge and not huge:  # no memory for it (a memory cgroup): what it reached goes back first
            self.failures += 1
            give_back(fd, 0, size)
        if huge:
            reserved = True  # 2 MiB pages, allocated and cleared through the daemon's mapping (~8x faster)
            self.populated_bytes += size
        elif clear(fd, size):  # Linux: reserved and cleared, mapped nowhere (1.5x faster)
            reserved = True
            self.populated_bytes += size
        else:
            reserved = self._reserve_and_populate(seg, fd, size)
        self.prepared_bytes += size if reserved else 0  # counted before it is offered (stats)
        arena.end_segment(seg, reserved)
        return reserved

    def _reserve_and_populate(self, seg: int, fd: int, size: int) -> bool:
        """A new segment's pages reserved (posix_fallocate) and populated
        (`populate`), where `clear` cannot be done; whether they are reserved."""
        arena = self.arena
        if not hasattr(os, "posix_fallocate"):
            return False
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as err:  # a full /dev/shm or memory cgroup: slots reserve their own pages
            self.failures += 1
            log.debug("shared memory: cannot prepare a segment: %s", err)
            return False
        if self._populate(arena.address(seg), size):
            self.populated_bytes += size
        return True

    @staticmethod
    def _populate(address: int, length: int) -> bool:
        """Populate in POPULATE_STEP pieces: each holds this process's mmap lock
        for ~1 ms, so a thread that maps or unmaps memory (libzmq, malloc) is
        never kept waiting for a whole segment's (module docstring)."""
        for off in range(0, length, POPULATE_STEP):
            if not populate(address + off, min(POPULATE_STEP, length - off)):
                return False
        return True

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(WAKE_S)
            self._wake.clear()
            try:
                self._reserve_grants()
                while not self._stop and self.step():
                    self._reserve_grants()  # a grant waits for one segment at most
            except OSError as err:  # the folder gone, no memory: the serving thread grows as before
                self.failures += 1
                log.debug("shared memory: preparing a segment failed: %s", err)
            except Exception:  # noqa: BLE001 -- a bug: logged; the thread lives on (grants wait for it)
                self.failures += 1
                log.exception("shared memory: preparing a segment failed")
            # Woken again once allocations have taken a segment's worth (module docstring).
            self.arena.wake_at = self.arena.allocated + self.arena.segment_bytes

    def stats(self) -> dict[str, int]:
        free = self.arena.spare_prepared()  # first: a segment counted free is counted prepared already
        return {"prepared_bytes": self.prepared_bytes, "populated_bytes": self.populated_bytes,
                "prepare_window_bytes": self.window, "prepare_segment_bytes": self._size, "prepared_free_bytes": free,
                "grants_reserved_off_thread": self.reserved_grants,
                "prepare_held_back": self.held_back, "prepare_failures": self.failures}
