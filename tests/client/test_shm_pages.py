"""The client's bulk prefault of granted slots (client/_pages.py, issue 42):
it maps pages the daemon's puts made resident and never allocates a page --
neither a hole of a sparse segment nor anything outside the granted range --
and a new client's first put over shared memory stays bit-exact."""

from __future__ import annotations

import mmap
import os
import sys

import numpy as np
import pytest

from kvd_client import _pages
from support import assert_prefix_hit, prefix_snapshot

PAGE = mmap.PAGESIZE
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_READ and mincore: Linux")


def _segment(n_pages: int):
    """A sparse shared-memory segment like the daemon's (a memfd), mapped twice:
    the daemon's side and a new client's."""
    fd = os.memfd_create("kvd-test-pages")
    os.ftruncate(fd, n_pages * PAGE)
    return fd, mmap.mmap(fd, n_pages * PAGE, flags=mmap.MAP_SHARED), mmap.mmap(fd, n_pages * PAGE, flags=mmap.MAP_SHARED)


@linux_only
def test_prefault_maps_resident_pages_and_allocates_none():
    fd, daemon, client = _segment(64)
    try:
        written = [1, 2, 3, 10, 11, 40]  # pages a warm daemon's puts wrote; the rest are holes
        for p in written:
            daemon[p * PAGE:(p + 1) * PAGE] = bytes([p]) * PAGE
        os.posix_fallocate(fd, 20 * PAGE, 4 * PAGE)  # reserved, never written: skipped, not allocated
        blocks = os.fstat(fd).st_blocks
        # Resident: in the segment's page cache, written (reserved pages are not, until cleared).
        assert _pages.resident(client, 0, 64 * PAGE).nonzero()[0].tolist() == written
        # A grant from the middle of page 1 to the middle of page 30.
        done = _pages.prefault(client, PAGE + 100, 29 * PAGE)
        assert done == 5 * PAGE  # pages 1, 2, 3, 10, 11: the resident ones inside the grant
        assert os.fstat(fd).st_blocks == blocks  # not a page allocated
        assert _pages.resident(client, 0, 64 * PAGE).nonzero()[0].tolist() == written
        assert _pages.prefault(client, PAGE + 100, 29 * PAGE) == 0  # granted before: no syscall again
        for p in written:  # what the daemon wrote, seen through the client's mapping
            assert client[p * PAGE:(p + 1) * PAGE] == bytes([p]) * PAGE
    finally:
        daemon.close()
        client.close()
        os.close(fd)


@linux_only
def test_a_new_clients_first_put_prefaults_reused_slots_bit_exact(daemon_factory):
    d = daemon_factory("--ram-mb", "2", "--data-dir", "none")
    toks = [np.arange(2048) + i * 100_000 for i in range(10)]  # ~0.55 MiB each: the first 8 overflow 2 MiB
    with d.client("pages", strict=True, transport="shm") as c:
        for t in toks[:8]:  # a warm daemon: evictions freed slots whose pages were written
            assert c.put(t, prefix_snapshot(t))
        assert c.stats()["tiers"]["ram"]["evictions"] > 0
    before = _pages.counters["prefaulted_bytes"]
    with d.client("pages", strict=True, transport="shm") as c2:
        for t in toks[8:]:
            assert c2.put(t, prefix_snapshot(t))
        assert c2.counters["shm_puts"] == 2
        for t in toks[8:]:
            assert_prefix_hit(c2.get(t), t)
        s = c2.stats()["shm"]
    assert _pages.counters["prefaulted_bytes"] > before  # the reused pages were populated in bulk
    assert s["used_bytes"] <= s["capacity_bytes"]
    assert d.proc.poll() is None
