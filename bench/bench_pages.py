"""What the shared-memory arena's pages cost to prepare, fill and read, by page size.

    python bench/bench_pages.py [--mib 256] [--reps 5] [--idle 5]

In one process, with the daemon's own functions (kvd.host.segments), on
memfd segments of 64 MiB, the way `kvd-shm-prep` and a new client meet them:

  prepare  the preparer's part: 4 KiB pages written through the fd (`clear`),
           or, where Linux's shmem THP policy lets a mapping ask, 2 MiB pages
           asked for (`advise_huge`) and populated through the daemon's mapping
  put      a copy into the segments through a new writable mapping (a new
           client's first put)
  fetch    a copy out of them through a new read-only mapping (a new client's
           first fetch) into touched memory

Each against one touched memcpy of the same bytes, measured in the same run.
The 2 MiB rows run only where /sys/kernel/mm/transparent_hugepage/shmem_enabled
allows (`advise` and the like); setting it is the machine owner's call. With
`--idle S`, each row again after S seconds with nothing allocated: a VM that
reports free memory to its host (free page reporting) faults such memory in
again at its next touch (docs/shared-memory.md, "Huge pages").
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import machine  # noqa: E402

from kvd.host.segments import HUGE_POLICIES, advise_huge, clear, populate, shmem_huge_policy  # noqa: E402

SEG = 64 << 20


def segments(n: int, huge: bool) -> tuple[float, list[tuple[int, mmap.mmap]]]:
    """n segments prepared as the preparer does; (seconds, [(fd, the daemon's mapping)])."""
    made = []
    t0 = time.perf_counter()
    for _ in range(n):
        fd = os.memfd_create("kvd-bench-pages", os.MFD_CLOEXEC)
        os.ftruncate(fd, SEG)
        mm = mmap.mmap(fd, SEG, flags=mmap.MAP_SHARED)
        if huge:
            address = np.frombuffer(mm, np.uint8).ctypes.data
            advise_huge(address, SEG)
            ok = all(populate(address + off, 4 << 20) for off in range(0, SEG, 4 << 20))
        else:
            ok = clear(fd, SEG)
        assert ok, "could not prepare a segment"
        made.append((fd, mm))
    return time.perf_counter() - t0, made


def one(n: int, huge: bool, src: np.ndarray, dst: np.ndarray) -> tuple[float, float, float]:
    t_prep, made = segments(n, huge)
    t0 = time.perf_counter()
    writers = [mmap.mmap(fd, SEG, flags=mmap.MAP_SHARED) for fd, _ in made]
    for k, w in enumerate(writers):
        np.copyto(np.frombuffer(w, np.uint8), src[k * SEG:(k + 1) * SEG])
    t_put = time.perf_counter() - t0
    t0 = time.perf_counter()
    readers = [mmap.mmap(fd, SEG, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) for fd, _ in made]
    for k, r in enumerate(readers):
        np.copyto(dst[k * SEG:(k + 1) * SEG], np.frombuffer(r, np.uint8))
    t_fetch = time.perf_counter() - t0
    assert np.array_equal(dst[:: 1 << 20], src[:: 1 << 20])
    for m in writers + readers + [mm for _, mm in made]:
        m.close()
    for fd, _ in made:
        os.close(fd)
    return t_prep, t_put, t_fetch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--idle", type=float, default=0.0, help="also each row after this many seconds idle")
    args = ap.parse_args()
    if not hasattr(os, "memfd_create"):
        sys.exit("bench_pages: needs Linux memfds")
    n = max(1, args.mib * (1 << 20) // SEG)
    nbytes = n * SEG
    src = np.random.default_rng(0).integers(0, 255, nbytes, np.uint8)
    dst = np.empty(nbytes, np.uint8)
    dst[:] = 1
    policy = shmem_huge_policy()
    kinds = [("4 KiB", False)] + ([("2 MiB", True)] if policy in HUGE_POLICIES else [])
    print(f"# bench_pages  {machine()}; shmem THP policy {policy}; {nbytes >> 20} MiB in {n} segments; "
          f"medians of {args.reps}")
    if len(kinds) == 1:
        print(f"# no 2 MiB rows: shmem_enabled is {policy} (advise, within_size, always or force would allow them)")
    t_mem = statistics.median(_timed(lambda: np.copyto(dst, src)) for _ in range(args.reps))
    print(f"{'touched memcpy':>36} {t_mem * 1e3:8.1f} ms  {nbytes / t_mem / 2**30:6.2f} GiB/s")
    for idle in [0.0] + ([args.idle] if args.idle > 0 else []):
        for name, huge in kinds:
            rows = []
            for _ in range(args.reps):
                time.sleep(idle)
                rows.append(one(n, huge, src, dst))
            for i, what in enumerate(("prepare", "put, new mapping", "fetch, new mapping")):
                t = statistics.median(r[i] for r in rows)
                label = f"{name} {what}" + (f" ({idle:g} s idle)" if idle else "")
                print(f"{label:>36} {t * 1e3:8.1f} ms  {nbytes / t / 2**30:6.2f} GiB/s  {t / t_mem:5.2f}x memcpy",
                      flush=True)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
