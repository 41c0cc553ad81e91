"""Offline stats and gc on a stopped daemon's data dir (same lock, same code)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvd.store.ssd import offline
from kvd.store.datadir import PACK_DIR, DataDirBusy, blob_path, default_data_dir
from kvd.store.ssd.pack import CLEAN
from kvd.store.tiered import open_store

from support import filled_store, assert_same, make_entry


def _fill(root, n=12):
    return filled_store(root, [make_entry(i, "a" if i % 2 else "b") for i in range(n)])


def test_stats_read_only_and_gc_refuses_beside_a_daemon(tmp_path):
    entries = _fill(tmp_path)
    s = offline.stats(tmp_path)
    assert s["entries"] == 12 and s["namespaces"]["a"]["entries"] == 6 and s["locked_by"] is None
    daemon = open_store(1, tmp_path, ssd_bytes=64 << 20, min_free_bytes=0)
    try:
        # Another process (as `kvd stats` would be): LMDB allows one open per process.
        out = subprocess.run(
            [sys.executable, "-c", "import sys, json; from kvd.store.ssd import offline; "
             "print(json.dumps(offline.stats(sys.argv[1])))", str(tmp_path)],
            capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": os.getcwd()},
        ).stdout
        s = json.loads(out)
        assert s["locked_by"] == os.getpid() and s["entries"] == 12
        with pytest.raises(DataDirBusy):
            offline.gc(tmp_path)
        assert_same(daemon.get(entries[0].id), entries[0])
    finally:
        daemon.close()
    with pytest.raises(FileNotFoundError):
        offline.stats(tmp_path / "nothing")


def test_gc_orphans_verify_drop_evict_quarantine_with_dry_run(tmp_path):
    entries = _fill(tmp_path)
    # Debris a crash would leave: a temp file and a blob without a row;
    # plus a row without a blob and a blob with a flipped bit.
    shard = blob_path(tmp_path, entries[0].id).parent
    (shard / f".{'ab' * 33}.999.tmp").write_bytes(b"partial")
    orphan = blob_path(tmp_path, b"\x07" * 33)
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(blob_path(tmp_path, entries[0].id).read_bytes())
    os.unlink(blob_path(tmp_path, entries[2].id))
    p = blob_path(tmp_path, entries[4].id)
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 0xFF
    p.write_bytes(raw)
    # A crash leaves no clean mark on the pack (the fill's close may have
    # written one, if its start-up reconcile had finished): its keys are
    # looked through too ("pack").
    (tmp_path / PACK_DIR / CLEAN).unlink(missing_ok=True)

    calls = []
    report = offline.gc(tmp_path, verify=True, dry_run=True, progress=lambda *a: calls.append(a))
    assert report["reconcile"] == {
        "temps_removed": 1, "orphans_removed": 1, "rows_repaired": 1,
        "temp_bytes": 7, "orphan_bytes": orphan.stat().st_size,
    }
    assert report["verify"]["bad"] == 2  # the missing one and the flipped one
    assert {c[0] for c in calls} == {"blobs", "rows", "pack", "verify"}
    assert orphan.exists() and offline.stats(tmp_path)["entries"] == 12  # dry run: nothing changed

    report = offline.gc(tmp_path, verify=True)
    assert report["reconcile"]["orphans_removed"] == 1 and report["verify"] == {"checked": 11, "bad": 1}
    assert not orphan.exists()
    s = offline.stats(tmp_path)
    assert s["entries"] == 10 and s["quarantine"]["files"] == 1

    report = offline.gc(tmp_path, namespace="a", budget_bytes=0, quarantine=True, dry_run=True)
    # entries 2 and 4 (namespace "b") are gone: "a" has 6, "b" 4.
    assert report["dropped"]["entries"] == 6 and report["evicted"]["entries"] == 10
    report = offline.gc(tmp_path, namespace="a", quarantine=True)
    assert report["dropped"]["entries"] == 6 and report["quarantine_purged"]["files"] == 1
    s = offline.stats(tmp_path)
    assert set(s["namespaces"]) == {"b"} and s["entries"] == 4 and s["quarantine"]["files"] == 0
    report = offline.gc(tmp_path, budget_bytes=0)
    assert report["evicted"]["entries"] == 4 and offline.stats(tmp_path)["entries"] == 0

    # What survives offline gc is served after restart.
    store = open_store(1, tmp_path, ssd_bytes=64 << 20, min_free_bytes=0)
    try:
        assert store.ssd.entries == 0
    finally:
        store.close()


def test_default_data_dir_per_os(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("XDG_CACHE_HOME", "/x/cache")
    assert str(default_data_dir()) == "/x/cache/kvd"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")
    assert default_data_dir() == default_data_dir().home() / ".cache" / "kvd"
    monkeypatch.setattr(sys, "platform", "darwin")
    assert default_data_dir().parts[-3:] == ("Library", "Caches", "kvd")
