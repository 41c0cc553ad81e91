"""The client's bulk prefault of granted slots (client/_pages.py, issue 42):
it maps pages the daemon's puts made resident and never allocates a page --
neither a hole of a sparse segment nor anything outside the granted range --
and a new client's first put over shared memory stays bit-exact, its slots
populated by a thread of their own as it copies (`Ahead`)."""

from __future__ import annotations

import mmap
import os
import sys

import numpy as np
import pytest

from kvd_client import _pages, _shm
from kvd_client import HostTensor, Snapshot
from support import assert_prefix_hit, prefix_snapshot, wait_until

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
def test_the_premapper_leaves_pages_not_resident_yet_to_the_grant_that_comes_to_them():
    """A segment the daemon is still clearing when a reply lists it: the
    premapper maps the pages cleared so far and marks only those, so a grant
    there later populates the rest (resident by then) in bulk, instead of its
    copy faulting them in one at a time."""
    fd, daemon, client = _segment(64)
    try:
        daemon[:32 * PAGE] = bytes(32 * PAGE)  # cleared so far: the first half
        pm = _pages.Premapper(lambda seg, reads: [client] if seg == 0 else None)
        before = _pages.counters["premapped_segments"]
        try:
            pm.offer([0])
            wait_until(lambda: _pages.counters["premapped_segments"] > before, what="the segment premapped")
        finally:
            pm.stop()
        os.pwrite(fd, bytes(32 * PAGE), 32 * PAGE)  # the daemon clears the rest (through its fd)
        assert bytes(_pages._seen(client)) == b"\x01" * 32 + b"\x00" * 32  # only what it mapped
        assert _pages.prefault(client, 0, 64 * PAGE) == 64 * PAGE  # the grant: its resident pages, in bulk
        assert _pages.prefault(client, 0, 64 * PAGE) == 0  # then every page looked at (rule 1)
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


def _written_segment(n_pages: int):
    """A segment whose every page a daemon's put wrote (resident), and a new client's mapping of it."""
    fd, daemon, client = _segment(n_pages)
    daemon[:] = bytes(range(256)) * (n_pages * PAGE // 256)
    return fd, daemon, client


@linux_only
def test_ahead_populates_each_slot_once_whoever_takes_it():
    fd, daemon, client = _written_segment(4096)  # 16 MiB: 64 slots of 64 pages
    try:
        jobs = [(client, i * 64 * PAGE, 64 * PAGE) for i in range(64)]
        before = dict(_pages.counters)
        ahead = _pages.Ahead.start(jobs)
        assert ahead is not None
        for i, (mm, off, n) in enumerate(jobs):  # the caller's copy loop: reach, then its own prefault
            ahead.reach(i)
            _pages.prefault(mm, off, n)
        ahead.stop()
        wait_until(lambda: not ahead._mine, what="the thread done with its last slot")
        # Every page populated exactly once (a slot's second prefault finds it mapped: rule 1),
        # by the thread or by the caller, and the thread did its share.
        assert _pages.counters["prefaulted_bytes"] - before["prefaulted_bytes"] == 4096 * PAGE
        assert _pages.counters["ahead_puts"] == before["ahead_puts"] + 1
        assert _pages.counters["ahead_slots"] - before["ahead_slots"] == ahead.populated
        assert not _pages.unmapped(client, 0, 4096 * PAGE)
        assert client[:] == daemon[:]
    finally:
        daemon.close()
        client.close()
        os.close(fd)


@linux_only
def test_the_caller_waits_for_a_slot_the_thread_has_in_hand_and_takes_those_it_has_not():
    import threading

    fd, daemon, client = _written_segment(4096)
    try:
        jobs = [(client, i * 64 * PAGE, 64 * PAGE) for i in range(64)]
        ahead = _pages.Ahead(jobs)  # no thread: this test plays it
        i, done = ahead.take()
        assert i == 0
        waiter = threading.Thread(target=ahead.reach, args=(0,))
        waiter.start()
        wait_until(lambda: len(done._cond._waiters) == 1, what="the caller waiting for slot 0")
        assert waiter.is_alive()
        ahead.done(0, done)
        waiter.join(10)
        assert not waiter.is_alive()
        ahead.reach(1)  # not taken: the caller's own; the thread goes on past it
        assert ahead.take()[0] == 2
        ahead.stop()
        assert ahead.take() is None
    finally:
        daemon.close()
        client.close()
        os.close(fd)


def test_a_small_grant_or_one_mapped_already_gets_no_thread():
    fd, daemon, client = _segment(4096)
    try:
        assert _pages.Ahead.start([(client, 0, _pages.AHEAD_MIN_BYTES - PAGE)]) is None
        if _pages._enabled:
            _pages.prefault(client, 0, 4096 * PAGE)  # mapped here already (rule 1)
        assert _pages.Ahead.start([(client, 0, 4096 * PAGE)]) is None
    finally:
        daemon.close()
        client.close()
        os.close(fd)


@linux_only
def test_a_new_clients_first_big_put_is_populated_ahead_and_bit_exact(daemon_factory, monkeypatch):
    # A put at once after HELLO: its slots' pages mapped by `Ahead` as it
    # copies. (The background map of the live segments HELLO lists would race
    # it for the same pages: kept out here, tested in test_shm_prepare.py.)
    monkeypatch.setattr(_shm.Link, "map_ahead", lambda self, live, reads=False: None)
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")
    with d.client("ahead", strict=True, transport="shm") as c:
        wait_until(lambda: c.stats()["shm"]["prepared_free_bytes"] >= 32 << 20, what="the window prepared")
    rng = np.random.default_rng(42)
    snap = Snapshot(sliced={"k": (HostTensor.from_numpy(rng.integers(0, 255, (1, 2048, 8192), np.uint8)), 1)})  # 16 MiB
    tokens = list(range(2048))
    before = dict(_pages.counters)
    with d.client("ahead", strict=True, transport="shm") as c2:  # a new client: none of the pages mapped here
        assert c2.put(tokens, snap)
        assert c2.counters["shm_puts"] == 1
        hit = c2.get(tokens)
        assert hit.n == 2048 and hit.sliced["k"].array.tobytes() == snap.sliced["k"][0].array.tobytes()
    assert _pages.counters["ahead_puts"] == before["ahead_puts"] + 1
    assert _pages.counters["prefaulted_bytes"] - before["prefaulted_bytes"] >= 16 << 20  # prepared pages: resident


@linux_only
def test_the_tensors_of_a_slot_are_populated_as_one_job(daemon_factory, monkeypatch):
    # 16 tensors a chunk, 8 chunks: 128 descriptors, side by side in 8 slots
    # (the last chunk's, 208 tokens of 513 bytes, padded to ALIGN). One job per tensor gave the populating thread 128
    # turns at the GIL against the caller's copy (2.5x slower); the tensors of
    # a slot, and slots that follow one another in a segment, are one job.
    monkeypatch.setattr(_shm.Link, "map_ahead", lambda self, live, reads=False: None)
    started = []
    real_start = _pages.Ahead.start
    monkeypatch.setattr(_pages.Ahead, "start", classmethod(lambda cls, jobs: started.append(list(jobs))
                                                            or real_start.__func__(cls, jobs)))
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")
    with d.client("ahead", strict=True, transport="shm") as c:
        wait_until(lambda: c.stats()["shm"]["prepared_free_bytes"] >= 32 << 20, what="the window prepared")
    rng = np.random.default_rng(7)
    sliced = {f"t{i}": (HostTensor.from_numpy(rng.integers(0, 255, (1, 2000, 513), np.uint8)), 1) for i in range(16)}
    tokens = list(range(2000))
    with d.client("ahead", strict=True, transport="shm") as c2:  # a new client: none of the pages mapped here
        assert c2.put(tokens, Snapshot(sliced=sliced))
        assert c2.counters["shm_puts"] == 1
        hit = c2.get(tokens)
        assert hit.n == 2000
        for name, (t, _) in sliced.items():
            assert hit.sliced[name].array.tobytes() == t.array.tobytes(), name
    assert len(started) == 1
    jobs = started[0]
    assert 1 <= len(jobs) <= 8, [(off, n) for _, off, n in jobs]
    assert sum(n for _, _, n in jobs) >= 16 * 2000 * 513


@linux_only
def test_a_premapper_whose_mapping_is_closed_midway_maps_the_next_segment_all_the_same(monkeypatch):
    # The daemon removed a segment the premapper is on, and another thread's
    # retain() closed its mapping between two pieces (forced here: the close
    # comes right after the first piece). The thread stops there and lives on.
    first, second = _written_segment(2048), _written_segment(2048)  # 8 MiB each: two pieces
    maps = {0: [first[2]], 1: [second[2]]}
    real = _pages.prefault
    calls = []

    def closing(mm, off, n, **kw):
        got = real(mm, off, n, **kw)
        calls.append((id(mm), off))
        if mm is first[2] and off == 0:
            mm.close()  # as retain() would, on another thread
        return got

    monkeypatch.setattr(_pages, "prefault", closing)
    before = _pages.counters["premapped_segments"]
    pm = _pages.Premapper(lambda seg, reads: maps.get(seg))
    try:
        pm.offer([0])
        wait_until(lambda: _pages.counters["premapped_segments"] == before + 1, what="the first piece mapped")
        pm.offer([1])
        wait_until(lambda: _pages.counters["premapped_segments"] == before + 2, what="the next segment mapped")
        assert (id(second[2]), _pages.PREMAP_STEP) in calls  # both its pieces
        assert not _pages.unmapped(second[2], 0, 2048 * PAGE)
    finally:
        pm.stop()
        for fd, daemon, client in (first, second):
            daemon.close()
            if not client.closed:
                client.close()
            os.close(fd)


@linux_only
def test_the_premapper_waits_while_its_client_copies_and_maps_once_it_is_done():
    """Rule 4: a put or a fetch copying (`pause`) keeps the premapper between
    pieces, mapping nothing; `resume` lets it go on; `stop` ends it even while
    paused. Beside the copy it took the core the copy ran on (a new client's
    first put 0.44-0.49x the steady state, 0.67-0.71x with it waiting)."""
    fd, daemon, client = _written_segment(2048)  # 8 MiB: two pieces
    pm = _pages.Premapper(lambda seg, reads: [client] if seg == 0 else None)
    try:
        waits, mapped = _pages.counters["premap_waits"], _pages.counters["premapped_segments"]
        pm.pause()
        pm.offer([0])
        wait_until(lambda: _pages.counters["premap_waits"] > waits, what="the premapper waiting")
        assert bytes(_pages._seen(client)) == bytes(2048)  # not a page mapped while the copy runs
        with pm.held():  # a second call copying: still waiting after the first is done
            pm.resume()
            assert pm._busy == 1 and _pages.counters["premapped_segments"] == mapped
        wait_until(lambda: _pages.counters["premapped_segments"] > mapped, what="the segment premapped")
        assert not _pages.unmapped(client, 0, 2048 * PAGE)
    finally:
        pm.stop()
    # Stopped while paused: the thread ends, having mapped nothing.
    second = _written_segment(2048)
    pm = _pages.Premapper(lambda seg, reads: [second[2]] if seg == 0 else None)
    try:
        waits = _pages.counters["premap_waits"]
        pm.pause()
        pm.offer([0])
        wait_until(lambda: _pages.counters["premap_waits"] > waits, what="the premapper waiting")
        thread = pm._thread
        pm.stop()
        thread.join(10)
        assert not thread.is_alive()
        assert bytes(_pages._seen(second[2])) == bytes(2048)
    finally:
        for f, dm, cm in ((fd, daemon, client), second):
            dm.close()
            cm.close()
            os.close(f)


@linux_only
def test_a_put_and_a_fetch_pause_the_premapper_while_they_copy(daemon_factory, monkeypatch):
    """The client's calls hold their link's premapper while they copy into
    granted slots and out of leased ones (real daemon, a spy on the copies)."""
    from kvd_client import _chunking, _core

    seen = {"put": [], "get": []}
    link_of = {}
    real_copy, real_join = _chunking.copy_hashed, _chunking.join

    def copy_hashed(dst, t):
        seen["put"].append(link_of["link"].premap._busy)
        return real_copy(dst, t)

    def join(*a, **kw):
        seen["get"].append(link_of["link"].premap._busy)
        return real_join(*a, **kw)

    monkeypatch.setattr(_core._chunking, "copy_hashed", copy_hashed)
    monkeypatch.setattr(_core._chunking, "join", join)
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")
    toks = np.arange(1024)
    with d.client("paused", strict=True, transport="shm") as c:
        assert c.limits()
        link_of["link"] = c._shm_link
        assert c.put(toks, prefix_snapshot(toks))
        assert c.counters["shm_puts"] == 1 and seen["put"] and set(seen["put"]) == {1}
        assert link_of["link"].premap._busy == 0  # resumed once the copy was done
        assert_prefix_hit(c.get(toks), toks)
        assert c.counters["shm_gets"] >= 1 and seen["get"] == [1]
        assert link_of["link"].premap._busy == 0


@linux_only
def test_a_segment_offered_for_writes_then_for_reads_is_mapped_again_with_its_read_only_mapping():
    """A segment a SLOTS reply listed (writable mapping only), then a HELLO of
    the same run (`reads`): the premapper takes it again, for its read-only
    mapping; each offer of the same kind after that is nothing new."""
    fd, daemon, client = _written_segment(1024)
    asked = []

    def segment(seg, reads):
        asked.append((seg, reads))
        return [client]

    pm = _pages.Premapper(segment)
    try:
        done = _pages.counters["premapped_segments"]
        pm.offer([0])
        wait_until(lambda: _pages.counters["premapped_segments"] > done, what="premapped for writes")
        pm.offer([0], reads=True)
        wait_until(lambda: len(asked) == 2, what="offered again for reads")
        pm.offer([0], reads=True)
        pm.offer([0])
        pm.offer([1], reads=True)
        wait_until(lambda: len(asked) == 3, what="the next segment")
        assert asked == [(0, False), (0, True), (1, True)]
    finally:
        pm.stop()
        daemon.close()
        client.close()
        os.close(fd)
