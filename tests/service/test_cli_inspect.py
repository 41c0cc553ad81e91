"""kvd ls, kvd verify, kvd stats --watch against a real daemon and data dir."""

from __future__ import annotations

import json

import numpy as np

from support import chunk_blob, kvd, prefix_snapshot


def test_ls_lists_namespaces_with_tokens_and_last_use(kvd_daemon):
    with kvd_daemon.client("model-a", strict=True) as a, kvd_daemon.client("model-b", strict=True) as b:
        prefix = np.arange(512)
        for tail in (1, 2, 3):  # three sequences sharing a 512-token prefix
            s = np.concatenate([prefix, np.full(100, tail)])
            assert a.put(s, prefix_snapshot(s))
        assert b.put(np.arange(300), prefix_snapshot(np.arange(300)))
    r = kvd("ls", "--json", "--endpoint", kvd_daemon.endpoint)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert rows["model-a"]["entries"] == 5 and rows["model-a"]["tokens"] == 512 + 3 * 100  # shared prefix once
    assert rows["model-b"]["tokens"] == 300 and rows["model-b"]["last_used"] > 0
    table = kvd("ls", "--endpoint", kvd_daemon.endpoint).stdout
    assert "model-a" in table and "812" in table and "ago" in table


def test_verify_finds_corruption_and_the_daemon_quarantines_it(daemon_factory):
    d = daemon_factory("--ram-mb", "64", "--write-through")
    seqs = [np.arange(256) + 1000 * i for i in range(4)]
    with d.client("v", strict=True) as c:
        for s in seqs:
            assert c.put(s, prefix_snapshot(s))
        c.stats()
    import time

    deadline = time.monotonic() + 10
    while len(list((d.data_dir / "blobs").rglob("*.safetensors"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    r = kvd("verify", "--data-dir", str(d.data_dir), "--endpoint", d.endpoint, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["failed"] == 0, r.stdout + r.stderr
    bad = chunk_blob(d.data_dir, "v", seqs[1], 0)
    raw = bytearray(bad.read_bytes())
    raw[len(raw) // 2] ^= 1
    bad.write_bytes(bytes(raw))
    r = kvd("verify", "--dry-run", "--data-dir", str(d.data_dir), "--endpoint", d.endpoint, "--json")
    rep = json.loads(r.stdout)
    assert r.returncode == 1 and rep["failed"] == 1 and rep["quarantined"] == 0 and bad.exists()
    r = kvd("verify", "--data-dir", str(d.data_dir), "--endpoint", d.endpoint)
    assert r.returncode == 1 and "1 failed, 1 quarantined by the daemon" in r.stdout, r.stdout
    assert not bad.exists()
    with d.client("v", strict=True) as c:
        assert c.stats()["tiers"]["ssd"]["quarantined"] >= 1
        assert c.get(seqs[0]).n == 256  # the rest keeps serving (from RAM or SSD)
    r = kvd("verify", "--data-dir", str(d.data_dir), "--endpoint", d.endpoint, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["checked"] == 3


def test_verify_without_a_daemon_quarantines_in_the_data_dir(daemon_factory):
    d = daemon_factory("--ram-mb", "64")
    seqs = [np.arange(256) + 1000 * i for i in range(3)]
    with d.client("v", strict=True) as c:
        for s in seqs:
            assert c.put(s, prefix_snapshot(s))
    assert d.stop() == 0  # flushes RAM to disk
    bad = chunk_blob(d.data_dir, "v", seqs[2], 0)
    bad.write_bytes(bad.read_bytes()[:-8])
    r = kvd("verify", "--data-dir", str(d.data_dir), "--endpoint", d.endpoint, "--timeout", "0.5")
    assert r.returncode == 1 and "quarantined in the data dir" in r.stdout, r.stdout + r.stderr
    assert list((d.data_dir / "quarantine").iterdir())
    d.start()
    with d.client("v", strict=True) as c:
        assert c.get(seqs[2]) is None and c.get(seqs[0]).n == 256


def test_stats_watch_refreshes_in_place(kvd_daemon):
    # piped: three plain tables (no escape codes in a file)
    r = kvd("stats", "--watch", "0.1", "--count", "3", "--endpoint", kvd_daemon.endpoint)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("requests:") == 3 and "\x1b[" not in r.stdout
    # on a terminal: each refresh homes the cursor and clears the screen
    import os
    import pty
    import subprocess
    import sys

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvd", "stats", "--watch", "0.1", "--count", "2", "--endpoint", kvd_daemon.endpoint],
        stdout=follower, stderr=follower, stdin=follower,
    )
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    assert proc.wait(30) == 0
    assert out.count(b"\x1b[H\x1b[2J") == 2, out[:200]


def test_offline_commands_read_the_running_daemons_data_dir_and_say_so(daemon_factory, tmp_path):
    # The configured data dir (the sandbox's default) is not the daemon's:
    # without --data-dir, the offline commands must read the daemon's.
    d = daemon_factory("--ram-mb", "16")
    said = f"kvd: reading {d.data_dir} (the data dir of the daemon at {d.endpoint})"
    r = kvd("stats", "--offline", "--json", "--endpoint", d.endpoint)
    assert r.returncode == 0 and json.loads(r.stdout)["data_dir"] == str(d.data_dir), r.stderr
    assert said in r.stderr.splitlines()
    r = kvd("ls", "--offline", "--endpoint", d.endpoint)
    assert r.returncode == 0 and said in r.stderr.splitlines(), r.stderr
    r = kvd("verify", "--endpoint", d.endpoint)
    assert r.returncode == 0 and "checked 0 blobs: 0 failed" in r.stdout and said in r.stderr.splitlines(), r.stderr
    # --data-dir still wins, and is named as the reason
    other = tmp_path / "other"
    r = kvd("verify", "--endpoint", d.endpoint, "--data-dir", str(other))
    assert r.returncode == 1 and f"kvd: reading {other} (flag:--data-dir)" in r.stderr, r.stderr
    # no daemon: the configured folder, and why
    d.stop()
    r = kvd("stats", "--offline", "--endpoint", d.endpoint, "--timeout", "0.5", "--data-dir", str(d.data_dir))
    assert r.returncode == 0 and f"kvd: reading {d.data_dir} (flag:--data-dir)" in r.stderr, r.stderr
    r = kvd("ls", "--offline", "--endpoint", d.endpoint, "--timeout", "0.5")
    assert f"no daemon answers at {d.endpoint}" in r.stderr, r.stderr
