"""Per-user folders: where kvd's config, cache (the data dir) and sockets live,
and how long a socket's path may be.

What each OS gives:

    folder   Linux (XDG base directories)              macOS
    config   $XDG_CONFIG_HOME/kvd, else ~/.config/kvd  ~/Library/Application Support/kvd
    cache    $XDG_CACHE_HOME/kvd, else ~/.cache/kvd    ~/Library/Caches/kvd
    run      $XDG_RUNTIME_DIR/kvd (if it exists),      <cache>/run
             then <cache>/run
    sun_path 108 bytes: paths of 107                   104 bytes: paths of 103

A relative XDG value is invalid and ignored, as the XDG spec says. `environ`
and `platform` default to this process's (tests pass others).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping

MAX_IPC_PATH = 103 if sys.platform == "darwin" else 107


def _home(environ: Mapping[str, str]) -> Path:
    return Path(environ["HOME"]) if environ.get("HOME") else Path.home()


def _xdg(environ: Mapping[str, str], name: str, fallback: Path) -> Path:
    value = environ.get(name) or ""
    return Path(value) if os.path.isabs(value) else fallback


def _folder(environ, platform, mac: tuple[str, ...], xdg: str, fallback: str) -> Path:
    environ = os.environ if environ is None else environ
    home = _home(environ)
    if (platform or sys.platform) == "darwin":
        return home.joinpath("Library", *mac, "kvd")
    return _xdg(environ, xdg, home / fallback) / "kvd"


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
