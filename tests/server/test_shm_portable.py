"""The portable host (`host = portable`, KVD_HOST): the POSIX-only mechanisms
macOS runs, selected on Linux so these tests run macOS's code. Against a
real `kvd serve`: the selection takes effect (`kvd stats --json`'s `host`
section)."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import numpy as np
import pytest

from kvd.protocol.shm import parse_segment_name
from support import ALL_DTYPES, assert_prefix_hit, prefix_snapshot, wait_until


def test_the_host_section_names_each_concerns_mechanism(daemon_factory):
    auto = daemon_factory("--ram-mb", "64", env={"KVD_HOST": "auto"})
    portable = daemon_factory("--ram-mb", "64", env={"KVD_HOST": "portable"})
    linux = {"process_memory": "statm", "peer_credentials": "SO_PEERCRED", "service": "systemd"}
    with auto.client() as c:
        stats = _sampled(c)
        assert stats["host"] == {"host": "auto", "shared_memory": "memfd", "open_fds": "/proc/self/fd",
                                 "accept_guard": "patched accept", "memory_pressure": "meminfo+psi+cgroup", **linux}
        assert stats["peers"]["accept_guard"] is True
        assert ("psi some" in stats["pressure"]["reason"]) == os.path.exists("/proc/pressure/memory")
    with portable.client() as c:
        stats = _sampled(c)
        assert stats["host"] == {"host": "portable", "shared_memory": "shm_open", "open_fds": "/dev/fd",
                                 "accept_guard": "gate only", "memory_pressure": "meminfo+cgroup", **linux}
        # Each selection took effect, not only its name: libzmq's accept() is
        # not patched and PSI is not read (what macOS runs).
        assert stats["peers"]["accept_guard"] is False
        assert "psi" not in stats["pressure"]["reason"] and "MemAvailable" in stats["pressure"]["reason"]


def _sampled(client) -> dict:
    """Stats once the pressure source has been read (the governor's first tick)."""
    wait_until(lambda: client.stats()["pressure"]["reason"] != "not sampled yet", what="a pressure sample")
    return client.stats()


def _objects() -> set[str]:
    """This user's kvd shm_open objects (Linux keeps them in /dev/shm)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"kvd-{os.getuid()}-")
            and not os.path.isdir("/dev/shm/" + n)}  # the planes' folders are named kvd-<uid>-... too


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


def test_segments_are_private_memory_objects_named_in_the_folder_and_gone_after_a_stop(daemon_factory):
    """Segments are POSIX shm objects (memory: /dev/shm on Linux), 0600,
    named `/kvd-<uid>-<hex>` within macOS's 31 characters; the folder holds
    only their names (no segment file, no /proc link); a clean stop unlinks
    them, and a start after a kill -9 unlinks what the killed run left."""
    before = _objects()
    d = _portable(daemon_factory)
    toks = np.arange(512)
    with d.client("obj", strict=True, transport="shm") as c:
        assert c.put(toks, prefix_snapshot(toks)) and c.counters["shm_puts"] == 1
        folder = Path(c.stats()["shm"]["dir"])
    records = [n for n in os.listdir(folder) if n.endswith(".shm")]
    assert records and not [n for n in os.listdir(folder) if parse_segment_name(n)]
    names = {(folder / r).read_text() for r in records}
    for name in names:
        assert len(name) <= 31 and re.fullmatch(rf"/kvd-{os.getuid()}-[0-9a-f]+", name)
        st = os.stat("/dev/shm" + name)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    assert names <= {"/" + n for n in _objects() - before}
    d.kill()  # (segments prepared ahead of demand may have come meanwhile: read the names again)
    names = {(folder / r).read_text() for r in os.listdir(folder) if r.endswith(".shm")}
    assert {"/" + n for n in _objects() - before} == names  # a kill leaves them ...
    d.start()  # ... the next start on the endpoint sweeps them
    assert not names & {"/" + n for n in _objects()}
    with d.client("obj", strict=True, transport="shm") as c:
        assert c.put(toks, prefix_snapshot(toks)) and c.counters["shm_puts"] == 1
        assert_prefix_hit(c.get(toks), toks)
    d.stop()
    assert _objects() == before


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
    names = [(folder / n).read_text() for n in os.listdir(folder) if n.endswith(".shm")]
    assert names
    for name in names:
        os.truncate("/dev/shm" + name, 0)  # what any process of this uid may do
    with d.client("cut", transport=reader) as b:
        assert b.get(toks) is None  # damaged: a miss, not a crash
    with d.client("cut", strict=True, transport="shm") as c:
        assert c.put(other, prefix_snapshot(other)) and c.counters["shm_puts"] == 1
        assert_prefix_hit(c.get(other), other)
        assert c.counters["shm_gets"] == 1
        s = c.stats()
    assert s["shm"]["shrunk_segments"] >= 1
    assert d.proc.poll() is None
