"""Durable files: what a sync promises, and reserving a file's extents.

What each OS gives:

    concern       Linux                          macOS
    fsync         reaches stable storage         hands the data to the drive, whose
                  (the drive's cache flushed)    cache a power loss may still lose
    full sync     = fsync                        fcntl F_FULLFSYNC: the drive's cache
                                                 flushed too, several times the cost
    preallocate   posix_fallocate (extents       none (the filesystem grows files
                  taken at once; a full disk     well by itself)
                  fails before a byte is copied)

F_FULLFSYNC is used only where the `full_fsync` setting asks (one policy per
process: the daemon sets it when it opens its store, `set_full_fsync`). Some
filesystems (network, FAT) refuse it; fsync is then the best left.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

_FULL = False


def set_full_fsync(on: bool) -> None:
    """Whether syncs use F_FULLFSYNC where it exists (the `full_fsync` setting)."""
    global _FULL
    _FULL = bool(on)


def full_fsync(fd: int) -> None:
    """Flush `fd` to stable storage: fsync, or F_FULLFSYNC on macOS when the
    `full_fsync` setting asks for it (set_full_fsync)."""
    if _FULL and sys.platform == "darwin":
        import fcntl

        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:
            pass  # some filesystems (network, FAT) refuse it; fsync is the best left
    os.fsync(fd)


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a file created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        full_fsync(fd)
    finally:
        os.close(fd)


def preallocate(fd: int, size: int) -> None:
    """Reserve `size` bytes for the file at once where the OS offers it.
    Best effort: a filesystem that cannot (EOPNOTSUPP, EINVAL) is written
    as before; a full disk (ENOSPC, EDQUOT) or EIO raises here, before any
    byte is copied."""
    if not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
            raise
