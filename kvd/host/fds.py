"""File descriptors: this process's fd limit, how many it holds, and the
two fd calls the peer gate makes without releasing the GIL.

What each OS gives:

    Linux   RLIMIT_NOFILE (hard limit granted as asked); the open fds listed
            in /proc/self/fd; libc's dup3() (atomic with O_CLOEXEC) and
            poll(), called through ctypes.PyDLL so the GIL stays held.
    macOS   RLIMIT_NOFILE reports an unlimited hard limit it does not grant:
            the soft limit goes as high as the kernel allows (OPEN_MAX,
            10240); open fds in /dev/fd; no dup3(): os.dup2, which releases
            the GIL; poll() through ctypes as on Linux.
    other   no fd listing (`open_fds` is None); select() for the wait.

Why without the GIL (kvd/server/admission/gate.py, `_admit`): os.dup2 and
select() release it, and getting it back waits for whichever thread took
it -- up to a switch interval with the listener open, in which libzmq could
accept hundreds of connections.

macOS's OPEN_MAX, quoted verbatim (tabs expanded) from Apple's xnu:
apple-oss-distributions/xnu, tag xnu-11417.101.15, commit
e3723e1f17661b24996789d8afc084c0c3303b26 (tests/host/test_darwin_declarations.py
checks OPEN_MAX against it; Python's resource module supplies RLIMIT_NOFILE
and RLIM_INFINITY, quoted for the reader of `raise_fd_limit`).
    bsd/sys/syslimits.h, line 108:
        #define OPEN_MAX                10240   /* max open files per process - todo, make a config option? */
    bsd/sys/resource.h, lines 496 and 515:
        #define RLIM_INFINITY   (((__uint64_t)1 << 63) - 1)     /* no limit */
        #define RLIMIT_NOFILE   8               /* number of open files */
END_XNU_QUOTE
"""

from __future__ import annotations

import os
import resource
import select

from kvd.host import select as chosen  # the host seam (not the stdlib's select)

OPEN_MAX = 10240  # macOS's ceiling for the soft limit (quoted above)


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns (soft, hard) after.

    macOS reports an unlimited hard limit it does not grant; there the soft
    limit goes as high as the kernel allows (OPEN_MAX, 10240)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for want in (hard, OPEN_MAX):
        if want == resource.RLIM_INFINITY or want <= soft:
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
            break
        except (ValueError, OSError):
            continue
    return soft, hard


def soft_fd_limit() -> int:
    """This process's soft RLIMIT_NOFILE now, as it is (RLIM_INFINITY included)."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def fd_limit() -> int:
    """This process's soft RLIMIT_NOFILE now (another process may change it);
    unlimited reads as 2**30."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 30


def open_fds(limit: int) -> int | None:
    """How many fds this process has open (leaving out the one listdir
    itself opens); `limit` when listing needs an fd there is none for (the
    table is full); None where it cannot be told without opening one per fd
    (no /proc/self/fd nor /dev/fd)."""
    folder = chosen.mechanism("open_fds")  # /proc/self/fd, or /dev/fd (macOS, portable)
    if folder == "none":
        return None
    try:
        return len(os.listdir(folder)) - 1
    except FileNotFoundError:
        return None
    except OSError:
        return limit  # EMFILE or ENFILE: as full as it gets


def _swap_fd():
    """`swap(src, dst)`: dup `src` onto fd number `dst`, close-on-exec, *without
    releasing the GIL* (ctypes.PyDLL). os.dup2 releases it, and getting it back
    waits for whichever thread took it -- up to a switch interval with the
    listener open, in which libzmq could accept hundreds of connections."""
    try:
        import ctypes

        libc = ctypes.PyDLL(None, use_errno=True)
        dup3 = getattr(libc, "dup3", None)  # Linux: atomic with O_CLOEXEC
    except (OSError, AttributeError):
        dup3 = None
    if dup3 is None:
        return lambda src, dst: os.dup2(src, dst, inheritable=False)  # macOS: no dup3

    def swap(src: int, dst: int) -> None:
        if dup3(src, dst, os.O_CLOEXEC) < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return swap


swap_fd = _swap_fd()


def _wait_readable():
    """`wait(fd, ms)`: poll(2) one fd for up to `ms` milliseconds *without
    releasing the GIL* (ctypes.PyDLL), for the same reason as `swap_fd`: the
    gate waits like this with the listener open, and a wait that releases the
    GIL ends only once the gate has it back -- after the serving thread's
    switch interval or its C call, while libzmq accepts all along (the fd test
    beside a full suite aborted on EMFILE 3 runs in 33 with zmq's poll here).
    Falls back to select() (releasing the GIL) where libc cannot be loaded."""
    try:
        import ctypes

        class PollFd(ctypes.Structure):
            _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]

        poll = ctypes.PyDLL(None, use_errno=True).poll
    except (OSError, AttributeError):
        return lambda fd, ms: select.select([fd], [], [], ms / 1000)

    def wait(fd: int, ms: int) -> None:
        pfd = PollFd(fd, select.POLLIN, 0)
        poll(ctypes.byref(pfd), 1, int(ms))

    return wait


wait_readable = _wait_readable()
