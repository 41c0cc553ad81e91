"""Which mechanism the daemon uses for each OS concern: the one place that
decides it (issue 41's host seam), so `kvd stats --json` (its `host`
section) and the docs can say what a run used.

Two hosts, chosen by the `host` setting (`KVD_HOST`, a developer setting):

    auto      what this OS gives best (Linux: sealed memfds, ...)
    portable  the POSIX-only implementations macOS runs, selected on Linux
              so CI exercises macOS's code: shm_open segments, no memfd.

`mechanisms()` names, per concern, what is used:

    concern            Linux (auto)          portable (Linux)       macOS
    shared_memory      memfd (sealed)        shm_open               shm_open
    open_fds           /proc/self/fd         /dev/fd                /dev/fd
    accept_guard       patched accept        gate only              gate only
    memory_pressure    meminfo+psi+cgroup    meminfo+cgroup         sysctl+vm_stat
    process_memory     statm                 statm                  proc_pid_rusage
    peer_credentials   SO_PEERCRED           SO_PEERCRED            LOCAL_PEERPID
    service            systemd               systemd                launchd
    shared_memory_pages  2 MiB (shmem THP <policy>) where Linux's policy allows,
                       else 4 KiB            4 KiB                  16 KiB (Apple Silicon)

What portable cannot change on Linux, it keeps: no POSIX call tells a
process's own resident memory or its peer's pid, and macOS's
proc_pid_rusage, LOCAL_PEERPID, sysctl and vm_stat do not exist here (their
ctypes declarations and parsers are checked against quoted SDK headers and
recorded outputs: tests/host/). Where neither works the mechanism is "none"
(or "files" for shared memory): the concern is off, and `kvd doctor` says so.

A concern is added as one entry of `_CONCERNS`: a function of the host's
name (and this OS) that returns its mechanism's name; modules of kvd.host
ask `host()` or `mechanism(concern)` instead of deciding by themselves.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

HOSTS = ("auto", "portable")
_host = "auto"


def use(name: str) -> None:
    """Select the host for this process (`kvd serve` calls it with the setting
    before it makes anything OS-specific)."""
    global _host
    if name not in HOSTS:
        raise ValueError(f"expected one of {', '.join(HOSTS)}, got {name!r}")
    _host = name
    _cache.clear()


def host() -> str:
    return _host


def portable() -> bool:
    """Whether only POSIX mechanisms are used (macOS always; Linux when selected)."""
    return _host == "portable" or not sys.platform.startswith("linux")


def _shared_memory() -> str:
    from kvd.host import segments  # the concern's own module knows what this process may do

    if not portable() and segments.probe_memfd():
        return "memfd"
    return "shm_open" if segments.probe_shm_open() else "files"


def _linux() -> bool:
    return sys.platform.startswith("linux")


def _open_fds() -> str:
    if not portable() and os.path.isdir("/proc/self/fd"):
        return "/proc/self/fd"
    return "/dev/fd" if os.path.isdir("/dev/fd") else "none"


def _accept_guard() -> str:
    # libzmq's accept() patched through its GOT (kvd.server.admission.acceptguard):
    # an ELF-only trick, so Linux's auto host alone has it.
    return "patched accept" if _linux() and not portable() else "gate only"


def _memory_pressure() -> str:
    if _linux():
        return "meminfo+cgroup" if portable() else "meminfo+psi+cgroup"
    return "sysctl+vm_stat" if sys.platform == "darwin" else "none"


def _process_memory() -> str:
    if _linux():
        return "statm"
    return "proc_pid_rusage" if sys.platform == "darwin" else "none"


def _peer_credentials() -> str:
    if _linux():
        return "SO_PEERCRED"
    return "LOCAL_PEERPID" if sys.platform == "darwin" else "none"


def _service() -> str:
    if _linux():
        return "systemd"
    return "launchd" if sys.platform == "darwin" else "none"


def _shared_memory_pages() -> str:
    # The daemon asks for huge pages on its memfd segments only (an shm_open
    # object's tmpfs mount has a huge= option of its own: not the daemon's to ask).
    from kvd.host import segments

    if mechanism("shared_memory") == "memfd":
        policy = segments.shmem_huge_policy()
        if policy in segments.HUGE_POLICIES:
            return f"2 MiB (shmem THP {policy})"
    return f"{os.sysconf('SC_PAGESIZE') // 1024} KiB" if hasattr(os, "sysconf") else "none"


_CONCERNS: dict[str, Callable[[], str]] = {
    "shared_memory": _shared_memory,
    "open_fds": _open_fds,
    "accept_guard": _accept_guard,
    "memory_pressure": _memory_pressure,
    "process_memory": _process_memory,
    "peer_credentials": _peer_credentials,
    "service": _service,
    "shared_memory_pages": _shared_memory_pages,
}
_cache: dict[str, str] = {}


def mechanism(concern: str) -> str:
    """What `concern` uses in this process (probed once per selection)."""
    if concern not in _cache:
        _cache[concern] = _CONCERNS[concern]()
    return _cache[concern]


def mechanisms() -> dict[str, str]:
    """`kvd stats --json`'s `host` section: the host, and each concern's mechanism."""
    return {"host": _host, **{concern: mechanism(concern) for concern in _CONCERNS}}
