"""The shared-memory data plane against a real `kvd serve` (PROTOCOL.md section 14).

Bit-exact round trips for every dtype along each path (shm and frames, each
way across); leases that outlive a client killed -9 while reading or while
writing are reclaimed, and a half-written grant is never served; eviction
never frees a leased slot; a daemon killed -9 costs its clients a miss and
leaves no segment after the next start; TCP and forged proofs get frames.
Leases are short (`--shm-lease-s`) and every wait polls STATS to a deadline.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import zmq

from kvd.protocol import codec
from kvd.protocol.errors import BACKLOG_FULL, BadField
from kvd.protocol.shm import parse_segment_name
from kvd.host import segments as shm_server
from kvd.server.shm.folders import plane_dirs, plane_prefix
from kvd_client import Busy, Client
from support import (ALL_DTYPES, TESTS, assert_prefix_hit, assert_wide_hit, free_port, prefix_snapshot, wait_spilled,
                     wait_until, wide_snapshot)



# Segments are sealed memfds on Linux's auto host; the portable host (these
# tests' `[portable]` runs, tests/conftest.py) and macOS have shm_open segments
# (tests/server/test_shm_portable.py).
def memfd_only(reason: str):
    def mark(test):
        return pytest.mark.skipif(not shm_server._SEALED, reason=reason)(pytest.mark.auto_host(reason=reason)(test))
    return mark


def nameless(host: str) -> bool:
    """shm_open segments on Linux have no name: handed out by fd (tests/server/test_shm_handout.py)."""
    return shm_server._SEALED and host == "portable"


def _shm_stats(client) -> dict:
    return client.stats()["shm"]


@pytest.fixture
def short_lease(daemon_factory):
    return daemon_factory("--ram-mb", "64", "--shm-lease-s", "0.5")


@pytest.mark.parametrize("put_via,get_via", [("shm", "shm"), ("frames", "shm"), ("shm", "frames")])
def test_every_dtype_round_trips_bit_exact(kvd_daemon, put_via, get_via):
    toks = np.arange(700)  # two full chunks and a tail
    snap = prefix_snapshot(toks, boundary=True)
    assert {name.split(".", 1)[1] for name in snap.sliced} == set(ALL_DTYPES)
    with kvd_daemon.client("rt", strict=True, transport=put_via) as p:
        assert p.put(toks, snap)
        assert p.counters["shm_puts"] == (put_via == "shm")
    with kvd_daemon.client("rt", strict=True, transport=get_via) as g:
        for _ in range(2):  # the second time, frame-PUT entries already live in shared memory
            hit = g.get(toks, need_boundary=True)
            assert hit is not None and hit.n == 700
            assert_prefix_hit(hit, toks)
            assert hit.boundary["state"].array.tobytes() == snap.boundary["state"].array.tobytes()
        assert g.counters["shm_gets"] == 2 * (get_via == "shm")
        s = _shm_stats(g)
    assert s["adopted_bytes"] > 0 if (put_via, get_via) == ("frames", "shm") else s["adopted_bytes"] == 0


def test_segments_are_private_and_named_for_this_run(kvd_daemon, kvd_host):
    with kvd_daemon.client("priv", strict=True) as c:
        assert c.put(np.arange(300), prefix_snapshot(np.arange(300)))
        s = _shm_stats(c)
    folder = Path(s["dir"])
    prefix = plane_prefix(kvd_daemon.workdir / "kvd.sock")
    assert folder.parent == prefix.parent and re.fullmatch(re.escape(prefix.name) + "-[0-9a-f]{16}", folder.name)
    assert plane_dirs(kvd_daemon.workdir / "kvd.sock") == [folder]
    assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700
    names = sorted(os.listdir(folder))
    if nameless(kvd_host):
        assert names == ["fds", "nonce"]
        names.remove("fds")  # the hand-out's socket
    else:
        assert "kvd-%s-0" % s["run"] in names and "nonce" in names  # and segments prepared ahead
        assert all(n == "nonce" or parse_segment_name(n)[0] == s["run"] for n in names)
    for name in names:
        st = os.stat(folder / name)  # a segment's name may be a symlink to the daemon's memfd
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    assert stat.S_ISREG(os.lstat(folder / "nonce").st_mode)


def test_forged_proof_gets_frames_and_no_slots(kvd_daemon):
    toks = np.arange(300)
    with kvd_daemon.client("forge", strict=True, transport="frames") as c:
        assert c.put(toks, prefix_snapshot(toks))
        seq = c._seq(toks)
        reply = c._transport.request("GET", {**seq, "shm": {"proof": b"\0" * 32, "run": "x"}}, 5)
        assert reply["n"] == 300 and "shm" not in reply.fields
        assert all(isinstance(t.data, memoryview) for ch in reply["chunks"] for t in ch["tensors"])
        spec = [codec.Tensor("k", "float32", (1, 4), None)]
        with pytest.raises(BadField):
            c._transport.request("SLOTS", {**seq, "chunks": [{"index": 0, "tensors": spec}], "shm": {"proof": b"x" * 32}}, 5)
        assert _shm_stats(c)["refused"] == 2


def test_tcp_never_offers_shared_memory(daemon_factory):
    d = daemon_factory("--ram-mb", "64", "--allow-insecure-tcp", start=False)
    d.endpoint = f"tcp://127.0.0.1:{free_port()}"
    d.start()
    with pytest.raises(ValueError):
        Client(d.endpoint, transport="shm")
    with Client(d.endpoint, namespace="tcp", strict=True) as c:
        hello = c.hello()
        assert "shm" not in hello and "shm" not in hello["features"]
        toks = np.arange(300)
        assert c.put(toks, prefix_snapshot(toks))
        assert_prefix_hit(c.get(toks), toks)
        assert c.counters["shm_gets"] == c.counters["shm_puts"] == 0
        assert "shm" not in c.stats()


def test_eviction_never_frees_a_leased_slot(kvd_daemon):
    toks = np.arange(512)
    with kvd_daemon.client("pin", strict=True) as c:
        assert c.put(toks, prefix_snapshot(toks))
        link = c._link()
        reply = c._transport.request("GET", {**c._seq(toks), "shm": link.field()}, 5)
        lease = reply["shm"]["lease"]
        descs = [t.data for ch in reply["chunks"] for t in ch["tensors"]]
        before = [bytes(link.view(d)) for d in descs]
        c.gc(ram_bytes=0)  # evicts every entry: only the lease keeps the slots
        s = _shm_stats(c)
        assert s["leases"] == 1 and s["used_bytes"] > 0
        other = np.arange(10_000, 10_512)  # same size: would land in freed slots
        assert c.put(other, prefix_snapshot(other))
        assert [bytes(link.view(d)) for d in descs] == before
        link.done(lease)
        assert c.get(np.arange(5)) is None  # any shm request carries the release
        s = _shm_stats(c)
        assert s["leases"] == 0 and s["released"] == 1


HOLDER = r"""
import sys, time
sys.path.insert(0, {here!r})
import numpy as np
import zmq
from kvd_client import Client
from kvd.protocol import codec
mode, endpoint = sys.argv[1], sys.argv[2]
c = Client(endpoint, namespace="kill", strict=True, transport="shm")
c._transport._socket().poll(10_000, zmq.POLLOUT)  # connected first (`connected`)
toks = np.arange(512)
link = c._link()
if mode == "read":
    reply = c._transport.request("GET", {{**c._seq(toks), "shm": link.field()}}, 5)
    assert reply["shm"]["lease"]
else:
    specs = [codec.Tensor("k", "float32", (1, 256, 64), None)]
    grant = c._transport.request("SLOTS", {{**c._seq(toks), "chunks": [
        {{"index": 0, "tensors": specs}}, {{"index": 1, "tensors": specs}}], "shm": link.field()}}, 5)
    view = link.view(grant["chunks"][0][0], writable=True)
    view[: len(view) // 2] = b"\x07" * (len(view) // 2)  # half of the first slot, then die
print("READY", flush=True)
time.sleep(600)
"""


def connected(client):
    """`client`, its connection made: a strict client's first request waits
    at most 0.25 s (`connect_wait`) for it and raises past that, and on the
    loaded CI machine a handshake took longer, twice in ~10 runs, both in the
    test below (its client in session 51, its holder child in 52). Why there
    only is not known; a model server meeting it gets a miss."""
    import zmq

    client._transport._socket().poll(10_000, zmq.POLLOUT)
    return client


@pytest.mark.parametrize("mode", ["read", "write"])
def test_client_killed_holding_a_lease_is_reclaimed(short_lease, mode):
    toks = np.arange(512)
    with connected(short_lease.client("kill", strict=True)) as c:
        if mode == "read":
            assert c.put(toks, prefix_snapshot(toks))
        base = _shm_stats(c)["used_bytes"]
        child = subprocess.Popen([sys.executable, "-c", HOLDER.format(here=str(TESTS)), mode, short_lease.endpoint],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "READY"
            s = _shm_stats(c)
            assert s["leases"] == 1 and (mode == "read" or s["used_bytes"] > base)
            child.kill()
            child.wait(10)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(10)
        s = wait_until(lambda: (st := _shm_stats(c))["leases"] == 0 and st, what="the lease to expire")
        assert s["expired"] == 1 and s["used_bytes"] == base  # an uncommitted grant is freed
        if mode == "write":
            assert c.probe(toks).n == 0 and c.get(toks) is None  # the half-written slot was never served
        else:
            assert_prefix_hit(c.get(toks), toks)


def test_commit_after_the_lease_ended_is_refused(short_lease):
    with short_lease.client("late", strict=True) as c:
        link = c._link()
        spec = [codec.Tensor("k", "float32", (1, 64), None)]
        grant = c._transport.request("SLOTS", {**c._seq(np.arange(300)), "chunks": [{"index": 0, "tensors": spec}],
                                               "shm": link.field()}, 5)
        wait_until(lambda: _shm_stats(c)["leases"] == 0, what="the write lease to expire")
        with pytest.raises(BadField):
            c._transport.request("COMMIT", {"lease": grant["lease"], "shm": link.field()}, 5)
        assert c.probe(np.arange(300)).n == 0


def test_daemon_killed_with_slots_mapped(daemon_factory, kvd_host):
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")
    toks = np.arange(512)
    c = d.client("crash", timeout=1.0)
    try:
        assert c.put(toks, prefix_snapshot(toks))
        assert_prefix_hit(c.get(toks), toks)
        old = c.stats()["shm"]
        old_run, folder = old["run"], Path(old["dir"])
        d.kill()
        assert c.get(toks) is None  # a miss, not a crash; the old mapping is still valid memory
        assert nameless(kvd_host) or any(parse_segment_name(n) == (old_run, 0) for n in os.listdir(folder))
        d.start()
        c.retry_now()
        assert c.get(toks) is None  # the new run holds nothing (RAM only); the stale proof gets frames
        new = c.stats()["shm"]
        assert new["run"] != old_run and new["dir"] != str(folder)
        assert not folder.exists()  # the killed run's folder was swept at start
        assert plane_dirs(d.workdir / "kvd.sock") == [Path(new["dir"])]
        assert c.put(toks, prefix_snapshot(toks))
        assert_prefix_hit(c.get(toks), toks)
        assert c.counters["shm_gets"] == 2 and c.counters["shm_puts"] == 2
    finally:
        c.close()
    d.stop()
    assert not folder.exists()  # a clean stop removes its own segments, nonce and folder


def _mappings(link) -> set[tuple[int, int]]:
    """(start address, inode) of each of `link`'s segment mappings."""
    starts = {np.frombuffer(mm, np.uint8, count=1).ctypes.data for mm in link._maps.values()}
    return {m for m in _maps_now() if m[0] in starts}


def _maps_now() -> set[tuple[int, int]]:
    """(start address, inode) of every mapping of this process."""
    out = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            out.add((int(parts[0].split("-")[0], 16), int(parts[4])))
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_runs_segments_are_unmapped_once_the_client_learns_it_ended(daemon_factory):
    """A restarted daemon's old segments, and a closed client's, are unmapped
    at once (the memory of a killed run's segments is freed with their last
    mapping), not left to the garbage collector, which alone could break the
    link's cycle with its premapper: collection is off here."""
    import gc

    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")
    toks = np.arange(512)
    c = d.client("unmap", timeout=1.0)
    gc.disable()
    try:
        assert c.put(toks, prefix_snapshot(toks))
        assert_prefix_hit(c.get(toks), toks)
        old = _mappings(c._shm_link)
        assert old and old <= _maps_now()
        stale = weakref.ref(c._shm_link)
        d.kill()
        d.start()
        c.retry_now()
        assert c.put(toks, prefix_snapshot(toks))  # HELLO: a new offer, a new link
        # (a piece its premapper was populating goes when that piece is done)
        wait_until(lambda: not old & _maps_now(), 10, "the killed run's segments unmapped")
        assert_prefix_hit(c.get(toks), toks)
        assert c.counters["shm_puts"] == 2 and c.counters["shm_gets"] == 2
        new = _mappings(c._shm_link)
        assert new
        link = c._shm_link
        c._shm_reset(stale())  # a thread whose call went out on the killed run's link, late
        assert c._shm_link is link and not link.closed and new <= _maps_now()
        c.close()
        wait_until(lambda: not new & _maps_now(), 10, "a closed client's segments unmapped")
    finally:
        gc.enable()
        c.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_the_clients_of_one_process_share_a_runs_mappings_and_the_last_to_close_unmaps(daemon_factory):
    """Two clients of one process (a server's two models, each a namespace)
    share the run's link: each segment is mapped once in the process, not once
    per client. One closing leaves the others served over shared memory; one
    that could not map a segment lets go of the link alone; one whose proof
    was refused closes it for all, and after a restart each takes the new
    run's, shared again; the last to close unmaps."""
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")
    toks, more = np.arange(512), np.arange(512) + 100_000
    a, b = d.client("model-a", timeout=5.0), d.client("model-b", timeout=5.0)
    c = d.client("model-a", timeout=5.0)  # model-a again, as a client made anew
    try:
        assert a.put(toks, prefix_snapshot(toks))
        assert b.put(more, prefix_snapshot(more))
        assert_prefix_hit(a.get(toks), toks)
        assert_prefix_hit(b.get(more), more)
        link = a._shm_link
        assert b._shm_link is link
        assert (a.counters["shm_puts"], a.counters["shm_gets"], b.counters["shm_puts"], b.counters["shm_gets"]) == (1, 1, 1, 1)
        with link._mu:  # the link's premapper maps nothing meanwhile (the daemon's window grows)
            mapped, held = _mappings(link), len(link._maps)
            inodes = {inode for _, inode in mapped}
            everyone = len([m for m in _maps_now() if m[1] in inodes])
        assert len(mapped) == held  # every (segment, writable) once ...
        assert everyone == len(mapped)  # ... and by no one else here

        a.close()
        assert not link.closed and mapped <= _maps_now()
        assert_prefix_hit(b.get(more), more)
        assert b.counters["shm_gets"] == 2

        assert_prefix_hit(c.get(toks), toks)
        assert c._shm_link is link and c.counters["shm_gets"] == 1
        c._shm_reset(link, ended=False)  # as after a segment it could not map: its own letting go
        assert not link.closed and b._shm_link is link
        assert_prefix_hit(c.get(toks), toks)
        assert c._shm_link is link and c.counters["shm_gets"] == 2

        c._shm_reset(link)  # as a client whose proof was refused does: the run is over for all
        assert link.closed and not link._maps
        assert_prefix_hit(b.get(more), more)  # the run goes on: b asks HELLO, takes it anew, over shared memory
        assert b._shm_link is not link and not b._shm_link.closed and b.counters["shm_gets"] == 3
        assert_prefix_hit(c.get(toks), toks)
        assert c._shm_link is b._shm_link and c.counters["shm_gets"] == 3
        # A link another client closed, its run ended: its offer names a folder
        # the restarted daemon has swept. c takes no link from it: it asks HELLO.
        current = c._shm_link
        where = "handout" if c._shm_offer.get("handout") else "dir"  # (shm_open segments are handed out)
        c._shm_offer = {**c._shm_offer, where: str(Path(c._shm_offer[where]).with_name("gone"))}
        current.close()
        assert_prefix_hit(c.get(toks), toks)
        assert c.counters["shm_gets"] == 4 and c.counters["shm_unavailable"] == 0
        assert c._shm_link is not current and c._shm_link.run == current.run

        d.kill()
        d.start()
        old = c._shm_link
        wait_until(lambda: b.put(more, prefix_snapshot(more)), 10, "b to store into the new daemon")
        wait_until(lambda: c.put(toks, prefix_snapshot(toks)), 10, "c to store into the new daemon")
        renewed = b._shm_link
        assert renewed is not None and renewed.run != old.run and old.closed
        assert c._shm_link is renewed and b.counters["shm_puts"] == 2 and c.counters["shm_puts"] == 1
        assert_prefix_hit(c.get(toks), toks)
        assert c.counters["shm_gets"] == 5
        mapped = _mappings(renewed)
        assert mapped
        b.close()
        assert not renewed.closed and mapped <= _maps_now()  # c still uses them
        assert_prefix_hit(c.get(toks), toks)
        c.close()
        wait_until(lambda: not mapped & _maps_now(), 10, "the last client's close unmaps")
    finally:
        for client in (a, b, c):
            client.close()


def test_a_put_whose_link_is_closed_midway_goes_over_frames_and_maps_nothing_more(kvd_daemon):
    """Another thread closes the link a put is copying into (its daemon's run
    ended, as a HELLO on that thread said): the put is abandoned and sent over
    frames, stored whole; the closed link maps no segment again (nothing would
    unmap it), and a run that ended is no fault of the link's: no cool-off."""
    c = kvd_daemon.client("closed-midway", timeout=5.0)
    try:
        toks = np.arange(512)
        assert c.put(toks, prefix_snapshot(toks)) and c.counters["shm_puts"] == 1
        link = c._shm_link
        view = link.view

        def closing(desc, **kw):
            link.close()  # as the other thread does, between two slots
            return view(desc, **kw)

        link.view = closing
        more = np.arange(512) + 10_000
        assert c.put(more, prefix_snapshot(more))
        assert c.counters["shm_put_abandoned"] == 1 and c.counters["shm_puts"] == 1
        assert not link._maps and not link.broken and c.counters["shm_cooling"] == 0
        assert_prefix_hit(c.get(more), more)
    finally:
        c.close()


def test_planted_folder_names_neither_stop_the_plane_nor_get_removed(daemon_factory, tmp_path):
    """The plane's folder is drawn afresh at each start: names planted where it
    would go (the fixed name daemons before 0.2 used, as a file; the new
    pattern as a symlink) do not turn it off, and only folders of ours are
    swept -- a legacy one with a killed run's segment is."""
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none", start=False)
    sock = d.workdir / "kvd.sock"
    prefix = plane_prefix(sock)
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "kvd-0badc0de-0").write_bytes(b"not the daemon's")
    link = prefix.with_name(prefix.name + "-" + "f" * 16)
    link.symlink_to(target)
    legacy = prefix  # a killed pre-0.2 daemon's folder: ours, with a segment and a nonce
    legacy.mkdir(mode=0o700)
    (legacy / "kvd-0badc0de-0").write_bytes(b"x")
    (legacy / "nonce").write_bytes(b"n")
    try:
        d.start()
        with d.client("plant", strict=True) as c:
            assert c.put(np.arange(300), prefix_snapshot(np.arange(300)))
            assert_prefix_hit(c.get(np.arange(300)), np.arange(300))
            assert c.counters["shm_puts"] == 1 and c.counters["shm_gets"] == 1
            folder = Path(_shm_stats(c)["dir"])
        assert folder not in (link, legacy) and not legacy.exists()
        assert link.is_symlink() and (target / "kvd-0badc0de-0").read_bytes() == b"not the daemon's"
        assert plane_dirs(sock) == [folder]
    finally:
        link.unlink()


@memfd_only("sealed segments are Linux memfds (shm_open: test_shm_portable.py)")
def test_no_process_can_cut_a_segment_short_under_the_daemon(daemon_factory):
    """Truncating a segment file used to kill the daemon with SIGBUS (its
    spill writer, or libzmq sending a frame from the slot) and every client
    that touched it. Segments are memfds sealed against shrinking now."""
    d = daemon_factory("--ram-mb", "64")
    toks = np.arange(512)
    with d.client("cut", strict=True, transport="shm") as c:
        assert c.put(toks, prefix_snapshot(toks)) and c.counters["shm_puts"] == 1
        folder = Path(_shm_stats(c)["dir"])
        segs = [n for n in os.listdir(folder) if parse_segment_name(n)]
        assert segs
        for name in segs:
            assert os.readlink(folder / name).startswith(f"/proc/{d.proc.pid}/fd/")
            with pytest.raises(PermissionError):
                os.truncate(folder / name, 0)
            fd = os.open(folder / name, os.O_RDWR)
            try:
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, 4096)
            finally:
                os.close(fd)
        wait_spilled(c, 2)  # the spill writer read the slots
        assert_prefix_hit(c.get(toks), toks)
    with d.client("cut", strict=True, transport="frames") as f:
        assert_prefix_hit(f.get(toks), toks)  # sent from the slots by libzmq
    assert d.proc.poll() is None


@memfd_only("names are put back for memfd segments (Linux)")
def test_the_plane_is_put_back_after_its_folder_is_removed(daemon_factory):
    """`rm -rf` of the plane's folder (a tmp cleaner, systemd's RemoveIPC) made
    the next segment fail to grow: INTERNAL for SLOTS and shm GETs of frame-PUT
    entries, and good SSD blobs quarantined when a cold read into the arena
    failed. The folder, nonce and names now come back within a second, and
    nothing fails meanwhile."""
    d = daemon_factory("--ram-mb", "64")
    toks = np.arange(512)
    with d.client("gone", strict=True) as c:
        assert c.put(toks, prefix_snapshot(toks)) and c.counters["shm_puts"] == 1
        folder = Path(_shm_stats(c)["dir"])
        wait_spilled(c, 2)
    import shutil

    shutil.rmtree(folder)
    with d.client("gone", strict=True, transport="frames") as w:
        wait_until(lambda: _shm_stats(w)["names_repaired"] >= 1, what="the plane's names put back")
    assert (folder / "nonce").is_file() and stat.S_IMODE(os.lstat(folder).st_mode) == 0o700
    with d.client("gone", strict=True) as c:  # a new link: reads the nonce again
        assert_prefix_hit(c.get(toks), toks)
        more = np.arange(1000, 1600)
        assert c.put(more, prefix_snapshot(more))
        assert_prefix_hit(c.get(more), more)
        assert c.counters["shm_gets"] == 2 and c.counters["shm_puts"] == 1
        assert c.stats()["tiers"]["ssd"]["quarantined"] == 0
    assert "INTERNAL" not in d.log_path.read_text(errors="replace")


@memfd_only("segments are Linux memfds")
@pytest.mark.parametrize("impostor", ["a file", "a memfd of the same name elsewhere"])
def test_a_client_writes_only_into_the_daemons_own_segments(daemon_factory, impostor):
    """A segment's name replaced by a file (rename over it) got a fresh
    client's PUT acknowledged with zeros stored (red-team). A client now
    follows a segment's name only to the daemon's memfd of that name; else
    the PUT goes over frames, and what is stored is what was put."""
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")
    toks, other = np.arange(512), np.arange(2000, 2512)
    with d.client("imp", strict=True) as c:
        assert c.put(toks, prefix_snapshot(toks)) and c.counters["shm_puts"] == 1
        folder, run = Path(_shm_stats(c)["dir"]), _shm_stats(c)["run"]
    name = folder / f"kvd-{run}-0"
    size = os.stat(name).st_size
    keep = None
    if impostor == "a file":
        fake = folder / "impostor"
        fake.write_bytes(b"")
        os.truncate(fake, size)
        os.replace(fake, name)
    else:
        keep = os.memfd_create(name.name)
        os.ftruncate(keep, size)
        os.unlink(name)
        os.symlink(f"/proc/{os.getpid()}/fd/{keep}", name)
    try:
        with d.client("imp", strict=True) as c:  # a fresh link: maps segment 0 anew
            assert c.put(other, prefix_snapshot(other))
            # Over frames; or over shm if the daemon's repair (each second)
            # put the real name back first: exact bytes either way.
            assert c.counters["shm_put_abandoned"] + c.counters["shm_puts"] == 1
        with d.client("imp", strict=True, transport="frames") as f:
            assert_prefix_hit(f.get(other), other)
            assert_prefix_hit(f.get(toks), toks)
    finally:
        if keep is not None:
            os.close(keep)


def test_a_get_that_asks_for_layouts_has_its_chunks_placed_and_one_that_does_not_has_maps(kvd_daemon):
    """Section 14, placed chunks: asked (`layouts: true`), every chunk comes as
    its layout and places, full chunks sharing one layout and the last (40
    tokens) its own; not asked (a client of revision 1.21), tensor maps as
    before. Both name the same bytes, each with its digest."""
    toks = np.arange(552)
    with kvd_daemon.client("placed", strict=True) as c:
        assert c.put(toks, prefix_snapshot(toks))
        assert "shm_layouts" in c._features
        link = c._link()
        asked = c._transport.request("GET", {**c._seq(toks), "shm": {**link.field(), "layouts": True}}, 5)
        plain = c._transport.request("GET", {**c._seq(toks), "shm": link.field()}, 5)
        assert [ch.get("layout") for ch in asked["chunks"]] == [0, 0, 1] and len(asked["layouts"]) == 2
        assert [len(ch["places"]) for ch in asked["chunks"]] == [24 * len(asked["layouts"][0])] * 2 + [24 * len(asked["layouts"][1])]
        assert "layouts" not in plain.fields and all("layout" not in ch for ch in plain["chunks"])

        def named(reply):
            return [[(t.name, t.dtype, t.shape, t.data.length, bytes(link.view(t.data))) for t in ch["tensors"]]
                    for ch in reply["chunks"]]

        assert named(asked) == named(plain)
        assert all(t.data.digest is not None for ch in asked["chunks"] for t in ch["tensors"])
        for reply in (asked, plain):
            link.done(reply["shm"]["lease"])
        hit = c.get(toks)  # the client asks for layouts itself
        assert hit.n == 552
        assert_prefix_hit(hit, toks)


def test_old_clients_without_shm_keep_working(kvd_daemon):
    """A kvd/1 client that never asks for shm: plain GET, frames back."""
    toks = np.arange(300)
    with kvd_daemon.client("old", strict=True) as c:
        assert c.put(toks, prefix_snapshot(toks))
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.connect(kvd_daemon.endpoint)
    try:
        seq = {"ns": "old", "tokens": np.arange(300, dtype="<u4").tobytes(), "chunk_tokens": 256}
        s.send_multipart(codec.encode("GET", seq, id=1))
        assert s.poll(5000)
        reply = codec.decode_reply(s.recv_multipart())
        assert reply.type == "GET" and reply["n"] == 300 and "shm" not in reply.fields
    finally:
        s.close(0)


@memfd_only("shm_open segments can be cut short: cold hits land in the heap first")
def test_a_cold_hit_is_checked_in_private_memory_then_moved_in_with_its_digests(daemon_factory):
    """An SSD-tier read is checked in the heap, where no other process can
    write; the shm GET moves it into slots with digests fixed from those bytes
    (tests/server/test_shm_integrity.py: a write into the slot after is a miss)."""
    d = daemon_factory("--ram-mb", "64")
    toks = np.arange(700)
    with d.client("cold", strict=True, transport="frames") as c:
        assert c.put(toks, prefix_snapshot(toks, boundary=True))
        c.gc(ram_bytes=0)  # spill everything; RAM keeps nothing
        wait_spilled(c, 4)
    with d.client("cold", strict=True, transport="shm") as c:
        hit = c.get(toks, need_boundary=True)
        assert_prefix_hit(hit, toks)
        assert c.counters["shm_gets"] == 1
        s = c.stats()
    assert s["tiers"]["ssd"]["hits"] >= 4
    assert s["shm"]["adopted_bytes"] >= 700 * 8 and s["shm"]["allocs"] >= 1  # copied into slots from private bytes
    assert c.counters["shm_damaged"] == 0


@memfd_only("shm_open segments can be cut short: cold hits land in the heap first")
def test_a_cold_hit_of_blob_files_is_read_through_a_private_buffer_straight_into_slots(daemon_factory):
    """Blob files of a bounce buffer or more (2 MiB chunks here) are read into
    their slots piece by piece through a private buffer, checked and hashed
    there (kvd.store.ssd.blobfile.read_to_slots): no copy of the whole entry
    in the heap, nothing for the GET to move in, and digests the reader
    checks (tests/server/test_shm_integrity.py: a write into the slot after
    is a miss)."""
    d = daemon_factory("--ram-mb", "64")
    toks = np.arange(768)
    with d.client("wide", strict=True, transport="frames") as c:
        assert c.put(toks, wide_snapshot(toks))
        c.gc(ram_bytes=0)
        wait_spilled(c, 3)
    with d.client("wide", strict=True, transport="shm") as c:
        hit = c.get(toks)
        assert hit.n == 768
        assert_wide_hit(hit, toks)
        assert c.counters["shm_gets"] == 1 and c.counters["shm_damaged"] == 0
        s = c.stats()
    assert s["tiers"]["ssd"]["hits"] >= 3 and s["tiers"]["ssd"]["read_to_slots"] >= 3
    assert s["shm"]["adopted_bytes"] == 0  # already in slots, with digests


def test_memory_given_back_leaves_the_arena(daemon_factory):
    """Evicted entries' segments are removed (clients unmap them too); under memory
    pressure the free ranges' pages go back as well (tests/server/test_pressure.py, cgroup)."""
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")  # 4 MiB segments
    with d.client("give", strict=True) as c:
        for i in range(6):
            toks = np.arange(4096) + 10_000 * i
            snap = prefix_snapshot(toks)
            assert c.put(toks, snap)
        assert_prefix_hit(c.get(toks), toks)
        grown = _shm_stats(c)
        assert grown["segments"] >= 2
        c.gc(ram_bytes=0)
        assert c.get(np.arange(5)) is None  # releases the last lease; the reply lists live segments
        s = _shm_stats(c)
        assert s["used_bytes"] == 0 and s["segments"] <= 1 and s["segments_removed"] >= grown["segments"] - 1
        small = np.arange(300)
        assert c.put(small, prefix_snapshot(small))
        assert_prefix_hit(c.get(small), small)  # its reply lists the live segments: the client unmaps the rest
        assert len({seg for seg, _ in c._shm_link._maps}) <= _shm_stats(c)["segments"]


def test_arena_reserves_pages_once_and_again_after_giving_them_back():
    """A slot's pages are reserved when it is allocated (a full tmpfs fails the
    allocation, never a later write); reused memory is not reserved twice, and
    memory `trim` handed back is reserved again when a slot reuses it."""
    from kvd.server.shm.arena import Arena

    if not hasattr(os, "posix_fallocate") or not Path("/dev/shm").is_dir():
        pytest.skip("needs posix_fallocate and /dev/shm (Linux)")
    folder = Path("/dev/shm") / f"kvd-test-{os.getpid()}"
    folder.mkdir(mode=0o700)
    arena = Arena(folder, "0badcafe", capacity=64 << 20, segment_bytes=8 << 20)
    try:
        keep = arena.alloc(4096)  # keeps the segment alive through trim
        big = arena.alloc(4 << 20)
        (path,) = folder.iterdir()
        held = lambda: os.stat(path).st_blocks * 512  # noqa: E731 - bytes the file really holds
        assert held() >= (4 << 20) + 4096  # reserved before anything was written
        del big  # its last reference: the slot is free, its pages stay (warm)
        again = arena.alloc(4 << 20)
        assert held() >= (4 << 20) + 4096
        del again
        assert arena.trim() >= 4 << 20  # the free range's pages go back
        assert held() < 1 << 20
        third = arena.alloc(4 << 20)  # the same range, reserved again
        assert held() >= (4 << 20) + 4096
        third[:] = 7
        assert int(third.sum()) == 7 * (4 << 20)
        del third, keep
    finally:
        arena.unlink()
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()


def test_write_through_grants_count_against_dirty_max_mb(daemon_factory):
    """Regression (a red-team find): a write-through COMMIT was charged its
    ~100-byte header, so six 16 MiB shared-memory PUTs waited for the disk at
    once under `dirty_max_mb` 8. A SLOTS now counts what the grants awaiting
    their COMMIT and the PUTs waiting hold; its COMMIT is then never refused."""
    d = daemon_factory("--ram-mb", "256", "--write-through", "--pack-max-kb", "0", "--dirty-max-mb", "8")
    with d.client("wt", strict=True) as c:
        link = c._link()
        spec = [codec.Tensor("k", "uint8", (6 << 20,), None)]

        def slots(i):
            return c._transport.request("SLOTS", {**c._seq(np.arange(4) + 10 * i), "shm": link.field(),
                                                  "chunks": [{"index": 0, "tensors": spec}]}, 5)

        first = slots(0)
        assert _shm_stats(c)["granted_bytes"] >= 6 << 20
        with pytest.raises(Busy) as refused:
            slots(1)  # 6 MiB granted + 6 MiB more > 8 MiB
        assert BACKLOG_FULL in str(refused.value)
        view = link.view(first["chunks"][0][0], writable=True)
        view[:] = b"\x05" * len(view)
        done = c._transport.request("COMMIT", {"lease": first["lease"], "shm": link.field()}, 10)
        assert done["stored"] == 1
        assert _shm_stats(c)["granted_bytes"] == 0 and c.stats()["write_through"]["waiting_bytes"] == 0
        slots(1)  # room again


def test_slots_that_its_put_would_refuse_are_refused_before_any_slot_is_granted(kvd_daemon):
    """A SLOTS whose PUT the COMMIT would refuse (a chunk past the sequence's
    last, a boundary with no token) is BAD_FIELD at once: it had been granted,
    holding its slots until its lease ended (red-team find)."""
    with kvd_daemon.client("slots", strict=True) as c:
        link = c._link()
        spec = [codec.Tensor("k", "uint8", (1 << 20,), None)]
        for bad in ({**c._seq(np.arange(300)), "chunks": [{"index": 5, "tensors": spec}]},
                    {**c._seq(np.arange(0)), "chunks": [], "boundary": {"tensors": spec}}):
            with pytest.raises(BadField):
                c._transport.request("SLOTS", {**bad, "shm": link.field()}, 5)
        s = _shm_stats(c)
        assert (s["leases"], s["pending"], s["granted_bytes"], s["used_bytes"]) == (0, 0, 0, 0), s


def test_entries_in_shared_memory_do_not_raise_the_anonymous_memory_ceiling(daemon_factory):
    """Regression (a red-team find): the watchdog compares anonymous memory
    with RAM tier + allowance; with the tier in shared-memory slots (not
    anonymous) that let stalled peers take the tier's size again, and a
    daemon in a memory cgroup sized to the documented ceiling was OOM-killed."""
    from kvd.protocol.limits import Limits
    from kvd.server.admission.caps import memory_ceiling

    d = daemon_factory("--ram-mb", "128", "--max-message-mb", "16")
    seqs = [np.arange(4096) + 100_000 * i for i in range(8)]
    with d.client("ceil", strict=True, transport="shm") as c:
        for s in seqs:
            assert c.put(s, prefix_snapshot(s))
        assert c.counters["shm_puts"] == len(seqs)
        limits = Limits(max_message_bytes=16 << 20)

        def settled():
            st = c.stats()
            ram, used = st["tiers"]["ram"]["bytes"], st["shm"]["used_bytes"]
            return st["peers"]["rss_ceiling_bytes"] == memory_ceiling(ram - used, limits) and (ram, used)

        ram, used = wait_until(settled, what="the ceiling to be recomputed on a tick")
        assert used > 8 << 20 and ram - used < ram // 4  # the tier lives in the arena


def test_a_client_cannot_write_into_what_it_reads(kvd_daemon):
    """Rule 4 of kvd_client._shm: a GET's descriptors are viewed through a
    read-only mapping, so an engine writing into a fetched buffer by mistake
    gets an error and every later reader the stored bytes."""
    toks = np.arange(512)
    with kvd_daemon.client("ro", strict=True, transport="shm") as c:
        assert c.put(toks, prefix_snapshot(toks))
        link = c._link()
        reply = c._transport.request("GET", {**c._seq(toks), "shm": link.field()}, 5)
        views = [link.view(t.data) for ch in reply["chunks"] for t in ch["tensors"]]
        assert views and all(v.readonly for v in views)
        with pytest.raises(TypeError):
            views[0][:4] = b"\xff\xff\xff\xff"
        arr = np.frombuffer(views[0], dtype=np.uint8)
        with pytest.raises(ValueError):
            arr[:4] = 0xFF
        with pytest.raises(ValueError):
            arr.flags.writeable = True
        link.done(reply["shm"]["lease"])
    with kvd_daemon.client("ro", strict=True, transport="frames") as c:
        assert_prefix_hit(c.get(toks), toks)
