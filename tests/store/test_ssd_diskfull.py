"""A full disk, for real: a small tmpfs. The SSD tier degrades, RAM keeps
serving, nothing on disk is harmed, and it recovers when space returns.

Mounting needs root (CAP_SYS_ADMIN); elsewhere the same test runs with the
one fault injected at the blob writer (ENOSPC from write(2)); set
KVD_TEST_NO_MOUNT=1 to run that variant as root.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess

import pytest

import lmdb

from kvd.store.ssd import blobfile
from kvd.store.ssd.pack import Pack
from kvd.store.tiered import open_store

from support import FakeClock, assert_same, charged, make_entry

FS_BYTES = 6 << 20


class TmpfsDisk:
    real = True

    def __init__(self, mnt):
        self.mnt = mnt
        mnt.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES},mode=0700", "tmpfs", str(mnt)],
                       check=True, capture_output=True)

    def fill(self):
        """Leave ~nothing free: another process ate the disk. Unbuffered: a
        buffered file kept the tail of its last write and raised ENOSPC again
        when closed (1 suite in ~10, as the free space's alignment varied)."""
        with open(self.mnt / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * (64 << 10))
            except OSError as exc:
                assert exc.errno == errno.ENOSPC

    def free(self):
        os.unlink(self.mnt / "filler")

    def close(self):
        subprocess.run(["umount", "-l", str(self.mnt)], check=False)


class InjectedDisk:
    real = False

    def __init__(self, mnt, monkeypatch):
        self.mnt = mnt
        self._mp = monkeypatch
        self._orig = blobfile._write_all
        self._orig_pack = Pack.put_many

    def fill(self):
        def enospc(fd, mv, hasher):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def pack_enospc(pack, items):
            raise lmdb.Error(f"{pack.path}: {os.strerror(errno.ENOSPC)}")

        self._mp.setattr(blobfile, "_write_all", enospc)
        self._mp.setattr(Pack, "put_many", pack_enospc)

    def free(self):
        self._mp.setattr(blobfile, "_write_all", self._orig)
        self._mp.setattr(Pack, "put_many", self._orig_pack)

    def close(self):
        pass


@pytest.fixture
def disk(tmp_path, monkeypatch):
    try:
        if os.environ.get("KVD_TEST_NO_MOUNT"):
            raise PermissionError("KVD_TEST_NO_MOUNT set")
        d = TmpfsDisk(tmp_path / "mnt")
    except (subprocess.CalledProcessError, FileNotFoundError, PermissionError):
        d = InjectedDisk(tmp_path / "mnt", monkeypatch)
    yield d
    d.close()


def _consistent(store):
    report = store.ssd.check()
    assert report.ok, report.summary()


@pytest.mark.parametrize("width", [1024, 64], ids=["files", "packed"])
def test_enospc_degrades_ram_serves_and_recovers(disk, width):
    # 128 KiB entries are files; 8 KiB ones go to the pack (an LMDB file).
    entries = [make_entry(i, width=width) for i in range(60)]
    n = entries[0].nbytes
    clock = FakeClock()
    store = open_store(4 * charged(entries[0]), disk.mnt / "kvd", ssd_bytes=1 << 30, min_free_bytes=0, retry_s=0.3,
                       clock=clock)
    try:
        for e in entries[:10]:
            store.put(e)
        assert store.flush(10)
        assert store.ssd.entries == 10 and store.ssd.degraded is None  # written behind, RAM's 4 too

        disk.fill()
        for e in entries[10:30]:
            store.put(e)
        assert store.flush(10)
        ssd = store.stats()["tiers"]["ssd"]
        assert ssd["degraded"] and ssd["write_errors"] >= 1
        assert ssd["drop_reasons"].get("write_error", 0) + ssd["drop_reasons"].get("degraded", 0) >= 1
        assert ssd["drops"] == sum(ssd["drop_reasons"].values())
        # RAM keeps serving, and so do the blobs committed before the disk filled.
        for e in entries[26:30] + entries[:10]:
            assert_same(store.get(e.id), e)
        _consistent(store)
        # A GET never lies even now: what contains reports is served.
        for e in entries[:30]:
            if store.contains(e.id):
                assert_same(store.get(e.id), e)

        disk.free()
        clock.advance(0.35)  # past retry_s: the next spill is a probe
        for e in entries[30:40]:
            store.put(e)
        assert store.flush(10)
        ssd = store.stats()["tiers"]["ssd"]
        assert not ssd["degraded"], ssd["degraded_reason"]
        assert store.ssd.contains(entries[35].id)
        assert_same(store.get(entries[35].id), entries[35])
        _consistent(store)
    finally:
        store.close(persist=False)


def test_min_free_guard_keeps_space_for_others(disk):
    if not disk.real:
        pytest.skip("the free-space guard needs a real small filesystem")
    entries = [make_entry(i, width=1024) for i in range(12)]
    store = open_store(1, disk.mnt / "kvd", ssd_bytes=1 << 30, min_free_bytes=FS_BYTES - (1 << 20), retry_s=0.2)
    try:
        for e in entries:
            store.put(e)
        assert store.flush(10)
        st = os.statvfs(disk.mnt)
        ssd = store.stats()["tiers"]["ssd"]
        assert ssd["degraded"] and "low space" in ssd["degraded_reason"]
        assert ssd["drop_reasons"]["low_space"] >= 1
        assert st.f_bavail * st.f_frsize >= store.ssd.min_free_bytes - (256 << 10)  # never ate into the reserve
        assert ssd["write_errors"] == 0  # the guard stopped writes before the disk refused them
    finally:
        store.close(persist=False)


def test_a_full_disk_stays_one_degraded_episode_until_space_returns(disk, caplog):
    # Small chunks go to the pack: each retry encodes them in memory first,
    # which once counted as "recovered" before the pack's commit failed again.
    entries = [make_entry(i, width=64) for i in range(40)]
    clock = FakeClock()
    store = open_store(1, disk.mnt / "kvd", ssd_bytes=1 << 30, min_free_bytes=0, retry_s=0.3, clock=clock)
    try:
        store.put(entries[0])
        assert store.flush(10) and store.ssd.entries == 1
        disk.fill()
        caplog.set_level(logging.WARNING, logger="kvd.store.ssd")
        since = None
        for r in range(4):  # four retries, the disk full throughout
            clock.advance(0.35)
            for e in entries[1 + 5 * r : 6 + 5 * r]:
                store.put(e)
            assert store.flush(10)
            ssd = store.stats()["tiers"]["ssd"]
            assert ssd["degraded"], f"retry {r}: not degraded on a full disk"
            since = since or ssd["degraded_since"]
            assert ssd["degraded_since"] == since
        said = [r.getMessage() for r in caplog.records if "degraded" in r.getMessage() or "recovered" in r.getMessage()]
        assert len(said) == 1 and "degraded" in said[0], said
        disk.free()
        clock.advance(0.35)
        store.put(entries[30])
        assert store.flush(10)
        assert store.ssd.degraded is None and "recovered" in caplog.records[-1].getMessage()
    finally:
        store.close(persist=False)
