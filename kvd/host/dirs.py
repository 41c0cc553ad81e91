"""Per-user folders: where kvd's config, cache (the data dir) and sockets live,
and how long a socket's path may be.

What each OS gives:

    folder   Linux (XDG base directories)              macOS
    config   $XDG_CONFIG_HOME/kvd, else ~/.config/kvd  ~/Library/Application Support/kvd
    cache    $XDG_CACHE_HOME/kvd, else ~/.cache/kvd    ~/Library/Caches/kvd
    run      $XDG_RUNTIME_DIR/kvd (if it exists),      <cache>/run
             then <cache>/run
    sun_path 108 bytes: paths of 107                   104 bytes: paths of 103
    symlinks fs.protected_symlinks (often on) refuses  nothing refuses them: kvd checks
             to follow another user's link in a        itself (`planted`), the same rule
             sticky folder (/tmp)                      on both

A relative XDG value is invalid and ignored, as the XDG spec says. `environ`
and `platform` default to this process's (tests pass others).
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from pathlib import Path
from typing import Mapping

MAX_IPC_PATH = 103 if sys.platform == "darwin" else 107


def _no_home(why: str) -> OSError:
    """No home folder to put kvd's folders in: an environment fault (a plain
    OSError, ENOENT: kvd's commands say it in one line, exit 1)."""
    return OSError(errno.ENOENT, f"{why}; set HOME, or XDG_CONFIG_HOME and XDG_CACHE_HOME")


def _home(environ: Mapping[str, str]) -> Path:
    home = environ.get("HOME")
    if home:
        if not os.path.isabs(home):
            raise _no_home(f"no home folder: HOME={home!r} is not an absolute path")
        return Path(home)
    try:
        return Path.home()
    except (RuntimeError, KeyError):  # no HOME, no passwd entry (a container run as `-u N`)
        raise _no_home(f"no home folder: HOME is unset and uid {os.getuid()} has no passwd entry") from None


def home_folder(environ: Mapping[str, str] | None = None) -> Path:
    """This user's home folder (HOME, else the passwd entry); OSError (ENOENT) if none."""
    return _home(os.environ if environ is None else environ)


def _folder(environ, platform, mac: tuple[str, ...], xdg: str, fallback: str) -> Path:
    """The folder; OSError (ENOENT) if it needs a home folder there is none of."""
    environ = os.environ if environ is None else environ
    if (platform or sys.platform) == "darwin":
        return _home(environ).joinpath("Library", *mac, "kvd")
    value = environ.get(xdg) or ""
    if os.path.isabs(value):  # (the home folder is not needed then)
        return Path(value) / "kvd"
    return _home(environ) / fallback / "kvd"


def config_dir(environ: Mapping[str, str] | None = None, platform: str | None = None) -> Path:
    """The per-user config folder (kvd.toml, keys/)."""
    return _folder(environ, platform, ("Application Support",), "XDG_CONFIG_HOME", ".config")


def cache_dir(environ: Mapping[str, str] | None = None, platform: str | None = None) -> Path:
    """The per-user cache folder: the default data dir."""
    return _folder(environ, platform, ("Caches",), "XDG_CACHE_HOME", ".cache")


def run_dirs(environ: Mapping[str, str] | None = None, platform: str | None = None) -> list[Path]:
    """The per-user folders a socket may live in, the preferred first (before
    any check of their length or owner: kvd.endpoint rules 3 and 5)."""
    environ = os.environ if environ is None else environ
    dirs: list[Path] = []
    if (platform or sys.platform) != "darwin":
        runtime = environ.get("XDG_RUNTIME_DIR")
        if runtime and os.path.isabs(runtime) and os.path.isdir(runtime):
            dirs.append(Path(runtime) / "kvd")
    dirs.append(cache_dir(environ, platform) / "run")
    return dirs


def planted(path: str | os.PathLike) -> int | None:
    """The uid of a symlink at `path` this process should not follow, or None:
    Linux's protected_symlinks rule, kept by kvd itself (macOS has none). A
    link of this user, of root, or of the owner of the folder it is in (a link
    in alice's home is hers to make) is followed; one another user planted in
    a shared folder (/tmp) would have kvd write, chmod and fill whatever it
    names. None too where `path` is not a symlink or cannot be looked at."""
    try:
        st = os.lstat(path)
        if not stat.S_ISLNK(st.st_mode) or st.st_uid in (os.getuid(), 0):
            return None
        if os.lstat(os.path.dirname(os.path.abspath(path))).st_uid == st.st_uid:
            return None
    except OSError:
        return None
    return st.st_uid
