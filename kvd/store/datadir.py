"""Where the SSD tier lives on disk, and who may use it.

Layout of a data dir (every directory 0700, every file 0600: KV blocks are
as sensitive as the prompts they were computed from)::

    <data dir>/
      kvd.lock                 flock()ed by the one process that writes here
      index/                   the LMDB environment (data.mdb, lock.mdb)
      blobs/<2 hex>/           blobs sharded by the first byte of the key
        <66 hex>.safetensors   one entry: hex(entry id) = chunk key + kind
        .<66 hex>.<pid>.tmp    a blob being written (or left by a crash)
      quarantine/              blobs that failed their checksum, kept for a post-mortem

256 shards keep directories at a few thousand files for a million entries,
which every filesystem kvd runs on handles well, while staying one level
deep so reconcile walks few directories.

The lock is an flock on `kvd.lock`: the kernel drops it when the holder dies
(even by SIGKILL), so a stale lock never needs a human. The daemon holds it
for its whole life; `kvd gc --offline` takes it too, and so refuses to run
beside a live daemon. Read-only stats do not take it (LMDB readers coexist
with the writer).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import time
from pathlib import Path
from typing import Callable

from kvd.host.dirs import cache_dir, planted
from kvd.protocol.errors import KvdError

INDEX_DIR = "index"
PACK_DIR = "pack"  # small blobs, packed into one LMDB file (pack.py)
BLOB_DIR = "blobs"
QUARANTINE_DIR = "quarantine"
LOCK_FILE = "kvd.lock"
BLOB_SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"

DIR_MODE = 0o700
FILE_MODE = 0o600

log = logging.getLogger("kvd.store.ssd")


class DataDirBusy(KvdError, RuntimeError):
    """Another process (a running daemon, or an offline gc) holds the data dir's lock."""


def default_data_dir(environ=None, platform: str | None = None) -> Path:
    """The per-user cache directory kvd uses when none is given.

    macOS: ~/Library/Caches/kvd. Elsewhere: $XDG_CACHE_HOME/kvd, else ~/.cache/kvd.
    `environ` and `platform` default to this process's.
    """
    return cache_dir(environ, platform)  # kvd/host/dirs.py


def ensure_dirs(root: str | os.PathLike) -> Path:
    """Create the data dir and its fixed subdirectories (0700). Returns the root."""
    root = Path(root)
    _not_planted(root)
    for sub in ("", INDEX_DIR, BLOB_DIR, QUARANTINE_DIR):
        path = root / sub if sub else root
        if sub == QUARANTINE_DIR:
            ensure_quarantine(root)  # only kept for a post-mortem: never a reason not to start
            continue
        if sub == BLOB_DIR:
            ensure_blob_dirs(root)
        elif sub:
            ensure_folder(root, sub)  # a symlink there would have LMDB and chmod work wherever it points
        else:
            path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        # mkdir's mode is masked by the umask and ignored for existing dirs:
        # tighten explicitly (a dir made by hand with 0755 gets fixed too),
        # but never grant: a folder its owner made read-only stays so, and
        # the daemon then serves RAM only (kvd/cli/serve.py).
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            os.chmod(path, mode & DIR_MODE)
    return root


def _not_planted(root: Path) -> None:
    """The data dir itself may be a symlink (a cache on another disk) -- but
    not one another user made: in a shared folder (/tmp) that would have kvd
    chmod and fill whatever it points at. PermissionError if it is."""
    uid = planted(root)
    if uid is not None:
        raise PermissionError(errno.EPERM, f"the data dir is a symlink of uid {uid}, not yours", str(root))


def ensure_folder(root: Path, rel: str, *, sync: Callable[[Path], None] | None = None) -> Path:
    """root/rel as a real folder of ours: made again (with its parents) if it
    is missing, and if something else took its name -- a file, or a symlink,
    which kvd would otherwise write into and delete from wherever it points --
    that is moved aside into the data dir (`<rel with - for />.not-a-dir-<time>`,
    never inside blobs/, where a walk would look into it) and a new one made.
    `sync(parent)` is called for each folder made (to fsync it into its
    parent). Returns the path.
    Raises OSError if it cannot be made (the caller's disk error)."""
    path = Path(root) / rel
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        return path
    if st is not None:
        aside = Path(root) / f"{rel.replace('/', '-')}.not-a-dir-{int(time.time())}"
        os.rename(path, aside)
        log.warning("ssd: %s was not a folder (%s); moved it to %s and made a new one",
                    path, "a symlink" if stat.S_ISLNK(st.st_mode) else "a file", aside)
    elif "/" in rel:
        ensure_folder(root, rel.rsplit("/", 1)[0], sync=sync)
    try:
        path.mkdir(mode=DIR_MODE)
    except FileExistsError:  # made meanwhile by someone else: look again
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise
        return path
    if sync is not None:
        sync(path.parent)
    return path


def shard_folders(root: str | os.PathLike) -> list[Path]:
    """The shard folders under root/blobs/, sorted, never through a symlink (a
    walk that followed one would take whatever it points at for blobs, to index
    or to delete); none if blobs/ is not a folder. Raises OSError if it cannot
    be listed: each walk decides what that means for it."""
    blob_root = Path(root) / BLOB_DIR
    try:
        if not stat.S_ISDIR(os.lstat(blob_root).st_mode):
            return []
    except FileNotFoundError:
        return []
    with os.scandir(blob_root) as it:
        return sorted(Path(e.path) for e in it if e.is_dir(follow_symlinks=False))


def ensure_blob_dirs(root: Path) -> None:
    """blobs/ as a real folder, and any symlink in it named like a shard
    moved aside: walks (reconcile, `kvd gc --orphans`) would otherwise
    delete "orphans" in whatever it points at. One scandir of blobs/. (A
    file under a shard's name is left: writes there fail, one path each.)"""
    ensure_folder(root, BLOB_DIR)
    with os.scandir(Path(root) / BLOB_DIR) as it:
        odd = [e.name for e in it if _is_shard_name(e.name) and e.is_symlink()]
    for name in odd:
        ensure_folder(root, f"{BLOB_DIR}/{name}")


def _is_shard_name(name: str) -> bool:
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


def ensure_quarantine(root: Path) -> Path | None:
    """The quarantine folder, made again if it is missing or something else
    took its name (that is moved aside as `quarantine.not-a-dir-<time>`).
    None, logged, if it cannot be made: quarantining then removes blobs."""
    qdir = Path(root) / QUARANTINE_DIR
    try:
        ensure_folder(root, QUARANTINE_DIR)
        mode = qdir.stat().st_mode & 0o777
        if mode & 0o077:
            os.chmod(qdir, mode & DIR_MODE)
        return qdir
    except OSError as exc:
        log.error("ssd: cannot make the quarantine folder %s: %s", qdir, exc)
        return None


def blob_name(eid: bytes) -> str:
    return eid.hex() + BLOB_SUFFIX


def shard_of(eid: bytes) -> str:
    return eid[:1].hex()


def blob_path(root: Path, eid: bytes) -> Path:
    """Where the blob of entry `eid` lives (whether or not it exists)."""
    return root / BLOB_DIR / shard_of(eid) / blob_name(eid)


def eid_of_blob(name: str) -> bytes | None:
    """The entry id a blob file name encodes, or None if it is not a blob name."""
    if not name.endswith(BLOB_SUFFIX) or name.startswith("."):
        return None
    try:
        eid = bytes.fromhex(name[: -len(BLOB_SUFFIX)])
    except ValueError:
        return None
    return eid if len(eid) == 33 else None


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(TMP_SUFFIX)


class DataDirLock:
    """An exclusive, non-blocking flock on <data dir>/kvd.lock.

    Raises DataDirBusy from `acquire` if another process holds it. The file
    records the holder's pid for humans; the flock, not the pid, is the truth.
    """

    def __init__(self, root: str | os.PathLike):
        self.path = Path(root) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> "DataDirLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO, a device: not a lock of ours
            os.close(fd)
            raise OSError(errno.EINVAL, "the data dir's lock is not a regular file", str(self.path))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = self.holder()
                raise DataDirBusy(
                    f"{self.path.parent} is in use by another kvd process"
                    + (f" (pid {holder})" if holder else "")
                    + "; stop it first, or use another --data-dir"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def holder(self) -> int | None:
        """The pid the lock file names, if it is a regular file that names one
        (read without blocking: a FIFO planted there would hang an open)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            return int(os.read(fd, 64).strip() or 0) or None
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)

    def release(self) -> None:
        if self._fd is not None:
            # Clear our pid while still holding the lock, so nobody reads a
            # live-but-former holder. Closing drops the flock; the file stays
            # (unlinking it would race a process that opened but has not yet
            # locked it).
            try:
                os.ftruncate(self._fd, 0)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "DataDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
