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

Replies: a daemon's STATS and GC maps are drawn by code that trusts their
shape, yet the process at the endpoint may be a buggy, older or newer kvd.
`shown` and `reply_json` are the one guard: a map that breaks the drawing is one
line and exit 1, never a traceback. A number that is not one draws as "?"
(`size`, `rate`, `ago`, `secs`), so one odd field does not cost the view.

Names come from peers: a namespace is whatever string a client sent, an error's
text whatever the daemon wrote. Text drawn from them goes through `printable`
(in `shown` and `fail`), so escape sequences in a name reach the operator's
terminal as `\x1b`, not as commands to it. JSON output escapes them itself.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, NoReturn

import click

from kvd.cli import exits
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


# C0 controls but newline and tab, DEL, C1 controls, and the bidirectional
# overrides and isolates (which reorder what a terminal shows).
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with every control character but newline and tab as an escape
    (`\x1b`, `\u202e`): safe to write to a terminal whatever a peer named."""
    return _UNPRINTABLE.sub(lambda m: ascii(m.group())[1:-1], text)


def fail(code: int, message: str) -> NoReturn:
    """Print `kvd: message` on stderr and exit with `code`."""
    click.echo(f"kvd: {printable(message)}", err=True)
    raise SystemExit(code)


#: What drawing a map of the wrong shape raises: a missing key, a list where a map
#: was expected, a string formatted as a number, a time past time_t, ...
MALFORMED = (KeyError, TypeError, AttributeError, ValueError, IndexError, OverflowError)


def shown(what: str, render: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`render(*args, **kwargs)` of the daemon's `what` reply (STATS, GC), or exit 1
    with one line if the reply's map breaks it. Text comes back `printable`."""
    try:
        out = render(*args, **kwargs)
        return printable(out) if isinstance(out, str) else out
    except MALFORMED as err:
        fail(exits.FAILED, f"the daemon sent a malformed {what} reply ({type(err).__name__}: {err}); "
                           "is it another version of kvd?")


def reply_json(what: str, reply: Any) -> str:
    """The daemon's `what` reply as indented JSON; bytes (which JSON has not) as their repr.
    Exits 1 with one line if it cannot be written (keys of mixed types)."""
    return shown(what, json.dumps, reply, indent=2, sort_keys=True, default=repr)


def daemon_data_dir(cfg: Config) -> tuple[bool, str | None]:
    """(a daemon answered, its data dir or None if it keeps RAM only), asked with one STATS."""
    from kvd_client import DaemonUnavailable

    with admin_client(cfg) as client:
        try:
            stats = client.stats()
        except DaemonUnavailable:
            return False, None
    path = shown("STATS", lambda: (stats.get("server") or {}).get("data_dir"))
    if path is not None and not isinstance(path, str):
        fail(exits.FAILED, f"the daemon sent a malformed STATS reply (data_dir {path!r}); is it another version of kvd?")
    return True, path


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


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def secs(s: Any) -> str:
    """`12s`; "?" if `s` is not a number."""
    return f"{s:.0f}s" if _number(s) else "?"


def size(n: float) -> str:
    """`1.5 MiB`; "?" if `n` is not a number."""
    if not _number(n):
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def ago(ts: float) -> str:
    """`3m ago`; "-" for never, "?" if `ts` is not a number."""
    if not ts:
        return "-"
    if not _number(ts):
        return "?"
    s = max(0.0, time.time() - ts)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.0f}{unit} ago"
    return f"{s:.0f}s ago"


def quota_table(quotas: dict) -> list[str]:
    """The quota table `kvd ls` and `kvd top` both draw from STATS' "quotas":
    per `[quota]` pattern, the namespaces it holds, RAM and SSD use against
    the quota ("-" for a tier it does not bound) and what it evicted from
    each. Its lines after a blank one; none without quotas."""
    if not quotas:
        return []

    def against(used: int, quota: int | None) -> str:
        if quota is None:
            return "-"
        return f"{size(used)} / {size(quota)} ({100 * used / quota:.0f}%)" if quota else f"{size(used)} / 0"

    lines = ["", f"{'quota':<30}{'namespaces':>11}  {'ram used / quota':<30}{'ssd used / quota':<30}{'evicted ram/ssd':>16}"]
    for pattern, q in quotas.items():
        lines.append(
            f"{pattern[:28]:<30}{q['namespaces']:>11}  {against(q['ram_bytes'], q['ram_quota_bytes']):<30}"
            f"{against(q['ssd_bytes'], q['ssd_quota_bytes']):<30}{q['ram_evictions']:>8}/{q['ssd_evictions']:<7}"
        )
    return lines


def rate(hits: int, misses: int) -> str:
    """Hits as a share of lookups: `87.5%`; "-" with none, "?" if either is not a number."""
    if not (_number(hits) and _number(misses)):
        return "?"
    return f"{100 * hits / (hits + misses):.1f}%" if hits + misses else "-"


def finite(ctx, param, value):
    """A click callback: click's FloatRange lets nan through (every comparison with it is false)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number.")
    return value
