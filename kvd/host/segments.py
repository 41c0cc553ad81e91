"""Shared-memory segments as the OS makes them, and where they can live:
the host half of the daemon's shared-memory plane (kvd/server/shm/).

What each OS gives:

    Linux   memfd_create() with sealing: a segment is a memfd sealed against
            shrinking (F_SEAL_SHRINK | F_SEAL_SEAL), so no process can cut it
            short under a mapping (the next touch of its pages would be
            SIGBUS, in the daemon and in every client), named in the plane's
            folder by a symlink to /proc/<pid>/fd/<fd> (which only processes
            allowed to inspect the daemon, i.e. of its uid, can open). It
            dies with the daemon and its clients' mappings. The folder goes
            in /dev/shm when that is a tmpfs (`memory_folder`); a client
            checks it shares the daemon's pid namespace (`pid_namespace`).
            A seccomp filter may forbid memfd_create: then as below.
    macOS   no memfd: a segment is a file 0600 in the folder, which sits
            beside the socket (README, known limits); no pid namespaces.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import sys
from pathlib import Path

log = logging.getLogger("kvd.server")

_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_SEAL", 0)
_SEALED = hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS") and _SEALS


def _tmpfs(path: str) -> bool:
    try:
        with open("/proc/mounts") as f:
            return any(line.split()[1:3] == [path, "tmpfs"] for line in f if len(line.split()) > 2)
    except OSError:
        return False


def memory_folder() -> Path | None:
    """The folder whose files are memory, not disk (Linux: /dev/shm when it is
    a tmpfs); None where there is none (macOS)."""
    if sys.platform.startswith("linux") and _tmpfs("/dev/shm"):
        return Path("/dev/shm")
    return None


def pid_namespace() -> str | None:
    """This process's pid namespace (Linux: the /proc/self/ns/pid link), or
    None where it cannot be read."""
    with contextlib.suppress(OSError):
        return os.readlink("/proc/self/ns/pid")
    return None


def probe_memfd() -> bool:
    """Whether this process may make sealed memfds (a seccomp filter may
    forbid memfd_create: then segments are files, as off Linux)."""
    if not _SEALED:
        return False
    try:
        fd = os.memfd_create("kvd-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as err:
        log.warning("shared memory: memfd_create refused (%s); segments are files in the folder", err)
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        return True
    except OSError as err:
        log.warning("shared memory: memfds cannot be sealed (%s); segments are files in the folder", err)
        return False
    finally:
        os.close(fd)


def probe_shm_open() -> bool:
    """Whether POSIX shm_open objects can be made here (Linux and macOS;
    Python's `_posixshmem`, as multiprocessing.shared_memory uses)."""
    try:
        import _posixshmem
    except ImportError:
        return False
    name = f"/kvd-{os.getuid()}-{secrets.token_hex(8)}"
    try:
        fd = _posixshmem.shm_open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as err:
        log.warning("shared memory: shm_open refused (%s); segments are files in the folder", err)
        return False
    os.close(fd)
    with contextlib.suppress(OSError):
        _posixshmem.shm_unlink(name)
    return True


def new_segment(folder: Path, name: str, size: int, sealed: bool) -> int:
    """A new segment of `size` bytes (sparse), open read-write, named `name`
    in `folder`: the one OS-specific step of the arena (kvd/server/shm/arena.py,
    rule 5). `sealed` (Linux, `probe_memfd`): a memfd sealed against
    shrinking, named by a symlink to /proc/<pid>/fd/<fd>. Else: a file 0600."""
    path = folder / name
    if not sealed:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        return fd
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        name_segment(path, fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def name_segment(path: Path, fd: int) -> None:
    """Make `path` name the segment open on `fd` (a memfd: a symlink to it)."""
    os.symlink(f"/proc/{os.getpid()}/fd/{fd}", path)


def names_segment(path: Path, fd: int) -> bool:
    """Whether the symlink `path` still names the memfd open on `fd`."""
    try:
        return os.readlink(path) == f"/proc/{os.getpid()}/fd/{fd}"
    except OSError:
        return False
