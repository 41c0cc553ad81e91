"""The disk misbehaves under a running SSD tier: odd files under a blob's
name, a failing or read-only disk, folders and LMDB files removed, cut
short or replaced by symlinks, a writer stuck in a call that never returns.
Each is a miss or a typed refusal and a degraded tier, never a hang, an
INTERNAL, a lost acknowledgement or a write outside the data dir.

Real faults where the machine allows them: FIFOs and symlinks always; an
ext4 image on a loop device (needs root) for EIO (EXT4_IOC_SHUTDOWN), a
disk turning read-only (errors=remount-ro) and a folder that refuses
creates (chattr +i). Those tests skip elsewhere. Only a call that never
returns is simulated (a hung disk cannot be made here).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvd.protocol.errors import Busy
from kvd.store.ssd import blobfile, upkeep
from kvd.store.datadir import BLOB_DIR, INDEX_DIR, PACK_DIR, QUARANTINE_DIR, blob_path
from kvd.store.ssd import SsdStore

from support import (
    assert_prefix_hit, assert_same, chunk_blob, filled_store, kvd, make_entry, prefix_snapshot, wait_until,
)

FAST = dict(min_free_bytes=0, reconcile=False, touch_flush_s=0.05)


def _bounded(fn, fifos, timeout=5.0):
    """fn() in a thread; if it is still inside after `timeout` (blocked on
    a FIFO), unblock it by opening the FIFOs for writing, then fail."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    hung = t.is_alive()
    while t.is_alive():
        for path in fifos:
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(0.05)
    assert not hung, "blocked on a FIFO under a blob's name"
    if "error" in out:
        raise out["error"]
    return out["value"]


def _fifo(path: Path) -> Path:
    path.unlink()
    os.mkfifo(path, 0o600)
    return path


def test_a_fifo_under_a_blobs_name_is_corrupt_never_a_hang(tmp_path):
    entries = filled_store(tmp_path, [make_entry(i) for i in range(4)])
    fifos = [_fifo(blob_path(tmp_path, e.id)) for e in entries[:3]]
    store = SsdStore(tmp_path, 64 << 20, **FAST)
    try:
        assert _bounded(lambda: store.get(entries[0].id), fifos) is None  # a GET: a miss
        wait_until(lambda: store.counters["quarantined"] == 1, what="the FIFO quarantined")
        assert not store.contains(entries[0].id) and store.counters["checksum_failures"] == 1
        assert not fifos[0].exists() and len(list((tmp_path / QUARANTINE_DIR).iterdir())) == 1
        report = _bounded(lambda: store.check(), fifos)  # kvd verify's check
        assert dict(report.bad)[entries[1].id].startswith("corrupt: not a regular file"), report.bad
        assert_same(store.get(entries[3].id), entries[3])
    finally:
        store.close()
    # A rebuild from the blobs (missing index, `kvd verify --repair`) reads every blob.
    store = _bounded(lambda: SsdStore(tmp_path, 64 << 20, rebuild="test", background=False, **FAST), fifos)
    try:
        assert store.heal.done and store.heal.recovered == 1 and store.heal.quarantined == 2
        assert_same(store.get(entries[3].id), entries[3])
    finally:
        store.close()


def test_open_errors_of_one_path_are_a_miss_and_quarantined_not_raised(tmp_path):
    entries = filled_store(tmp_path, [make_entry(i) for i in range(40)])
    looped = blob_path(tmp_path, entries[0].id)
    looped.unlink()
    os.symlink(looped.name, looped)  # ELOOP
    shard = blob_path(tmp_path, entries[1].id).parent
    spared = [e for e in entries[2:] if blob_path(tmp_path, e.id).parent not in (shard, looped.parent)]
    shutil.rmtree(shard)
    shard.write_bytes(b"x")  # ENOTDIR
    store = SsdStore(tmp_path, 64 << 20, **FAST)
    try:
        for e in entries[:2]:
            assert store.get(e.id) is None  # was: OSError, INTERNAL on the wire
            wait_until(lambda: not store.contains(e.id), what="the row dropped")
            assert store.get(e.id) is None
        assert store.counters["read_errors"] == 1 and store.counters["checksum_failures"] == 2
        assert store.degraded is None  # one path each, not the disk
        assert_same(store.get(spared[0].id), spared[0])
    finally:
        store.close()


def test_daemon_serves_a_miss_for_a_fifo_blob_and_stays_responsive(daemon_factory):
    d = daemon_factory("--ram-mb", "16", "--pack-max-kb", "0", "--write-through")
    seqs = [np.arange(512) + 1000 * i for i in range(2)]
    with d.client(strict=True) as c:
        for s in seqs:
            assert c.put(s, prefix_snapshot(s))
        c.gc(ram_bytes=0)  # GETs come from the SSD tier
    fifos = [_fifo(chunk_blob(d.data_dir, "test", seqs[0], 0))]
    try:
        with d.client(strict=True, timeout=3.0) as c:
            assert c.get(seqs[0], max_tokens=511) is None  # was: no answer, and none to anyone after
            assert c.ping() is not None
            assert_prefix_hit(c.get(seqs[1], max_tokens=511), seqs[1])
            fifos.append(_fifo(chunk_blob(d.data_dir, "test", seqs[1], 1)))
            r = kvd("verify", "--endpoint", d.endpoint, timeout=20)  # was: hung
            assert r.returncode == 1 and "not a regular file" in r.stdout, (r.stdout, r.stderr)
            assert c.ping() is not None
        assert d.stop() == 0
    finally:
        for path in fifos:  # unblock a reader, if one hangs
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass


def test_daemon_answers_not_persisted_for_puts_into_a_removed_pack(daemon_factory):
    from kvd_client import NotPersisted

    d = daemon_factory("--ram-mb", "16", "--pack-max-kb", "128", "--write-through")
    s, t = np.arange(512), np.arange(512) + 5000
    with d.client(strict=True) as c:
        assert c.put(s, prefix_snapshot(s))
        shutil.rmtree(d.data_dir / PACK_DIR)
        with pytest.raises(NotPersisted):  # was: acknowledged, and lost at the next start
            c.put(t, prefix_snapshot(t))
        ssd = c.stats()["tiers"]["ssd"]
        assert ssd["degraded"] and "pack" in ssd["degraded_reason"], ssd["degraded_reason"]
        assert_prefix_hit(c.get(t), t)  # RAM still serves it
    assert (d.data_dir / PACK_DIR / "data.mdb").is_file()
    d.restart()  # on the new pack
    with d.client(strict=True) as c:
        assert c.put(t, prefix_snapshot(t))
        c.gc(ram_bytes=0)
        assert_prefix_hit(c.get(t), t)


# -- a real ext4 on a loop device (root) ----------------------------------------


@pytest.fixture
def ext4():
    """A fresh 16 MiB ext4 (errors=remount-ro) on a loop device, and its
    device name; skipped where it cannot be made (not root, no mkfs.ext4)."""
    top = Path(tempfile.mkdtemp(prefix="kvd-ext4-", dir="/tmp"))
    img, mnt = top / "disk.img", top / "mnt"
    mnt.mkdir()
    try:
        with open(img, "wb") as f:
            f.truncate(16 << 20)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True, capture_output=True)
        subprocess.run(["mount", "-o", "loop,errors=remount-ro", str(img), str(mnt)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        shutil.rmtree(top, ignore_errors=True)
        pytest.skip(f"cannot mount an ext4 image here: {exc}")
    dev = subprocess.run(["findmnt", "-n", "-o", "SOURCE", str(mnt)], capture_output=True, text=True).stdout.strip()
    yield mnt, os.path.basename(dev)
    subprocess.run(["chattr", "-R", "-i", str(mnt)], capture_output=True)
    subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)
    shutil.rmtree(top, ignore_errors=True)


def _shutdown(mnt: Path) -> None:
    """EXT4_IOC_SHUTDOWN, NOLOGFLUSH: from now on every I/O there is EIO."""
    fd = os.open(mnt, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, 0x8004587D, (2).to_bytes(4, "little"))
    finally:
        os.close(fd)


def test_eio_from_a_failing_disk_is_a_miss_that_degrades_and_keeps_the_blob(ext4):
    mnt, _ = ext4
    root = mnt / "data"
    entries = filled_store(root, [make_entry(i) for i in range(3)])
    store = SsdStore(root, 64 << 20, **FAST)
    try:
        _shutdown(mnt)
        assert store.get(entries[0].id) is None  # was: OSError, INTERNAL on the wire
        st = store.stats()["tiers"]["ssd"]
        assert st["degraded"] and "read failed" in st["degraded_reason"], st["degraded_reason"]
        assert st["read_errors"] == 1 and st["checksum_failures"] == 0
        # The blob may be intact (a transient error): never hidden, never quarantined.
        assert entries[0].id not in store._bad and store.contains(entries[0].id)
        assert store.flush(5) and store.counters["quarantined"] == 0
    finally:
        store.close()


def test_a_disk_turned_read_only_degrades_once_and_admin_writes_are_busy(ext4, caplog):
    mnt, dev = ext4
    trigger = Path(f"/sys/fs/ext4/{dev}/trigger_fs_error")
    if not trigger.exists():
        pytest.skip("this kernel has no ext4 trigger_fs_error")
    root = mnt / "data"
    entries = filled_store(root, [make_entry(i) for i in range(3)])
    store = SsdStore(root, 64 << 20, **FAST)
    try:
        trigger.write_text("kvd test")  # errors=remount-ro: the disk is read-only now
        caplog.set_level(logging.WARNING)
        for _ in range(3):  # reads only: their recency updates are what fails
            for e in entries:
                assert_same(store.get(e.id), e)
            time.sleep(store.touch_flush_s * 2)
        wait_until(lambda: store.degraded is not None, what="degraded")
        assert "Read-only" in store.degraded, store.degraded
        with pytest.raises(Busy, match="refuses writes"):  # `kvd gc --ssd-gb 0`: was INTERNAL
            store.evict(0)
        for e in entries:
            assert_same(store.get(e.id), e)  # reads go on
        text = caplog.text
        assert "unexpected error" not in text and text.count("ssd tier degraded") == 1, text
    finally:
        store.close()


def test_writes_failing_path_after_path_with_one_errno_degrade(ext4):
    mnt, _ = ext4
    root = mnt / "data"
    store = SsdStore(root, 64 << 20, pack_max_bytes=0, **FAST)
    try:
        batch = [make_entry(i) for i in range(5)]
        for e in batch:  # every shard these go to refuses creates, even root's (EPERM)
            blob_path(root, e.id).parent.mkdir(exist_ok=True)
        r = subprocess.run(["chattr", "+i", *{str(blob_path(root, e.id).parent) for e in batch}], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"chattr +i not available: {r.stderr!r}")
        for e in batch:
            store.put(e)
        assert store.flush(5)
        assert store.counters["write_errors"] == 3 and store.drop_reasons == {"write_error": 3, "degraded": 2}
        assert store.degraded is not None and "writes in a row failed" in store.degraded, store.degraded
    finally:
        store.close()


# -- folders and LMDB files removed, cut short or replaced ----------------------


def test_the_blobs_folder_removed_under_a_running_store_is_made_again(tmp_path):
    store = SsdStore(tmp_path, 64 << 20, pack_max_bytes=0, **FAST)
    try:
        first, *more = [make_entry(i) for i in range(4)]
        store.put(first)
        assert store.flush(5)
        shutil.rmtree(tmp_path / BLOB_DIR)
        for e in more:
            store.put(e)
        assert store.flush(5)
        assert store.degraded is None and store.counters["write_errors"] == 0
        for e in more:
            assert blob_path(tmp_path, e.id).is_file()
            assert_same(store.get(e.id), e)
    finally:
        store.close()


def _settling(store) -> list[tuple[bytes, bool]]:
    told: list[tuple[bytes, bool]] = []
    store.on_settled = lambda pairs, degraded: told.extend(pairs)
    return told


@pytest.mark.parametrize("found_by", ["batch", "tick"])
def test_a_pack_removed_under_the_store_is_never_acknowledged_and_replaced(tmp_path, monkeypatch, found_by):
    """Whoever finds the pack gone, the batch's own check or the writer's tick
    between batches, the next entry is not acknowledged: committed into the
    removed file, or dropped while the tier is degraded."""
    if found_by == "batch":  # the tick looks once, at the start, and not again
        monkeypatch.setattr(upkeep, "FILE_CHECK_S", 3600.0)
    store = SsdStore(tmp_path, 64 << 20, **FAST)  # make_entry's 8 KiB blobs go to the pack
    try:
        told = _settling(store)
        kept = make_entry(0)
        store.put(kept)
        assert store.flush(5) and told == [(kept.id, True)]
        old_pack = store.pack
        shutil.rmtree(tmp_path / PACK_DIR)
        if found_by == "tick":
            wait_until(lambda: store.pack is not old_pack, what="the pack replaced by the tick")
        lost = make_entry(1)
        store.put(lost)
        assert store.flush(5)
        assert told[-1] == (lost.id, False)  # committed into a removed file, or dropped: not durable
        assert store.degraded is not None and "pack" in store.degraded, store.degraded
        assert store.counters["files_replaced"] == 1
        assert store.drop_reasons == ({"degraded": 1} if found_by == "tick" else {})
        assert store.pack is not old_pack and (tmp_path / PACK_DIR / "data.mdb").is_file()
        for e in (kept, lost):  # their rows name nothing now: misses, then dropped
            assert store.get(e.id) is None
        wait_until(lambda: store.entries == 0, what="the rows dropped")
    finally:
        store.close()
    store = SsdStore(tmp_path, 64 << 20, **FAST)  # and the next start is clean
    try:
        assert store.entries == 0 and store.check().ok
    finally:
        store.close()


def test_an_index_removed_under_the_store_is_never_acknowledged_and_healed(tmp_path, monkeypatch):
    monkeypatch.setattr(upkeep, "FILE_CHECK_S", 3600.0)  # the batch finds it, not the tick: its blob is written
    store = SsdStore(tmp_path, 64 << 20, **FAST)
    try:
        told = _settling(store)
        entries = [make_entry(i) for i in range(2)]
        store.put(entries[0])
        assert store.flush(5)
        shutil.rmtree(tmp_path / INDEX_DIR)
        store.put(entries[1])
        assert store.flush(5)
        assert [ok for _, ok in told] == [True, False]  # its row went into a removed file
        assert store.degraded is not None and "index" in store.degraded, store.degraded
        wait_until(lambda: store.heal is not None and store.heal.done, what="the index rebuilt")
        for e in entries:  # their blobs were durable: the rebuild found them both
            assert_same(store.get(e.id), e)
        assert store.counters["files_replaced"] == 1
    finally:
        store.close()


@pytest.mark.parametrize("what", [PACK_DIR, INDEX_DIR])
def test_an_lmdb_file_cut_short_is_replaced_before_it_is_read(tmp_path, what):
    entries = [make_entry(i) for i in range(30)]
    store = SsdStore(tmp_path, 64 << 20, **FAST)
    try:
        for e in entries:
            store.put(e)
        assert store.flush(5)
        old = store.pack if what == PACK_DIR else store.index
        os.truncate(tmp_path / what / "data.mdb", 8192)  # a read past it would be a SIGBUS
        wait_until(lambda: (store.pack if what == PACK_DIR else store.index) is not old, what="the file replaced")
        assert list(tmp_path.glob(f"{what}.bad-*"))
        if what == INDEX_DIR:  # rebuilt from the pack, which is intact
            wait_until(lambda: store.heal.done, what="the index rebuilt")
            assert_same(store.get(entries[7].id), entries[7])
        else:  # the pack's entries are lost: misses
            assert store.get(entries[7].id) is None
    finally:
        store.close()


def test_a_symlinked_blobs_folder_is_never_written_through_nor_swept(tmp_path):
    root, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    store = SsdStore(root, 64 << 20, pack_max_bytes=0, **FAST)
    try:
        store.put(make_entry(0))
        assert store.flush(5)
        foreign = elsewhere / "ab" / ("ab" * 33 + ".safetensors")  # named like a blob without a row
        foreign.parent.mkdir(parents=True)
        foreign.write_bytes(b"someone else's file")
        os.rename(root / BLOB_DIR, tmp_path / "moved")
        os.symlink(elsewhere, root / BLOB_DIR)
        more = [make_entry(i) for i in range(1, 4)]
        for e in more:
            store.put(e)
        assert store.flush(5)
        assert not (root / BLOB_DIR).is_symlink() and list(root.glob("blobs.not-a-dir-*"))
        store.reconcile()  # `kvd gc --orphans`
        os.symlink(elsewhere / "ab", root / BLOB_DIR / "ab")  # one shard, too
        store.reconcile()
        assert sorted(p.name for p in elsewhere.rglob("*")) == ["ab", foreign.name]  # nothing written, nothing swept
        for e in more:
            assert_same(store.get(e.id), e)
    finally:
        store.close()


# -- the stop bound ------------------------------------------------------------


def test_close_stays_within_its_timeout_when_the_writer_is_stuck(tmp_path, monkeypatch):
    # A hung disk (NFS, iSCSI, FUSE) cannot be made here: the blob write blocks instead.
    inside, release = threading.Event(), threading.Event()
    real = blobfile.write_blob

    def stuck(*args, **kw):
        inside.set()
        release.wait(30)
        return real(*args, **kw)

    monkeypatch.setattr(blobfile, "write_blob", stuck)
    store = SsdStore(tmp_path, 64 << 20, pack_max_bytes=0, **FAST)
    try:
        store.put(make_entry(0))
        assert inside.wait(5)
        t0 = time.monotonic()
        store.close(timeout=1.0)
        took = time.monotonic() - t0
        assert took < 1.2, f"close(timeout=1.0) took {took:.2f}s"
    finally:
        release.set()
        store.writer.stop(timeout=5)


def test_a_file_that_grew_between_two_threads_looks_is_never_cut_short(tmp_path, monkeypatch):
    """The writer's tick and a batch on another thread each look at the
    pack's file: a stat taken before it grew, compared after the other had
    seen it grown, said "cut short" and the pack -- every entry in it -- was
    replaced (CI, session 30: test_quota's batch beside the tick). The look
    is one thread at a time, so the older stat is never compared with the
    newer size."""
    from kvd.store.ssd import lmdbenv

    env = lmdbenv.Env(tmp_path / "env")
    try:
        real_stat = os.stat
        first_stat_taken, let_first_go = threading.Event(), threading.Event()
        first = []

        def stat(path, *args, **kwargs):
            st = real_stat(path, *args, **kwargs)
            if threading.current_thread().name == "first-look" and not first:
                first.append(st)
                first_stat_taken.set()
                let_first_go.wait(10)
            return st

        monkeypatch.setattr(lmdbenv.os, "stat", stat)
        answers = {}
        looker = threading.Thread(target=lambda: answers.setdefault("first", env.file_fault()), name="first-look")
        looker.start()
        assert first_stat_taken.wait(10)
        db = env.env.open_db(b"grow")
        env.write(lambda txn: [txn.put(b"%d" % i, b"x" * 4000, db=db) for i in range(64)])
        assert real_stat(tmp_path / "env" / lmdbenv.DATA_FILE).st_size > first[0].st_size
        second = threading.Thread(target=lambda: answers.setdefault("second", env.file_fault()))
        second.start()
        second.join(0.5)  # with the look one thread at a time, it waits for the first
        let_first_go.set()
        looker.join(10)
        second.join(10)
        assert answers == {"first": None, "second": None}
    finally:
        env.close()
