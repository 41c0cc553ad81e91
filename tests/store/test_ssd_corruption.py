"""Damaged blobs: each is a miss, quarantined, counted, and the store keeps serving."""

from __future__ import annotations

import os

from kvd.store.datadir import blob_path
from kvd.store.ssd import SsdStore

from support import assert_same, filled_store, make_entry, wait_until


def _fill(tmp_path, n=10):
    return filled_store(tmp_path, [make_entry(i, dtype_list=["bfloat16", "float32"]) for i in range(n)])


def test_flipped_truncated_and_deleted_blobs(tmp_path):
    entries = _fill(tmp_path)
    flipped, truncated, deleted = entries[1], entries[4], entries[7]
    p = blob_path(tmp_path, flipped.id)
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit, deep inside tensor data
    p.write_bytes(raw)
    p = blob_path(tmp_path, truncated.id)
    os.truncate(p, p.stat().st_size - 100)
    os.unlink(blob_path(tmp_path, deleted.id))

    store = SsdStore(tmp_path, 64 << 20, min_free_bytes=0, reconcile=False)
    try:
        for bad in (flipped, truncated, deleted):
            assert store.contains(bad.id)  # the index cannot know before reading
            assert store.get(bad.id) is None  # a miss, not an exception
            assert not store.contains(bad.id)  # hidden at once, before the writer acts
        for e in entries:
            if e not in (flipped, truncated, deleted):
                assert_same(store.get(e.id), e)
        wait_until(lambda: store.counters["quarantined"] == 2 and store.counters["rows_repaired"] == 1)
        c = store.counters
        assert c["checksum_failures"] == 2 and c["misses"] == 3
        quarantined = sorted(p.name.split(".")[0] for p in (tmp_path / "quarantine").iterdir())
        assert quarantined == sorted([flipped.id.hex(), truncated.id.hex()])
        assert not blob_path(tmp_path, flipped.id).exists()
        assert store.entries == 7
        # The same entries can be stored again and are then served.
        for e in (flipped, truncated, deleted):
            store.put(e)
        assert store.flush(10)
        for e in (flipped, truncated, deleted):
            assert_same(store.get(e.id), e)
        assert store.purge_quarantine(dry_run=True)[0] == 2
        assert store.purge_quarantine()[0] == 2 and not list((tmp_path / "quarantine").iterdir())
    finally:
        store.close()


def test_header_damage_and_a_foreign_file_under_a_blob_name(tmp_path):
    entries = _fill(tmp_path, 4)
    # Swap two blobs: each is internally valid but holds the other entry.
    a, b = blob_path(tmp_path, entries[0].id), blob_path(tmp_path, entries[1].id)
    ra, rb = a.read_bytes(), b.read_bytes()
    a.write_bytes(rb)
    b.write_bytes(ra)
    p = blob_path(tmp_path, entries[2].id)
    raw = bytearray(p.read_bytes())
    raw[20] ^= 0x20  # inside the JSON header
    p.write_bytes(raw)
    store = SsdStore(tmp_path, 64 << 20, min_free_bytes=0, reconcile=False)
    try:
        for e in entries[:3]:
            assert store.get(e.id) is None
        assert_same(store.get(entries[3].id), entries[3])
        wait_until(lambda: store.counters["quarantined"] == 3)
        assert store.counters["checksum_failures"] == 3
    finally:
        store.close()
