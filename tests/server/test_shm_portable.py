"""The portable host (`host = portable`, KVD_HOST): the POSIX-only mechanisms
macOS runs, selected on Linux so these tests run macOS's code. Against a
real `kvd serve`: the selection takes effect (`kvd stats --json`'s `host`
section)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

from kvd.host.segments import shmem_huge_policy
from kvd.protocol import codec
from kvd.server.shm.folders import plane_dirs
from kvd_client._shm import Link, ShmUnavailable
from support import ALL_DTYPES, ask_raw, assert_prefix_hit, prefix_snapshot, wait_until
from test_shm_handout import ask_fds


def test_the_host_section_names_each_concerns_mechanism(daemon_factory):
    auto = daemon_factory("--ram-mb", "64", env={"KVD_HOST": "auto"})  # whatever KVD_TEST_HOST says
    portable = daemon_factory("--ram-mb", "64", env={"KVD_HOST": "portable"})
    linux = {"process_memory": "statm", "peer_credentials": "SO_PEERCRED", "service": "systemd"}
    policy = shmem_huge_policy()  # the machine's: 2 MiB pages only where it lets a mapping ask
    pages = f"2 MiB (shmem THP {policy})" if policy in ("always", "within_size", "advise", "force") else "4 KiB"
    with auto.client() as c:
        stats = _sampled(c)
        assert stats["host"] == {"host": "auto", "shared_memory": "memfd", "open_fds": "/proc/self/fd",
                                 "accept_guard": "patched accept", "memory_pressure": "meminfo+psi+cgroup", **linux,
                                 "shared_memory_pages": pages}
        assert stats["peers"]["accept_guard"] is True
        assert ("psi some" in stats["pressure"]["reason"]) == os.path.exists("/proc/pressure/memory")
    with portable.client() as c:
        stats = _sampled(c)
        assert stats["host"] == {"host": "portable", "shared_memory": "shm_open", "open_fds": "/dev/fd",
                                 "accept_guard": "gate only", "memory_pressure": "meminfo+cgroup", **linux,
                                 "shared_memory_pages": "4 KiB"}
        # Each selection took effect, not only its name: libzmq's accept() is
        # not patched and PSI is not read (what macOS runs).
        assert stats["peers"]["accept_guard"] is False
        assert "psi" not in stats["pressure"]["reason"] and "MemAvailable" in stats["pressure"]["reason"]


def _sampled(client) -> dict:
    """Stats once the pressure source has been read (the governor's first tick)."""
    wait_until(lambda: client.stats()["pressure"]["reason"] != "not sampled yet", what="a pressure sample")
    return client.stats()


def _portable(daemon_factory, *args: str):
    return daemon_factory("--ram-mb", "64", "--data-dir", "none", *args, env={"KVD_HOST": "portable"})


@pytest.mark.parametrize("put_via,get_via", [("shm", "shm"), ("frames", "shm"), ("shm", "frames")])
def test_shm_open_segments_round_trip_every_dtype_bit_exact(daemon_factory, put_via, get_via):
    d = _portable(daemon_factory)
    toks = np.arange(700)
    snap = prefix_snapshot(toks, boundary=True)
    assert {name.split(".", 1)[1] for name in snap.sliced} == set(ALL_DTYPES)
    with d.client("rt", strict=True, transport=put_via) as p:
        assert p.put(toks, snap)
        assert p.counters["shm_puts"] == (put_via == "shm")
    with d.client("rt", strict=True, transport=get_via) as g:
        hit = g.get(toks, need_boundary=True)
        assert_prefix_hit(hit, toks)
        assert hit.boundary["state"].array.tobytes() == snap.boundary["state"].array.tobytes()
        assert g.counters["shm_gets"] == (get_via == "shm")


def _named(inodes: set[int]) -> set[str]:
    """Names in /dev/shm of these objects. By inode, not by comparing listings:
    other processes of this uid (other daemons, their probes) make names there too."""
    found = set()
    for n in os.listdir("/dev/shm"):
        try:
            if os.stat("/dev/shm/" + n).st_ino in inodes:
                found.add(n)
        except OSError:  # gone meanwhile
            continue
    return found


def _segment_inodes(folder: Path, run: str) -> tuple[set[int], list[int]]:
    """The inodes of this run's live segments (the first 32 indexes), and the
    fds the hand-out gave for them (the caller closes them)."""
    statuses, fds = ask_fds(folder / "fds", [f"kvd-{run}-{i}" for i in range(32)])
    assert statuses.count("ok") == len(fds) >= 1
    return {os.fstat(fd).st_ino for fd in fds}, fds


def test_no_segment_keeps_a_name_once_made_and_a_client_connecting_later_gets_them_by_fd(daemon_factory):
    """Segments are POSIX shm objects whose names are unlinked as soon as they
    are made: while the daemon serves, with segments live (prepared ones too),
    none is named in /dev/shm and the folder holds only the nonce and the
    hand-out socket. A client that connects later still gets hits over shared
    memory, bit-exact, its segments handed over by fd; a kill -9 leaves no
    name behind, and the next start sweeps the folder."""
    d = _portable(daemon_factory)
    toks = np.arange(700)
    snap = prefix_snapshot(toks, boundary=True)
    with d.client("obj", strict=True, transport="shm") as c:
        assert c.put(toks, snap) and c.counters["shm_puts"] == 1
        s = c.stats()["shm"]
    folder = Path(s["dir"])
    assert s["segments"] >= 1 and s["handout_fds_handed"] >= 1
    inodes, fds = _segment_inodes(folder, s["run"])
    try:
        assert len(inodes) >= s["segments"] and _named(inodes) == set()  # every segment live (more prepared meanwhile), none named
        assert sorted(os.listdir(folder)) == ["fds", "nonce"]
        assert stat.S_ISSOCK(os.lstat(folder / "fds").st_mode)
        with d.client("obj", strict=True, transport="shm") as later:
            hit = later.get(toks, need_boundary=True)
            assert_prefix_hit(hit, toks)
            assert hit.boundary["state"].array.tobytes() == snap.boundary["state"].array.tobytes()
            assert later.counters["shm_gets"] == 1
        d.kill()
        assert _named(inodes) == set()  # nothing for a kill -9 to leave (we still hold the objects)
    finally:
        for fd in fds:
            os.close(fd)
    d.start()
    assert plane_dirs(d.workdir / "kvd.sock") != [folder] and not folder.exists()
    with d.client("obj", strict=True, transport="shm") as c:
        assert c.put(toks, prefix_snapshot(toks)) and c.counters["shm_puts"] == 1
        assert_prefix_hit(c.get(toks), toks)
        s = c.stats()["shm"]
    inodes, fds = _segment_inodes(Path(s["dir"]), s["run"])
    for fd in fds:
        os.close(fd)
    d.stop()
    assert _named(inodes) == set()


def test_an_older_client_refuses_the_offer_cleanly_and_uses_frames(daemon_factory):
    """A client of revision 1.13 requires `dir` in the offer: the hand-out's
    offer has none, so such a client refuses the offer when it makes its link
    (frames from then on) instead of taking grants it cannot map."""
    d = _portable(daemon_factory)
    offer = ask_raw(d.endpoint, codec.encode("HELLO", {"versions": [1]}, id=1))["shm"]
    assert "dir" not in offer and offer["handout"].endswith("/fds")
    with pytest.raises(ShmUnavailable, match="dir None"):
        Link({k: v for k, v in offer.items() if k != "handout"})  # what an older client sees


@pytest.mark.parametrize("reader", ["frames", "shm"])
def test_a_segment_cut_short_under_the_daemon_costs_its_entries_never_the_daemon(daemon_factory, reader):
    """On the portable host (as on macOS without its refusal of a second
    ftruncate) a process of the daemon's uid can cut a shm_open segment short;
    touching a mapped page past the new end would be SIGBUS. The daemon reads
    such segments with pread: the entry a client wrote there is a miss (a
    short read), dropped; the daemon stays up and serves another client over
    shared memory, in a segment that is whole."""
    d = _portable(daemon_factory)
    toks, other = np.arange(512), np.arange(5000, 5512)
    with d.client("cut", strict=True, transport="shm") as a:
        assert a.put(toks, prefix_snapshot(toks)) and a.counters["shm_puts"] == 1
        folder = Path(a.stats()["shm"]["dir"])
        run, live = a.stats()["shm"]["run"], a.stats()["shm"]["segments"]
    statuses, fds = ask_fds(folder / "fds", [f"kvd-{run}-{i}" for i in range(live + 4)])
    assert fds and statuses.count("ok") == len(fds)
    for fd in fds:
        os.ftruncate(fd, 0)  # what any process of this uid holding the fd may do
        os.close(fd)
    with d.client("cut", transport=reader) as b:
        assert b.get(toks) is None  # damaged: a miss, not a crash
    with d.client("cut", strict=True, transport="shm") as c:
        assert c.put(other, prefix_snapshot(other)) and c.counters["shm_puts"] == 1
        assert_prefix_hit(c.get(other), other)
        assert c.counters["shm_gets"] == 1
        s = c.stats()
    assert s["shm"]["shrunk_segments"] >= 1
    assert d.proc.poll() is None
