"""kvd's settings: one table, four sources, one resolution rule.

Why one module of ~650 lines: it is the one settings table (SETTINGS) and the
parsers its rows name; every command reads both, and the table is what
docs/configuration.md is checked against.

Theory of operation
-------------------
Every setting is a row of `SETTINGS`: its name, how to parse it, its default,
and the documentation that `--help`, `kvd config` and the tests all read. The
environment variable (`KVD_<NAME>`) and the command-line flag (`--<name>`) are
derived from the name, never spelled twice.

`resolve()` looks at four sources and the last one that sets a value wins:

    default  <  config file (TOML)  <  environment  <  command-line flag

Rules it keeps:
1. A flag whose value is None is unset (click passes None for flags not given).
2. Every value, whatever its source, goes through the row's parser; a bad one
   raises `ConfigError` naming the setting and the source it came from.
3. The config file is `--config`, else `$KVD_CONFIG`, else the per-user
   default path. A file named explicitly must exist; the default one need not.
4. Unknown keys in the file are errors (a typo must not silently do nothing).
5. Defaults that depend on the machine (endpoint, data_dir) are computed only
   when no source sets the value, so a broken default never hides a good value.
6. A few settings are TOML tables, read from the config file only (`TABLES`):
   `[quota."pattern"]` rows (kvd/store/quota.py). `Config.<table>` is their
   parsed value; `kvd config` prints them back.
7. Whatever a config file holds -- not UTF-8, nested a thousand deep, a FIFO,
   /dev/zero -- reading it gives a dict or one ConfigError, never a hang or
   a traceback. A setting may also `check` its final value against the
   machine (`log_file` must be a file whose folder exists).
"""

from __future__ import annotations

import math
import os
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from kvd.host.dirs import config_dir, planted
from kvd.endpoint import EndpointError, check_endpoint, default_endpoint, default_keys_dir, file_kind
from kvd.protocol.errors import KvdError

_NONE_WORDS = ("", "none", "off", "null")
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class ConfigError(KvdError, ValueError):
    """A setting has a bad value, or the config file cannot be used."""

    name = "CONFIG"


# --- parsers: each takes a raw value (str from env/flag, typed from TOML) and
# returns the typed value or raises ValueError with a short reason. -------------


# Bounds of the sizes and durations: past them a value is a typo, and byte
# counts past 2**63 no longer fit the wire's integers (STATS, GC) or the
# store's arithmetic; seconds past ~11 days overflow poll and lock timeouts.
MAX_MB = 1 << 40  # MiB settings: 2**60 bytes
MAX_GB = 1 << 30  # GiB settings: 2**60 bytes
MAX_KB = 1 << 30  # KiB settings: 2**40 bytes
MAX_SECONDS = 1e6


def _short(raw: Any) -> str:
    """repr of a raw value, cut short (an integer of 400 digits is not an error message)."""
    text = repr(raw) if not isinstance(raw, int) or abs(raw) < 10**30 else f"an integer of {len(str(abs(raw)))} digits"
    return text if len(text) <= 60 else text[:57] + "..."


def _int(minimum: int = 0, maximum: int | None = None) -> Callable[[Any], int]:
    def parse(raw: Any) -> int:
        if isinstance(raw, bool):
            raise ValueError("expected an integer, got a boolean")
        if isinstance(raw, float):
            if not raw.is_integer():
                raise ValueError(f"expected an integer, got {raw!r}")
            raw = int(raw)
        if not isinstance(raw, int):
            try:
                raw = int(str(raw).strip())
            except ValueError:
                raise ValueError(f"expected an integer, got {raw!r}") from None
        value = raw
        if value < minimum or (maximum is not None and value > maximum):
            hi = "" if maximum is None else f" and <= {maximum}"
            raise ValueError(f"must be >= {minimum}{hi}, got {_short(value)}")
        return value

    parse.kind = "int"  # type: ignore[attr-defined]
    return parse


def _float(minimum: float = 0.0, *, exclusive: bool = False, maximum: float | None = None) -> Callable[[Any], float]:
    def parse(raw: Any) -> float:
        if isinstance(raw, bool):
            raise ValueError("expected a number, got a boolean")
        try:
            value = float(str(raw).strip()) if isinstance(raw, str) else float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"expected a number, got {_short(raw)}") from None
        except OverflowError:  # an integer too big for a float (TOML allows any number of digits)
            raise ValueError(f"must be a finite number, got {_short(raw)}") from None
        if not math.isfinite(value):
            raise ValueError(f"must be a finite number, got {_short(raw)}")
        if value < minimum or (exclusive and value == minimum):
            op = ">" if exclusive else ">="
            raise ValueError(f"must be {op} {minimum:g}, got {value:g}")
        if maximum is not None and value > maximum:
            raise ValueError(f"must be <= {maximum:g}, got {value:g}")
        return value

    parse.kind = "float"  # type: ignore[attr-defined]
    return parse


def _bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    word = str(raw).strip().lower()
    if word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    raise ValueError(f"expected true/false (1/0, yes/no, on/off), got {raw!r}")


_bool.kind = "bool"  # type: ignore[attr-defined]


def _str(raw: Any) -> str:
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError(f"expected a non-empty string, got {_short(raw)}")
    _no_nul(raw)
    return raw.strip()


def _no_nul(text: str) -> None:
    # No path, name or URL the OS is handed can hold one: open() and bind()
    # would fail far from here, with a traceback.
    if "\0" in text:
        raise ValueError(f"must not contain a NUL character, got {_short(text)}")


_str.kind = "str"  # type: ignore[attr-defined]


def _endpoint(raw: Any) -> str:
    try:
        return check_endpoint(_str(raw))
    except EndpointError as exc:
        raise ValueError(exc.message) from None


_endpoint.kind = "str"  # type: ignore[attr-defined]


def _log_level(raw: Any) -> str:
    value = _str(raw).lower()
    if value not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}, got {raw!r}")
    return value


_log_level.kind = "choice"  # type: ignore[attr-defined]


def _host(raw: Any) -> str:
    value = _str(raw).lower()
    if value not in ("auto", "portable"):  # kvd.host.select.HOSTS
        raise ValueError(f"expected auto or portable, got {raw!r}")
    return value


_host.kind = "host"  # type: ignore[attr-defined]


def _optional_path(raw: Any) -> str | None:
    """A path, or None for "" / "none" / "off". `~` is expanded; relative
    paths are made absolute by `resolve` (against the file's folder for values
    from the config file, else against the working directory)."""
    if raw is None:
        return None
    if not isinstance(raw, (str, os.PathLike)):
        raise ValueError(f"expected a path or \"none\", got {raw!r}")
    text = os.fspath(raw).strip()
    if isinstance(text, bytes):
        raise ValueError(f"expected a path or \"none\", got {_short(raw)}")
    if text.lower() in _NONE_WORDS:
        return None
    _no_nul(text)
    return os.path.expanduser(text)


_optional_path.kind = "path"  # type: ignore[attr-defined]


def _log_file_usable(path: str | None) -> None:
    """`log_file`, once absolute: a file `kvd serve` can open for appending
    (or create), so a bad one is a configuration error `kvd config` shows too,
    not a failure at start."""
    if path is None:
        return
    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder; name a file, e.g. {os.path.join(path, 'kvd.log')}")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise ValueError(f"{path}: its folder {folder} does not exist")
    uid = planted(path)
    if uid is not None:  # in a shared folder (/tmp): kvd would append wherever it points
        raise ValueError(f"{path} is a symlink of uid {uid}, not yours")
    try:
        st = os.stat(path)
    except FileNotFoundError:  # (none yet, or a dangling link of ours: the file it names is made)
        return
    except OSError as err:
        raise ValueError(f"{path}: {err.strerror}") from None
    if stat.S_ISFIFO(st.st_mode):
        # Opened for appending, a FIFO nobody reads blocks the start before it
        # binds, silently. One a collector reads is a log like any other.
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))
        except OSError as err:
            raise ValueError(f"{path} is a FIFO nobody reads ({err.strerror})") from None
    elif not (stat.S_ISREG(st.st_mode) or stat.S_ISCHR(st.st_mode)):  # (/dev/stderr, /dev/null: devices)
        raise ValueError(f"{path} is {file_kind(st.st_mode)}, not a file to log to")


def _ram_mb(raw: Any) -> int | str:
    """MiB as an integer >= 1, or "auto" (sized when the daemon starts:
    kvd.server.governor.auto_ram_mb for ram_mb, the RAM tier's budget for
    dirty_max_mb)."""
    if isinstance(raw, str) and raw.strip().lower() == "auto":
        return "auto"
    try:
        return _int(1, MAX_MB)(raw)
    except ValueError as exc:
        raise ValueError(f"{exc} (or \"auto\")") from None


_ram_mb.kind = "int_auto"  # type: ignore[attr-defined]


def _pressure_source(raw: Any) -> str:
    value = _str(raw)
    if value.lower() in ("auto", "off"):
        return value.lower()
    if value.startswith("file:") and len(value) > 5:
        return "file:" + os.path.abspath(os.path.expanduser(value[5:]))
    raise ValueError(f"expected auto, off or file:PATH, got {raw!r}")


_pressure_source.kind = "source"  # type: ignore[attr-defined]


def _remote_url(raw: Any) -> str | None:
    """A redis://, rediss://, valkey://, valkeys:// or unix:// URL, or None
    for "" / "none" / "off". Checked without importing the client library."""
    from kvd.store.remote.url import check  # light: no redis import

    if raw is None or (isinstance(raw, str) and raw.strip().lower() in _NONE_WORDS):
        return None
    return check(_str(raw))


_remote_url.kind = "url"  # type: ignore[attr-defined]


def _redact_url(value: Any) -> Any:
    from kvd.store.remote.url import redact

    return redact(value)


# --- per-user default locations ------------------------------------------------


def _shown_default_config_path() -> str:
    """The default config path for a help text (built when this module is
    imported: it must not fail where there is no home folder)."""
    try:
        return str(default_config_path())
    except OSError as err:
        return f"none ({err})"


def default_config_path(environ: Mapping[str, str] | None = None, platform: str | None = None) -> Path:
    """Return the per-user config file path (which may not exist).

    macOS: ~/Library/Application Support/kvd/kvd.toml;
    elsewhere: $XDG_CONFIG_HOME/kvd/kvd.toml, else ~/.config/kvd/kvd.toml.
    """
    return config_dir(environ, platform) / "kvd.toml"  # kvd/host/dirs.py


def default_data_dir(environ: Mapping[str, str] | None = None, platform: str | None = None) -> str:
    """Return the per-user SSD-tier folder as a string (which may not exist).

    macOS: ~/Library/Caches/kvd; elsewhere $XDG_CACHE_HOME/kvd, else ~/.cache/kvd.
    """
    from kvd.store.datadir import default_data_dir as rule  # the store owns the layout

    return str(rule(environ, platform))


def _default_endpoint(environ: Mapping[str, str]) -> str:
    return default_endpoint(dict(environ))  # kvd.endpoint owns the per-user rule


# --- the table -----------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One row of the settings table."""

    name: str
    parse: Callable[[Any], Any]
    default: Any  # a value, or a callable(environ) -> value computed lazily
    doc: str
    default_doc: str = ""  # how --help describes a computed default
    redact: Callable[[Any], Any] | None = None  # how to show a value that may hold a secret
    # Checks the final value (a path made absolute) against the machine;
    # raises ValueError. Parsers see the raw value only.
    check: Callable[[Any], None] | None = None

    def shown(self, value: Any) -> Any:
        """`value` as `kvd config`, logs and reprs may show it (secrets hidden)."""
        return self.redact(value) if self.redact is not None and value is not None else value

    @property
    def env(self) -> str:
        return "KVD_" + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def kind(self) -> str:
        return getattr(self.parse, "kind", "str")

    def default_value(self, environ: Mapping[str, str]) -> Any:
        return self.default(environ) if callable(self.default) else self.default

    def describe_default(self) -> str:
        if self.default_doc:
            return self.default_doc
        if self.default is None:
            return "none"
        if isinstance(self.default, bool):
            return "true" if self.default else "false"
        return str(self.default)


SETTINGS: tuple[Setting, ...] = (
    Setting("endpoint", _endpoint, _default_endpoint,
            "ZeroMQ endpoint the daemon binds and clients connect to.",
            default_doc="per-user ipc socket"),
    Setting("ram_mb", _ram_mb, 1024,
            "Size of the RAM tier in MiB, or \"auto\": an eighth of the memory the daemon may use "
            "(physical, or its cgroup's limit if lower), 256 MiB to 32 GiB."),
    Setting("ram_floor_mb", _int(0, MAX_MB), 64,
            "Least the RAM tier keeps, in MiB, when it yields to memory pressure."),
    Setting("pressure_source", _pressure_source, "auto",
            "What the RAM tier yields to: \"auto\" (this machine: PSI, MemAvailable, cgroup limits; "
            "macOS: the kernel's pressure level), \"off\", or \"file:PATH\" (a file whose first word "
            "is normal, warn or critical)."),
    Setting("pressure_poll_s", _float(0.0, exclusive=True, maximum=MAX_SECONDS), 1.0,
            "Seconds between memory-pressure samples."),
    Setting("pressure_calm_s", _float(0.0, maximum=MAX_SECONDS), 30.0,
            "Seconds without memory pressure before the RAM tier grows back, a quarter at a time."),
    Setting("data_dir", _optional_path, lambda env: default_data_dir(env),
            "Folder of the SSD tier; \"none\" keeps chunks in RAM only.",
            default_doc="~/Library/Caches/kvd on macOS, $XDG_CACHE_HOME/kvd or ~/.cache/kvd elsewhere"),
    Setting("ssd_gb", _float(0.0, maximum=MAX_GB), 16.0,
            "Size cap of the SSD tier in GiB."),
    Setting("min_free_gb", _float(0.0, maximum=MAX_GB), 2.0,
            "Stop writing to the SSD tier when its disk has less free space than this, in GiB."),
    Setting("write_through", _bool, False,
            "Write every chunk to the SSD tier when it is stored, not only when evicted from RAM."),
    Setting("full_fsync", _bool, False,
            "On macOS, flush the drive's own cache at each sync of a blob file (F_FULLFSYNC): "
            "what a power loss cannot take back, at several times the cost. Off, a sync survives a "
            "crash of kvd or of the OS. Elsewhere fsync already does both: no effect."),
    Setting("spill_queue", _int(1), 256,
            "Most chunks in the SSD writer's queue. In write-back mode more wait in RAM, and a chunk "
            "RAM lets go enters the queue regardless (dirty_max_mb bounds the bytes of both)."),
    Setting("dirty_max_mb", _ram_mb, "auto",
            "Bytes of stored chunks not yet on disk, in MiB, or \"auto\": the RAM tier's budget, at "
            "least 256 MiB. In "
            "write-back mode the most the backlog (what a stop has to write) may hold: past it, or "
            "when a PUT would make it more than a stop can write at the disk's pace, a PUT is answered "
            "BUSY (docs/durability.md); in write-through mode the most that PUTs waiting for their fsync "
            "may hold (past it a PUT is answered BUSY)."),
    Setting("pack_max_kb", _int(0, MAX_KB), 64,
            "Chunks whose blob is at most this many KiB are packed into one LMDB file "
            "(data_dir/pack) instead of a file each: a file costs more to create than a small "
            "chunk costs to write. 0: every chunk its own file."),
    Setting("stop_timeout", _float(0.0, exclusive=True, maximum=MAX_SECONDS), 10.0,
            "Seconds a stop (SIGTERM, `kvd stop`) may take: what is not on disk by then is logged "
            "and lost, and the daemon exits 0. The service files allow a little more."),
    Setting("max_message_mb", _int(1, MAX_MB), 512,
            "Largest message the daemon accepts, in MiB (advertised to clients)."),
    Setting("max_peers", _int(0), 0,
            "Most client connections served at once; past it the longest-idle are shed. "
            "0: derived from the fd limit (raised to its hard limit at start): half of it less 64.",
            default_doc="0 (from the fd limit)"),
    Setting("log_level", _log_level, "info",
            "Log level: " + ", ".join(LOG_LEVELS) + "."),
    Setting("log_file", _optional_path, None,
            "Log to this file instead of stderr (\"none\" = stderr); its folder must exist.",
            default_doc="none (stderr)", check=_log_file_usable),
    Setting("metrics_port", _int(0, 65535), 0,
            "TCP port for Prometheus metrics (0 = off)."),
    Setting("metrics_idle_s", _float(0.0, exclusive=True, maximum=MAX_SECONDS), 10.0,
            "Seconds the metrics exporter lets a connection send or read nothing before it closes it "
            "(a stuck or trickling scraper holds none of its 16 connections longer)."),
    Setting("timeout", _float(0.0, exclusive=True, maximum=MAX_SECONDS), 5.0,
            "Seconds a client, or a kvd command, waits for one request's answer."),
    Setting("chunk_tokens", _int(1), 256,
            "Tokens per cached chunk (prefixes are matched chunk by chunk)."),
    Setting("keys_dir", _optional_path, lambda env: str(default_keys_dir(dict(env))),
            "Folder of the CURVE key files a tcp:// endpoint needs (made by `kvd keys`).",
            default_doc="keys/ beside the config file: ~/.config/kvd/keys, ~/Library/Application Support/kvd/keys"),
    Setting("client_key", _str, "default",
            "Name of the client key pair (in keys_dir/clients) a client presents on a tcp:// endpoint."),
    Setting("allow_insecure_tcp", _bool, False,
            "Serve a tcp:// endpoint without CURVE keys, unauthenticated (logged as a warning, shown by `kvd stats`)."),
    Setting("shm", _bool, True,
            "Offer the shared-memory data plane to clients of an ipc:// endpoint on this host "
            "(segments in <socket>.shm/; tcp:// never gets it)."),
    Setting("shm_lease_s", _float(0.0, exclusive=True, maximum=MAX_SECONDS), 30.0,
            "Seconds a client may hold shared-memory slots it was handed before they are reclaimed."),
    Setting("shm_warm_mb", _int(0, MAX_MB), 4096,
            "MiB of shared memory the daemon makes ready in the background from its start, before any put, "
            "so a new daemon's first puts run at a warm one's rate: at most the RAM tier's budget and a segment, and a "
            "quarter of the memory available (a tight memory cgroup gets less or none); 0: none before the first put."),
    Setting("host", _host, "auto",
            "Developer setting: \"portable\" makes the daemon use only the POSIX mechanisms macOS runs "
            "(shm_open segments instead of memfds, open fds from /dev/fd, no accept() patch, no PSI), so Linux CI exercises macOS's code; \"auto\": this "
            "OS's best. `kvd stats --json` names each concern's mechanism (section `host`)."),
    Setting("gc_on_tick", _bool, True,
            "Collect cyclic garbage on the daemon's tick and freeze what survives, so no request waits for a "
            "scan of the whole RAM tier (false: CPython's own collector)."),
    Setting("remote_url", _remote_url, None,
            "Shared remote tier behind RAM and SSD: redis://[user:password@]host:port[/db], rediss:// (TLS; "
            "ssl_* query parameters go to the client), valkey://, valkeys://, unix://PATH; \"none\" = off. "
            "Never printed with its password.",
            default_doc="none (off)", redact=_redact_url),
    Setting("remote_key_file", _optional_path, None,
            "File of the secret the daemons sharing a remote tier sign and check its values with: 64 hex digits, "
            "mode 0600 (`kvd keys remote` makes one; copy it to every daemon of the tier). Never sent to the server.",
            default_doc="remote.key in keys_dir"),
    Setting("remote_ca_file", _optional_path, None,
            "CA certificates (PEM) a rediss:// remote's certificate must chain to (default: the system's).",
            default_doc="none (the system's CAs)"),
    Setting("remote_ttl_s", _int(0), 0,
            "Seconds each remote key lives (0 = until the server's maxmemory-policy evicts it)."),
    Setting("remote_timeout_s", _float(0.0, exclusive=True, maximum=MAX_SECONDS), 0.5,
            "Seconds a read of the remote may take in all (a batch, however its bytes trickle in) before the tier is marked degraded."),
    Setting("remote_part_mb", _int(1, 512), 32,
            "Largest remote value in MiB; bigger entries are split into parts."),
    Setting("remote_backlog_mb", _int(1, MAX_MB), 1024,
            "Most MiB of entries waiting to be written to the remote (the oldest are dropped past it); "
            "keep it above the largest PUT (max_message_mb)."),
    Setting("remote_batch", _int(1), 32,
            "Entries written to the remote per pipelined batch."),
    Setting("remote_cluster", _bool, False,
            "The remote is a Redis/Valkey Cluster: remote_url names any node, the others and the slot map are "
            "discovered; a node that fails or moves a slot costs misses, never errors."),
    Setting("remote_read_replicas", _bool, True,
            "On a cluster, a read whose primary does not answer is asked of that slot's replicas (READONLY; a "
            "lagging replica gives misses, never wrong bytes); false = reads on primaries only."),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def _quota_table(raw: Any) -> Any:
    from kvd.store.quota import Quotas  # light: no store machinery is imported

    return Quotas.from_table(raw)


# File-only settings that are TOML tables: name -> parser (raw table or {} -> value).
TABLES: dict[str, Callable[[Any], Any]] = {"quota": _quota_table}
CONFIG_ENV = "KVD_CONFIG"


class Config:
    """The resolved settings: one attribute per setting, plus

    - `sources`: setting name -> "default" | "file:<path>" | "env:KVD_X" | "flag:--x"
    - `config_path`: the config file that was read, or None.
    """

    __slots__ = ("_values", "sources", "config_path", "tables")

    def __init__(
        self, values: dict[str, Any], sources: dict[str, str], config_path: Path | None, tables: dict[str, Any] | None = None
    ):
        self._values = dict(values)
        self.sources = dict(sources)
        self.config_path = config_path
        self.tables = {name: parse({}) for name, parse in TABLES.items()} if tables is None else dict(tables)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            pass
        try:
            return self.tables[name]
        except KeyError:
            raise AttributeError(f"no setting named {name!r}") from None

    def as_dict(self) -> dict[str, Any]:
        """Return {setting name: value} in table order."""
        return dict(self._values)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={BY_NAME[k].shown(v)!r}" for k, v in self._values.items())
        return f"Config({inner})"


# TOML has types: a file value must already be of its setting's type.
_TOML_TYPES = {
    "int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "choice": (str,), "path": (str,),
    "int_auto": (int, str), "source": (str,), "url": (str,), "host": (str,),
}


def _parse(setting: Setting, raw: Any, source: str, base_dir: Path | None = None) -> Any:
    if source.startswith("file:"):
        want = _TOML_TYPES.get(setting.kind, (str,))
        if not isinstance(raw, want) or (isinstance(raw, bool) and bool not in want):
            names = " or ".join({int: "integer", float: "float", bool: "boolean", str: "string"}[t] for t in want)
            raise ConfigError(f"{setting.name} (from {source}): expected a TOML {names}, got {raw!r}")
        if setting.kind == "int_auto" and isinstance(raw, str) and raw.strip().lower() != "auto":
            raise ConfigError(f"{setting.name} (from {source}): expected a TOML integer or \"auto\", got {raw!r}")
    try:
        value = setting.parse(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{setting.name} (from {source}): {exc}") from None
    if setting.kind == "path" and value is not None and not os.path.isabs(value):
        value = os.path.abspath(os.path.join(base_dir or os.getcwd(), value))
    if setting.check is not None:
        try:
            setting.check(value)
        except ValueError as exc:
            raise ConfigError(f"{setting.name} (from {source}): {exc}") from None
    return value


# A config file is a few hundred bytes; past this it is not one (or it is
# /dev/zero), and it is not read whole.
MAX_CONFIG_BYTES = 1 << 20


def _read_file(path: Path) -> dict[str, Any]:
    # Rule 7: whatever the file holds, reading it ends in a dict or one
    # ConfigError. Opened non-blocking so a FIFO cannot hang `kvd serve`,
    # and only a regular file of at most MAX_CONFIG_BYTES is read.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"config file {path}: is {file_kind(st.st_mode)}, not a file")
            if st.st_size > MAX_CONFIG_BYTES:
                raise ConfigError(f"config file {path}: {st.st_size} bytes, more than a config file "
                                  f"may be ({MAX_CONFIG_BYTES} bytes)")
            raw = os.read(fd, MAX_CONFIG_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"config file {path}: not valid TOML: not UTF-8 (byte {raw[exc.start]:#04x} on line {line})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses once per level of [ or {
        raise ConfigError(f"config file {path}: not valid TOML for kvd: arrays or tables nested too deeply") from None
    except ValueError as exc:  # an integer of more digits than int() converts (4,300)
        raise ConfigError(f"config file {path}: not valid TOML for kvd: {str(exc).split(';')[0][:120]}") from None
    unknown = sorted(set(data) - set(BY_NAME) - set(TABLES))
    if unknown:
        raise ConfigError(
            f"config file {path}: unknown setting(s) {', '.join(unknown)}; "
            f"known: {', '.join([*BY_NAME, *TABLES])}"
        )
    return data


def find_config_file(
    config_path: str | os.PathLike | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[Path | None, str]:
    """Return (path to read or None, how it was chosen: "flag"|"env"|"default").

    Raises ConfigError when a file named by flag or env does not exist.
    """
    environ = os.environ if environ is None else environ
    if config_path is not None and os.fspath(config_path) != "":
        path, how = Path(os.path.expanduser(os.fspath(config_path))), "flag"
    elif environ.get(CONFIG_ENV):
        path, how = Path(os.path.expanduser(environ[CONFIG_ENV])), "env"
    else:
        path = default_config_path(environ)
        return (path if path.is_file() else None), "default"
    where = "--config" if how == "flag" else f"${CONFIG_ENV}"
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise ConfigError(f"config file {path} (from {where}) does not exist") from None
        raise ConfigError(f"config file {path} (from {where}): cannot read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise ConfigError(f"config file {path} (from {where}) is {file_kind(mode)}, not a file")
    return path, how


def resolve(
    flags: Mapping[str, Any] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    config_path: str | os.PathLike | None = None,
) -> Config:
    """Resolve every setting from default < file < env < flag.

    `flags` maps setting names to values (e.g. a click command's kwargs); None
    values and names that are not settings are ignored, except "config", which
    is used as `config_path` when that is not given.

    Returns a `Config`. Raises `ConfigError` for a bad value (naming the
    setting and its source), an unreadable or invalid config file, or an
    explicitly named config file that does not exist.
    """
    environ = os.environ if environ is None else environ
    flags = dict(flags or {})
    if config_path is None:
        config_path = flags.get("config")
    path, _ = find_config_file(config_path, environ)
    file_values = _read_file(path) if path is not None else {}

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for s in SETTINGS:
        if flags.get(s.name) is not None:
            values[s.name] = _parse(s, flags[s.name], f"flag:{s.flag}")
            sources[s.name] = f"flag:{s.flag}"
        elif s.env in environ:
            values[s.name] = _parse(s, environ[s.env], f"env:{s.env}")
            sources[s.name] = f"env:{s.env}"
        elif s.name in file_values:
            src = f"file:{path}"
            values[s.name] = _parse(s, file_values[s.name], src, base_dir=path.parent)
            sources[s.name] = src
        else:
            try:
                raw = s.default_value(environ)
            except Exception as exc:  # a machine-dependent default could not be computed
                raise ConfigError(f"{s.name} (from default): cannot compute the default: {exc}") from exc
            values[s.name] = _parse(s, raw, "default") if raw is not None else None
            sources[s.name] = "default"
    tables = {}
    for name, parse in TABLES.items():
        try:
            tables[name] = parse(file_values.get(name, {}))
        except ValueError as exc:
            raise ConfigError(f"{name} (from file:{path}): {exc}") from None
    return Config(values, sources, path, tables)


def config_options(command: Callable | None = None, *, names: tuple[str, ...] | None = None) -> Callable:
    """Decorator adding `--config` and one click option per setting (only the
    settings in `names`, if given: `@config_options(names=("endpoint", "timeout"))`).

    Every option defaults to None (unset), so `resolve(kwargs)` can tell a flag
    given on the command line from one left out. Help text comes from the table.
    """
    if command is None:
        return lambda fn: config_options(fn, names=names)
    import click  # the CLI's dependency; the daemon core need not import it

    unknown = set(names or ()) - set(BY_NAME)
    if unknown:
        raise ValueError(f"no such setting(s): {', '.join(sorted(unknown))}")
    rows = SETTINGS if names is None else tuple(s for s in SETTINGS if s.name in names)
    for s in reversed(rows):
        help_text = f"{s.doc} [env: {s.env}; default: {s.describe_default()}]"
        if s.kind == "bool":
            decl = f"{s.flag}/--no-{s.flag[2:]}"
            command = click.option(decl, s.name, default=None, help=help_text)(command)
            continue
        click_type = {
            "int": click.INT,
            "float": click.FLOAT,
            "choice": click.Choice(LOG_LEVELS, case_sensitive=False),
        }.get(s.kind, click.STRING)
        metavar = {"path": "PATH|none", "int_auto": "MIB|auto", "source": "auto|off|file:PATH", "url": "URL|none", "host": "auto|portable"}.get(s.kind)
        command = click.option(
            s.flag, s.name, type=click_type, default=None, metavar=metavar, help=help_text
        )(command)
    return click.option(
        "--config",
        "config",
        type=click.Path(dir_okay=False),
        default=None,
        help=f"TOML config file [env: {CONFIG_ENV}; default: {_shown_default_config_path()}]",
    )(command)


