"""Shared-memory segments as the OS makes them, and where they can live:
the host half of the daemon's shared-memory plane (kvd/server/shm/). Which
mechanism a run uses is decided in kvd/host/select.py (`shared_memory`).

What each OS gives:

    Linux   memfd_create() with sealing ("memfd", the default): a segment is
            a memfd sealed against shrinking (F_SEAL_SHRINK | F_SEAL_SEAL), so
            no process can cut it short under a mapping (the next touch of its
            pages would be SIGBUS, in the daemon and in every client), named in
            the plane's folder by a symlink to /proc/<pid>/fd/<fd> (which only
            processes allowed to inspect the daemon, i.e. of its uid, can
            open). It dies with the daemon and its clients' mappings. The
            folder goes in /dev/shm when that is a tmpfs (`memory_folder`); a
            client checks it shares the daemon's pid namespace (`pid_namespace`).
            A seccomp filter may forbid memfd_create: then as below.
    macOS,  POSIX shm_open() objects ("shm_open"; on Linux with host =
    portable  portable): memory, never a file on disk. Made under a name
            `/kvd-<uid>-<random hex>` (at most 31 characters: macOS's
            PSHMNAMLEN), created O_CREAT | O_EXCL 0600, so no other user can
            take or open the name, and unlinked at once: the daemon keeps the
            fd, and a client gets the segment from the daemon's hand-out
            service as an fd (SCM_RIGHTS, kvd/server/shm/handout.py). So no
            name outlives its creation: none to squat, none a kill -9 leaves
            behind. (Earlier daemons kept the name while the segment
            lived, written in a `<segment>.shm` file of the folder: a start
            still unlinks what such a file names, `unlink_segment`.) Such an
            object cannot be sealed: on Linux a process of the daemon's uid
            holding its fd (any client it was handed to) can ftruncate it
            short, so the daemon never touches these segments' pages in user
            space where a client can write them: it reads and writes them with
            pread/pwrite on the fd (`Arena.copy_out`), and a short read is a
            damaged entry, a miss. macOS refuses a second ftruncate of a
            POSIX shm object (EINVAL), so there no process can shrink one;
            and it takes no read(2)/write(2) on one (ENOTSUP; pread/pwrite:
            ESPIPE), so there the daemon touches the pages through its own
            mapping, as it does a sealed memfd's (`fixed_size`).
    other   no POSIX shm: a segment is a file 0600 in the folder ("files").

Pages made ready ahead of use (issue 42): on Linux `clear` writes zeros
through a new segment's fd (its pages allocated, cleared and resident, and
mapped in no process: faster than the way below, which also fills the
daemon's page tables). Else `populate`: Linux 5.14+
madvise(MADV_POPULATE_WRITE) through ctypes (the GIL released while the
kernel clears the pages; a page a mapping cannot have is an error, never a
SIGBUS). A shmem page reserved by posix_fallocate is not cleared until its
first fault, and another process's fault maps such pages one at a time;
once cleared here, a client's MADV_POPULATE_READ maps them sixteen a fault
(fault-around). Elsewhere (macOS: 16 KiB pages, no MADV_POPULATE_*) it does
nothing and the first write faults them in.

Huge pages: where Linux's shmem THP policy lets a mapping ask for them
(`shmem_huge_policy`: advise, within_size, always or force; many
distributions ship `never`), the daemon asks (`advise_huge`) on its mapping
of each memfd segment and prepares the segment with `populate` there: the
kernel then allocates and clears 2 MiB pages, and every process that maps
the segment later maps them 2 MiB a page-table entry, whatever its own
mapping asked. Measured on this 2-core VM, 256 MiB of segments
(bench/bench_pages.py, bench/RESULTS.md Session 38): prepared in 12 ms
against ~100 ms of 4 KiB pages written through the fd, a put and a fetch
through a new process's mapping 21 and 21-24 ms (a touched memcpy: 21 ms)
against ~105 and ~46 ms. Out of memory this VM had handed back to its host
(free page reporting) the preparation took 587 ms: the host's faults.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import stat
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


def fixed_size(mechanism: str, platform: str = sys.platform) -> bool:
    """Whether no process can cut a segment of `mechanism` short once it is
    made, so the daemon may read and write its pages through its own mapping
    (kvd.server.shm.arena: `Arena.fixed`) with no SIGBUS to fear. A sealed
    memfd: F_SEAL_SHRINK. A POSIX shm object on macOS: XNU sizes one once
    (`pshm_truncate` refuses, EINVAL, once it is allocated) and has no read or
    write for it (`pshm_read`/`pshm_write` answer ENOTSUP, bsd/kern/posix_shm.c),
    so the pread/pwrite road below would fail there on every call. Not a POSIX
    shm object on Linux (a tmpfs file) nor a file: any process of the uid
    holding the fd may ftruncate it, so the daemon uses pread/pwrite."""
    return mechanism == "memfd" or (mechanism == "shm_open" and platform == "darwin")


def probe_shm_open() -> bool:
    """Whether POSIX shm_open objects can be made here (Linux and macOS;
    Python's `_posixshmem`, as multiprocessing.shared_memory uses)."""
    try:
        import _posixshmem
    except ImportError:
        return False
    name = shm_name()  # as long as macOS allows (31: a 10-digit uid made a 32-character name, refused)
    try:
        fd = _posixshmem.shm_open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as err:
        log.warning("shared memory: shm_open refused (%s); segments are files in the folder", err)
        return False
    os.close(fd)
    with contextlib.suppress(OSError):
        _posixshmem.shm_unlink(name)
    return True


SHM_NAME_MAX = 31  # macOS's PSHMNAMLEN, the leading slash included
NAME_SUFFIX = ".shm"  # `<segment>.shm`: where earlier daemons wrote a shm_open segment's POSIX name
_SHM_NAME = re.compile(r"/kvd-([0-9]+)-[0-9a-f]{8,20}")


def shm_name(uid: int | None = None) -> str:
    """A fresh POSIX shm name: `/kvd-<uid>-<random hex>`, as long as macOS allows."""
    prefix = f"/kvd-{os.getuid() if uid is None else uid}-"
    return prefix + secrets.token_hex(10)[:min(20, SHM_NAME_MAX - len(prefix))]


def read_shm_name(path: Path) -> str | None:
    """The POSIX name a `<segment>.shm` file holds, if it is one of ours (a
    regular file, our uid, a name of our uid's form); else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        name = os.read(fd, 64).decode("ascii", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)
    m = _SHM_NAME.fullmatch(name)
    return name if m and int(m.group(1)) == os.getuid() else None


def new_segment(folder: Path, name: str, size: int, mechanism: str) -> int:
    """A new segment of `size` bytes (sparse), open read-write, named `name`
    in `folder`: the one OS-specific step of the arena (kvd/server/shm/arena.py,
    rule 5). `mechanism` (kvd.host.select): "memfd", a memfd sealed against
    shrinking, named by a symlink to /proc/<pid>/fd/<fd>; "shm_open", a POSIX
    shm object with no name left (handed out by fd); "files", a file 0600."""
    path = folder / name
    if mechanism == "files":
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        return fd
    if mechanism == "shm_open":
        return _new_shm(size)
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


def _new_shm(size: int) -> int:
    """A POSIX shm object of `size` bytes whose name is already gone: only
    its fd holds it (the module docstring)."""
    import _posixshmem

    for _ in range(8):
        posix = shm_name()
        try:
            fd = _posixshmem.shm_open(posix, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # taken (by another user, say): draw again
            continue
        break
    else:
        raise FileExistsError("no free POSIX shm name")
    # The name goes before anything can fail or be killed: nothing to leave behind.
    with contextlib.suppress(OSError):
        _posixshmem.shm_unlink(posix)
    try:
        os.set_inheritable(fd, False)
        os.ftruncate(fd, size)  # the one ftruncate macOS allows
    except BaseException:
        os.close(fd)
        raise
    return fd


def unlink_segment(folder: Path, name: str) -> None:
    """Remove a segment's name from the folder (the mapping and fds stay
    valid): its link or file, and for a shm_open segment of an earlier daemon
    the POSIX name its `.shm` file holds, then that file. What is gone
    already is no error."""
    record = folder / (name + NAME_SUFFIX)
    posix = read_shm_name(record)
    if posix is not None:
        import _posixshmem

        with contextlib.suppress(FileNotFoundError):
            _posixshmem.shm_unlink(posix)
    for path in (record, folder / name):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


_MADV_POPULATE_WRITE = 23  # include/uapi/asm-generic/mman-common.h, Linux 5.14
_MADV_HUGEPAGE = 14  # the same header
SHMEM_THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
# Those that let a mapping ask (Documentation/admin-guide/mm/transhuge.rst).
# Under always and force every shmem page may be 2 MiB whatever the daemon
# asks, and khugepaged may refill the holes `Arena.trim` punches; advise is
# the setting kvd doctor suggests.
HUGE_POLICIES = ("always", "within_size", "advise", "force")


def _libc(name: str, *argtypes: str):
    """A Linux libc call through ctypes (it releases the GIL for the call), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
        fn.argtypes = tuple(getattr(ctypes, t) for t in argtypes)
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError):
        return None


_MADVISE = _libc("madvise", "c_void_p", "c_size_t", "c_int")
_FALLOCATE = _libc("fallocate", "c_int", "c_int", "c_longlong", "c_longlong")


def shmem_huge_policy(path: str = SHMEM_THP) -> str | None:
    """Linux's policy for 2 MiB pages in shmem, which memfd segments are: the
    word in brackets of `path` (always, within_size, advise, never, deny or
    force), unless the PMD size's own knob beside it (Linux 6.x:
    hugepages-2048kB/shmem_enabled on x86-64) says other than `inherit`;
    None where there is no such file (not Linux; no THP)."""
    policy = _bracketed(path)
    folder = os.path.dirname(path)
    try:
        with open(os.path.join(folder, "hpage_pmd_size")) as f:
            pmd_kib = int(f.read()) // 1024
    except (OSError, ValueError):
        return policy
    own = _bracketed(os.path.join(folder, f"hugepages-{pmd_kib}kB", "shmem_enabled"))
    if policy in ("deny", "force") or own in (None, "inherit"):  # the global word overrides every size
        return policy
    return own


def _bracketed(path: str) -> str | None:
    try:
        with open(path) as f:
            m = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return None
    return m.group(1) if m else None


def advise_huge(address: int, length: int) -> bool:
    """Ask for 2 MiB pages where [address, address + length) of a memfd
    segment's mapping faults its pages in (madvise MADV_HUGEPAGE; module
    docstring, "Huge pages"); whether the kernel took the advice."""
    if _MADVISE is None or length <= 0:
        return False
    return _MADVISE(address, length, _MADV_HUGEPAGE) == 0


def populate(address: int, length: int) -> bool:
    """Make the pages of [address, address + length) of a shared mapping
    present and cleared (module docstring); whether that was done. Releases
    the GIL for the whole call."""
    if _MADVISE is None or length <= 0:
        return False
    return _MADVISE(address, length, _MADV_POPULATE_WRITE) == 0


_ZEROS = bytes(256 << 10)
_CLEAR_IOV = [_ZEROS] * 16  # 4 MiB a call, from 256 KiB of zeros that stay in cache


def clear(fd: int, length: int, offset: int = 0) -> bool:
    """Reserve and clear `length` bytes from `offset` of a segment, pages no
    process uses (a new segment; the holes of a slot just handed out), by
    writing zeros through its fd: Linux allocates their shmem pages cleared
    and resident (so a client's MADV_POPULATE_READ maps them sixteen a
    fault) and maps them nowhere. Whether that was done (False off Linux,
    where a POSIX shm object takes no write(2), and when the memory is not
    there: ENOSPC, ENOMEM; what was written then is given back). On this VM 2.6 GiB/s against 1.7
    for posix_fallocate and `populate`, which also fill this process's page
    tables (bench/RESULTS.md, Session 34). Never on memory in use: what is
    there is overwritten."""
    if not sys.platform.startswith("linux"):
        return False
    step = len(_ZEROS) * len(_CLEAR_IOV)
    off, end = offset, offset + length
    try:
        while off < end:
            n = min(step, end - off)
            iov = _CLEAR_IOV if n == step else _iov(n)
            wrote = os.pwritev(fd, iov, off)
            if wrote <= 0:
                break
            off += wrote
    except OSError:
        pass
    if off >= end:
        return True
    # Not all of it (a full memory cgroup or /dev/shm): give back what was
    # written, as a posix_fallocate that fails does (the range is the caller's
    # alone), or its pages would stay charged to the daemon, counted nowhere.
    give_back(fd, offset, off - offset)
    return False


def give_back(fd: int, offset: int, length: int) -> None:
    """Free the pages of [offset, offset + length) of a segment no process
    uses (a clear or a preparation cut short; Linux fallocate(
    FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)); best effort."""
    if _FALLOCATE is not None and length > 0:
        _FALLOCATE(fd, 0x02 | 0x01, offset, length)


def _iov(n: int) -> list:
    full, rest = divmod(n, len(_ZEROS))
    return [_ZEROS] * full + ([memoryview(_ZEROS)[:rest]] if rest else [])


def name_segment(path: Path, fd: int) -> None:
    """Make `path` name the segment open on `fd` (a memfd: a symlink to it)."""
    os.symlink(f"/proc/{os.getpid()}/fd/{fd}", path)


def names_segment(path: Path, fd: int) -> bool:
    """Whether the symlink `path` still names the memfd open on `fd`."""
    try:
        return os.readlink(path) == f"/proc/{os.getpid()}/fd/{fd}"
    except OSError:
        return False
