"""Which mechanism the daemon uses for each OS concern: the one place that
decides it (issue 41's host seam), so `kvd stats --json` (its `host`
section) and the docs can say what a run used.

Two hosts, chosen by the `host` setting (`KVD_HOST`, a developer setting):

    auto      what this OS gives best (Linux: sealed memfds, ...)
    portable  the POSIX-only implementations macOS runs, selected on Linux
              so CI exercises macOS's code: shm_open segments, no memfd.

`mechanisms()` names, per concern, what is used:

    concern        Linux (auto)   portable / macOS       no POSIX shm
    shared_memory  memfd          shm_open               files

A concern is added as one entry of `_CONCERNS`: a function of the host's
name (and this OS) that returns its mechanism's name; modules of kvd.host
ask `host()` or `mechanism(concern)` instead of deciding by themselves.
"""

from __future__ import annotations

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


_CONCERNS: dict[str, Callable[[], str]] = {"shared_memory": _shared_memory}
_cache: dict[str, str] = {}


def mechanism(concern: str) -> str:
    """What `concern` uses in this process (probed once per selection)."""
    if concern not in _cache:
        _cache[concern] = _CONCERNS[concern]()
    return _cache[concern]


def mechanisms() -> dict[str, str]:
    """`kvd stats --json`'s `host` section: the host, and each concern's mechanism."""
    return {"host": _host, **{concern: mechanism(concern) for concern in _CONCERNS}}
