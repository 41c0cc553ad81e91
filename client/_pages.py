"""Page tables filled in bulk before a put copies into a granted slot (issue 42).

A client's first put into pages it has never mapped takes one page fault per
4 KiB page (a new client of a warm daemon: 65,536 faults for 256 MiB, about
four times the copy itself). Pages the daemon's earlier puts wrote are in the
segment's page cache already, so one MADV_POPULATE_READ over them maps them
all at once, sixteen pages a fault (the kernel's fault-around), and writable:
a shared mapping of shmem needs no write fault after a read one. Pages only
reserved (posix_fallocate) and never written are skipped: the kernel must
clear each of them anyway, and populating them measured no faster than the
copy's own faults (`bench/RESULTS.md`, Session 25).

A segment the daemon prepared ahead of demand (kvd/server/shm/prepare.py)
is reserved *and* cleared there: its pages are resident, so
they map sixteen a fault like written ones. `Premapper` maps the segments a
reply lists as live (`segments`; HELLO's `shm_live`) on a thread of its
own, `kvd-client-premap`, ahead of the puts that will be granted slots in
them: a fresh daemon's fill, and a new client's first put after its first
fetch, then copy into pages this client has mapped already.

A put that comes before the premapper got there (a new client's first put,
at once after its HELLO) has its slots populated by `Ahead`: a thread of
its own, `kvd-client-ahead`, populates the grant's slots in the order the
caller copies them, while the caller copies those already done. Populating
256 MiB of another process's pages took ~56 ms here, about as long as the
copy: one after the other, a new client's first put ran at ~0.45x the
steady state; side by side, on two cores, at 0.42-0.75x (median ~0.6x;
bench/RESULTS.md, Session 28). A job is a run of the grant's slots side by
side in one mapping (kvd_client._shm, `populate_ahead`), not a tensor: with
512 jobs for a 256 MiB grant, the thread's turns at the GIL slowed the
caller's copy 2.5x and the first put ran at 0.36-0.51x; with a job per run,
0.69-1.12x (Session 49).

Rules:
1. A page is looked at once per mapping: the steady state's puts, into pages
   this client has written before, cost no syscall here (a bitmap per
   mapping of the pages granted to it so far). The premapper marks only the
   pages it populated: a segment it met while the daemon was still clearing
   it (a SLOTS reply lists it) has the rest populated by the grants that
   come to them, not faulted in one at a time by their copies.
2. Only pages mincore() reports resident are populated, in a range SLOTS
   granted this client or in a live segment of the daemon (the premapper):
   nothing a client does here allocates a page (populating a hole would
   allocate it, charged to this process) -- but for a page the daemon hands
   back (trim, under memory pressure) between the mincore() and the madvise()
   of its run, a window of microseconds.
3. Best effort: any failure (an old kernel's EINVAL, no mincore) turns this
   off for the process and the copy faults pages in as before.
4. The premapper gives way: while a call of its clients copies (those of
   the process that share the link, kvd_client._shm; a put into
   its slots, with its COMMITs in parts; a fetch out of its leases), it
   waits between pieces. Running beside the copy, it took the core the copy
   ran on, for pages that copy did not need (a new client's first put maps
   its own slots, `Ahead`; a GET's read faults its pages in sixteen at a
   time): a new client's first 256 MiB put ran at 0.44-0.49x the steady
   state with it, 0.67-0.71x with it waiting; a new client's first 1 GiB
   fetch 244-312 ms against 180-207 (bench/RESULTS.md, Session 35). It maps
   when its clients are between calls: from a HELLO to the first put or fetch,
   or while a model server generates and its writer thread is not uploading.

What each OS gives:

    Linux   mincore() and madvise(MADV_POPULATE_READ = 22, Linux 5.14+;
            Python 3.11 has no name for it) through ctypes, which releases
            the GIL for the call (mmap.madvise holds it: a premap would stall
            the caller's thread).
    macOS   no MADV_POPULATE_*: `prefault` does nothing (the copy faults
            pages in, as before).
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import sys
import threading
import time
import weakref
from typing import Callable

import numpy as np

_MADV_POPULATE_READ = 22  # include/uapi/asm-generic/mman-common.h, Linux 5.14
_PAGE = mmap.PAGESIZE


def _libc(name: str, *argtypes):
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
        fn.argtypes = tuple(getattr(ctypes, t) for t in argtypes)
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError):
        return None


_MINCORE = _libc("mincore", "c_void_p", "c_size_t", "c_void_p")
_MADVISE = _libc("madvise", "c_void_p", "c_size_t", "c_int")
_enabled = _MINCORE is not None and _MADVISE is not None
counters = {"prefaulted_bytes": 0, "premapped_segments": 0,  # pages populated in bulk, this process
            "premap_waits": 0,  # times a premapper waited for a copy of its client's (rule 4)
            "ahead_puts": 0, "ahead_slots": 0,  # puts whose slots a thread populated (Ahead), and the slots it did
            "followed_segments": 0}  # premapped segments of a window found as the daemon prepared it (`Premapper.follow`)
# Per mapping, per page: 1 once granted to this client (rule 1); goes with the mapping.
_granted: "weakref.WeakKeyDictionary[mmap.mmap, bytearray]" = weakref.WeakKeyDictionary()


def resident(mm: mmap.mmap, lo: int, hi: int) -> np.ndarray | None:
    """Per page of mm[lo:hi] (page-aligned), whether it is resident (mincore's
    low bit), or None where that cannot be told."""
    if _MINCORE is None:
        return None
    vec = np.zeros((hi - lo) // _PAGE, np.uint8)
    base = np.frombuffer(mm, np.uint8, count=1).ctypes.data
    if _MINCORE(base + lo, hi - lo, vec.ctypes.data) != 0:
        return None
    return (vec & 1).astype(bool)


def prefault(mm: mmap.mmap, offset: int, length: int, *, ahead: bool = False) -> int:
    """Map the resident pages of mm[offset:offset+length] (a granted slot) in
    bulk (module docstring); returns the bytes populated (0: none, or off).
    `ahead` (the premapper's, no copy to follow): only the pages populated are
    marked looked at, so a page not resident yet (a segment the daemon is
    still clearing) is populated by the grant that comes to it."""
    global _enabled
    if not _enabled or length <= 0:
        return 0
    lo = offset - offset % _PAGE
    try:
        hi = min(len(mm), -(-(offset + length) // _PAGE) * _PAGE)
    except ValueError:  # closed meanwhile by another thread's retain()
        return 0
    seen = _seen(mm)
    first, last = lo // _PAGE, hi // _PAGE
    if seen.find(0, first, last) == -1:
        return 0  # mapped here since an earlier grant (rule 1)
    if not ahead:
        seen[first:last] = b"\x01" * (last - first)  # the copy about to run maps the rest
    try:
        base = np.frombuffer(mm, np.uint8, count=1)  # held: retain() cannot unmap under the madvise
        present = resident(mm, lo, hi)
        if present is None:
            _enabled = False
            return 0
        if ahead:
            np.frombuffer(seen, np.uint8)[first:last] |= present
        done = 0
        # Runs of resident pages: where each starts and ends.
        edges = np.flatnonzero(np.diff(np.concatenate(([False], present, [False])).astype(np.int8)))
        for start, end in zip(edges[::2], edges[1::2]):
            n = int(end - start) * _PAGE
            if _MADVISE(base.ctypes.data + lo + int(start) * _PAGE, n, _MADV_POPULATE_READ) != 0:
                _enabled = False  # EINVAL before Linux 5.14
                return done
            done += n
    except ValueError:  # the mapping closed meanwhile by another thread's retain(): the copy will say so
        return 0
    counters["prefaulted_bytes"] += done
    return done


AHEAD_MIN_BYTES = 8 << 20  # a grant with fewer bytes to map than this is populated by the caller, as it copies


def _seen(mm: mmap.mmap) -> bytearray:
    """The mapping's bitmap of pages looked at (rule 1), made on first use."""
    seen = _granted.get(mm)
    if seen is None:
        seen = _granted.setdefault(mm, bytearray(-(-len(mm) // _PAGE)))
    return seen


def unmapped(mm: mmap.mmap, offset: int, length: int) -> bool:
    """Whether mm[offset:offset+length] has pages this client has not
    looked at yet (rule 1): a slot `prefault` would populate."""
    if not _enabled or length <= 0:
        return False
    seen = _granted.get(mm)
    if seen is None:
        return True
    return seen.find(0, offset // _PAGE, -(-(offset + length) // _PAGE)) != -1


class Ahead:
    """A grant's slots (`jobs`: mapping, offset, length, in the order the
    caller copies them) populated on the thread `kvd-client-ahead` while
    the caller copies (module docstring). Slots are taken in order by
    whoever comes first: the caller calls `reach(i)` before copying slot i,
    which waits for the thread if it has slot i in hand, or leaves slot i to
    the caller's own `prefault` if the thread is not there yet."""

    def __init__(self, jobs: list[tuple[mmap.mmap, int, int]]):
        self._jobs = jobs
        self._next = 0  # slots [0, _next) are taken
        self._mine: dict[int, threading.Event] = {}  # taken by the thread, not yet populated
        self._mu = threading.Lock()
        self.populated = 0  # slots the thread populated

    @classmethod
    def start(cls, jobs: list[tuple[mmap.mmap, int, int]]) -> "Ahead | None":
        """An Ahead at work, or None where there is too little to map (or no thread to be had)."""
        if sum(n for mm, off, n in jobs if unmapped(mm, off, n)) < AHEAD_MIN_BYTES:
            return None
        for mm in {id(mm): mm for mm, _, _ in jobs}.values():
            _seen(mm)  # made here: the thread and the caller then share one per mapping
        ahead = cls(jobs)
        try:
            threading.Thread(target=ahead._run, name="kvd-client-ahead", daemon=True).start()
        except RuntimeError:  # no thread to be had: the caller populates as it copies, as before
            return None
        counters["ahead_puts"] += 1
        return ahead

    def reach(self, i: int) -> None:
        """The caller is about to copy slot i."""
        with self._mu:
            if i >= self._next:
                self._next = i + 1  # the caller's: its own prefault maps it
                return
            done = self._mine.get(i)
        if done is not None:
            done.wait()

    def stop(self) -> None:
        """Take no more slots (the put is done, or abandoned)."""
        with self._mu:
            self._next = len(self._jobs)

    def take(self) -> tuple[int, threading.Event] | None:
        """The thread's next slot, and the event it sets once it is populated; None: none left."""
        with self._mu:
            i = self._next
            if i >= len(self._jobs):
                return None
            self._next = i + 1
            done = self._mine[i] = threading.Event()
            return i, done

    def done(self, i: int, done: threading.Event) -> None:
        with self._mu:
            self._mine.pop(i, None)
        done.set()

    def _run(self) -> None:
        while (taken := self.take()) is not None:
            i, done = taken
            try:
                mm, offset, length = self._jobs[i]
                prefault(mm, offset, length)
                self.populated += 1
                counters["ahead_slots"] += 1
            except Exception:  # noqa: BLE001 -- best effort (rule 3): the caller's copy faults its pages in
                pass
            finally:
                self.done(i, done)


PREMAP_STEP = 4 << 20  # bytes a premapper populates at once (its pieces)
IDLE_S = 5.0  # a premapper's thread ends after this long with nothing to map (the next offer starts another)
FOLLOW_S = 60.0  # how long a premapper follows a window the daemon is still preparing (`follow`)
FOLLOW_POLL_S = 0.05  # how often it looks for the window's next segment meanwhile
FOLLOW_PATIENCE_S = 2.0  # how long it waits for a segment's pages to be all there before mapping those that are


class _Follow:
    """A window being followed (`Premapper.follow`): the bytes not mapped yet,
    until when, the next segment looked for, and since when it has been seen
    with pages still missing (None: not seen so)."""

    __slots__ = ("left", "until", "next", "partial")

    def __init__(self, left: int, until: float, first: int):
        self.left, self.until, self.next, self.partial = left, until, first, None


class Premapper:
    """Maps the live segments of one daemon run ahead of use, off the
    caller's thread (module docstring): `offer` a reply's list of live
    segments; each new one is mapped (`segment(seg, reads)`: the link's
    mappings of it to populate -- the writable one, and with `reads` the
    read-only one too -- or None if it cannot be had) and its resident pages
    populated on the thread `kvd-client-premap`, once, between the copies of
    its clients' calls (`pause`, `resume`: rule 4)."""

    def __init__(self, segment: "Callable[[int, bool], list[mmap.mmap] | None]"):
        self._segment = segment
        self._seen: dict[int, bool] = {}  # segment -> offered with `reads`
        self._queue: collections.deque[tuple[int, bool]] = collections.deque()
        self._mu = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._busy = 0  # calls of its clients copying (`pause`)
        self._calm = threading.Condition(self._mu)
        self._following: _Follow | None = None  # the window the daemon is still preparing (`follow`)

    def stop(self) -> None:
        """Map nothing more (the client closed, or its daemon restarted): the
        thread ends after the piece it is on."""
        with self._mu:
            self._stopped = True
            self._queue.clear()
            self._following = None
            self._calm.notify_all()
        self._wake.set()

    def pause(self) -> None:
        """A call of a client sharing the link copies (a put into its slots,
        and its COMMITs in parts; a fetch out of its leases): the thread waits between pieces
        until every such call has called `resume` (rule 4). Call it inside
        the `try` whose `finally` resumes."""
        with self._mu:
            self._busy += 1

    def resume(self) -> None:
        """The end of a `pause` (never below none: a pause cut short before it
        counted, by an exception, resumes nothing)."""
        with self._mu:
            self._busy = max(0, self._busy - 1)
            if not self._busy:
                self._calm.notify_all()

    @contextlib.contextmanager
    def held(self):
        """`pause` for the block."""
        try:
            self.pause()
            yield
        finally:
            self.resume()

    def _wait_calm(self) -> None:
        with self._mu:
            if self._busy and not self._stopped:
                counters["premap_waits"] += 1
            while self._busy and not self._stopped:
                self._calm.wait(1.0)

    def offer(self, live: list[int], *, reads: bool = False) -> None:
        """Map the segments of `live` not offered before (with `reads`, their
        read-only mappings too: those offered before without it go again)."""
        if not _enabled or self._stopped:
            return
        with self._mu:
            new = [seg for seg in live if seg not in self._seen or (reads and not self._seen[seg])]
            if not new:
                return
            self._seen.update(dict.fromkeys(new, reads))
            self._queue.extend((seg, reads) for seg in new)
            if not self._started():
                return
        self._wake.set()

    def follow(self, nbytes: int, first: int) -> None:
        """HELLO said the daemon has `nbytes` of its window still to prepare,
        in segments numbered from `first` (`shm_window`): this client
        connected before it was ready (a model server that connects, then
        loads its model). Map those segments, each once its pages are all there (or
        after FOLLOW_PATIENCE_S, those that are), until that many bytes are
        mapped or FOLLOW_S has passed: the first puts then copy into pages
        this client has mapped, as into a warm daemon's. Without this a 2 s
        load left every page of the window to the puts' own mapping: a
        fresh daemon's first 1 GiB puts ran at 1.6-2.2 GiB/s out of pages
        prepared, against 3.5-4.6 for the steady state (bench/RESULTS.md,
        Session 52). The daemon is not asked: segments are looked for by
        their names (or at the hand-out), in order, every FOLLOW_POLL_S. One
        that never comes (removed as soon as made) stops the following at
        FOLLOW_S: nothing is lost but the mapping ahead."""
        if not _enabled or self._stopped or nbytes <= 0:
            return
        with self._mu:
            self._following = _Follow(int(nbytes), time.monotonic() + FOLLOW_S, first)
            if not self._started():
                return
        self._wake.set()

    def _started(self) -> bool:
        """The thread running, started if need be (under `_mu`); False if no
        thread can be had (the puts then map their own pages, as before)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvd-client-premap", daemon=True)
            try:
                self._thread.start()
            except RuntimeError:
                self._thread = None
                self._queue.clear()
                self._following = None
                return False
        return True

    def _run(self) -> None:
        while True:
            self._wake.wait(FOLLOW_POLL_S if self._following is not None else IDLE_S)
            with self._mu:
                self._wake.clear()
                if not self._queue and self._following is None:
                    self._thread = None
                    return
            while True:
                try:
                    seg, reads = self._queue.popleft()
                except IndexError:  # emptied (or stopped) meanwhile
                    break
                try:
                    if self._pieces(self._segment(seg, reads) or []):
                        counters["premapped_segments"] += 1
                except Exception:  # noqa: BLE001 -- a segment gone meanwhile: nothing to map ahead (rule 3)
                    pass
            try:
                self._follow_step()
            except Exception:  # noqa: BLE001 -- a segment gone meanwhile (rule 3): the next look goes on
                pass

    def _follow_step(self) -> None:
        """One look for the next segment of the window being followed (`follow`)."""
        with self._mu:
            f = self._following
            if f is None:
                return
            if self._stopped or f.left <= 0 or time.monotonic() >= f.until:
                self._following = None
                return
            while f.next in self._seen:  # listed by a reply meanwhile: queued already
                f.next += 1
            seg = f.next
        maps = self._segment(seg, False)
        if not maps:
            return  # not made yet (or not ours to have now): looked for again
        size = min(len(mm) for mm in maps)
        have = resident(maps[0], 0, size)
        if have is not None and not have.all():  # still being prepared
            now = time.monotonic()
            if f.partial is None:
                f.partial = now
            if now - f.partial < FOLLOW_PATIENCE_S:
                return
        with self._mu:
            if self._following is not f or seg in self._seen:
                return
            self._seen[seg] = False
            f.next, f.left, f.partial = seg + 1, f.left - size, None
        if self._pieces(maps):
            counters["premapped_segments"] += 1
            counters["followed_segments"] += 1

    def _pieces(self, maps: list[mmap.mmap]) -> int:
        """Populate a segment's mappings a piece at a time, each marked as it
        is taken (rule 1), the same piece of each in turn: a put copying into
        it meanwhile populates the pieces not taken yet itself, instead of
        faulting them in one by one, and a fetch reading it meets pages
        mapped up to where the thread is. Stops at a mapping closed meanwhile
        (`retain`: the daemon removed the segment) or at `stop`; the bytes
        populated."""
        done = 0
        try:
            size = min((len(mm) for mm in maps), default=0)
            for off in range(0, size, PREMAP_STEP):
                self._wait_calm()
                if self._stopped:
                    break
                for mm in maps:
                    done += prefault(mm, off, min(PREMAP_STEP, size - off), ahead=True)
        except ValueError:  # closed by another thread's retain(): nothing more to map here
            pass
        return done
