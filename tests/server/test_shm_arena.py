"""The shared-memory arena's allocator against a reference model of the free
space: seeded random alloc/free sequences (thousands of operations), checked
after every one of them.

The model is the obvious, slow one: per segment a sorted list of free ranges,
merged by sorting after each free, and best fit by a scan of every range
(`min` of (size, segment, offset) over those that fit). The allocator
(kvd/server/shm/freespace.py behind kvd.server.shm.arena.Arena) must agree exactly:
the same placement for every slot (so it never grows a segment while a free
range fits, and never misses the best one), the same free ranges, no two free
ranges touching, live slots and free ranges tiling every segment without
overlap, the same `used`, live segments, counters and trimmed bytes. The
arena test runs on real segment files; every slot is filled with a byte of
its own and read back when freed, so an overlap would show in the memory too.
"""

from __future__ import annotations

import mmap
import os
import random

import pytest

from kvd.protocol.shm import ALIGN, align_up
from kvd.server.shm.arena import Arena
from kvd.server.shm.freespace import FreeSpace
from support import shm_folder

SEG = 256 << 10  # small segments, so slots often need a new one and segments empty out
# The daemon's mix (bench_scale): ~4.7 KiB SSD read buffers and 16 KiB PUT slots,
# plus odd small sizes and the occasional slot bigger than a segment.
SIZES = [4800] * 6 + [16384] * 6 + [1, 63, 64, 65, 1000, 2500, 9000, 40_000, SEG - 64, SEG, SEG + 4096]


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for off, n in sorted(ranges):
        if out and out[-1][0] + out[-1][1] == off:
            out[-1][1] += n
        else:
            out.append([off, n])
    return [(o, n) for o, n in out]


class Model:
    """The reference: the arena's rules written the slow, plain way."""

    def __init__(self, capacity, seg_bytes: int):
        self.capacity, self.seg_bytes = capacity, seg_bytes
        self.sizes: list[int] = []  # per segment, 0 once removed
        self.free: list[list[tuple[int, int]]] = []
        self.used, self.lean = 0, False
        self.counters = {"allocs": 0, "alloc_failures": 0, "segments_removed": 0, "trimmed_bytes": 0,
                         "grow_failures": 0, "lost_slots": 0, "names_repaired": 0, "shrunk_segments": 0}

    def keep_free(self) -> int:
        return self.seg_bytes if self.lean else max(self.seg_bytes, self.capacity() // 2)

    def alloc(self, nbytes: int) -> tuple[int, int] | None:
        size = align_up(max(1, nbytes))
        self.lean = False
        if self.used + size > self.capacity():
            self.counters["alloc_failures"] += 1
            return None
        fits = [(n, seg, off) for seg, ranges in enumerate(self.free) for off, n in ranges if n >= size]
        if fits:
            n, seg, off = min(fits)
            self.free[seg].remove((off, n))
            if n > size:
                self.free[seg] = merged(self.free[seg] + [(off + size, n - size)])
        else:
            seg_size = max(self.seg_bytes, size)
            over = sum(self.sizes) + seg_size - self.capacity()
            idle = [seg for seg in self.live() if self.free[seg] == [(0, self.sizes[seg])]]
            if over > 0 and sum(self.sizes[seg] for seg in idle) >= over:
                for seg in idle:  # all-free segments too small for it make room, oldest first
                    if over <= 0:
                        break
                    over -= self.sizes[seg]
                    self.remove(seg)
            if over > 0:
                self.counters["alloc_failures"] += 1
                return None
            seg, off = len(self.sizes), 0
            self.sizes.append(seg_size)
            self.free.append([(size, seg_size - size)] if seg_size > size else [])
        self.used += size
        self.counters["allocs"] += 1
        return seg, off

    def release(self, seg: int, off: int, size: int) -> None:
        self.used -= size
        self.free[seg] = merged(self.free[seg] + [(off, size)])
        if self.free[seg] == [(0, self.sizes[seg])] and sum(self.sizes) - self.used > self.keep_free():
            self.remove(seg)

    def remove(self, seg: int) -> None:
        self.sizes[seg], self.free[seg] = 0, []
        self.counters["segments_removed"] += 1

    def trim(self) -> int:
        freed = 0
        for seg, size in enumerate(self.sizes):
            if not size:
                continue
            if self.free[seg] == [(0, size)]:
                freed += size
                self.remove(seg)
                continue
            if hasattr(mmap, "MADV_REMOVE"):
                for off, n in self.free[seg]:
                    lo, hi = -(-off // mmap.PAGESIZE) * mmap.PAGESIZE, (off + n) // mmap.PAGESIZE * mmap.PAGESIZE
                    freed += max(0, hi - lo)
        self.counters["trimmed_bytes"] += freed
        return freed

    def live(self) -> list[int]:
        return [seg for seg, size in enumerate(self.sizes) if size]


def _free_ranges(space: FreeSpace, segs) -> list[list[tuple[int, int]]]:
    return [sorted(space.ranges(seg)) for seg in segs]


@pytest.mark.parametrize("seed", range(4))
def test_free_space_places_and_merges_like_the_reference(seed):
    """FreeSpace alone: best fit with ties to the lowest (segment, offset), every
    free merged with both neighbours, dropped segments gone from the search."""
    rng = random.Random(seed)
    space, ref = FreeSpace(), Model(lambda: 1 << 40, SEG)
    held: list[tuple[int, int, int]] = []
    for step in range(6000):
        roll = rng.random()
        if roll < 0.5 or not held:
            size = align_up(rng.choice(SIZES))
            want = ref.alloc(size)  # unbounded capacity: it grows a segment when nothing fits
            got = space.take(size)
            if got is None:  # nothing fits: the arena's _grow
                seg = len(ref.sizes) - 1
                assert want == (seg, 0) and ref.sizes[seg] == max(SEG, size), (step, want)
                if ref.sizes[seg] > size:
                    space.give(seg, size, ref.sizes[seg] - size)
                got = want
            assert got == want, step
            held.append((*got, size))
        elif roll < 0.98:
            seg, off, size = held.pop(rng.randrange(len(held)))
            ref.used -= size
            ref.free[seg] = merged(ref.free[seg] + [(off, size)])
            assert space.give(seg, off, size) in ref.free[seg]
        else:  # a segment whose slots are all free is removed
            whole = [seg for seg in ref.live() if ref.free[seg] == [(0, ref.sizes[seg])]]
            for seg in whole:
                ref.remove(seg)
                space.drop(seg)
                assert space.ranges(seg) == []
        assert _free_ranges(space, range(len(ref.sizes))) == ref.free, step
        if step % 20 == 0:
            space.check()
    space.check()
    assert len(space) == sum(len(r) for r in ref.free)


def test_stale_entries_stay_bounded_and_duplicates_are_harmless():
    """The same range freed, merged away and freed again leaves duplicate and
    stale heap entries; the index still finds every live range once."""
    space = FreeSpace()
    space.give(0, 0, 1 << 20)
    slots = [space.take(4096) for _ in range(64)]
    assert slots == [(0, i * 4096) for i in range(64)]
    for _ in range(200):
        for i in range(0, 64, 2):  # holes of 4096 ...
            space.give(0, i * 4096, 4096)
        space.check()
        for i in range(1, 64, 2):  # ... merged into one range, their entries stale
            space.give(0, i * 4096, 4096)
        space.check()
        assert sorted(space.ranges(0)) == [(0, 1 << 20)]
        assert [space.take(4096) for _ in range(64)] == [(0, i * 4096) for i in range(64)]
    assert space.take(1 << 20) is None and space.take(1) == (0, 64 * 4096)


@pytest.fixture
def folder(tmp_path):
    with shm_folder(tmp_path, "arena") as path:
        yield path


@pytest.mark.parametrize("seed", range(3))
def test_arena_agrees_with_the_reference_model(folder, seed):
    """The real arena (files, mappings, page reservations, slots freed with their
    last reference) against the model: the same slot for every alloc, the same
    free ranges, segments grown and removed at the same moments, trim and
    give_back handing back the same bytes, a capacity that moves."""
    rng = random.Random(seed)
    cap = [3 << 20]
    arena, ref = Arena(folder, "0badcafe", capacity=lambda: cap[0], segment_bytes=SEG), Model(lambda: cap[0], SEG)
    held: list[tuple] = []  # (SlotArray, fill byte)

    def alloc(step: int) -> None:
        nbytes = rng.choice(SIZES)
        want = ref.alloc(nbytes)
        arr = arena.alloc(nbytes)
        if want is None:
            assert arr is None, step
            return
        assert arr is not None and (arr.slot.seg, arr.slot.off) == want, (step, nbytes)
        assert arr.nbytes == nbytes and arr.slot.size == align_up(max(1, nbytes)) and arr.slot.off % ALIGN == 0
        fill = arr.slot.sid % 251 + 1
        arr[:] = fill
        held.append((arr, fill))

    def release(i: int) -> None:
        arr, fill = held.pop(i)
        assert (arr == fill).all(), "another slot wrote over this one"
        s = arr.slot
        ref.release(s.seg, s.off, s.size)
        del arr, s  # the last reference: the slot goes back

    for step in range(3000):
        roll = rng.random()
        if roll < 0.52:
            alloc(step)
        elif roll < 0.985 and held:
            release(rng.randrange(len(held)))
        elif roll < 0.99:
            assert arena.trim() == ref.trim(), step
        elif roll < 0.993:
            ref.lean = True
            assert arena.give_back() == ref.trim(), step
        else:  # memory pressure moves the capacity (and with it keep_free)
            cap[0] = rng.choice([1 << 20, 2 << 20, 3 << 20, 6 << 20])

        assert arena.used == ref.used and arena.live() == ref.live(), step
        assert _free_ranges(arena._space, ref.live()) == [ref.free[seg] for seg in ref.live()], step
        assert arena.counters == ref.counters, step
        stats = arena.stats()
        assert stats["mapped_bytes"] == sum(ref.sizes) and stats["used_bytes"] == ref.used
        if step % 10 == 0:  # live slots and free ranges tile every live segment, no overlap
            arena._space.check()
            for seg in ref.live():
                spans = sorted([(a.slot.off, a.slot.size) for a, _ in held if a.slot.seg == seg] + ref.free[seg])
                pos = 0
                for off, n in spans:
                    assert off == pos, (step, seg, off, pos)
                    pos += n
                assert pos == ref.sizes[seg], (step, seg)
            assert not any(a.slot.seg not in ref.live() for a, _ in held)
    while held:
        release(len(held) - 1)
    assert arena.used == 0 and arena.counters["allocs"] > 1000 and arena.counters["segments_removed"] > 10
    assert _free_ranges(arena._space, ref.live()) == [[(0, ref.sizes[seg])] for seg in ref.live()]
    arena.unlink()


def test_idle_segments_too_small_for_a_slot_make_room_for_it_only_when_that_is_enough(folder):
    """All-free segments kept warm count against the capacity: a slot bigger
    than any of them removes as many as it needs (oldest first), never more,
    and none when removing every one would not make room."""
    cap = [8 * SEG]
    arena = Arena(folder, "0badcafe", capacity=lambda: cap[0], segment_bytes=SEG)
    small = [arena.alloc(SEG) for _ in range(6)]
    while small:
        small.pop(0)  # all free: four kept warm (keep_free, half the capacity), the last two removed
    assert arena.live() == [0, 1, 2, 3] and arena.counters["segments_removed"] == 2
    big = [arena.alloc(2 * SEG), arena.alloc(2 * SEG)]  # 4 idle + 2 + 2: the capacity, nothing removed
    assert [a.slot.seg for a in big] == [6, 7] and arena.counters["segments_removed"] == 2
    big.append(arena.alloc(2 * SEG))  # 10 would be over: the two oldest idle ones make room
    assert big[2] is not None and big[2].slot.seg == 8
    assert arena.live() == [2, 3, 6, 7, 8] and arena.counters["segments_removed"] == 4
    half = arena.alloc(SEG // 2)  # into idle segment 2 (best fit): one idle segment left
    assert half.slot.seg == 2
    cap[0] = 9 * SEG
    # used 6.5 + 2.5 fits the capacity, but 8 mapped - 1 idle + 2.5 does not: none removed
    assert arena.alloc(2 * SEG + SEG // 2) is None
    assert arena.live() == [2, 3, 6, 7, 8] and arena.counters["segments_removed"] == 4
    for i, a in enumerate(big):
        a[:] = i + 1
    assert [int(a[0]) for a in big] == [1, 2, 3] and all((a == a[0]).all() for a in big)
    del big, half
    arena.unlink()


def test_a_slot_freed_by_the_garbage_collector_inside_a_locked_section_waits_for_it(tmp_path):
    """The cyclic collector can run inside the arena's own locked section (it
    runs wherever objects are made) and finalise a slot caught in a cycle: the
    non-reentrant lock would deadlock the thread. The free waits until the
    section ends instead, then counts."""
    import gc
    import threading

    arena = Arena(tmp_path, "0000c0de", capacity=1 << 20, segment_bytes=256 << 10)
    arr = arena.alloc(4096)
    cycle: list = [arr]
    cycle.append(cycle)  # only the collector can free it
    del arr
    done = threading.Event()

    def inside():
        nonlocal cycle
        with arena._locked():
            cycle = None
            gc.collect()  # finalises the slot here, lock held
            assert arena.used == align_up(4096)  # not yet: the section is still running
        done.set()

    t = threading.Thread(target=inside, daemon=True)
    t.start()
    t.join(10)
    assert done.is_set(), "the thread deadlocked on the arena's lock"
    assert arena.used == 0
    assert arena.alloc(4096) is not None


def test_a_failing_segment_is_logged_now_and_then_not_at_every_allocation(tmp_path, caplog):
    """Every allocation that could not add a segment logged a warning (one per
    SLOTS, GET copy-in and cold read: a flood); now the 1st, 2nd, 4th, 8th..."""
    import logging
    import shutil

    folder = tmp_path / "plane"
    folder.mkdir()
    arena = Arena(folder, "aaaaaaaa", capacity=64 << 20, segment_bytes=1 << 20)
    shutil.rmtree(folder)  # a segment can no longer be made (or named) there
    with caplog.at_level(logging.WARNING, logger="kvd.server"):
        assert all(arena.alloc(4096) is None for _ in range(100))
    lines = [r for r in caplog.records if "cannot add a shared-memory segment" in r.getMessage()]
    assert arena.counters["grow_failures"] == 100 and len(lines) == 7  # 1, 2, 4, ..., 64


def test_which_segments_no_process_can_cut_short():
    """kvd.host.segments.fixed_size, the one OS-specific decision of the
    road below: a sealed memfd, and a POSIX shm object on macOS (sized once,
    no read or write for one: bsd/kern/posix_shm.c), are fixed; an shm_open
    object on Linux and a file are not."""
    from kvd.host.segments import fixed_size

    assert fixed_size("memfd", "linux") and fixed_size("shm_open", "darwin")
    assert not fixed_size("shm_open", "linux") and not fixed_size("files", "darwin") and not fixed_size("files", "linux")


@pytest.fixture
def shm_open_host():
    from kvd.host import select

    select.use("portable")
    try:
        assert select.mechanism("shared_memory") == "shm_open"
        yield
    finally:
        select.use("auto")


@pytest.mark.parametrize("platform", ["darwin", "linux"])
def test_shm_open_segments_on_macos_are_copied_through_the_mapping(folder, shm_open_host, monkeypatch, platform):
    """macOS has no pread/pwrite for a POSIX shm object (ENOTSUP; ESPIPE for
    pread), a fault Linux cannot produce, so it is injected on the segments'
    fds. There (`fixed_size` on darwin) the daemon reads and writes slots
    through its mapping, as a sealed memfd's, and loses nothing; with Linux's
    answer it would have taken every segment for one cut short: each copy
    out a damaged entry, the segment never allocated in again."""
    import errno

    from kvd.host import segments
    from kvd.server.shm import arena as arena_module

    monkeypatch.setattr(arena_module, "fixed_size", lambda m: segments.fixed_size(m, platform))
    arena = Arena(folder, "0000a11e", capacity=16 << 20, segment_bytes=4 << 20)
    assert arena.mechanism == "shm_open" and arena.fixed == (platform == "darwin")
    a = arena.alloc(1000)
    seg_fds = set(arena._fds)

    def no_io(real):
        def call(fd, *args):
            if fd in seg_fds:
                raise OSError(errno.ESPIPE, "Illegal seek")
            return real(fd, *args)
        return call

    monkeypatch.setattr(arena_module.os, "pread", no_io(os.pread))
    monkeypatch.setattr(arena_module.os, "pwrite", no_io(os.pwrite))
    a[:] = 7
    if platform == "darwin":
        assert arena.copy_out(a) == b"\x07" * 1000
        b = arena.alloc(500)
        arena.copy_in(b, b"\x05" * 500)
        assert bytes(b) == b"\x05" * 500 and arena.counters["shrunk_segments"] == 0
    else:
        assert arena.copy_out(a) is None and arena.counters["shrunk_segments"] == 1


def test_the_ssd_writer_never_touches_a_segment_another_process_may_cut_short(folder, shm_open_host, tmp_path):
    """A blob file written from a slot of an shm_open segment on Linux (not
    `fixed`) reads the slot with pread: cut short under it, the entry is
    Altered (a drop), never a SIGBUS that takes the daemon down (red-team:
    its header's sum and its bounce buffer read the slot through the mapping)."""
    import xxhash

    from kvd.store.base import CHUNK, Entry, Tensor
    from kvd.store.ssd import blobfile

    arena = Arena(folder, "00c0ffee", capacity=16 << 20, segment_bytes=4 << 20)
    assert not arena.fixed
    n = 2 << 20
    slot = arena.alloc(n)
    slot[:] = 3
    slot.digest = xxhash.xxh3_64_intdigest(slot)
    entry = Entry("ns", b"k" * 32, CHUNK, b"p" * 32, 0, 16, (Tensor("t", "uint8", (n,), slot),))
    info = blobfile.write_blob(tmp_path / "ab" / "good.safetensors", entry)
    fd = os.open(tmp_path / "ab" / "good.safetensors", os.O_RDONLY)
    try:
        assert bytes(blobfile.read_blob(fd, info.file_size, info.checksum).tensors[0].data) == b"\x03" * n
    finally:
        os.close(fd)
    os.ftruncate(arena._fds[slot.slot.seg], 4096)  # what a process of the daemon's user may do here
    with pytest.raises(blobfile.Altered):
        blobfile.write_blob(tmp_path / "ab" / "cut.safetensors", entry)
    assert not (tmp_path / "ab" / "cut.safetensors").exists()
