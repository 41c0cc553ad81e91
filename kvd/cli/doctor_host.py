"""What `kvd doctor` asks of the code that touches the operating system.

Every call doctor makes into the daemon's OS-facing modules (fd limits, RSS
and malloc tuning, memory-pressure sources, shared-memory segments), the
endpoint rules and the service files goes through this module, so that when
that code moves only the import lines below change. Each function runs the daemon's own code on this
machine -- nothing here re-implements what the daemon does, so a doctor line
is true of `kvd serve` too.
"""

from __future__ import annotations

import mmap
import os
import resource
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

from kvd.endpoint import (
    EndpointError, check_endpoint, check_run_dir, check_socket, endpoint_locked, ipc_path, is_default_run_dir,
)
from kvd.protocol.shm import segment_name
from kvd.host.fds import raise_fd_limit
from kvd.host.memory import rss_bytes, tune_malloc
from kvd.host.pressure import Sample
from kvd.server.admission.caps import default_max_peers
from kvd.server.governor import make_source
from kvd.protocol import handout
from kvd.protocol.errors import KvdError
from kvd.server.shm.plane import ShmPlane
from kvd.server.shm.folders import new_plane_dir, plane_prefix
from kvd.service import install as svc
from kvd.service import launchd, systemd
from kvd.service.install import UnsupportedPlatform

# What doctor calls from kvd.endpoint as it is (it stays where it is).
__all__ = ["EndpointError", "check_endpoint", "check_run_dir", "check_socket", "endpoint_locked", "ipc_path",
           "is_default_run_dir", "fd_limits", "memory_watch", "pressure_sample", "segment_folder", "try_segment",
           "service_state", "UnsupportedPlatform", "ping"]


# -- fd limits --------------------------------------------------------------------


@dataclass(frozen=True)
class FdLimits:
    soft: int  # before kvd serve raises it
    hard: int
    raised: int  # the soft limit after raise_fd_limit, as kvd serve does at start
    max_peers: int  # the default cap kvd serve derives from `raised`


def fd_limits() -> FdLimits:
    """This process's RLIMIT_NOFILE, then raised the way `kvd serve` raises its own."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    raised, _ = raise_fd_limit()
    return FdLimits(soft, hard, raised, default_max_peers(raised))


# -- memory -----------------------------------------------------------------------


def memory_watch() -> tuple[int | None, bool]:
    """(this process's anonymous RSS as the daemon's peer gate reads it, or None
    where it cannot be read cheaply; whether glibc's malloc took kvd's tuning)."""
    return rss_bytes(), tune_malloc()


def pressure_sample(spec: str) -> Sample | None:
    """One sample of the `pressure_source` setting's source; None for "off".
    Raises ValueError for a spec the daemon would refuse too."""
    source = make_source(spec)
    if source is None:
        return None
    sample = source("normal")
    if sample.available is None:  # macOS's sysctl gives a level, no figure: vm_stat's, once
        from dataclasses import replace

        from kvd.host.pressure import darwin_vm_available

        sample = replace(sample, available=darwin_vm_available())
    return sample


# -- shared memory ----------------------------------------------------------------


@dataclass(frozen=True)
class SegmentTrial:
    folder: Path
    sealed: bool  # a sealed memfd named by a symlink (Linux), else a file 0600
    nbytes: int
    mechanism: str = "memfd"  # memfd | shm_open | files (kvd.host.select)
    handed: bool = False  # got by fd from the plane's hand-out service (a shm_open segment has no name)


def _open_segment(plane: ShmPlane, name: str) -> int:
    """A read-only fd of segment `name`, got the way a client gets it
    (client/_shm.py): a shm_open segment, which has no name, by fd from the
    plane's hand-out service (SCM_RIGHTS); else the folder's link or file."""
    if plane.handout is None:
        return os.open(plane.folder / name, os.O_RDONLY | os.O_CLOEXEC)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5.0)
        s.connect(str(plane.handout.path))
        s.sendall(handout.encode_request([name]))
        data, fds, _, _ = socket.recv_fds(s, handout.MAX_REPLY, 1)
    try:
        if handout.parse_reply(data, 1) != [handout.OK] or len(fds) != 1:
            raise OSError(f"the fd hand-out did not hand out {name}: {data!r}")
    except BaseException as err:
        for fd in fds:
            os.close(fd)
        if isinstance(err, KvdError):
            raise OSError(f"the fd hand-out refused {name}: {err}") from None
        raise
    return fds[0]


def segment_folder(socket_path: Path) -> Path:
    """Where the daemon on this socket would make its run's segment folder."""
    return plane_prefix(socket_path).parent


def try_segment(socket_path: Path, nbytes: int = 1 << 16) -> SegmentTrial:
    """Make a segment the way the daemon does (a fresh run folder, the daemon's
    ShmPlane and its Arena; where segments have no name, its fd hand-out),
    write a pattern into a slot, read it back through a second mapping of an
    fd got the way a client gets it (by the segment's name, or handed over by
    the hand-out service), then remove the segment and the folder. Raises
    OSError or AssertionError (read back wrong).

    The folder is named like a daemon run's, so should this process be killed
    midway, the next `kvd serve` on the endpoint sweeps it."""
    folder = new_plane_dir(socket_path)
    plane = None
    try:
        plane = ShmPlane(folder, capacity=4 * nbytes, lease_seconds=1.0, segment_bytes=4 * nbytes)
        plane.hand_out()  # the daemon's own hand-out service, where segments have no name
        arena, run_id = plane.arena, plane.run_id
        slot = arena.alloc(nbytes)
        if slot is None:
            raise OSError(f"the arena could not allocate {nbytes} bytes (see the warning above, if any)")
        pattern = secrets.token_bytes(nbytes)
        slot[:] = memoryview(pattern)
        seg, off = slot.slot.seg, slot.slot.off
        fd = _open_segment(plane, segment_name(run_id, seg))
        try:
            with mmap.mmap(fd, off + nbytes, prot=mmap.PROT_READ) as view:
                back = bytes(view[off:off + nbytes])
        finally:
            os.close(fd)
        if back != pattern:
            raise AssertionError("a second mapping of the segment read back other bytes than were written")
        del slot
        return SegmentTrial(folder, arena.sealed, nbytes, arena.mechanism, handed=plane.handout is not None)
    finally:
        if plane is not None:
            plane.close()  # the hand-out, the segments' names, the nonce, the folder
        for name in os.listdir(folder) if folder.is_dir() else ():
            os.unlink(folder / name)
        if folder.is_dir():
            folder.rmdir()


# -- the service ------------------------------------------------------------------


@dataclass(frozen=True)
class ServiceState:
    init: str
    path: str
    installed: bool
    loaded: bool  # launchd: bootstrapped; systemd: active
    asked: str  # what was asked and the answer, in words
    log: str  # where its output goes


def service_state(endpoint: str, answered: tuple[bool, str]) -> ServiceState:
    """Whether kvd's per-user service is installed and loaded here (launchctl /
    systemctl asked), and where it logs. `answered` is the ping already made,
    so the daemon is not asked twice. Raises UnsupportedPlatform off macOS and Linux."""
    t = svc.Target.current()
    st = svc.status(t, endpoint, pinger=lambda _ep: answered)
    if t.init == "launchd":
        log = str(launchd.log_dir(t.home) / "kvd.err.log")
        asked = f"launchctl print {t.launchd_domain}/{launchd.LABEL}: {'loaded' if st.loaded else 'not loaded'}"
    else:
        log = f"journalctl --user -u {systemd.UNIT_NAME}"
        asked = f"systemctl --user is-active {systemd.UNIT_NAME}: {st.loaded_detail or ('active' if st.loaded else '?')}"
    return ServiceState(st.init, st.path, st.installed, st.loaded, asked, log)


def ping(endpoint: str, timeout: float, keys_dir: str | None, client_key: str) -> tuple[bool, str]:
    """(True, "ping 0.12 ms") if a daemon answers at `endpoint` within `timeout`,
    else (False, why). A strict client: it says why, and logs nothing."""
    from kvd_client import Client, DaemonUnavailable

    try:
        with Client(endpoint, namespace="kvd-admin", timeout=timeout, strict=True,
                    keys_dir=keys_dir, client_key=client_key) as client:
            rtt = client.ping()
    except DaemonUnavailable as exc:
        return False, str(exc)
    except Exception as exc:  # any failure means "not answering"; say why
        return False, f"{type(exc).__name__}: {exc}"
    if rtt is None:
        return False, f"no reply within {timeout:g} s"
    return True, f"ping {rtt * 1000:.2f} ms"
