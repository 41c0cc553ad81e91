"""The pack of small blobs (kvd/store/ssd/pack.py): small chunks live in one LMDB
file, not a file each, and keep every promise a blob file keeps: bit-exact
after a restart, a bad byte is a miss and a quarantine, orphans and lost
blobs reconciled, a damaged index rebuilt from the pack, a damaged pack
costing only its own entries."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import pytest

from kvd.store.ssd import blobfile
from kvd.store.ssd.check import check
from kvd.store.datadir import BLOB_DIR, INDEX_DIR, PACK_DIR, QUARANTINE_DIR
from kvd.store.ssd.index import Index
from kvd.store.ssd.pack import PACKED, Pack, eid_of, pack_key, slot_of
from kvd.store.ssd import SsdStore
from kvd_client import HostTensor, Snapshot
from support import (
    ALL_DTYPES, assert_prefix_hit, assert_same, filled_store, kvd, make_entry, prefix_snapshot, wait_until,
)

PACK = 64 << 10


def _files(root: Path) -> list[Path]:
    return list((root / BLOB_DIR).rglob("*.safetensors"))


def _fill(root: Path, n: int = 10, **kw) -> list:
    return filled_store(root, [make_entry(i, **kw) for i in range(n)], pack_max_bytes=PACK)


def _edit_pack(root: Path, fn) -> None:
    """Change the pack with the daemon's store closed (as damage from outside
    would): `fn(txn, db, key)`, where `key(eid)` is the key of that entry's
    blob (of one the pack does not hold: the next slot)."""
    pack = Pack(root / PACK_DIR)
    try:
        where = {eid_of(k): k for k in pack.iter_keys()}
        slots = itertools.count(max(map(slot_of, where.values()), default=0) + 1)

        def key(eid: bytes) -> bytes:
            if eid not in where:
                where[eid] = pack_key(eid, next(slots))
            return where[eid]

        pack.write(lambda txn: fn(txn, pack.slots, key))
    finally:
        pack.close()


def _served_but(store: SsdStore, entries: list, gone) -> None:
    """Every entry but `gone` served bit-exact, and the data dir consistent."""
    for e in entries:
        if e is not gone:
            assert_same(store.get(e.id), e)
    assert store.check().ok, store.check().summary()


def test_small_chunks_are_packed_and_come_back_bit_exact_after_a_restart(tmp_path):
    entries = [make_entry(i, dtype_list=ALL_DTYPES, tokens=4, width=16, tail=i == 5) for i in range(12)]
    big = make_entry(99, width=4096)  # 256 KiB of tensors: over pack_max_bytes, its own file
    filled_store(tmp_path, entries + [big], pack_max_bytes=PACK)
    assert [p.name.split(".")[0] for p in _files(tmp_path)] == [big.id.hex()]
    with SsdStore(tmp_path, 64 << 20, min_free_bytes=0, pack_max_bytes=PACK) as store:
        wait_until(store.reconciled.is_set, what="the start-up walk and reconcile")
        assert store.entries == 13 and len(store.pack) == 12
        with store.index.reading() as txn:
            assert {store.index.get(txn, e.id).state for e in entries} == {PACKED}
            assert store.index.get(txn, big.id).state == "ssd"
        for e in entries + [big]:
            assert_same(store.get(e.id), e)
        assert store.tails(entries[4].key) == [(entries[5].length, entries[5].key)]
        assert store.counters["orphans_removed"] == store.counters["rows_repaired"] == 0
        report = store.check()
        assert report.ok and report.checked == 13, report.summary()
        # Eviction deletes from the pack as it unlinks a file.
        n, _ = store.evict(0)
        assert n == 13 and store.entries == 0 and len(store.pack) == 0 and not _files(tmp_path)
    with SsdStore(tmp_path, 64 << 20, min_free_bytes=0) as store:
        assert store.entries == 0 and len(store.pack) == 0 and not _files(tmp_path)
        assert store.check().ok


def test_a_flipped_bit_in_a_packed_blob_is_a_miss_and_a_quarantine(tmp_path):
    entries = _fill(tmp_path)
    bad = entries[3]

    def flip(txn, db, key):
        raw = bytearray(txn.get(key(bad.id), db=db))
        raw[-5] ^= 0x01  # inside tensor data
        txn.put(key(bad.id), bytes(raw), db=db)

    _edit_pack(tmp_path, flip)
    with SsdStore(tmp_path, 64 << 20, min_free_bytes=0, reconcile=False) as store:
        assert store.contains(bad.id)  # the index cannot know before reading
        assert store.get(bad.id) is None  # a miss, not an exception
        store.writer.submit(lambda: None).result()  # the quarantine runs on the writer: a barrier
        assert store.counters["checksum_failures"] == 1 and store.counters["quarantined"] == 1
        assert not store.contains(bad.id) and store.entries == 9 and len(store.pack) == 9
        kept = list((tmp_path / QUARANTINE_DIR).iterdir())
        assert [p.name.split(".")[0] for p in kept] == [bad.id.hex()]
        assert len(kept[0].read_bytes()) > 8  # the bad bytes, kept for a post-mortem
        _served_but(store, entries, bad)


def test_reconcile_removes_packed_orphans_and_rows_whose_packed_blob_is_gone(tmp_path):
    entries = _fill(tmp_path, 6)
    orphan = make_entry(50)
    buf, _ = blobfile.encode_blob(orphan)
    _edit_pack(tmp_path, lambda txn, db, key: (txn.put(key(orphan.id), buf, db=db), txn.delete(key(entries[2].id), db=db)))
    with SsdStore(tmp_path, 64 << 20, min_free_bytes=0, pack_max_bytes=PACK, reconcile=False) as store:
        report = store.reconcile(dry_run=True)
        assert report["orphans_removed"] == 1 and report["rows_repaired"] == 1
        assert store.entries == 6 and len(store.pack) == 6  # a dry run
    with SsdStore(tmp_path, 64 << 20, min_free_bytes=0, pack_max_bytes=PACK) as store:
        wait_until(store.reconciled.is_set, what="the start-up reconcile")
        assert store.counters["orphans_removed"] == 1 and store.counters["rows_repaired"] == 1
        assert store.entries == 5 and len(store.pack) == 5 and not store.contains(orphan.id)
        _served_but(store, entries, entries[2])


def test_check_names_a_missing_a_corrupt_and_an_orphan_packed_blob(tmp_path):
    entries = _fill(tmp_path, 5)
    orphan = make_entry(60)
    buf, _ = blobfile.encode_blob(orphan)

    def spoil(txn, db, key):
        txn.delete(key(entries[0].id), db=db)
        raw = bytearray(txn.get(key(entries[1].id), db=db))
        raw[-1] ^= 0xFF
        txn.put(key(entries[1].id), bytes(raw), db=db)
        txn.put(key(orphan.id), buf, db=db)

    _edit_pack(tmp_path, spoil)
    index, pack = Index(tmp_path / INDEX_DIR), Pack(tmp_path / PACK_DIR)
    try:
        report = check(tmp_path, index, pack=pack, verify=True)
    finally:
        index.close()
        pack.close()
    reasons = dict(report.bad)
    assert reasons[entries[0].id] == "missing" and reasons[entries[1].id].startswith("corrupt")
    assert report.orphans == [orphan.id] and not report.ok


@pytest.mark.parametrize("how", ["truncate", "missing"])
def test_a_damaged_index_is_rebuilt_from_the_pack(tmp_path, how):
    entries = _fill(tmp_path, 12, tail=False)
    big = filled_store(tmp_path, [make_entry(98, width=4096)], pack_max_bytes=PACK)[0]
    data = tmp_path / INDEX_DIR / "data.mdb"
    if how == "truncate":
        os.truncate(data, data.stat().st_size // 2)
    else:
        import shutil

        shutil.rmtree(tmp_path / INDEX_DIR)
    with SsdStore(tmp_path, 64 << 20, min_free_bytes=0, background=False) as store:
        h = store.heal
        assert h is not None and h.done
        assert (h.recovered, h.quarantined, h.unverified) == (13, 0, 0), h.stats()
        for e in entries + [big]:
            assert_same(store.get(e.id), e)
        with store.index.reading() as txn:
            assert store.index.get(txn, entries[0].id).state == PACKED
        assert store.check().ok


def test_a_damaged_pack_is_moved_aside_and_costs_only_its_own_entries(tmp_path, caplog):
    entries = _fill(tmp_path, 6)
    big = filled_store(tmp_path, [make_entry(97, width=4096)], pack_max_bytes=PACK)[0]
    data = tmp_path / PACK_DIR / "data.mdb"
    os.truncate(data, 3 * 4096 + 100)  # LMDB would map past the end: SIGBUS, if it were let
    with SsdStore(tmp_path, 64 << 20, min_free_bytes=0, pack_max_bytes=PACK) as store:
        assert "pack of small blobs" in caplog.text and "damaged" in caplog.text
        assert len(list(tmp_path.glob("pack.bad-*"))) == 1
        wait_until(store.reconciled.is_set, what="reconcile")
        assert store.counters["rows_repaired"] == 6 and store.entries == 1
        for e in entries:
            assert store.get(e.id) is None
        assert_same(store.get(big.id), big)
        store.put(entries[0])  # the new pack takes writes
        assert store.flush(10)
        assert_same(store.get(entries[0].id), entries[0])
        assert store.check().ok



def test_packed_blobs_take_the_next_slots_in_write_order_and_one_written_twice_is_kept_once(tmp_path):
    # Appended at the pack's right edge (pack.py, "Slots"): its key order is
    # the order the blobs were written in, whatever their entry ids.
    first, second = [make_entry(i) for i in range(5)], [make_entry(i) for i in range(5, 12)]
    with SsdStore(tmp_path, 64 << 20, min_free_bytes=0, pack_max_bytes=PACK, reconcile=False,
                  background=False) as store:
        store.write_batch(first)
        store.write_batch(second)
        keys = list(store.pack.iter_keys())
        assert [eid_of(k) for k in keys] == [e.id for e in first + second]
        assert [slot_of(k) for k in keys] == list(range(1, 13))
        with store.index.reading() as txn:
            assert [store.index.get(txn, e.id).slot for e in first + second] == list(range(1, 13))
        # An entry stored already, in a batch with a new one: its second blob
        # (slot 13) is written before the index says it had one, then deleted.
        new = make_entry(12)
        store.write_batch([first[2], new])
        assert [slot_of(k) for k in store.pack.iter_keys()][-2:] == [12, 14] and len(store.pack) == 13
        with store.index.reading() as txn:
            assert store.index.get(txn, first[2].id).slot == 3 and store.index.get(txn, new.id).slot == 14
        _served_but(store, first + second + [new], None)


def _as_an_older_kvd_wrote_it(root: Path) -> None:
    """Rewrite the data dir at `root` as a kvd before slots wrote it: each
    packed blob in the `blobs` table keyed by its entry id, rows without `slot`."""
    import msgpack

    index, pack = Index(root / INDEX_DIR), Pack(root / PACK_DIR)
    try:
        with index.reading() as txn:
            rows = {eid: row for eid, row in index.iter_rows(txn) if row.state == PACKED}

        def move(txn):
            for eid, row in rows.items():
                key = pack_key(eid, row.slot)
                txn.put(eid, bytes(txn.get(key, db=pack.slots)), db=pack.blobs)
                txn.delete(key, db=pack.slots)

        def unslot(txn):
            for eid in rows:
                d = msgpack.unpackb(txn.get(eid, db=index.rows), raw=False)
                del d["slot"]
                txn.put(eid, msgpack.packb(d, use_bin_type=True), db=index.rows)

        pack.write(move)
        index.write(unslot)
    finally:
        index.close()
        pack.close()


def test_a_pack_an_older_kvd_wrote_is_served_reconciled_rebuilt_and_evicted(tmp_path):
    import shutil

    entries = _fill(tmp_path, 8)
    _as_an_older_kvd_wrote_it(tmp_path)
    stray, twice = make_entry(80), entries[1]
    pack = Pack(tmp_path / PACK_DIR)  # opened for writing: the clean mark goes
    try:
        assert len(pack) == 8 and not list(pack.iter_keys(old=False))
        # Two orphans: a blob no row names in the old table, and a second blob
        # of an entry whose row names its old one, in a slot.
        pack.write(lambda txn: txn.put(stray.id, blobfile.encode_blob(stray)[0], db=pack.blobs))
        pack.put_many([(twice.id, blobfile.encode_blob(twice)[0])])
    finally:
        pack.close()
    new = make_entry(81)
    with SsdStore(tmp_path, 64 << 20, min_free_bytes=0, pack_max_bytes=PACK) as store:
        wait_until(store.reconciled.is_set, what="the start-up reconcile")
        assert store.counters["orphans_removed"] == 2 and store.counters["rows_repaired"] == 0
        assert len(store.pack) == 8 and list(store.pack.iter_keys(old=False)) == []
        _served_but(store, entries, None)
        store.put(new)
        assert store.flush(10)
        with store.index.reading() as txn:
            assert store.index.get(txn, entries[0].id).slot == 0 and store.index.get(txn, new.id).slot >= 1
        assert_same(store.get(new.id), new)
    shutil.rmtree(tmp_path / INDEX_DIR)  # rebuilt from both tables
    with SsdStore(tmp_path, 64 << 20, min_free_bytes=0, pack_max_bytes=PACK, background=False) as store:
        assert store.heal is not None and store.heal.recovered == 9, store.heal.stats()
        _served_but(store, entries + [new], None)
        assert store.evict(0)[0] == 9 and len(store.pack) == 0


def test_the_daemon_packs_small_chunks_and_serves_them_after_a_restart(daemon_factory):
    d = daemon_factory("--ram-mb", "1")
    seqs = [np.arange(512) + 10_000 * i for i in range(12)]  # 96 chunks of 64 tokens, ~20 KiB each
    with d.client("packed", strict=True, chunk_tokens=64) as c:
        for s in seqs:
            assert c.put(s, prefix_snapshot(s))
        assert c.stats()["tiers"]["ssd"]["pack_max_bytes"] == 64 << 10
    assert d.stop() == 0
    d.start()
    with d.client("packed", strict=True, chunk_tokens=64) as c:
        c.gc(ram_bytes=0)
        for s in seqs:
            assert_prefix_hit(c.get(s), s)
        ssd = c.stats()["tiers"]["ssd"]
        assert ssd["entries"] == 96 and ssd["pack_file_bytes"] > 96 * 4096, ssd
    assert not _files(d.data_dir)
    r = kvd("verify", "--data-dir", str(d.data_dir), "--endpoint", d.endpoint)
    assert r.returncode == 0, r.stdout + r.stderr
    assert d.stop() == 0
    from kvd.store.ssd import offline

    st = offline.stats(d.data_dir)
    assert st["entries"] == 96 and st["pack"]["file_bytes"] == (d.data_dir / PACK_DIR / "data.mdb").stat().st_size > 96 * 4096


def test_a_clean_stop_spares_the_next_start_a_look_through_the_pack(tmp_path):
    """After a clean close no packed blob lacks a row, and the pack says so
    (`pack/clean`): the next start's reconcile reads the rows only. Without
    the mark (a crash, or a process that never looked) it reads the pack."""
    from kvd.store.ssd.pack import CLEAN

    entries = _fill(tmp_path, 4)
    mark = tmp_path / PACK_DIR / CLEAN
    orphan = make_entry(70)
    buf, _ = blobfile.encode_blob(orphan)
    _edit_pack(tmp_path, lambda txn, db, key: txn.put(key(orphan.id), buf, db=db))  # takes the mark away
    assert not mark.exists()
    with SsdStore(tmp_path, 64 << 20, min_free_bytes=0, pack_max_bytes=PACK, reconcile=False) as store:
        assert not store.pack.orphan_free
    assert not mark.exists()  # closed cleanly, but nobody looked for orphans
    with SsdStore(tmp_path, 64 << 20, min_free_bytes=0, pack_max_bytes=PACK) as store:
        assert not mark.exists()  # open for writing: no mark
        wait_until(store.reconciled.is_set, what="the start-up reconcile")
        assert store.counters["orphans_removed"] == 1 and store.pack.orphan_free
        _served_but(store, entries, None)
    assert mark.exists()
    with SsdStore(tmp_path, 64 << 20, min_free_bytes=0, pack_max_bytes=PACK) as store:
        assert store.pack.orphan_free
        wait_until(store.reconciled.is_set, what="the start-up reconcile")
        assert store.counters["orphans_removed"] == store.counters["rows_repaired"] == 0
        _served_but(store, entries, None)


def test_prefetch_reads_and_changes_nothing_and_a_retired_env_is_ignored(tmp_path):
    # SsdStore.write_batch asks for the pages its inserts will touch first
    # (Env.prefetch): only a hint, so it must neither change nor break anything.
    from concurrent.futures import ThreadPoolExecutor

    pack = Pack(tmp_path / PACK_DIR)
    with ThreadPoolExecutor(4) as pool:
        try:
            keys = pack.put_many((bytes([i]) * 33, bytes([i]) * 5000) for i in range(20))
            keys += [pack_key(bytes([i]) * 33, i + 1) for i in range(20, 40)]  # half of them absent
            futures = pack.prefetch(pack.slots, keys, pool, per_task=3)
            assert len(futures) == 14 and [f.result() for f in futures] == [None] * 14
            assert len(pack) == 20 and pack.read(keys[7]) == bytes([7]) * 5000 and pack.read(keys[30]) is None
        finally:
            pack.retire()
        # A retired (or resizing) environment: every read is refused, and the hint is dropped.
        assert [f.result() for f in pack.prefetch(pack.slots, keys, pool)] == [None] * 5


def test_the_writer_reads_ahead_only_while_its_batches_wait_for_the_disk(tmp_path, monkeypatch):
    # A cold page cache cannot be made on demand (dropping caches needs root
    # and a host that obeys): the process's major-fault count is injected.
    calls = []
    prefetch = Index.prefetch
    monkeypatch.setattr(Index, "prefetch", lambda self, *a, **kw: (calls.append(1), prefetch(self, *a, **kw))[1])
    with SsdStore(tmp_path, 64 << 20, min_free_bytes=0, reconcile=False, background=False) as store:
        def batch(i: int, *, disk_reads: int) -> None:
            # The count before the batch, then after it: `disk_reads` more.
            counts = iter([1000 * i, 1000 * i + disk_reads])
            store.major_faults = lambda: next(counts)
            entries = [make_entry(i * 100 + j) for j in range(16)]
            store.write_batch(entries)
            for e in entries:
                assert_same(store.get(e.id), e)

        batch(0, disk_reads=0)
        assert not store.prefetching and not calls
        batch(1, disk_reads=1)  # 1 of 16 entries: the cache holds the index
        assert not store.prefetching
        batch(2, disk_reads=5)
        assert store.prefetching and not calls  # from the next batch on
        batch(3, disk_reads=5)
        assert calls and store.prefetching
        n = len(calls)
        batch(4, disk_reads=0)  # the pages are cached again
        assert len(calls) == n + 1 and not store.prefetching
        batch(5, disk_reads=0)
        assert len(calls) == n + 1


def _pack_ending_before_its_last_page(root: Path) -> tuple[Pack, dict[bytes, bytes]]:
    """A pack whose data.mdb ends before LMDB's last page number, made the way
    the SSD tier's writer makes one (values put, some deleted, a commit each):
    pages a transaction took and gave back unwritten are free, not on disk."""
    import random

    rng = random.Random(3)
    pack, values = Pack(root / "pack"), {}
    for _ in range(600):
        def put(txn):
            for _ in range(rng.randint(1, 64)):
                key, value = rng.randbytes(33), rng.randbytes(rng.choice([500, 1000, 2000, 3000, 9000]))
                txn.put(key, value, db=pack.blobs)
                values[key] = value
        pack.write(put)
        if rng.random() < 0.5:
            gone = rng.sample(sorted(values), rng.randint(1, len(values)))
            def delete(txn):
                for key in gone:
                    txn.delete(key, db=pack.blobs)
                    del values[key]
            pack.write(delete)
        if (root / "pack" / "data.mdb").stat().st_size < (pack.env.info()["last_pgno"] + 1) * 4096:
            return pack, values
    raise AssertionError("LMDB never ended the file before its last page: nothing here tests that case")


def test_a_file_that_ends_before_lmdbs_last_page_is_not_damage(tmp_path):
    """Regression: the writer's check took LMDB's last page number for the
    pages on disk, called such a file cut short after an ordinary GC and moved
    the whole pack aside (every small chunk lost) or rebuilt the index. The
    pages past the end are on LMDB's free list; a page cut away is not."""
    from kvd.store.ssd.heal import inspect_data_file

    pack, values = _pack_ending_before_its_last_page(tmp_path)
    data = tmp_path / "pack" / "data.mdb"
    assert pack.file_fault() is None
    pack.close()
    assert inspect_data_file(data) is None
    pack = Pack(tmp_path / "pack", readonly=True)
    with pack.reading() as txn:
        assert {k: bytes(txn.get(k, db=pack.blobs)) for k in values} == values
    pack.close()
    size = data.stat().st_size
    os.truncate(data, size - 4096)  # a page in use, cut away
    assert "truncated" in inspect_data_file(data)
    os.truncate(data, size - 100)
    assert "not whole pages" in inspect_data_file(data)


def test_a_running_pack_cut_short_is_seen_but_its_own_growth_is_not(tmp_path):
    pack, _ = _pack_ending_before_its_last_page(tmp_path)
    data = tmp_path / "pack" / "data.mdb"
    try:
        assert pack.file_fault() is None
        pack.write(lambda txn: txn.put(b"k" * 33, b"v" * 9000, db=pack.blobs))
        assert pack.file_fault() is None
        os.truncate(data, data.stat().st_size - 4096)
        assert "cut short" in pack.file_fault()
    finally:
        pack.close()


def test_gc_of_small_chunks_never_costs_the_pack(daemon_factory):
    """Regression (a red-team find): spilling ~400 small chunks and evicting a
    third of the SSD tier by GC, a few rounds, made the daemon call its own
    pack 'cut short' and start an empty one (or rebuild its index)."""
    d = daemon_factory("--ram-mb", "8")
    rng = np.random.default_rng(1)
    with d.client("p", strict=True, chunk_tokens=4) as c:
        for rnd in range(4):
            for j in range(8):  # 50 chunks of 500 B to 9 KiB each: in the pack, some on overflow pages
                tokens = np.arange(200) + rnd * 100_000 + j * 1_000
                width = int(rng.choice([125, 250, 500, 750, 2250]))
                kv = rng.integers(0, 255, (1, 200, width), np.uint8)
                assert c.put(tokens, Snapshot(sliced={"k": (HostTensor.from_numpy(kv), 1)}))
            c.gc(ram_bytes=0)
            ssd = c.stats()["tiers"]["ssd"]
            c.gc(ssd_bytes=ssd["bytes"] // 3)
            after = c.stats()["tiers"]["ssd"]
            assert not after["degraded"] and after["entries"] > 0, after
    assert "cut short" not in d.log() and "damaged" not in d.log(), d.log()
    assert not list(d.data_dir.glob("pack.bad-*")) and not list(d.data_dir.glob("index.bad*"))
