"""The SSD tier and RAM-over-SSD at the store level: real LMDB, real files."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

from kvd.store.ssd.spill import Pace
from kvd.store.ssd import SsdStore
from kvd.store.tiered import open_store
from kvd.store.ssd import blobfile
from kvd.store.base import BOUNDARY, PutOutcome
from kvd.store.datadir import DataDirBusy, blob_path
from kvd.store.ssd.index import IncompatibleIndex
from kvd.store.ram import RamStore

from support import ALL_DTYPES, FakeClock, assert_same, charged, make_entry

# Each blob its own file: these tests look at the files (tests/store/test_pack.py: the pack).
FAST = dict(min_free_bytes=0, retry_s=0.2, touch_flush_s=0.05, pack_max_bytes=0)


@pytest.fixture
def stores():
    opened = []

    def make(ram_bytes, path, ssd_bytes=64 << 20, **kw):
        s = open_store(ram_bytes, path, ssd_bytes=ssd_bytes, **{**FAST, **kw})
        opened.append(s)
        return s

    yield make
    for s in opened:
        try:
            s.close(persist=False)
        except Exception:
            pass


def _block_writer(ssd):
    """Park the writer thread inside a job until the returned Event is set."""
    gate, parked = threading.Event(), threading.Event()
    ssd.writer.submit(lambda: (parked.set(), gate.wait(10)))
    assert parked.wait(5)
    return gate


def _disk_blobs(root):
    return [p for p in (root / "blobs").rglob("*.safetensors")]


def test_spill_and_restore_every_dtype_bit_exact(tmp_path, stores):
    # Entry 0 leaves out float64, which mlx's safetensors loader refuses.
    no_f64 = [d for d in ALL_DTYPES if d != "float64"]
    entries = [make_entry(i, dtype_list=ALL_DTYPES if i else no_f64, tokens=4, width=16) for i in range(30)]
    store = stores(5 * charged(entries[1]), tmp_path)
    for e in entries:
        assert store.put(e) is PutOutcome.STORED
    assert store.flush(10)
    st = store.stats()["tiers"]
    # Written behind: every entry reached disk, those still in RAM too.
    assert st["ram"]["entries"] == 5 and st["ssd"]["spills"] == 30 and st["ssd"]["drops"] == 0
    for e in entries:
        assert store.contains(e.id)
        assert_same(store.get(e.id), e)
    assert store.stats()["store"]["promotions"] > 0

    # A spilled blob is a real safetensors file: mx.load sees BF16 as BF16.
    path = blob_path(tmp_path, entries[0].id)
    loaded = mx.load(str(path))
    bf = next(t for t in entries[0].tensors if t.dtype == "bfloat16")
    assert loaded[bf.name].dtype == mx.bfloat16
    assert np.array(loaded[bf.name].view(mx.uint16)).tobytes() == bytes(bf.data)


def test_restart_warm_serves_every_entry(tmp_path, stores):
    entries = [make_entry(i, dtype_list=["bfloat16", "float32"]) for i in range(40)]
    boundary = make_entry(39, kind=BOUNDARY, dtype_list=["float32"])
    store = stores(5 * charged(entries[0]), tmp_path)
    for e in entries + [boundary]:
        store.put(e)
    store.close()  # persist=True: RAM is written down too
    store = stores(5 * charged(entries[0]), tmp_path)
    assert store.stats()["tiers"]["ssd"]["entries"] == 41
    for e in entries + [boundary]:
        assert store.contains(e.id)
        assert_same(store.get(e.id), e)
    assert store.ssd.counters["checksum_failures"] == 0
    assert store.ssd.reconciled.wait(10)
    assert store.ssd.counters["orphans_removed"] == store.ssd.counters["temps_removed"] == 0


def test_put_many_refreshes_what_the_disk_holds_and_keeps_what_is_new(tmp_path, stores):
    """A PUT's step of chunks asks the index about them in one read
    transaction: those with a row (or queued) are refreshed there, never
    copied into RAM again; the new ones go to RAM; the outcomes are those of
    `put` one at a time, in order."""
    entries = [make_entry(i) for i in range(12)]
    store = stores(3 * charged(entries[0]), tmp_path)
    for e in entries[:8]:
        store.put(e)
    assert store.flush(10)  # 0..4 evicted to the disk, 5..7 in RAM and on the disk too (written back)
    on_disk = [e for e in entries[:8] if not store.ram.contains(e.id)]
    assert len(on_disk) == 5 and all(store.ssd.has_row(e.id) for e in on_disk)
    dup_before = store.ssd.counters["duplicates"]
    outcomes = store.put_many(entries)
    assert outcomes[:8] == [PutOutcome.DUPLICATE] * 8
    assert outcomes[8:] == [PutOutcome.STORED] * 4
    assert store.ssd.counters["duplicates"] == dup_before + 5  # refreshed on the disk, not into RAM
    assert not any(store.ram.contains(e.id) for e in on_disk)
    for e in entries:
        assert_same(store.get(e.id), e)


def test_queued_entries_are_served_before_they_reach_disk(tmp_path, stores):
    entries = [make_entry(i) for i in range(10)]
    store = stores(charged(entries[0]), tmp_path)
    gate = _block_writer(store.ssd)
    for e in entries:
        store.put(e)
    assert len(store.ssd.queue) == 10 and not _disk_blobs(tmp_path)  # written behind: all queued
    for e in entries[:9]:
        assert store.ssd.contains(e.id)
        assert_same(store.ssd.get(e.id), e)
    assert store.ssd.counters["queue_hits"] == 9
    gate.set()
    assert store.flush(10)
    assert len(_disk_blobs(tmp_path)) == 10 and len(store.ssd.queue) == 0
    for e in entries[:9]:
        assert_same(store.ssd.get(e.id), e)


def test_a_full_queue_moves_evicted_backlog_into_it_without_waiting_or_dropping(tmp_path, stores):
    """Write-back with the writer stuck: what the queue cannot take waits in
    `behind`; RAM letting those entries go moves them into the queue at once
    (the daemon's thread never waits for the disk), nothing is dropped, the
    backlog says it is full, and the queue counts what RAM no longer holds."""
    entries = [make_entry(i) for i in range(8)]
    n = entries[0].nbytes
    store = stores(charged(entries[0]), tmp_path, queue_bytes=2 * n, dirty_max_bytes=2 * n)
    gate = _block_writer(store.ssd)
    assert store.refuse_put() is None
    for e in entries:
        store.put(e)  # the writer never makes room: a wait for it would never end
    ssd = store.ssd.stats()["tiers"]["ssd"]
    assert ssd["drops"] == 0
    # RAM holds one entry: 0..6 were let go; 0 and 1 were queued when stored,
    # 2..6 waited in `behind` and were moved into the queue past its bound.
    assert list(store.behind) == [entries[7].id] and len(store.ssd.queue) == 7
    assert store.ssd.queue.outside_bytes == 7 * n
    assert store.dirty() == (8, 8 * n)
    assert "not on disk yet" in store.refuse_put()
    assert store.counters["backlog_refusals"] == 1
    gate.set()
    assert store.flush(10)
    assert store.dirty() == (0, 0) and store.ssd.queue.outside_bytes == 0
    assert store.refuse_put() is None
    for e in entries:
        assert_same(store.get(e.id), e)


def test_the_entry_bound_decides_what_waits_in_ram_and_evictions_still_enter(tmp_path, stores):
    entries = [make_entry(i) for i in range(6)]
    store = stores(charged(entries[0]), tmp_path, queue_entries=2)
    gate = _block_writer(store.ssd)
    store.put(entries[0])
    store.put(entries[1])
    store.put(entries[2])  # the queue holds two: the third waits in RAM
    assert len(store.ssd.queue) == 2 and list(store.behind) == [entries[2].id]
    for e in entries[3:]:
        store.put(e)
    assert store.ssd.drop_reasons == {} and len(store.ssd.queue) == 5
    assert list(store.behind) == [entries[5].id]
    gate.set()
    assert store.flush(10)
    for e in entries:
        assert_same(store.get(e.id), e)


def test_budget_counts_blocks_on_disk_and_evicts_lru(tmp_path, stores):
    entries = [make_entry(i) for i in range(30)]
    blob = blobfile.estimate_disk_bytes(entries[0])
    store = stores(charged(entries[0]), tmp_path, ssd_bytes=10 * blob)
    for e in entries[:10]:
        store.put(e)
    assert store.flush(10)  # entries 0..9 on SSD (written behind), 9 in RAM too
    store.get(entries[0].id)  # a disk hit: entries[0] becomes the youngest on SSD
    for e in entries[10:15]:
        store.put(e)  # 5 more writes: 5 must be evicted, oldest first
    assert store.flush(10)
    ssd = store.ssd
    on_disk = sum(p.stat().st_blocks * 512 for p in _disk_blobs(tmp_path))
    assert ssd.bytes == on_disk <= ssd.budget_bytes
    assert ssd.counters["evictions"] == 5
    assert ssd.contains(entries[0].id), "recently read entry was evicted before older ones"
    assert [ssd.contains(e.id) for e in entries[1:7]] == [False] * 5 + [True]
    assert ssd.entries == len(_disk_blobs(tmp_path))


def test_lookup_lease_keeps_entry_until_get(tmp_path, stores):
    entries = [make_entry(i) for i in range(40)]
    store = stores(charged(entries[0]), tmp_path, ssd_bytes=6 * blobfile.estimate_disk_bytes(entries[0]))
    for e in entries[:5]:
        store.put(e)
    assert store.flush(10)
    assert store.contains(entries[0].id)  # LOOKUP
    for e in entries[5:]:  # heavy traffic between LOOKUP and GET
        store.put(e)
    assert store.flush(10)
    assert store.ssd.counters["evictions"] > 25 and store.ssd.counters["drops"] == 0
    assert_same(store.get(entries[0].id), entries[0])  # the GET that follows


def test_lease_many_leases_all_but_the_victims_being_evicted(tmp_path):
    """A LOOKUP leases every id it reports; one whose row is being deleted this
    instant is reported absent and gets no lease (both of lease_many's paths)."""
    clock = FakeClock()
    ssd = SsdStore(tmp_path / "d", 1 << 20, min_free_bytes=0, background=False, clock=clock)
    try:
        ids = [bytes([i]) * 33 for i in range(4)]
        assert ssd.lease_many(ids[:2]) == [True, True]
        assert ssd.leased(ids[0]) and ssd.leased(ids[1]) and not ssd.leased(ids[2])
        ssd._evicting.add(ids[3])  # as the writer's eviction marks its victims
        assert ssd.lease_many(ids) == [True, True, True, False]
        assert ssd.leased(ids[2]) and not ssd.leased(ids[3])
        clock.advance(ssd.lease_s + 1)
        assert not any(ssd.leased(e) for e in ids)
    finally:
        ssd.close()


@pytest.mark.parametrize("lookup", ["contains", "held"])
def test_a_lookups_yes_is_served_while_writer_evicts(tmp_path, stores, lookup):
    """Reads race spills and evictions: every yes from `contains`, or from
    `held` (the batch a LOOKUP asks: look, then lease what was found), is
    then served -- or, on a machine so loaded that the writer held the unlink
    lock past a GET's 50 ms, is a miss counted `busy_misses` (reads.py: a GET
    misses rather than waits for the disk's writer), never an uncounted one."""
    entries = [make_entry(i, tokens=4) for i in range(300)]
    # Leases are short here (long leases on so many lookups would pin the
    # whole tiny tier), so time is the test's: one put = 1 ms, and a lease
    # of 5 ms outlives the GET that follows its LOOKUP however slow the
    # machine is. (The daemon's leases are 30 s of wall time.)
    now = [1_000_000.0]
    store = stores(
        charged(entries[0]) * 2, tmp_path, ssd_bytes=20 * 4096, durable=False, lease_s=0.005, clock=lambda: now[0]
    )
    ask = (lambda ids: [store.contains(e) for e in ids]) if lookup == "contains" else store.held
    rng = np.random.default_rng(0)
    served = 0
    for i, e in enumerate(entries):
        now[0] += 0.001
        store.put(e)
        if i % 8 == 7:
            # Let the writer catch up now and then (however loaded the machine),
            # so reads hit the disk while the next puts make it evict.
            assert store.flush(10)
        asked = [entries[j] for j in rng.integers(max(0, i - 24), i + 1, size=6)]
        for a, yes in zip(asked, ask([a.id for a in asked])):
            if yes:
                busy = store.ssd.counters["busy_misses"]
                got = store.get(a.id)
                if got is None:
                    seen = {k: v for k, v in store.ssd.counters.items() if v}
                    assert store.ssd.counters["busy_misses"] == busy + 1, (seen, dict(store.ssd.drop_reasons))
                    continue
                assert_same(got, a)
                served += 1
    assert store.flush(10)
    c = store.ssd.counters
    assert served > 1000 and c["evictions"] > 200
    assert c["hits"] - c["queue_hits"] > 100, "reads never raced the evicting writer on disk"


def test_lease_found_leases_the_yes_answers_unless_an_eviction_began_or_ended(tmp_path):
    """A batch LOOKUP looks, then leases what it found (a no leased would pin
    the row its PUT writes next): safe only if no eviction began or ended in
    between; one in progress throughout still answers no for its victims."""
    clock = FakeClock()
    ssd = SsdStore(tmp_path / "d", 1 << 20, min_free_bytes=0, background=False, clock=clock)
    try:
        ids = [bytes([i]) * 33 for i in range(4)]
        since = ssd.eviction_events
        found = [True, False, True, True]
        ssd._evicting.add(ids[3])  # being deleted this instant (marked before the look)
        assert ssd.lease_found(ids, found, since)
        assert found == [True, False, True, False]
        assert [ssd.leased(e) for e in ids] == [True, False, True, False]
        ssd._evicting.clear()
        ssd.write_batch([make_entry(0)])
        since = ssd.eviction_events
        ssd.evict_rows([make_entry(0).id], "budget")  # begins (and ends) between the look and the lease
        found = [True, True, True, True]
        assert not ssd.lease_found(ids, found, since)
        assert found == [True] * 4 and not ssd.leased(ids[1])
        # Begun before the look (its victim's row still seen), ended before the lease:
        # the row is gone, and nothing in `_evicting` says so any more.
        with ssd._mu:
            ssd._mark_evicting([ids[1]])
        since = ssd.eviction_events
        found = [False, True, False, False]
        ssd._unmark_evicting([ids[1]])
        assert not ssd.lease_found(ids, found, since)
        assert not ssd.leased(ids[1])
    finally:
        ssd.close()


def test_pace_is_the_writers_last_seconds():
    pace = Pace(window_s=2.0, min_s=0.05)
    assert pace.seconds_for(100, 1 << 20) is None  # nothing seen: no estimate
    pace.observe(64, 64 << 10, 0.01)
    assert pace.seconds_for(100, 1 << 20) is None  # too little to tell
    for _ in range(4):
        pace.observe(100, 100 << 10, 1.0)  # 100 chunks of 1 KiB a second
    assert pace.seconds_for(300, 300 << 10) == pytest.approx(3.0)
    assert pace.seconds_for(10, 100 << 20) == pytest.approx(1024.0)  # few chunks, many bytes: the bytes say
    for _ in range(4):
        pace.observe(1000, 1000 << 10, 1.0)  # faster now: the old seconds leave the window
    assert pace.seconds_for(3000, 3000 << 10) == pytest.approx(3.0, rel=0.01)


def test_write_back_backlog_is_bounded_by_time_at_the_pace_a_stop_counts_on(tmp_path, stores):
    """`dirty_max_mb` of small chunks can be minutes of writing; a stop has
    `stop_timeout`. A write-back PUT that would make the backlog take a stop
    longer than `stop_write_s` is refused (the daemon answers BUSY): at
    FLOOR_PACE until the writer has measured itself, then at a third of its
    recent pace when that is faster."""
    from kvd.store.ssd.spill import FLOOR_PACE

    store = stores(64 << 20, tmp_path, background=False, stop_write_s=2.0)  # no writer: the backlog stays
    nbytes = make_entry(0).nbytes
    assert store.refuse_put(1 << 40, 10**6) is None  # into an empty backlog: whatever its size
    floor = int(2.0 * FLOOR_PACE[0])  # chunks a stop writes in 2 s at the floor
    for i in range(floor):
        store.put(make_entry(i))
    assert store.dirty() == (floor, floor * nbytes)
    assert store.refuse_put() is None  # what is held fits
    why = store.refuse_put(nbytes, 1)  # one chunk more would not
    assert why is not None and f"{floor + 1} chunks" in why and "about 2.0 s" in why, why
    assert store.counters["backlog_refusals"] == 1
    store.ssd.writer.pace.observe(1000, 1000 * nbytes, 1.0)  # a fast writer: a stop counts on 333/s
    assert store.refuse_put(60 * nbytes, 60) is None
    assert store.refuse_put(500 * nbytes, 500) is not None  # 700 chunks: 2.1 s at 333/s
    for _ in range(4):
        store.ssd.writer.pace.observe(10, 10 * nbytes, 1.0)  # slower than the floor: the floor holds
    assert store.refuse_put(nbytes, 1) is not None and store.refuse_put() is None
    # Write-through bounds its waiting PUTs otherwise (dirty_max_mb), never by this.
    wt = stores(64 << 20, tmp_path / "wt", background=False, stop_write_s=0.001, write_through=True)
    wt.ssd.writer.pace.observe(1, nbytes, 1.0)
    wt.put(make_entry(0))
    assert wt.refuse_put(1 << 30, 1) is None


def test_write_back_backlog_bytes_are_bounded_by_ram_or_dirty_max_mb(tmp_path, stores):
    """By bytes: "auto" (None) is the RAM tier's budget, at least 256 MiB; a
    number is that. A PUT is refused once the backlog committed is at it
    (the last one admitted may pass it). Shared-memory grants not yet
    committed count in time (they are the stop's to write), not in bytes
    (the arena's)."""
    import dataclasses

    from kvd.store.base import Tensor
    from kvd.store.tiered import AUTO_DIRTY_MIN

    one = make_entry(0)
    assert stores(3 << 30, tmp_path / "big", background=False).dirty_max() == 3 << 30
    auto = stores(4 * one.nbytes, tmp_path / "auto", ssd_bytes=1 << 30, background=False)
    assert auto.dirty_max() == AUTO_DIRTY_MIN
    auto.put(one)
    assert auto.refuse_put(10 * one.nbytes, 1) is None  # under the cap: admitted, whatever its size
    zeros = np.zeros(AUTO_DIRTY_MIN, np.uint8)  # pages never touched: no memory taken
    auto.put(dataclasses.replace(make_entry(1), tensors=(Tensor("k", "uint8", (zeros.size,), zeros),), nbytes=0))
    why = auto.refuse_put(one.nbytes, 1)
    assert why is not None and "dirty_max_mb is auto" in why, why
    fixed = stores(64 * one.nbytes, tmp_path / "fixed", background=False, dirty_max_bytes=2 * one.nbytes)
    fixed.put(one)
    assert fixed.refuse_put(one.nbytes, 1, granted=1 << 20) is None
    fixed.put(make_entry(1))
    why = fixed.refuse_put(one.nbytes, 1)
    assert why is not None and "dirty_max_mb is 0" in why, why  # (0 MiB: a few KiB here)
    timed = stores(64 * one.nbytes, tmp_path / "timed", background=False, stop_write_s=1.0)
    timed.put(one)
    assert timed.refuse_put(one.nbytes, 1, granted=1 << 30) is not None  # a GiB on its way: 4 s at the floor


def test_tails_from_every_tier_and_after_restart(tmp_path, stores):
    parent = make_entry(0).key
    tails = [make_entry(100 + n, tokens=n, tail=True, parent=parent) for n in (3, 5, 7)]
    store = stores(charged(tails[0]) + 16, tmp_path)
    for t in tails:
        store.put(t)
    want = sorted(((t.length, t.key) for t in tails), reverse=True)
    assert list(store.tails(parent)) == want
    assert store.flush(10)
    assert list(store.tails(parent)) == want
    store.close()
    store = stores(1 << 20, tmp_path)
    assert list(store.tails(parent)) == want
    store.drop(namespace="ns")
    assert list(store.tails(parent)) == []


def test_drop_and_evict_with_dry_run(tmp_path, stores):
    a = [make_entry(i, "a") for i in range(6)]
    b = [make_entry(i, "b") for i in range(6)]
    clock = FakeClock()
    store = stores(1, tmp_path, clock=clock)  # RAM holds nothing: every entry is on SSD
    for e in a + b:
        store.put(e)
    assert store.flush(10)
    ns = store.stats()["namespaces"]
    assert ns["a"]["ssd_entries"] == ns["b"]["ssd_entries"] == 6
    n, nbytes = store.drop(namespace="a", dry_run=True)
    assert n == 6 and nbytes > 0 and store.contains(a[0].id)
    assert store.drop(namespace="a") == (n, nbytes)
    assert not any(store.contains(e.id) for e in a) and all(store.contains(e.id) for e in b)
    assert "a" not in store.stats()["namespaces"]
    assert store.drop(older_than=3600) == (0, 0)
    clock.advance(0.05)
    assert store.drop(older_than=0.01, dry_run=True)[0] == 6
    before = store.ssd.bytes
    n, freed = store.evict(before // 2, dry_run=True)
    assert store.ssd.bytes == before
    assert store.evict(before // 2) == (n, freed) and store.ssd.bytes <= before // 2


def test_write_through_and_entries_too_big_for_ram(tmp_path, stores):
    entries = [make_entry(i) for i in range(4)]
    big = make_entry(99, width=1024)
    store = stores(charged(big) - 1, tmp_path, write_through=True)
    for e in entries:
        assert store.put(e) is PutOutcome.STORED
    assert store.put(big) is PutOutcome.STORED  # straight to SSD
    assert store.flush(10)
    assert store.ssd.entries == 5 and store.ram.stats()["tiers"]["ram"]["entries"] == 4
    assert_same(store.get(big.id), big)
    assert store.stats()["store"]["promotions_skipped"] == 1
    # Evicting a written-through entry from RAM writes nothing more.
    store.evict(0, tier="ram")
    assert store.ssd.counters["spills_clean"] == 4 and store.ssd.counters["spills"] == 5


def test_index_map_grows_on_map_full(tmp_path, stores):
    entries = [make_entry(i, tokens=1, width=1) for i in range(400)]
    store = stores(1, tmp_path, map_size=64 << 10, durable=False)
    for e in entries:
        store.put(e)
    assert store.flush(30)
    assert store.ssd.index.map_size > 64 << 10
    assert store.ssd.entries == 400
    for e in entries[::37]:
        assert_same(store.get(e.id), e)


def test_lock_perms_and_format_version(tmp_path, stores):
    store = stores(1, tmp_path)
    store.put(make_entry(1))
    assert store.flush(10)
    with pytest.raises(DataDirBusy):
        SsdStore(tmp_path, 1 << 20)
    for p in [tmp_path, *tmp_path.rglob("*")]:
        assert p.stat().st_mode & 0o777 == (0o700 if p.is_dir() else 0o600), p
    store.close()
    import lmdb

    env = lmdb.open(str(tmp_path / "index"), max_dbs=8)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        txn.put(b"format", b"99")
    env.close()
    with pytest.raises(IncompatibleIndex):
        SsdStore(tmp_path, 1 << 20)
    with pytest.raises(IncompatibleIndex):  # not DataDirBusy: the failed open let go of the lock
        SsdStore(tmp_path, 1 << 20)


READER = r"""
import sys, time
from kvd.store.ssd import offline
seen = {offline.stats(sys.argv[1])["entries"]}
print("ready", flush=True)
deadline = time.time() + 20
while time.time() < deadline:
    s = offline.stats(sys.argv[1])
    seen.add(s["entries"])
    if s["entries"] >= int(sys.argv[2]):
        break
    time.sleep(0.01)
print(len(seen), s["entries"], s["locked_by"], flush=True)
"""


def test_readonly_stats_from_another_process_while_writing(tmp_path, stores):
    store = stores(1, tmp_path, durable=False)
    store.put(make_entry(0))
    assert store.flush(10)
    n = 200
    proc = subprocess.Popen(
        [sys.executable, "-c", READER, str(tmp_path), str(n)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert proc.stdout.readline().strip() == "ready"
    for i in range(1, n):
        store.put(make_entry(i, tokens=2))
        if i % 20 == 0:
            time.sleep(0.02)
    assert store.flush(10)
    out, _ = proc.communicate(timeout=30)
    distinct, final, holder = out.split()
    assert proc.returncode == 0 and int(final) == n
    assert int(distinct) > 1  # it watched the count grow while the daemon wrote
    assert int(holder) == os.getpid()


def test_ram_only_when_no_data_dir():
    store = open_store(1 << 20)
    assert isinstance(store, RamStore)
    with pytest.raises(ValueError):
        open_store(1 << 20, "/tmp/x", ssd_bytes=0)


def test_held_answers_chunk_and_boundary_pairs_as_contains_does(tmp_path):
    # held() answers a chunk and its boundary with one cursor descent (they sort
    # next to each other); every mix of present, missing, queued and bad ids
    # must get the answer contains() gives, in any order.
    import random

    from kvd.store.base import CHUNK

    rng = random.Random(7)
    store = SsdStore(tmp_path / "d", budget_bytes=1 << 30, durable=False, reconcile=False, background=False)
    try:
        made = {(i, kind): make_entry(i, tokens=1, width=1, kind=kind) for i in range(300) for kind in (CHUNK, BOUNDARY)}
        stored = [e for e in made.values() if rng.random() < 0.6]
        store.write_batch(stored)
        for e in rng.sample(stored, 20):
            store._bad[e.id] = "a test's bad blob"  # hidden, as after a failed checksum
        for e in rng.sample(list(made.values()), 20):
            store.queue.offer(e, force=True)
        for trial in range(100):
            picked = rng.sample(range(300), 64)
            eids = [made[i, CHUNK].id for i in picked] + [made[i, BOUNDARY].id for i in picked]
            if trial % 2:
                rng.shuffle(eids)
            assert store.held(eids) == [store.contains(e) for e in eids]
    finally:
        store.close()


def test_a_batch_the_writer_fails_is_taken_again_then_given_up_counted_never_forgotten_unsaid():
    """The writer's own rule: an unexpected error in a batch (a bug, or no
    thread to start) puts it back; after RETRIES in a row it is given up,
    counted and reported not durable -- never dropped without a word.
    (A sink that fails on demand: such a bug cannot be made for real.)"""
    from kvd.store.ssd.spill import RETRIES, SpillQueue, Writer

    class Sink:
        def __init__(self, fail: int):
            self.fail, self.written, self.news = fail, [], []

        def write_batch(self, batch):
            if self.fail:
                self.fail -= 1
                raise RuntimeError("can't start new thread")
            self.written += [e.id for e in batch]

        def settled(self, batch):
            self.news.append([e.id for e in batch])

        def idle(self, busy):
            return False

    for fail, written in ((RETRIES - 1, True), (RETRIES, False)):
        queue, sink = SpillQueue(1 << 30), Sink(fail)
        writer = Writer(queue, sink, tick=0.001)
        e = make_entry(1)
        assert queue.offer(e)
        writer.start()
        try:
            assert writer.flush(10)
        finally:
            writer.stop(10)
        assert sink.news == [[e.id]] and len(queue) == 0  # settled once, either way
        assert (sink.written == [e.id]) is written and writer.abandoned == (0 if written else 1)


def _clocked_tier(tmp_path, n: int, blobs: int) -> tuple[FakeClock, list, SsdStore]:
    """A tier of `blobs` blobs' room on an injected clock, hits flushed only
    when a test says, and `n` entries to fill it with."""
    clock = FakeClock()
    entries = [make_entry(i) for i in range(n)]
    blob = blobfile.estimate_disk_bytes(entries[0])
    ssd = SsdStore(tmp_path / "d", blobs * blob, min_free_bytes=0, background=False, clock=clock,
                   touch_flush_s=3600, pack_max_bytes=0, reconcile=False)
    return clock, entries, ssd


def _lru_order(ssd: SsdStore, entries: list) -> list[int]:
    """Entry numbers, least recently used first."""
    with ssd.index.reading() as txn:
        return [next(i for i, e in enumerate(entries) if e.id == eid) for _, eid in ssd.index.oldest(txn)]


def test_disk_hits_ride_in_the_next_batch_commit_and_never_make_a_read_entry_the_victim(tmp_path):
    """A hit on disk is moved in the recency order by the next batch's own
    index commit (one commit for both, no wait for `touch_flush_s`); a batch
    that may evict moves the hits first, so an entry just read is not the
    victim; hits no commit carried (the batch dropped whole) are kept for
    the next flush."""
    clock, entries, ssd = _clocked_tier(tmp_path, 9, 6)

    def order():
        """As _lru_order, 5 and 6 (written together) as one."""
        return [56 if i in (5, 6) else i for i in _lru_order(ssd, entries)]

    def commits():
        return ssd.index.env.info()["last_txnid"]

    try:
        for e in entries[:4]:
            clock.advance(1)
            ssd.write_batch([e])
        clock.advance(1)
        assert_same(ssd.get(entries[0].id), entries[0])  # a disk hit
        clock.advance(1)
        before = commits()
        ssd.write_batch([entries[4]])
        assert commits() == before + 1, "the hit had a commit of its own"
        assert order() == [1, 2, 3, 0, 4]

        # A batch the tier drops whole (degraded) commits nothing: the hit waits for the next flush.
        clock.advance(1)
        assert_same(ssd.get(entries[3].id), entries[3])
        ssd._degrade("a test")
        ssd.write_batch([entries[7]])
        assert ssd.drop_reasons == {"degraded": 1} and order() == [1, 2, 3, 0, 4]
        clock.advance(ssd.retry_s + 3600)
        ssd.idle(busy=False)  # touch_flush_s passed: the hit goes in on its own
        assert order() == [1, 2, 0, 4, 3]

        # 5 of 6 blobs' room used: the next batch of two must evict one, the
        # oldest once the hit on entry 1 is counted.
        clock.advance(1)
        assert_same(ssd.get(entries[1].id), entries[1])
        clock.advance(1)
        ssd.write_batch(entries[5:7])
        assert ssd.counters["evictions"] == 1
        assert ssd.contains(entries[1].id), "an entry just read was evicted before older ones"
        assert order() == [0, 4, 3, 1, 56, 56]
    finally:
        ssd.close()


def test_a_use_moves_a_row_only_outside_the_tiers_youngest_quarter(tmp_path):
    """A disk hit, a clean spill or a duplicate PUT on a row used within the
    newest quarter of the tier's age (oldest row to now) leaves it where it
    is, counted `touches_skipped`: the writer does not rewrite rows nowhere
    near eviction (under mixed load at 1 M rows that was most of its time).
    A use of an older row moves it, and it outlives rows newer than it was."""
    clock, entries, ssd = _clocked_tier(tmp_path, 11, 10)

    def order():
        return _lru_order(ssd, entries)

    try:
        for e in entries[:10]:  # written at 1 .. 10 s
            clock.advance(1)
            ssd.write_batch([e])
        clock.advance(2)  # now 12 s: the oldest row's last use 1 s, so rows used after 9.25 s are young
        assert_same(ssd.get(entries[9].id), entries[9])  # young (10 s): not moved
        assert ssd.spill(entries[8])  # 9 s, just older than that: moved
        clock.advance(0.1)
        assert ssd.put(entries[2]) is PutOutcome.DUPLICATE  # old: moved
        clock.advance(0.1)
        assert_same(ssd.get(entries[0].id), entries[0])  # old: moved
        assert ssd.counters["touches_skipped"] == 1
        assert ssd.counters["spills_clean"] == 1 and ssd.counters["duplicates"] == 1
        clock.advance(1)
        ssd.idle(busy=False)  # the floor and the flush: only the old rows' uses are recorded
        ssd._flush_touches()
        assert order() == [1, 3, 4, 5, 6, 7, 9, 8, 2, 0]
        # A use of a young row is not lost for good: once older than the
        # newest quarter, the next use moves it.
        clock.advance(100)
        assert_same(ssd.get(entries[9].id), entries[9])
        ssd._flush_touches()
        assert order()[-1] == 9
        # The tier full, the next entry evicts the oldest (1), never a row used.
        clock.advance(1)
        ssd.write_batch([entries[10]])
        assert [ssd.has_row(e.id) for e in entries] == [True, False] + [True] * 9
    finally:
        ssd.close()


def test_a_full_tier_makes_room_for_a_whole_batch_in_one_commit(tmp_path):
    """A batch written into a full tier evicts what all of it needs in one
    index commit and one pack commit, oldest first (it was one of each per
    entry: a full tier's writer fell to ~130 chunks/s); a hit on an entry
    that is not a victim rides in the batch's commit."""
    clock = FakeClock()
    entries = [make_entry(i) for i in range(10)]
    blob = blobfile.estimate_disk_bytes(entries[0])
    ssd = SsdStore(tmp_path / "d", 6 * blob, min_free_bytes=0, background=False, clock=clock, reconcile=False)
    try:
        assert blob <= ssd.pack_max_bytes  # packed: the pack has commits of its own
        for e in entries[:6]:
            clock.advance(1)
            ssd.write_batch([e])
        clock.advance(1)
        assert_same(ssd.get(entries[5].id), entries[5])  # a hit, not on a victim: it rides in the batch's commit
        index, pack = ssd.index.env.info()["last_txnid"], ssd.pack.env.info()["last_txnid"]
        clock.advance(1)
        ssd.write_batch(entries[6:])
        assert ssd.counters["evictions"] == 4
        assert [ssd.contains(e.id) for e in entries] == [False] * 4 + [True] * 6
        assert ssd.index.env.info()["last_txnid"] - index == 2  # the victims' rows, then the batch's
        assert ssd.pack.env.info()["last_txnid"] - pack == 2  # the victims' blobs, then the batch's
        for e in entries[4:]:
            assert_same(ssd.get(e.id), e)
    finally:
        ssd.close()


def test_stats_in_steps_count_each_entry_once_as_one_snapshot_does(tmp_path, stores, monkeypatch):
    """A RAM tier of more entries than a step looks up (STATS_STEP, here 5):
    the stats come in steps (a STATS served in turns), and each namespace's
    entries and tokens are exact -- those on disk once, plus those only RAM
    holds -- and the same as one step's."""
    import kvd.store.tiered as tiered

    a = [make_entry(i, "a") for i in range(12)]
    b = [make_entry(i, "b", tokens=4, width=8) for i in range(7)]
    store = stores(1 << 30, tmp_path)
    for e in a:
        assert store.put(e) is PutOutcome.STORED
    assert store.flush(10)  # a: in RAM and on disk
    gate = _block_writer(store.ssd)
    try:
        for e in b:  # b: queued behind the parked writer, in RAM only
            assert store.put(e) is PutOutcome.STORED
        monkeypatch.setattr(tiered, "STATS_STEP", 5)
        steps, taken = store.stats_steps(), 1
        while True:
            try:
                next(steps)
                taken += 1
            except StopIteration as done:
                stats = done.value
                break
        assert taken == 4  # 19 RAM entries, 5 a step
        monkeypatch.setattr(tiered, "STATS_STEP", 1 << 20)
        assert store.stats()["namespaces"] == stats["namespaces"]
        ns = stats["namespaces"]
        assert (ns["a"]["entries"], ns["a"]["ram_entries"], ns["a"]["ssd_entries"], ns["a"]["tokens"]) == (12, 12, 12, 12 * 16)
        assert (ns["b"]["entries"], ns["b"]["ram_entries"], ns["b"].get("ssd_entries", 0), ns["b"]["tokens"]) == (7, 7, 0, 7 * 4)
        assert stats["store"]["dirty_entries"] == 7
        # Without the namespaces (the daemon's summary line): one step, no lookups.
        quick = store.stats_steps(namespaces=False)
        with pytest.raises(StopIteration) as done:
            next(quick)
        assert done.value.value["namespaces"] == {} and done.value.value["tiers"] == stats["tiers"]
    finally:
        gate.set()


def test_stats_steps_run_after_a_close_end_quietly(tmp_path, stores, monkeypatch, caplog):
    """A /metrics scrape runs its later steps with no lock held, and may while
    the daemon stops: the closed index is a miss to them (IndexBusy), never
    an lmdb.Error, an index error counted or an ERROR logged."""
    import kvd.store.tiered as tiered
    from kvd.store.base import finish

    monkeypatch.setattr(tiered, "STATS_STEP", 4)
    store = stores(1 << 30, tmp_path)
    for i in range(20):
        assert store.put(make_entry(i, "a")) is PutOutcome.STORED
    assert store.flush(10)
    steps = store.stats_steps()
    next(steps)  # the first step, under the daemon's lock
    store.close()
    stats = finish(steps)
    assert stats["tiers"]["ssd"]["index_errors"] == 0 and stats["tiers"]["ssd"]["index_map_size"] > 0
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
