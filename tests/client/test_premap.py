"""The premapper (client/_pages.py): a daemon's live segments mapped ahead of
the puts, off the caller's thread, resident pages only, and nothing after stop."""

from __future__ import annotations

import mmap
import os
import sys

import pytest

from kvd_client import _pages
from support import wait_until

MiB = 1 << 20


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _pages._enabled, reason="no mincore/MADV_POPULATE_READ")
def test_a_live_segment_is_mapped_ahead_allocating_nothing_and_nothing_after_stop():
    fd = os.memfd_create("kvd-premap-test")
    try:
        os.ftruncate(fd, 8 * MiB)
        written = mmap.mmap(fd, 8 * MiB)  # the daemon's: half the segment written, half a hole
        written[:4 * MiB] = b"\x5a" * (4 * MiB)
        blocks = os.fstat(fd).st_blocks
        mm = mmap.mmap(fd, 8 * MiB)  # the client's, never touched
        asked: list[int] = []

        def segment(seg, reads):
            asked.append(seg)
            return [mm]

        before = dict(_pages.counters)
        p = _pages.Premapper(segment)
        p.offer([0])
        p.offer([0])  # once per segment
        wait_until(lambda: _pages.counters["premapped_segments"] > before["premapped_segments"], what="premapped")
        assert asked == [0]
        assert _pages.counters["prefaulted_bytes"] - before["prefaulted_bytes"] == 4 * MiB  # the written half only
        assert os.fstat(fd).st_blocks == blocks  # the hole stays a hole: the client allocated nothing
        assert mm[:4] == b"\x5a" * 4
        p.stop()
        p.offer([1])
        assert asked == [0]  # stopped: nothing more asked for
        del written
    finally:
        os.close(fd)
