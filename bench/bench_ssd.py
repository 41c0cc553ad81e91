"""Spill and restore throughput of the SSD tier, against the raw disk.

    PYTHONPATH=. python3 bench/bench_ssd.py [--entry-mib 16] [--count 32] [--dir DIR] [--json]

Baselines, measured in the same run on the same filesystem with the same
payload sizes: raw `write + fsync` of one file per entry, and a cold `read`
of those files (page cache dropped with posix_fadvise(DONTNEED)). kvd's
figures are then given as ratios to them:

  spill         SsdStore.put of every entry until the queue is flushed:
                safetensors encode + xxh3 + write + fsync + rename + dir fsync
                + LMDB commit (batched), on the writer thread
  restore cold  SsdStore.get of every entry with the page cache dropped:
                index lookup + read + xxh3 verify + parse (zero-copy views)
  restore warm  the same from the page cache

The machines are noisy: each figure is the median of --repeat runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from kvd.store.base import Entry, Tensor  # noqa: E402
from kvd.store.ssd import SsdStore  # noqa: E402

GiB = 1 << 30


def drop_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def make_entries(count: int, entry_bytes: int) -> list[Entry]:
    rng = np.random.default_rng(0)
    half = entry_bytes // 4  # two bf16 tensors (k, v) of entry_bytes/2 each
    entries = []
    for i in range(count):
        k = rng.integers(0, 1 << 16, size=half, dtype=np.uint16)
        v = rng.integers(0, 1 << 16, size=half, dtype=np.uint16)
        shape = (1, 8, half // 1024, 128)
        entries.append(Entry(
            namespace="bench", key=i.to_bytes(32, "big"), kind=0, parent=b"\0" * 32, start=0, length=256,
            tensors=(Tensor("k", "bfloat16", shape, k.data), Tensor("v", "bfloat16", shape, v.data)),
        ))
    return entries


def raw_baseline(root: Path, entries: list[Entry]) -> tuple[float, float]:
    root.mkdir()
    paths = []
    t0 = time.perf_counter()
    for i, e in enumerate(entries):
        p = root / f"raw{i}"
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for t in e.tensors:
            mv = memoryview(t.data).cast("B")
            while mv:
                mv = mv[os.write(fd, mv):]
        os.fsync(fd)
        os.close(fd)
        paths.append(p)
    write_s = time.perf_counter() - t0
    drop_cache(paths)
    t0 = time.perf_counter()
    for p in paths:
        size = p.stat().st_size
        buf = bytearray(size)
        with open(p, "rb", buffering=0) as f:
            f.readinto(buf)
    read_s = time.perf_counter() - t0
    return write_s, read_s


def kvd_run(root: Path, entries: list[Entry]) -> tuple[float, float, float]:
    store = SsdStore(root, 1 << 50, min_free_bytes=0, queue_bytes=1 << 30, reconcile=False)
    try:
        t0 = time.perf_counter()
        for e in entries:
            store.put(e)
        assert store.flush(600)
        spill_s = time.perf_counter() - t0
        assert store.entries == len(entries), store.stats()
        drop_cache([store.path(e.id) for e in entries])
        t0 = time.perf_counter()
        for e in entries:
            assert store.get(e.id) is not None
        cold_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for e in entries:
            assert store.get(e.id) is not None
        warm_s = time.perf_counter() - t0
        assert store.counters["checksum_failures"] == 0
    finally:
        store.close()
    return spill_s, cold_s, warm_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--entry-mib", type=float, default=16)
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--dir", default=None, help="a directory on the filesystem to measure (default: $TMPDIR)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    entry_bytes = int(args.entry_mib * (1 << 20)) // 4096 * 4096
    entries = make_entries(args.count, entry_bytes)
    total = entry_bytes * args.count
    runs = []
    for r in range(args.repeat):
        tmp = Path(tempfile.mkdtemp(prefix="kvd-bench-", dir=args.dir))
        try:
            # Alternate which goes first: the disk (and the VM's host cache)
            # warms up over a run, which would favour whoever comes second.
            if r % 2:
                s, c, wm = kvd_run(tmp / "kvd", entries)
                shutil.rmtree(tmp / "kvd")
                w, rd = raw_baseline(tmp / "raw", entries)
            else:
                w, rd = raw_baseline(tmp / "raw", entries)
                shutil.rmtree(tmp / "raw")
                s, c, wm = kvd_run(tmp / "kvd", entries)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        runs.append({"raw_write_fsync": total / w / GiB, "raw_cold_read": total / rd / GiB,
                     "spill": total / s / GiB, "restore_cold": total / c / GiB, "restore_warm": total / wm / GiB})
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    result = {
        "entries": args.count, "entry_bytes": entry_bytes, "repeat": args.repeat, "gib_per_s": med,
        "spill_vs_raw_write": med["spill"] / med["raw_write_fsync"],
        "restore_cold_vs_raw_read": med["restore_cold"] / med["raw_cold_read"],
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{args.count} entries x {entry_bytes / (1 << 20):.1f} MiB, median of {args.repeat} (GiB/s)")
        print(f"  raw write+fsync   {med['raw_write_fsync']:6.2f}")
        print(f"  kvd spill         {med['spill']:6.2f}   ratio {result['spill_vs_raw_write']:.2f}")
        print(f"  raw cold read     {med['raw_cold_read']:6.2f}")
        print(f"  kvd restore cold  {med['restore_cold']:6.2f}   ratio {result['restore_cold_vs_raw_read']:.2f}")
        print(f"  kvd restore warm  {med['restore_warm']:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
