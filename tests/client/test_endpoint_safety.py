"""kvd.endpoint rules 3 and 5 for one user: where the default socket lives, and
what a run dir or socket must look like before anyone uses it. The same
rules against a second real user are in test_two_users.py (root only)."""

from __future__ import annotations

import os
import socket
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

from kvd.endpoint import (
    MAX_IPC_PATH,
    UnsafeEndpoint,
    check_run_dir,
    check_socket,
    default_endpoint,
    default_run_dirs,
)
from kvd_client import Client
from support import prefix_snapshot

linux_only = pytest.mark.skipif(sys.platform == "darwin", reason="the Linux defaults")


@linux_only
def test_default_is_the_runtime_dir_then_the_users_cache_then_tmp(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert default_endpoint({"XDG_RUNTIME_DIR": str(run), "HOME": "/h"}) == f"ipc://{run}/kvd/kvd.sock"
    assert default_endpoint({"HOME": "/home/u"}) == "ipc:///home/u/.cache/kvd/run/kvd.sock"
    assert default_endpoint({"HOME": "/h", "XDG_CACHE_HOME": "/c"}) == "ipc:///c/kvd/run/kvd.sock"
    assert default_endpoint({"HOME": "/h", "XDG_CACHE_HOME": "relative"}) == "ipc:///h/.cache/kvd/run/kvd.sock"
    # Only when the cache path does not fit in sun_path: /tmp, checked like the others.
    deep = "/" + "d" * (MAX_IPC_PATH - len("/kvd/run/kvd.sock"))
    assert default_endpoint({"HOME": "/h", "XDG_CACHE_HOME": deep}) == f"ipc:///tmp/kvd-{os.getuid()}/kvd.sock"
    assert default_endpoint({"HOME": "/h", "XDG_CACHE_HOME": deep[:-1]}) == f"ipc://{deep[:-1]}/kvd/run/kvd.sock"
    assert Path(f"/tmp/kvd-{os.getuid()}") in default_run_dirs({"HOME": "/h"})


def test_run_dir_must_be_a_private_real_directory_of_ours(tmp_path):
    good = tmp_path / "good"
    good.mkdir(mode=0o700)
    good.chmod(0o700)
    check_run_dir(good)
    check_run_dir(tmp_path / "missing")  # whoever creates it creates it 0700
    for mode in (0o750, 0o705, 0o755, 0o777):
        good.chmod(mode)
        with pytest.raises(UnsafeEndpoint) as err:
            check_run_dir(good)
        assert str(err.value) == (
            f"refusing the kvd run directory {good}: it has mode {mode:04o}: other users may use it "
            "(chmod 700 it if it is yours)"
        )
    good.chmod(0o700)
    link = tmp_path / "link"
    link.symlink_to(good)
    with pytest.raises(UnsafeEndpoint, match="it is a symbolic link, not a directory"):
        check_run_dir(link)
    (tmp_path / "file").write_text("")
    with pytest.raises(UnsafeEndpoint, match="it is not a directory"):
        check_run_dir(tmp_path / "file")


def test_socket_file_must_be_a_socket(tmp_path):
    check_socket(tmp_path / "none.sock")
    (tmp_path / "f.sock").write_text("")
    with pytest.raises(UnsafeEndpoint, match=f"refusing the kvd socket {tmp_path}/f.sock: it is not a socket"):
        check_socket(tmp_path / "f.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(tmp_path / "s.sock"))
    try:
        check_socket(tmp_path / "s.sock")
    finally:
        s.close()


@linux_only
def test_daemon_makes_the_default_run_dir_private_and_refuses_a_loose_one(daemon_factory, tmp_path, monkeypatch):
    home = tmp_path / "h"
    env = {"HOME": str(home), "XDG_CACHE_HOME": str(home / "c")}
    run_dir = home / "c" / "kvd" / "run"
    for umask in (0o000, 0o022):
        old = os.umask(umask)  # the daemon child inherits it; `kvd serve` must override it
        try:
            d = daemon_factory("--ram-mb", "16", start=False, env=env)
            d.endpoint = f"ipc://{run_dir}/kvd.sock"
            d.start()
        finally:
            os.umask(old)
        for path in (run_dir, run_dir / "kvd.sock", run_dir / "kvd.sock.lock"):
            assert stat.S_IMODE(os.lstat(path).st_mode) & 0o077 == 0, (oct(umask), path)
        with d.client() as c:
            s = np.arange(256)
            assert c.put(s, prefix_snapshot(s))
        d.stop()
    run_dir.chmod(0o755)
    d = daemon_factory("--ram-mb", "16", start=False, env=env)
    d.endpoint = f"ipc://{run_dir}/kvd.sock"
    d.start(wait=False)
    assert d.proc.wait(30) == 78
    assert f"refusing the kvd run directory {run_dir}: it has mode 0755" in d.log()
    # The client (with the same environment) refuses it too: one warning, a miss, no connection.
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with Client(namespace="x", timeout=1) as c:
        assert c.get(np.arange(256)) is None
        assert c.counters["error_unsafe_endpoint"] == 1
    with pytest.raises(UnsafeEndpoint, match="has mode 0755"):
        Client(namespace="x", timeout=1, strict=True).ping()


def test_an_abstract_socket_is_refused_by_client_daemon_and_cli(tmp_path):
    """`ipc://@name` has no file, so no owner or mode: another user could
    connect to the daemon or serve the name first (a red-team pass read a
    cache across users both ways). Refused before any socket is made."""
    import subprocess

    from kvd.endpoint import EndpointError, check_endpoint

    with pytest.raises(EndpointError, match="abstract socket"):
        check_endpoint("ipc://@kvd-test")
    with pytest.raises(EndpointError):
        Client("ipc://@kvd-test", namespace="x")
    r = subprocess.run([sys.executable, "-m", "kvd", "serve", "--endpoint", "ipc://@kvd-test", "--data-dir", "none"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 78 and "abstract socket" in r.stderr and "Traceback" not in r.stderr


def test_a_fifo_under_the_lock_files_name_never_blocks(tmp_path):
    """In a shared folder another user may plant a FIFO as `<socket>.lock`:
    a client asking whether a daemon holds it, and a daemon taking it, must
    not block in open(); the client misses within its timeout, the daemon
    refuses the lock."""
    import subprocess
    import time

    from kvd.endpoint import EndpointLock, UnsafeEndpoint, endpoint_locked

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    endpoint = f"ipc://{run}/kvd.sock"
    os.mkfifo(run / "kvd.sock.lock", 0o600)
    assert endpoint_locked(endpoint) is None
    with Client(endpoint, namespace="x", timeout=1.0) as c:
        t0 = time.monotonic()
        assert c.get(list(range(300))) is None
        assert time.monotonic() - t0 < 5
    with pytest.raises(UnsafeEndpoint, match="not a regular file"):
        EndpointLock(endpoint).acquire()
    r = subprocess.run([sys.executable, "-m", "kvd", "serve", "--endpoint", endpoint, "--data-dir", "none"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 78 and "not a regular file" in r.stderr, r.stderr


@pytest.mark.parametrize("bad", ["tcp://127.0.0.1:99999", "tcp://127.0.0.1:0", "tcp://127.0.0.1", "tcp://:5599",
                                 "tcp://127.0.0.1:x"])
def test_a_tcp_endpoint_needs_a_host_and_a_real_port(bad):
    """A port past 65535 was accepted, and the daemon served on whatever libzmq made of it."""
    from kvd.endpoint import EndpointError, check_endpoint

    with pytest.raises(EndpointError, match="port from 1 to 65535"):
        check_endpoint(bad)
    assert check_endpoint("tcp://127.0.0.1:5599") == "tcp://127.0.0.1:5599"
    assert check_endpoint("tcp://[::1]:5599") == "tcp://[::1]:5599"


def test_a_client_asking_whether_a_daemon_is_there_never_stops_it_starting(tmp_path):
    """`endpoint_locked` (a client whose call found no daemon) flocks the lock
    file for a moment: a daemon starting in that moment had refused to start,
    "another kvd daemon is already serving" (exit 4). The daemon tries again
    for a grace period; a lock held past it is another daemon's."""
    import fcntl

    from kvd.endpoint import EndpointBusy, EndpointLock, endpoint_locked

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    endpoint = f"ipc://{run}/kvd.sock"
    probe = os.open(run / "kvd.sock.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a client's probe, caught holding it
    waits = []

    def probe_done(seconds):  # called only after an attempt found the lock held
        waits.append(seconds)
        fcntl.flock(probe, fcntl.LOCK_UN)

    lock = EndpointLock(endpoint, wait=probe_done)
    lock.acquire()
    assert len(waits) == 1 and endpoint_locked(endpoint) is True
    lock.release()

    # Held for good (another daemon): EndpointBusy once the grace is over, not before.
    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    now = [0.0]

    def advance(seconds):
        now[0] += seconds

    with pytest.raises(EndpointBusy, match="already serving"):
        EndpointLock(endpoint, clock=lambda: now[0], wait=advance).acquire()
    assert EndpointLock.GRACE_S <= now[0] < EndpointLock.GRACE_S + 0.01
    os.close(probe)


def test_where_the_plane_sits_beside_the_socket_its_hand_out_socket_must_fit_too(monkeypatch):
    """macOS (no folder that is memory): a run's shared-memory folder sits beside
    the socket, its hand-out socket `fds` in it, 25 bytes more than the socket's
    path. A run dir where only the socket fit turned shared memory off at every
    start (the hand-out's bind refused); it goes to /tmp instead."""
    import kvd.endpoint as endpoint
    from kvd.server.shm import folders

    monkeypatch.setattr(endpoint, "memory_folder", lambda: None)
    monkeypatch.setattr(folders, "memory_folder", lambda: None)
    sock = Path("/h/x/kvd.sock")
    run_folder = folders.plane_prefix(sock).with_name(folders.plane_prefix(sock).name + "-" + "0" * 16)
    assert folders._RUN_DIR.fullmatch(run_folder.name.removeprefix(folders.plane_prefix(sock).name))
    assert len(str(run_folder / folders.HANDOUT_SOCKET)) - len(str(sock)) == endpoint.PLANE_SOCKET_EXTRA
    fits_alone = "/" + "d" * (MAX_IPC_PATH - len("/kvd/run/kvd.sock") - 1)  # the socket's path is MAX_IPC_PATH long
    assert default_run_dirs({"HOME": "/h", "XDG_CACHE_HOME": fits_alone})[0] == Path(f"/tmp/kvd-{os.getuid()}")
    fits_both = fits_alone[: -endpoint.PLANE_SOCKET_EXTRA]
    assert default_run_dirs({"HOME": "/h", "XDG_CACHE_HOME": fits_both})[0] == Path(f"{fits_both}/kvd/run")
