"""What the kvd commands share: their settings, the admin client, the data
dir an offline command reads, and how sizes and times are shown.

Settings: every command that reaches a daemon or a data dir takes
`--endpoint`, `--timeout` and `--data-dir` (and `--config`) from the one
settings table (kvd.config), so each resolves like `kvd serve` does:
default < config file < KVD_* environment < flag.

Offline commands (`verify`, `stats --offline`, `ls --offline`) read the data
dir of the daemon that is running, when one answers -- its STATS reply names
it (`server.data_dir`) -- unless `--data-dir` is given; with no daemon they
read the configured one. They always say which folder they read, and why.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Mapping, NoReturn

import click

from kvd.config import Config, config_options, resolve

if TYPE_CHECKING:
    from kvd_client import Client

#: `--config`, `--endpoint`, `--timeout`: for commands that talk to a daemon.
daemon_options = config_options(names=("endpoint", "timeout", "keys_dir", "client_key"))
#: ... and `--data-dir`: for commands that may read the data dir themselves.
data_dir_options = config_options(names=("endpoint", "timeout", "data_dir", "keys_dir", "client_key"))


def settings(flags: Mapping[str, Any]) -> Config:
    """The resolved settings for a command's flags (ConfigError: exit 78)."""
    return resolve(flags)


def admin_client(cfg: Config) -> Client:
    """A strict client on the configured endpoint: failures raise (and map to exit codes)."""
    from kvd_client import Client

    return Client(cfg.endpoint, namespace="kvd-admin", timeout=cfg.timeout, strict=True,
                  keys_dir=cfg.keys_dir, client_key=cfg.client_key)


def fail(code: int, message: str) -> NoReturn:
    """Print `kvd: message` on stderr and exit with `code`."""
    click.echo(f"kvd: {message}", err=True)
    raise SystemExit(code)


def daemon_data_dir(cfg: Config) -> tuple[bool, str | None]:
    """(a daemon answered, its data dir or None if it keeps RAM only), asked with one STATS."""
    from kvd_client import DaemonUnavailable

    with admin_client(cfg) as client:
        try:
            stats = client.stats()
        except DaemonUnavailable:
            return False, None
    return True, (stats.get("server") or {}).get("data_dir")


def data_dir_to_read(cfg: Config) -> str | None:
    """The data dir an offline command reads (see module docstring); says which on stderr."""
    source = cfg.sources["data_dir"]
    if source.startswith("flag:"):
        path, why = cfg.data_dir, source
    else:
        answered, theirs = daemon_data_dir(cfg)
        if answered and theirs:
            path, why = theirs, f"the data dir of the daemon at {cfg.endpoint}"
        elif answered:
            path, why = cfg.data_dir, f"{source}; the daemon at {cfg.endpoint} keeps RAM only"
        else:
            path, why = cfg.data_dir, f"{source}; no daemon answers at {cfg.endpoint}"
    click.echo(f"kvd: reading {path or 'no data dir'} ({why})", err=True)
    return path


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def ago(ts: float) -> str:
    if not ts:
        return "-"
    s = max(0.0, time.time() - ts)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.0f}{unit} ago"
    return f"{s:.0f}s ago"


def rate(hits: int, misses: int) -> str:
    return f"{100 * hits / (hits + misses):.1f}%" if hits + misses else "-"
