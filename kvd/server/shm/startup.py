"""Attach the shared-memory plane to a bound daemon (kept apart from daemon.py)."""

from __future__ import annotations

import logging
import time

from kvd.endpoint import ipc_path
from kvd.host.fds import fd_limit, open_fds
from kvd.server.shm.folders import new_plane_dir, read_slot_note, slot_note_path, sweep_plane_dirs, write_slot_note
from kvd.server.shm.plane import ShmPlane
from kvd.server.shm.prepare import Preparer

log = logging.getLogger("kvd.server")


def arena_capacity(store, segment: int):
    """Room for the RAM tier twice over (its own bytes, plus leased and
    spill-pending slots of evicted entries) and one segment more, following
    the tier's budget as memory pressure moves it."""
    ram = getattr(store, "ram", store)
    return lambda: 2 * int(getattr(ram, "budget_bytes", 0)) + segment


def segment_bytes(store) -> int:
    """A thirty-second of the RAM tier, 4 to 64 MiB: segments are reserved whole when
    made, so a small daemon (a tight memory cgroup) must not reserve far ahead of use.
    A power of two: a chunk's slot (chunk_tokens of a layout, most often a power of
    two too: 256 tokens x 128 KiB = 32 MiB) does not straddle segments, and a
    40 MiB segment left 8 of every 40 unused (the prepared window fell short)."""
    ram = getattr(store, "ram", store)
    want = int(getattr(ram, "budget_bytes", 0)) // 32
    return min(64 << 20, max(4 << 20, 1 << max(0, want.bit_length() - 1)))


WINDOW_SEGMENT_MOST = 256 << 20  # the biggest segment a window is prepared in (`window_segment_bytes`)


def window_segment_bytes(budget: int, segment: int) -> int:
    """The size of the segments of a window prepared before the size of any
    slot is known (a new endpoint: no note of its last run's slots,
    kvd/server/shm/folders.py): a sixteenth of the RAM tier, a power of two
    from `segment` to 256 MiB. In segments of `segment` (at most 64 MiB) a
    70B-class model's first 80 MiB chunks found no prepared range to fit,
    and the window was given back and prepared again as they came (a fill
    after a model load: 0.14-0.23x the steady state's rate, bench/RESULTS.md
    Session 51). 256 MiB holds two or more of any chunk up to 128 MiB, with
    at most a third of it left over; a window of the budget is still made
    ready a sixteenth at a time."""
    want = int(budget) // 16
    return min(WINDOW_SEGMENT_MOST, max(segment, 1 << max(0, want.bit_length() - 1)))


WARM_BYTES = 4 << 30  # the window's size unless the daemon says (`shm_warm_mb`, kvd/config.py)


def _fds_ok() -> bool:
    """Room in the fd table for one more segment: this process holds under
    half of its limit (Preparer's docstring)."""
    limit = fd_limit()
    held = open_fds(limit)
    return held is None or held + 1 <= limit // 2


def warm_window(daemon, budget: int, segment: int) -> int:
    """Bytes the preparer makes ready from the start, before any PUT
    (kvd/server/shm/prepare.py): the daemon's `shm_warm_bytes` (set by `kvd
    serve` from `shm_warm_mb`) but at most the RAM tier's budget and a
    segment (puts that fill the budget need a little more than it: slots are
    aligned, and a chunk's slot does not straddle segments), in whole segments."""
    want = min(int(getattr(daemon, "shm_warm_bytes", WARM_BYTES)), int(budget) + segment)
    return want // segment * segment


def memory_available():
    """Bytes the daemon could still get (MemAvailable, or its tightest memory
    cgroup's limit less the working set: kvd.host.pressure), sampled at
    each call, ~50 us; None where the OS does not say."""
    from kvd.host.pressure import system_source

    source = system_source()
    return lambda: source("normal").available


REPAIR_S = 1.0  # seconds between checks of the plane's folder, nonce and names (ShmPlane.repair)


def open_plane(daemon) -> None:
    """Sweep what killed runs on this endpoint left, create the plane in a
    folder of its own (kvd.server.shm.folders.new_plane_dir) and let the handler and
    the SSD tier use it. The daemon holds the endpoint's lock. A failure only
    costs the plane: the daemon serves frames and says why."""
    path = ipc_path(daemon.endpoint)
    if path is None:  # an abstract socket has no folder to hold a private nonce
        return
    try:
        if swept := sweep_plane_dirs(path):
            log.info("shared memory: removed %d folder(s) stopped runs left", swept)
        seg = segment_bytes(daemon.store)
        plane = ShmPlane(new_plane_dir(path), capacity=arena_capacity(daemon.store, seg), lease_seconds=daemon.shm_lease_s,
                         segment_bytes=seg)
    except Exception as err:  # an unsafe folder, a full disk: frames still work
        log.warning("shared memory disabled: %s", err)
        return
    try:  # segments with no name (shm_open): clients get them by fd (plane.py rule 5)
        plane.hand_out()
    except (OSError, RuntimeError) as err:  # a socket path too long, no thread to be had
        log.warning("shared memory disabled: no fd hand-out in %s: %s", plane.folder, err)
        plane.close()
        return
    daemon.handler.shm = plane
    ram = getattr(daemon.store, "ram", daemon.store)
    full_budget = getattr(ram, "budget_bytes", 0)
    # The window in segments that hold the slots the last run on this endpoint was given.
    note = slot_note_path(path)
    plane.arena.window_segment_bytes = window_segment_bytes(full_budget, seg)  # where no note says
    if noted := read_slot_note(note, most=plane.arena.capacity // 2):
        plane.arena.expect_slots(noted)
    try:  # pages ready before a PUT needs them, from the start; not while the RAM tier yields to pressure
        plane.preparer = Preparer(plane.arena, lambda: getattr(ram, "budget_bytes", full_budget) >= full_budget,
                                  window=warm_window(daemon, full_budget, seg), available=memory_available(),
                                  fds_ok=_fds_ok, on_size=lambda size: write_slot_note(note, size)).start()
    except RuntimeError as err:  # no thread to be had: slots reserve their pages as they are handed out
        plane.preparer = None
        log.warning("shared memory: no thread to prepare segments ahead of demand: %s", err)
    last, checked = [0.0], [time.monotonic()]
    ticked = daemon.on_tick

    def on_tick() -> None:
        if ticked is not None:
            ticked()
        # The RAM tier yielded to memory pressure: the arena yields with it.
        now = time.monotonic()
        if getattr(ram, "budget_bytes", full_budget) < full_budget and now - last[0] >= 0.1:
            last[0] = now
            with daemon.lock:
                plane.arena.trim()
        if now - checked[0] >= REPAIR_S:  # names removed under us (a tmp cleaner, RemoveIPC) come back
            checked[0] = now
            try:
                plane.repair()
            except OSError as err:
                daemon.ratelog.warning("shm repair", "shared memory: cannot restore the plane's folder: %s", err)

    daemon.on_tick = on_tick
    # What the remote tier reads back goes to the heap, never straight into a
    # slot: any process of the daemon's user can write into a slot, and a value
    # read into one would be checked (its MAC) where it could still change
    # after. A GET over shared memory moves the entry in from those private
    # bytes, its digests fixed from them (reads.py `_adopt`), as it moves in
    # anything stored over frames. A blob file of the SSD tier goes through a
    # private bounce buffer into its slot, checked and hashed in the bounce
    # (kvd.store.ssd.blobfile.read_to_slots): the same promise, one copy fewer
    # and no new memory. Only on segments no process can cut short (`fixed`:
    # a sealed memfd, an shm_open object on macOS): one that may be is
    # written with pwrite (Arena.copy_in), never through the mapping.
    # Only for a request over shared memory: a frames reply would copy the
    # bytes out of the slot again (kvd.store.base.as_stored).
    ssd = getattr(daemon.store, "ssd", None)
    if plane.arena.fixed and ssd is not None and hasattr(ssd, "read_slots"):
        handler = daemon.handler
        ssd.read_slots = lambda: plane.arena.alloc if handler.over_shm else None
    daemon.handler.stats_sections["shm"] = lambda stats: plane.stats()
    log.info("shared memory offered: %s (%s segments, capacity %d MiB, lease %gs)", plane.folder,
             plane.arena.mechanism, plane.arena.capacity >> 20, plane.leases.lease_seconds)
