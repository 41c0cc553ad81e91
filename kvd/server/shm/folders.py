"""Where the plane's folder lives: named from the endpoint's socket, made
fresh at each start (a name drawn at random, so no other user can take it
first), and found again by its prefix so the next start sweeps what a killed
run left (kvd/server/shm/plane.py, rule 4). In memory, never on disk: on
Linux under /dev/shm (kvd.host.segments.memory_folder), elsewhere beside
the socket.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import stat
from pathlib import Path

from kvd.host.segments import NAME_SUFFIX, memory_folder, unlink_segment
from kvd.protocol.shm import parse_segment_name

log = logging.getLogger("kvd.server")

NONCE_FILE = "nonce"
HANDOUT_SOCKET = "fds"  # the segment hand-out's socket (kvd/server/shm/handout.py)
_RUN_DIR = re.compile(r"-[0-9a-f]{16}")  # a run's folder: the prefix and this


def plane_prefix(socket_path: Path, uid: int | None = None) -> Path:
    """What the folders of an ipc endpoint's runs are named from (module
    docstring): on Linux `/dev/shm/kvd-<uid>-<12 hex of the socket path's
    hash>`, elsewhere `<socket>.shm` beside the socket."""
    root = memory_folder()
    if root is not None:
        digest = hashlib.sha256(os.fsencode(os.path.abspath(socket_path))).hexdigest()[:12]
        return root / f"kvd-{os.getuid() if uid is None else uid}-{digest}"
    return socket_path.with_name(socket_path.name + ".shm")


def plane_dirs(socket_path: Path, uid: int | None = None) -> list[Path]:
    """The folders runs on this endpoint made and left (a daemon killed; the
    live one's too): named from the prefix (or the prefix alone, as daemons
    before 0.2 named theirs), directories, and owned by `uid` (default: ours).
    A name another user made is never ours to touch."""
    prefix = plane_prefix(socket_path, uid)
    uid = os.getuid() if uid is None else uid
    try:
        names = os.listdir(prefix.parent)
    except OSError:
        return []
    found = []
    for name in names:
        if name != prefix.name and not _RUN_DIR.fullmatch(name.removeprefix(prefix.name)):
            continue
        try:
            st = os.lstat(prefix.parent / name)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid:
            found.append(prefix.parent / name)
    return sorted(found)


def sweep_plane_dirs(socket_path: Path) -> int:
    """Remove the folders killed runs on this endpoint left (call it holding
    the endpoint's lock: no other daemon serves it): their segments, nonce
    and hand-out socket, then the folder. Anything else in one stays, and so does that
    folder. Returns how many folders went."""
    gone = 0
    for folder in plane_dirs(socket_path):
        try:
            for name in os.listdir(folder):
                if parse_segment_name(name.removesuffix(NAME_SUFFIX)) is not None:
                    unlink_segment(folder, name.removesuffix(NAME_SUFFIX))  # a shm_open segment's POSIX name too
                elif name == NONCE_FILE or name.startswith(NONCE_FILE + ".") or name == HANDOUT_SOCKET:
                    os.unlink(folder / name)
            folder.rmdir()
            gone += 1
        except OSError as err:
            log.warning("shared memory: cannot remove %s, a stopped run's folder: %s", folder, err)
    return gone


def new_plane_dir(socket_path: Path) -> Path:
    """A folder for this run's segments, made here, 0700: the prefix and 16
    random hex digits. Another user cannot have made it first (a name taken
    is passed over for another)."""
    prefix = plane_prefix(socket_path)
    for _ in range(8):
        folder = prefix.with_name(f"{prefix.name}-{secrets.token_hex(8)}")
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            continue
        return folder
    raise FileExistsError(f"no free folder name beside {prefix}")


# -- the slots a run was given, for the next run on the endpoint ---------------------
#
# Segments are sized from the RAM budget, chunks from the model: the window a
# daemon prepares before its first PUT (kvd/server/shm/prepare.py) holds a
# 70B-class model's 80 MiB chunks only if the daemon knows that size before
# the first PUT shows it. A run notes the size of the slots it is given
# beside the socket, as it keeps its lock there (kvd.endpoint rule 4), and the
# next run on the endpoint prepares its window in segments that hold them: a
# restart starts as warm as the run before it ended. The note is a number
# in a file of this user's, read with O_NOFOLLOW; anything else there is
# ignored, and a note that cannot be written costs only that.
SLOT_NOTE_SUFFIX = ".slots"


def slot_note_path(socket_path: Path) -> Path:
    """Where runs on this endpoint note the size of the slots they are given."""
    return socket_path.with_name(socket_path.name + SLOT_NOTE_SUFFIX)


def read_slot_note(path: Path, most: int) -> int:
    """The slot size the last run on the endpoint noted (`write_slot_note`),
    or 0: none, not a regular file of this user's, or not a whole number of
    bytes from 1 to `most`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return 0
        raw = os.read(fd, 32)
    except OSError:
        return 0
    finally:
        os.close(fd)
    if not raw.strip().isdigit():
        return 0
    nbytes = int(raw)
    return nbytes if 0 < nbytes <= most else 0


def write_slot_note(path: Path, nbytes: int) -> bool:
    """Note `nbytes` for the next run (a new file of this user's renamed over
    the old, 0600); whether it was noted."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    try:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:  # a run of this pid before (a container's pid 1) left it
            os.unlink(tmp)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"%d\n" % int(nbytes))
        finally:
            os.close(fd)
        os.replace(tmp, path)
        return True
    except OSError as err:
        log.debug("shared memory: cannot note the slot size in %s: %s", path, err)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False
