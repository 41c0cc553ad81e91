"""This process's memory as the OS sees it: anonymous RSS, and the C
allocator's controls.

What each OS gives:

    Linux   /proc/self/statm (resident less shared pages: RssAnon, which
            leaves out file-backed maps such as the index's and shared
            memory); glibc's mallopt() and malloc_trim() through ctypes (not
            under musl: no controls there).
    macOS   the physical footprint from proc_pid_rusage() (ri_phys_footprint,
            kvd/host/footprint.py: anonymous and compressed memory, leaving out
            file-backed maps), so the memory watchdog holds there too. It
            counts the pages of shared memory this process has touched (XNU's
            pmap charges an anonymous page to `phys_footprint` in every task
            that maps it): `rss_counts_shared`. No glibc: `tune_malloc` and
            `trim_malloc` do nothing.
"""

from __future__ import annotations

import os

from kvd.host import footprint


def _libc():
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except (OSError, AttributeError):
        return None


_LIBC = _libc()  # glibc's allocator controls, or None (macOS, musl)
_M_MMAP_THRESHOLD = -3


def can_trim() -> bool:
    """Whether `trim_malloc` can give anything back (glibc)."""
    return _LIBC is not None


def trim_malloc() -> None:
    """Ask glibc to give freed heap memory back to the system (malloc_trim(0))."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def tune_malloc() -> bool:
    """Make freed big buffers go back to the system (glibc): a fixed mmap
    threshold of 4 MiB, so a big frame libzmq frees after a peer is cut off
    leaves the process instead of staying in the heap (glibc's default
    threshold rises with use, up to 32 MiB, and malloc_trim alone did not
    give those back: the long stress run stayed at 370 MB). Not lower: a
    typical tensor frame (a 256-token chunk of one layer, ~0.5 MiB) stays on
    the heap's fast path; 256 KiB cost PUTs of 1 MiB frames ~20% (bench_wire).
    Returns False where there is no glibc."""
    return bool(_LIBC is not None and _LIBC.mallopt(_M_MMAP_THRESHOLD, 4 << 20))


def rss_bytes() -> int | None:
    """This process's anonymous resident memory (Linux: RssAnon, which leaves
    out the index's file-backed map and shared memory; macOS: the physical
    footprint, ri_phys_footprint), or None where the system tells neither.

    Read from /proc/self/statm (resident less shared pages: RssAnon), kept
    open and read again in place: ~2 us, where parsing /proc/self/status took
    ~20 -- the gate samples it holding the GIL the serving thread wants."""
    global _STATM
    if _STATM is None:
        try:
            _STATM = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            _STATM = -1  # no /proc (macOS): not asked again
            return footprint.phys_footprint()
        except OSError:
            return None  # no fd free this time (EMFILE): tried again at the next sample
    if _STATM < 0:
        return footprint.phys_footprint()
    try:
        fields = os.pread(_STATM, 128, 0).split()
        return (int(fields[1]) - int(fields[2])) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


_STATM: int | None = None  # the open /proc/self/statm (rss_bytes)


def rss_counts_shared() -> bool:
    """Whether `rss_bytes` counts the shared-memory pages this process has
    touched (macOS's footprint; the daemon reads and writes slots through its
    mapping there) rather than leaving them all out (Linux's RssAnon)."""
    if _STATM is None:
        rss_bytes()  # opens statm, or finds there is none
    return _STATM is not None and _STATM < 0
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
