"""A data dir another process of the user has tampered with: the SSD tier
never deletes a good blob for it, never works through a symlink outside the
data dir, and answers a miss -- never an exception -- for any file under a
blob's name.

Each test builds the tampering with real files, real LMDB environments and
a real SsdStore (its writer thread where the order of its steps matters).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import struct
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
import xxhash

from kvd.store.datadir import BLOB_DIR, INDEX_DIR, PACK_DIR, blob_path
from kvd.store.ssd import SsdStore, heal, offline
from kvd.store.ssd.index import Index
from kvd.store.ssd.reconcile import reconcile_steps
from support import assert_same, filled_store, make_entry

# A header whose `__metadata__` is a JSON string: before, its parse raised
# AttributeError, which neither a read nor a rebuild took for damage.
_HEAD = b'{"__metadata__":"x"}' + b" " * 4
STRING_METADATA = struct.pack("<Q", len(_HEAD)) + _HEAD


def _served_once_reconciled(root: Path, entries, recovered: int) -> None:
    """A store on `root` (its writer thread: rebuild, walk, reconcile) rebuilt
    its index recovering `recovered` entries and serves every one of `entries`."""
    store = SsdStore(root, 64 << 20, min_free_bytes=0)
    try:
        assert store.reconciled.wait(30)
        assert store.heal is not None and store.heal.recovered == recovered
        for e in entries:
            assert_same(store.get(e.id), e)
    finally:
        store.close()


def _odd_file(root: Path, how: str) -> Path:
    p = blob_path(root, b"\x00" * 33)
    p.parent.mkdir(exist_ok=True)
    if how == "metadata-a-string":
        p.write_bytes(STRING_METADATA)
    else:  # a sparse file of 1 TiB: read whole, it was a MemoryError
        with open(p, "wb") as f:
            f.truncate(1 << 40)
    return p


@pytest.mark.parametrize("how", ["metadata-a-string", "a-sparse-terabyte"])
def test_no_one_file_ends_a_rebuild_and_no_good_blob_is_removed_after_it(tmp_path, how):
    # Before: the rebuild died at the odd file, and the reconcile that
    # followed deleted every blob not indexed yet as an orphan.
    entries = filled_store(tmp_path, [make_entry(i) for i in range(20)])
    _odd_file(tmp_path, how)
    shutil.rmtree(tmp_path / INDEX_DIR)
    store = SsdStore(tmp_path, 64 << 20, min_free_bytes=0)  # rebuild, walk, reconcile on the writer thread
    try:
        assert store.reconciled.wait(30)
        h = store.heal
        assert h is not None and h.done and (h.recovered, h.quarantined) == (20, 1)
        for e in entries:
            assert_same(store.get(e.id), e)
        assert store.counters["orphans_removed"] == 0
    finally:
        store.close()


def test_reconcile_removes_no_blob_while_a_rebuild_is_unfinished(tmp_path):
    filled_store(tmp_path / "data", [make_entry(i) for i in range(3)])
    others = filled_store(tmp_path / "other", [make_entry(i) for i in range(10, 13)])
    orphans = [blob_path(tmp_path / "data", e.id) for e in others]  # blobs no row of this index names
    for e, p in zip(others, orphans):
        p.parent.mkdir(exist_ok=True)
        shutil.copyfile(blob_path(tmp_path / "other", e.id), p)
    store = SsdStore(tmp_path / "data", 64 << 20, min_free_bytes=0, background=False, reconcile=False)
    try:
        store.index.write(lambda txn: txn.put(heal.REBUILDING, heal.Heal("test").record(), db=store.index.meta))
        report: dict = {}
        for _ in reconcile_steps(store, report):
            pass
        assert (report["orphans_removed"], report.get("orphans_kept")) == (0, 1)
        assert all(p.exists() for p in orphans)
        store.index.write(lambda txn: txn.delete(heal.REBUILDING, db=store.index.meta))
        report = {}
        for _ in reconcile_steps(store, report):
            pass
        assert (report["orphans_removed"], report.get("orphans_kept")) == (3, None)
        assert not any(p.exists() for p in orphans)
    finally:
        store.close()


def test_reconcile_and_gc_never_follow_a_symlink_under_blobs(tmp_path):
    root, outside = tmp_path / "data", tmp_path / "outside"
    filled_store(root, [make_entry(i) for i in range(3)])
    outside.mkdir()
    kept = [outside / ".notes.tmp", outside / ("cd" * 33 + ".safetensors")]  # a temp name, an orphan's name
    for p in kept:
        p.write_bytes(b"theirs")
    os.symlink(outside, root / BLOB_DIR / "zz")  # not named like a shard: ensure_blob_dirs leaves it
    report = offline.gc(root)
    assert report["reconcile"]["temps_removed"] == 0 and report["reconcile"]["orphans_removed"] == 0
    assert all(p.read_bytes() == b"theirs" for p in kept)


@pytest.mark.parametrize("folder", [INDEX_DIR, PACK_DIR])
def test_a_symlinked_index_or_pack_folder_is_moved_aside_never_written_through(tmp_path, folder):
    root, outside = tmp_path / "data", tmp_path / "outside"
    entries = filled_store(root, [make_entry(i) for i in range(3)])
    outside.mkdir()
    os.chmod(outside, 0o755)
    env = lmdb.open(str(outside), max_dbs=2)  # someone else's environment
    env.open_db(b"theirs")
    env.close()
    files = {p.name: p.read_bytes() for p in outside.iterdir()}
    shutil.rmtree(root / folder, ignore_errors=True)
    os.symlink(outside, root / folder)
    store = SsdStore(root, 64 << 20, min_free_bytes=0)
    try:
        assert store.reconciled.wait(30)
        for e in entries:
            assert_same(store.get(e.id), e)
    finally:
        store.close()
    assert not (root / folder).is_symlink()
    assert stat.S_IMODE(outside.stat().st_mode) == 0o755
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == files


def test_an_lmdb_no_kvd_wrote_in_place_of_the_index_is_rebuilt_not_taken_for_empty(tmp_path):
    # Before, any LMDB there (or one made by a start that stopped before
    # marking it) looked whole: reconcile took every blob for an orphan.
    entries = filled_store(tmp_path, [make_entry(i) for i in range(5)])
    shutil.rmtree(tmp_path / INDEX_DIR)
    env = lmdb.open(str(tmp_path / INDEX_DIR), max_dbs=8)
    env.open_db(b"rows")  # kvd's table names, no format record
    env.close()
    _served_once_reconciled(tmp_path, entries, 5)


def test_entries_dropped_are_not_brought_back_by_a_stop_before_their_blobs_went(tmp_path):
    # A drop deletes rows, then blobs: a stop between leaves kvd's own index
    # empty beside blobs. Those are orphans, not entries to index again.
    entries = filled_store(tmp_path, [make_entry(i) for i in range(5)])
    kept = tmp_path.parent / f"{tmp_path.name}-blobs"
    shutil.copytree(tmp_path / BLOB_DIR, kept)
    store = SsdStore(tmp_path, 64 << 20, min_free_bytes=0, background=False)
    try:
        assert store.drop(namespace="ns")[0] == 5
    finally:
        store.close()
    shutil.rmtree(tmp_path / BLOB_DIR)
    shutil.copytree(kept, tmp_path / BLOB_DIR)  # what the stop left
    store = SsdStore(tmp_path, 64 << 20, min_free_bytes=0)
    try:
        assert store.reconciled.wait(30)
        assert store.heal is None and all(store.get(e.id) is None for e in entries)
        assert store.counters["orphans_removed"] == 5
    finally:
        store.close()


def test_a_blob_whose_header_is_not_kvd_s_and_whose_row_matches_is_a_miss(tmp_path):
    e = filled_store(tmp_path, [make_entry(0)])[0]
    blob_path(tmp_path, e.id).write_bytes(STRING_METADATA)
    ix = Index(tmp_path / INDEX_DIR)
    with ix.reading() as txn:
        row = ix.get(txn, e.id)
    row = dataclasses.replace(row, file_size=len(STRING_METADATA), nbytes=0, tensors=[],
                              checksum=xxhash.xxh3_64_intdigest(STRING_METADATA))
    ix.write(lambda txn: txn.put(e.id, row.pack(), db=ix.rows))
    ix.close()
    store = SsdStore(tmp_path, 64 << 20, min_free_bytes=0, reconcile=False)
    try:
        assert store.get(e.id) is None
        assert store.counters["checksum_failures"] == 1
    finally:
        store.close()


def test_a_garbage_namespace_record_neither_stops_writes_nor_stats(tmp_path):
    filled_store(tmp_path, [make_entry(i) for i in range(3)])
    ix = Index(tmp_path / INDEX_DIR)
    ix.write(lambda txn: txn.put(b"ns", b"\xc1", db=ix.ns_db))  # 0xc1: no msgpack value
    ix.close()
    assert offline.stats(tmp_path)["namespaces"]["ns"]["entries"] == 0
    cli = subprocess.run([sys.executable, "-m", "kvd", "stats", "--offline", "--json", "--data-dir", str(tmp_path),
                          "--endpoint", f"ipc://{tmp_path}/none.sock"], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    store = SsdStore(tmp_path, 64 << 20, min_free_bytes=0, reconcile=False)
    try:
        e = make_entry(7)
        store.put(e)
        assert store.flush(20)
        assert store.has_row(e.id) and store.writer.abandoned == 0
        assert_same(store.get(e.id), e)
        assert store.stats()["namespaces"]["ns"]["entries"] == 1  # counted again from the repaired record
    finally:
        store.close()


def test_a_shard_the_rebuild_cannot_list_is_left_as_it_is_and_the_rest_indexed(tmp_path, monkeypatch):
    # A folder whose mode was changed by hand (a fault root cannot meet for
    # real: the scandir is made to refuse it). Before, the rebuild died there.
    entries = filled_store(tmp_path, [make_entry(i) for i in range(20)])
    locked = blob_path(tmp_path, entries[0].id).parent
    inside = [e for e in entries if blob_path(tmp_path, e.id).parent == locked]
    shutil.rmtree(tmp_path / INDEX_DIR)
    real = os.scandir

    def scandir(path="."):
        if os.fspath(path) == os.fspath(locked):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path)

    monkeypatch.setattr(heal.os, "scandir", scandir)
    store = SsdStore(tmp_path, 64 << 20, min_free_bytes=0, background=False)
    try:
        assert store.heal is not None and store.heal.done
        assert store.heal.recovered == len(entries) - len(inside)
        assert heal.unfinished(store.index)  # resumed at the next start; meanwhile no blob is an orphan
        report: dict = {}
        for _ in reconcile_steps(store, report):  # (it can list the shard: a refusal that came and went)
            pass
        assert report["orphans_removed"] == 0
        assert all(blob_path(tmp_path, e.id).exists() for e in inside)
        for e in entries:
            if e not in inside:
                assert_same(store.get(e.id), e)
    finally:
        store.close()
    monkeypatch.setattr(heal.os, "scandir", real)
    store = SsdStore(tmp_path, 64 << 20, min_free_bytes=0, background=False)  # the shard readable again
    try:
        assert store.heal is not None and store.heal.recovered == len(inside) and not heal.unfinished(store.index)
        for e in entries:
            assert_same(store.get(e.id), e)
    finally:
        store.close()


@pytest.mark.parametrize("shape", [(0, 5), (0, 2**64 - 1), (3, 0, 2**63)])
def test_a_tensor_of_no_elements_reads_back_whatever_its_other_dims(tmp_path, shape):
    # Red-team (session 41): the wire takes any dims of a tensor with a zero
    # in its shape, the index row's check took none larger than the entry's
    # bytes: a write-through PUT acknowledged was a "bad row" at its first read
    # from the disk, and quarantined.
    import numpy as np

    from kvd.protocol.codec import Tensor
    from kvd.store.base import CHUNK, Entry

    e = Entry("ns", b"\x05" * 32, CHUNK, b"\x06" * 32, 0, 4,
              (Tensor("state", "float16", shape, np.zeros(0, np.uint8)), Tensor("k", "uint8", (4,), np.arange(4, dtype=np.uint8))))
    store = SsdStore(tmp_path, 64 << 20, min_free_bytes=0, reconcile=False)
    try:
        store.put(e)
        assert store.flush(20)
        got = store.get(e.id)
        assert got is not None and [t.shape for t in got.tensors] == [shape, (4,)]
        assert store.counters["bad_rows"] == 0 and store.counters["quarantined"] == 0
    finally:
        store.close()
