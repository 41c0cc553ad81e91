"""SsdStore.check() (kvd/store/ssd/check.py) and what the tier does with a write
error that is not the disk's (DISK_ERRNOS decides degraded mode)."""

from __future__ import annotations

import os

from kvd.store.datadir import blob_path
from kvd.store.ssd import SsdStore

from support import make_entry

FAST = dict(min_free_bytes=0, retry_s=0.2, touch_flush_s=0.05, pack_max_bytes=0)  # files: these tests damage them


def _filled(root, n=6) -> SsdStore:
    store = SsdStore(root, 64 << 20, **FAST)
    for i in range(n):
        store.put(make_entry(i))
    assert store.flush(10)
    return store


def test_a_consistent_store_checks_ok(tmp_path):
    store = _filled(tmp_path)
    try:
        report = store.check()
        assert report.ok, report.summary()
        assert report.rows == report.checked == 6
    finally:
        store.close()


def test_check_names_every_kind_of_fault(tmp_path):
    store = _filled(tmp_path)
    try:
        e0, e1, e2 = (make_entry(i).id for i in range(3))
        raw = bytearray(blob_path(tmp_path, e0).read_bytes())
        raw[len(raw) // 2] ^= 1
        blob_path(tmp_path, e0).write_bytes(bytes(raw))  # corrupt
        os.unlink(blob_path(tmp_path, e1))  # row without blob
        stray = make_entry(99).id
        path = blob_path(tmp_path, stray)
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"x")  # blob without row
        (path.parent / ".x.tmp").write_bytes(b"")  # an unfinished write
        import msgpack

        store.index.write(lambda txn: txn.put(b"totals", msgpack.packb([1, 1]), db=store.index.meta))  # a lying totals row
        report = store.check()
        assert not report.ok
        assert dict(report.bad)[e1] == "missing" and dict(report.bad)[e0].startswith("corrupt")
        assert e2 not in dict(report.bad)
        assert report.orphans == [stray] and len(report.temps) == 1
        assert any("totals row" in p for p in report.problems)
        assert store.check(verify=False).checked == 0
    finally:
        store.close()


def test_a_write_error_that_is_not_the_disks_drops_one_entry_and_the_tier_goes_on(tmp_path):
    store = SsdStore(tmp_path, 64 << 20, **FAST)
    try:
        bad = make_entry(0)
        shard = blob_path(tmp_path, bad.id).parent
        shard.parent.mkdir(parents=True, exist_ok=True)
        shard.write_bytes(b"not a directory")  # ENOTDIR/EEXIST for this shard only
        others = [e for e in (make_entry(i) for i in range(1, 40)) if blob_path(tmp_path, e.id).parent != shard][:5]
        store.put(bad)
        for e in others:
            store.put(e)
        assert store.flush(10)
        assert store.degraded is None
        assert store.counters["write_errors"] == 1 and store.drop_reasons.get("write_error") == 1
        assert not store.contains(bad.id)
        assert all(store.contains(e.id) for e in others)
    finally:
        store.close()
