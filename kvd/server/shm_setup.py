"""Attach the shared-memory plane to a bound daemon (kept apart from daemon.py)."""

from __future__ import annotations

import logging

from kvd.endpoint import ipc_path
from kvd.server.shm import ShmPlane, plane_dir

log = logging.getLogger("kvd.server")


def arena_capacity(store) -> int:
    """Room for the RAM tier twice over (its own bytes, plus leased and
    spill-pending slots of evicted entries), and one segment more."""
    ram = getattr(store, "ram", store)
    return 2 * int(getattr(ram, "budget_bytes", 0)) + (256 << 20)


def open_plane(daemon) -> None:
    """Create the plane in `<socket>.shm/` and let the handler and the SSD tier use it.
    A failure only costs the plane: the daemon serves frames and says why."""
    path = ipc_path(daemon.endpoint)
    if path is None:  # an abstract socket has no folder to hold a private nonce
        return
    try:
        plane = ShmPlane(plane_dir(path), capacity=arena_capacity(daemon.store), lease_seconds=daemon.shm_lease_s)
    except Exception as err:  # an unsafe folder, a full disk: frames still work
        log.warning("shared memory disabled: %s", err)
        return
    daemon.handler.shm = plane
    ssd = getattr(daemon.store, "ssd", None)
    if ssd is not None and hasattr(ssd, "read_buffers"):
        ssd.read_buffers = plane.arena.alloc  # a cold hit lands in shared memory, never a bytearray first
    daemon.handler.stats_sections["shm"] = lambda stats: plane.stats()
    log.info("shared memory offered: %s (capacity %d MiB, lease %gs)", plane.folder, plane.arena.capacity >> 20,
             plane.leases.lease_seconds)
