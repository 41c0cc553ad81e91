"""macOS's answers for POSIX shm objects, where Linux answers otherwise
(checked on Linux with the Mac's answer injected: the fault cannot be made
here). XNU: a name is at most PSHMNAMLEN (31) characters, the slash included
(`pshm_get_name`: ENAMETOOLONG past it); Linux allows 255."""

from __future__ import annotations

import errno

import pytest

from kvd.host import segments

_posixshmem = pytest.importorskip("_posixshmem")


def test_the_shm_open_probe_makes_a_name_macos_takes_whatever_the_uid(monkeypatch):
    """A 10-digit uid (Active Directory accounts on Macs have them) made the
    probe's name 32 characters: refused there, and segments went to files on
    the SSD for every run."""
    real, names = _posixshmem.shm_open, []

    def like_macos(name, flags, mode=0o777):
        names.append(name)
        if len(name) > segments.SHM_NAME_MAX:
            raise OSError(errno.ENAMETOOLONG, "File name too long")
        return real(name, flags, mode)

    monkeypatch.setattr(_posixshmem, "shm_open", like_macos)
    monkeypatch.setattr(segments.os, "getuid", lambda: 4294967294)
    assert segments.probe_shm_open()
    assert names and all(len(n) <= segments.SHM_NAME_MAX for n in names)
    assert len(segments.shm_name()) <= segments.SHM_NAME_MAX


def test_where_the_footprint_is_the_measure_shared_pages_count(monkeypatch):
    """macOS has no /proc/self/statm: the watchdog reads the physical
    footprint, which counts the slot pages the daemon touched, so the daemon
    keeps them in its memory ceiling there (kvd.server.daemon._update_ceiling);
    Linux's RssAnon leaves them all out."""
    from kvd.host import memory

    assert memory.rss_counts_shared() is False  # here: statm
    monkeypatch.setattr(memory, "_STATM", -1)  # what rss_bytes() leaves where there is no /proc
    assert memory.rss_counts_shared() is True
