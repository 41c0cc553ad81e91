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

Rules:
1. A page is looked at once per mapping: the steady state's puts, into pages
   this client has written before, cost no syscall here (a bitmap per
   mapping of the pages granted to it so far).
2. Only a range SLOTS granted this client is populated, and only its pages
   mincore() reports resident: nothing a client does here allocates a page
   (populating a hole would allocate it, charged to this process).
3. Best effort: any failure (an old kernel's EINVAL, no mincore) turns this
   off for the process and the copy faults pages in as before.

What each OS gives:

    Linux   mincore() through ctypes; mmap.madvise(MADV_POPULATE_READ = 22,
            Linux 5.14+; Python 3.11 has no name for it).
    macOS   no MADV_POPULATE_*: `prefault` does nothing (the copy faults
            pages in, as before).
"""

from __future__ import annotations

import mmap
import sys
import weakref

import numpy as np

_MADV_POPULATE_READ = 22  # include/uapi/asm-generic/mman-common.h, Linux 5.14
_PAGE = mmap.PAGESIZE


def _mincore():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).mincore
        fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError):
        return None


_MINCORE = _mincore()
_enabled = _MINCORE is not None
counters = {"prefaulted_bytes": 0}  # pages populated in bulk, this process
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


def prefault(mm: mmap.mmap, offset: int, length: int) -> int:
    """Map the resident pages of mm[offset:offset+length] (a granted slot) in
    bulk (module docstring); returns the bytes populated (0: none, or off)."""
    global _enabled
    if not _enabled or length <= 0:
        return 0
    lo = offset - offset % _PAGE
    hi = min(len(mm), -(-(offset + length) // _PAGE) * _PAGE)
    seen = _granted.get(mm)
    if seen is None:
        seen = _granted[mm] = bytearray(-(-len(mm) // _PAGE))
    first, last = lo // _PAGE, hi // _PAGE
    if seen.find(0, first, last) == -1:
        return 0  # mapped here since an earlier grant (rule 1)
    seen[first:last] = b"\x01" * (last - first)  # the copy about to run maps the rest
    try:
        present = resident(mm, lo, hi)
        if present is None:
            _enabled = False
            return 0
        done = 0
        # Runs of resident pages: where each starts and ends.
        edges = np.flatnonzero(np.diff(np.concatenate(([False], present, [False])).astype(np.int8)))
        for start, end in zip(edges[::2], edges[1::2]):
            mm.madvise(_MADV_POPULATE_READ, lo + int(start) * _PAGE, int(end - start) * _PAGE)
            done += int(end - start) * _PAGE
    except OSError:  # EINVAL before Linux 5.14
        _enabled = False
        return 0
    except ValueError:  # the mapping closed meanwhile by another thread's retain(): the copy will say so
        return 0
    counters["prefaulted_bytes"] += done
    return done
