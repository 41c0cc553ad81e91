"""Pages of the arena made ready ahead of demand (kvd/server/shm/prepare.py,
issue 42), against a real `kvd serve`: a window of segments from the start,
before any PUT (`shm_warm_mb`, at most the RAM budget, within a quarter of
the memory available: a daemon in a tight memory cgroup sees no jump), handed
back under memory pressure; then whole reserved segments ahead of demand,
within the RAM budget's ceiling. What a real daemon cannot be made to see (a
small figure of available memory) is injected into a Preparer over a real
arena."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

from kvd.protocol import codec
from kvd.server.shm.arena import Arena
from kvd.server.shm.folders import read_slot_note, slot_note_path, write_slot_note
from kvd.server.shm import prepare
from kvd.server.shm.prepare import Preparer
from support import ask_raw, assert_prefix_hit, kvd, prefix_snapshot, shm_folder, wait_until, wide_snapshot

MiB = 1 << 20
LINUX = sys.platform.startswith("linux")


def test_a_started_daemon_prepares_its_window_before_any_put(daemon_factory):
    d = daemon_factory("--ram-mb", "64", "--shm-warm-mb", "32", "--data-dir", "none")
    seg = 4 * MiB  # a thirty-second of 64 MiB, at least 4

    def shm():
        return json.loads(kvd("stats", "--json", "--endpoint", d.endpoint).stdout)["shm"]

    s = wait_until(lambda: (x := shm())["prepared_free_bytes"] >= 32 * MiB and x, what="the window prepared")
    assert s["prepare_window_bytes"] == 32 * MiB and s["used_bytes"] == 0 and s["allocs"] == 0
    assert s["prepared_bytes"] == 32 * MiB and s["mapped_bytes"] == 32 * MiB  # the window, not past it
    assert s["prepare_failures"] == 0
    if LINUX:  # cleared and present (MADV_POPULATE_WRITE): a client maps them sixteen a fault
        assert s["populated_bytes"] == 32 * MiB
    toks = [np.arange(2048) + i * 100_000 for i in range(4)]
    with d.client("warm", strict=True, transport="shm") as c:
        for t in toks:
            assert c.put(t, prefix_snapshot(t))
        for t in toks:
            assert_prefix_hit(c.get(t), t)  # bit-exact out of prepared pages
        assert c.counters["shm_puts"] == len(toks)
        s = c.stats()["shm"]
    assert s["segments"] * seg == s["mapped_bytes"] and s["alloc_failures"] == 0


def test_the_window_is_at_most_the_ram_budget_and_a_segment(daemon_factory):
    d = daemon_factory("--ram-mb", "16", "--shm-warm-mb", "4096", "--data-dir", "none")
    with d.client("budget", strict=True, transport="shm") as c:
        s = wait_until(lambda: (x := c.stats()["shm"])["prepared_free_bytes"] >= 20 * MiB and x,
                       what="the window prepared")
        assert s["prepare_window_bytes"] == 20 * MiB  # 16 and one 4 MiB segment: a fill needs a little more
        assert s["mapped_bytes"] == s["prepared_bytes"] == 20 * MiB, s


def test_a_window_of_segments_smaller_than_the_chunks_gives_way_to_them(daemon_factory):
    """A 64 MiB RAM tier prepares its window in 4 MiB segments; 256-token
    chunks of 32 KiB a token need 8 MiB slots, each in a segment of its own.
    Once the RAM tier was full the window's idle segments and the chunks'
    filled the arena's capacity (twice the budget and a segment), and every
    later PUT was refused its slots and went over frames (a 768 MiB daemon's
    16 MiB window against 32 MiB chunks, bench_write_through.py). Now the
    idle segments too small for a slot make room for it."""
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")
    toks = [np.arange(512) + i * 100_000 for i in range(10)]  # two 8 MiB chunks each
    with d.client("wide", strict=True, transport="shm") as c:
        s = wait_until(lambda: (x := c.stats()["shm"])["prepared_free_bytes"] >= 68 * MiB and x,
                       what="the window prepared")
        assert s["prepare_window_bytes"] == 68 * MiB and s["mapped_bytes"] == 68 * MiB  # 17 segments of 4 MiB
        for t in toks:
            assert c.put(t, wide_snapshot(t, width=8192))
        assert c.counters["shm_puts"] == len(toks) and c.counters["shm_put_fallback"] == 0
        s = c.stats()["shm"]
        assert s["alloc_failures"] == 0 and s["segments_removed"] > 0, s
        assert s["mapped_bytes"] <= s["capacity_bytes"]
        hit = c.get(toks[-1])
        assert hit is not None and hit.n == 512
        want = wide_snapshot(toks[-1], width=8192).sliced["t.bfloat16"][0]
        assert hit.sliced["t.bfloat16"].array.tobytes() == want.array.tobytes()
        assert c.counters["shm_gets"] == 1


def test_chunks_bigger_than_a_segment_get_segments_prepared_to_their_size(folder):
    """Segments are sized from the RAM budget, chunks from the model: a
    70B-class model's 256-token chunk (80 MiB) fits no 64 MiB segment. Each
    such slot went to a segment made for it, its pages not ready, while the
    preparer kept preparing segments no slot of it could use. Now the
    segments prepared are as big as the latest slots, only free ranges that
    hold one count as ready, and idle segments too small give way to them."""
    arena = Arena(folder, "0decade0", capacity=64 * MiB, segment_bytes=4 * MiB, huge=False)
    prep = Preparer(arena, window=32 * MiB, available=lambda: None)
    while prep.step():
        pass
    assert arena.spare_prepared() == 32 * MiB and len(arena.live()) == 8  # the window: 4 MiB segments
    first = arena.alloc(6 * MiB)  # no 4 MiB segment holds it: one made for it (_grow)
    assert first.slot.seg == 8 and arena.prepare_bytes() == 6 * MiB
    assert arena.spare_prepared() == 0  # no free range holds a second one
    assert arena.spare_prepared(4 * MiB) == 32 * MiB  # (though 4 MiB slots would fit)
    while prep.step():
        pass
    # Two slots ahead, in two 6 MiB segments. The ceiling, half the capacity
    # and a segment (38 MiB), had 32 + 6 mapped: three idle 4 MiB segments gave way.
    assert arena.spare_prepared() == 12 * MiB and prep.prepared_bytes == 32 * MiB + 12 * MiB
    assert arena.stats()["segments_removed"] == 3 and len(arena.live()) == 8
    prepared = set(arena.live()) - set(range(9))
    more = [arena.alloc(6 * MiB) for _ in range(2)]
    assert {a.slot.seg for a in more} == prepared and len(prepared) == 2  # carved from them: no segment made
    assert not any(getattr(a, "unreserved", False) for a in more)
    for a in [first, *more]:
        a[:] = 7
        assert bytes(a[-3:]) == b"\x07\x07\x07"


def test_a_fill_of_chunks_bigger_than_a_segment_meets_segments_prepared_for_them(daemon_factory):
    """A real daemon: a 64 MiB RAM tier's segments are 4 MiB, and 256-token
    chunks of 16 KiB a token are 8 MiB slots. Once the first put showed the
    preparer their size, the next put's slots are carved from segments it
    prepared for them: no grant waits for its pages to be reserved."""
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")
    toks = [np.arange(512) + i * 100_000 for i in range(3)]  # two 8 MiB chunks each
    with d.client("wide", strict=True, transport="shm") as c:
        wait_until(lambda: c.stats()["shm"]["prepared_free_bytes"] >= 68 * MiB, what="the window prepared")
        assert c.put(toks[0], wide_snapshot(toks[0], width=8192))
        s = wait_until(lambda: (x := c.stats()["shm"])["prepared_free_bytes"] >= 16 * MiB and x,
                       what="segments prepared for 8 MiB slots")
        assert s["grants_reserved_off_thread"] == 1, s  # the first put's, into segments made for it
        for t in toks[1:]:
            assert c.put(t, wide_snapshot(t, width=8192))
            wait_until(lambda: c.stats()["shm"]["prepared_free_bytes"] >= 16 * MiB, what="prepared again")
        s = c.stats()["shm"]
        assert s["grants_reserved_off_thread"] == 1 and s["alloc_failures"] == 0, s
        assert c.counters["shm_puts"] == len(toks) and c.counters["shm_put_fallback"] == 0
        hit = c.get(toks[-1])
        want = wide_snapshot(toks[-1], width=8192).sliced["t.bfloat16"][0]
        assert hit is not None and hit.sliced["t.bfloat16"].array.tobytes() == want.array.tobytes()


def test_a_restarted_daemon_prepares_its_window_for_the_slots_its_last_run_was_given(daemon_factory):
    """The first run on an endpoint learns its 8 MiB slots from its first put
    (segments of 4 MiB) and notes their size beside the socket; the next run
    prepares its window in segments that hold them from its start, so its
    first puts' slots are all carved from pages already prepared: no grant
    waits for its pages to be reserved."""
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")
    note = slot_note_path(d.workdir / "kvd.sock")
    first = np.arange(512) + 900_000
    with d.client("wide", strict=True, transport="shm") as c:
        assert c.stats()["shm"]["prepare_segment_bytes"] == 4 * MiB
        assert c.put(first, wide_snapshot(first, width=8192))
        wait_until(lambda: c.stats()["shm"]["prepare_segment_bytes"] == 8 * MiB, what="8 MiB segments prepared")
    assert note.read_text() == f"{8 * MiB}\n" and stat.S_IMODE(note.stat().st_mode) == 0o600
    d.restart()
    toks = [np.arange(512) + i * 100_000 for i in range(3)]  # two 8 MiB chunks each
    with d.client("wide", strict=True, transport="shm") as c:
        s = wait_until(lambda: (x := c.stats()["shm"])["prepared_free_bytes"] >= 64 * MiB and x,
                       what="the window prepared")
        assert s["prepare_segment_bytes"] == 8 * MiB and s["allocs"] == 0, s
        for t in toks:
            assert c.put(t, wide_snapshot(t, width=8192))
        s = c.stats()["shm"]
        assert s["grants_reserved_off_thread"] == 0 and s["alloc_failures"] == 0, s
        assert c.counters["shm_puts"] == len(toks) and c.counters["shm_put_fallback"] == 0
        hit = c.get(toks[-1])
        want = wide_snapshot(toks[-1], width=8192).sliced["t.bfloat16"][0]
        assert hit is not None and hit.sliced["t.bfloat16"].array.tobytes() == want.array.tobytes()


def test_a_new_endpoints_window_is_prepared_in_segments_that_hold_chunks_bigger_than_a_segment(daemon_factory):
    """A 256 MiB RAM tier's segments are 8 MiB; its window, before any slot's
    size is known, is prepared in segments of a sixteenth of the tier (16 MiB),
    so 12 MiB chunks (a 70B-class model's 80 MiB ones against 64 MiB
    segments, scaled down) are carved from it from the first put: no grant
    waits for its pages to be reserved. In 8 MiB segments none fit and each
    went to a segment made for it (1 grant reserved off the serving thread)."""
    d = daemon_factory("--ram-mb", "256", "--shm-warm-mb", "64", "--data-dir", "none")
    t = np.arange(512) + 700_000  # two 12 MiB chunks
    with d.client("wide", strict=True, transport="shm") as c:
        s = wait_until(lambda: (x := c.stats()["shm"])["prepared_free_bytes"] >= 64 * MiB and x,
                       what="the window prepared")
        assert s["prepare_segment_bytes"] == 16 * MiB and s["mapped_bytes"] == 64 * MiB and s["allocs"] == 0, s
        assert c.put(t, wide_snapshot(t, width=12288))
        s = c.stats()["shm"]
        assert s["grants_reserved_off_thread"] == 0 and s["alloc_failures"] == 0 and s["allocs"] == 2, s
        assert c.counters["shm_puts"] == 1 and c.counters["shm_put_fallback"] == 0
        hit = c.get(t)
        want = wide_snapshot(t, width=12288).sliced["t.bfloat16"][0]
        assert hit is not None and hit.sliced["t.bfloat16"].array.tobytes() == want.array.tobytes()


@pytest.mark.parametrize("budget_mib, segment_mib, want_mib", [
    (64, 4, 4), (256, 8, 16), (1280, 32, 64), (2048, 64, 128), (4352, 64, 256), (65536, 64, 256)])
def test_a_window_before_any_slot_is_prepared_in_sixteenths_of_the_budget_up_to_256_mib(budget_mib, segment_mib, want_mib):
    from kvd.server.shm.startup import window_segment_bytes

    assert window_segment_bytes(budget_mib * MiB, segment_mib * MiB) == want_mib * MiB


@pytest.mark.parametrize("content", [b"", b"junk\n", b"-8388608\n", b"8388608.5", b"0\n", b"%d\n" % (1 << 40),
                                     b"8" * 4096, "link", "folder", "fifo"])
def test_a_slot_note_that_is_not_a_sane_number_in_a_file_of_ours_is_ignored(tmp_path, content):
    note = tmp_path / "kvd.sock.slots"
    if content == "link":
        (tmp_path / "elsewhere").write_bytes(b"8388608\n")
        note.symlink_to(tmp_path / "elsewhere")
    elif content == "folder":
        note.mkdir()
    elif content == "fifo":
        os.mkfifo(note)
    else:
        note.write_bytes(content)
    assert read_slot_note(note, most=1 << 30) == 0
    if content in ("link", "folder"):
        return
    # Written over (a fifo too: renamed over, never opened), then read back.
    assert write_slot_note(note, 8 * MiB) and read_slot_note(note, most=1 << 30) == 8 * MiB
    assert read_slot_note(note, most=4 * MiB) == 0  # more than this daemon could hold: ignored
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["kvd.sock.slots"] + (["elsewhere"] if content == "link" else []))


def test_a_daemon_starts_and_serves_whatever_its_slot_note_holds(daemon_factory):
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none", start=False)
    slot_note_path(d.workdir / "kvd.sock").write_bytes(b"\xff" * 64)
    d.start()
    t = np.arange(2048)
    with d.client("junk", strict=True, transport="shm") as c:
        assert c.stats()["shm"]["prepare_segment_bytes"] == 4 * MiB
        assert c.put(t, prefix_snapshot(t))
        assert_prefix_hit(c.get(t), t)


def _blocks(folder: Path) -> int:
    """Bytes the arena's segments hold allocated (their pages), as the kernel counts them."""
    return sum(os.stat(p).st_blocks * 512 for p in folder.iterdir() if p.name != "nonce")


@pytest.mark.skipif(not LINUX, reason="no MADV_POPULATE_READ: nothing is mapped ahead")
def test_a_client_maps_the_prepared_segments_in_the_background_and_allocates_none(daemon_factory):
    from kvd_client import _pages

    d = daemon_factory("--ram-mb", "64", "--shm-warm-mb", "64", "--data-dir", "none")
    with d.client("ahead", strict=True, transport="shm") as c:
        s = wait_until(lambda: (x := c.stats()["shm"])["prepared_free_bytes"] >= 64 * MiB and x,
                       what="the window prepared")
        folder, live = Path(s["dir"]), s["segments"]
        before, premapped = _blocks(folder), _pages.counters["premapped_segments"]
        t = np.arange(2048)
        assert c.put(t, prefix_snapshot(t))  # its SLOTS reply lists the live segments
        # Every live segment mapped ahead but (at most) the one its slots were in, already mapped by the put.
        wait_until(lambda: _pages.counters["premapped_segments"] - premapped >= live - 1, what="segments premapped")
        assert _blocks(folder) == before  # the window's pages only: the client allocated none
        assert c.counters["shm_puts"] == 1
        assert_prefix_hit(c.get(t), t)


@pytest.mark.skipif(not LINUX, reason="no MADV_POPULATE_READ: nothing is mapped ahead")
def test_a_client_connected_before_the_window_is_ready_maps_it_as_it_is_prepared(daemon_factory, tmp_path):
    """A model server connects, then loads its model: its HELLO came before
    the window was ready. HELLO says how much of it is still to come
    (`shm_window_left`), and the client maps each segment as the daemon
    makes it ready, asking the daemon nothing, so its first put copies into
    pages it has mapped. Here the window is held back by memory pressure
    until the client has connected, then let go."""
    from kvd_client import _pages

    level = tmp_path / "level"
    level.write_text("critical\n")
    d = daemon_factory("--ram-mb", "64", "--shm-warm-mb", "32", "--data-dir", "none", "--ram-floor-mb", "8",
                       "--pressure-source", f"file:{level}", "--pressure-poll-s", "0.05", "--pressure-calm-s", "0.2")

    def shm():  # asked by another process: this one's link hears nothing of it
        return json.loads(kvd("stats", "--json", "--endpoint", d.endpoint).stdout)["shm"]

    def hello():
        return ask_raw(d.endpoint, codec.encode("HELLO", {"versions": [1]}, id=1))

    wait_until(lambda: shm()["mapped_bytes"] == 0, what="the window held back")
    assert hello()["shm_window"]["left"] == 32 * MiB
    with d.client("early", strict=True, transport="shm") as c:
        c.limits()  # HELLO: no segment ready, 32 MiB to come
        followed = _pages.counters["followed_segments"]
        level.write_text("normal\n")
        s = wait_until(lambda: (x := shm())["prepared_free_bytes"] >= 32 * MiB and x, what="the window prepared")
        wait_until(lambda: _pages.counters["followed_segments"] - followed >= 8, what="the window mapped")
        assert s["segments"] == 8 and s["allocs"] == 0, s
        assert shm().get("handout_gone", 0) == 0  # the portable host: looks ahead of the window are not "gone"
        assert _blocks(Path(s["dir"])) <= 32 * MiB  # the window's pages only: the client allocated none
        assert "shm_window" not in hello() and len(hello()["shm_live"]) == 8  # whole: nothing to follow
        prefaulted = _pages.counters["prefaulted_bytes"]
        t = np.arange(2048)
        assert c.put(t, prefix_snapshot(t))
        assert _pages.counters["prefaulted_bytes"] == prefaulted  # its slots' pages were mapped already
        assert c.counters["shm_puts"] == 1
        assert_prefix_hit(c.get(t), t)


def test_the_window_is_handed_back_under_memory_pressure(daemon_factory, tmp_path):
    level = tmp_path / "level"
    d = daemon_factory("--ram-mb", "64", "--shm-warm-mb", "32", "--data-dir", "none", "--ram-floor-mb", "8",
                       "--pressure-source", f"file:{level}", "--pressure-poll-s", "0.05", "--pressure-calm-s", "3600")
    with d.client("pressed", strict=True, transport="shm") as c:
        wait_until(lambda: c.stats()["shm"]["prepared_free_bytes"] >= 32 * MiB, what="the window prepared")
        level.write_text("critical\n")
        s = wait_until(lambda: (x := c.stats()["shm"])["mapped_bytes"] == 0 and x, what="the window handed back")
        assert s["trimmed_bytes"] >= 32 * MiB
        prepared = s["prepared_bytes"]
        t = np.arange(2048)
        assert c.put(t, prefix_snapshot(t))  # still served, from memory reserved slot by slot
        assert_prefix_hit(c.get(t), t)
        assert c.stats()["shm"]["prepared_bytes"] == prepared  # nothing prepared while the tier yields


@pytest.fixture
def folder(tmp_path):
    with shm_folder(tmp_path, "prepare") as path:
        yield path


def _prepared(folder, *, available, allowed=lambda: True, window=16 * MiB) -> tuple[Arena, Preparer]:
    arena = Arena(folder, "0decade0", capacity=64 * MiB, segment_bytes=4 * MiB)
    prep = Preparer(arena, allowed, window=window, available=available)
    while prep.step():  # the thread's loop, on this thread
        pass
    return arena, prep


def test_hello_tells_the_whole_segments_of_the_window_still_to_come_and_none_after_a_put(folder):
    # An 18 MiB window in 4 MiB segments is four of them: a client told 18
    # would look for a fifth that never comes.
    arena = Arena(folder, "0decade0", capacity=64 * MiB, segment_bytes=4 * MiB, huge=False)
    prep = Preparer(arena, window=18 * MiB, available=lambda: None)
    assert prep.window_left() == 16 * MiB
    assert prep.step() and prep.step()
    assert prep.window_left() == 8 * MiB and arena.next_segment() == 2
    while prep.step():
        pass
    assert prep.window_left() == 0 and arena.spare_prepared() == 16 * MiB
    prep.window = 32 * MiB  # (more wanted, but a put came: the window is over)
    kept = arena.alloc(MiB)
    assert kept is not None and prep.window_left() == 0


def test_the_window_stays_within_a_quarter_of_the_memory_available(folder):
    # A tight memory cgroup (limit less working set) or a machine short of
    # memory: 20 MiB available leaves room for one 4 MiB segment (0 + 4 <= 20 / 4),
    # not a second (4 + 4 > (16 + 4) / 4, the first having taken its 4).
    made: list[Arena] = []

    def available():  # what the prepared pages took is no longer available
        return 20 * MiB - (made[0].spare_prepared() if made else 0)

    arena = Arena(folder, "0decade0", capacity=64 * MiB, segment_bytes=4 * MiB)
    made.append(arena)
    prep = Preparer(arena, window=16 * MiB, available=available)
    while prep.step():
        pass
    assert arena.spare_prepared() == 4 * MiB and prep.held_back == 1
    assert arena.trim() == 4 * MiB
    arena2, prep2 = _prepared(folder, available=lambda: 10 * MiB)  # under four segments' worth: none at all
    assert arena2.spare_prepared() == 0 and arena2.stats()["mapped_bytes"] == 0 and prep2.held_back == 1
    arena3, prep3 = _prepared(folder, available=lambda: None)  # the OS does not say: the window whole
    assert arena3.spare_prepared() == 16 * MiB and prep3.held_back == 0


def test_a_segment_being_prepared_is_not_free_until_it_is_offered(folder, monkeypatch):
    # Stats are read on the loop's thread while kvd-shm-prep prepares a segment:
    # one made but not yet offered counted free and not prepared, and
    # test_the_window_is_at_most_the_ram_budget_and_a_segment once read
    # prepared_free_bytes 20 MiB against prepared_bytes 16 MiB.
    seen = []
    arena = Arena(folder, "0decade0", capacity=64 * MiB, segment_bytes=4 * MiB, huge=False)  # cleared through the fd
    prep = Preparer(arena, window=8 * MiB, available=lambda: None)
    clear = prepare.clear

    def spied(fd, length):  # inside step(): begun, its counters not yet moved (the first thing done to its pages)
        seen.append(prep.stats())
        return clear(fd, length)

    monkeypatch.setattr(prepare, "clear", spied)
    while prep.step():
        pass
    assert [(s["prepared_free_bytes"], s["prepared_bytes"]) for s in seen] == [(0, 0), (4 * MiB, 4 * MiB)]
    assert prep.stats()["prepared_free_bytes"] == prep.prepared_bytes == 8 * MiB
    assert arena.stats()["mapped_bytes"] == 8 * MiB


def _rss_kib(address: int) -> int:
    """Rss of this process's mapping that starts at `address` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{address:x}":
            return next(int(x.split()[1]) for x in lines[i + 1:] if x.startswith("Rss:"))
    raise AssertionError(f"no mapping at {address:x}")


def _mapping(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of this process's mapping that starts at `address`."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    i = next(i for i, line in enumerate(lines) if line.split("-", 1)[0] == f"{address:x}")
    fields = {}
    for line in lines[i + 1:]:
        key, _, value = line.partition(":")
        if not key or " " in key or "-" in key:  # the next mapping's first line
            break
        fields[key] = value.strip()
    return fields


def test_where_linux_gives_shmem_huge_pages_a_segment_asks_and_is_prepared_through_its_mapping(folder):
    """kvd.host.segments "Huge pages": the arena asks for 2 MiB pages on its
    mapping of each memfd segment (VmFlags `hg`), and the preparer populates
    that mapping instead of writing through the fd: every page allocated and in
    the daemon's page tables. Where the machine's policy allows (advise and the
    like; `never` here by default), they are 2 MiB pages, and another mapping
    of the segment, as a client makes, maps them 2 MiB at a time too."""
    import mmap

    from kvd.host.segments import HUGE_POLICIES, shmem_huge_policy
    from kvd.host.select import mechanism

    if not LINUX or mechanism("shared_memory") != "memfd":
        pytest.skip("huge pages are asked for on Linux memfd segments only")
    arena = Arena(folder, "0decade0", capacity=64 * MiB, segment_bytes=4 * MiB, huge=True)
    prep = Preparer(arena, window=8 * MiB, available=lambda: None)
    while prep.step():
        pass
    assert prep.prepared_bytes == prep.populated_bytes == 8 * MiB and prep.stats()["prepared_free_bytes"] == 8 * MiB
    assert _blocks(folder) >= 8 * MiB
    for seg in (0, 1):
        daemon_side = _mapping(arena.address(seg))
        assert "hg" in daemon_side["VmFlags"].split(), daemon_side
        assert int(daemon_side["Rss"].split()[0]) == 4096, daemon_side  # populated: in the daemon's page tables
    slot = arena.alloc(3 * MiB)
    slot[:] = 7
    assert not arena.unreserved(slot.slot)
    fd = os.open(f"/proc/self/fd/{arena._fds[slot.slot.seg]}", os.O_RDONLY)  # as a client opens a segment
    try:
        client = mmap.mmap(fd, 4 * MiB, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    view = np.frombuffer(client, np.uint8)
    assert (view[slot.slot.off:slot.slot.off + 3 * MiB] == 7).all()
    if shmem_huge_policy() in HUGE_POLICIES:
        assert int(_mapping(view.ctypes.data)["ShmemPmdMapped"].split()[0]) == 4096
        assert int(_mapping(arena.address(0))["ShmemPmdMapped"].split()[0]) == 4096
    del view
    client.close()


def test_a_huge_preparation_that_fails_midway_gives_back_what_it_reached(folder, monkeypatch):
    """A populate cut short (no memory for the next 2 MiB pages: a memory
    cgroup) gives back the pages it reached before the other ways are tried;
    where they fail too, the segment is offered unreserved holding nothing."""
    import errno

    from kvd.host.select import mechanism

    if not LINUX or mechanism("shared_memory") != "memfd":
        pytest.skip("huge pages are asked for on Linux memfd segments only")
    real, calls = prepare.populate, []

    def cut_short(address, length):  # the first piece really populated, then ENOMEM
        calls.append(length)
        return real(address, length) if len(calls) == 1 else False

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, "no room")

    monkeypatch.setattr(prepare, "populate", cut_short)
    monkeypatch.setattr(prepare, "clear", lambda fd, length, offset=0: False)
    monkeypatch.setattr(prepare.os, "posix_fallocate", no_room)
    arena = Arena(folder, "0decade0", capacity=64 * MiB, segment_bytes=8 * MiB, huge=True)  # two pieces
    prep = Preparer(arena, window=8 * MiB, available=lambda: None)
    assert prep.step() is False
    assert len(calls) == 2 and prep.failures == 2 and prep.prepared_bytes == prep.populated_bytes == 0
    assert _blocks(folder) == 0  # the piece populated went back with the rest


def test_the_shmem_policy_is_the_pmd_sizes_own_unless_it_inherits(tmp_path):
    from kvd.host.segments import shmem_huge_policy

    top = tmp_path / "shmem_enabled"
    (tmp_path / "hpage_pmd_size").write_text("2097152\n")
    own = tmp_path / "hugepages-2048kB" / "shmem_enabled"
    own.parent.mkdir()
    for line, size, expected in [
        ("always within_size [advise] never deny force", "always [inherit] within_size advise never", "advise"),
        ("always within_size [advise] never deny force", "always inherit within_size advise [never]", "never"),
        ("always within_size advise [never] deny force", "always inherit within_size [advise] never", "advise"),
        ("always within_size advise never [deny] force", "always inherit within_size [advise] never", "deny"),
        ("always within_size advise never deny [force]", "always inherit within_size advise [never]", "force"),
    ]:
        top.write_text(line + "\n")
        own.write_text(size + "\n")
        assert shmem_huge_policy(str(top)) == expected, (line, size)
    own.unlink()  # a kernel without per-size knobs: the global word
    top.write_text("always within_size [advise] never deny force\n")
    assert shmem_huge_policy(str(top)) == "advise"
    assert shmem_huge_policy(str(tmp_path / "absent")) is None


@pytest.mark.skipif(not LINUX or os.geteuid() != 0 or shutil.which("mount") is None,
                    reason="mounts a tmpfs with huge=advise (Linux, root)")
def test_pages_asked_for_and_populated_are_2_mib_ones_where_the_kernel_allows(tmp_path):
    """What the arena does to a segment's mapping where the policy is advise
    (`advise_huge`, then `populate`), on shmem the test can set the policy of
    without touching the machine's: a tmpfs of its own mounted huge=advise
    (the sysfs policy governs memfds the same way). Every page is then a 2 MiB
    one, in the daemon's page tables as such, and a second mapping of the
    file, as a client makes, maps them 2 MiB at a time though it asked nothing."""
    import mmap
    import subprocess

    from kvd.host.segments import advise_huge, populate

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m,huge=advise,mode=0700", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (a container without CAP_SYS_ADMIN)")
    try:
        fd = os.open(mnt / "seg", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, 8 * MiB)
            daemon_side = mmap.mmap(fd, 8 * MiB)
            address = np.frombuffer(daemon_side, np.uint8).ctypes.data
            assert advise_huge(address, 8 * MiB)
            assert all(populate(address + off, 4 * MiB) for off in (0, 4 * MiB))
            mine = _mapping(address)
            if int(mine.get("ShmemPmdMapped", "0 kB").split()[0]) == 0 and address % (2 * MiB):
                pytest.skip("the mapping is not 2 MiB aligned (a kernel before 6.x aligns tmpfs maps only for huge=always)")
            assert int(mine["ShmemPmdMapped"].split()[0]) == 8192, mine
            assert os.fstat(fd).st_blocks * 512 == 8 * MiB
            client = mmap.mmap(fd, 8 * MiB, prot=mmap.PROT_READ)
            view = np.frombuffer(client, np.uint8)
            assert not view[:: 4096].any()  # cleared, and read through the new mapping
            assert int(_mapping(view.ctypes.data)["ShmemPmdMapped"].split()[0]) == 8192
            del view
            client.close()
            daemon_side.close()
        finally:
            os.close(fd)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux shmem written through its fd")
def test_a_new_segment_is_cleared_and_resident_yet_mapped_nowhere():
    """`segments.clear`, how kvd-shm-prep prepares a segment on Linux: every page
    allocated (st_blocks), cleared and resident (mincore: what a client's
    MADV_POPULATE_READ maps sixteen a fault), the size unchanged, and no page
    in this process's own mapping of it (Rss 0: the preparer fills no page
    tables). An fd it cannot write through is False, not an error."""
    import mmap

    from kvd.host.segments import clear
    from kvd_client._pages import resident

    size = 5 * MiB + 3 * 4096 + 100  # not a whole number of 4 MiB steps, nor of pages
    fd = os.memfd_create("kvd-test-clear", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        address = np.frombuffer(mm, np.uint8, count=1).ctypes.data
        assert not resident(mm, 0, size).any()
        assert clear(fd, size)
        assert resident(mm, 0, size).all()
        assert _rss_kib(address) == 0
        st = os.fstat(fd)
        assert st.st_size == size and st.st_blocks * 512 >= size
        assert not np.frombuffer(os.pread(fd, size, 0), np.uint8).any()
        ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
        try:
            assert clear(ro, size) is False
        finally:
            os.close(ro)
        mm.close()
    finally:
        os.close(fd)


@pytest.mark.skipif(not LINUX, reason="Linux shmem written through its fd")
def test_a_clear_cut_short_gives_back_what_it_wrote():
    """A clear that cannot finish (here the file-size limit, EFBIG after 1 MiB:
    a full memory cgroup or /dev/shm stops it the same way, ENOSPC) is False
    and leaves no page allocated, as a failed posix_fallocate leaves none:
    they would stay charged to the daemon, counted nowhere."""
    import subprocess

    code = (
        "import os, resource, signal\n"
        "from kvd.host.segments import clear\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "fd = os.memfd_create('kvd-test-clear')\n"
        "os.ftruncate(fd, 8 << 20)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        "print(clear(fd, 8 << 20), os.fstat(fd).st_blocks * 512, os.fstat(fd).st_size)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "0", str(8 << 20)]


@pytest.mark.skipif(not hasattr(os, "posix_fallocate"), reason="pages are never reserved where there is no fallocate")
def test_where_a_segment_cannot_be_cleared_it_is_reserved_and_populated(folder, monkeypatch):
    """The way off Linux, and on Linux if `clear` fails: posix_fallocate then
    MADV_POPULATE_WRITE (Linux 5.14+) of the daemon's mapping."""
    monkeypatch.setattr(prepare, "clear", lambda fd, length, offset=0: False)
    arena, prep = _prepared(folder, available=lambda: None, window=8 * MiB)
    assert prep.prepared_bytes == 8 * MiB and prep.stats()["prepared_free_bytes"] == 8 * MiB
    assert prep.populated_bytes == (8 * MiB if LINUX else 0)
    assert _blocks(folder) >= 8 * MiB  # the kernel holds their pages
    assert not any(arena.unreserved(arena.alloc(4 * MiB, reserve=False).slot) for _ in range(2))


def test_nothing_is_prepared_while_the_ram_tier_yields(folder):
    arena, prep = _prepared(folder, available=lambda: 1 << 40, allowed=lambda: False)
    assert arena.spare_prepared() == 0 and prep.prepared_bytes == 0


def test_pages_are_prepared_ahead_once_puts_come_never_past_the_budget(daemon_factory):
    d = daemon_factory("--ram-mb", "256", "--shm-warm-mb", "0", "--data-dir", "none")
    toks = [np.arange(2048) + i * 100_000 for i in range(12)]
    with d.client("prep", strict=True, transport="shm") as c:
        def shm():
            return c.stats()["shm"]

        s = shm()
        assert s["prepared_bytes"] == 0 and s["mapped_bytes"] == 0  # no window: nothing before the first PUT
        assert c.put(toks[0], prefix_snapshot(toks[0]))
        seg = 8 * MiB  # a thirty-second of 256 MiB
        s = wait_until(lambda: (x := shm())["prepared_bytes"] >= 2 * seg and x, what="segments prepared ahead")
        ceiling = s["capacity_bytes"] // 2 + seg
        for t in toks[1:]:
            assert c.put(t, prefix_snapshot(t))
        assert c.counters["shm_puts"] == len(toks)
        for t in toks:
            assert_prefix_hit(c.get(t), t)
        s = shm()
        assert s["prepared_bytes"] <= ceiling  # the preparer never went past the budget
        assert s["mapped_bytes"] <= s["capacity_bytes"] and s["prepare_failures"] == 0
    assert d.proc.poll() is None


def test_what_a_fill_leaves_resident_stays_within_the_ram_budget_and_two_segments(daemon_factory):
    # The arena's resident pages (the segments' allocated blocks), after a fill
    # that evicts: the RAM tier's budget plus the free memory kept warm for the
    # next puts (Arena.keep_free) and what the preparer holds ahead, within
    # the budget and two segments (the preparer's ceiling is half the arena's
    # capacity plus a segment); and a client's bulk prefault of
    # its grants (client/_pages.py) adds no page to it.
    from kvd_client import _pages

    ram = 8 * MiB
    d = daemon_factory("--ram-mb", "8", "--data-dir", "none")
    toks = [np.arange(2048) + i * 100_000 for i in range(40)]  # ~0.55 MiB each: 22 MiB through 8
    with d.client("fill", strict=True, transport="shm") as c:
        for t in toks:
            assert c.put(t, prefix_snapshot(t))
        s = c.stats()["shm"]
        folder = Path(s["dir"])
        resident = sum(os.stat(p).st_blocks * 512 for p in folder.iterdir() if p.name != "nonce")
    assert c.counters["shm_puts"] == len(toks) and _pages.counters["prefaulted_bytes"] > 0
    assert s["used_bytes"] <= ram
    seg = 4 * MiB  # a thirty-second of 8 MiB, at least 4
    assert resident <= s["mapped_bytes"] <= ram + 2 * seg, (resident, s)  # measured: 11 MiB resident, 12 mapped


# -- a grant's pages reserved off the serving thread (issue 44) ----------------
def _raw_slots(arena: Arena, n: int, nbytes: int) -> list:
    """Slots as a SLOTS into never-reserved memory hands them out (alloc(reserve=False))."""
    arrs = [arena.alloc(nbytes, reserve=False) for _ in range(n)]
    return arrs


@pytest.mark.skipif(not hasattr(os, "posix_fallocate"), reason="pages are never reserved where there is no fallocate")
def test_a_grants_pages_are_reserved_on_the_preparers_thread_then_it_is_told(folder):
    import threading

    arena = Arena(folder, "0decade0", capacity=64 * MiB, segment_bytes=4 * MiB)
    arrs = _raw_slots(arena, 3, 3 * MiB)
    slots = [a.slot for a in arrs]
    assert all(arena.unreserved(s) for s in slots)
    before = _blocks(folder)
    prep = Preparer(arena, lambda: False, window=0, available=lambda: None)  # (it prepares nothing ahead)
    assert not prep.running
    prep.start()
    assert prep.running
    told, done = [], threading.Event()
    try:
        prep.reserve(slots, lambda ok: (told.append((ok, threading.current_thread().name)), done.set()))
        assert done.wait(10)
    finally:
        prep.stop()
    assert told == [(True, "kvd-shm-prep")] and not prep.running
    assert not any(arena.unreserved(s) for s in slots)
    assert _blocks(folder) - before >= 9 * MiB  # the kernel holds their pages now
    assert prep.stats()["grants_reserved_off_thread"] == 1
    arrs[0][:] = 7  # written as a client would, after the reply
    assert arena.copy_out(arrs[0]) == b"\x07" * (3 * MiB)


@pytest.mark.skipif(not LINUX, reason="pages cleared through the fd: Linux shmem")
def test_a_grants_whole_pages_are_cleared_and_a_page_it_shares_keeps_the_other_slots_bytes(folder, monkeypatch):
    """Arena.reserve clears the never-reserved pages wholly inside a slot
    (resident: a client maps them sixteen a fault, not one each as it copies)
    and only posix_fallocates its edge pages, which another slot may share:
    here one the serving thread allocates, reserves and has written into
    while kvd-shm-prep clears (the arena lock is not held through that),
    and its bytes stay."""
    from kvd.server.shm import arena as arena_module
    from kvd_client._pages import resident

    arena = Arena(folder, "0decade0", capacity=64 * MiB, segment_bytes=4 * MiB)
    b = arena.alloc(MiB + 100, reserve=False)
    assert b.slot.off == 0 and arena.unreserved(b.slot)
    real, other = arena_module.clear, []

    def meanwhile(fd, length, offset=0):
        if not other:  # the serving thread, between the snapshot of b's pages and their clearing
            a = arena.alloc(100)  # reserved at once (posix_fallocate), in the page b ends in
            assert a.slot.seg == b.slot.seg and a.slot.off // 4096 == (MiB + 100) // 4096
            a[:] = 9  # and written, as a client would after its grant
            other.append(a)
        return real(fd, length, offset)

    monkeypatch.setattr(arena_module, "clear", meanwhile)
    assert arena.reserve(b.slot) and not arena.unreserved(b.slot) and other
    assert arena.copy_out(other[0]) == b"\x09" * 100
    assert resident(arena._maps[b.slot.seg], 0, MiB).all()  # its whole pages: cleared
    b[:] = 5
    assert arena.copy_out(b) == b"\x05" * (MiB + 100) and arena.copy_out(other[0]) == b"\x09" * 100


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pages cleared through the fd: Linux")
def test_pages_a_failed_reserve_cleared_are_counted_reserved_and_trimmed(folder, monkeypatch):
    """A grant whose whole pages were cleared, then whose edge pages could
    not be reserved (a full /dev/shm or memory cgroup: the fallocate fails by
    hand here): the reserve fails, and the pages it cleared, allocated all
    the same, are counted reserved (a later slot there costs no syscall)
    and handed back by `trim` once free."""
    arena = Arena(folder, "0decade0", capacity=64 * MiB, segment_bytes=4 * MiB)
    b = arena.alloc(2 * MiB + 100, reserve=False)
    keep = arena.alloc(100)  # past it, reserved: the segment stays, its free pages are punched
    assert keep.slot.seg == b.slot.seg
    fd = arena._fds[b.slot.seg]
    monkeypatch.setattr(arena, "_fallocate", lambda fd, off, n: False)
    assert arena.reserve(b.slot) is False
    assert os.fstat(fd).st_blocks * 512 >= 2 * MiB  # the whole pages: cleared, so allocated
    del b  # the grant given up: its slot goes back
    inside = arena.alloc(2 * MiB + 100, reserve=False)  # best fit: the hole b left
    assert inside.slot.off == 0 and not arena.unreserved(inside.slot)
    del inside
    assert arena.trim() >= 2 * MiB
    assert os.fstat(fd).st_blocks * 512 <= 2 * 4096  # handed back: only keep's page is left


def test_a_grant_whose_pages_cannot_be_reserved_is_told_so_and_one_queued_at_stop_too(folder, monkeypatch):
    # A full /dev/shm or memory cgroup (ENOSPC) cannot be made here without
    # root: the fallocate fails by hand. A grant still queued when the
    # preparer stops (its thread inside another grant's fallocate) is told
    # too: nothing waits for ever.
    import errno
    import threading

    arena = Arena(folder, "0decade0", capacity=64 * MiB, segment_bytes=4 * MiB)
    first, second, third = ([a.slot] for a in _raw_slots(arena, 3, MiB))
    inside, go_on = threading.Event(), threading.Event()

    def full(fd, off, n):
        inside.set()
        assert go_on.wait(10)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full, raising=False)
    prep = Preparer(arena, lambda: False, window=0, available=lambda: None).start()
    told: list = []
    prep.reserve(first, lambda ok: told.append(("first", ok)))
    assert inside.wait(10)  # the thread is in the first grant's fallocate
    prep.reserve(second, lambda ok: told.append(("second", ok)))
    stopping = threading.Thread(target=prep.stop)
    stopping.start()
    go_on.set()
    stopping.join(10)
    assert not stopping.is_alive()
    assert told == [("first", False), ("second", False)]
    # The first's whole pages were cleared before its fallocate failed (Linux:
    # through the fd), so counted reserved; elsewhere nothing was. The second
    # was never tried.
    assert arena.unreserved(first[0]) is not sys.platform.startswith("linux")
    assert arena.unreserved(second[0])
    assert prep.stats()["grants_reserved_off_thread"] == 0
    with pytest.raises(RuntimeError):
        prep.reserve(third, told.append)
    assert len(told) == 2


def test_a_fresh_daemons_grant_into_unreserved_pages_is_answered_once_reserved(daemon_factory):
    # No window: the first PUT's slots are carved from a segment the serving
    # thread makes, never reserved; the preparer reserves them, then the
    # SLOTS reply goes. Served bit-exact.
    d = daemon_factory("--ram-mb", "64", "--shm-warm-mb", "0", "--data-dir", "none")
    toks = np.arange(4096)
    with d.client("raw", strict=True, transport="shm") as c:
        assert c.put(toks, prefix_snapshot(toks))
        assert_prefix_hit(c.get(toks), toks)
        s = c.stats()["shm"]
        assert c.counters["shm_puts"] == 1 and c.counters["shm_put_fallback"] == 0
    if hasattr(os, "posix_fallocate"):
        assert s["grants_reserved_off_thread"] >= 1, s
    assert s["busy_reserve"] == 0 and s["alloc_failures"] == 0


@pytest.mark.skipif(not LINUX, reason="no MADV_POPULATE_READ: nothing is mapped ahead")
def test_a_new_client_maps_the_live_segments_from_its_hello_before_its_first_put(daemon_factory):
    # A model server fetches (a miss, its HELLO asked) before it stores: HELLO
    # lists the segments the next grants come from (`shm_live`), mapped in the
    # background then, so its first PUT (16 MiB: big enough for `Ahead`)
    # copies into pages in its page tables already, nothing left to populate
    # as it copies. A frames client maps nothing.
    from kvd_client import HostTensor, Snapshot, _pages

    d = daemon_factory("--ram-mb", "64", "--shm-warm-mb", "64", "--data-dir", "none")
    with d.client("first", strict=True, transport="shm") as c:
        wait_until(lambda: c.stats()["shm"]["prepared_free_bytes"] >= 64 * MiB, what="the window prepared")
        live = c.stats()["shm"]["segments"]
    with d.client("frames", strict=True, transport="frames") as f:
        before = dict(_pages.counters)
        assert f.get(np.arange(64) + 7_000_000) is None and f.limits()  # HELLO asked
        assert _pages.counters == before
    rng = np.random.default_rng(7)
    snap = Snapshot(sliced={"k": (HostTensor.from_numpy(rng.integers(0, 255, (1, 2048, 8192), np.uint8)), 1)})
    with d.client("second", strict=True, transport="shm") as c2:
        before = dict(_pages.counters)
        assert c2.get(np.arange(64) + 9_000_000) is None  # a miss; its HELLO asked
        wait_until(lambda: _pages.counters["premapped_segments"] - before["premapped_segments"] >= live,
                   what="the live segments premapped")
        mapped = _pages.counters["prefaulted_bytes"]
        tokens = list(range(2048))
        assert c2.put(tokens, snap)
        assert _pages.counters["ahead_puts"] == before["ahead_puts"]  # nothing left to map as it copied
        assert _pages.counters["prefaulted_bytes"] == mapped
        assert c2.counters["shm_puts"] == 1
        assert c2.get(tokens).sliced["k"].array.tobytes() == snap.sliced["k"][0].array.tobytes()


@pytest.mark.skipif(not LINUX, reason="no MADV_POPULATE_READ: nothing is mapped ahead")
def test_a_new_clients_first_fetch_reads_through_pages_mapped_from_its_hello(daemon_factory):
    """The premapper maps each live segment's read-only mapping (what a GET
    copies from) beside its writable one: a new client's first fetch of 1 GiB
    took 265 ms with its pages faulted in as it read, 115 with them mapped."""
    d = daemon_factory("--ram-mb", "64", "--shm-warm-mb", "64", "--data-dir", "none")
    toks = np.arange(2048)
    with d.client("shared", strict=True, transport="shm") as c:
        assert c.put(toks, prefix_snapshot(toks))  # (its pages resident, in the daemon's segments)
    with d.client("shared", strict=True, transport="shm") as c2:
        from kvd_client import _pages

        before = _pages.counters["premapped_segments"]
        assert c2.limits()  # its HELLO: the live segments offered, mapped in the background
        link = c2._shm_link
        wait_until(lambda: _pages.counters["premapped_segments"] - before >= len(link.premap._seen),
                   what="the live segments premapped")
        rss = {w: sum(_rss_kib(np.frombuffer(mm, np.uint8, count=1).ctypes.data)
                      for (seg, writable), mm in list(link._maps.items()) if writable == w) for w in (False, True)}
        assert rss[False] > 0 and rss[False] == rss[True], rss  # read-only pages mapped as the writable ones
        assert_prefix_hit(c2.get(toks), toks)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps")
def test_a_segment_a_slots_reply_lists_is_premapped_writable_only(daemon_factory):
    """A segment made after the client's HELLO (the arena growing as it puts)
    holds little a fetch would read yet: the premapper maps its writable
    mapping for the puts to come and leaves the read-only one to the GETs
    (a fresh daemon's fill mapped every page twice)."""
    from kvd_client import _pages

    d = daemon_factory("--ram-mb", "64", "--shm-warm-mb", "0", "--data-dir", "none")
    with d.client("grown", strict=True, transport="shm") as c:
        assert c.limits()  # HELLO: no segment yet
        link = c._shm_link
        assert link is not None
        before = _pages.counters["premapped_segments"]
        toks = np.arange(2048)
        assert c.put(toks, prefix_snapshot(toks))  # a segment made for it; the reply lists it
        wait_until(lambda: _pages.counters["premapped_segments"] > before, what="the new segment premapped")
        rss = {w: sum(_rss_kib(np.frombuffer(mm, np.uint8, count=1).ctypes.data)
                      for (seg, writable), mm in list(link._maps.items()) if writable == w) for w in (False, True)}
        assert rss[True] > 0 and rss[False] == 0, rss
        assert_prefix_hit(c.get(toks), toks)  # the GET maps what it reads


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_child_after_fork_makes_its_own_link_even_with_its_parents_lock_held(daemon_factory):
    # The parent's link lock held as the child is forked (as the parent's
    # premapper holds it while it maps a segment): the child, which has not
    # that thread, makes a link of its own and stores over shared memory.
    import multiprocessing as mp

    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")
    with d.client("forked", strict=True, transport="shm") as c:
        t = np.arange(512)
        assert c.put(t, prefix_snapshot(t))  # the parent's link made and used
        link = c._shm_link  # noqa: SLF001
        assert link is not None

        def child(q):
            u = np.arange(512) + 1_000_000
            ok = c.put(u, prefix_snapshot(u))
            q.put((ok, c.counters["shm_puts"], c._shm_link is not link))  # noqa: SLF001

        ctx = mp.get_context("fork")
        q = ctx.Queue()
        with link._mu:  # noqa: SLF001 -- held across the fork, as a thread of the parent would
            p = ctx.Process(target=child, args=(q,))
            p.start()
        p.join(60)
        if p.is_alive():  # hung on its parent's lock
            p.kill()
            p.join()
        assert p.exitcode == 0, "the child hung or failed"
        assert q.get(timeout=5) == (True, 2, True)
        u = np.arange(512) + 1_000_000
        assert_prefix_hit(c.get(u), u)
