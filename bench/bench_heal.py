"""Rebuilding a lost index from the blobs, against reading the same blobs raw.

    PYTHONPATH=. python3 bench/bench_heal.py [--count 100000] [--entry-kib 2] [--dir DIR] [--json]

Fills a data dir with --count small entries (one blob each, written through
the SSD tier), then damages its index (garbage in the meta page) and times:

  raw read        scandir of the shards + open/read/close of every blob: the
                  floor any rebuild pays (page cache warm, as after the fill)
  rebuild         `SsdStore(..., background=False)` on the damaged dir: the
                  meta-page check, the move aside, and the rebuild (parse,
                  kvd_sum verified, name checked, rows committed in batches)
  healthy open    opening the rebuilt index again (what every later start pays
                  before it serves)
  read-through    the walk over every key and row every start then runs on the
                  writer thread in steps (heal.walk_steps), between spills

and prints the rebuild's ratio to the raw read. The daemon runs the same
rebuild on its writer thread while it serves, so these seconds are the time
until every entry is back, not time without service.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from kvd.store.base import Entry, Tensor  # noqa: E402
from kvd.store.datadir import BLOB_DIR, INDEX_DIR  # noqa: E402
from kvd.store.ssd.heal import walk_steps  # noqa: E402
from kvd.store.ssd import SsdStore  # noqa: E402


def fill(root: Path, count: int, entry_bytes: int) -> None:
    rng = np.random.default_rng(0)
    payload = rng.integers(0, 1 << 16, size=entry_bytes // 2, dtype=np.uint16)
    # One file per blob (pack_max_bytes=0): the rebuild this bench measures walks
    # blob files; packed blobs are rebuilt from the pack, not from files.
    store = SsdStore(root, 1 << 40, min_free_bytes=0, durable=False, queue_entries=4096, pack_max_bytes=0)
    try:
        for i in range(count):
            key = i.to_bytes(8, "big") + bytes(24)
            parent = (i - 1).to_bytes(8, "big") + bytes(24) if i else bytes(32)
            data = payload.copy()
            data[:4] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint16)  # distinct bytes per entry
            entry = Entry("bench", key, 0, parent, i * 16, 16, (Tensor("kv", "bfloat16", (2, 16, data.size // 32), data.tobytes()),))
            store.spill(entry)
        store.flush()
    finally:
        store.close()


def raw_read(root: Path) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = 0
    for shard in os.scandir(root / BLOB_DIR):
        with os.scandir(shard.path) as it:
            for e in it:
                with open(e.path, "rb") as f:
                    f.read()
                n += 1
    return time.perf_counter() - t0, n


def garble_meta(root: Path) -> None:
    path = root / INDEX_DIR / "data.mdb"
    with open(path, "r+b") as f:
        f.seek(16)
        f.write(os.urandom(136))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=100_000)
    ap.add_argument("--entry-kib", type=float, default=2.0)
    ap.add_argument("--dir", default=None, help="where to make the data dir (default: a temp dir under /tmp)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="kvd-bench-heal-", dir=args.dir))
    root = base / "data"
    try:
        t0 = time.perf_counter()
        fill(root, args.count, int(args.entry_kib * 1024))
        fill_s = time.perf_counter() - t0
        raw_s, n = raw_read(root)
        garble_meta(root)
        t0 = time.perf_counter()
        store = SsdStore(root, 1 << 40, min_free_bytes=0, background=False)
        rebuild_s = time.perf_counter() - t0
        heal = store.heal.stats()
        store.close()
        t0 = time.perf_counter()
        store = SsdStore(root, 1 << 40, min_free_bytes=0, background=False, reconcile=False)
        open_s = time.perf_counter() - t0
        assert store.heal is None and store.entries == n == heal["recovered"], (store.entries, n, heal)
        t0 = time.perf_counter()
        for _ in walk_steps(store):
            pass
        walk_s = time.perf_counter() - t0
        store.close()
        out = {
            "entries": n, "entry_kib": args.entry_kib, "fill_s": fill_s, "raw_read_s": raw_s, "rebuild_s": rebuild_s,
            "rebuild_entries_per_s": n / rebuild_s, "ratio_to_raw_read": rebuild_s / raw_s, "healthy_open_s": open_s,
            "read_through_s": walk_s,
            "quarantined": heal["quarantined"],
        }
        if args.json:
            print(json.dumps(out, indent=2))
            return
        print(f"bench_heal: {n} entries of {args.entry_kib:g} KiB tensor data, {os.cpu_count()} cores, "
              f"Python {sys.version.split()[0]}, {sys.platform}")
        print(f"  fill (SSD tier, not durable)  {fill_s:8.2f} s")
        print(f"  raw read of every blob        {raw_s:8.2f} s")
        print(f"  rebuild from the blobs        {rebuild_s:8.2f} s   {n / rebuild_s:,.0f} entries/s   ratio {rebuild_s / raw_s:.2f}")
        print(f"  healthy open afterwards       {open_s * 1e3:8.1f} ms")
        print(f"  read-through after a start    {walk_s:8.2f} s   (writer thread, in steps)")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
