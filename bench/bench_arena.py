"""Allocation and free in the shared-memory arena on a fragmented free list:
the linear first fit kvd had before against the best-fit index it has now.

One command:

    .venv/bin/python bench/bench_arena.py [--live 10000] [--ops 20000] [--reps 3] [--seed 1]

Both allocators run the same seeded operation stream in the same run. The
arena is filled with `--live` slots, then churned: each step frees a random
live slot and allocates a new one, so the free list fragments the way the
daemon's does under bench_scale's mixed load. Two mixes: the daemon's
(~4.7 KiB SSD read buffers and 16 KiB PUT slots, half each) and sizes spread
uniformly over 64 B-32 KiB (many distinct sizes: the new index's worst case).
Each is timed two ways after a warm-up churn of `--ops` steps:
- allocator: the free-range index alone (`take` + `give`), no memory touched;
- arena: `Arena.alloc` + dropping the slot's last reference, on real segment
  files (/dev/shm when there is one), the old index put in its place.
Printed: alloc+free pairs per second (the fastest of `--reps` interleaved
runs: the machine is shared), the ratio, and what the churn left (free
ranges, the largest one, mapped segments), to compare fragmentation.

`LinearFreeSpace` is the old code (Arena._first_fit and _free_locked before
the change) behind FreeSpace's interface.
"""

from __future__ import annotations

import argparse
import bisect
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _util import machine  # noqa: E402

from kvd.protocol.shm import align_up  # noqa: E402
from kvd.server.shm.arena import Arena  # noqa: E402
from kvd.server.shm.freespace import FreeSpace  # noqa: E402

SEG = 64 << 20  # the daemon's segment size
MIXES = {
    "4.7K/16K": lambda rng: rng.choice((4800, 16384)),
    "64B-32K": lambda rng: rng.randrange(1, 32 << 10),
}


class LinearFreeSpace:
    """The arena's free lists before this change: per segment a sorted list of
    [offset, size]; first fit scans the segments in order, each range in order."""

    def __init__(self) -> None:
        self._free_lists: dict[int, list[list[int]]] = {}

    def take(self, size: int) -> tuple[int, int] | None:
        for seg, free in self._free_lists.items():  # (dropped segments are gone, as `_maps[seg] is None` skipped them)
            for i, (off, n) in enumerate(free):
                if n >= size:
                    if n == size:
                        del free[i]
                    else:
                        free[i] = [off + size, n - size]
                    return seg, off
        return None

    def give(self, seg: int, off: int, size: int) -> tuple[int, int]:
        free = self._free_lists.setdefault(seg, [])
        i = bisect.bisect_left(free, [off, 0])
        free.insert(i, [off, size])
        if i + 1 < len(free) and off + size == free[i + 1][0]:  # merge with the next
            free[i][1] += free.pop(i + 1)[1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == off:  # and with the previous
            free[i - 1][1] += free.pop(i)[1]
            i -= 1
        return free[i][0], free[i][1]

    def drop(self, seg: int) -> None:
        self._free_lists.pop(seg, None)

    def ranges(self, seg: int) -> list[tuple[int, int]]:
        return [(o, n) for o, n in self._free_lists.get(seg, [])]

    def __len__(self) -> int:
        return sum(len(f) for f in self._free_lists.values())


def _shape(space, segs: int) -> str:
    ranges = [n for seg in range(segs) for _, n in space.ranges(seg)]
    return f"{len(ranges):6d} free ranges, largest {max(ranges, default=0) >> 10:6d} KiB"


def bench_allocator(space, mix, live: int, ops: int, seed: int) -> tuple[float, str]:
    """alloc+free pairs per second through the index alone (the arena's _grow
    stands in: a new 64 MiB segment when nothing fits)."""
    rng = random.Random(seed)
    segs = 0
    held: list[tuple[int, int, int]] = []

    def alloc() -> None:
        nonlocal segs
        size = align_up(mix(rng))
        got = space.take(size)
        if got is None:
            space.give(segs, size, SEG - size)
            got, segs = (segs, 0), segs + 1
        held.append((*got, size))

    def churn(n: int) -> None:
        for _ in range(n):
            i = rng.randrange(len(held))
            held[i], held[-1] = held[-1], held[i]
            space.give(*held.pop())
            alloc()

    for _ in range(live):
        alloc()
    churn(ops)  # warm-up: the free list fragments
    t0 = time.perf_counter()
    churn(ops)
    rate = ops / (time.perf_counter() - t0)
    return rate, f"{_shape(space, segs)}, {segs} segments"


def bench_arena(space, mix, live: int, ops: int, seed: int, folder: Path) -> tuple[float, str]:
    """alloc+free pairs per second through Arena.alloc and the slot's last reference."""
    rng = random.Random(seed)
    arena = Arena(folder, "0badcafe", capacity=4 << 30, segment_bytes=SEG)
    arena._space = space  # before the first alloc: the index under test
    held = []

    def churn(n: int) -> None:
        for _ in range(n):
            i = rng.randrange(len(held))
            held[i] = held[-1]  # the slot at i goes back (its last reference)
            held.pop()
            held.append(arena.alloc(mix(rng)))

    try:
        for _ in range(live):
            held.append(arena.alloc(mix(rng)))
        churn(ops)
        t0 = time.perf_counter()
        churn(ops)
        rate = ops / (time.perf_counter() - t0)
        shape = f"{_shape(space, len(arena._maps))}, {arena.stats()['mapped_bytes'] >> 20} MiB mapped"
        held.clear()
        return rate, shape
    finally:
        arena.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--live", type=int, default=10_000, help="live slots while churning")
    ap.add_argument("--ops", type=int, default=20_000, help="alloc+free pairs timed (and as many before, untimed)")
    ap.add_argument("--reps", type=int, default=3, help="runs of each, interleaved; the fastest counts (a shared machine)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    print(f"{machine()}; {args.live} live slots, {args.ops} alloc+free pairs timed after as many untimed, "
          f"best of {args.reps}")
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    impls = {"linear first fit (before)": LinearFreeSpace, "best fit (now)": FreeSpace}
    for mix_name, mix in MIXES.items():
        for level in ("allocator", "arena"):
            rates: dict[str, float] = {name: 0.0 for name in impls}
            shapes: dict[str, str] = {}
            for _ in range(args.reps):
                for name, make in impls.items():
                    if level == "allocator":
                        rate, shapes[name] = bench_allocator(make(), mix, args.live, args.ops, args.seed)
                    else:
                        folder = Path(tempfile.mkdtemp(prefix="kvd-bench-arena-", dir=base))
                        try:
                            rate, shapes[name] = bench_arena(make(), mix, args.live, args.ops, args.seed, folder)
                        finally:
                            shutil.rmtree(folder, ignore_errors=True)
                    rates[name] = max(rates[name], rate)
            for name in impls:
                print(f"{mix_name:9s} {level:9s} {name:26s} {rates[name]:10.0f} pairs/s   {shapes[name]}")
            old, new = rates.values()
            print(f"{mix_name:9s} {level:9s} {'now / before':26s} {new / old:10.1f}x")

if __name__ == "__main__":
    main()
