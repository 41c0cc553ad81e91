"""The SSD tier through a real `kvd serve`: spill, restart, corruption, kill -9."""

from __future__ import annotations

import json
import random
import threading
import time

import mlx.core as mx
import numpy as np
import safetensors

from kvd.store.ssd import blobfile
from kvd.store.datadir import BLOB_DIR, QUARANTINE_DIR, TMP_SUFFIX
from kvd_client import Snapshot
from support import ALL_DTYPES, assert_prefix_hit, chunk_blob, kvd, prefix_snapshot, wait_spilled


def test_spill_and_restore_every_dtype_bf16_blob_is_real_bf16(daemon_factory):
    d = daemon_factory("--ram-mb", "1", "--pack-max-kb", "0")  # blobs in files, to open with mx.load
    seqs = [np.arange(512) + 10_000 * i for i in range(12)]  # ~2.5 MiB: most must spill
    # First in, so first out to disk: a chunk of the dtypes mlx has (no float64).
    mlx_only = prefix_snapshot(seqs[0][:256])
    mlx_only = Snapshot(sliced={k: v for k, v in mlx_only.sliced.items() if k != "t.float64"}, meta=mlx_only.meta)
    with d.client("mlx-only", strict=True) as c:
        assert c.put(seqs[0][:256], mlx_only)
    with d.client("spill", strict=True) as c:
        for s in seqs:
            assert c.put(s, prefix_snapshot(s))
        ssd = wait_spilled(c, 10)
        assert ssd["spills"] >= 10 and ssd["entries"] >= 10, ssd
        for s in seqs:  # served whole, whichever tier each chunk is in
            hit = c.get(s)
            assert hit.n == 512
            assert_prefix_hit(hit, s)
        st = c.stats()
        assert st["tiers"]["ssd"]["hits"] > 0
    # the first chunk of the first sequence went to disk: a plain safetensors file
    path = chunk_blob(d.data_dir, "spill", seqs[0], 0)
    want = prefix_snapshot(seqs[0][:256])
    # Every dtype of the table, as the safetensors library itself reads it:
    # BF16 stays BF16, never widened.
    tensors = dict(safetensors.deserialize(path.read_bytes()))
    for dt in ALL_DTYPES:
        t, _ = want.sliced[f"t.{dt}"]
        got = tensors[f"t.{dt}"]
        assert (got["dtype"], got["shape"]) == (blobfile.ST_DTYPE[dt], list(t.array.shape)), dt
        assert bytes(got["data"]) == t.array.tobytes(), dt
    # And mlx reads such a blob (mlx has no float64: the chunk of the dtypes it has).
    loaded = mx.load(str(chunk_blob(d.data_dir, "mlx-only", seqs[0][:256], 0)))
    assert loaded["t.bfloat16"].dtype == mx.bfloat16
    assert np.array_equal(np.array(loaded["t.bfloat16"].view(mx.uint16)), want.sliced["t.bfloat16"][0].array)
    for dt in ALL_DTYPES:
        if dt != "float64":
            assert str(loaded[f"t.{dt}"].dtype) == f"mlx.core.{dt}"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct((d.data_dir / BLOB_DIR).stat().st_mode & 0o777) == "0o700"


def test_restart_warm(daemon_factory):
    d = daemon_factory("--ram-mb", "64")
    seqs = [np.arange(300 + 37 * i) + 7_000 * i for i in range(6)]
    with d.client("warm", strict=True) as c:
        for s in seqs:
            assert c.put(s, prefix_snapshot(s, boundary=True))
    assert d.stop() == 0  # a clean stop writes RAM down to disk
    d.start()
    with d.client("warm", strict=True) as c:
        for s in seqs:
            hit = c.get(s, need_boundary=True)
            assert hit is not None and hit.n == len(s)
            assert_prefix_hit(hit, s)
            assert hit.boundary["state"].equal(prefix_snapshot(s, boundary=True).boundary["state"])
        st = c.stats()
        assert st["tiers"]["ssd"]["hits"] >= len(seqs) and st["tiers"]["ram"]["entries"] > 0  # promoted


def test_corruption_is_a_miss_quarantined_and_counted(daemon_factory):
    d = daemon_factory("--ram-mb", "64")
    seqs = {name: np.arange(256) + 50_000 * i for i, name in enumerate(["flip", "trunc", "gone", "fine"])}
    with d.client("rot", strict=True) as c:
        for s in seqs.values():
            assert c.put(s, prefix_snapshot(s))
    assert d.stop() == 0
    flip, trunc, gone = (chunk_blob(d.data_dir, "rot", seqs[n], 0) for n in ("flip", "trunc", "gone"))
    raw = bytearray(flip.read_bytes())
    raw[-3] ^= 0x40
    flip.write_bytes(bytes(raw))
    trunc.write_bytes(trunc.read_bytes()[:-100])
    gone.unlink()
    d.start()
    with d.client("rot", strict=True) as c:
        for name in ("flip", "trunc", "gone"):
            assert c.get(seqs[name]) is None, name
            assert c.probe(seqs[name]).n == 0, name  # never reported again
        hit = c.get(seqs["fine"])
        assert hit.n == 256
        assert_prefix_hit(hit, seqs["fine"])
        # Quarantining is the writer thread's job, queued by the failed reads.
        # An SSD GC runs on that thread after them, in order: once it has
        # answered, they are done (a barrier, not a wait).
        c.gc(ssd_bytes=1 << 40, dry_run=True)
        ssd = c.stats()["tiers"]["ssd"]
        assert ssd["checksum_failures"] == 2 and ssd["quarantined"] == 2
        # the daemon keeps serving and can store the same chunks again
        assert c.put(seqs["flip"], prefix_snapshot(seqs["flip"]))
        assert_prefix_hit(c.get(seqs["flip"]), seqs["flip"])
    assert len(list((d.data_dir / QUARANTINE_DIR).iterdir())) >= 2


def test_kill_9_during_heavy_spill_then_every_reported_chunk_is_exact(daemon_factory):
    d = daemon_factory("--ram-mb", "1", "--ssd-gb", "0.05")
    rng = random.Random(1234)
    seqs = [np.arange(256 + 64 * (i % 5)) + 1_000 * i for i in range(400)]
    cursor = 0
    for round_ in range(8):
        stop = threading.Event()

        def writer(start: int) -> None:
            with d.client("crash", timeout=2.0) as c:
                i = start
                while not stop.is_set():
                    s = seqs[i % len(seqs)]
                    c.put(s, prefix_snapshot(s))
                    i += 1

        t = threading.Thread(target=writer, args=(cursor,))
        t.start()
        time.sleep(rng.uniform(0.2, 0.8))
        d.kill()
        stop.set()
        t.join(10)
        assert not t.is_alive(), "a client call hung across the kill -9"
        cursor += 37
        d.start()
        with d.client("crash", strict=True) as c:
            for s in seqs[::13]:
                n = c.probe(s).n
                if n:
                    hit = c.get(s)
                    assert hit is not None and hit.n >= min(n, 256) - 0, (round_, n)
                    assert_prefix_hit(hit, s)
    # after the last restart's reconcile: no temp files, no orphans
    with d.client("crash", strict=True) as c:
        deadline = time.monotonic() + 10
        while not c.stats()["tiers"]["ssd"].get("reconciled") and time.monotonic() < deadline:
            time.sleep(0.1)
        report = c.gc(orphans=True, dry_run=True)
        assert report["entries"] == 0 and report["bytes"] == 0, report
    assert not [p for p in d.data_dir.rglob("*") if p.name.endswith(TMP_SUFFIX)]


def test_offline_stats_beside_daemon_and_offline_gc_when_stopped(daemon_factory):
    d = daemon_factory("--ram-mb", "1")
    with d.client("off", strict=True) as c:
        for i in range(20):  # ~3.4 MiB through a 1 MiB RAM tier
            s = np.arange(512) + 1000 * i
            assert c.put(s, prefix_snapshot(s))
        assert wait_spilled(c, 20)["entries"] >= 20
    r = kvd("stats", "--offline", "--json", "--data-dir", str(d.data_dir))
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["namespaces"]["off"]["entries"] >= 20 and st["locked_by"] == d.proc.pid
    assert d.stop() == 0
    orphan = d.data_dir / BLOB_DIR / "ff" / ("ff" * 33 + ".safetensors")
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"junk")
    r = kvd("gc", "--endpoint", d.endpoint, "--timeout", "0.5", "--data-dir", str(d.data_dir), "--json")
    assert r.returncode == 0, r.stderr
    assert not orphan.exists()
    r = kvd("gc", "--namespace", "off", "--endpoint", d.endpoint, "--timeout", "0.5", "--data-dir", str(d.data_dir), "--json")
    assert json.loads(r.stdout)["details"]["dropped"]["entries"] >= 20
    st = json.loads(kvd("stats", "--offline", "--json", "--data-dir", str(d.data_dir)).stdout)
    assert st["entries"] == 0 and st["locked_by"] is None


def test_a_read_that_finds_no_free_fd_is_a_miss_and_the_blob_stays(daemon_factory):
    """Regression (a red-team find): with the daemon's fd table full for a
    moment (EMFILE), a GET from the SSD tier quarantined the intact blobs it
    could not open: acknowledged write-through entries lost for good."""
    import resource

    d = daemon_factory("--ram-mb", "16", "--write-through", "--pack-max-kb", "0")
    seqs = [np.arange(512) + 10_000 * i for i in range(3)]
    with d.client("fds", strict=True) as c:
        for s in seqs:
            assert c.put(s, prefix_snapshot(s))
        c.gc(ram_bytes=0)  # on the SSD tier only: a GET opens their blob files
        pid = d.proc.pid
        was = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        # No fd number free below the limit: every open is EMFILE (a limit at the lowest free
        # number was not enough: the daemon's own short-lived files, a pressure poll's, come and go).
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (3, was[1]))
        try:
            assert c.get(seqs[0]) is None  # no fd for the blob: a miss (on a connection made before)
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, was)
        ssd = c.stats()["tiers"]["ssd"]
        assert ssd["quarantined"] == 0 and ssd["read_transient"] >= 1 and not ssd["degraded"], ssd
        for s in seqs:
            assert_prefix_hit(c.get(s), s)
