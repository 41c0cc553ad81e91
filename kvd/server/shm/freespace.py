"""The free ranges of the shared-memory arena's segments: which range a new
slot is carved from, and how a freed slot merges with its neighbours.

Theory of operation
-------------------
No I/O here: the arena (kvd/server/shm/arena.py) owns the segment files and calls
this under its lock. Sizes and offsets are whatever the arena passes (ALIGN
multiples there); a segment is an index the arena never reuses.

Two indexes over the same ranges:
- by address, per segment: offset -> size of every free range, and its end ->
  offset. A freed range finds the range that starts at its end and the one
  that ends at its start in O(1) (boundary tags), so it always merges with
  both: no two free ranges ever touch.
- by size: the sorted distinct sizes of the free ranges, and per size a heap
  of (segment, offset) with a live count. `take` bisects the sizes for the
  smallest that fits and pops the lowest (segment, offset) of that size. A
  range that leaves the free set by merging is not searched for in its heap:
  its entry goes stale and is skipped when popped (an entry is live while
  its segment's map still says that offset has that size), and a heap that
  holds more than twice its live count (plus a few) is rebuilt, so stale
  entries cost amortised O(log n).
So `take` and `give` cost O(log n) Python steps whatever the fragmentation;
the sorted sizes list adds a C memmove when a size appears or disappears
(8 bytes per distinct size: microseconds at tens of thousands of them).
The linear first-fit this replaced scanned every range in Python until one
fit (11 % of the serving thread under bench_scale's mixed load).

The policy is best fit, ties to the lowest (segment, offset), because of the
arena's load: slots of a few sizes (4.7 KiB SSD read buffers, 16 KiB PUT
slots) freed in any order. Best fit hands a request the hole its own size
left behind before it splits a bigger one, so a read buffer does not carve
up a PUT slot's hole and strand 11 KiB that fits neither; and a segment's
untouched tail, or a whole free segment kept warm, is split last.
Address-ordered first fit fragments about as little (Johnstone and Wilson,
"The Memory Fragmentation Problem: Solved?", 1998: both waste a few percent
on real programs' traces) but finding it in O(log n) needs a tree augmented
with each subtree's largest range, many Python steps per operation. Measured
on the arena's own mix (bench/bench_arena.py), best fit left 120 free ranges
where first fit left 2,004. The tie to the lowest segment keeps live slots
packed into old segments, so the newest drain and can be removed.
"""

from __future__ import annotations

import bisect
import heapq

_SLACK = 8  # stale heap entries tolerated beyond the live count before a rebuild
_NONE: dict[int, int] = {}  # the ranges of a segment dropped since (its stale entries)


class FreeSpace:
    """Free ranges of numbered segments. Not thread-safe: the arena's lock guards it."""

    def __init__(self) -> None:
        self._starts: dict[int, dict[int, int]] = {}  # segment -> {offset: size}
        self._ends: dict[int, dict[int, int]] = {}  # segment -> {offset + size: offset}
        self._sizes: list[int] = []  # sorted distinct sizes with at least one live range
        self._heaps: dict[int, list[tuple[int, int]]] = {}  # size -> heap of (segment, offset), some stale
        self._counts: dict[int, int] = {}  # size -> live ranges of that size

    def __len__(self) -> int:
        """How many free ranges there are."""
        return sum(self._counts.values())

    def take(self, size: int) -> tuple[int, int] | None:
        """(segment, offset) of `size` bytes carved from the smallest free range
        that holds them (the lowest segment and offset among equals), its rest
        left free; None if no range is that large."""
        sizes = self._sizes
        i = bisect.bisect_left(sizes, size)
        if i == len(sizes):
            return None
        n = sizes[i]
        heap = self._heaps[n]
        while True:  # the count says a live entry is in there; stale ones go on the way
            seg, off = heapq.heappop(heap)
            if self._starts.get(seg, _NONE).get(off) == n:
                break
        self._unlist(seg, off, n)
        if n > size:
            self._list(seg, off + size, n - size)
        return seg, off

    def give(self, seg: int, off: int, size: int) -> tuple[int, int]:
        """Free `size` bytes at `off` of `seg` (a new segment: its whole size at 0),
        merged with the free ranges either side; returns the merged (offset, size)."""
        starts = self._starts.setdefault(seg, {})
        ends = self._ends.setdefault(seg, {})
        after = starts.get(off + size)
        if after is not None:
            self._unlist(seg, off + size, after)
            size += after
        before = ends.get(off)
        if before is not None:
            n = starts[before]
            self._unlist(seg, before, n)
            off, size = before, size + n
        self._list(seg, off, size)
        return off, size

    def drop(self, seg: int) -> None:
        """Forget a segment and its free ranges (the arena removed it)."""
        for off, n in list(self._starts.get(seg, {}).items()):
            self._unlist(seg, off, n)
        self._starts.pop(seg, None)
        self._ends.pop(seg, None)

    def ranges(self, seg: int) -> list[tuple[int, int]]:
        """The free (offset, size) ranges of a segment, in no particular order."""
        return list(self._starts.get(seg, {}).items())

    def check(self) -> None:
        """Raise AssertionError unless the two indexes describe the same ranges
        and no two free ranges touch (a consistency check for tests)."""
        counts: dict[int, int] = {}
        for seg, starts in self._starts.items():
            assert self._ends[seg] == {off + n: off for off, n in starts.items()}, seg
            spans = sorted(starts.items())
            for (a, n), (b, _) in zip(spans, spans[1:]):
                assert a + n < b, f"segment {seg}: free ranges at {a} (+{n}) and {b} touch or overlap"
            for off, n in spans:
                assert n > 0, (seg, off)
                counts[n] = counts.get(n, 0) + 1
                assert (seg, off) in self._heaps[n], (seg, off, n)
        assert self._counts == counts and self._sizes == sorted(counts) and self._heaps.keys() == counts.keys()
        for n, heap in self._heaps.items():
            assert len(heap) <= 2 * counts[n] + _SLACK, (n, len(heap), counts[n])
            assert all(heap[(i - 1) // 2] <= heap[i] for i in range(1, len(heap)))

    # -- the two indexes ----------------------------------------------------------
    def _list(self, seg: int, off: int, n: int) -> None:
        self._starts[seg][off] = n
        self._ends[seg][off + n] = off
        count = self._counts.get(n, 0)
        if count == 0:
            bisect.insort(self._sizes, n)
            self._heaps[n] = [(seg, off)]
        else:
            heapq.heappush(self._heaps[n], (seg, off))
        self._counts[n] = count + 1

    def _unlist(self, seg: int, off: int, n: int) -> None:
        """Take a range out of the address index; its heap entry, if still
        there, goes stale (see the module docstring)."""
        starts = self._starts[seg]
        del starts[off], self._ends[seg][off + n]
        count = self._counts[n] - 1
        if count == 0:
            del self._counts[n], self._heaps[n]
            del self._sizes[bisect.bisect_left(self._sizes, n)]
            return
        self._counts[n] = count
        heap = self._heaps[n]
        if len(heap) > 2 * count + _SLACK:
            # A sorted list is a heap; the set drops duplicates (a range freed,
            # merged away and freed again at the same place has two entries).
            heap[:] = sorted({(s, o) for s, o in heap if self._starts.get(s, _NONE).get(o) == n})
